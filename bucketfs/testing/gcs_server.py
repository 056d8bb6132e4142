"""A throwaway GCS emulator (`gcp-storage-emulator`) on 127.0.0.1 for tests.

`start_gcs_emulator()` runs the emulator as a child process on a free port, waits
for its health check with a deadline (polling, no fixed sleeps), yields a
`GCSEmulator` handle, and always terminates the process it started, by PID.

Known quirks of the emulator (version 2026.x), which the backend tests rely on.
`GCSLikeAdapter`, mounted on a backend's HTTP session, papers over the first two
so the GCS code paths get exercised too:
- Media GETs ignore `generation=` and `ifGenerationMatch=` and send no
  `x-goog-generation` header: they always return the live object.
- Listings ignore `maxResults`, `pageToken`, `startOffset` and `endOffset`: every
  listing is one page of everything under the prefix.
- Objects are served as stored: no Content-Encoding header, no transcoding.
- A range starting at or past the end gives 206 with an empty body, never 416.
- It serves one request at a time (http.server.HTTPServer, HTTP/1.0).
- It rewrites all its metadata on every write; the launcher below turns that off.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from typing import Iterator, Optional

import requests
import requests.adapters
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from bucketfs.config import BucketURL, Config
from bucketfs.testing.servers import _die_with_parent, _stop

# `gcp-storage-emulator ARGS`, minus one cost: on every write the emulator
# re-serialises ALL its metadata as indented JSON (O(n^2): 2,500 uploads take ~80 s).
# In memory mode nothing ever reads that file back (only startup does), so skip it.
_LAUNCHER = """
import sys
from gcp_storage_emulator import storage, __main__
storage.Storage._write_config_to_file = lambda self: None
__main__.main(sys.argv[1:])
"""
_READY_DEADLINE_S = 20.0  # the emulator imports in ~1 s; allow for a loaded CI box


def free_port() -> int:
    """A port that was free a moment ago (the caller retries if it is taken since)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GCSEmulator:
    """A running emulator: its endpoint and helpers to seed buckets and objects."""

    def __init__(self, endpoint_url: str, pid: int):
        self.endpoint_url = endpoint_url
        self.pid = pid
        # Seeding goes through the real client library, so objects get the same
        # metadata (generation, contentEncoding, ...) the backend will list.
        self.client = storage.Client(
            project="test-project",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": endpoint_url},
        )
        self.client._bucket_metadata_cache = None  # no background bucket GETs

    def new_bucket(self) -> str:
        """Create a bucket with a fresh name (one per test keeps tests independent)."""
        name = f"test-{uuid.uuid4().hex[:16]}"
        self.client.create_bucket(name)
        return name

    def put(self, bucket: str, key: str, data: bytes, content_encoding: Optional[str] = None) -> int:
        """Upload one object; returns its generation."""
        blob = self.client.bucket(bucket).blob(key)
        if content_encoding:
            blob.content_encoding = content_encoding
        blob.upload_from_string(data, content_type="application/octet-stream")
        return blob.generation

    def delete(self, bucket: str, key: str) -> None:
        self.client.bucket(bucket).blob(key).delete()

    def seed(self, bucket: str, objects: dict) -> dict:
        """Upload `{key: bytes}`; returns `{key: generation}`."""
        return {key: self.put(bucket, key, data) for key, data in objects.items()}

    def config(self, bucket: str, prefix: str = "", **overrides) -> Config:
        """A bucketfs Config pointing at this emulator (no retries wasted by default)."""
        fields: dict = dict(
            url=BucketURL("gs", bucket, prefix),
            mountpoint="/nonexistent",  # backends never look at it
            endpoint_url=self.endpoint_url,
            retry_base_delay_s=0.01,
            retry_max_delay_s=0.05,
        )
        fields.update(overrides)
        return Config(**fields)

    def close(self) -> None:
        self.client.close()


_BOUNDARY = b"bucketfs-test-boundary-7d1e0c4b"
_MULTIPART_TYPE = f"multipart/related; boundary={_BOUNDARY.decode()}"


