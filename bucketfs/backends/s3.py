"""S3 (and S3-compatible) backend on boto3.

Role: the contract of backends/base.py over ListObjectsV2, HeadObject and ranged
GetObject. Invariants:
- One boto3 client, shared by the worker threads of one BlockingCaller; its pool
  holds as many connections as the caller runs threads. botocore's own retries are
  off: every retry happens in BlockingCaller, with jittered backoff, so attempts are
  bounded in one place.
- A read pinned to a version returns bytes of exactly that version or raises
  ObjectChanged. What a version is depends on what the store states (versions.py):
  its ETag, else its Last-Modified, else nothing but its size. We send the condition
  (If-Match, If-Unmodified-Since) AND compare the answer's ETag or Last-Modified,
  because some servers (rclone serve s3) ignore both, and its total size. An answer
  without an ETag for an ETag-pinned read is not served once the store has shown that
  its answers carry ETags: rclone answers so for an object being rewritten, and
  served as is it cut a new version at the old size.
- ETags are normalised (quotes stripped): LIST answers them unquoted on some
  servers, HEAD and GET always quote them.
- Redirects with a Location are followed on every GET path, signed again for the
  new host (s3_lean.py); the SDK's path sends the hop through the client's own HTTP
  session (its proxies, its CA bundle).
- `requests` counts the calls the core made, by type; retries of one call are
  counted in `caller.retries_count`. Both are touched only on the trio thread.
- Error messages never carry credentials (botocore never prints them; an endpoint
  URL's user-info is scrubbed).
"""

from __future__ import annotations

import datetime
import http.client
import logging
import re
from typing import Optional

import boto3
import botocore.awsrequest
import botocore.config
import botocore.exceptions
import botocore.utils
import trio
import urllib3.exceptions
from botocore import UNSIGNED

from bucketfs import errors
from bucketfs.backends import versions
from bucketfs.backends.base import Backend, ListPage, ObjectInfo, check_answer, gone_message, lists_entries
from bucketfs.backends.calls import BlockingCaller, RetryPolicy
from bucketfs.backends.digests import EtagChecks, check_whole_object, s3_etag_digest
from bucketfs.backends.http.body import copy_into, read_range_body
from bucketfs.backends.http.curl import SMALL_GET_MAX_BYTES, CurlEngine
from bucketfs.backends.s3_lean import (REDIRECT_HOPS_MAX, REDIRECT_STATUSES, LeanS3, ca_bundle, error_response,
                                       redirect_url, too_many_redirects)
from bucketfs.config import Config

log = logging.getLogger(__name__)

LIST_PAGE_KEYS_COUNT = 1000  # the S3 maximum: one page answers a whole typical directory
# check_bucket must answer within ~30 s even when packets to the endpoint are dropped:
# 3 attempts x 5 s connect timeout, plus backoff.
PROBE_ATTEMPTS_COUNT = 3
PROBE_CONNECT_TIMEOUT_S = 5.0
PROBE_READ_TIMEOUT_S = 10.0

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)

_NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404"}
_DENIED_CODES = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
                 "AccountProblem", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
                    "503", "500", "502", "504"}
_TRANSIENT_STATUSES = {429, 500, 502, 503, 504}
# Failures of the connection or of the body stream: the whole request is worth repeating.
_TRANSIENT_EXCEPTIONS = (
    botocore.exceptions.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError, ...
    botocore.exceptions.HTTPClientError,  # ReadTimeoutError, ConnectionClosedError, ResponseStreamingError
    botocore.exceptions.IncompleteReadError,
    urllib3.exceptions.HTTPError,  # ProtocolError, ReadTimeoutError, IncompleteRead
    http.client.IncompleteRead,
    ConnectionError,
    TimeoutError,
)
# Failures to reach the endpoint at all: check_bucket reports these as EndpointUnreachable.
_UNREACHABLE_EXCEPTIONS = (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError)
_USERINFO_RE = re.compile(r"//[^/@\s]+@")


def _scrub(text: str) -> str:
    return _USERINFO_RE.sub("//***@", text)


