"""Whole-object checksums (backends/digests.py): which answers state one, and how a
mismatch is told apart from an ETag that is no MD5."""

import base64
import hashlib
import zlib

import pytest

from bucketfs.backends.digests import (
    CorruptBody,
    EtagChecks,
    check_whole_object,
    gcs_hash_digest,
    is_whole_object,
    s3_answer_digest,
    s3_etag_digest,
)
from bucketfs.backends.gcs import _crc32c_of

DATA = b"the bytes of a small file" * 100
MD5_HEX = hashlib.md5(DATA).hexdigest()


def test_an_s3_etag_states_an_md5_only_for_plain_single_part_objects():
    assert s3_etag_digest(f'"{MD5_HEX}"', None, None).expected == hashlib.md5(DATA).digest()
    assert s3_etag_digest(MD5_HEX, "AES256", None) is not None  # SSE-S3: still the MD5 on AWS
    assert s3_etag_digest(f"{MD5_HEX}-3", None, None) is None  # multipart
    assert s3_etag_digest(MD5_HEX, "aws:kms", None) is None
    assert s3_etag_digest(MD5_HEX, "aws:kms:dsse", None) is None
    assert s3_etag_digest(MD5_HEX, "AES256", "AES256") is None  # SSE-C
    assert s3_etag_digest("1a2b3c", None, None) is None  # a store's own kind of ETag
    assert s3_etag_digest("", None, None) is None


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_gcs_x_goog_hash_prefers_crc32c_and_ignores_what_it_cannot_read():
    crc, md5 = _crc32c_of(DATA), hashlib.md5(DATA).digest()
    both = gcs_hash_digest(f"crc32c={b64(crc)}, md5={b64(md5)}", _crc32c_of)  # two headers, joined
    assert (both.name, both.expected) == ("crc32c", crc)
    assert (
        gcs_hash_digest(f"md5={b64(md5)}", _crc32c_of).name == "md5"
    )  # (composite objects have no MD5; here, the reverse)
    assert gcs_hash_digest("crc32c=not base64!", _crc32c_of) is None
    assert gcs_hash_digest(None, _crc32c_of) is None
    check_whole_object("k", both, 0, DATA, len(DATA), None)
    with pytest.raises(CorruptBody):
        check_whole_object("k", both, 0, DATA[:-1] + b"!", len(DATA), None)
    check_whole_object("k", both, 0, DATA[:100] + b"!", None, f"bytes 0-100/{len(DATA)}")  # a range: not checked
    check_whole_object("k", None, 0, DATA[:-1] + b"!", len(DATA), None)  # nothing stated


def test_only_a_body_that_is_the_whole_object_is_checked():
    assert is_whole_object(0, 100, 100, None)
    assert is_whole_object(0, 100, None, "bytes 0-99/100")
    assert not is_whole_object(0, 50, 100, "bytes 0-49/100")
    assert not is_whole_object(10, 90, 100, "bytes 10-99/100")
    assert not is_whole_object(0, 100, None, None)  # no size known
    assert not is_whole_object(0, 100, None, "bytes 0-99/*")


def test_damage_is_fetched_again_but_the_same_bytes_twice_mean_the_etag_is_no_md5():
    checks, digest = EtagChecks(), s3_etag_digest(MD5_HEX, None, None)

    def check(digest, data):
        check_whole_object("k", digest, 0, data, len(DATA), None, checks)

    check(digest, DATA)
    for n in range(5):  # damage differs between attempts: every attempt refused
        with pytest.raises(CorruptBody, match="md5 of the 2500 bytes"):
            check(digest, DATA[:n] + b"!" + DATA[n + 1 :])
    assert checks.enabled
    other = digest._replace(expected=bytes(16))  # an ETag that is not the bytes' MD5
    with pytest.raises(CorruptBody):
        check(other, DATA)
    check(other, DATA)  # the same bytes again: served
    assert not checks.enabled
    check(digest, DATA[:-1] + b"!")  # no longer checked


def test_a_failed_check_keeps_no_view_of_the_buffer():
    """The GET paths resize or reuse the buffer after a failed attempt: a traceback
    holding a view of it would make that raise BufferError."""
    buffer = bytearray(DATA)
    digest = s3_etag_digest(hashlib.md5(b"other").hexdigest(), None, None)
    try:
        check_whole_object("k", digest, 0, memoryview(buffer)[:100], 100, None)
    except CorruptBody:
        del buffer[10:]  # BufferError if a view were still alive
    assert len(buffer) == 10