class GCSServer:
    """The GCS emulator as the mount and contract fixtures see a server.

    Same shape as bucketfs.testing.servers.S3Server where they overlap (`scheme`,
    `endpoint_url`, `env()`, `new_bucket()`, `put()`, `config()`), plus
    `put_many()`, a bulk seeding path: one bare upload per object over
    http.client, ~4x faster than the client library's multipart upload
    (2,500 objects: ~2 s instead of ~8 s; the emulator serves one request at a
    time, so uploading in parallel does not help).
    """

    scheme = "gs"

    def __init__(self, emulator: GCSEmulator):
        self.emulator = emulator
        self.endpoint_url = emulator.endpoint_url
        self.client = emulator.client
        self._netloc = urllib.parse.urlsplit(emulator.endpoint_url).netloc

    def env(self) -> dict:
        """Environment for a subprocess: no credentials needed (an http:// endpoint is
        an emulator, and the backend talks to it anonymously)."""
        return {}

    def new_bucket(self) -> str:
        return self.emulator.new_bucket()

    def put(self, bucket: str, key: str, data: bytes, content_encoding: Optional[str] = None) -> int:
        """Upload one object through the client library; returns its generation."""
        return self.emulator.put(bucket, key, data, content_encoding=content_encoding)

    def delete(self, bucket: str, key: str) -> None:
        self.emulator.delete(bucket, key)

    def put_many(self, bucket: str, objects: dict) -> None:
        """Upload `{key: bytes}` fast (plain objects: no Content-Encoding)."""
        for key, data in objects.items():
            if data:
                path = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={urllib.parse.quote(key, safe='')}"
                content_type = "application/octet-stream"
            else:
                # The emulator fails a media upload of an empty body (it reads no body
                # as None and drops the connection); a multipart upload carries it.
                # (Multipart for everything would cost ~1 s per 24 MiB in its parser.)
                meta = json.dumps({"name": key, "contentType": "application/octet-stream"}).encode()
                path, content_type = f"/upload/storage/v1/b/{bucket}/o?uploadType=multipart", _MULTIPART_TYPE
                data = b"".join(
                    [
                        b"--",
                        _BOUNDARY,
                        b"\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n",
                        meta,
                        b"\r\n--",
                        _BOUNDARY,
                        b"\r\nContent-Type: application/octet-stream\r\n\r\n",
                        b"\r\n--",
                        _BOUNDARY,
                        b"--\r\n",
                    ]
                )
            connection = http.client.HTTPConnection(self._netloc, timeout=30.0)
            try:
                connection.request("POST", path, body=data, headers={"Content-Type": content_type})
                response = connection.getresponse()
                response.read()
            finally:
                connection.close()  # the emulator speaks HTTP/1.0: one request per connection
            if response.status != 200:
                raise RuntimeError(f"seeding {key!r} into {bucket}: HTTP {response.status}")

    def config(self, bucket: str, prefix: str = "", **overrides):
        return self.emulator.config(bucket, prefix, **overrides)


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens: connections are refused."""
    return f"http://127.0.0.1:{free_port()}"


def _is_ready(endpoint_url: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint_url + "/", timeout=1.0) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def start_gcs_emulator() -> Iterator[GCSEmulator]:
    """Run `gcp-storage-emulator start --in-memory` on a free port; always stop it."""
    with tempfile.TemporaryFile() as log_file:
        for _attempt in range(3):  # the free port may be taken between probe and bind
            port = free_port()
            endpoint_url = f"http://127.0.0.1:{port}"
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _LAUNCHER,
                    "start",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--in-memory",
                    "--quiet",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"},
                preexec_fn=_die_with_parent,  # no orphaned emulator if the test run is killed
            )
            try:
                deadline = time.monotonic() + _READY_DEADLINE_S
                while proc.poll() is None and time.monotonic() < deadline and not _is_ready(endpoint_url):
                    time.sleep(0.05)  # polling interval, not synchronisation
                if proc.poll() is not None:
                    continue  # exited (port taken?): try another port
                if not _is_ready(endpoint_url):
                    log_file.seek(0)
                    raise RuntimeError(
                        f"GCS emulator not ready after {_READY_DEADLINE_S}s: {log_file.read()[-2000:]!r}"
                    )
                emulator = GCSEmulator(endpoint_url, proc.pid)
                try:
                    yield emulator
                finally:
                    emulator.close()
                return
            finally:
                _stop(proc)
        log_file.seek(0)
        raise RuntimeError(f"GCS emulator failed to start: {log_file.read()[-2000:]!r}")


def fake_response(request: requests.PreparedRequest, status: int, body: Optional[dict] = None) -> requests.Response:
    """A JSON error/answer as the transport would return it (for adapters in tests)."""
    response = requests.Response()
    response.status_code = status
    response.reason = "injected"
    response._content = json.dumps(body or {"error": {"code": status, "message": "injected"}}).encode()
    response.raw = io.BytesIO(response._content)  # as a transport's response, it has a raw stream
    response.headers["Content-Type"] = "application/json"
    response.url = request.url or ""
    response.request = request
    return response


class GCSLikeAdapter(requests.adapters.HTTPAdapter):
    """Makes the emulator answer like GCS where the backend depends on it.

    - paging: the emulator answers every listing in one page; GCS answers at most
      `maxResults` entries (objects + prefixes, interleaved by name) and a
      `nextPageToken`. Each listing response is cut to the page after the token,
      and to `startOffset`/`endOffset`, which the emulator ignores too.
    - generations: GCS serves `generation=N` exactly (404 once N is gone), answers
      412 to a failed `ifGenerationMatch`, and reports `x-goog-generation`. The
      emulator does none of it; this adapter looks up the live generation first.
      With `targeting=False` it ignores `generation=`/`ifGenerationMatch` but still
      reports the generation served, like a server that only tells the truth.
    """

    def __init__(self, paging: bool = True, generations: bool = True, targeting: bool = True):
        super().__init__(max_retries=0)
        self.paging, self.generations, self.targeting = paging, generations, targeting
        self.pages_served_count = 0

    def send(self, request, **kwargs):
        url = urllib.parse.urlsplit(request.url)
        query = urllib.parse.parse_qs(url.query)
        if self.generations and request.method == "GET" and url.path.startswith("/download/"):
            return self._download(request, url, query, kwargs)
        response = super().send(request, **kwargs)
        if self.paging and request.method == "GET" and url.path.endswith("/o") and response.status_code == 200:
            self._cut_page(response, query)
        return response

    def _download(self, request, url, query, kwargs):
        # /download/storage/v1/b/BUCKET/o/OBJECT -> metadata at /storage/v1/b/BUCKET/o/OBJECT
        meta_url = f"{url.scheme}://{url.netloc}{url.path[len('/download') :]}"
        meta = requests.get(meta_url, timeout=10)
        if meta.status_code != 200:
            return fake_response(request, meta.status_code)
        live = meta.json()["generation"]
        if self.targeting and query.get("generation", [live])[0] != live:
            return fake_response(request, 404)
        if self.targeting and query.get("ifGenerationMatch", [live])[0] != live:
            return fake_response(request, 412)
        response = super().send(request, **kwargs)
        response.headers["x-goog-generation"] = live
        return response

    def _cut_page(self, response, query):
        page_size = int(query.get("maxResults", ["1000"])[0])
        after = base64.urlsafe_b64decode(query["pageToken"][0]).decode() if "pageToken" in query else None
        body = response.json()
        entries = sorted(
            [(item["name"], "item", item) for item in body.get("items", [])]
            + [(prefix, "prefix", prefix) for prefix in body.get("prefixes", [])]
        )
        if after is not None:
            entries = [entry for entry in entries if entry[0] > after]
        # startOffset (inclusive) and endOffset (exclusive), which the emulator ignores.
        start_offset = query.get("startOffset", [""])[0]
        end_offset = query.get("endOffset", [""])[0]
        entries = [e for e in entries if e[0] >= start_offset and (not end_offset or e[0] < end_offset)]
        page = entries[:page_size]
        out = {
            "kind": "storage#objects",
            "items": [entry[2] for entry in page if entry[1] == "item"],
            "prefixes": [entry[2] for entry in page if entry[1] == "prefix"],
        }
        if len(entries) > page_size:
            out["nextPageToken"] = base64.urlsafe_b64encode(page[-1][0].encode()).decode()
        response._content = json.dumps(out).encode()
        response.headers["Content-Length"] = str(len(response._content))
        self.pages_served_count += 1
