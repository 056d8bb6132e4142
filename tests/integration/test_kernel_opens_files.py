"""The kernel opens files itself in the immutable default (bucketfs/fuse/noopen.py),
on a real mount over rclone's S3 server: after a few checked READs, OPEN is answered
ENOSYS and no OPEN or RELEASE reaches the daemon again; every byte reads back right
by inode, small files, a shard read in parts and files read by many threads at once;
a warm pass reaches the daemon with nothing at all; the stats file still reads fresh
counters; and with --kernel-dir-cache off, or --metadata-ttl, files are opened as
before."""

import concurrent.futures
import os
import random

import pytest

from bucketfs.fuse.noopen import VERIFY_COUNT
from bucketfs.metrics import STATS_FILE_NAME
from bucketfs.testing.mounting import drop_page_cache, fuse_requests_waiting, pinned_in_page_cache, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
MiB = 1024 * 1024


def dataset() -> dict:
    rng = random.Random(37)
    files = {f"train/c{i % 4}/img{i:03d}.jpg": rng.randbytes(rng.randrange(1, 300_000)) for i in range(120)}
    files["shards/shard-000000.tar"] = rng.randbytes(24 * MiB + 5)
    return files


def read_all(m, files: dict, threads: int = 16) -> dict:
    def one(key):
        with open(m.path(key), "rb") as f:
            got = b""
            while chunk := f.read(1 * MiB):
                got += chunk
        return key, got

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return dict(pool.map(one, files))


def fuse_counts(m) -> dict:
    return {k: v for k, v in m.stats().items() if k.startswith("fuse.")}


def test_after_a_few_checked_reads_no_open_or_release_reaches_the_daemon(rclone_server, s3_bucket, mount_factory):
    files = dataset()
    rclone_server.write_files(s3_bucket, files)
    m = mount_factory(rclone_server, s3_bucket)
    for top in ("train", "shards"):
        list(os.walk(m.path(top)))  # (a listing: the first OPENDIR finds pyfuse3's table of operations)
    assert read_all(m, files) == files
    # (the kernel's read-ahead READs past what the readers asked for may still be on their way)
    wait_for(lambda: fuse_requests_waiting(m.mountpoint) in (0, None), 30, "the first pass's READs answered")
    first = fuse_counts(m)
    assert m.stats()["namespace.kernel_opens_files"] == 1
    # Opens before the switch: the checked ones, and those already in flight then. Those
    # closed before it were released; the kernel sends no RELEASE for the others: they
    # were let go of at the switch.
    assert first.get("fuse.open", 0) <= VERIFY_COUNT + 16 and first.get("fuse.release", 0) <= first["fuse.open"]
    assert m.stats()["handles.open"] == 0 and "errors.EIO" not in m.stats()

    with pinned_in_page_cache([m.path(key) for key in files]):  # (no reclaim between the passes)
        first = fuse_counts(m)
        assert read_all(m, files) == files  # warm: the page cache has every byte
        warm = fuse_counts(m)
    for op in ("fuse.open", "fuse.release", "fuse.read", "fuse.lookup", "fuse.getattr"):
        assert warm.get(op, 0) == first.get(op, 0), op

    if drop_page_cache():  # (root): every file read again by inode, from the daemon
        assert read_all(m, files) == files
        cold = fuse_counts(m)
        assert cold["fuse.read"] > warm["fuse.read"] and cold.get("fuse.open", 0) == warm.get("fuse.open", 0)
        assert m.stats()["handles.open"] == 0  # (each file read to its end: its handle released)

    stats_path = m.path(STATS_FILE_NAME)
    with open(stats_path, "rb") as f:
        before = f.read()
    with open(m.path("train/c0/img000.jpg"), "rb") as f:
        f.read()
    assert read_all(m, {k: files[k] for k in list(files)[:5]}) == {k: files[k] for k in list(files)[:5]}
    with open(stats_path, "rb") as f:
        after = f.read()
    assert before != after and after.rstrip().endswith(b"}")  # (fresh counters, whole)


@pytest.mark.parametrize("args", [("--kernel-dir-cache", "off"), ("--metadata-ttl", "3600")])
def test_without_private_layouts_or_with_a_ttl_files_are_opened_as_before(
    rclone_server, s3_bucket, mount_factory, args
):
    files = dataset()
    rclone_server.write_files(s3_bucket, files)
    m = mount_factory(rclone_server, s3_bucket, "", *args)
    list(os.walk(m.path("train")))
    small = {k: v for k, v in files.items() if k.startswith("train/")}
    assert read_all(m, small) == small
    counts = fuse_counts(m)
    assert "namespace.kernel_opens_files" not in m.stats()
    assert counts["fuse.open"] == counts["fuse.release"] == len(small)
