"""Fetch-ahead workers receiving pushes into the shared arena (workerengine.py,
fetchworker.py, arena.py), with real worker processes, a real HTTP server and a pipe
standing in for /dev/fuse (the worker's STORE notifications are read from it).

Checked: a pushed body reaches the "kernel" and the daemon's kept copy byte for byte;
a body WANTed back comes back and its extent is freed once the worker says so
(RELEASED); a push given up on mid-GET has its extent freed when the worker ends it,
never before; a worker killed mid-GET has its extent reused only once it exited.
Pushes started with no task (push_soon) end by their call the same ways: DONE, a
worker killed, the trio run ending.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.server
import os
import signal
import struct
import threading

import pytest
import trio

from bucketfs.backends.base import PushRequest
from bucketfs.backends.http.arena import LOST, PAGE_BYTES
from bucketfs.backends.http.curl import BodyTransfer, pycurl
from bucketfs.backends.http.workerengine import WorkerEngine

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.skipif(pycurl is None, reason="the workers' engine needs pycurl"),
]

KiB = 1024
ARENA_BYTES = 1024 * KiB
OBJECTS = {f"obj{i}": os.urandom(size) for i, size in enumerate((1, 5000, 100 * KiB, 300 * KiB))}
F_SETPIPE_SZ = 1031
STORE_HEADER = struct.Struct("<IiQQQII")  # fuse_out_header, fuse_notify_store_out
WAIT_S = 20.0


class _Handler(http.server.BaseHTTPRequestHandler):
    server: "_Server"

    def do_GET(self):  # noqa: N802 - http.server's name
        name = self.path.lstrip("/")
        body = OBJECTS[name]
        hold = self.server.holds.get(name)
        if hold is not None:
            self.server.started.set()
            hold.wait(WAIT_S)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", f'"{hashlib.md5(body).hexdigest()}"')
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)

    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.holds: dict = {}  # name -> threading.Event: its answer waits for it
        self.started = threading.Event()  # a held GET arrived


class _Kernel:
    """A pipe the workers write their notifications into, drained by a thread:
    {ino: bytes stored}."""

    def __init__(self):
        self.read_fd, self.fd = os.pipe()
        fcntl.fcntl(self.fd, F_SETPIPE_SZ, 1 << 20)
        self.stored: dict = {}
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self):
        with os.fdopen(self.read_fd, "rb", buffering=0) as f:
            while header := f.read(16):
                length, code, _unique = struct.unpack("<IiQ", header)
                rest = _read_exactly(f, length - 16)
                if code == 4:  # FUSE_NOTIFY_STORE
                    ino, offset, size, _pad = struct.unpack_from("<QQII", rest)
                    self.stored[ino] = rest[24 : 24 + size]

    def close(self):
        os.close(self.fd)
        self._thread.join(timeout=WAIT_S)


def _read_exactly(f, n: int) -> bytes:
    parts = []
    while n:
        part = f.read(n)
        if not part:
            break
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


@pytest.fixture
def server():
    s = _Server()
    thread = threading.Thread(target=s.serve_forever, daemon=True)
    thread.start()
    yield s
    for hold in s.holds.values():
        hold.set()
    s.shutdown()
    s.server_close()


@pytest.fixture
def kernel():
    k = _Kernel()
    yield k
    k.close()


@pytest.fixture
def engine(kernel):
    e = WorkerEngine(1, 8, 5.0, 10.0, None, kernel_fd=kernel.fd, arena_bytes=ARENA_BYTES)
    assert e.arena is not None
    yield e
    e.close()


def push(engine, server, name: str, ino: int, request=None):
    body = OBJECTS[name]
    transfer = BodyTransfer(f"http://127.0.0.1:{server.server_address[1]}/{name}", [], bytearray(), 0, 10.0)
    checks = (hashlib.md5(body).hexdigest(), None, hashlib.md5(body).digest(), (), ())
    return engine.push(transfer, len(body), ino, checks, request or PushRequest(tell_open=False))


def push_soon(engine, server, name: str, ino: int, ended: dict) -> None:
    """push() with no task: `ended[name]` = (transfer, kept) once it ended."""
    body = OBJECTS[name]
    transfer = BodyTransfer(f"http://127.0.0.1:{server.server_address[1]}/{name}", [], bytearray(), 0, 10.0)
    checks = (hashlib.md5(body).hexdigest(), None, hashlib.md5(body).digest(), (), ())

    def on_end(transfer, kept) -> None:
        assert name not in ended, "ended twice"
        ended[name] = (transfer, kept)

    engine.push_soon(transfer, len(body), ino, checks, PushRequest(tell_open=False), on_end)


async def until(condition, what: str) -> None:
    """Wait for `condition()` (state the engine's tasks change as frames arrive)."""
    with trio.fail_after(WAIT_S):
        while not condition():
            await trio.sleep(0.005)


def pages(n_bytes: int) -> int:
    return -(-n_bytes // PAGE_BYTES) * PAGE_BYTES


def test_pushed_bodies_reach_the_kernel_and_the_kept_copy_byte_for_byte(engine, server, kernel):
    async def main():
        kept = {}
        for ino, name in enumerate(OBJECTS, start=10):
            transfer, body = await push(engine, server, name, ino)
            assert transfer.error is None and not transfer.buffer
            kept[name] = body
        assert engine.arena.live_bytes == sum(pages(len(b)) for b in OBJECTS.values())
        for name, body in kept.items():
            assert body.read(0, 1 << 30) == OBJECTS[name]
            assert body.read(3, 7) == OBJECTS[name][3:7]
            body.discard(give_back=True)
        assert engine.arena.live_bytes == 0
        await until(lambda: len(kernel.stored) == len(OBJECTS), "the notifications")

    trio.run(main)
    assert kernel.stored == {ino: OBJECTS[name] for ino, name in enumerate(OBJECTS, start=10)}


def test_a_body_wanted_back_comes_back_and_its_extent_is_freed_once_released(engine, server, kernel):
    server.holds["obj2"] = threading.Event()

    async def main():
        request = PushRequest(tell_open=False)
        async with trio.open_nursery() as nursery:
            results = []

            async def pushing():
                results.append(await push(engine, server, "obj2", 20, request))

            nursery.start_soon(pushing)
            await trio.to_thread.run_sync(server.started.wait, WAIT_S)
            assert engine.arena.live_bytes == pages(len(OBJECTS["obj2"]))
            request.ask_for_body()  # (a READ came while the push ran)
            # The WANT leaves the daemon before the body leaves the server: a body the
            # worker had already begun to store would go into the kernel as well.
            await until(lambda: not any(worker.outbox for worker in engine.workers), "the WANT sent")
            server.holds["obj2"].set()
        ((transfer, body),) = results
        assert body is None and bytes(transfer.buffer) == OBJECTS["obj2"]
        await until(lambda: engine.arena.live_bytes == 0, "the RELEASED")

    trio.run(main)
    assert 20 not in kernel.stored


def test_a_body_wanted_before_the_push_is_sent_takes_no_extent(server, kernel):
    """A reader's file (Filesystem._push_for_reader) comes back through the socket: the
    ring's oldest kept copies stay (the loader may read them next). The arena holds
    one 300 KiB body: an extent for the second would take the first's kept copy."""
    engine = WorkerEngine(1, 8, 5.0, 10.0, None, kernel_fd=kernel.fd, arena_bytes=512 * KiB)

    async def main():
        _, kept = await push(engine, server, "obj3", 24)
        request = PushRequest(tell_open=False)
        request.ask_for_body()
        transfer, body = await push(engine, server, "obj3", 25, request)
        assert body is None and bytes(transfer.buffer) == OBJECTS["obj3"]
        assert kept.read(0, 1 << 30) == OBJECTS["obj3"]
        assert engine.arena.live_bytes == pages(len(OBJECTS["obj3"]))

    try:
        trio.run(main)
    finally:
        engine.close()
    assert 25 not in kernel.stored


def test_a_push_given_up_mid_get_frees_its_extent_only_when_the_worker_ends_it(engine, server, kernel):
    server.holds["obj3"] = threading.Event()

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(push, engine, server, "obj3", 30)
            await trio.to_thread.run_sync(server.started.wait, WAIT_S)
            nursery.cancel_scope.cancel()
        # The worker still holds the extent: it may be writing it.
        assert engine.arena.live_bytes == pages(len(OBJECTS["obj3"]))
        server.holds["obj3"].set()
        await until(lambda: engine.arena.live_bytes == 0, "the aborted push's DONE")
        transfer, body = await push(engine, server, "obj2", 31)  # (the arena serves on)
        assert body.read(0, 1 << 30) == OBJECTS["obj2"]

    trio.run(main)


def test_a_killed_workers_extent_is_reused_only_once_it_exited(server, kernel):
    """The arena holds one 300 KiB body, not two: the push after the kill needs the
    dead worker's extent, free once its process exited (it might still be reading it)."""
    server.holds["obj3"] = threading.Event()
    engine = WorkerEngine(1, 8, 5.0, 10.0, None, kernel_fd=kernel.fd, arena_bytes=512 * KiB)

    async def main():
        async with trio.open_nursery() as nursery:
            results = []

            async def pushing():
                results.append(await push(engine, server, "obj3", 40))

            nursery.start_soon(pushing)
            await trio.to_thread.run_sync(server.started.wait, WAIT_S)
            (pid,) = engine.pids()
            os.kill(pid, signal.SIGKILL)
            server.holds.pop("obj3").set()
        ((transfer, body),) = results
        assert isinstance(transfer.error, ConnectionError) and body is None
        extents = list(engine.arena._ring)
        assert all(extent.state == LOST for extent in extents) or engine.arena.live_bytes == 0
        await until(lambda: engine.pids() and engine.pids()[0] != pid, "the replacement")
        transfer, body = await push(engine, server, "obj3", 41)
        assert transfer.error is None, transfer.error
        assert body.read(0, 1 << 30) == OBJECTS["obj3"]

    try:
        trio.run(main)
    finally:
        engine.close()


def test_pushes_with_no_task_reach_the_kernel_and_the_kept_copy_byte_for_byte(engine, server, kernel):
    async def main():
        assert not engine.pushes_now  # (no worker before the first push: push() waits for one)
        await push(engine, server, "obj0", 50)
        assert engine.pushes_now
        ended: dict = {}
        for ino, name in enumerate(OBJECTS, start=60):
            push_soon(engine, server, name, ino, ended)
        await until(lambda: len(ended) == len(OBJECTS), "every push's end")
        for name, (transfer, body) in ended.items():
            assert transfer.error is None and not transfer.buffer
            assert body.read(0, 1 << 30) == OBJECTS[name]
            body.discard(give_back=False)
        await until(lambda: engine.arena.live_bytes == pages(len(OBJECTS["obj0"])), "the arena's extents back")
        await until(lambda: len(kernel.stored) == len(OBJECTS) + 1, "the notifications")

    trio.run(main)
    assert {ino: kernel.stored[ino] for ino in range(60, 60 + len(OBJECTS))} == {
        ino: OBJECTS[name] for ino, name in enumerate(OBJECTS, start=60)
    }


def test_a_push_with_no_task_ends_with_an_error_when_its_worker_is_killed(engine, server, kernel):
    server.holds["obj3"] = threading.Event()

    async def main():
        await push(engine, server, "obj0", 70)
        ended: dict = {}
        push_soon(engine, server, "obj3", 71, ended)
        await trio.to_thread.run_sync(server.started.wait, WAIT_S)
        (pid,) = engine.pids()
        os.kill(pid, signal.SIGKILL)
        server.holds.pop("obj3").set()
        await until(lambda: "obj3" in ended, "the push's end")
        transfer, body = ended["obj3"]
        assert isinstance(transfer.error, ConnectionError) and body is None
        await until(lambda: engine.pushes_now and engine.pids()[0] != pid, "the replacement")
        push_soon(engine, server, "obj2", 72, ended)
        await until(lambda: "obj2" in ended, "the next push's end")
        transfer, body = ended["obj2"]
        assert transfer.error is None and body.read(0, 1 << 30) == OBJECTS["obj2"]

    trio.run(main)


def test_a_push_with_no_task_ends_with_an_error_when_the_trio_run_ends(engine, server, kernel):
    server.holds["obj3"] = threading.Event()
    ended: dict = {}

    async def main():
        await push(engine, server, "obj0", 80)
        push_soon(engine, server, "obj3", 81, ended)
        await trio.to_thread.run_sync(server.started.wait, WAIT_S)

    trio.run(main)
    transfer, body = ended["obj3"]
    assert isinstance(transfer.error, ConnectionError) and body is None
    server.holds.pop("obj3").set()
