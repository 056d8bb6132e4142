"""Lean GetObject and ListObjectsV2: botocore's SigV4 signer and a urllib3 pool,
without the client.

Why: the benchmark showed botocore's per-request machinery (event hooks, parameter
validation, user-agent building, response parsing) taking ~68% of the daemon's CPU
on small files: 2.5 ms of CPU per GET, against 1.1 ms for the same signed request
sent here. One GET per ImageFolder sample makes that the ceiling of files/s. A LIST
page of 1,000 keys cost ~40 ms of CPU in botocore's XML and date parsing; here
ElementTree (C) and datetime.fromisoformat do it in a few ms.

Invariants:
- The URL prefix comes from the boto3 client itself (a presigned URL for a dummy
  key), so endpoint, addressing style and region resolution stay botocore's.
- Credentials come from the session on every call (refreshable credentials renew
  themselves); the signature is botocore's S3SigV4Auth's, computed by sigv4.Signer.
- Any answer other than 200/206/416 (412 included) becomes a botocore ClientError, so
  S3Backend classifies errors in one place. A redirect or a region error switches
  this path off for good (`usable = False`) and the client, whose region redirector
  handles it, serves the rest. So does an HTTP(S)_PROXY that applies to the endpoint
  (botocore routes through it; a direct connection may not be allowed).
- Trust: the CA bundle is botocore's (AWS_CA_BUNDLE, the profile, REQUESTS_CA_BUNDLE).
"""

from __future__ import annotations

import datetime
import html
import logging
import os
import re
import time
import xml.etree.ElementTree as ElementTree
from typing import Optional
from urllib.parse import quote, urlencode, urlsplit

import botocore.exceptions
import botocore.httpsession
import botocore.utils
import urllib3
from botocore.compat import unquote_str

from bucketfs.backends.base import body_deadline_s, copy_into, read_body
from bucketfs.backends.curl_engine import Transfer
from bucketfs.backends.digests import s3_etag_digest
from bucketfs.backends.sigv4 import Signer, host_of

log = logging.getLogger(__name__)

_DUMMY_KEY = "bucketfs-probe-key"
_XML_FIELD_RE = {name: re.compile(rf"<{name}>(.*?)</{name}>", re.S) for name in ("Code", "Message")}


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def ca_bundle(session) -> str:
    """The certificates botocore trusts for this session: AWS_CA_BUNDLE or the
    profile's ca_bundle, then REQUESTS_CA_BUNDLE, else its default (certifi's bundle).
    The lean requests must trust exactly these: a store behind a private CA (MinIO,
    Ceph) is configured this way, and urllib3 alone would use the system store."""
    botocore_session = getattr(session, "_session", session)  # boto3 Session -> botocore's
    configured = botocore_session.get_config_variable("ca_bundle") or os.environ.get("REQUESTS_CA_BUNDLE")
    return configured or botocore.httpsession.get_cert_path(True)


def _receive_into(response, buffer: bytearray, deadline_s: float) -> int:
    """A response body received straight into `buffer`; its length. urllib3's own
    readinto reads into a temporary bytes object and copies it; the socket reader
    under http.client's response receives into the buffer itself, one receive at a
    time (readinto1) so that a body trickling in meets `deadline_s` (base.read_body)."""
    raw = getattr(response, "_fp", None)  # http.client's response
    stream = getattr(raw, "fp", None)  # its socket's buffered reader
    length = getattr(response, "length_remaining", None)
    if length is None or length > len(buffer) or getattr(raw, "chunked", True) or not hasattr(stream, "readinto1"):
        data = read_body(response, deadline_s)
        if len(data) > len(buffer):
            raise urllib3.exceptions.ProtocolError(f"a {len(data)}-byte body for a {len(buffer)}-byte range")
        return copy_into(buffer, data)
    view = memoryview(buffer)
    got = 0
    try:
        while got < length:
            n = stream.readinto1(view[got:length])
            if not n:
                raise urllib3.exceptions.IncompleteRead(got, length - got)
            got += n
            if got < length and time.monotonic() > deadline_s:
                raise TimeoutError(f"body still arriving at its deadline ({got} of {length} bytes)")
    except BaseException:
        response.close()  # never hand a half-read connection back to the pool
        raise
    raw.close()  # (what http.client does at a body's end: its connection may serve the next request)
    return got


