"""A store that stops answering, through a real mount: readers get EIO within the
configured timeouts (never a hang, never wrong bytes), cached metadata keeps being
served, failures are not cached (a failed listing is not an empty directory), and
once the store answers again the same files read back correctly from the same daemon.

The store is a private server (`rclone serve s3`, or the GCS emulator) frozen with
SIGSTOP: its sockets stay open and accept connections, but nothing answers, which is
what a hung server or a black-holed network path looks like to a client (the harder
case than a refused connection, which fails at once).
"""

import errno
import hashlib
import os
import queue
import random
import signal
import threading
import time

import pytest

from bucketfs.core.filesystem import KERNEL_RETRY_WINDOW_S
from bucketfs.testing.gcs_server import GCSServer, start_gcs_emulator
from bucketfs.testing.servers import rclone_s3_server

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
# The mount's own limits: each attempt may stall this long, this many times.
READ_TIMEOUT_S = 1
ATTEMPTS = 2
# Generous: an EIO must come from those limits (~2.5 s here), not from the test's timeout.
EIO_DEADLINE_S = 30
# Failed reads allowed after the store came back: the frozen store's last read-ahead
# parts (a few per stream) may fail once more after the thaw.
OUTAGE_LEFTOVER_FAILURES_MAX = 4


def rnd(n_bytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n_bytes)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(params=["s3", pytest.param("gcs", marks=pytest.mark.gcs)])
def private_store(request, tmp_path):
    """(server, pid, put_many, mount args): a server of this test's own, so freezing it
    cannot stall other tests."""
    if request.param == "s3":
        with rclone_s3_server(tmp_path / "store") as server:
            yield server, server.pid, server.write_files, ()
    else:
        with start_gcs_emulator() as emulator:
            server = GCSServer(emulator)
            # The emulator serves one request at a time.
            yield server, emulator.pid, server.put_many, ("--max-connections", "4")


class Frozen:
    """SIGSTOP the server for the block; SIGCONT on the way out, whatever happens."""

    def __init__(self, pid: int):
        self.pid = pid

    def __enter__(self):
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        os.kill(self.pid, signal.SIGCONT)
        return False


