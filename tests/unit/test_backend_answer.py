"""base.check_answer: what a ranged GET's answer of the pinned version must satisfy,
and which of its failures BlockingCaller retries (in the worker thread)."""

import pytest
import trio

from bucketfs import errors
from bucketfs.backends.base import ShortBody, check_answer
from bucketfs.backends.calls import BlockingCaller, RetryPolicy


def test_an_answer_with_fewer_bytes_than_its_range_is_short():
    with pytest.raises(ShortBody):
        check_answer("k", 100, 200, 90, "bytes 100-189/1000", 1000)
    check_answer("k", 100, 200, 100, "bytes 100-199/1000", 1000)
    # A range past the object's end is clipped at its size: 50 bytes are all of it.
    check_answer("k", 950, 1100, 50, "bytes 950-999/1000", 1000)
    with pytest.raises(ShortBody):
        check_answer("k", 950, 1100, 49, "bytes 950-998/1000", 1000)
    check_answer("k", 100, 200, None, "bytes 100-189/1000", 1000)  # (None: not checked)


def test_an_answer_for_an_object_of_another_size_is_a_changed_object():
    with pytest.raises(errors.ObjectChanged):
        check_answer("k", 0, 100, 100, "bytes 0-99/999", 1000)
    with pytest.raises(errors.ObjectChanged):
        check_answer("k", 0, 100, None, "bytes 0-99/999", 1000)
    check_answer("k", 0, 100, 100, "bytes 0-99/999", None)  # no size to compare with
    check_answer("k", 100, 200, None, "bytes */1000", 1000)  # (a 416 names no range)


def test_a_short_answer_is_short_before_its_size_is_compared():
    """Retried first: its retry may answer with the pinned size."""
    with pytest.raises(ShortBody):
        check_answer("k", 0, 100, 10, "bytes 0-9/999", 1000)


def test_a_range_answered_from_another_offset_is_not_served():
    with pytest.raises(errors.BackendError):
        check_answer("k", 100, 200, 100, "bytes 0-99/1000", 1000)
    check_answer("k", 100, 200, 100, "bytes 100-199/1000", 1000)


def test_a_whole_object_answer_without_content_range_is_not_checked():
    """A server that ignores Range: the caller kept the range of the whole object, which
    holds what there is of it (here the 50 bytes before its end)."""
    check_answer("k", 950, 1100, 50, None, 1000)
    check_answer("k", 950, 1100, 50, "", 1000)


def _attempts(raising, policy_attempts_count=3):
    """How many times BlockingCaller ran a call that raises `raising` (then the error)."""
    attempts = []

    def get():
        attempts.append(1)
        raising()

    def classify(exc):
        return errors.TransientError(str(exc)) if isinstance(exc, ConnectionError) else errors.BackendError(str(exc))

    caller = BlockingCaller(1, RetryPolicy(policy_attempts_count, 0.0, 0.0), classify)
    with pytest.raises(errors.BucketfsError) as caught:
        trio.run(caller.call, "GET", get)
    return len(attempts), caught.value


def test_in_the_worker_a_short_answer_is_retried_and_a_changed_size_is_not():
    count, error = _attempts(lambda: check_answer("k", 0, 100, 10, "bytes 0-9/100", 100))
    assert (count, type(error)) == (3, errors.TransientError)
    count, error = _attempts(lambda: check_answer("k", 0, 100, 100, "bytes 0-99/999", 100))
    assert (count, type(error)) == (1, errors.ObjectChanged)
    assert not issubclass(ShortBody, errors.BucketfsError)
