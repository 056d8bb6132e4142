"""Fixtures for real mounts against the rclone (and moto) S3 servers."""

import os

import pytest

from tests.integration.mounting import Mount


@pytest.fixture
def mount_factory(tmp_path):
    """mount(server, bucket, prefix="", *args) -> Mount; every mount is torn down."""
    mounts = []

    def mount(server, bucket, prefix="", *args, mountpoint=None):
        mp = mountpoint or tmp_path / f"mnt{len(mounts)}"
        os.makedirs(mp, exist_ok=True)
        url = f"s3://{bucket}/{prefix}"
        env = dict(os.environ, **server.env())
        m = Mount(url, str(mp), env, ("--endpoint-url", server.endpoint_url, *args))
        mounts.append(m)
        return m

    yield mount
    for m in mounts:
        m.close()
