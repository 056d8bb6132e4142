"""How S3Backend's GETs and LISTs go on the wire: one transport, chosen when the
backend is built (S3Backend.choose_transport) and logged once.

- CurlLean: GETs up to SMALL_GET_MAX_BYTES on the libcurl engine (http/curl.py), larger
  GETs and LISTs on urllib3 worker threads, all signed by bucketfs (s3_lean.py). Where
  pycurl is installed and the lean path serves the bucket.
- UrllibLean: every GET and LIST on urllib3 worker threads (no pycurl).
- Sdk: every GET and LIST through the boto3 client on worker threads: where the lean
  path cannot serve the bucket (a proxy applies to the endpoint).
HEADs and the mount's probe go through the boto3 client whatever the transport.

One switch at run time, explicit: a lean transport refused with a region error (S3's
301 PermanentRedirect, AuthorizationHeaderMalformed, ...) or a redirect without a
Location swaps the backend to Sdk for good (S3Backend.swap_to_sdk, logged), and the
request that met the refusal goes on through Sdk at once. Redirects with a Location
are no such switch: every transport follows them, signed again for their host,
counted in LeanS3.redirects_count.

Every transport's `get` is one attempt of the backend's BlockingCaller (it retries)
and returns the bytes received into the caller's buffer, checked by the backend
(S3Backend.checked: versions, Content-Range, whole-object digests), or None for a 416.
It counts the GET in `backend.get_paths` ("curl" or "threads").
"""

from __future__ import annotations

import abc
import datetime
from typing import Optional

import botocore.awsrequest
import botocore.exceptions
import trio

from bucketfs.backends import versions
from bucketfs.backends.digests import s3_answer_digest
from bucketfs.backends.http.body import copy_into, read_range_body
from bucketfs.backends.http.curl import SMALL_GET_MAX_BYTES
from bucketfs.backends.s3_lean import (
    REDIRECT_HOPS_MAX,
    REDIRECT_STATUSES,
    error_response,
    parse_page_until,
    redirect_url,
    too_many_redirects,
)

LIST_PAGE_KEYS_COUNT = 1000  # the S3 maximum: one page answers a whole typical directory

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def into(buffer: Optional[bytearray], data: bytes):
    """`data` itself, or with a buffer: copied into it, and its length."""
    return data if buffer is None else copy_into(buffer, data)


def normalise_etag(etag: str) -> str:
    return etag.strip('"') if etag else ""