def _mtime_ns(text: str) -> int:
    when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return (when - _EPOCH) // datetime.timedelta(microseconds=1) * 1000

# A ListObjectsV2 page as S3, MinIO, Ceph and rclone write it: flat, unprefixed tags,
# no CDATA. One regular-expression pass reads it without building ~8 Elements per key.
# Alone it is only ~1.5x faster (200 keys: ~1.4 -> ~1.0 ms), but inside the daemon,
# with many pages at once, a cold 52-page ImageFolder scan took 0.41 s of daemon CPU
# with ElementTree against 0.29 s this way (scan 0.58 -> 0.46 s; W2 of scripts/bench.py).
# Anything else goes to ElementTree (see parse_list_page).
_OBJECT_FIELDS_RE = re.compile(r"<(Key|LastModified|ETag|Size)>([^<]*)</")
_PREFIX_RE = re.compile(r"<CommonPrefixes>\s*<Prefix>([^<]*)</Prefix>\s*</CommonPrefixes>")
_TOP_FIELD_RE = {tag: re.compile(rf"<{tag}>([^<]*)</{tag}>") for tag in ("IsTruncated", "NextContinuationToken", "EncodingType")}


def _parse_fast(body: bytes) -> Optional[tuple]:
    """The page by regular expressions; None if it is not in the plain shape."""
    text = body.decode("utf-8")
    if "CDATA" in text or ":Contents" in text or ":Key" in text:
        return None
    # XML's five entities and &#...; are HTML's too; most pages have none.
    unescape = html.unescape if "&" in text else (lambda value: value)

    def top(tag: str) -> Optional[str]:
        match = _TOP_FIELD_RE[tag].search(text)
        return None if match is None else unescape(match.group(1))

    decode = unquote_str if top("EncodingType") == "url" else (lambda value: value)
    # Every <Contents> has each of the four fields once, in any order: then the matches
    # split into groups of four, one group per object, with no guessing.
    fields = _OBJECT_FIELDS_RE.findall(text)
    if len(fields) != 4 * text.count("<Contents>"):
        return None
    objects = []
    for i in range(0, len(fields), 4):
        record = dict(fields[i : i + 4])
        if len(record) != 4:
            return None
        try:
            objects.append((decode(unescape(record["Key"])), int(record["Size"]),
                            _mtime_ns(record["LastModified"]), unescape(record["ETag"])))
        except ValueError:
            return None
    prefixes = [decode(unescape(value)) for value in _PREFIX_RE.findall(text)]
    if len(prefixes) != text.count("<CommonPrefixes>"):
        return None
    truncated = top("IsTruncated") == "true"
    return objects, prefixes, top("NextContinuationToken") if truncated else None, truncated


def _parse_tree(body: bytes) -> tuple:
    root = ElementTree.fromstring(body)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    encoded = root.findtext(f"{ns}EncodingType") == "url"
    decode = unquote_str if encoded else (lambda text: text)
    objects = [
        (decode(item.findtext(f"{ns}Key")), int(item.findtext(f"{ns}Size")),
         _mtime_ns(item.findtext(f"{ns}LastModified")), item.findtext(f"{ns}ETag") or "")
        for item in root.iterfind(f"{ns}Contents")
    ]
    prefixes = [decode(item.findtext(f"{ns}Prefix")) for item in root.iterfind(f"{ns}CommonPrefixes")]
    truncated = root.findtext(f"{ns}IsTruncated") == "true"
    return objects, prefixes, root.findtext(f"{ns}NextContinuationToken") if truncated else None, truncated


def parse_list_page(body: bytes) -> tuple:
    """(objects [(key, size, mtime_ns, etag)], prefixes, next_token, truncated) of one page."""
    return _parse_fast(body) or _parse_tree(body)


