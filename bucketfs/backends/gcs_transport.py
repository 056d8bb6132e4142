"""How GCSBackend's GETs go on the wire: one transport, chosen once when the backend
builds its client (GCSBackend.choose_transport; on a worker thread at the first
request, the mount's probe, since Application Default Credentials may block) and
logged then.

- LibraryGets: every GET on the library's authorized requests session, on worker threads.
- CurlGets: GETs up to SMALL_GET_MAX_BYTES on the libcurl engine (the requests built by
  gcs_curl.py), larger ones as LibraryGets. Where pycurl is installed and the session
  allows it (no mTLS, no proxy for the endpoint: gcs_curl.CurlDownloads.usable).
LISTs and metadata GETs always go through the library.

A transport's `get` is one GET with the backend's retries (BlockingCaller): (data,
served generation, looked_up) or None when the range starts past the end (416). An
answer of the pinned generation is checked in the attempt (base.check_answer, the
whole-object checksum), so a short or damaged body is retried; the generation itself
is compared by the backend. It counts the GET in `backend.get_paths` ("curl" or "threads").
"""

from __future__ import annotations

import abc
from typing import Optional

import trio
from google.api_core import exceptions as gexc
from google.cloud import storage

from bucketfs.backends.base import check_answer
from bucketfs.backends.digests import check_whole_object, gcs_hash_digest, received_digest
from bucketfs.backends.gcs_curl import refused, served_generation
from bucketfs.backends.http.body import read_range_body
from bucketfs.backends.http.checksums import crc32c_of
from bucketfs.backends.http.curl import SMALL_GET_MAX_BYTES

LISTS = "google-cloud-storage (worker threads)"


class GCSTransport(abc.ABC):
    """The wire under one GCSBackend's GETs."""

    name = ""
    gets = ""  # which way GETs go, for the log

    def __init__(self, backend) -> None:
        self.backend = backend

    def describe(self) -> str:
        return f"GETs: {self.gets}; LISTs: {LISTS}"

    @abc.abstractmethod
    async def get(
        self, key: str, start: int, end: int, generation: int, object_bytes: Optional[int]
    ) -> Optional[tuple]:
        """(data, served generation, looked_up: a metadata GET told it), or None past the end."""


class LibraryGets(GCSTransport):
    """Every GET on the library's requests session, on worker threads."""

    name = "library"
    gets = "the library's requests session (worker threads)"

    async def get(
        self, key: str, start: int, end: int, generation: int, object_bytes: Optional[int]
    ) -> Optional[tuple]:
        self.backend.get_paths["threads"] += 1
        return await self.backend.caller.call(
            f"GET {key}", self.fetch_blocking, key, start, end, generation, object_bytes
        )

    def fetch_blocking(self, key: str, start: int, end: int, generation: int, object_bytes: Optional[int]):
        backend = self.backend
        bucket = backend._get_bucket()
        # generation= makes GCS serve exactly that generation (404 once it is gone).
        blob = storage.Blob(key, bucket, generation=generation)
        url = blob._get_download_url(bucket.client, if_generation_match=generation)
        # One request on the client's own authorized session, without the
        # library's download machinery (most of the daemon's CPU per small file).
        # Accept-Encoding: gzip with an undecoded read is the raw download: an
        # object stored gzip-encoded comes back as stored, at its listed size.
        response = bucket.client._http.request(
            "GET",
            url,
            headers={"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "gzip"},  # inclusive end
            stream=True,
            timeout=backend._timeout_s,
        )
        try:
            if response.status_code == 416:
                return None  # start >= size of whichever generation was served
            if response.status_code not in (200, 206):
                raise gexc.from_http_response(response)
            content_range = response.headers.get("Content-Range")
            data = read_range_body(
                response.raw,
                backend.read_timeout_s,
                start,
                end,
                whole_object=response.status_code == 200 and content_range is None,
            )
            served = response.headers.get("x-goog-generation")
            goog_hash = response.headers.get("x-goog-hash")
        finally:
            response.close()  # (its connection back to the pool, for the metadata GET)
        if served:
            served, looked_up = int(served), False
        else:
            # An endpoint that names no generation: ask the live one after the
            # download, here, so that a short body of the pinned generation is
            # retried like any other. Generations only grow: if the live one is the
            # pinned one now, the download served the pinned one.
            served, looked_up = backend._reload_blocking(key).generation, True
        if served == generation:
            check_answer(key, start, end, len(data), content_range, object_bytes)
            check_whole_object(key, gcs_hash_digest(goog_hash, crc32c_of), start, data, object_bytes, content_range)
        return data, served, looked_up


class CurlGets(LibraryGets):
    """LibraryGets, with GETs up to SMALL_GET_MAX_BYTES on the libcurl engine."""

    name = "curl"
    gets = (
        f"libcurl for <= {SMALL_GET_MAX_BYTES // 2**20} MiB, the library's requests session (worker threads) for larger"
    )

    def __init__(self, backend, engine, downloads) -> None:
        super().__init__(backend)
        self.engine = engine
        self.downloads = downloads  # gcs_curl.CurlDownloads

    async def get(
        self, key: str, start: int, end: int, generation: int, object_bytes: Optional[int]
    ) -> Optional[tuple]:
        if end - start > SMALL_GET_MAX_BYTES:
            return await super().get(key, start, end, generation, object_bytes)
        self.backend.get_paths["curl"] += 1
        return await self.backend.caller.run(f"GET {key}", self._fetch_curl, key, start, end, generation, object_bytes)

    async def _fetch_curl(self, key: str, start: int, end: int, generation: int, object_bytes: Optional[int]):
        """fetch_blocking on the engine. One attempt (BlockingCaller.run retries it), with
        one new token after a 401, as the library's authorized session does."""
        downloads, limiter, into = self.downloads, self.backend.caller.limiter, bytearray(end - start)
        for refreshed in (False, True):
            if downloads.needs_token():
                await trio.to_thread.run_sync(downloads.refresh_blocking, limiter=limiter)
            transfer = await self.engine.get(downloads.transfer(key, start, end, generation, into))
            if transfer.error is not None:
                raise transfer.error
            if transfer.status != 401 or downloads.anonymous or refreshed:
                break
            await trio.to_thread.run_sync(downloads.refresh_blocking, True, limiter=limiter)
        if transfer.status == 416:
            return None  # start >= size of whichever generation was served
        if transfer.status not in (200, 206):
            raise refused(transfer)
        served, looked_up = served_generation(transfer), False
        if served is None:  # (see fetch_blocking)
            blob = await trio.to_thread.run_sync(self.backend._reload_blocking, key, limiter=limiter)
            served, looked_up = blob.generation, True
        del into[transfer.received_bytes :]  # (a range past the object's end: its shorter answer)
        if served == generation:
            content_range = transfer.headers.get("content-range")
            check_answer(key, start, end, transfer.received_bytes, content_range, object_bytes)
            digest = received_digest(
                gcs_hash_digest(transfer.headers.get("x-goog-hash"), crc32c_of), transfer.body_hash
            )
            check_whole_object(key, digest, start, into, object_bytes, content_range)
        return into, served, looked_up