def mtime_ns(when: Optional[datetime.datetime]) -> int:
    # Integer arithmetic: a float timestamp * 1e9 loses the low bits of a nanosecond count.
    # A time before the epoch (AIStore's zero time for objects never read) or none: 0.
    if when is None:
        return 0
    return max((when - _EPOCH) // datetime.timedelta(microseconds=1) * 1000, 0)


class S3Transport(abc.ABC):
    """The wire under one S3Backend: its GETs and LISTs."""

    name = ""
    gets = ""  # which way GETs go, for the log
    lists = ""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.lean = backend.lean

    def describe(self) -> str:
        return f"GETs: {self.gets}; LISTs: {self.lists}"

    async def get(
        self, what: str, key: str, start: int, end: int, version: str, buffer: bytearray, object_bytes: Optional[int]
    ) -> Optional[int]:
        """One ranged GET into `buffer` (len >= end - start), checked: the bytes received,
        or None when the range starts past the end (416). With its retries."""
        self.backend.get_paths["threads"] += 1
        return await self.backend.caller.call(
            what, self.get_checked_blocking, key, start, end, version, buffer, object_bytes
        )

    def get_checked_blocking(
        self, key: str, start: int, end: int, version: str, buffer: Optional[bytearray], object_bytes: Optional[int]
    ):
        """get() on a worker thread (one attempt), checked there: a short answer is
        retried (base.check_answer)."""
        if buffer is not None:
            self.backend.fresh_pages.fault_in(buffer)
        return self.backend.checked(
            key, start, end, version, self.get_blocking(key, start, end, version, buffer), buffer, object_bytes
        )

    @abc.abstractmethod
    def get_blocking(
        self, key: str, start: int, end: int, version: str, buffer: Optional[bytearray]
    ) -> Optional[tuple]:
        """(etag, content_range, body, digest, last_modified), unchecked, or with
        `buffer` the number of bytes written into it as `body`; None for a 416."""

    @abc.abstractmethod
    def list_blocking(self, prefix: str, token: Optional[str]) -> tuple:
        """One delimited LIST page on a worker thread: (objects [(key, size, mtime_ns,
        etag)], prefixes, next_token, truncated)."""

    async def list_flat(self, prefix: str, start_after: str, end: Optional[str], keys_max: int) -> tuple:
        """list_flat_blocking, with its retries, on a worker thread."""
        return await self.backend.caller.call(
            f"LIST {prefix!r} after {start_after!r}",
            self.list_flat_blocking,
            prefix,
            start_after,
            end,
            keys_max,
            abandon_on_cancel=True,
        )

    @abc.abstractmethod
    def list_flat_blocking(
        self, prefix: str, start_after: str, end: Optional[str] = None, keys_max: int = LIST_PAGE_KEYS_COUNT
    ) -> tuple:
        """One LIST page (<= `keys_max` keys) of every key under `prefix` after
        `start_after` (no delimiter), on a worker thread: as list_blocking's. Keys past
        `end` need not be decoded (a page cut there says it is not truncated)."""


class Sdk(S3Transport):
    """Every GET and LIST through the boto3 client, on worker threads."""

    name = "sdk"
    gets = "the SDK client (boto3, worker threads)"
    lists = "the SDK client"

    def get_blocking(
        self, key: str, start: int, end: int, version: str, buffer: Optional[bytearray]
    ) -> Optional[tuple]:
        backend = self.backend
        # The lean paths' conditional header, as the client's parameter of the same name.
        condition = {name.replace("-", ""): value for name, value in versions.condition_headers(version).items()}
        try:
            response = backend.client.get_object(
                Bucket=backend.bucket, Key=key, Range=f"bytes={start}-{end - 1}", **condition
            )
        except botocore.exceptions.ClientError as exc:
            metadata = exc.response.get("ResponseMetadata", {})
            status, location = metadata.get("HTTPStatusCode"), metadata.get("HTTPHeaders", {}).get("location")
            if status in REDIRECT_STATUSES and location:
                url = backend.client.meta.endpoint_url  # (only its scheme and host matter to urljoin)
                return self._get_redirected_blocking(redirect_url(url, location), start, end, version, buffer)
            if status == 416:
                return None
            raise
        return self._answer(response, start, end, buffer)

    def _answer(self, response: dict, start: int, end: int, buffer: Optional[bytearray]) -> tuple:
        body = response["Body"]
        try:
            # Read the whole body here, in the worker: a reset mid-body raises in this
            # thread and BlockingCaller repeats the whole request.
            data = read_range_body(
                body._raw_stream, self.backend.read_timeout_s, start, end, whole_object=not response.get("ContentRange")
            )
        finally:
            body.close()
        # (The client's parameters ask for no checksum: botocore would check it itself,
        # and needs awscrt for CRC32C. A store that states one unasked is checked by it.)
        headers_in = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        digest = s3_answer_digest(headers_in)
        last_modified = headers_in.get("last-modified")
        return (
            normalise_etag(response.get("ETag", "")),
            response.get("ContentRange"),
            into(buffer, data),
            digest,
            last_modified,
        )

    def _get_redirected_blocking(self, url: str, start: int, end: int, version: str, buffer: Optional[bytearray]):
        """The GET, redirected to `url`: signed again for that host and sent through the
        client's HTTP session (its proxies and CA bundle), hop by hop."""
        http_session = self.backend.client._endpoint.http_session
        lean = self.lean
        headers = lean.range_headers(start, end, version)
        hops = 1
        lean.redirects_count += 1
        while True:
            request = botocore.awsrequest.AWSRequest("GET", url, headers=lean.signed_for(url, headers))
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
                lean.redirects_count += 1
                continue
            if response.status_code == 416:
                response.raw.release_conn()
                return None
            if response.status_code not in (200, 206):
                raise botocore.exceptions.ClientError(
                    error_response(response.status_code, response.content), "GetObject"
                )
            try:
                data = read_range_body(
                    response.raw,
                    self.backend.read_timeout_s,
                    start,
                    end,
                    whole_object="content-range" not in response.headers,
                )
            finally:
                response.raw.release_conn()
            headers_in = response.headers
            digest = s3_answer_digest(headers_in)
            return (
                normalise_etag(headers_in.get("etag", "")),
                headers_in.get("content-range"),
                into(buffer, data),
                digest,
                headers_in.get("last-modified"),
            )

    def list_blocking(self, prefix: str, token: Optional[str]) -> tuple:
        return self._page(self.backend.list_objects_blocking(self.backend.client, prefix, token, LIST_PAGE_KEYS_COUNT))

    def list_flat_blocking(
        self, prefix: str, start_after: str, end: Optional[str] = None, keys_max: int = LIST_PAGE_KEYS_COUNT
    ) -> tuple:
        return self._page(
            self.backend.list_objects_blocking(
                self.backend.client, prefix, None, keys_max, delimited=False, start_after=start_after
            )
        )

    @staticmethod
    def _page(response: dict) -> tuple:
        objects = [
            (item["Key"], item["Size"], mtime_ns(item.get("LastModified")), item.get("ETag", ""))
            for item in response.get("Contents", ())
        ]
        prefixes = [item["Prefix"] for item in response.get("CommonPrefixes", ())]
        truncated = bool(response.get("IsTruncated"))
        return objects, prefixes, response.get("NextContinuationToken") if truncated else None, truncated


class UrllibLean(S3Transport):
    """Every GET and LIST signed by bucketfs and sent on urllib3, on worker threads."""

    name = "urllib3"
    gets = "urllib3 (worker threads)"
    lists = "urllib3"

    def get_blocking(
        self, key: str, start: int, end: int, version: str, buffer: Optional[bytearray]
    ) -> Optional[tuple]:
        answer = self.lean.get(key, start, end, version, buffer)
        if answer is None:  # refused: the SDK client serves the bucket from now on, this GET first
            return self.backend.swap_to_sdk().get_blocking(key, start, end, version, buffer)
        status, etag, content_range, body, digest, last_modified = answer
        if status == 416:
            return None
        if not content_range:  # a server that ignored Range: the range was kept
            body = into(buffer, body)
        return normalise_etag(etag), content_range, body, digest, last_modified

    def list_blocking(self, prefix: str, token: Optional[str]) -> tuple:
        answer = self.lean.list(prefix, token, LIST_PAGE_KEYS_COUNT)
        if answer is None:
            return self.backend.swap_to_sdk().list_blocking(prefix, token)
        return answer

    def list_flat_blocking(
        self, prefix: str, start_after: str, end: Optional[str] = None, keys_max: int = LIST_PAGE_KEYS_COUNT
    ) -> tuple:
        answer = self.lean.list(prefix, None, keys_max, delimited=False, start_after=start_after, end=end)
        if answer is None:
            return self.backend.swap_to_sdk().list_flat_blocking(prefix, start_after, end, keys_max)
        return answer


class CurlLean(UrllibLean):
    """UrllibLean, with GETs up to SMALL_GET_MAX_BYTES on the libcurl engine, from the
    trio thread (a fraction of a worker thread's CPU per small file)."""

    name = "curl"
    gets = f"libcurl for <= {SMALL_GET_MAX_BYTES // 2**20} MiB, urllib3 (worker threads) for larger"

    def __init__(self, backend, engine) -> None:
        super().__init__(backend)
        self.engine = engine

    async def get(
        self, what: str, key: str, start: int, end: int, version: str, buffer: bytearray, object_bytes: Optional[int]
    ) -> Optional[int]:
        if end - start > SMALL_GET_MAX_BYTES:
            return await super().get(what, key, start, end, version, buffer, object_bytes)
        self.backend.get_paths["curl"] += 1
        return await self.backend.caller.run(what, self._get_curl, key, start, end, version, buffer, object_bytes)

    async def list_flat(self, prefix: str, start_after: str, end: Optional[str], keys_max: int) -> tuple:
        """Flat pages on the engine too (index build keeps tens in flight: on worker
        threads their Python cost and hand-offs were most of its CPU)."""
        return await self.backend.caller.run(
            f"LIST {prefix!r} after {start_after!r}", self._list_flat_curl, prefix, start_after, end, keys_max
        )

    async def _list_flat_curl(self, prefix: str, start_after: str, end: Optional[str], keys_max: int) -> tuple:
        """One attempt on the engine; anything but a 200 (an error to classify, a
        redirect, a refusal that swaps to the SDK) is asked again on the thread path,
        which answers each as it does for every LIST."""
        url = self.lean.list_url(prefix, None, keys_max, delimited=False, start_after=start_after)
        if url is not None:
            transfer = await self.engine.get(self.lean.list_transfer(url))
            if transfer.error is not None:
                raise transfer.error
            if transfer.status == 200:
                return parse_page_until(bytes(transfer.buffer), end)
        return await trio.to_thread.run_sync(
            self.list_flat_blocking, prefix, start_after, end, keys_max, limiter=self.backend.caller.limiter
        )

    async def _get_curl(
        self, key: str, start: int, end: int, version: str, buffer: bytearray, object_bytes: Optional[int]
    ):
        """One attempt on the engine (BlockingCaller.run retries it); on a worker thread
        through the SDK after all when the lean path is refused."""
        lean = self.lean
        transfer = lean.transfer(key, start, end, version, buffer)
        answer = None
        if transfer is not None:
            hops = 0
            await self.engine.get(transfer)
            while (following := lean.redirected(transfer, start, end, version, hops)) is not None:
                transfer, hops = following, hops + 1
                await self.engine.get(transfer)
            answer = lean.answer_of(transfer)
        if answer is None:
            sdk = self.backend.swap_to_sdk()
            return await trio.to_thread.run_sync(
                sdk.get_checked_blocking,
                key,
                start,
                end,
                version,
                buffer,
                object_bytes,
                limiter=self.backend.caller.limiter,
            )
        status, etag, content_range, got_bytes, digest, last_modified = answer
        if status == 416:
            return None
        return self.backend.checked(
            key,
            start,
            end,
            version,
            (normalise_etag(etag), content_range, got_bytes, digest, last_modified),
            buffer,
            object_bytes,
        )
