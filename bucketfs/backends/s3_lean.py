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
  S3Backend classifies errors in one place.
- A redirect with a Location (AIStore's gateways answer object GETs with 307 to the
  target that holds the object; S3 sends 307 to a new bucket's region) is followed,
  signed again for its host, at most REDIRECT_HOPS_MAX hops: past that, an error
  (EIO), never a loop. A redirect without a Location or a region error (S3's 301
  PermanentRedirect, AuthorizationHeaderMalformed) switches this path off for good
  (`usable = False`, `off_reason` says why): the backend then swaps its transport to
  the SDK client, whose region redirector handles it (s3_transport.py). An
  HTTP(S)_PROXY that applies to the endpoint (botocore routes through it; a direct
  connection may not be allowed) keeps this path off from the start: resolved when
  the backend is built, so that it chooses its transport once.
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
from typing import Any, Optional
from urllib.parse import quote, unquote, urlencode, urljoin, urlsplit

import botocore.exceptions
import botocore.httpsession
import botocore.utils
import urllib3
from botocore import UNSIGNED
from botocore.compat import unquote_str

from bucketfs.backends import versions
from bucketfs.backends.digests import received_digest, s3_answer_digest
from bucketfs.backends.http.body import body_deadline_s, read_body, receive_into
from bucketfs.backends.http.checksums import S3_CHECKSUM_MODE_HEADERS
from bucketfs.backends.http.curl import BodyTransfer, Transfer
from bucketfs.backends.http.sigv4 import Signer, host_of

log = logging.getLogger(__name__)

_DUMMY_KEY = "bucketfs-probe-key"
_XML_FIELD_RE = {name: re.compile(rf"<{name}>(.*?)</{name}>", re.S) for name in ("Code", "Message")}


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)

# Statuses that send a request elsewhere, with a Location header.
REDIRECT_STATUSES = frozenset((301, 302, 303, 307, 308))
# Hops followed for one request: AIStore takes one (gateway -> target); more is a loop.
REDIRECT_HOPS_MAX = 4


def redirect_url(url: str, location: str) -> str:
    """Where a redirect from `url` with header `location` sends the request, in the
    canonical form SigV4 signs: the path as the server wrote it (encoded once), the
    query's names and values encoded as SigV4 encodes them."""
    target = urljoin(url, location.strip())
    base, _, query = target.partition("?")
    base = base.partition("#")[0]
    if not query:
        return base
    pairs = [item.partition("=") for item in query.partition("#")[0].split("&") if item]
    return (
        base
        + "?"
        + "&".join(
            f"{quote(unquote(name), safe='-_.~')}={quote(unquote(value), safe='-_.~')}" for name, _, value in pairs
        )
    )


def error_response(status: int, body: bytes) -> dict:
    """A ClientError's response for an error answer: the Code and Message of S3's XML
    body, else the status as the code."""
    text = body.decode("utf-8", "replace")
    code = (_XML_FIELD_RE["Code"].search(text) or [None, str(status)])[1]
    message = (_XML_FIELD_RE["Message"].search(text) or [None, ""])[1]
    return {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}


def too_many_redirects(url: str) -> botocore.exceptions.ClientError:
    """The error of a request still redirected after REDIRECT_HOPS_MAX hops (EIO)."""
    return botocore.exceptions.ClientError(
        {
            "Error": {
                "Code": "TooManyRedirects",
                "Message": f"still redirected after {REDIRECT_HOPS_MAX} hops ({url})",
            },
            "ResponseMetadata": {"HTTPStatusCode": 310},
        },
        "GetObject",
    )


def ca_bundle(session) -> str:
    """The certificates botocore trusts for this session: AWS_CA_BUNDLE or the
    profile's ca_bundle, then REQUESTS_CA_BUNDLE, else its default (certifi's bundle).
    The lean requests must trust exactly these: a store behind a private CA (MinIO,
    Ceph) is configured this way, and urllib3 alone would use the system store."""
    botocore_session = getattr(session, "_session", session)  # boto3 Session -> botocore's
    configured = botocore_session.get_config_variable("ca_bundle") or os.environ.get("REQUESTS_CA_BUNDLE")
    return configured or botocore.httpsession.get_cert_path(True)