def _etag_digest(headers):
    """s3_etag_digest of an answer's headers (urllib3's, or curl_engine's lower-case dict)."""
    return s3_etag_digest(headers.get("etag", ""), headers.get("x-amz-server-side-encryption"),
                          headers.get("x-amz-server-side-encryption-customer-algorithm"))


class LeanS3:
    def __init__(self, client, session, bucket: str, max_connections_count: int,
                 connect_timeout_s: float, read_timeout_s: float, unsigned: bool):
        """`session`: the boto3 session; credentials and the CA bundle come from it."""
        self.client, self.bucket = client, bucket
        self.base_url: Optional[str] = None  # ".../<bucket>/" or "https://<bucket>.host/"; first use
        self.region = client.meta.region_name
        self.session = session
        self.unsigned = unsigned
        self.read_timeout_s = read_timeout_s
        self.signer = Signer(self.region)
        self.usable = True
        self.pool = urllib3.PoolManager(
            num_pools=4, maxsize=max_connections_count, block=False, retries=False, ca_certs=ca_bundle(session),
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
        )

    def _headers(self, url: str, headers: dict) -> dict:
        if self.unsigned:
            return headers
        credentials = self.session.get_credentials()
        if credentials is None:
            raise botocore.exceptions.NoCredentialsError()
        return self.signer.sign_get(credentials.get_frozen_credentials(), url, self._host, headers)

    def _resolve(self) -> bool:
        if self.base_url is None:
            # Worker threads call this at once on first use: everything is set before
            # base_url, whose value says "resolved" to the others.
            url = self.client.generate_presigned_url("get_object", Params={"Bucket": self.bucket, "Key": _DUMMY_KEY}, ExpiresIn=60)
            base_url = url.split("?", 1)[0][: -len(_DUMMY_KEY)]
            self._host = host_of(base_url)
            if not base_url.endswith("/"):
                self.usable = False
            elif botocore.utils.get_environ_proxies(base_url).get(urlsplit(base_url).scheme):
                # botocore sends this endpoint's requests through HTTP(S)_PROXY; so must we,
                # and the client does that already: a direct connection may not be allowed.
                log.info("a proxy is set for %s: requests go through the SDK client", self._host)
                self.usable = False
            else:
                # One host: its connection pool directly, without PoolManager parsing
                # and normalising every URL (~5% of a small-file GET's CPU).
                self._host_pool = self.pool.connection_from_url(base_url)
                self._origin_len = len(base_url) - len(urlsplit(base_url).path)
            self.base_url = base_url
        return self.usable

    def _request(self, url: str, headers: dict):
        """One GET on the wire, unread (the tests' fault injection replaces this)."""
        # decode_content=False: the stored bytes, as botocore reads them. urllib3 would
        # gunzip an object stored with Content-Encoding: gzip, whose listed size, ranges
        # and ETag are those of the stored bytes (every read of one gave ESTALE or EIO).
        return self._host_pool.urlopen("GET", url[self._origin_len:], headers=headers,
                                       preload_content=False, decode_content=False, redirect=False, retries=False)

    def _send(self, url: str, headers: dict, ok_statuses, buffer: Optional[bytearray] = None,
              byte_range: Optional[tuple] = None) -> Optional[tuple]:
        """(status, headers, body) for an answer in `ok_statuses`; None if this path
        cannot serve the bucket; a botocore ClientError for any other answer. With
        `buffer`, a ranged body (Content-Range) is received into it and `body` is its length.
        `byte_range` (start, end) of a ranged GET: if the server ignored it (a 200 with
        no Content-Range), `body` is that range of the whole object, read only so far."""
        response = self._request(url, self._headers(url, headers))
        expected_bytes = getattr(response, "length_remaining", None) or (len(buffer) if buffer is not None else 0)
        deadline_s = body_deadline_s(self.read_timeout_s, expected_bytes)
        try:
            if buffer is not None and response.status in (200, 206) and "Content-Range" in response.headers:
                body = _receive_into(response, buffer, deadline_s)
            elif byte_range is not None and response.status == 200 and "Content-Range" not in response.headers:
                body = read_body(response, deadline_s, *byte_range)
            else:
                body = read_body(response, deadline_s)
        finally:
            response.release_conn()
        status = response.status
        if status in ok_statuses:
            return status, response.headers, body
        return self._refused(status, body)

    def _refused(self, status: int, body: bytes) -> None:
        """An answer not in the expected statuses: None, having switched this path off
        (a redirect or a region error), or a botocore ClientError raised."""
        text = body.decode("utf-8", "replace")
        code = (_XML_FIELD_RE["Code"].search(text) or [None, str(status)])[1]
        if 300 <= status < 400 or code in ("AuthorizationHeaderMalformed", "PermanentRedirect", "IllegalLocationConstraintException"):
            log.info("lean request path off for this bucket (%s %s); using the SDK client", status, code)
            self.usable = False
            return None
        message = (_XML_FIELD_RE["Message"].search(text) or [None, ""])[1]
        raise botocore.exceptions.ClientError(
            {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}, "S3")

    def get(self, key: str, start: int, end: int, version: str, buffer: Optional[bytearray] = None) -> Optional[tuple]:
        """(status, etag, content_range or None, body, digest) of a ranged GET pinned to
        `version` (without Content-Range, the server ignored Range: `body` is the range all
        the same); with `buffer`, a ranged body is received into it and `body` is its
        length. `digest`: the MD5 the ETag states of the whole object, if it states one."""
        if not self._resolve():
            return None
        url = self.base_url + quote(key, safe="/~")
        answer = self._send(url, self._range_headers(start, end, version), (200, 206, 416), buffer, (start, end))
        if answer is None:
            return None
        status, headers, body = answer
        return status, headers.get("ETag", ""), headers.get("Content-Range"), body, _etag_digest(headers)

    @staticmethod
    def _range_headers(start: int, end: int, version: str) -> dict:
        return {"Range": f"bytes={start}-{end - 1}", "If-Match": f'"{version}"'}

    def transfer(self, key: str, start: int, end: int, version: str, buffer: bytearray) -> Optional[Transfer]:
        """get() as a signed curl_engine.Transfer into `buffer` (len end - start); None
        if this path cannot serve the bucket. Its answer: answer_of(transfer)."""
        if not self._resolve():
            return None
        url = self.base_url + quote(key, safe="/~")
        return Transfer.ranged(url, self._headers(url, self._range_headers(start, end, version)), buffer, start,
                               self.read_timeout_s)

    def answer_of(self, transfer: Transfer) -> Optional[tuple]:
        """get()'s answer for a finished transfer (`body`: the bytes received into its
        buffer); None if this path was switched off; raises as get() does."""
        if transfer.error is not None:
            raise transfer.error
        if transfer.status not in (200, 206, 416):
            return self._refused(transfer.status, bytes(transfer.error_body))
        headers = transfer.headers
        return (transfer.status, headers.get("etag", ""), headers.get("content-range"), transfer.received_bytes,
                _etag_digest(headers))

    def list(self, prefix: str, token: Optional[str], max_keys: int) -> Optional[tuple]:
        """(objects [(key, size, mtime_ns, etag)], prefixes, next_token) of one delimited page."""
        if not self._resolve():
            return None
        params = {"list-type": "2", "delimiter": "/", "encoding-type": "url", "max-keys": str(max_keys), "prefix": prefix}
        if token:
            params["continuation-token"] = token
        # The bucket URL is base_url minus its trailing slash's key part: base_url ends at "<bucket>/" or "/".
        url = self.base_url + "?" + urlencode(sorted(params.items()), quote_via=quote, safe="-_.~")
        answer = self._send(url, {}, (200,))
        if answer is None:
            return None
        return parse_list_page(answer[2])

    def close(self) -> None:
        self.pool.clear()
