"""Whole-object checksums: a GET whose body is a whole object is checked against the
checksum the store states for that object, so bytes damaged on the way (a proxy, a
NIC, a plain-HTTP network, a bug) are fetched again and never served.

Only whole objects: S3 and GCS state checksums of whole objects (S3: a full-object
CRC32C or CRC32 in x-amz-checksum-* where the object was uploaded with one, as AWS's
SDKs do by default, and the ETag of a single-part upload, the MD5 of its bytes; GCS's
x-goog-hash header carries CRC32C and, except for composite objects, MD5), never of a
range. A CRC is preferred where stated (http/checksums.py). Files fetched whole at
open (up to --small-file-bytes: ImageFolder samples) are checked; ranged reads of
larger objects (shards, random reads) are not.

Checked in the backends (a mismatch is retried like a reset: another attempt fetches
the object again; after the last one, EIO), where the answer's headers say whether the
ETag is an MD5 at all.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import re
from typing import Callable, NamedTuple, Optional

from bucketfs.backends.http.checksums import CRC_COMPUTE, stated_crc

log = logging.getLogger(__name__)

# Objects whose last GET did not match their ETag, remembered to tell damage (which
# differs between attempts) from an ETag that is no MD5 (the same bytes twice).
MISMATCHES_KEPT_COUNT = 1024

_MD5_HEX_RE = re.compile(r"[0-9a-fA-F]{32}")


class CorruptBody(ConnectionError):
    """A body that does not match the checksum its store states for it: retried like a
    reset, and after the last attempt EIO; never served."""


class Digest(NamedTuple):
    name: str  # "md5", "crc32c" or "crc32"
    expected: bytes
    compute: Callable[[object], bytes]  # bytes-like -> digest


def md5_of(data) -> bytes:
    return hashlib.md5(data).digest()


def s3_answer_digest(headers) -> Optional[Digest]:
    """The checksum an S3 answer's headers (lower-case names, or urllib3's) state of the
    whole object: a full-object CRC where stated (http/checksums.py), else the MD5 its
    ETag states (s3_etag_digest), else None."""
    stated = stated_crc(headers)
    if stated is not None:
        return Digest(stated[0], stated[1], CRC_COMPUTE[stated[0]])
    return s3_etag_digest(
        headers.get("etag", ""),
        headers.get("x-amz-server-side-encryption"),
        headers.get("x-amz-server-side-encryption-customer-algorithm"),
    )


def received_digest(digest: Optional[Digest], body_hash) -> Optional[Digest]:
    """`digest`, answering with `body_hash` (curl.Transfer.body_hash: computed on the
    engine's thread, or in a worker, as the body arrived) where it is of the same kind,
    so that the check reads no byte on the event loop."""
    if digest is None or body_hash is None or body_hash.name != digest.name:
        return digest
    received = body_hash.digest()
    return digest._replace(compute=lambda _body: received)


# Answer headers that say an S3 ETag is not the MD5 of the bytes (AWS: SSE-KMS, DSSE-KMS,
# SSE-C): (header, what its value starts with; "" any value). Also checked by the
# fetch-ahead workers, which are given it (http/fetchworker.py: answer_refusal).
S3_ETAG_NOT_MD5_HEADERS = (
    ("x-amz-server-side-encryption", "aws:kms"),
    ("x-amz-server-side-encryption-customer-algorithm", ""),
)


def s3_etag_digest(etag: str, encryption: Optional[str], customer_algorithm: Optional[str]) -> Optional[Digest]:
    """The MD5 an S3 ETag (quoted or not) states of the object's bytes, or None where it
    states none: a multipart upload's ETag ("<hex>-<parts>"), SSE-KMS, DSSE-KMS and
    SSE-C objects (AWS: their ETag is not the MD5 of the data: S3_ETAG_NOT_MD5_HEADERS),
    and ETags of another shape (stores that do not use MD5)."""
    values = (encryption, customer_algorithm)
    if (encryption or customer_algorithm) and any(
        (value or "").lower().startswith(start) and value for value, (_, start) in zip(values, S3_ETAG_NOT_MD5_HEADERS)
    ):
        return None
    etag = (etag or "").strip('"')
    if not _MD5_HEX_RE.fullmatch(etag):
        return None
    return Digest("md5", bytes.fromhex(etag), md5_of)


def gcs_hash_digest(goog_hash: Optional[str], crc32c_of: Callable[[object], bytes]) -> Optional[Digest]:
    """The checksum GCS's `x-goog-hash: crc32c=<b64>,md5=<b64>` header states: CRC32C
    where given (cheaper to compute), else MD5; None without either."""
    hashes = {}
    for item in (goog_hash or "").split(","):
        name, _, value = item.strip().partition("=")
        try:
            hashes[name.lower()] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            continue
    if len(hashes.get("crc32c", b"")) == 4:
        return Digest("crc32c", hashes["crc32c"], crc32c_of)
    if len(hashes.get("md5", b"")) == 16:
        return Digest("md5", hashes["md5"], md5_of)
    return None


def is_whole_object(start: int, received_bytes: int, object_bytes: Optional[int], content_range: Optional[str]) -> bool:
    """Whether a body of `received_bytes` from `start` is all of the object: its size is
    `object_bytes` (the listed size), or else the total of `Content-Range: bytes a-b/TOTAL`."""
    if start != 0:
        return False
    total_bytes = object_bytes
    if total_bytes is None and content_range:
        total = content_range.rpartition("/")[2].strip()
        total_bytes = int(total) if total.isdigit() else None
    return total_bytes is not None and received_bytes == total_bytes


def check_whole_object(
    key: str,
    digest: Optional[Digest],
    start: int,
    data,
    object_bytes: Optional[int],
    content_range: Optional[str],
    etags: Optional["EtagChecks"] = None,
) -> None:
    """CorruptBody if `data` (bytes-like), the body of a GET from `start`, is the whole
    object and does not have the stated digest (None: nothing stated, nothing checked).
    `etags`: the mount's S3 checks, which may have learnt that its store's ETags are no
    MD5s, or its CRCs not of the bytes."""
    if digest is None or (etags is not None and not etags.on(digest)):
        return
    if not is_whole_object(start, len(data), object_bytes, content_range):
        return
    size_bytes, got = len(data), digest.compute(data)
    del data  # (a traceback must not keep a view of a buffer its owner resizes or reuses)
    if got == digest.expected or (etags is not None and etags.same_bytes_again(key, digest, got)):
        return
    raise CorruptBody(
        f"{key}: the {digest.name} of the {size_bytes} bytes received is not the one the store states for the object"
    )


class EtagChecks:
    """Whether the checksums an S3 store states are checked, for one mount: its ETags as
    MD5s (`enabled`), and its full-object CRCs (`crc_enabled`), each until the store
    shows that they are not of the objects' bytes, by two GETs of one object version
    that bring the same bytes, not matching it. Damage on the way does not repeat
    itself; a checksum of another kind does (S3-compatible stores that encrypt, compress
    or choose ETags their own way, where AWS would send MD5s; a store that stated a
    multipart object's composite CRC as a full-object one). Then the bytes are served,
    and that kind is no longer checked on this mount (logged once). Used from worker
    threads and the trio thread: the dict's single operations are atomic under the GIL,
    and a lost update only costs one more attempt."""

    def __init__(self) -> None:
        self.enabled = True  # ETags taken as MD5s
        self.crc_enabled = True  # x-amz-checksum-* CRCs
        self._mismatched: dict = {}  # (key, kind, stated) -> the checksum of the bytes that came

    def on(self, digest: Digest) -> bool:
        return self.enabled if digest.name == "md5" else self.crc_enabled

    def same_bytes_again(self, key: str, digest: Digest, got: bytes) -> bool:
        """A mismatch: whether the last GET of this object version brought the same
        bytes (then the checks of its kind go off), remembering these otherwise."""
        mismatch = (key, digest.name, digest.expected.hex())
        if self._mismatched.pop(mismatch, None) == got:
            if digest.name == "md5" and self.enabled:
                self.enabled = False
                log.warning(
                    "%s: two GETs brought the same bytes, whose MD5 is not the object's ETag: this store's "
                    "ETags are not MD5s of the bytes, so whole-object checks against them are off",
                    key,
                )
            elif digest.name != "md5" and self.crc_enabled:
                self.crc_enabled = False
                log.warning(
                    "%s: two GETs brought the same bytes, whose %s is not the one the store states: this store's "
                    "x-amz-checksum-* headers are not of the bytes, so whole-object checks against them are off",
                    key,
                    digest.name.upper(),
                )
            return True
        if len(self._mismatched) >= MISMATCHES_KEPT_COUNT:
            self._mismatched.clear()
        self._mismatched[mismatch] = got
        return False
