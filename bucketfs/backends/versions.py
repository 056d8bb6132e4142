"""What a read is pinned to, on stores that state versions differently.

A version is the opaque string an open handle is pinned to (ObjectInfo.version). S3
and S3-compatible stores state one of three things, per object:
- an ETag (AWS, MinIO, Ceph, rclone; an MD5 or any other string: XXH3, opaque): the
  version is the ETag without quotes. A GET sends If-Match and its answer's ETag is
  compared (some servers ignore If-Match).
- no ETag, or an empty one (rclone --etag-hash "", SeaweedFS's listings, fronts that
  strip it), but a Last-Modified: the version is `lastmod <seconds>`, the listed time
  in whole seconds (HTTP dates' resolution). A GET sends If-Unmodified-Since (honoured
  by some stores) and an answer last modified in a later second is ObjectChanged. A
  space never appears in an ETag (RFC 9110's etagc), so no ETag reads as one of these.
- neither (no ETag, and Last-Modified zero: AIStore lists the access time, zero for
  objects never read): the version is UNPINNED, "". Reads are not version-checked.
In every case the answer's total size (Content-Range) is compared with the listed
size (base.check_answer): a second witness, and the only one for UNPINNED objects.
A rewrite of the same size in the same second as the listed time is not detected on
a store without ETags: nothing the store states tells it apart.

GCS states a generation for every object: always the first kind.
"""

from __future__ import annotations

import email.utils
import logging
from typing import Optional

from bucketfs import errors
from bucketfs.backends.http.body import http_date_s

log = logging.getLogger(__name__)

UNPINNED = ""
LASTMOD_PREFIX = "lastmod "
NS_PER_S = 10**9

# Pinning kinds, as logged and counted.
ETAG, LASTMOD, SIZE_ONLY = "etag", "lastmod", "size-only"
PINNING_LOG = {
    ETAG: "reads are pinned to the objects' ETags (If-Match, and the ETag of every answer compared)",
    LASTMOD: (
        "the store lists no ETags: reads are pinned to Last-Modified (If-Unmodified-Since, and the "
        "Last-Modified of every answer compared) and size"
    ),
    SIZE_ONLY: ("the store lists neither ETags nor modification times: reads are checked against the listed size only"),
}


def of_s3(etag: str, mtime_ns: int) -> str:
    """The version of an object listed (or HEAD-answered) with `etag` (quotes stripped
    or not; "" when absent) and modification time `mtime_ns` (0: not stated)."""
    etag = (etag or "").strip('"')
    if etag:
        return etag
    if mtime_ns > 0:
        return f"{LASTMOD_PREFIX}{mtime_ns // NS_PER_S}"
    return UNPINNED


def kind(version: str) -> str:
    if version == UNPINNED:
        return SIZE_ONLY
    return LASTMOD if version.startswith(LASTMOD_PREFIX) else ETAG


def lastmod_s(version: str) -> Optional[int]:
    """The pinned Last-Modified (seconds since the epoch) of a `lastmod` version, else None."""
    if not version.startswith(LASTMOD_PREFIX):
        return None
    return int(version[len(LASTMOD_PREFIX) :])


def persistent(version: str) -> bool:
    """Whether bytes of this version may be kept across mounts (the disk cache): not
    for UNPINNED objects, whose replacement by one of the same size nothing reveals."""
    return version != UNPINNED


def still(version: str, current) -> bool:
    """Whether `current` (an ObjectInfo of the object now, from HEAD) can be `version`.
    Its own version may be of another kind: a store may list no ETag and send one in
    HEAD (SeaweedFS), so it is compared as the pinned version's kind compares."""
    what = kind(version)
    if what == ETAG:
        return current.version == version or kind(current.version) != ETAG
    if what == LASTMOD:
        return current.mtime_ns // NS_PER_S <= lastmod_s(version)
    return True


def condition_headers(version: str) -> dict:
    """The conditional header a GET pinned to `version` sends (none when UNPINNED).
    If-Unmodified-Since names the second after the pinned one: a store that compares
    sub-second times must not refuse an unchanged object listed at 12:00:00.5 (the
    answer's own Last-Modified is compared to the second in check_answer)."""
    pinned_s = lastmod_s(version)
    if pinned_s is not None:
        return {"If-Unmodified-Since": email.utils.formatdate(pinned_s + 1, usegmt=True)}
    if version == UNPINNED:
        return {}
    return {"If-Match": f'"{version}"'}


class AnswerChecks:
    """Checks a GET's answer against the version it is pinned to, for one mount; logs
    once which pinning the mount's objects use. Used from worker threads and the trio
    thread: every update is one atomic assignment."""

    def __init__(self, store: str) -> None:
        self.store = store  # for the log: "s3://bucket"
        self.kinds_seen: set = set()
        # Whether any GET answer of this mount named an ETag. Until one does, an ETag-
        # pinned answer without one is the store's way (If-Match was sent; the size
        # is compared); after one has, an answer without one is an object being
        # rewritten (rclone answers so mid-write) and is not served.
        self.answers_name_etags = False
        self._told_etagless_answers = False

    def note_listed(self, version: str) -> None:
        """Say once per kind which pinning this mount's objects use."""
        what = kind(version)
        if what not in self.kinds_seen:
            self.kinds_seen = self.kinds_seen | {what}
            (log.info if what == ETAG else log.warning)("%s: %s", self.store, PINNING_LOG[what])

    def check(self, key: str, version: str, etag: str, last_modified: Optional[str]) -> None:
        """ObjectChanged unless an answer with ETag `etag` ("" if none) and Last-Modified
        header `last_modified` can be of `version`."""
        etag = (etag or "").strip('"')
        if etag:
            self.answers_name_etags = True
        what = kind(version)
        if what == ETAG:
            if etag == version:
                return
            if etag or self.answers_name_etags:
                raise errors.ObjectChanged(f"{key}: version {version} is now {etag or '(an answer with no ETag)'}")
            if not self._told_etagless_answers:
                self._told_etagless_answers = True
                log.warning(
                    "%s: the store lists ETags but answers GETs without one: those answers are pinned by "
                    "If-Match (which the store may ignore) and the object's size",
                    self.store,
                )
            return
        if what == LASTMOD:
            answered_s, pinned_s = http_date_s(last_modified), lastmod_s(version)
            if answered_s is not None and pinned_s is not None and answered_s > pinned_s:
                raise errors.ObjectChanged(f"{key}: last modified at {pinned_s} when listed, at {answered_s} now")