def within(deadline_s: float, fn):
    """fn()'s result, or its exception, if it ends within `deadline_s`; else fail.

    fn runs in a thread: a read blocked in the kernel on a FUSE request does not
    return on a signal (the kernel waits for the daemon's answer), so the test's
    own timeout could not stop it. The mount's teardown unblocks such a thread."""
    out: queue.Queue = queue.Queue()

    def run():
        try:
            out.put((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            out.put((False, exc))

    threading.Thread(target=run, daemon=True).start()
    try:
        ok, value = out.get(timeout=deadline_s)
    except queue.Empty:
        raise AssertionError(f"a reader still blocked after {deadline_s} s: the mount hangs") from None
    if not ok:
        raise value
    return value


def store_answers(server, bucket: str, key: str) -> None:
    """One byte of `key` asked of the store directly, past the mount. A server just
    thawed first serves the requests that queued while it was stopped (the GCS
    emulator one at a time): until this answers, the mount's own reads may still run
    out of their 1 s timeouts, rightly."""
    if isinstance(server, GCSServer):
        server.client.bucket(bucket).blob(key).download_as_bytes(start=0, end=0)
    else:
        server.client.get_object(Bucket=bucket, Key=key, Range="bytes=0-0")["Body"].read()


def read_on(fd: int, expected: bytes) -> tuple:
    """(the file's bytes, failed reads on the way): read through `fd` from 0; after a
    failure, go on from where it stopped once the mount's memory of failed READs
    (KERNEL_RETRY_WINDOW_S) is over, as a reader's own retry would. Every byte is
    checked as it comes: a short read is a failure, other bytes a wrong answer."""
    got, failures = bytearray(), 0
    while len(got) < len(expected):
        try:
            data = os.pread(fd, len(expected) - len(got), len(got))
        except OSError as exc:
            assert exc.errno == errno.EIO, exc
            data = b""
        assert data == expected[len(got) : len(got) + len(data)], f"wrong bytes from {len(got)}"
        got += data
        if len(got) < len(expected):
            failures += 1
            if failures > OUTAGE_LEFTOVER_FAILURES_MAX:
                break
            time.sleep(KERNEL_RETRY_WINDOW_S)  # (a reader's retry, not a wait for an event)
    return bytes(got), failures


def read_all(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.timeout(120)
def test_frozen_store_gives_eio_in_bounded_time_and_the_mount_recovers(private_store, mount_factory):
    server, pid, put_many, store_args = private_store
    bucket = server.new_bucket()
    files = {f"data/img{i}.jpg": rnd(150_000 + i, i) for i in range(3)}
    files["data/shard-000000.tar"] = rnd(24 * MiB, 10)
    files["other/never-listed.bin"] = rnd(1000, 11)
    put_many(bucket, files)
    m = mount_factory(
        server,
        bucket,
        "",
        *store_args,
        "--read-timeout",
        str(READ_TIMEOUT_S),
        "--connect-timeout",
        "1",
        "--retries",
        str(ATTEMPTS),
        "--part-size",
        "1M",
        "--readahead-max",
        "2M",
    )
    names = sorted(os.listdir(m.path("data")))  # the listing is cached from here on
    assert read_all(m.path("data", "img0.jpg")) == files["data/img0.jpg"]
    shard = files["data/shard-000000.tar"]
    fd = os.open(m.path("data", "shard-000000.tar"), os.O_RDONLY)
    try:
        head = os.pread(fd, 1 * MiB, 0)
        assert head == shard[: len(head)]

        with Frozen(pid):
            # A small file never fetched: its one GET stalls, is retried, then EIO.
            with pytest.raises(OSError) as info:
                within(EIO_DEADLINE_S, lambda: read_all(m.path("data", "img1.jpg")))
            assert info.value.errno == errno.EIO

            # A stream past its read-ahead: what it returns before the EIO is the right bytes.
            def stream_on():
                for off in range(1 * MiB, len(shard), 1 * MiB):
                    data = os.pread(fd, 1 * MiB, off)
                    assert data == shard[off : off + len(data)], f"wrong bytes at {off}"

            with pytest.raises(OSError) as info:
                within(EIO_DEADLINE_S, stream_on)
            assert info.value.errno == errno.EIO
            # A directory not listed yet: EIO, not an empty listing that would stick.
            with pytest.raises(OSError) as info:
                within(EIO_DEADLINE_S, lambda: os.listdir(m.path("other")))
            assert info.value.errno == errno.EIO
            # Metadata comes from the cache: the frozen store is never asked.
            assert within(EIO_DEADLINE_S, lambda: sorted(os.listdir(m.path("data")))) == names
            assert within(EIO_DEADLINE_S, lambda: os.stat(m.path("data", "img2.jpg")).st_size) == len(
                files["data/img2.jpg"]
            )

        # The store answers again: the failures were not cached, the same handle goes on.
        within(EIO_DEADLINE_S, lambda: store_answers(server, bucket, "data/shard-000000.tar"))
        again, failures = within(EIO_DEADLINE_S, lambda: read_on(fd, shard))
        # Read-ahead the frozen store left running may still fail (a connect attempt that
        # met the frozen listener times out after the thaw): each costs a reader one
        # EIO at most, then the store is asked again.
        assert failures <= OUTAGE_LEFTOVER_FAILURES_MAX, (
            f"still failing after the store came back, at {len(again)} bytes"
        )
        assert again == shard
    finally:
        os.close(fd)
    assert os.listdir(m.path("other")) == ["never-listed.bin"]
    for key, data in files.items():
        assert sha(read_all(m.path(key))) == sha(data), key
    assert m.proc.poll() is None, "the daemon died"
    stats = m.stats()
    assert stats["errors.EIO"] >= 3  # the small file, the stream, the listing
