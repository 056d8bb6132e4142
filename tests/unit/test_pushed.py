"""A pass's pushed files: each told push stands for the untold ones after it (core/pushed.py)."""

import random

import pytest

from bucketfs.core.pushed import PushedFiles

pytestmark = pytest.mark.timeout(30)


def pushes(pushed: PushedFiles, inos, size_bytes=100, every=4) -> list:
    """Push `inos` in order as a pass does; the told ones."""
    told = []
    for ino in inos:
        tell = pushed.next_is_told()
        pushed.add(ino, size_bytes, tell, every)
        if tell:
            told.append(ino)
    return told


def test_a_told_files_open_counts_its_stratum_and_an_untold_one_seen_later_is_not_counted_twice():
    pushed = PushedFiles()
    assert pushes(pushed, range(1, 9)) == [1, 5]
    assert pushed.held_bytes == 800
    assert pushed.opened(1) == (4, 400)  # (1 and the 3 untold after it)
    assert pushed.held_bytes == 400
    assert pushed.opened(2) == (0, 0)  # (a READ of one of those: already counted)
    assert pushed.opened(6) == (1, 100)  # (seen before its told file: counted alone)
    assert pushed.opened(5) == (3, 300)
    assert pushed.held_bytes == 0 and pushed.end() == (0, 0)


def test_a_failed_told_push_hands_its_stratum_to_the_next_told_one():
    pushed = PushedFiles()
    pushes(pushed, [1, 2, 3])
    assert pushed.failed(1) == (True, (0, 0))
    assert pushed.next_is_told()  # (no told file stands for 2 and 3 now)
    assert pushes(pushed, [4, 5]) == [4]
    assert pushed.opened(4) == (4, 400)  # (2, 3, 4 and 5)
    assert pushed.end() == (0, 0)


def test_a_push_that_fails_after_its_stratum_was_counted_is_uncounted():
    pushed = PushedFiles()
    pushes(pushed, [1, 2, 3])
    assert pushed.opened(1) == (3, 300)
    assert pushed.failed(3) == (True, (1, 100))
    assert pushed.failed(99) == (False, (0, 0))


def test_what_the_pass_never_heard_of_is_unused_at_its_end():
    pushed = PushedFiles()
    pushes(pushed, range(1, 13))  # strata of 1, 5, 9
    pushed.opened(5)
    assert pushed.end() == (8, 800)
    assert not pushed and pushed.held_bytes == 0


@pytest.mark.parametrize("seed", range(20))
def test_every_push_is_counted_once_opened_or_unused_whatever_happens(seed):
    rng = random.Random(seed)
    pushed = PushedFiles()
    sizes, counted_files, counted_bytes, failed_files, failed_bytes, seen = {}, 0, 0, 0, 0, set()
    for ino in range(1, 400):
        size_bytes = rng.randrange(1, 1000)
        sizes[ino] = size_bytes
        tell = pushed.next_is_told()
        pushed.add(ino, size_bytes, tell, rng.choice([1, 3, 8]))
        for _ in range(rng.randrange(3)):
            other = rng.randrange(1, ino + 1)
            if other in seen:
                continue
            seen.add(other)
            if rng.random() < 0.1:
                ours, (files, nbytes) = pushed.failed(other)
                assert ours
                counted_files -= files
                counted_bytes -= nbytes
                failed_files += 1
                failed_bytes += sizes[other]
            else:
                files, nbytes = pushed.opened(other)
                counted_files += files
                counted_bytes += nbytes
        assert pushed.held_bytes >= 0
    unused_files, unused_bytes = pushed.end()
    assert counted_files + unused_files + failed_files == len(sizes)
    assert counted_bytes + unused_bytes + failed_bytes == sum(sizes.values())