def test_the_curl_engine_computes_the_md5_as_the_body_arrives_and_the_check_uses_it():
    """On the curl path the MD5 of a whole object is computed on the engine's thread as
    its chunks arrive; the answer's digest then returns it without reading the body
    (so the trio thread never hashes), and a byte changed on the way is still caught."""
    from bucketfs.backends.http.curl import Transfer
    from bucketfs.backends.s3_lean import LeanS3

    def received(data: bytes, skip_bytes: int = 0) -> Transfer:
        t = Transfer("http://store/k", [], bytearray(len(data)), skip_bytes, 30.0)
        for line in (b"HTTP/1.1 200 OK\r\n", f'ETag: "{MD5_HEX}"\r\n'.encode(), b"\r\n"):
            t.on_header(line)
        for at in range(0, len(data), 1000):
            t.on_body(data[at : at + 1000])
        return t

    t = received(DATA)
    assert t.body_hash is not None and t.body_hash.digest() == hashlib.md5(DATA).digest()
    digest = LeanS3.answer_of(None, t)[4]
    assert digest.compute(b"not read") == hashlib.md5(DATA).digest()
    check_whole_object("k", digest, 0, t.buffer, len(DATA), None)

    damaged = bytearray(DATA)
    damaged[700] ^= 1
    digest = LeanS3.answer_of(None, received(bytes(damaged)))[4]
    with pytest.raises(CorruptBody):
        check_whole_object("k", digest, 0, damaged, len(DATA), None)
    assert received(DATA, skip_bytes=5).body_hash is None  # not from the object's start: hashed later, if at all


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


CRC32C_B64 = _b64(_crc32c_of(DATA))
CRC32_B64 = _b64(zlib.crc32(DATA).to_bytes(4, "big"))


def test_an_s3_answer_states_a_full_object_crc_before_its_etags_md5():
    etag = f'"{MD5_HEX}"'
    both = {"etag": etag, "x-amz-checksum-crc32": CRC32_B64, "x-amz-checksum-crc32c": CRC32C_B64}
    assert s3_answer_digest(both).name == "crc32c"  # the cheapest first
    assert s3_answer_digest({"etag": etag, "x-amz-checksum-crc32": CRC32_B64}).expected == zlib.crc32(DATA).to_bytes(
        4, "big"
    )
    assert s3_answer_digest({"etag": etag}).name == "md5"
    # A multipart upload's composite CRC (of its parts' CRCs) says nothing of the bytes.
    composite = {"etag": f'"{MD5_HEX}-2"', "x-amz-checksum-crc32": f"{CRC32_B64}-2"}
    assert s3_answer_digest(composite) is None
    typed = {"etag": etag, "x-amz-checksum-crc32": CRC32_B64, "x-amz-checksum-type": "COMPOSITE"}
    assert s3_answer_digest(typed).name == "md5"
    # AWS drops the "-<parts>" of a composite CRC when a Range asks for the whole object:
    # a multipart object's CRC is taken only where the answer says it is FULL_OBJECT.
    ranged = {"etag": f'"{MD5_HEX}-2"', "x-amz-checksum-crc32": CRC32_B64}
    assert s3_answer_digest(ranged) is None
    assert s3_answer_digest({**ranged, "x-amz-checksum-type": "FULL_OBJECT"}).name == "crc32"
    # CRC64NVME is not computed here; an unreadable value is no checksum.
    assert s3_answer_digest({"etag": etag, "x-amz-checksum-crc64nvme": "AAAAAAAAAAA="}).name == "md5"
    assert s3_answer_digest({"x-amz-checksum-crc32c": "not base64!"}) is None
    # SSE-KMS: the ETag is no MD5, but a CRC still checks the bytes.
    kms = {"etag": etag, "x-amz-server-side-encryption": "aws:kms", "x-amz-checksum-crc32c": CRC32C_B64}
    assert s3_answer_digest(kms).name == "crc32c"


def test_a_crc_mismatch_is_damage_even_where_etags_were_found_to_be_no_md5s():
    checks = EtagChecks()
    checks.enabled = False  # (this store's ETags are no MD5s)
    digest = s3_answer_digest({"etag": "whatever", "x-amz-checksum-crc32c": CRC32C_B64})
    check_whole_object("k", digest, 0, DATA, len(DATA), None, checks)
    damaged = bytearray(DATA)
    damaged[3] ^= 1
    with pytest.raises(CorruptBody):
        check_whole_object("k", digest, 0, damaged, len(DATA), None, checks)
    damaged[3] ^= 1
    damaged[4] ^= 1  # other damage: still damage
    with pytest.raises(CorruptBody):
        check_whole_object("k", digest, 0, damaged, len(DATA), None, checks)
    assert checks.crc_enabled


