"""Readers killed mid-read, through a real mount on a slow store: what a DataLoader's
workers go through when a training loop breaks out of an epoch or is interrupted.

The kernel does not wait for a killed reader's READs: it releases the file while
they are still in the daemon, whose answers then go nowhere. The daemon must take
that in its stride: stay up, let go of every handle, and serve the same files right
to the next readers. Both ways files are opened: by the daemon (OPEN and RELEASE,
`--kernel-dir-cache off`) and by the kernel itself (the default, noopen.py), where a
file a killed reader left half read keeps its inode's handle until a READ reaches its
end or none came for INODE_HANDLE_IDLE_S (a hole it left may be read after the file's
last pages are in the page cache: no READ then reaches the end).
"""

import os
import signal
import subprocess
import sys

import pytest

from bucketfs.testing.fault_proxy import fault_proxy
from bucketfs.testing.mounting import wait_for

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
GET_DELAY_S = 0.3  # every GET takes this long: READs are in flight when the kill comes
READERS = 8

# A reader: every file in turn, whole, over and over, until killed.
READER_CODE = """
import sys
paths = sys.argv[1:]
while True:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 20):
                pass
"""


def dataset() -> dict:
    files = {f"train/img{i}.jpg": os.urandom(300_000 + i) for i in range(12)}
    files.update({f"shards/shard-{i:06d}.tar": os.urandom(16 * MiB + i) for i in range(2)})
    return files


@pytest.mark.timeout(180)
@pytest.mark.parametrize("opened_by", ["kernel", "daemon"])
def test_readers_killed_mid_read_leave_the_mount_serving_right_bytes(
    rclone_server, s3_bucket, mount_factory, opened_by
):
    files = dataset()
    rclone_server.write_files(s3_bucket, files)
    with fault_proxy(rclone_server.endpoint_url, delay_s=GET_DELAY_S) as proxy:
        options = ("--kernel-dir-cache", "off") if opened_by == "daemon" else ()
        m = mount_factory(
            rclone_server, s3_bucket, "", "--max-memory", "64M", "--part-size", "2M", *options, endpoint_url=proxy.url
        )
        keys = sorted(files)
        readers = [
            subprocess.Popen([sys.executable, "-c", READER_CODE, *[m.path(k) for k in keys[i::READERS]]])
            for i in range(READERS)
        ]
        try:
            # Readers have files open and READs are waiting on GETs (with the kernel
            # opening files, a handle is the daemon's only while a file is being read).
            wait_for(
                lambda: (
                    m.stats()["handles.open"] >= (READERS if opened_by == "daemon" else 1)
                    and len(proxy.object_gets()) >= READERS
                ),
                60,
                "readers reading",
            )
        finally:
            for r in readers:
                r.send_signal(signal.SIGKILL)
            for r in readers:
                r.wait(timeout=60)
        assert all(r.returncode == -signal.SIGKILL for r in readers)
        if opened_by == "daemon":
            wait_for(lambda: m.stats()["handles.open"] == 0, 60, "the killed readers' files released")
        assert m.stats()["handles.open"] <= len(files)

        for key, data in files.items():
            with open(m.path(key), "rb") as f:
                assert f.read() == data, key
        # Every file read to its end: no handle is left either way.
        wait_for(lambda: m.stats()["handles.open"] == 0, 60, "every handle let go of")
        stats = m.stats()
        assert stats.get("namespace.kernel_opens_files", 0) == (opened_by == "kernel")
        assert m.proc.poll() is None, "the daemon died"
        assert stats.get("errors.EIO", 0) == 0, stats
        assert stats["memory.used_bytes"] <= stats["memory.budget_bytes"]
        assert "unexpected error" not in m.stderr_text