_UTC_SECOND_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.(\d{1,9}))?Z\Z")
_SECONDS_SEEN: dict = {}  # "YYYY-MM-DDTHH:MM:SS" -> its _mtime_ns, for the listings' common shape
_SECONDS_SEEN_MAX = 4096


def _mtime_ns(text: str) -> int:
    """Nanoseconds since the epoch of a listed LastModified; 0 for a time before the
    epoch (AIStore lists Go's zero time for objects never read) or none at all.
    The usual shape (UTC, 'Z') takes its second from a table: objects listed together
    were mostly written within seconds of each other."""
    match = _UTC_SECOND_RE.match(text) if text else None
    if match is not None:
        second = text[:19]
        base_ns = _SECONDS_SEEN.get(second)
        if base_ns is None:
            base_ns = _mtime_ns_parsed(second + "Z")
            if len(_SECONDS_SEEN) >= _SECONDS_SEEN_MAX:
                _SECONDS_SEEN.clear()
            _SECONDS_SEEN[second] = base_ns
        fraction = match.group(1)
        if base_ns <= 0 and not (base_ns == 0 and second == "1970-01-01T00:00:00"):
            return 0
        # (Microseconds, as datetime keeps them: the same value as parsed whole.)
        return base_ns + (int(fraction[:6].ljust(6, "0")) * 1000 if fraction else 0)
    return _mtime_ns_parsed(text)


