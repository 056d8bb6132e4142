"""Fixtures for real mounts against the test servers: rclone and moto (S3), and
the GCS emulator (tests/conftest.py)."""

import os

import pytest

from bucketfs.testing.mounting import Mount, force_unmount, server_env

_USE_SERVER_ENDPOINT = object()


@pytest.fixture
def empty_dir(tmp_path):
    """An empty directory to mount on; whatever is mounted there is undone after."""
    d = tmp_path / "mp"
    d.mkdir()
    yield str(d)
    force_unmount(str(d))


# Of each mount's log, what a failed test prints (the daemon's warnings name every
# failed request: a flaky failure in CI is explained by them or not at all).
FAILED_LOG_TAIL_CHARS = 6000


@pytest.fixture
def mount_factory(tmp_path, request):
    """mount(server, bucket, prefix="", *args) -> Mount; every mount is torn down.

    The URL's scheme is the server's `scheme` ("s3" when it has none, "gs" for the
    GCS emulator). `--endpoint-url` is the server's unless `endpoint_url=` says
    otherwise (None: no flag, e.g. to mount through STORAGE_EMULATOR_HOST);
    `extra_env` is added to the mount's environment (`server_env`); `new_session` as
    for Mount.
    """
    mounts = []

    def mount(
        server,
        bucket,
        prefix="",
        *args,
        mountpoint=None,
        endpoint_url=_USE_SERVER_ENDPOINT,
        extra_env=None,
        new_session=False,
    ):
        mp = mountpoint or tmp_path / f"mnt{len(mounts)}"
        os.makedirs(mp, exist_ok=True)
        url = f"{getattr(server, 'scheme', 's3')}://{bucket}/{prefix}"
        if endpoint_url is _USE_SERVER_ENDPOINT:
            endpoint_url = server.endpoint_url
        m = Mount(
            url,
            str(mp),
            server_env(server, **(extra_env or {})),
            args,
            new_session=new_session,
            endpoint_url=endpoint_url,
        )
        mounts.append(m)
        return m

    yield mount
    for m in mounts:
        m.close()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for m in mounts:
            print(
                f"--- log of the mount of {m.url} on {m.mountpoint} (tail) ---\n{m.stderr_text[-FAILED_LOG_TAIL_CHARS:]}"
            )
