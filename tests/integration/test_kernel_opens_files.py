"""The kernel opens files itself in the immutable default (bucketfs/fuse/noopen.py),
on a real mount over rclone's S3 server: after a few checked READs, OPEN is answered
ENOSYS and no OPEN or RELEASE reaches the daemon again; every byte reads back right
by inode, small files, a shard read in parts and files read by many threads at once;
a warm pass reaches the daemon with nothing at all; the stats file still reads fresh
counters; and with --kernel-dir-cache off, or --metadata-ttl, files are opened as
before."""

import concurrent.futures
import errno
import json
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


def test_large_reads_are_replied_from_the_reply_thread_every_byte_right(rclone_server, s3_bucket, mount_factory):
    """READs of REPLY_THREAD_MIN_BYTES or more (a shard streamed: the kernel asks for
    1 MiB at a time) are served by a task of the daemon and replied from its reply
    thread (bucketfs/fuse/replies.py); their errors still reach the reader as errnos."""
    files = dataset()
    rclone_server.write_files(s3_bucket, files)
    m = mount_factory(rclone_server, s3_bucket)
    list(os.walk(m.path("train")))  # (the first OPENDIR finds the table of operations)
    small = {key: data for key, data in files.items() if key.startswith("train/")}
    assert read_all(m, small) == small  # (checks the handle's offset: large READs may then be taken)
    shard_key = "shards/shard-000000.tar"
    shard = files[shard_key]
    # The whole shard first, alone: all of its 24 MiB comes through READs of at most
    # 4 MiB (max_read), so at least 6, the first perhaps smaller. (Read beside the ranges
    # below, pages they had brought into the page cache took READs from it: 7 under CI.)
    with open(m.path(shard_key), "rb") as f:
        assert f.read() == shard
    assert m.stats().get("fuse.replies_from_thread", 0) >= 5, m.stats().get("fuse.read")
    drop_page_cache()  # (root: the ranges' READs reach the daemon too)
    rng = random.Random(3)
    ranges = [(0, len(shard))] + [
        (start, rng.randrange(1, 5 * MiB)) for start in (rng.randrange(len(shard)) for _ in range(24))
    ]

    def read_range(span):
        start, length = span
        with open(m.path(shard_key), "rb") as f:
            return os.pread(f.fileno(), length, start) if length < 8 * MiB else f.read()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for (start, length), got in zip(ranges, pool.map(read_range, ranges)):
            assert got == shard[start : start + length], (start, length)
    stats = m.stats()
    assert "errors.EIO" not in stats
    # The file's handle goes once it was read to its end and its other readers have
    # stopped: at a READ, or at the mount's sweep of idle handles (every 5 s).
    wait_for(lambda: m.stats()["handles.open"] == 0, 30, "the shard's handle released")
    # The stats file's READs (its size is a bound of 16 MiB: the kernel asks for large
    # ones) stay in order: each reading is one snapshot, whole.
    for _ in range(5):
        with open(m.path(STATS_FILE_NAME), "rb") as f:
            assert json.loads(f.read())["fuse.read"] > 0

    if drop_page_cache():  # (root): the shard's READs reach the daemon again
        rclone_server.put(s3_bucket, shard_key, b"another version" * 100_000)
        with pytest.raises(OSError) as caught:
            with open(m.path(shard_key), "rb") as f:
                f.read()
        assert caught.value.errno == errno.ESTALE  # (pinned to the version listed)
        assert m.stats().get("errors.ESTALE", 0) >= 1


def test_a_shard_read_again_at_once_streams_and_costs_its_bytes_once(rclone_server, s3_bucket, mount_factory):
    """A shard read again right after it was read to its end (the next epoch of a small
    data set whose pages were evicted, or a second reader): its READs from the start
    are the file read again, not the late read-ahead of the first pass; they stream
    through a handle of their own, fetching the shard once, not READ by READ through
    the block cache."""
    files = dataset()
    rclone_server.write_files(s3_bucket, files)
    m = mount_factory(rclone_server, s3_bucket)
    list(os.walk(m.path("")))
    small = {key: data for key, data in files.items() if key.startswith("train/")}
    assert read_all(m, small) == small  # (the kernel opens files from here on)
    shard_key = "shards/shard-000000.tar"
    shard = {shard_key: files[shard_key]}
    if not drop_page_cache():
        pytest.skip("dropping the page cache needs root")
    for _ in range(3):
        before = m.stats()
        assert read_all(m, shard, threads=1) == shard
        drop_page_cache()
        after = m.stats()
        fetched = after["backend.bytes_fetched"] - before.get("backend.bytes_fetched", 0)
        assert fetched <= len(files[shard_key]) + 2 * MiB
        assert after.get("cache.misses", 0) - before.get("cache.misses", 0) <= 8
        assert after["prefetch.streams"] - before.get("prefetch.streams", 0) == 1
    assert "errors.EIO" not in m.stats()


