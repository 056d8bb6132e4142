"""Shared fixtures: real S3-compatible servers and the GCS emulator on 127.0.0.1
(see tests/servers.py and tests/gcs_server.py).

Servers are session-scoped and started lazily, only by tests that ask for them;
buckets are per test, so tests never see each other's objects.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Optional

import pytest

from tests.gcs_server import GCSEmulator, start_gcs_emulator
from tests.servers import moto_s3_server, rclone_s3_server


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on the test item (`item.rep_call`...), so a fixture's
    teardown can tell that the test failed and leave evidence (a mount's log)."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture(scope="session")
def rclone_server(tmp_path_factory):
    """`rclone serve s3` over a fresh temp directory, for the whole session."""
    with rclone_s3_server(tmp_path_factory.mktemp("rclone-root")) as server:
        yield server


@pytest.fixture(scope="session")
def rclone_server_no_etag(tmp_path_factory):
    """`rclone serve s3 --etag-hash ""`: empty ETags in listings and answers, as some
    S3-compatible stores send (SeaweedFS lists them so)."""
    with rclone_s3_server(tmp_path_factory.mktemp("rclone-no-etag"), etag_hash="") as server:
        yield server


@pytest.fixture(scope="session")
def rclone_server_xxh3(tmp_path_factory):
    """`rclone serve s3 --etag-hash XXH3`: ETags that are 16-hex-digit hashes, no MD5s."""
    with rclone_s3_server(tmp_path_factory.mktemp("rclone-xxh3"), etag_hash="XXH3") as server:
        yield server


@pytest.fixture(scope="session")
def moto_server():
    """moto's S3 server (answers 412 to a failed If-Match), for the whole session."""
    with moto_s3_server() as server:
        yield server


@pytest.fixture
def s3_bucket(rclone_server):
    """A fresh, uniquely named bucket on the rclone server; deleted afterwards."""
    bucket = rclone_server.new_bucket()
    try:
        yield bucket
    finally:
        rclone_server.delete_bucket(bucket)


_BOUNDARY = b"bucketfs-test-boundary-7d1e0c4b"
_MULTIPART_TYPE = f"multipart/related; boundary={_BOUNDARY.decode()}"


class GCSServer:
    """The GCS emulator as the mount and contract fixtures see a server.

    Same shape as tests.servers.S3Server where they overlap (`scheme`,
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
                data = b"".join([
                    b"--", _BOUNDARY, b"\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n", meta,
                    b"\r\n--", _BOUNDARY, b"\r\nContent-Type: application/octet-stream\r\n\r\n",
                    b"\r\n--", _BOUNDARY, b"--\r\n",
                ])
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


@pytest.fixture(scope="session")
def gcs_server():
    """The GCS emulator (gcp-storage-emulator, in memory), for the whole session."""
    with start_gcs_emulator() as emulator:
        yield GCSServer(emulator)
