"""Google Cloud Storage backend: `gs://BUCKET[/PREFIX]` on google-cloud-storage.

Role: the Backend contract (see base.py) over the GCS JSON API, with the same
guarantees as the S3 backend.

Invariants:
- `version` is the object's generation as a decimal string. Size, mtime and
  generation come from listing pages; there is no metadata GET per file.
- A read pinned to a generation returns bytes of exactly that generation or
  raises ObjectChanged (a generation gone or replaced; BackendError if the store
  still lists it but will not serve it). The GET targets the generation (`generation=`)
  and sends `ifGenerationMatch`, and the generation the response reports
  (`x-goog-generation`) is checked; endpoints that omit that header (the
  gcp-storage-emulator ignores both parameters) get a metadata GET after the
  download instead, as does a 416 (a range past the end names no generation).
- Reads are raw (`raw_download`, `Accept-Encoding: gzip`): an object stored with
  `Content-Encoding: gzip` is served as its stored bytes, so offsets match the
  size the listing reports.
- Every blocking call runs through one BlockingCaller; the library's own retry is
  off (`retry=None`) so there is one bounded, jittered retry loop, and every call
  carries (connect, read) timeouts. `requests` counts the calls the core made,
  by type (retries of one call are in `caller.retries_count`); it and
  `bytes_fetched` are touched only on the trio thread.
- GETs go through one transport (gcs_transport.py: libcurl for small GETs and the
  library's session for larger ones, or the library's alone), chosen once when the
  client is built and logged; LISTs and metadata GETs go through the library.
- Credentials are never logged.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Optional

import google.auth.exceptions
import requests
import requests.adapters
import trio
import urllib3.exceptions
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from bucketfs import errors
from bucketfs.backends.base import PAGE_KEYS_MAX, Backend, ListPage, ObjectInfo, gone_message, lists_entries
from bucketfs.backends.calls import BlockingCaller, RetryPolicy
from bucketfs.backends.gcs_curl import CurlDownloads, ca_bundle_path
from bucketfs.backends.gcs_transport import CurlGets, GCSTransport, LibraryGets
from bucketfs.backends.gcs_transport import crc32c_of as _crc32c_of  # noqa: F401 - (tests import it from here)
from bucketfs.backends.http.curl import CurlEngine
from bucketfs.backends.http.workerengine import engine_workers, small_get_engine
from bucketfs.backends.slots import fetch_ahead_slots
from bucketfs.config import Config

log = logging.getLogger(__name__)

_PAGE_SIZE_COUNT = 1000  # the JSON API's maximum entries per listing page
# Partial response: a full object resource is ~25 fields; a listing needs 4.
_LIST_FIELDS = "items(name,size,updated,generation),prefixes,nextPageToken"
_FLAT_LIST_FIELDS = "items(name,size,updated,generation),nextPageToken"
# Answer "is the bucket there?" within this, even against a black-holed address
# where every attempt waits for the whole connect timeout.
_PROBE_DEADLINE_S = 30.0
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)

# Throttling and server-side failures, by HTTP status (408 has no class of its own).
_TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.HTTPError,  # raw body streaming can leak urllib3's own errors
    google.auth.exceptions.TransportError,  # token endpoint unreachable
    ConnectionError,
    TimeoutError,
)
_DENIED = (
    gexc.Forbidden,
    gexc.Unauthorized,
    google.auth.exceptions.DefaultCredentialsError,
    google.auth.exceptions.RefreshError,
)


def _is_transient_refresh(exc: BaseException) -> bool:
    """A token refresh that failed for want of an answer (the token endpoint or the
    metadata server briefly down: google-auth marks it retryable or wraps a
    TransportError), not because the credentials were refused."""
    return isinstance(exc, google.auth.exceptions.RefreshError) and (
        getattr(exc, "retryable", False) or isinstance(exc.__cause__, google.auth.exceptions.TransportError)
    )


def classify(exc: BaseException) -> errors.BucketfsError:
    """Map a google-cloud / requests exception to a bucketfs error (one table)."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, gexc.PreconditionFailed):
        return errors.ObjectChanged(message)
    if isinstance(exc, gexc.NotFound):
        return errors.NotFound(message)
    if _is_transient_refresh(exc):
        return errors.TransientError(message)
    if isinstance(exc, _DENIED):
        return errors.AccessDenied(message)
    if isinstance(exc, _TRANSIENT) or (isinstance(exc, gexc.GoogleAPICallError) and exc.code in _TRANSIENT_STATUSES):
        return errors.TransientError(message)
    return errors.BackendError(message)