def test_readers_of_a_shards_slices_at_once_read_every_byte_and_fetch_it_about_once(
    rclone_server, s3_bucket, mount_factory
):
    """Four threads each stream a quarter of one shard, as a loader's workers read
    their slices of a large file: the kernel sends their READs by inode, with no
    handle to tell them apart. Each reader keeps a stream of its own
    (core/handlereader.py); with one stream per file they fetched 2.7x its bytes."""
    files = dataset()
    shard_key = "shards/shard-000000.tar"
    shard = files[shard_key] = random.Random(4).randbytes(64 * MiB + 3)  # (slices of 16 MiB: 4 READs and more each)
    rclone_server.write_files(s3_bucket, files)
    m = mount_factory(rclone_server, s3_bucket)
    list(os.walk(m.path("")))
    small = {key: data for key, data in files.items() if key.startswith("train/")}
    assert read_all(m, small) == small  # (the kernel opens files from here on)
    bounds = [len(shard) * i // 4 for i in range(5)]

    def read_slice(i):
        fd = os.open(m.path(shard_key), os.O_RDONLY)
        try:
            got, off = bytearray(), bounds[i]
            while off < bounds[i + 1]:
                chunk = os.pread(fd, min(MiB, bounds[i + 1] - off), off)
                assert chunk, (i, off)
                got += chunk
                off += len(chunk)
            return bytes(got)
        finally:
            os.close(fd)

    before = m.stats()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert b"".join(pool.map(read_slice, range(4))) == shard
    after = m.stats()
    assert after["prefetch.streams"] - before.get("prefetch.streams", 0) >= 2
    assert after["backend.bytes_fetched"] - before.get("backend.bytes_fetched", 0) <= 1.5 * len(shard)
    assert "errors.EIO" not in after


def test_a_stop_while_large_reads_wait_on_a_frozen_store_replies_to_them_and_exits(tmp_path, empty_dir, mount_factory):
    """READs served by the daemon's own tasks (replies.py) blocked on a store that
    stopped answering: a second SIGTERM still ends the daemon at once, cleanly, and the
    reader gets an error rather than waiting for ever."""
    from bucketfs.testing.mounting import stop_twice_while_a_read_waits_on_a_frozen_store
    from bucketfs.testing.servers import rclone_s3_server

    with rclone_s3_server(tmp_path / "store") as server:
        bucket = server.new_bucket()
        small = {f"train/img{i}.jpg": bytes([i]) * 50_000 for i in range(VERIFY_COUNT + 2)}
        server.write_files(bucket, {**small, "shards/big.tar": b"s" * (16 * MiB)})
        m = mount_factory(server, bucket, mountpoint=empty_dir)
        list(os.walk(m.path("")))
        assert read_all(m, small, threads=1) == small  # (the handle's offset checked: large READs are taken)
        try:
            stop_twice_while_a_read_waits_on_a_frozen_store(m, server, m.path("shards/big.tar"))
        finally:
            m.close()


def test_concurrent_readers_of_the_stats_file_each_read_one_whole_snapshot(rclone_server, s3_bucket, mount_factory):
    """Once the kernel opens files, the stats file has no handle per reading: each
    reader (thread) is served one snapshot from its first READ to its end, however
    the readings of other threads interleave and whatever the counters do meanwhile."""
    files = dataset()
    del files["shards/shard-000000.tar"]
    rclone_server.write_files(s3_bucket, files)
    m = mount_factory(rclone_server, s3_bucket)
    list(os.walk(m.path("train")))
    assert read_all(m, files) == files
    assert m.stats()["namespace.kernel_opens_files"] == 1
    stats_path = m.path(STATS_FILE_NAME)
    busy = True

    def churn():  # (the counters change between and during readings)
        while busy:
            drop_page_cache()
            read_all(m, dict(list(files.items())[:8]), threads=2)

    def readings(_worker):
        texts = []
        for _ in range(150):
            with open(stats_path, "rb") as f:
                texts.append(f.read())
        return texts

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        churning = pool.submit(churn)
        try:
            texts = [text for got in pool.map(readings, range(4)) for text in got]
        finally:
            busy = False
        churning.result()
    for text in texts:
        assert json.loads(text)["namespace.kernel_opens_files"] == 1, text[-200:]
    assert len(set(texts)) > 1  # (readings of changing counters)
