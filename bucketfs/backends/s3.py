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
- GETs and LISTs go through one transport (s3_transport.py: libcurl and urllib3, urllib3
  alone, or the SDK client), chosen when the backend is built and logged; the only
  switch at run time is the lean path's refusal (a region error), which swaps to the
  SDK client for good, logged. HEADs and the probe always use the client.
- Redirects with a Location are followed on every transport, signed again for the
  new host (s3_lean.py); the SDK's sends the hop through the client's own HTTP
  session (its proxies, its CA bundle).
- `requests` counts the calls the core made, by type; retries of one call are
  counted in `caller.retries_count`. Both are touched only on the trio thread.
- Error messages never carry credentials (botocore never prints them; an endpoint
  URL's user-info is scrubbed).
"""

from __future__ import annotations

import bisect
import functools
import http.client
import itertools
import logging
import re
import threading
from typing import Callable, Optional

import boto3
import botocore.config
import botocore.exceptions
import botocore.utils
import trio
import urllib3.exceptions
from botocore import UNSIGNED

from bucketfs import errors
from bucketfs.backends import versions
from bucketfs.backends.base import (
    PAGE_KEYS_MAX,
    PUSH_FAILED,
    PUSH_NO_INODE,
    PUSH_READ,
    PUSH_REFUSED,
    PUSHED,
    Backend,
    ListPage,
    ObjectInfo,
    PushRequest,
    check_answer,
    gone_message,
    lists_entries,
)
from bucketfs.backends.calls import BlockingCaller, RetryPolicy
from bucketfs.backends.digests import S3_ETAG_NOT_MD5_HEADERS, EtagChecks, check_whole_object, s3_etag_digest
from bucketfs.backends.http.checksums import S3_CHECKSUM_HEADERS
from bucketfs.backends.http.curl import CurlEngine
from bucketfs.backends.http.fetchworker import DAMAGED, NO_INODE
from bucketfs.backends.http.workerengine import PushRefused, WorkerEngine, engine_workers, small_get_engine
from bucketfs.backends.s3_lean import REDIRECT_STATUSES, LeanS3, ca_bundle
from bucketfs.backends.s3_transport import CurlLean, S3Transport, Sdk, UrllibLean
from bucketfs.backends.s3_transport import mtime_ns as _mtime_ns
from bucketfs.backends.slots import fetch_ahead_slots
from bucketfs.config import Config

log = logging.getLogger(__name__)

# check_bucket must answer within ~30 s even when packets to the endpoint are dropped:
# 3 attempts x 5 s connect timeout, plus backoff.
PROBE_ATTEMPTS_COUNT = 3
PROBE_CONNECT_TIMEOUT_S = 5.0
PROBE_READ_TIMEOUT_S = 10.0

_NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404"}
_DENIED_CODES = {
    "AccessDenied",
    "403",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "AccountProblem",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
    "502",
    "504",
}
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


def check_region(region: str) -> None:
    """botocore's own rule for a region name, not a copy of it."""
    try:
        botocore.utils.validate_region_name(region)
    except botocore.exceptions.InvalidRegionError as exc:
        raise errors.InvalidOption(f"--region {region!r}: {exc}") from None


# ObjectInfo(*fields) without the named tuple's Python-level __new__: a C call.
_AS_OBJECT_INFO = functools.partial(tuple.__new__, ObjectInfo)


def object_infos(raw_objects: list) -> list:
    """ObjectInfo of each (key, size, mtime_ns, ETag) of a LIST page, its version as
    versions.of_s3 makes it, in C loops where every ETag is stated (index build makes
    one per key: 200,000 took 0.19 s of its 0.58 s of CPU one at a time)."""
    if not raw_objects:
        return []
    keys, sizes, mtimes, etags = zip(*raw_objects)
    stated = list(map(str.strip, etags, itertools.repeat('"')))
    if "" in stated:  # (a store that states no ETag: versions by time)
        stated = list(map(versions.of_s3, etags, mtimes))
    return list(map(_AS_OBJECT_INFO, zip(keys, sizes, mtimes, stated)))


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
        self.read_timeout_s = config.read_timeout_s
        self.lean = LeanS3(
            self.client,
            self._session,
            self.bucket,
            config.max_connections_count,
            config.connect_timeout_s,
            config.read_timeout_s,
            config.no_sign_request,
        )
        self.lean.resolve_early()  # (no request: where it resolves, what the transport can be)
        # The curl engine, where pycurl is installed and the lean path serves the bucket.
        usable_curl = CurlEngine.available() and self.lean.usable
        fetch_ahead_slots_count = fetch_ahead_slots(config) if usable_curl else 0
        self.curl = (
            small_get_engine(
                config.fetch_workers_count,
                config.max_connections_count + fetch_ahead_slots_count,
                config.connect_timeout_s,
                config.read_timeout_s,
                ca_bundle(self._session),
            )
            if usable_curl
            else None
        )
        self.lean.sign_in_engine = getattr(self.curl, "signs_requests", False)
        self.push_engine: Optional[WorkerEngine] = None  # start_pushing's
        # A push refused because the store answered with a redirect (AIStore's gateways):
        # every push would be, its GET wasted; none is sent from then on.
        self.pushes_redirected = False
        self.etag_checks = EtagChecks()
        self.answer_checks = versions.AnswerChecks(f"s3://{self.bucket}")
        self.caller = BlockingCaller(
            config.max_connections_count,
            RetryPolicy(config.retry_attempts_count, config.retry_base_delay_s, config.retry_max_delay_s),
            classify,
            fetch_ahead_slots_count,
        )
        self.sdk = Sdk(self)
        self._swap_lock = threading.Lock()
        self.transport: S3Transport = self.choose_transport()
        log.info(
            "s3://%s: %s%s",
            self.bucket,
            self.transport.describe(),
            f" ({self.lean.off_reason})" if self.lean.off_reason else "",
        )

    def choose_transport(self) -> S3Transport:
        """The transport for what this host and endpoint allow (s3_transport.py): the
        curl engine where there is one, the lean path where it serves the bucket."""
        if not self.lean.usable:
            return self.sdk
        if self.curl is not None:
            return CurlLean(self, self.curl)
        return UrllibLean(self)

    def swap_to_sdk(self) -> Sdk:
        """The one switch at run time: the lean path was refused (a region error, a
        redirect without a Location): every GET and LIST goes through the SDK client
        from now on, whose region redirector handles it. Logged once. Any thread."""
        with self._swap_lock:
            if self.transport is not self.sdk:
                log.info(
                    "s3://%s: %s; GETs and LISTs go through the SDK client from now on",
                    self.bucket,
                    self.lean.off_reason or "the lean path is off",
                )
                self.transport = self.sdk
        return self.sdk

    @property
    def fetch_workers(self) -> tuple:
        return engine_workers(self.curl)

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
    def list_objects_blocking(
        self,
        client,
        prefix: str,
        token: Optional[str],
        max_keys: int,
        delimited: bool = True,
        start_after: str = "",
    ) -> dict:
        """One ListObjectsV2 through `client` (the transport's, or the probe's own):
        delimited by '/', or every key under `prefix` after `start_after`."""
        kwargs = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": max_keys}
        if delimited:
            kwargs["Delimiter"] = "/"
        if start_after:
            kwargs["StartAfter"] = start_after
        if token:
            kwargs["ContinuationToken"] = token
        # boto3 asks for EncodingType=url and decodes keys itself, so any UTF-8 key
        # (including characters XML 1.0 cannot carry) round-trips exactly.
        return client.list_objects_v2(**kwargs)

    def checked(
        self,
        key: str,
        start: int,
        end: int,
        version: str,
        answer: Optional[tuple],
        buffer: Optional[bytearray],
        object_bytes: Optional[int],
    ):
        """A transport's GET answer (etag, content_range, body, digest, last_modified), or
        None (416), checked: the bytes, or with `buffer` the number received into it
        (`body` is that number then); None for a 416. A whole object is checked against
        its ETag where that is an MD5 (digests.py)."""
        if answer is None:
            return None
        etag, content_range, body, digest, last_modified = answer
        self.answer_checks.check(key, version, etag, last_modified)
        received_bytes = body if buffer is not None else len(body)
        check_answer(key, start, end, received_bytes, content_range, object_bytes)
        check_whole_object(
            key,
            digest,
            start,
            body if buffer is None else memoryview(buffer)[:received_bytes],
            object_bytes,
            content_range,
            self.etag_checks,
        )
        return body

    def _list_page_blocking(self, prefix: str, token: Optional[str]) -> tuple:
        """One attempt, on the transport of the moment (a retry after a swap takes the SDK's)."""
        return self.transport.list_blocking(prefix, token)

    # -- contract ---------------------------------------------------------------
    async def list_page(self, prefix: str, token: Optional[str] = None) -> ListPage:
        self.requests["list"] += 1
        raw_objects, prefixes, next_token, truncated = await self.caller.call(
            f"LIST {prefix!r}", self._list_page_blocking, prefix, token, abandon_on_cancel=True
        )
        # (A directory marker object, key == prefix, is among them: the namespace knows it
        # for the directory itself.)
        objects = [
            ObjectInfo(key, size, mtime_ns, versions.of_s3(etag, mtime_ns)) for key, size, mtime_ns, etag in raw_objects
        ]
        for info in objects:
            self.answer_checks.note_listed(info.version)
        if truncated and not next_token:
            # A silently short directory would be worse than an error.
            raise errors.BackendError(f"LIST {prefix!r}: truncated page without a continuation token")
        return ListPage(objects, prefixes, next_token)

    async def list_flat_page(
        self, prefix: str, start_after: str = "", end: Optional[str] = None, keys_max: int = PAGE_KEYS_MAX
    ) -> ListPage:
        self.requests["list"] += 1
        raw_objects, _prefixes, _token, truncated = await self.transport.list_flat(
            prefix, start_after, end, min(keys_max, PAGE_KEYS_MAX)
        )
        if end is not None and raw_objects and raw_objects[-1][0] > end:
            # (The SDK's answer is whole; the lean path's is cut already.)
            raw_objects = raw_objects[: bisect.bisect_right([raw[0] for raw in raw_objects], end)]
            truncated = False
        objects = object_infos(raw_objects)
        if objects:
            self.answer_checks.note_listed(objects[-1].version)
        if truncated and not objects:
            raise errors.BackendError(f"LIST {prefix!r} after {start_after!r}: a truncated page with no key")
        # Without a delimiter every entry is a key: the next page starts after the last.
        return ListPage(objects, [], objects[-1].key if truncated else None)

    async def upload(self, key: str, data: bytes) -> None:
        self.requests["put"] += 1
        await self.caller.call(
            f"PUT {key!r}",
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=key, Body=data, ContentType="application/octet-stream"
            ),
        )

    async def stat(self, key: str) -> ObjectInfo:
        self.requests["head"] += 1
        response = await self.caller.call(
            f"HEAD {key!r}", lambda: self.client.head_object(Bucket=self.bucket, Key=key), abandon_on_cancel=True
        )
        mtime_ns = _mtime_ns(response.get("LastModified"))
        return ObjectInfo(key, response["ContentLength"], mtime_ns, versions.of_s3(response.get("ETag", ""), mtime_ns))

    async def read_range(
        self, key: str, start: int, end: int, version: str, object_bytes: Optional[int] = None
    ) -> bytes:
        return await self._read(key, start, end, version, None, object_bytes)

    async def read_range_into(
        self, key: str, start: int, end: int, version: str, buffer: bytearray, object_bytes: Optional[int] = None
    ) -> int:
        return await self._read(key, start, end, version, buffer, object_bytes)

    async def _read(
        self, key: str, start: int, end: int, version: str, buffer: Optional[bytearray], object_bytes: Optional[int]
    ):
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
        try:
            got_bytes = await self.transport.get(
                f"GET {key!r} [{start}, {end})", key, start, end, version, into, object_bytes
            )
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
            self._make_client,
            min(self._config.connect_timeout_s, PROBE_CONNECT_TIMEOUT_S),
            min(self._config.read_timeout_s, PROBE_READ_TIMEOUT_S),
        )
        policy = self.caller.policy
        probe = BlockingCaller(
            1,
            RetryPolicy(min(policy.attempts_count, PROBE_ATTEMPTS_COUNT), policy.base_delay_s, policy.max_delay_s),
            classify,
        )
        try:
            # Two keys: the first may be the prefix's own directory marker.
            response = await probe.call(
                f"probe LIST {prefix!r}", self.list_objects_blocking, probe_client, prefix, None, 2
            )
        except errors.TransientError as exc:
            if isinstance(exc.__cause__, botocore.exceptions.SSLError):
                raise errors.EndpointUnreachable(
                    f"{exc} (a certificate signed by a private CA? give the CA as AWS_CA_BUNDLE)"
                ) from exc.__cause__
            if isinstance(exc.__cause__, _UNREACHABLE_EXCEPTIONS):
                raise errors.EndpointUnreachable(str(exc)) from exc.__cause__
            raise
        finally:
            probe_client.close()
            self.caller.retries_count += probe.retries_count
        return lists_entries(
            (item["Key"] for item in response.get("Contents", ())), len(response.get("CommonPrefixes", ())), prefix
        )

    @property
    def fetch_ahead_workers(self) -> tuple:
        return engine_workers(self.push_engine)

    def start_pushing(self, kernel_fd: int, workers_count: int, transfers_count: int, keep_bytes: int = 0) -> bool:
        if self.curl is None or self.push_engine is not None:  # (the workers' engine needs pycurl)
            return False
        config = self._config
        self.push_engine = WorkerEngine(
            workers_count,
            transfers_count,
            config.connect_timeout_s,
            config.read_timeout_s,
            ca_bundle(self._session),
            kernel_fd,
            keep_bytes,
        )
        return True

    @property
    def pushes(self) -> bool:
        return self.push_engine is not None and self.transport is not self.sdk and not self.pushes_redirected

    async def push_whole(self, key: str, version: str, size_bytes: int, ino: int, request: PushRequest) -> tuple:
        engine = self.push_engine
        if engine is None or not self.pushes:
            return PUSH_REFUSED, None
        started = self._push_started(key, version, size_bytes)
        if started is None:
            return PUSH_REFUSED, None
        transfer, checks = started
        try:
            transfer, kept = await engine.push(transfer, size_bytes, ino, checks, request)
        except PushRefused:
            return PUSH_REFUSED, None
        except ConnectionError:  # (no worker could start)
            return PUSH_FAILED, None
        return self._push_outcome(key, size_bytes, transfer, kept)

    def push_soon(
        self, key: str, version: str, size_bytes: int, ino: int, request: PushRequest, on_end: Callable
    ) -> bool:
        engine = self.push_engine
        if engine is None or not self.pushes or not engine.pushes_now:
            return False
        started = self._push_started(key, version, size_bytes)
        if started is None:
            return False
        transfer, checks = started

        def ended(transfer, kept) -> None:
            on_end(*self._push_outcome(key, size_bytes, transfer, kept))

        engine.push_soon(transfer, size_bytes, ino, checks, request, ended)
        return True

    def _push_started(self, key: str, version: str, size_bytes: int) -> Optional[tuple]:
        """(the push's transfer, its checks), counted as a GET; None if the lean path
        cannot serve the bucket."""
        transfer = self.lean.push_transfer(key, size_bytes, version)
        if transfer is None:
            return None
        pinned_etag = version if versions.kind(version) == versions.ETAG else None
        digest = s3_etag_digest(version, None, None) if pinned_etag and self.etag_checks.enabled else None
        md5 = None if digest is None else digest.expected
        crcs = S3_CHECKSUM_HEADERS if self.etag_checks.crc_enabled else ()
        checks = (pinned_etag, versions.lastmod_s(version), md5, S3_ETAG_NOT_MD5_HEADERS, crcs)
        self.requests["get"] += 1
        self.get_paths["push"] += 1
        return transfer, checks

    def _push_outcome(self, key: str, size_bytes: int, transfer, kept) -> tuple:
        """push_whole's (outcome, body) of the push `transfer` that ended."""
        error = transfer.error
        if error is None:
            self.bytes_fetched += size_bytes
            if transfer.buffer:
                return PUSH_READ, transfer.buffer
            return PUSHED, kept
        log.debug("push of %r: %s", key, error)
        if not isinstance(error, PushRefused):
            return PUSH_FAILED, None
        if transfer.status in REDIRECT_STATUSES:
            self.lean.redirects_count += 1  # (the store answered one more: counted as the daemon's are)
            if not self.pushes_redirected:
                self.pushes_redirected = True
                log.info("the store answers GETs with redirects: fetch-ahead workers push nothing more")
        if str(error) == DAMAGED:
            self.caller.corrupt_bodies_count += 1  # (as a damaged answer to the daemon's own GET is)
        return (PUSH_NO_INODE if str(error) == NO_INODE else PUSH_REFUSED), None

    async def aclose(self) -> None:
        if self.push_engine is not None:
            self.push_engine.close()
        if self.curl is not None:
            self.curl.close()
        self.lean.close()
        self.client.close()
