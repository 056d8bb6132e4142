"""What a read is pinned to on each kind of store (bucketfs/backends/versions.py)."""

import logging

import pytest

from bucketfs import errors
from bucketfs.backends import versions
from bucketfs.backends.base import ObjectInfo

NS = 10**9


def test_the_version_is_the_etag_else_the_listed_second_else_nothing():
    assert versions.of_s3('"d41d8cd98f00b204e9800998ecf8427e"', 5 * NS) == "d41d8cd98f00b204e9800998ecf8427e"
    assert versions.of_s3("e317eb2e70dbf7ad", 5 * NS) == "e317eb2e70dbf7ad"  # XXH3: a version all the same
    assert versions.of_s3('""', 1_700_000_000 * NS + 783_000_000) == "lastmod 1700000000"  # to the second
    assert versions.of_s3("", 0) == versions.UNPINNED == ""
    assert [versions.kind(v) for v in ("abc", "lastmod 12", "")] == [
        versions.ETAG,
        versions.LASTMOD,
        versions.SIZE_ONLY,
    ]


def test_no_etag_can_read_as_a_time_pin():
    """A space is not allowed in an ETag (RFC 9110 etagc): "lastmod 12" can only be ours."""
    assert " " in versions.LASTMOD_PREFIX


def test_conditions_sent_for_each_kind():
    assert versions.condition_headers("abc") == {"If-Match": '"abc"'}
    # The second after the pinned one: a store comparing sub-second times must not refuse
    # an unchanged object listed at 12:00:00.5.
    assert versions.condition_headers("lastmod 0") == {"If-Unmodified-Since": "Thu, 01 Jan 1970 00:00:01 GMT"}
    assert versions.condition_headers("") == {}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Thu, 01 Jan 1970 00:00:01 GMT", 1),
        ("Fri, 27 Nov 2026 07:23:40 GMT", 1795764220),
        (None, None),
        ("", None),
        ("not a date", None),
    ],
)
def test_http_dates(text, expected):
    assert versions.http_date_s(text) == expected


def test_answers_are_checked_as_their_pin_says(caplog):
    checks = versions.AnswerChecks("s3://b")
    checks.check("k", "abc", '"abc"', None)
    with pytest.raises(errors.ObjectChanged):
        checks.check("k", "abc", '"abd"', None)
    # Last-Modified: the same second or earlier is the pinned version; a later one is not.
    checks.check("k", "lastmod 100", "", "Thu, 01 Jan 1970 00:01:40 GMT")
    checks.check("k", "lastmod 100", "", "Thu, 01 Jan 1970 00:01:00 GMT")
    checks.check("k", "lastmod 100", "", None)  # (nothing stated: the size decides)
    with pytest.raises(errors.ObjectChanged, match="last modified"):
        checks.check("k", "lastmod 100", "", "Thu, 01 Jan 1970 00:01:41 GMT")
    checks.check("k", "", "anything", "Fri, 27 Nov 2026 07:23:40 GMT")  # pinned to nothing


def test_an_answer_without_an_etag_is_trusted_only_until_the_store_shows_it_sends_them(caplog):
    quiet = versions.AnswerChecks("s3://quiet")
    for _ in range(3):
        quiet.check("k", "abc", "", None)
    assert sum("answers GETs without one" in r.message for r in caplog.records) == 1
    chatty = versions.AnswerChecks("s3://chatty")
    chatty.check("k", "abc", "abc", None)
    with pytest.raises(errors.ObjectChanged):
        chatty.check("k", "abc", "", None)  # an object being rewritten (rclone answers so)


def test_the_pinning_is_logged_once_per_kind(caplog):
    caplog.set_level(logging.INFO, logger="bucketfs.backends.versions")
    checks = versions.AnswerChecks("s3://b")
    for version in ("a", "b", "lastmod 1", "lastmod 2", "", ""):
        checks.note_listed(version)
    messages = [r.message for r in caplog.records]
    assert len(messages) == 3 and all(m.startswith("s3://b: ") for m in messages)


def test_a_head_answer_of_another_kind_still_matches_a_pin():
    """SeaweedFS lists no ETag and sends one on HEAD: the pinned kind decides."""
    pinned = versions.of_s3("", 100 * NS)
    assert versions.still(pinned, ObjectInfo("k", 1, 100 * NS + 5, "etag-from-head"))
    assert not versions.still(pinned, ObjectInfo("k", 1, 101 * NS, "etag-from-head"))
    assert versions.still("abc", ObjectInfo("k", 1, 0, "abc"))
    assert not versions.still("abc", ObjectInfo("k", 1, 0, "abd"))
    assert versions.still("", ObjectInfo("k", 1, 0, "abd"))
    assert not versions.persistent("") and versions.persistent("lastmod 1") and versions.persistent("abc")
