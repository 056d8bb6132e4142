"""READs of up to 4 MiB (bucketfs/fuse/requestsize.py) on a real mount over rclone's
S3 server: a streamed shard reaches the daemon in a quarter of the READs it took at
libfuse's 1 MiB where the kernel allows it (root raises fs.fuse.max_pages_limit), every
byte right, READs that span two read-ahead parts included; with --kernel-dir-cache off
nothing is written into libfuse's session and READs stay at 1 MiB."""

import os
import random

import pytest

from bucketfs.fuse.requestsize import LIBFUSE_MAX_PAGES, PAGE_BYTES, REQUEST_BYTES, max_pages_limit
from bucketfs.testing.mounting import fuse_requests_waiting, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
MiB = 1024 * 1024
SHARD_BYTES = 40 * MiB + 5  # (an odd end: the last READ is short)


def stream(path: str, read_bytes: int) -> bytes:
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(read_bytes):
            out += chunk
    return bytes(out)


def streamed_reads(m, key: str, expected: bytes) -> tuple:
    """(READs the daemon served for one cold pass over `key`, the daemon's stats)."""
    before = m.stats().get("fuse.read", 0)
    assert stream(m.path(key), 1 * MiB) == expected
    wait_for(lambda: fuse_requests_waiting(m.mountpoint) in (0, None), 30, "the stream's READs answered")
    stats = m.stats()
    return stats.get("fuse.read", 0) - before, stats


@pytest.fixture
def shard(rclone_server, s3_bucket):
    data = random.Random(41).randbytes(SHARD_BYTES)
    # Read first: a few small files, so the kernel opens files itself before the shard.
    files = {f"warm/f{i}.bin": bytes([i]) * 1000 for i in range(8)}
    rclone_server.write_files(s3_bucket, {"shards/shard-000000.tar": data, **files})
    return data, files


def test_a_streamed_shard_comes_in_reads_of_up_to_4_mib(rclone_server, s3_bucket, mount_factory, shard):
    data, files = shard
    m = mount_factory(rclone_server, s3_bucket)
    for key, body in files.items():
        assert stream(m.path(key), 1 * MiB) == body
    limit = max_pages_limit()  # (raised by the mount where it may: root)
    largest_bytes = min(REQUEST_BYTES, (limit or LIBFUSE_MAX_PAGES) * PAGE_BYTES)
    reads, stats = streamed_reads(m, "shards/shard-000000.tar", data)
    assert stats["fuse.max_read_bytes"] == largest_bytes
    if os.geteuid() == 0 and limit is not None:
        assert largest_bytes == REQUEST_BYTES
    # The kernel's read-ahead starts small and grows to its 4 MiB window: a few small
    # READs first, then whole windows.
    assert reads <= SHARD_BYTES // largest_bytes + 8, stats
    assert stats.get("fuse.replies_from_thread", 0) >= reads - 8, stats


def test_kernel_dir_cache_off_leaves_libfuses_session_alone(rclone_server, s3_bucket, mount_factory, shard):
    data, files = shard
    m = mount_factory(rclone_server, s3_bucket, "", "--kernel-dir-cache", "off")
    reads, stats = streamed_reads(m, "shards/shard-000000.tar", data)
    assert "fuse.max_read_bytes" not in stats
    assert reads >= SHARD_BYTES // (LIBFUSE_MAX_PAGES * PAGE_BYTES), stats
