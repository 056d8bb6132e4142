"""Checksums of bodies as they arrive: what an answer states of its whole object, and
the hash that checks it, computed on the receiving engine's thread (curl.py) or in a
fetch worker. The checks themselves (retries, EIO) are the backends' (digests.py).

S3 states a full-object CRC32C or CRC32 (x-amz-checksum-*) for an object uploaded with
one, as AWS's SDKs do by default; the ETag of a single-part upload is the MD5 of its
bytes. A CRC is preferred where stated: here ~6x (CRC32) to ~35x (CRC32C) cheaper per
byte than MD5 (100 KB: 17 and 3 us against 122), and it also covers multipart and
SSE-KMS objects, whose ETags are no MD5s.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import zlib
from typing import Optional

import google_crc32c

# S3's full-object checksums checked, cheapest first: (answer header, kind). CRC64NVME,
# which AWS adds to objects uploaded without a checksum, and the SHAs have no C
# implementation among bucketfs's dependencies: such objects are checked by their ETag.
S3_CHECKSUM_HEADERS = (("x-amz-checksum-crc32c", "crc32c"), ("x-amz-checksum-crc32", "crc32"))
_MULTIPART_ETAG_RE = re.compile(r"-[0-9]+\"?\s*$")  # a multipart upload's ETag: "<md5 of the parts' MD5s>-<parts>"
# Sent with S3 GETs from an object's first byte: AWS states checksums only when asked.
S3_CHECKSUM_MODE_HEADERS = {"x-amz-checksum-mode": "ENABLED"}


def crc32c_of(data) -> bytes:
    """CRC32C as S3 and GCS state it (4 bytes, big-endian), by google-crc32c (C where it
    has wheels; a dependency of google-cloud-storage), which takes bytes only."""
    return google_crc32c.value(data if isinstance(data, bytes) else bytes(data)).to_bytes(4, "big")


def crc32_of(data) -> bytes:
    return zlib.crc32(data).to_bytes(4, "big")


CRC_COMPUTE = {"crc32c": crc32c_of, "crc32": crc32_of}


class BodyHash:
    """A checksum of kind `name` ("md5", "crc32c", "crc32") computed piece by piece as a
    body arrives, with hashlib's interface (update, digest)."""

    __slots__ = ("name", "_md5", "_crc")

    def __init__(self, name: str):
        self.name = name
        self._md5 = hashlib.md5() if name == "md5" else None
        self._crc = 0

    def update(self, data) -> None:
        if self._md5 is not None:
            self._md5.update(data)
        elif self.name == "crc32c":
            self._crc = google_crc32c.extend(self._crc, data if isinstance(data, bytes) else bytes(data))
        else:
            self._crc = zlib.crc32(data, self._crc)

    def digest(self) -> bytes:
        return self._md5.digest() if self._md5 is not None else self._crc.to_bytes(4, "big")


def stated_crc(headers, checksum_headers=S3_CHECKSUM_HEADERS) -> Optional[tuple]:
    """(kind, 4-byte value) of the full-object CRC an S3 answer's headers (a dict with
    lower-case names, or urllib3's) state, or None: none stated, or a COMPOSITE one (a
    multipart upload's checksum of its parts' checksums: "<b64>-<parts>", but without
    the suffix when a Range asked for the whole object). A multipart object's CRC is
    taken only where the answer says it is FULL_OBJECT."""
    checksum_type = (headers.get("x-amz-checksum-type") or "").upper()
    if checksum_type == "COMPOSITE":
        return None
    if checksum_type != "FULL_OBJECT" and _MULTIPART_ETAG_RE.search(headers.get("etag") or ""):
        return None
    for header, kind in checksum_headers:
        value = (headers.get(header) or "").strip()
        if not value or "-" in value:
            continue
        try:
            expected = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            continue
        if len(expected) == 4:
            return kind, expected
    return None


def covers_all(content_range: Optional[str]) -> bool:
    """Whether an answer with `Content-Range: bytes a-b/TOTAL` (None: a whole answer)
    ends at its object's end."""
    if not content_range:
        return True
    span, _, total = content_range.strip().rpartition("/")
    end = span.rpartition("-")[2]
    return total.isdigit() and end.isdigit() and int(end) + 1 == int(total)


def body_hash_for(headers: dict, skip_bytes: int) -> Optional[BodyHash]:
    """What to hash a body with as it arrives: for an answer from the object's first
    byte to its end, the kind of checksum it states (an S3 CRC, GCS's CRC32C in
    x-goog-hash, else an ETag that could be an MD5: 32 hex digits); None for anything
    else."""
    if skip_bytes or not covers_all(headers.get("content-range")):
        return None
    stated = stated_crc(headers)
    if stated is not None:
        return BodyHash(stated[0])
    if "crc32c=" in headers.get("x-goog-hash", ""):
        return BodyHash("crc32c")
    if len(headers.get("etag", "").strip('"')) == 32:
        return BodyHash("md5")
    return None
