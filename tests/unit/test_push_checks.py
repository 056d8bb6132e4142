"""The checks a fetch-ahead worker makes before it writes a body into the kernel's page
cache (backends/http/fetchworker.py: answer_refusal): a doubt is a refusal, and the
reader's own READ then fetches the file through the daemon's checks and retries."""

import base64
import hashlib

import pytest

from bucketfs.backends.digests import S3_ETAG_NOT_MD5_HEADERS
from bucketfs.backends.http.checksums import S3_CHECKSUM_HEADERS, body_hash_for, crc32_of, crc32c_of
from bucketfs.backends.http.curl import Transfer
from bucketfs.backends.http.fetchworker import DAMAGED, answer_refusal

BODY = b"x" * 1000 + b"y" * 234
SIZE = len(BODY)
MD5 = hashlib.md5(BODY).digest()
ETAG = MD5.hex()


def answer(status=206, body=BODY, size=SIZE, **headers) -> Transfer:
    transfer = Transfer("http://store/b/k", [], bytearray(size), 0, 10.0)
    transfer.status = status
    transfer.headers = {"etag": f'"{ETAG}"', "content-range": f"bytes 0-{size - 1}/{size}", **headers}
    transfer.buffer[: len(body)] = body
    transfer.received_bytes = len(body)
    transfer.body_hash = body_hash_for(transfer.headers, 0)  # (as curl.Transfer.on_body does)
    if transfer.body_hash is not None:
        transfer.body_hash.update(body)
    return transfer


def checks(etag=ETAG, last_modified_max_s=None, md5=MD5):
    return (etag, last_modified_max_s, md5, S3_ETAG_NOT_MD5_HEADERS, S3_CHECKSUM_HEADERS)


def test_the_whole_object_of_the_pinned_version_with_its_md5_is_pushed():
    assert answer_refusal(answer(), checks()) == ""
    whole = answer(status=200, **{"content-range": "", "content-length": str(len(BODY))})
    assert answer_refusal(whole, checks()) == ""


@pytest.mark.parametrize(
    "transfer, why",
    [
        (answer(**{"content-range": f"bytes 0-99/{len(BODY)}"}), "a part of the object"),
        (answer(**{"content-range": f"bytes 0-{len(BODY) - 1}/{len(BODY) + 1}"}), "a larger object"),
        (answer(body=BODY[:-10]), "a short body"),
        (answer(etag='"0123456789abcdef0123456789abcdef"'), "another version"),
        (answer(etag=""), "no ETag though pinned to one"),
        (answer(body=BODY[:-1] + b"z"), "damaged on the way"),
        (answer(status=200, **{"content-range": "", "content-length": "5"}), "a 200 of another length"),
        (answer(status=304), "not an answer with the body"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_a_doubtful_answer_is_refused(transfer, why):
    assert answer_refusal(transfer, checks()), why


def test_a_damaged_body_is_refused_as_damaged():
    """(The daemon counts those refusals with its own GETs' damaged answers: backend.corrupt_bodies.)"""
    assert answer_refusal(answer(body=BODY[:-1] + b"z"), checks()) == DAMAGED
    assert answer_refusal(answer(body=BODY[:-10]), checks()) != DAMAGED


def test_an_etag_the_answer_says_is_no_md5_is_not_compared():
    kms = answer(body=BODY[:-1] + b"z", **{"x-amz-server-side-encryption": "aws:kms"})
    assert answer_refusal(kms, checks()) == ""
    sse_c = answer(body=BODY[:-1] + b"z", **{"x-amz-server-side-encryption-customer-algorithm": "AES256"})
    assert answer_refusal(sse_c, checks()) == ""
    s3_managed = answer(body=BODY[:-1] + b"z", **{"x-amz-server-side-encryption": "AES256"})
    assert answer_refusal(s3_managed, checks())  # (SSE-S3: the ETag is still the MD5)


def test_a_last_modified_pin_refuses_a_newer_object():
    old = answer(etag="", **{"last-modified": "Wed, 25 Nov 2026 10:00:00 GMT"})
    pinned_s = 1795687200  # 2026-11-26 10:00:00 UTC
    assert answer_refusal(old, checks(etag=None, last_modified_max_s=pinned_s, md5=None)) == ""
    newer = answer(etag="", **{"last-modified": "Fri, 27 Nov 2026 10:00:00 GMT"})
    assert answer_refusal(newer, checks(etag=None, last_modified_max_s=pinned_s, md5=None))
    undated = answer(etag="")
    assert answer_refusal(undated, checks(etag=None, last_modified_max_s=pinned_s, md5=None))


@pytest.mark.parametrize("header, crc_of", [("x-amz-checksum-crc32c", crc32c_of), ("x-amz-checksum-crc32", crc32_of)])
def test_a_stated_crc_is_checked_instead_of_the_etags_md5(header, crc_of):
    stated = {header: base64.b64encode(crc_of(BODY)).decode()}
    assert answer_refusal(answer(**stated), checks()) == ""
    assert answer_refusal(answer(body=BODY[:-1] + b"z", **stated), checks()) == DAMAGED
    # An object whose ETag is no MD5 (SSE-KMS; multipart, its CRC FULL_OBJECT) is still
    # checked by its CRC.
    kms = {"x-amz-server-side-encryption": "aws:kms", **stated}
    multipart = {"etag": '"abc-3"', "x-amz-checksum-type": "FULL_OBJECT", **stated}
    for headers, etag in ((kms, ETAG), (multipart, "abc-3")):
        assert answer_refusal(answer(**headers), checks(etag=etag, md5=None)) == ""
        assert answer_refusal(answer(body=BODY[:-1] + b"z", **headers), checks(etag=etag, md5=None)) == DAMAGED
    # A mount that found its store's CRCs not of the bytes sends no CRC headers to check.
    assert answer_refusal(answer(body=BODY[:-1] + b"z", **kms), (ETAG, None, None, (), ())) == ""
    # A CRC stated but not computed (nothing hashed as it came): a doubt, refused.
    unhashed = answer(**stated)
    unhashed.body_hash = None
    assert answer_refusal(unhashed, checks()) == DAMAGED
