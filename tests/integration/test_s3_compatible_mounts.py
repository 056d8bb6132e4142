"""Real mounts of the S3-compatible stores users run: no ETags or empty ones, ETags
that are no MD5s, listed times that are no modification times (AIStore), redirects
(AIStore's gateways), and an object replaced while mounted (moto: atomic overwrites).

Each tree holds files from 0 B to tens of MiB, read through the mount sequentially
and at random offsets, and must come back byte-identical with no error."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import time

import pytest

from bucketfs.backends import versions
from bucketfs.testing.mounting import wait_for
from bucketfs.testing.s3_fronts import RedirectFront, RewritingFront, started

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
MiB = 1024 * 1024
SIZES = [0, 1, 4095, 100_000, 3 * MiB + 5, 24 * MiB + 3]


def _tree() -> dict:
    rng = random.Random(34)
    return {f"mixed/f{i:02d}-{size}.bin": rng.randbytes(size) for i, size in enumerate(SIZES)}


def _assert_reads_back(mount, tree: dict) -> None:
    """Every file whole (sequentially, as `cat` reads) and at random offsets (pread)."""
    assert sorted(os.listdir(mount.path("mixed"))) == sorted(key.split("/")[1] for key in tree)
    for key, data in tree.items():
        path = mount.path(key)
        assert os.stat(path).st_size == len(data)
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).digest() == hashlib.sha256(data).digest(), key
    rng = random.Random(7)
    for key, data in tree.items():
        fd = os.open(mount.path(key), os.O_RDONLY)
        try:
            for _ in range(20):
                offset, length = rng.randrange(len(data) + 1), rng.randrange(1, 256 * 1024)
                assert os.pread(fd, length, offset) == data[offset : offset + length], (key, offset, length)
        finally:
            os.close(fd)


def _mount_tree(server, mount_factory, *, endpoint_url=None, mtime_s=None):
    tree = _tree()
    bucket = server.new_bucket()
    server.write_files(bucket, tree, mtime_s=mtime_s)
    kwargs = {"endpoint_url": endpoint_url} if endpoint_url else {}
    return tree, mount_factory(server, bucket, "", **kwargs)


def test_a_store_with_empty_etags_mounts_and_reads(rclone_server_no_etag, mount_factory):
    tree, mount = _mount_tree(rclone_server_no_etag, mount_factory, mtime_s=int(time.time()) - 60)
    _assert_reads_back(mount, tree)
    assert versions.PINNING_LOG[versions.LASTMOD] in mount.stderr_text
    assert mount.stats().get("errors.ESTALE", 0) == 0


def test_a_store_that_sends_no_etags_at_all_mounts_and_reads(rclone_server, mount_factory):
    with started(RewritingFront(rclone_server.endpoint_url, strip_etags=True)) as front:
        tree, mount = _mount_tree(rclone_server, mount_factory, endpoint_url=front.url)
        _assert_reads_back(mount, tree)
        assert versions.PINNING_LOG[versions.LASTMOD] in mount.stderr_text


def test_etags_that_are_no_md5s_mount_and_read_with_one_get_per_small_file(rclone_server_xxh3, mount_factory):
    tree, mount = _mount_tree(rclone_server_xxh3, mount_factory)
    _assert_reads_back(mount, tree)
    stats = mount.stats()
    assert stats.get("backend.corrupt_bodies", 0) == 0 and stats.get("backend.retries", 0) == 0
    assert versions.PINNING_LOG[versions.ETAG] in mount.stderr_text


def test_listed_times_at_the_epoch_stat_and_read(rclone_server, mount_factory, tmp_path):
    cache_dir = tmp_path / "cache"
    with started(RewritingFront(rclone_server.endpoint_url, epoch_times=True)) as front:
        tree = _tree()
        bucket = rclone_server.new_bucket()
        rclone_server.write_files(bucket, tree)
        mount = mount_factory(rclone_server, bucket, "", "--cache-dir", str(cache_dir), endpoint_url=front.url)
        _assert_reads_back(mount, tree)
        assert all(os.stat(mount.path(key)).st_mtime == 0 for key in tree)
        mount.close()
        # The disk cache keys on the ETag: a second mount reads the cache, not the store.
        front_gets = len(front.object_gets())
        again = mount_factory(rclone_server, bucket, "", "--cache-dir", str(cache_dir), endpoint_url=front.url)
        with open(again.path("mixed/f03-100000.bin"), "rb") as f:
            assert f.read() == tree["mixed/f03-100000.bin"]
        assert len(front.object_gets()) == front_gets


def test_redirected_gets_are_followed_and_counted(rclone_server, mount_factory):
    with started(RedirectFront(rclone_server.endpoint_url)) as front:
        tree, mount = _mount_tree(rclone_server, mount_factory, endpoint_url=front.url)
        _assert_reads_back(mount, tree)
        stats = mount.stats()
        assert stats["backend.redirects"] == front.redirects_sent > 0
        assert stats.get("backend.retries", 0) == 0
        # One push to a fetch-ahead worker learns that the store redirects; none after
        # (each would be refused, its GET wasted).
        assert stats.get("open.worker_refused", 0) + stats.get("fetch_ahead.push_refused", 0) <= 1


def test_a_redirect_loop_is_eio_within_the_retry_budget(rclone_server, mount_factory):
    bucket = rclone_server.new_bucket()
    rclone_server.write_files(bucket, {"k.bin": b"0123456789"})
    with started(RedirectFront(rclone_server.endpoint_url, loop=True)) as front:
        mount = mount_factory(rclone_server, bucket, "", endpoint_url=front.url)
        started_s = time.monotonic()
        with pytest.raises(OSError) as caught:
            with open(mount.path("k.bin"), "rb") as f:
                f.read()
        assert caught.value.errno == errno.EIO
        assert time.monotonic() - started_s < 30
        assert os.listdir(mount.mountpoint) == ["k.bin"]  # the mount keeps serving


def test_a_replaced_object_is_stale_for_its_reader_and_new_for_later_opens(moto_server, mount_factory):
    """moto overwrites atomically and answers 412 to a stale If-Match."""
    bucket = moto_server.new_bucket()
    old, new = random.Random(1).randbytes(6 * MiB), random.Random(2).randbytes(6 * MiB)
    moto_server.put(bucket, "d/big.bin", old)
    moto_server.put(bucket, "d/small.jpg", old[:100_000])
    try:
        mount = mount_factory(
            moto_server, bucket, "", "--readahead-max", "1M", "--part-size", "1M", "--small-file-bytes", "1M"
        )
        fd = os.open(mount.path("d", "big.bin"), os.O_RDONLY)
        try:
            assert os.pread(fd, 64 * 1024, 0) == old[: 64 * 1024]
            with open(mount.path("d", "small.jpg"), "rb") as f:
                assert f.read() == old[:100_000]
            moto_server.put(bucket, "d/big.bin", new)
            moto_server.put(bucket, "d/small.jpg", new[:100_000])
            with pytest.raises(OSError) as caught:
                for offset in range(5 * MiB, 6 * MiB, 64 * 1024):
                    data = os.pread(fd, 64 * 1024, offset)
                    assert data == old[offset : offset + len(data)], "bytes of the new version"
            assert caught.value.errno == errno.ESTALE
            # Later opens of the name read the new version once the directory is listed again.

            def reads_new() -> bool:
                try:
                    with open(mount.path("d", "big.bin"), "rb") as f:
                        return f.read() == new
                except OSError as exc:
                    assert exc.errno == errno.ESTALE  # (before the new listing is in)
                    return False

            wait_for(reads_new, 30, "an open of the replaced object reads its new version")
            with pytest.raises(OSError) as caught:  # the old handle stays pinned to the old version
                os.pread(fd, 64 * 1024, 5 * MiB)
            assert caught.value.errno == errno.ESTALE
        finally:
            os.close(fd)
        # The small file was replaced too: the kernel kept its old pages, under the old
        # inode; the name now names the new one.
        with open(mount.path("d", "small.jpg"), "rb") as f:
            assert f.read() == new[:100_000]
        assert os.stat(mount.path("d", "big.bin")).st_size == len(new)
        assert mount.stats()["namespace.stale_relists"] >= 1
    finally:
        moto_server.delete_bucket(bucket)
