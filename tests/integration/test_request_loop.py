"""bucketfs's FUSE request loop (bucketfs/fuse/requestloop.py) on a real mount over
rclone's S3 server: it serves the mount in the immutable default; 32 threads opening
files at once (each Python open() an IOCTL libfuse answers) have requests read with
no wait before them, and every byte reads back right, cold and warm; a READ waiting on
a slow store holds up no other request; with --kernel-dir-cache off, pyfuse3's own
loop serves the mount."""

import concurrent.futures
import os
import random
import threading

import pytest

from bucketfs.testing.fault_proxy import fault_proxy
from bucketfs.testing.mounting import pinned_in_page_cache, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
STORE_DELAY_S = 6.0


def dataset() -> dict:
    rng = random.Random(43)
    return {f"train/c{i % 5}/img{i:03d}.jpg": rng.randbytes(rng.randrange(1, 120_000)) for i in range(200)}


def read_all(m, keys, threads: int = 32) -> dict:
    def one(key):
        with open(m.path(key), "rb") as f:  # (buffered: Python asks isatty(), an IOCTL)
            return key, f.read()

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return dict(pool.map(one, keys))


def test_requests_queued_at_once_are_read_without_a_wait_and_every_byte_is_right(
    rclone_server, s3_bucket, mount_factory
):
    files = dataset()
    rclone_server.write_files(s3_bucket, files)
    m = mount_factory(rclone_server, s3_bucket)
    list(os.walk(m.path("train")))
    assert m.stats()["fuse_loop.active"] == 1
    assert read_all(m, files) == files  # cold
    with pinned_in_page_cache([m.path(key) for key in files]):
        before = m.stats().get("fuse_loop.requests_read_at_once", 0)
        for _ in range(3):
            keys = list(files)
            random.Random(_).shuffle(keys)
            assert read_all(m, keys) == files  # warm: an IOCTL per open reaches the daemon
        assert m.stats()["fuse_loop.requests_read_at_once"] > before
    assert "errors.EIO" not in m.stats()


def test_a_read_waiting_on_a_slow_store_holds_up_no_other_request(rclone_server, s3_bucket, mount_factory):
    files = dataset()
    slow_key = "slow/one.bin"  # (one GET when it is read: small, and nothing is fetched ahead)
    slow_body = random.Random(5).randbytes(200_000)
    rclone_server.write_files(s3_bucket, {**files, slow_key: slow_body})
    with fault_proxy(rclone_server.endpoint_url, 0.0, 1, stall_s=0.0) as proxy:
        m = mount_factory(rclone_server, s3_bucket, "", "--fetch-ahead", "off", endpoint_url=proxy.url)
        list(os.walk(m.path("train")))
        os.stat(m.path(slow_key))
        assert read_all(m, files) == files  # (cached: in the page cache from here on)
        with pinned_in_page_cache([m.path(key) for key in files]):
            proxy.delay_s = STORE_DELAY_S  # every GET from now on is held that long
            slow_read: dict = {}
            reader = threading.Thread(target=lambda: slow_read.update(body=open(m.path(slow_key), "rb").read()))
            reader.start()
            try:
                wait_for(
                    lambda: any(r.path.endswith(slow_key) for r in proxy.object_gets()),
                    30,
                    "the slow file's first GET sent",
                )
                # While the slow file's READ waits on the store, other files open and
                # read (their IOCTLs and GETATTRs served by the daemon meanwhile).
                assert read_all(m, files) == files
                assert reader.is_alive() and "body" not in slow_read
            finally:
                reader.join(STORE_DELAY_S * 5)
        assert slow_read["body"] == slow_body


def test_with_the_kernel_dir_cache_off_pyfuse3s_loop_serves_the_mount(rclone_server, s3_bucket, mount_factory):
    files = dataset()
    rclone_server.write_files(s3_bucket, files)
    m = mount_factory(rclone_server, s3_bucket, "", "--kernel-dir-cache", "off")
    list(os.walk(m.path("train")))
    assert read_all(m, files) == files
    assert "fuse_loop.active" not in m.stats()