def _is_storage_404(exc: Optional[BaseException]) -> bool:
    """A 404 from a storage API: GCS's JSON error, or the empty body of emulators
    (gcp-storage-emulator). A web server's page is neither."""
    response = getattr(exc, "response", None)
    if response is None:
        return True
    body = (getattr(response, "text", "") or "").strip()
    return not body or body.startswith("{")


def _mtime_ns(updated: Optional[str]) -> int:
    """An RFC 3339 time as GCS writes it ("2024-05-01T12:00:00.123Z") in ns since the epoch.
    datetime.fromisoformat (C; 'Z' and any number of fraction digits since Python 3.11,
    those past microseconds dropped, as the library drops them) instead of the library's
    strptime: 20 us an entry, two thirds of a listing's CPU."""
    if not updated:
        return 0
    # Integer arithmetic: a float timestamp loses the microseconds GCS reports.
    return (datetime.datetime.fromisoformat(updated) - _EPOCH) // datetime.timedelta(microseconds=1) * 1000


def _info(resource: dict) -> ObjectInfo:
    """An object's ObjectInfo from its JSON resource (a listing item, or a Blob's
    `_properties`): no Blob object per listed entry."""
    return ObjectInfo(
        resource["name"],
        int(resource.get("size") or 0),
        _mtime_ns(resource.get("updated")),
        str(resource.get("generation")),
    )


def _item_as_is(_iterator, item: dict) -> dict:
    return item


def _past(end: Optional[str]) -> Optional[str]:
    """An endOffset (exclusive) above every key up to `end`: its last character
    raised by one (the keys that extend `end` come too, and are the caller's to drop);
    None where there is none to give."""
    if not end:
        return None
    raised = ord(end[-1]) + 1
    if raised > 0x10FFFF or 0xD800 <= raised <= 0xDFFF:
        return None
    return end[:-1] + chr(raised)