def classify(exc: BaseException) -> errors.BucketfsError:
    """Map a boto3/botocore/urllib3 exception to a bucketfs error (see module docstring)."""
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        text = _scrub(f"{exc.operation_name}: {code or status} {error.get('Message', '')}".strip())
        if code == "NoSuchBucket":
            return errors.BucketNotFound(text)
        if code in _NOT_FOUND_CODES or status == 404:
            return errors.NotFound(text)
        if code == "RequestTimeTooSkewed":
            # A 403 the credentials are not to blame for: this machine's clock is off (a VM
            # at boot, before its clock is synced). Retried, and at mount exit 5, which
            # systemd retries, not 4, which it does not.
            return errors.TransientError(f"{text} (is this machine's clock right?)")
        if code in _DENIED_CODES or status == 403:
            return errors.AccessDenied(text)
        if code == "PreconditionFailed" or status == 412:
            return errors.ObjectChanged(text)
        if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUSES:
            return errors.TransientError(text)
        return errors.BackendError(text)
    if isinstance(exc, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)):
        return errors.AccessDenied(f"{exc} (set AWS credentials or a profile, or use --no-sign-request)")
    if isinstance(exc, botocore.exceptions.CredentialRetrievalError):
        # Refreshing temporary credentials failed (the instance metadata service, SSO or a
        # credential_process did not answer): worth retrying, like the store itself.
        return errors.TransientError(_scrub(f"credentials could not be refreshed: {exc}"))
    if isinstance(exc, _TRANSIENT_EXCEPTIONS):
        return errors.TransientError(_scrub(f"{type(exc).__name__}: {exc}"))
    return errors.BackendError(_scrub(f"{type(exc).__name__}: {exc}"))


def _into(buffer: Optional[bytearray], data: bytes):
    """`data` itself, or with a buffer: copied into it, and its length."""
    return data if buffer is None else copy_into(buffer, data)


def normalise_etag(etag: str) -> str:
    return etag.strip('"') if etag else ""


