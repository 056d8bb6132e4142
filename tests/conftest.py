"""Shared fixtures: real S3-compatible servers and the GCS emulator on 127.0.0.1
(see bucketfs/testing/servers.py and bucketfs/testing/gcs_server.py).

Servers are session-scoped and started lazily, only by tests that ask for them;
buckets are per test, so tests never see each other's objects.
"""

from __future__ import annotations

import pytest

from bucketfs.testing.gcs_server import GCSServer, start_gcs_emulator
from bucketfs.testing.servers import moto_s3_server, rclone_s3_server


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


@pytest.fixture(scope="session")
def gcs_server():
    """The GCS emulator (gcp-storage-emulator, in memory), for the whole session."""
    with start_gcs_emulator() as emulator:
        yield GCSServer(emulator)
