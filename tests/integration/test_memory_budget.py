"""The memory budget holds on a real mount: 64 files read at once stay within
--max-memory plus the documented overhead (README: ~150 MB for the interpreter,
SDKs, listings and the bytes in flight in worker threads)."""

import concurrent.futures
import hashlib
import os
import random

import pytest

from bucketfs.testing.mounting import wait_for

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
OVERHEAD_BYTES = 150 * MiB


def rss_peak_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_64_concurrent_readers_stay_within_budget(rclone_server, s3_bucket, mount_factory):
    rng = random.Random(5)
    objects = {f"shards/shard-{i:02d}.tar": rng.randbytes(24 * MiB) for i in range(8)}
    objects.update({f"img/{i:03d}.jpg": rng.randbytes(2 * MiB) for i in range(56)})
    rclone_server.write_files(s3_bucket, objects)
    budget_bytes = 64 * MiB
    m = mount_factory(rclone_server, s3_bucket, "", "--max-memory", "64M")
    baseline_bytes = rss_peak_bytes(m.proc.pid)

    def read(key):
        digest = hashlib.sha256()
        with open(m.path(key), "rb") as f:
            while chunk := f.read(1 * MiB):
                digest.update(chunk)
        return key, digest.hexdigest()

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = dict(pool.map(read, objects))
    assert results == {k: hashlib.sha256(v).hexdigest() for k, v in objects.items()}
    peak_bytes = rss_peak_bytes(m.proc.pid)
    assert peak_bytes <= budget_bytes + OVERHEAD_BYTES, (
        f"peak RSS {peak_bytes >> 20} MiB (started at {baseline_bytes >> 20} MiB)"
    )
    wait_for(lambda: os.path.ismount(m.mountpoint), 5, "mount still up")