def _mtime_ns(when: Optional[datetime.datetime]) -> int:
    # Integer arithmetic: a float timestamp * 1e9 loses the low bits of a nanosecond count.
    # A time before the epoch (AIStore's zero time for objects never read) or none: 0.
    if when is None:
        return 0
    return max((when - _EPOCH) // datetime.timedelta(microseconds=1) * 1000, 0)


def check_region(region: str) -> None:
    """botocore's own rule for a region name, not a copy of it."""
    try:
        botocore.utils.validate_region_name(region)
    except botocore.exceptions.InvalidRegionError as exc:
        raise errors.InvalidOption(f"--region {region!r}: {exc}") from None


class S3Backend(Backend):
    receives_into = True  # the lean path's socket reads land in the part buffer

    def __init__(self, config: Config, session: Optional[boto3.session.Session] = None):
        """`session` lets tests pass explicit credentials; by default the profile's session."""
        super().__init__()
        self.bucket = config.url.bucket
        self._config = config
        if config.region:
            check_region(config.region)
        try:
            self._session = session or boto3.session.Session(profile_name=config.profile)
            self.client = self._make_client(config.connect_timeout_s, config.read_timeout_s)
        except botocore.exceptions.ProfileNotFound as exc:
            raise errors.AccessDenied(str(exc)) from None
        except ValueError as exc:  # "Invalid endpoint": the CLI's usage error
            raise errors.InvalidOption(f"--endpoint-url {config.endpoint_url!r}: {exc}") from None
        self.lean = LeanS3(self.client, self._session, self.bucket, config.max_connections_count,
                               config.connect_timeout_s, config.read_timeout_s, config.no_sign_request)
        # Without pycurl there is no engine, and while the lean path is off for the
        # bucket (a proxy, a redirect) it is not used: then every GET runs on a thread.
        self.curl = CurlEngine(config.max_connections_count, config.connect_timeout_s, config.read_timeout_s,
                               ca_bundle(self._session)) if CurlEngine.available() else None
        self.etag_checks = EtagChecks()
        self.answer_checks = versions.AnswerChecks(f"s3://{self.bucket}")
        self.caller = BlockingCaller(
            config.max_connections_count,
            RetryPolicy(config.retry_attempts_count, config.retry_base_delay_s, config.retry_max_delay_s),
            classify,
        )

    @property
    def redirects_count(self) -> int:
        return self.lean.redirects_count

    def _make_client(self, connect_timeout_s: float, read_timeout_s: float):
        config = self._config
        botocore_config = botocore.config.Config(
            region_name=config.region or self._session.region_name or "us-east-1",
            signature_version=UNSIGNED if config.no_sign_request else None,
            s3={"addressing_style": "path" if config.path_style else "auto"},
            max_pool_connections=config.max_connections_count,
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"total_max_attempts": 1},  # BlockingCaller retries, with backoff
            # Flexible checksums off unless an operation requires them: rclone serve s3
            # sends the whole object's CRC with a ranged GET, which botocore would then
            # reject; our version check (ETag) already guards consistency.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        return self._session.client("s3", endpoint_url=config.endpoint_url, config=botocore_config)

    # -- blocking bodies, run in worker threads --------------------------------
    def _list_blocking(self, client, prefix: str, token: Optional[str], max_keys: int) -> dict:
        kwargs = {"Bucket": self.bucket, "Prefix": prefix, "Delimiter": "/", "MaxKeys": max_keys}
        if token:
            kwargs["ContinuationToken"] = token
        # boto3 asks for EncodingType=url and decodes keys itself, so any UTF-8 key
        # (including characters XML 1.0 cannot carry) round-trips exactly.
        return client.list_objects_v2(**kwargs)

    def _get_blocking(self, key: str, start: int, end: int, version: str, buffer: Optional[bytearray],
                      object_bytes: Optional[int]):
        """The bytes, or with `buffer` the number of bytes written into it; None when the
        range starts past the end (416). Checked here, in the worker, where a short
        answer is retried (check_answer)."""
        return self._checked(key, start, end, version, self._get_unchecked_blocking(key, start, end, version, buffer),
                             buffer, object_bytes)

    def _checked(self, key: str, start: int, end: int, version: str, answer: Optional[tuple],
                 buffer: Optional[bytearray], object_bytes: Optional[int]):
        """_get_blocking's answer from (etag, content_range, body, digest, last_modified),
        or None; with `buffer`, `body` is the number of bytes received into it. A whole
        object is checked against its ETag where that is an MD5 (digests.py)."""
        if answer is None:
            return None
        etag, content_range, body, digest, last_modified = answer
        self.answer_checks.check(key, version, etag, last_modified)
        received_bytes = body if buffer is not None else len(body)
        check_answer(key, start, end, received_bytes, content_range, object_bytes)
        check_whole_object(key, digest, start, body if buffer is None else memoryview(buffer)[:received_bytes],
                           object_bytes, content_range, self.etag_checks)
        return body

    async def _get_curl(self, key: str, start: int, end: int, version: str, buffer: bytearray,
                        object_bytes: Optional[int]):
        """_get_blocking's answer, by http/curl.py; on a worker thread after all when the
        lean path cannot serve the bucket. (One attempt: BlockingCaller.run retries it.)"""
        transfer = self.lean.transfer(key, start, end, version, buffer)
        answer = None
        if transfer is not None:
            hops = 0
            await self.curl.get(transfer)
            while (following := self.lean.redirected(transfer, start, end, version, hops)) is not None:
                transfer, hops = following, hops + 1
                await self.curl.get(transfer)
            answer = self.lean.answer_of(transfer)
        if answer is None:
            return await trio.to_thread.run_sync(self._get_blocking, key, start, end, version, buffer, object_bytes,
                                                 limiter=self.caller.limiter)
        status, etag, content_range, got_bytes, digest, last_modified = answer
        if status == 416:
            return None
        return self._checked(key, start, end, version,
                             (normalise_etag(etag), content_range, got_bytes, digest, last_modified), buffer, object_bytes)

    def _get_unchecked_blocking(self, key: str, start: int, end: int, version: str, buffer: Optional[bytearray]):
        """(etag, content_range, bytes, digest, last_modified), or with `buffer` (etag,
        content_range, bytes written into it, ...); None when the range starts past the
        end (416)."""
        if self.lean.usable:
            answer = self.lean.get(key, start, end, version, buffer)
            if answer is not None:
                status, etag, content_range, body, digest, last_modified = answer
                if status == 416:
                    return None
                if not content_range:  # a server that ignored Range: the range was kept
                    body = _into(buffer, body)
                return normalise_etag(etag), content_range, body, digest, last_modified
        condition = {"IfMatch": f'"{version}"'} if versions.kind(version) == versions.ETAG else {}
        if versions.kind(version) == versions.LASTMOD:
            condition = {"IfUnmodifiedSince": versions.lastmod_s(version) + 1}
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}", **condition)
        except botocore.exceptions.ClientError as exc:
            metadata = exc.response.get("ResponseMetadata", {})
            status, location = metadata.get("HTTPStatusCode"), metadata.get("HTTPHeaders", {}).get("location")
            if status in REDIRECT_STATUSES and location:
                url = self.client.meta.endpoint_url  # (only its scheme and host matter to urljoin)
                return self._get_redirected_blocking(redirect_url(url, location), key, start, end, version, buffer)
            if status == 416:
                return None
            raise
        return self._sdk_answer(response, start, end, buffer)

    def _sdk_answer(self, response: dict, start: int, end: int, buffer: Optional[bytearray]) -> tuple:
        body = response["Body"]
        try:
            # Read the whole body here, in the worker: a reset mid-body raises in this
            # thread and BlockingCaller repeats the whole request.
            data = read_range_body(body._raw_stream, self._config.read_timeout_s, start, end,
                                   whole_object=not response.get("ContentRange"))
        finally:
            body.close()
        digest = s3_etag_digest(response.get("ETag", ""), response.get("ServerSideEncryption"),
                                response.get("SSECustomerAlgorithm"))
        last_modified = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("last-modified")
        return (normalise_etag(response.get("ETag", "")), response.get("ContentRange"), _into(buffer, data), digest,
                last_modified)

    def _get_redirected_blocking(self, url: str, key: str, start: int, end: int, version: str,
                                 buffer: Optional[bytearray]):
        """The SDK path's GET, redirected to `url`: signed again for that host and sent
        through the client's HTTP session (its proxies and CA bundle), hop by hop."""
        http_session = self.client._endpoint.http_session
        headers = self.lean.range_headers(start, end, version)
        hops = 1
        self.lean.redirects_count += 1
        while True:
            request = botocore.awsrequest.AWSRequest("GET", url, headers=self.lean.signed_for(url, headers))
            request.stream_output = True
            response = http_session.send(request.prepare())
            location = response.headers.get("location")
            if response.status_code in REDIRECT_STATUSES and location:
                response.raw.drain_conn()
                response.raw.release_conn()
                url = redirect_url(url, location)
                if hops == REDIRECT_HOPS_MAX:
                    raise too_many_redirects(url)
                hops += 1
                self.lean.redirects_count += 1
                continue
            if response.status_code == 416:
                response.raw.release_conn()
                return None
            if response.status_code not in (200, 206):
                raise botocore.exceptions.ClientError(error_response(response.status_code, response.content), "GetObject")
            try:
                data = read_range_body(response.raw, self._config.read_timeout_s, start, end,
                                       whole_object="content-range" not in response.headers)
            finally:
                response.raw.release_conn()
            headers_in = response.headers
            digest = s3_etag_digest(headers_in.get("etag", ""), headers_in.get("x-amz-server-side-encryption"),
                                    headers_in.get("x-amz-server-side-encryption-customer-algorithm"))
            return (normalise_etag(headers_in.get("etag", "")), headers_in.get("content-range"), _into(buffer, data),
                    digest, headers_in.get("last-modified"))

    # -- contract ---------------------------------------------------------------
    def _list_page_blocking(self, prefix: str, token: Optional[str]) -> tuple:
        """(objects [(key, size, mtime_ns, etag)], prefixes, next_token, truncated)."""
        if self.lean.usable:
            answer = self.lean.list(prefix, token, LIST_PAGE_KEYS_COUNT)
            if answer is not None:
                return answer
        response = self._list_blocking(self.client, prefix, token, LIST_PAGE_KEYS_COUNT)
        objects = [(item["Key"], item["Size"], _mtime_ns(item.get("LastModified")), item.get("ETag", ""))
                   for item in response.get("Contents", ())]
        prefixes = [item["Prefix"] for item in response.get("CommonPrefixes", ())]
        truncated = bool(response.get("IsTruncated"))
        return objects, prefixes, response.get("NextContinuationToken") if truncated else None, truncated

    async def list_page(self, prefix: str, token: Optional[str] = None) -> ListPage:
        self.requests["list"] += 1
        raw_objects, prefixes, next_token, truncated = await self.caller.call(
            f"LIST {prefix!r}", self._list_page_blocking, prefix, token, abandon_on_cancel=True)
        # (A directory marker object, key == prefix, is among them: the namespace knows it
        # for the directory itself.)
        objects = [ObjectInfo(key, size, mtime_ns, versions.of_s3(etag, mtime_ns)) for key, size, mtime_ns, etag in raw_objects]
        for info in objects:
            self.answer_checks.note_listed(info.version)
        if truncated and not next_token:
            # A silently short directory would be worse than an error.
            raise errors.BackendError(f"LIST {prefix!r}: truncated page without a continuation token")
        return ListPage(objects, prefixes, next_token)

    async def stat(self, key: str) -> ObjectInfo:
        self.requests["head"] += 1
        response = await self.caller.call(f"HEAD {key!r}", lambda: self.client.head_object(Bucket=self.bucket, Key=key),
                                          abandon_on_cancel=True)
        mtime_ns = _mtime_ns(response.get("LastModified"))
        return ObjectInfo(key, response["ContentLength"], mtime_ns, versions.of_s3(response.get("ETag", ""), mtime_ns))

    async def read_range(self, key: str, start: int, end: int, version: str, object_bytes: Optional[int] = None) -> bytes:
        return await self._read(key, start, end, version, None, object_bytes)

    async def read_range_into(self, key: str, start: int, end: int, version: str, buffer: bytearray,
                              object_bytes: Optional[int] = None) -> int:
        return await self._read(key, start, end, version, buffer, object_bytes)

    async def _read(self, key: str, start: int, end: int, version: str, buffer: Optional[bytearray], object_bytes: Optional[int]):
        """The bytes, or with `buffer` the number of bytes written into it."""
        if end <= start:
            return b"" if buffer is None else 0
        self.requests["get"] += 1
        # Without a buffer, one of the range's size: the lean path receives the body
        # straight into it (read in pieces and joined, it took a second copy, and both
        # were alive at once).
        into = buffer if buffer is not None else bytearray(end - start)
        # Not abandoned on cancel: the bytes a thread (or a curl transfer, aborted first)
        # is still receiving stay counted in the memory budget until it returns (a dropped
        # read-ahead part waits for them), and nothing writes into a buffer after its part
        # has let go of it.
        what = f"GET {key!r} [{start}, {end})"
        try:
            if self.curl is not None and self.lean.usable and end - start <= SMALL_GET_MAX_BYTES:
                self.get_paths["curl"] += 1
                got_bytes = await self.caller.run(what, self._get_curl, key, start, end, version, into, object_bytes)
            else:
                self.get_paths["threads"] += 1
                got_bytes = await self.caller.call(what, self._get_blocking, key, start, end, version, into, object_bytes)
        except errors.NotFound:
            raise errors.ObjectChanged(gone_message(key)) from None
        if got_bytes is None:
            data = await self.confirm_past_end(key, version, start)
            return data if buffer is None else 0
        self.bytes_fetched += got_bytes
        if buffer is not None:
            return got_bytes
        del into[got_bytes:]  # (a range past the object's end: its shorter answer)
        return into

    async def check_bucket(self, prefix: str) -> bool:
        self.requests["list"] += 1
        # Its own short-timeout client and few attempts: the user waits for this answer.
        # (Made in a thread: building a client reads botocore's service models.)
        probe_client = await trio.to_thread.run_sync(
            self._make_client, min(self._config.connect_timeout_s, PROBE_CONNECT_TIMEOUT_S),
            min(self._config.read_timeout_s, PROBE_READ_TIMEOUT_S))
        policy = self.caller.policy
        probe = BlockingCaller(1, RetryPolicy(min(policy.attempts_count, PROBE_ATTEMPTS_COUNT), policy.base_delay_s,
                                              policy.max_delay_s), classify)
        try:
            # Two keys: the first may be the prefix's own directory marker.
            response = await probe.call(f"probe LIST {prefix!r}", self._list_blocking, probe_client, prefix, None, 2)
        except errors.TransientError as exc:
            if isinstance(exc.__cause__, botocore.exceptions.SSLError):
                raise errors.EndpointUnreachable(f"{exc} (a certificate signed by a private CA? "
                                                 "give the CA as AWS_CA_BUNDLE)") from exc.__cause__
            if isinstance(exc.__cause__, _UNREACHABLE_EXCEPTIONS):
                raise errors.EndpointUnreachable(str(exc)) from exc.__cause__
            raise
        finally:
            probe_client.close()
            self.caller.retries_count += probe.retries_count
        return lists_entries((item["Key"] for item in response.get("Contents", ())),
                             len(response.get("CommonPrefixes", ())), prefix)

    async def aclose(self) -> None:
        if self.curl is not None:
            self.curl.close()
        self.lean.close()
        self.client.close()