def _mtime_ns_parsed(text: str) -> int:
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (AttributeError, ValueError):
        return 0
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max((when - _EPOCH) // datetime.timedelta(microseconds=1) * 1000, 0)


# A ListObjectsV2 page as S3, MinIO, Ceph and rclone write it: flat, unprefixed tags,
# no CDATA. One regular-expression pass reads it without building ~8 Elements per key.
# Alone it is only ~1.5x faster (200 keys: ~1.4 -> ~1.0 ms), but inside the daemon,
# with many pages at once, a cold 52-page ImageFolder scan took 0.41 s of daemon CPU
# with ElementTree against 0.29 s this way (scan 0.58 -> 0.46 s; W2 of scripts/bench.py).
# Anything else goes to ElementTree (see parse_list_page).
_OBJECT_FIELDS_RE = re.compile(r"<(Key|LastModified|ETag|Size)>([^<]*)</")
_PREFIX_RE = re.compile(r"<CommonPrefixes>\s*<Prefix>([^<]*)</Prefix>\s*</CommonPrefixes>")
# (AWS writes ChecksumAlgorithm and ChecksumType between ETag and Size, for objects
# stored with a checksum.)
_OBJECT_IN_ORDER_RE = re.compile(
    r"<Contents>\s*<Key>([^<]*)</Key>\s*<LastModified>([^<]*)</LastModified>\s*<ETag>([^<]*)</ETag>"
    r"(?:\s*<Checksum\w*>[^<]*</Checksum\w*>)*\s*<Size>(\d+)</Size>"
)
# The same entries as S3, MinIO and rclone write them, with nothing between the tags:
# tried first, as it is matched in ~60% of the time (200 KB page: ~0.55 -> ~0.35 ms).
_OBJECT_COMPACT_RE = re.compile(
    r"<Contents><Key>([^<]*)</Key><LastModified>([^<]*)</LastModified><ETag>([^<]*)</ETag><Size>(\d+)</Size>"
)
_TOP_FIELD_RE = {
    tag: re.compile(rf"<{tag}>([^<]*)</{tag}>") for tag in ("IsTruncated", "NextContinuationToken", "EncodingType")
}


def _parse_fast(body: bytes) -> Optional[tuple]:
    """The page by regular expressions; None if it is not in the plain shape."""
    text = body.decode("utf-8")
    # Not the plain shape: prefixed elements (<s3:Contents>: the counts of entries and
    # of their tags would not add up), or CDATA outside the entries (inside one, the
    # entry's match fails and the counts tell). (Each scan of a 200 KB page costs
    # ~0.1 ms: the guards are counts, as few as a plain page needs.)
    tag_ends = text.count("Contents>")  # "<Contents>" and "</Contents>", prefixed or not
    first_entry = text.find("<Contents>")
    last_entry = text.rfind("</Contents>")
    if (
        "CDATA" in (text if first_entry < 0 else text[:first_entry])
        or (last_entry >= 0 and "CDATA" in text[last_entry:])
        or (tag_ends == 0 and (":Key" in text or ":Prefix" in text))
    ):
        return None
    # XML's five entities and &#...; are HTML's too; most pages have none.
    unescape = html.unescape if "&" in text else (lambda value: value)

    def top(tag: str) -> Optional[str]:
        match = _TOP_FIELD_RE[tag].search(text)
        return None if match is None else unescape(match.group(1))

    decode = unquote_str if top("EncodingType") == "url" else (lambda value: value)
    objects = []
    # The fields in S3's own order (S3, MinIO, rclone write them so): one match per
    # object, then each field of every object at once (_objects_of).
    rows = _OBJECT_COMPACT_RE.findall(text)
    if 2 * len(rows) != tag_ends:
        rows = _OBJECT_IN_ORDER_RE.findall(text)
    if 2 * len(rows) == tag_ends:  # (each matched entry opens and closes one plain tag: no other entry)
        return _page_rest(text, _objects_of(rows, decode is unquote_str), unescape, decode, top)
    contents_count = text.count("<Contents>")
    if tag_ends != 2 * contents_count:
        return None
    # Every <Contents> has each of the four fields once, in any order: then the matches
    # split into groups of four, one group per object, with no guessing.
    fields = _OBJECT_FIELDS_RE.findall(text)
    if len(fields) != 4 * contents_count:
        return None
    for i in range(0, len(fields), 4):
        record = dict(fields[i : i + 4])
        if len(record) != 4:
            return None
        try:
            objects.append(
                (
                    decode(unescape(record["Key"])),
                    int(record["Size"]),
                    _mtime_ns(record["LastModified"]),
                    unescape(record["ETag"]),
                )
            )
        except ValueError:
            return None
    return _page_rest(text, objects, unescape, decode, top)


def _objects_of(rows: list, url_encoded: bool) -> list:
    """[(key, size, mtime_ns, etag)] of the (key, LastModified, ETag, Size) matches of a
    page, each field decoded for all objects at once where none needs more (C loops,
    not one Python step per object: a flat page of 1,000 keys ~2.7 -> ~0.7 ms with
    the match): keys with no '&', '%' or '+' are as written; a modification time is
    parsed once per page; ETags have their &quot; replaced."""
    if not rows:
        return []
    keys, modified, etags, sizes = zip(*rows)
    joined = "\x00".join(keys)
    if "&" in joined or (url_encoded and ("%" in joined or "+" in joined)):
        keys = tuple(unquote_str(html.unescape(key)) if url_encoded else html.unescape(key) for key in keys)
    times = {text: _mtime_ns(text) for text in set(modified)}
    joined = "\x00".join(etags)
    if "&" in joined:  # (S3 quotes its ETags as &quot;, and nothing else in them)
        quoted = joined.replace("&quot;", '"')
        etags = tuple(quoted.split("\x00")) if "&" not in quoted else tuple(html.unescape(etag) for etag in etags)
    return list(zip(keys, map(int, sizes), map(times.__getitem__, modified), etags))


def _page_rest(text: str, objects: list, unescape, decode, top) -> Optional[tuple]:
    """_parse_fast's answer, with the page's prefixes and continuation."""
    prefixes_count = text.count("<CommonPrefixes>")
    prefixes = [decode(unescape(value)) for value in _PREFIX_RE.findall(text)] if prefixes_count else []
    if len(prefixes) != prefixes_count:
        return None
    truncated = top("IsTruncated") == "true"
    return objects, prefixes, top("NextContinuationToken") if truncated else None, truncated


def _parse_tree(body: bytes) -> tuple:
    root = ElementTree.fromstring(body)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    encoded = root.findtext(f"{ns}EncodingType") == "url"
    decode = unquote_str if encoded else (lambda text: text)
    objects = [
        (
            decode(item.findtext(f"{ns}Key")),
            int(item.findtext(f"{ns}Size") or ""),
            _mtime_ns(item.findtext(f"{ns}LastModified") or ""),
            item.findtext(f"{ns}ETag") or "",
        )
        for item in root.iterfind(f"{ns}Contents")
    ]
    prefixes = [decode(item.findtext(f"{ns}Prefix")) for item in root.iterfind(f"{ns}CommonPrefixes")]
    truncated = root.findtext(f"{ns}IsTruncated") == "true"
    return objects, prefixes, root.findtext(f"{ns}NextContinuationToken") if truncated else None, truncated


def cut_page_at(body: bytes, end: str) -> Optional[bytes]:
    """A flat page (its keys in order) without the entries of keys past `end`, closed
    again, for parse_list_page; None if none is past it, or the page is not in the
    plain shape (then it is read whole). The page's last key is looked at first (a page
    within its range costs one decoded key), then the first past `end` is found by
    bisection over the text: O(log n) keys decoded, and the rest of a page that
    overlaps the next range costs no parsing."""
    text = body.decode("utf-8")
    encoded = "<EncodingType>url</EncodingType>" in text

    def key_at(at: int) -> Optional[tuple]:
        """(key, where its <Key> starts) of the first <Key> at or after `at`, or None."""
        found = text.find("<Key>", at)
        if found < 0:
            return None
        close = text.find("</Key>", found)
        if close < 0:
            return None
        value = text[found + 5 : close]
        value = html.unescape(value) if "&" in value else value
        return (unquote_str(value) if encoded else value), found

    last = text.rfind("<Key>")
    if last < 0:
        return None
    last_key = key_at(last)
    if last_key is None or last_key[0] <= end:
        return None
    if "CDATA" in text or ":Contents" in text or ":Key" in text:
        return None
    # The first key past `end` lies in (low, high]: bisect on offsets into the text.
    low, high = text.find("<Key>"), last
    first = key_at(low)
    if first is None:
        return None
    if first[0] > end:
        high = low
    else:
        while True:
            middle = key_at((low + high) // 2 + 1)
            if middle is None or middle[1] >= high:  # none after the middle: the one after low?
                middle = key_at(low + 1)
                if middle is None or middle[1] >= high:
                    break  # no key between low and high: high is the first past `end`
            if middle[0] > end:
                high = middle[1]
            else:
                low = middle[1]
    at = text.rfind("<Contents>", 0, high)
    if at < 0 or "</Contents>" in text[at:high]:
        return None
    # What the page says after its entries (rclone writes EncodingType there) stays said.
    tail = "<EncodingType>url</EncodingType>" if encoded else ""
    return (text[:at] + tail + "</ListBucketResult>").encode("utf-8")


def parse_page_until(body: bytes, end: Optional[str]) -> tuple:
    """parse_list_page of a flat page, no key past `end` decoded (a page cut there is
    not truncated); of any page when `end` is None."""
    if end is not None:
        cut = cut_page_at(body, end)
        if cut is not None:
            objects, _prefixes, _token, _truncated = parse_list_page(cut)
            return objects, [], None, False
    return parse_list_page(body)


# The size a LIST answer's deadline allows for (read_body's slowest rate): a page of
# 1,000 keys is ~0.2-0.4 MB.
LIST_BODY_DEADLINE_BYTES = 1024 * 1024


def parse_list_page(body: bytes) -> tuple:
    """(objects [(key, size, mtime_ns, etag)], prefixes, next_token, truncated) of one page."""
    return _parse_fast(body) or _parse_tree(body)


class LeanS3:
    def __init__(
        self,
        client,
        session,
        bucket: str,
        max_connections_count: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        unsigned: bool,
    ):
        """`session`: the boto3 session; credentials and the CA bundle come from it."""
        self.client, self.bucket = client, bucket
        self.base_url: Optional[str] = None  # ".../<bucket>/" or "https://<bucket>.host/"; first use
        self.region = client.meta.region_name
        self.session = session
        self.unsigned = unsigned
        self.read_timeout_s = read_timeout_s
        self.signer = Signer(self.region)
        # True where the curl engine signs the GETs itself (fetch workers: the
        # signature's HMACs leave the daemon's main thread); set by the backend.
        self.sign_in_engine = False
        self.usable = True
        self.off_reason = ""  # why `usable` turned false (logged by the backend's transport swap)
        self.redirects_count = 0  # hops followed (every path: S3Backend counts the SDK's here too)
        # Pools per host: the endpoint's, and those of the hosts redirects lead to
        # (an AIStore cluster's targets).
        self.pool = urllib3.PoolManager(
            num_pools=32,
            maxsize=max_connections_count,
            block=False,
            retries=False,
            ca_certs=ca_bundle(session),
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
        )

    def _credentials(self):
        """The session's credentials now (frozen: refreshed first where they expire)."""
        credentials = self.session.get_credentials()
        if credentials is None:
            raise botocore.exceptions.NoCredentialsError()
        return credentials.get_frozen_credentials()

    def _headers(self, url: str, headers: dict, host: Optional[str] = None) -> dict:
        """`headers` signed for a GET of `url` on `host` (default: the endpoint's)."""
        if self.unsigned:
            return headers
        return self.signer.sign_get(self._credentials(), url, host or self._host, headers)

    def signed_for(self, url: str, headers: dict) -> dict:
        """`headers` signed for a GET of `url` on its own host (a redirect's target)."""
        return self._headers(url, headers, host_of(url))

    def resolve_early(self) -> None:
        """Resolve the path when the backend is built, to choose its transport from it.
        Where that raises (a bucket name botocore refuses), it stays unresolved: the
        first request resolves it on a worker thread, where the error is classified
        like any other."""
        try:
            self._resolve()
        except Exception as exc:  # noqa: BLE001 - raised again, classified, by the first request
            log.debug("lean path not resolved at start (%s: %s)", type(exc).__name__, exc)

    def _presigned_url(self) -> str:
        """A presigned GET of a dummy key: the endpoint, addressing style and region as
        botocore resolves them. Unsigned (a choose-signer hook that answers presigns
        only; bucketfs presigns nothing else): only its URL is used, so no credentials
        are fetched for it (an assumed role's would be, over the network)."""

        def unsigned(context=None, **_kwargs):
            return UNSIGNED if context and context.get("is_presign_request") else None

        events = self.client.meta.events
        events.register_first("choose-signer.s3.GetObject", unsigned, unique_id="bucketfs-unsigned-presign")
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": _DUMMY_KEY}, ExpiresIn=60
        )

    def _base(self) -> str:
        """base_url, once resolved (the callers checked _resolve())."""
        assert self.base_url is not None
        return self.base_url

    def _resolve(self) -> bool:
        if self.base_url is None:
            # Where resolve_early could not, worker threads call this at once on first
            # use: everything is set before base_url, whose value says "resolved" to the others.
            url = self._presigned_url()
            base_url = url.split("?", 1)[0][: -len(_DUMMY_KEY)]
            self._host = host_of(base_url)
            if not base_url.endswith("/"):
                self.off_reason = f"the endpoint's object URLs ({base_url}) cannot be extended"
                self.usable = False
            elif botocore.utils.get_environ_proxies(base_url).get(urlsplit(base_url).scheme):
                # botocore sends this endpoint's requests through HTTP(S)_PROXY; so must we,
                # and the client does that already: a direct connection may not be allowed.
                self.off_reason = f"a proxy is set for {self._host}"
                self.usable = False
            else:
                # One host: its connection pool directly, without PoolManager parsing
                # and normalising every URL (~5% of a small-file GET's CPU).
                self._host_pool = self.pool.connection_from_url(base_url)
                self._origin_len = len(base_url) - len(urlsplit(base_url).path)
                self._origin = base_url[: self._origin_len]
            self.base_url = base_url
        return self.usable

    def _request(self, url: str, headers: dict):
        """One GET on the wire, unread (the tests' fault injection replaces this)."""
        # decode_content=False: the stored bytes, as botocore reads them. urllib3 would
        # gunzip an object stored with Content-Encoding: gzip, whose listed size, ranges
        # and ETag are those of the stored bytes (every read of one gave ESTALE or EIO).
        if url.startswith(self._origin) and url[self._origin_len : self._origin_len + 1] == "/":
            return self._host_pool.urlopen(
                "GET",
                url[self._origin_len :],
                headers=headers,
                preload_content=False,
                decode_content=False,
                redirect=False,
                retries=False,
            )
        return self.pool.urlopen(
            "GET", url, headers=headers, preload_content=False, decode_content=False, redirect=False, retries=False
        )  # (a redirect's target)

    def _send(
        self,
        url: str,
        headers: dict,
        ok_statuses,
        buffer: Optional[bytearray] = None,
        byte_range: Optional[tuple] = None,
    ) -> Optional[tuple]:
        """(status, headers, body) for an answer in `ok_statuses`; None if this path
        cannot serve the bucket; a botocore ClientError for any other answer. With
        `buffer`, a ranged body (Content-Range) is received into it and `body` is its length.
        `byte_range` (start, end) of a ranged GET: if the server ignored it (a 200 with
        no Content-Range), `body` is that range of the whole object, read only so far.
        Redirects are followed (module docstring)."""
        signed, hops = self._headers(url, headers), 0
        while True:
            response = self._request(url, signed)
            location = response.headers.get("Location")
            if response.status not in REDIRECT_STATUSES or not location:
                break
            response.drain_conn()  # (a redirect's body is a few bytes at most)
            response.release_conn()
            url = redirect_url(url, location)
            if hops == REDIRECT_HOPS_MAX:
                raise too_many_redirects(url)
            hops += 1
            self.redirects_count += 1
            signed = self.signed_for(url, headers)
        expected_bytes = getattr(response, "length_remaining", None) or (len(buffer) if buffer is not None else 0)
        deadline_s = body_deadline_s(self.read_timeout_s, expected_bytes)
        body: Any  # the bytes, or with `buffer` how many of them it received
        try:
            if buffer is not None and response.status in (200, 206) and "Content-Range" in response.headers:
                body = receive_into(response, buffer, deadline_s, self.read_timeout_s)
            elif byte_range is not None and response.status == 200 and "Content-Range" not in response.headers:
                body = read_body(response, deadline_s, *byte_range)
            else:
                body = read_body(response, deadline_s)
        finally:
            response.release_conn()
        status = response.status
        if status in ok_statuses:
            return status, response.headers, body
        self._refused(status, body)
        return None

    def _refused(self, status: int, body: bytes) -> None:
        """An answer not in the expected statuses: None, having switched this path off
        (a redirect without a Location, or a region error), or a botocore ClientError raised."""
        response = error_response(status, body)
        code = response["Error"]["Code"]
        if 300 <= status < 400 or code in (
            "AuthorizationHeaderMalformed",
            "PermanentRedirect",
            "IllegalLocationConstraintException",
        ):
            self.off_reason = f"the lean path was refused with {status} {code}"
            self.usable = False
            return None
        raise botocore.exceptions.ClientError(response, "S3")

    def get(self, key: str, start: int, end: int, version: str, buffer: Optional[bytearray] = None) -> Optional[tuple]:
        """(status, etag, content_range or None, body, digest, last_modified) of a ranged
        GET pinned to `version` (without Content-Range, the server ignored Range: `body`
        is the range all the same); with `buffer`, a ranged body is received into it and
        `body` is its length. `digest`: the MD5 the ETag states of the whole object, if it
        states one. `last_modified`: the Last-Modified header, or None."""
        if not self._resolve():
            return None
        url = self._base() + quote(key, safe="/~")
        answer = self._send(url, self.range_headers(start, end, version), (200, 206, 416), buffer, (start, end))
        if answer is None:
            return None
        status, headers, body = answer
        return (
            status,
            headers.get("ETag", ""),
            headers.get("Content-Range"),
            body,
            s3_answer_digest(headers),
            headers.get("Last-Modified"),
        )

    @staticmethod
    def range_headers(start: int, end: int, version: str) -> dict:
        """A GET's headers; from the object's first byte, AWS is asked for the checksum
        it keeps of the whole object (digests.py checks a whole one by it)."""
        headers = {"Range": f"bytes={start}-{end - 1}", **versions.condition_headers(version)}
        return {**headers, **S3_CHECKSUM_MODE_HEADERS} if start == 0 else headers

    def transfer(self, key: str, start: int, end: int, version: str, buffer: bytearray) -> Optional[Transfer]:
        """get() as a signed curl.Transfer into `buffer` (len end - start); None
        if this path cannot serve the bucket. Its answer: answer_of(transfer)."""
        if not self._resolve():
            return None
        url = self._base() + quote(key, safe="/~")
        headers = self.range_headers(start, end, version)
        if self.sign_in_engine and not self.unsigned:
            # Signed where the engine runs it (a fetch worker), off this thread.
            return Transfer.ranged(url, {}, buffer, start, self.read_timeout_s, self._signing(headers))
        return Transfer.ranged(url, self._headers(url, headers), buffer, start, self.read_timeout_s)

    def push_transfer(self, key: str, size_bytes: int, version: str) -> Optional[Transfer]:
        """The GET of the whole object for a worker's push (workerengine.push): signed
        there; its buffer stays empty here. None if this path cannot serve the bucket."""
        if not self._resolve():
            return None
        url = self._base() + quote(key, safe="/~")
        headers = self.range_headers(0, size_bytes, version)
        timeout_s = body_deadline_s(self.read_timeout_s, size_bytes) - time.monotonic()
        # (A BodyTransfer: a body that comes back, WANTed, is appended to its buffer.)
        if self.unsigned:
            lines = [f"{name}: {value}" for name, value in headers.items()]
            return BodyTransfer(url, lines, bytearray(), 0, timeout_s)
        return BodyTransfer(url, [], bytearray(), 0, timeout_s, signing=self._signing(headers))

    def _signing(self, headers: dict) -> tuple:
        """What an engine that signs (a worker) signs a GET of the endpoint's with."""
        credentials = self._credentials()
        return (self.region, credentials.access_key, credentials.secret_key, credentials.token, self._host, headers)

    def redirected(self, transfer: Transfer, start: int, end: int, version: str, hops: int) -> Optional[Transfer]:
        """The transfer that follows `transfer`'s answer if it is a redirect (signed
        for its target; into the same buffer, which a redirect's answer left
        untouched), else None. `hops`: redirects already followed for this GET."""
        location = transfer.headers.get("location")
        if transfer.error is not None or transfer.status not in REDIRECT_STATUSES or not location:
            return None
        url = redirect_url(transfer.url, location)
        if hops >= REDIRECT_HOPS_MAX:
            raise too_many_redirects(url)
        self.redirects_count += 1
        return Transfer.ranged(
            url,
            self.signed_for(url, self.range_headers(start, end, version)),
            transfer.buffer,
            start,
            self.read_timeout_s,
        )

    def answer_of(self, transfer: Transfer) -> Optional[tuple]:
        """get()'s answer for a finished transfer (`body`: the bytes received into its
        buffer); None if this path was switched off; raises as get() does."""
        if transfer.error is not None:
            raise transfer.error
        if transfer.status not in (200, 206, 416):
            self._refused(transfer.status, bytes(transfer.error_body))
            return None
        headers = transfer.headers
        digest = received_digest(s3_answer_digest(headers), transfer.body_hash)
        return (
            transfer.status,
            headers.get("etag", ""),
            headers.get("content-range"),
            transfer.received_bytes,
            digest,
            headers.get("last-modified"),
        )

    def list(
        self,
        prefix: str,
        token: Optional[str],
        max_keys: int,
        delimited: bool = True,
        start_after: str = "",
        end: Optional[str] = None,
    ) -> Optional[tuple]:
        """(objects [(key, size, mtime_ns, etag)], prefixes, next_token, truncated) of one
        page: delimited by '/', or (`delimited` False) every key under `prefix`, from
        the first after `start_after`, and (`end`) none past `end` decoded: a page cut
        there is not truncated."""
        url = self.list_url(prefix, token, max_keys, delimited, start_after)
        if url is None:
            return None
        answer = self._send(url, {}, (200,))
        if answer is None:
            return None
        return parse_page_until(answer[2], end if not delimited else None)

    def list_url(
        self, prefix: str, token: Optional[str], max_keys: int, delimited: bool = True, start_after: str = ""
    ) -> Optional[str]:
        """The URL of list()'s request; None if this path cannot serve the bucket."""
        if not self._resolve():
            return None
        params = {
            "list-type": "2",
            "encoding-type": "url",
            "max-keys": str(max_keys),
            "prefix": prefix,
        }
        if delimited:
            params["delimiter"] = "/"
        if start_after:
            params["start-after"] = start_after
        if token:
            params["continuation-token"] = token
        # The bucket URL is base_url minus its trailing slash's key part: base_url ends at "<bucket>/" or "/".
        return self._base() + "?" + urlencode(sorted(params.items()), quote_via=quote, safe="-_.~")

    def list_transfer(self, url: str) -> BodyTransfer:
        """The GET of list_url()'s `url`, signed, as a curl transfer of its whole answer."""
        deadline_s = body_deadline_s(self.read_timeout_s, LIST_BODY_DEADLINE_BYTES) - time.monotonic()
        return BodyTransfer(
            url, [f"{name}: {value}" for name, value in self._headers(url, {}).items()], bytearray(), 0, deadline_s
        )

    def close(self) -> None:
        self.pool.clear()