class GCSBackend(Backend):
    """One bucket over the GCS JSON API; keys are full object names."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self._config = config
        self._bucket_name = config.url.bucket
        self._timeout_s = (config.connect_timeout_s, config.read_timeout_s)
        self.read_timeout_s = config.read_timeout_s
        policy = RetryPolicy(config.retry_attempts_count, config.retry_base_delay_s, config.retry_max_delay_s)
        fetch_ahead_slots_count = fetch_ahead_slots(config) if CurlEngine.available() else 0
        self.caller = BlockingCaller(config.max_connections_count, policy, classify, fetch_ahead_slots_count)
        self._client_lock = threading.Lock()
        self._client: Optional[storage.Client] = None
        self._bucket: Optional[storage.Bucket] = None
        self._warned_no_generation_header = False
        # Without pycurl, or where CurlDownloads is not usable (mTLS, a proxy), every GET
        # takes the library's path on a worker thread.
        self.curl = (
            small_get_engine(
                config.fetch_workers_count,
                config.max_connections_count + fetch_ahead_slots_count,
                config.connect_timeout_s,
                config.read_timeout_s,
                ca_bundle_path(),
            )
            if CurlEngine.available()
            else None
        )
        self._downloads: Optional[CurlDownloads] = None
        # Chosen once the client is built (_get_bucket): what it allows decides.
        self.transport: Optional[GCSTransport] = None

    # -- client (built lazily in a worker thread: ADC discovery may block) ----
    def _endpoint_url(self) -> Optional[str]:
        endpoint = self._config.endpoint_url or os.environ.get("STORAGE_EMULATOR_HOST")
        if endpoint and "://" not in endpoint:
            endpoint = "http://" + endpoint  # STORAGE_EMULATOR_HOST is often host:port
        return endpoint.rstrip("/") if endpoint else None

    def _credentials(self, endpoint: Optional[str]):
        if self._config.key_file and endpoint and endpoint.startswith("http://"):
            # The key file's tokens would travel in clear text: refused, not sent.
            raise errors.InvalidOption(
                f"--key-file with the plaintext endpoint {endpoint}: its tokens would travel "
                "unencrypted (use https://, or no key file for an emulator)"
            )
        if self._config.key_file:
            from google.oauth2 import service_account

            try:
                return service_account.Credentials.from_service_account_file(self._config.key_file)
            except (OSError, ValueError) as exc:
                raise errors.AccessDenied(
                    f"cannot load key file {self._config.key_file}: {type(exc).__name__}: {exc}"
                ) from None
        # A plaintext endpoint is an emulator: it needs no token, and a real token
        # must never travel unencrypted.
        if self._config.no_sign_request or (endpoint and endpoint.startswith("http://")):
            return AnonymousCredentials()
        return None  # Application Default Credentials

    def _get_bucket(self) -> storage.Bucket:
        with self._client_lock:
            if self._bucket is None:
                endpoint = self._endpoint_url()
                client = storage.Client(
                    project=None,  # reads need no project; None avoids project discovery
                    credentials=self._credentials(endpoint),
                    client_options={"api_endpoint": endpoint} if endpoint else None,
                )
                # google-cloud-storage >= 3.x fetches bucket metadata in background
                # threads for tracing: uncounted requests with their own retries.
                if hasattr(client, "_bucket_metadata_cache"):
                    client._bucket_metadata_cache = None
                # One pool as large as the thread limiter, so concurrent GETs reuse
                # connections instead of opening and discarding them. (An mTLS
                # session keeps the adapter that carries its client certificate.)
                if not getattr(client._http, "is_mtls", False):
                    adapter = requests.adapters.HTTPAdapter(
                        pool_connections=2, pool_maxsize=self._config.max_connections_count, max_retries=0
                    )
                    client._http.mount("https://", adapter)
                    client._http.mount("http://", adapter)
                self._client = client
                bucket = client.bucket(self._bucket_name)
                if self.curl is not None:
                    self._downloads = CurlDownloads(client, bucket, self._config.read_timeout_s)
                if self.transport is None:
                    self.transport = self.choose_transport()
                    off = self._downloads.off_reason if self._downloads is not None else ""
                    log.info("gs://%s: %s%s", self._bucket_name, self.transport.describe(), f" ({off})" if off else "")
                self._bucket = bucket
            return self._bucket

    def choose_transport(self) -> GCSTransport:
        """The transport for what this host and client allow (gcs_transport.py): the curl
        engine where there is one and the client's session allows it."""
        if self.curl is not None and self._downloads is not None and self._downloads.usable:
            return CurlGets(self, self.curl, self._downloads)
        return LibraryGets(self)

    async def transport_ready(self) -> GCSTransport:
        """The transport, the client built first if it is not yet (on a thread: ADC
        discovery may block)."""
        if self.transport is None:
            await self.caller.call("GCS client", self._get_bucket)
        assert self.transport is not None  # (chosen by _get_bucket)
        return self.transport

    def session(self) -> requests.Session:
        """The shared HTTP session (tests mount fault-injecting adapters on it). Blocks."""
        self._get_bucket()
        assert self._client is not None  # (built by _get_bucket)
        return self._client._http

    # -- contract ---------------------------------------------------------------
    @property
    def fetch_workers(self) -> tuple:
        return engine_workers(self.curl)

    async def list_page(self, prefix: str, token: Optional[str] = None) -> ListPage:
        def fetch():
            bucket = self._get_bucket()
            iterator = bucket.client.list_blobs(
                bucket,
                prefix=prefix or None,
                delimiter="/",
                page_size=_PAGE_SIZE_COUNT,
                page_token=token,
                fields=_LIST_FIELDS,
                retry=None,
                timeout=self._timeout_s,
            )
            iterator.item_to_value = _item_as_is  # the items' JSON, not a Blob each (most of the CPU)
            page = next(iterator.pages)  # exactly one request: the caller drives paging
            return [_info(item) for item in page], sorted(page.prefixes), iterator.next_page_token

        self.requests["list"] += 1
        objects, prefixes, next_token = await self.caller.call(f"list gs://{self._bucket_name}/{prefix}", fetch)
        return ListPage(objects, prefixes, next_token or None)

    async def list_flat_page(
        self, prefix: str, start_after: str = "", end: Optional[str] = None, keys_max: int = PAGE_KEYS_MAX
    ) -> ListPage:
        def fetch():
            bucket = self._get_bucket()
            iterator = bucket.client.list_blobs(
                bucket,
                prefix=prefix or None,
                # (startOffset includes the start key itself, dropped below: one more.)
                page_size=min(_PAGE_SIZE_COUNT, keys_max + (1 if start_after else 0)),
                start_offset=start_after or None,  # (inclusive: the key itself is dropped below)
                end_offset=_past(end),
                fields=_FLAT_LIST_FIELDS,
                retry=None,
                timeout=self._timeout_s,
            )
            iterator.item_to_value = _item_as_is
            page = [item for item in next(iterator.pages) if item["name"] > start_after]
            more = bool(iterator.next_page_token) or len(page) > keys_max
            del page[keys_max:]  # (a start key that is no object's: one more than asked)
            last = page[-1]["name"] if page else None
            return [_info(item) for item in page], more, last

        self.requests["list"] += 1
        where = f"list gs://{self._bucket_name}/{prefix} after {start_after!r}"
        objects, more, last = await self.caller.call(where, fetch)
        if more and (last is None or last <= start_after):
            raise errors.BackendError(f"{where}: a page that does not move past {start_after!r}")
        return ListPage(objects, [], last if more else None)

    async def upload(self, key: str, data: bytes) -> None:
        def store():
            blob = self._get_bucket().blob(key)
            blob.upload_from_string(data, content_type="application/octet-stream", retry=None, timeout=self._timeout_s)

        self.requests["put"] += 1
        await self.caller.call(f"upload gs://{self._bucket_name}/{key}", store)

    def _reload_blocking(self, key: str) -> storage.Blob:
        """The object's metadata (one metadata GET), in a worker thread."""
        blob = self._get_bucket().blob(key)
        blob.reload(retry=None, timeout=self._timeout_s)
        return blob

    async def stat(self, key: str) -> ObjectInfo:
        self.requests["head"] += 1
        return await self.caller.call(f"stat {key}", lambda: _info(self._reload_blocking(key)._properties))

    async def read_range(
        self, key: str, start: int, end: int, version: str, object_bytes: Optional[int] = None
    ) -> bytes:
        if end <= start:
            return b""
        generation = int(version)
        self.requests["get"] += 1
        try:
            transport = self.transport or await self.transport_ready()
            result = await transport.get(key, start, end, generation, object_bytes)
        except errors.NotFound:  # the GET's 404, or the metadata GET's (gone since)
            raise await self._gone_error(key, version) from None
        if result is None:
            return await self.confirm_past_end(key, version, start)
        data, served_generation, looked_up = result
        if looked_up:
            self.requests["head"] += 1
            if not self._warned_no_generation_header:
                self._warned_no_generation_header = True
                log.warning("endpoint sends no x-goog-generation header; each read costs an extra metadata GET")
        if served_generation != generation:
            raise errors.ObjectChanged(f"{key}: generation {version} is now {served_generation}")
        self.bytes_fetched += len(data)
        return data

    async def _gone_error(self, key: str, version: str) -> errors.BucketfsError:
        """A generation-targeted GET gave 404: the object is gone or was replaced."""
        try:
            live = await self.stat(key)
        except errors.NotFound:
            return errors.ObjectChanged(gone_message(key))
        if live.version == version:
            # Listed and still there at that generation, yet not served: no stale handle
            # (EIO, logged).
            return errors.BackendError(f"{key}: generation {version} exists but its GET answered 404")
        return errors.ObjectChanged(f"{key}: generation {version} is now {live.version}")

    async def check_bucket(self, prefix: str) -> bool:
        def probe():
            bucket = self._get_bucket()
            # Two entries: the first may be the prefix's own directory marker.
            iterator = bucket.client.list_blobs(
                bucket,
                prefix=prefix or None,
                delimiter="/",
                max_results=2,
                fields="items(name),prefixes,nextPageToken",
                retry=None,
                timeout=self._timeout_s,
            )
            page = next(iterator.pages)
            return lists_entries([blob.name for blob in page], len(iterator.prefixes), prefix)

        where = f"gs://{self._bucket_name}/{prefix}"
        self.requests["list"] += 1
        try:
            with trio.fail_after(_PROBE_DEADLINE_S):
                return await self.caller.call(f"probe {where}", probe, abandon_on_cancel=True)
        except trio.TooSlowError:
            raise errors.EndpointUnreachable(f"{where}: no answer within {_PROBE_DEADLINE_S:.0f}s") from None
        except errors.NotFound as exc:
            if not _is_storage_404(exc.__cause__):
                # A web server or a wrong path at the endpoint: the caller says so (exit 5).
                raise errors.BackendError(f"{where}: 404 without a GCS error body") from None
            raise errors.BucketNotFound(f"{where}: {exc}") from None
        except errors.TransientError as exc:
            raise errors.EndpointUnreachable(f"{where}: {exc}") from None

    async def aclose(self) -> None:
        if self.curl is not None:
            self.curl.close()
        with self._client_lock:
            client, self._client, self._bucket = self._client, None, None
        if client is not None:
            client.close()
