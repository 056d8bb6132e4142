"""Shared fixtures: real S3-compatible servers on 127.0.0.1 (see tests/servers.py).

Servers are session-scoped and started lazily, only by tests that ask for them;
buckets are per test, so tests never see each other's objects.
"""

from __future__ import annotations

import pytest

from tests.servers import moto_s3_server, rclone_s3_server


@pytest.fixture(scope="session")
def rclone_server(tmp_path_factory):
    """`rclone serve s3` over a fresh temp directory, for the whole session."""
    with rclone_s3_server(tmp_path_factory.mktemp("rclone-root")) as server:
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