def test_crcs_that_twice_disagree_with_the_same_bytes_are_not_of_the_bytes_and_go_off_alone():
    checks = EtagChecks()
    wrong = s3_answer_digest({"etag": f'"{MD5_HEX}"', "x-amz-checksum-crc32c": _b64(b"\x00\x00\x00\x01")})
    with pytest.raises(CorruptBody):
        check_whole_object("k", wrong, 0, DATA, len(DATA), None, checks)
    check_whole_object("k", wrong, 0, DATA, len(DATA), None, checks)  # the same bytes again: served
    assert not checks.crc_enabled and checks.enabled  # the ETags' MD5s are still checked
    damaged = bytearray(DATA)
    damaged[3] ^= 1
    with pytest.raises(CorruptBody):
        check_whole_object("k", s3_etag_digest(MD5_HEX, None, None), 0, damaged, len(DATA), None, checks)


@pytest.mark.parametrize(
    "header, value, kind",
    [("x-amz-checksum-crc32c", CRC32C_B64, "crc32c"), ("x-amz-checksum-crc32", CRC32_B64, "crc32")],
)
def test_the_curl_engine_computes_a_stated_crc_as_the_body_arrives_instead_of_the_md5(header, value, kind):
    from bucketfs.backends.http.curl import Transfer
    from bucketfs.backends.s3_lean import LeanS3

    def received(data: bytes, extra: tuple = ()) -> Transfer:
        t = Transfer("http://store/k", [], bytearray(len(data)), 0, 30.0)
        lines = (
            b"HTTP/1.1 206 Partial Content\r\n",
            f'ETag: "{MD5_HEX}"\r\n'.encode(),
            f"{header}: {value}\r\n".encode(),
        )
        for line in (*lines, *extra, b"\r\n"):
            t.on_header(line)
        for at in range(0, len(data), 999):
            t.on_body(memoryview(data)[at : at + 999])
        return t

    whole = f"Content-Range: bytes 0-{len(DATA) - 1}/{len(DATA)}\r\n".encode()
    t = received(DATA, (whole,))
    assert t.body_hash.name == kind
    digest = LeanS3.answer_of(None, t)[4]
    assert digest.name == kind and digest.compute(b"not read") == digest.expected
    check_whole_object("k", digest, 0, t.buffer, len(DATA), None)

    damaged = bytearray(DATA)
    damaged[1234] ^= 1
    digest = LeanS3.answer_of(None, received(bytes(damaged), (whole,)))[4]
    with pytest.raises(CorruptBody):
        check_whole_object("k", digest, 0, damaged, len(DATA), None)
    # The first part of a larger object is not all of it: nothing is hashed.
    part = f"Content-Range: bytes 0-{len(DATA) - 1}/{len(DATA) * 4}\r\n".encode()
    assert received(DATA, (part,)).body_hash is None


def test_s3_gets_from_an_objects_first_byte_ask_for_its_checksum():
    from bucketfs.backends.s3_lean import LeanS3

    assert LeanS3.range_headers(0, 100, '"etag"')["x-amz-checksum-mode"] == "ENABLED"
    assert "x-amz-checksum-mode" not in LeanS3.range_headers(100, 200, '"etag"')


def test_the_curl_engine_computes_gcs_crc32c_as_the_body_arrives():
    from bucketfs.backends.http.curl import Transfer

    goog_hash = f"crc32c={CRC32C_B64}, md5={_b64(hashlib.md5(DATA).digest())}"
    t = Transfer("http://store/k", [], bytearray(len(DATA)), 0, 30.0)
    for line in (b"HTTP/1.1 200 OK\r\n", f"x-goog-hash: {goog_hash}\r\n".encode(), b"\r\n"):
        t.on_header(line)
    for at in range(0, len(DATA), 999):
        t.on_body(DATA[at : at + 999])
    digest = gcs_hash_digest(t.headers["x-goog-hash"], _crc32c_of)
    assert t.body_hash.name == digest.name == "crc32c" and t.body_hash.digest() == digest.expected
