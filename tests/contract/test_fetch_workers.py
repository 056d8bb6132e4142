"""The fetch workers (backends/http/fetchworker.py, backends/http/workerengine.py):
small GETs run in worker processes that stream bodies back over a Unix socket, behind
S3Backend with --fetch-workers N. Against real servers on 127.0.0.1: `rclone serve s3`
(real S3, signatures checked) and socket servers answering byte by byte
(tests/contract/test_slow_body.py's socket_store) for what a store or a worker does
when it misbehaves.

Every test that starts workers records each process its engine started (the `spawned`
fixture) and checks at its end that the engine killed and reaped all of them; the
fixture kills whatever is left (SIGCONT first: some tests stop a worker).

"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import random
import resource
import select
import shutil
import signal
import subprocess
import sys
import termios
import threading
import time

import pytest
import trio

from bucketfs import errors
from bucketfs.backends.http import workerengine
from bucketfs.backends.http.curl import SMALL_GET_MAX_BYTES, Transfer
from bucketfs.backends.http.fetchworker import HELD_MAX_BYTES
from bucketfs.backends.http.workerengine import WorkerEngine
from bucketfs.backends.s3 import S3Backend
from tests.contract.test_http_curl import socket_backend
from tests.contract.test_slow_body import socket_store, trickle_until_hung_up

pytestmark = pytest.mark.timeout(90)

MIB = 1 << 20
REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRONG_SECRET = "wrong-secret-key-0123456789abcdefghijklmn"
_PR_SET_CHILD_SUBREAPER = 36


# -- helpers ----------------------------------------------------------------------


@pytest.fixture
def spawned(monkeypatch):
    """The Popen of every worker a WorkerEngine starts during the test. At teardown
    each must have been reaped by its engine (Popen.returncode set by its wait); any
    that was not is continued, killed and reaped here, and the test fails."""
    procs: list = []
    real_spawn = WorkerEngine._spawn

    def spawn(self):
        started = real_spawn(self)
        if started:
            procs.append(self.workers[-1].proc)
        return started

    monkeypatch.setattr(WorkerEngine, "_spawn", spawn)
    yield procs
    leftover = []
    for proc in procs:
        if proc.returncode is None:  # our child, not reaped: its pid is still its own
            leftover.append(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)
    assert not leftover, f"fetch workers left unreaped by their engine: {leftover}"


def _assert_all_reaped(procs: list) -> None:
    """Every worker started has exited and been reaped by its engine (no zombie)."""
    assert procs, "no fetch worker was started"
    for proc in procs:
        assert proc.returncode is not None, f"fetch worker {proc.pid} not reaped"
        assert not os.path.exists(f"/proc/{proc.pid}"), f"fetch worker {proc.pid} still in /proc"


def _status_field(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    raise KeyError(name)


def _vm_hwm_bytes(pid: int) -> int:
    value, unit = _status_field(pid, "VmHWM").split()
    assert unit == "kB"
    return int(value) * 1024


def _wait_until(condition, timeout_s: float, what: str) -> None:
    """Poll `condition` (on this thread) until true; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s} s")
        time.sleep(0.01)  # polling interval, not synchronisation


async def _await_until(condition, timeout_s: float, what: str) -> None:
    """The same, from a trio task (the run goes on meanwhile)."""
    with trio.move_on_after(timeout_s):
        while not condition():
            await trio.sleep(0.01)  # polling interval, not synchronisation
        return
    raise AssertionError(f"not {what} after {timeout_s} s")


def _pattern(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _headers(body_bytes: int, etag: str = "v1") -> bytes:
    return (
        "HTTP/1.1 206 Partial Content\r\n"
        f"Content-Length: {body_bytes}\r\nContent-Range: bytes 0-{body_bytes - 1}/{body_bytes}\r\n"
        f'ETag: "{etag}"\r\nContent-Type: application/octet-stream\r\n\r\n'
    ).encode()


def _socket_backend(
    endpoint: str, workers_count: int = 1, read_timeout_s: float = 10.0, attempts_count: int = 3
) -> S3Backend:
    """An S3Backend on a socket_store, its small GETs on `workers_count` fetch workers."""
    backend = socket_backend(endpoint, read_timeout_s, attempts_count, workers_count)
    assert isinstance(backend.curl, WorkerEngine), "pycurl is a dependency: the fetch workers must be there"
    return backend


def _rclone_backend(server, bucket: str, secret_key=None, **overrides) -> S3Backend:
    overrides.setdefault("fetch_workers_count", 2)
    backend = S3Backend(server.config(bucket, **overrides), session=server.session(secret_key=secret_key))
    assert isinstance(backend.curl, WorkerEngine), "pycurl is a dependency: the fetch workers must be there"
    assert backend.lean.sign_in_engine, "with fetch workers, GETs are signed in the workers"
    return backend


async def _versions(backend: S3Backend, prefix: str) -> dict:
    """key -> (size, version) of every object under `prefix` (flat pages)."""
    found, start_after = {}, ""
    while True:
        page = await backend.list_flat_page(prefix, start_after)
        found.update({info.key: (info.size_bytes, info.version) for info in page.objects})
        if page.next_token is None:
            return found
        start_after = page.next_token


def _fionread(sock) -> int:
    """Bytes waiting in a socket's receive queue."""
    count = bytearray(4)
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    return int.from_bytes(count, sys.byteorder)


# -- 1. many reads on real S3, signed in the workers -----------------------------------


def test_many_concurrent_reads_through_two_workers_return_the_stored_bytes(rclone_server, s3_bucket, spawned):
    rng = random.Random(37)
    sizes = [0, 1, 2, SMALL_GET_MAX_BYTES - 1, SMALL_GET_MAX_BYTES, SMALL_GET_MAX_BYTES + 1]
    sizes += [rng.randrange(1, 256 * 1024) for _ in range(150)]
    sizes += [rng.randrange(256 * 1024, SMALL_GET_MAX_BYTES) for _ in range(34)]
    sizes += [rng.randrange(SMALL_GET_MAX_BYTES + 2, 5 * MIB // 2) for _ in range(10)]
    objects = {f"many/{i:03d}-{size}": _pattern(size, i) for i, size in enumerate(sizes)}
    assert len(objects) == 200
    rclone_server.write_files(s3_bucket, objects)
    # Each object whole (past its end for the 0-byte one, whose read is a 416), and two
    # ranges at random offsets: some over 2 MiB (the urllib3 path), most on the workers.
    reads = [(key, 0, max(len(data), 1)) for key, data in objects.items()]
    for key, data in objects.items():
        for _ in range(2):
            if data:
                start = rng.randrange(len(data))
                reads.append((key, start, start + rng.randrange(1, 5 * MIB // 2)))
    curl_count = sum(1 for _key, start, end in reads if end - start <= SMALL_GET_MAX_BYTES)
    threads_count = len(reads) - curl_count
    assert curl_count > 300 and threads_count > 10

    backend = _rclone_backend(rclone_server, s3_bucket)
    signed_here: list = []  # URLs the daemon itself signed
    real_sign_get = backend.lean.signer.sign_get

    def sign_get(credentials, url, host, headers):
        signed_here.append(url)
        return real_sign_get(credentials, url, host, headers)

    backend.lean.signer.sign_get = sign_get

    async def main():
        found = await _versions(backend, "many/")
        assert {key: size for key, (size, _version) in found.items()} == {k: len(v) for k, v in objects.items()}
        lists_count = backend.requests["list"]
        results: dict = {}

        async def read(index, key, start, end):
            results[index] = bytes(await backend.read_range(key, start, end, found[key][1]))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for index, (key, start, end) in enumerate(reads):
                    nursery.start_soon(read, index, key, start, end)
        for index, (key, start, end) in enumerate(reads):
            assert results[index] == objects[key][start:end], (key, start, end)
        return lists_count

    try:
        lists_count = trio.run(main)
        engine = backend.curl
        assert backend.caller.retries_count == 0
        assert len(engine.workers) == 2 and engine.restarts_count == 0
        assert all(worker.gets_count > 0 for worker in engine.workers), [w.gets_count for w in engine.workers]
        assert backend.get_paths["curl"] == curl_count
        assert backend.get_paths["threads"] == threads_count
        # The workers ran the small GETs and the flat LIST pages.
        assert sum(worker.gets_count for worker in engine.workers) == curl_count + lists_count
        # Signed here: the LIST pages and the large GETs only; the small GETs were signed
        # in the workers (rclone checks every signature: a GET not signed is refused).
        assert len(signed_here) == lists_count + threads_count
    finally:
        trio.run(backend.aclose)
    _assert_all_reaped(spawned)


def test_a_wrong_secret_key_is_access_denied_through_the_workers(rclone_server, s3_bucket, spawned):
    rclone_server.write_files(s3_bucket, {"obj": b"0123456789"})
    good = _rclone_backend(rclone_server, s3_bucket)
    denied = _rclone_backend(rclone_server, s3_bucket, secret_key=WRONG_SECRET)

    async def main():
        version = (await good.stat("obj")).version
        assert await good.read_range("obj", 0, 10, version) == b"0123456789"
        with trio.fail_after(20), pytest.raises(errors.AccessDenied) as caught:
            await denied.read_range("obj", 0, 10, version)
        assert WRONG_SECRET not in str(caught.value)

    try:
        trio.run(main)
        # The denied GET went through a worker (signed there with the wrong key), once:
        # a refusal is not retried.
        assert sum(worker.gets_count for worker in denied.curl.workers) == 1
        assert denied.get_paths["curl"] == 1
    finally:
        trio.run(good.aclose)
        trio.run(denied.aclose)
    _assert_all_reaped(spawned)


# -- 2, 3. a worker killed or stopped with a GET in flight ----------------------------------


def test_a_worker_killed_mid_get_is_replaced_and_the_read_retried(spawned):
    body_bytes = 100_000
    body = _pattern(body_bytes, 2)
    part_sent, release = threading.Event(), threading.Event()

    def respond(conn, count, _stop):
        if count == 1:  # headers and part of the body, then nothing until the test is done
            conn.sendall(_headers(body_bytes) + body[:1000])
            part_sent.set()
            release.wait(30)
            return
        conn.sendall(_headers(body_bytes) + body)

    with socket_store(respond) as (endpoint, answered):
        backend = _socket_backend(endpoint, workers_count=2)
        engine = backend.curl

        async def main():
            result = []

            async def read():
                result.append(bytes(await backend.read_range("k", 0, body_bytes, "v1")))

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read)
                    await trio.to_thread.run_sync(part_sent.wait, 10)
                    [victim] = [worker for worker in engine.workers if worker.pending]
                    pids_before = set(engine.pids())
                    os.kill(victim.pid, signal.SIGKILL)
                # A replacement is started at once (the first death).
                await _await_until(lambda: len(engine.workers) == 2, 10, "two workers again")
            assert result == [body]
            return victim, pids_before

        try:
            victim, pids_before = trio.run(main)
            assert backend.caller.retries_count == 1  # the attempt on the killed worker, then one more
            assert len(answered) == 2
            assert engine.restarts_count == 1
            pids_after = set(engine.pids())
            assert victim.pid not in pids_after and len(pids_after) == 2
            assert pids_after - pids_before, "no new worker replaced the dead one"
            assert pids_before - {victim.pid} <= pids_after  # the other one is untouched
            # The killed worker was reaped (no zombie left behind).
            assert victim.proc.returncode == -signal.SIGKILL
            assert not os.path.exists(f"/proc/{victim.pid}")
        finally:
            release.set()
            trio.run(backend.aclose)
    _assert_all_reaped(spawned)


def test_a_stopped_worker_is_killed_past_its_gets_deadline_and_the_read_never_hangs(spawned, monkeypatch):
    grace_s, read_timeout_s = 0.5, 1.0
    monkeypatch.setattr(workerengine, "WORKER_GRACE_S", grace_s)
    body = _pattern(1000, 3)
    received, release = threading.Event(), threading.Event()

    def respond(conn, count, _stop):
        if count == 1:  # never answered: its worker is stopped anyway
            received.set()
            release.wait(30)
            return
        conn.sendall(_headers(len(body)) + body)

    with socket_store(respond) as (endpoint, answered):
        backend = _socket_backend(endpoint, workers_count=1, read_timeout_s=read_timeout_s)
        engine = backend.curl

        async def main():
            outcome = []

            async def read():
                try:
                    outcome.append(bytes(await backend.read_range("k", 0, len(body), "v1")))
                except errors.TransientError as exc:
                    outcome.append(exc)

            started_s = time.monotonic()
            with trio.fail_after(20):  # a hang fails here
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read)
                    await trio.to_thread.run_sync(received.wait, 10)
                    [victim] = engine.workers
                    os.kill(victim.pid, signal.SIGSTOP)
            return victim, outcome, time.monotonic() - started_s

        try:
            victim, outcome, elapsed_s = trio.run(main)
            # Killed by the watchdog, while stopped: not before its GET's deadline (the
            # read timeout plus the body at the slowest rate) plus the grace, and not long after.
            assert victim.proc.returncode == -signal.SIGKILL
            assert not os.path.exists(f"/proc/{victim.pid}")
            assert engine.restarts_count >= 1
            assert victim.pid not in engine.pids()
            assert read_timeout_s + grace_s - 0.1 <= elapsed_s < 10, elapsed_s
            # The retry goes to the replacement, which the store answers in full; or, if no
            # replacement served it within the attempts, the read fails: never a hang.
            assert len(outcome) == 1
            if not isinstance(outcome[0], errors.TransientError):
                assert outcome[0] == body
                assert len(answered) >= 2
        finally:
            release.set()
            trio.run(backend.aclose)
    _assert_all_reaped(spawned)


# -- 4. cancelled reads --------------------------------------------------------------------


def test_a_cancelled_read_returns_at_once_and_its_worker_serves_the_next(spawned):
    body_bytes = 100_000
    body = _pattern(body_bytes, 4)
    part_sent, client_went_away = threading.Event(), threading.Event()

    def respond(conn, count, stop):
        if count > 1:
            conn.sendall(_headers(body_bytes) + body)
            return
        conn.sendall(_headers(body_bytes) + body[:1000])
        part_sent.set()
        trickle_until_hung_up(conn, stop, client_went_away)  # (the rest never comes)

    with socket_store(respond) as (endpoint, answered):
        backend = _socket_backend(endpoint, workers_count=1, read_timeout_s=40)
        engine = backend.curl

        async def main():
            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(backend.read_range, "k", 0, body_bytes, "v1")
                    await trio.to_thread.run_sync(part_sent.wait, 10)
                    [worker] = engine.workers
                    assert worker.pending
                    cancelled_s = time.monotonic()
                    nursery.cancel_scope.cancel()
                assert time.monotonic() - cancelled_s < 1.0  # nothing to wait for
                assert not worker.pending
                # The worker took the transfer off the wire: the store sees the close.
                assert await trio.to_thread.run_sync(client_went_away.wait, 10)
                assert bytes(await backend.read_range("k", 0, body_bytes, "v1")) == body
            return worker

        try:
            worker = trio.run(main)
            assert engine.workers == [worker] and engine.restarts_count == 0
            assert worker.gets_count == 2 and not worker.pending
            assert len(answered) == 2
        finally:
            trio.run(backend.aclose)
    _assert_all_reaped(spawned)


def test_a_cancelled_gets_buffer_is_never_written_after_the_cancel(spawned):
    """The worker sends a GET's body in frames of HELD_MAX_BYTES; the daemon does not
    read while the first frame is sent, so it is cancelled with most of that frame
    still to come: none of it may land in the buffer its owner let go of."""
    body_bytes = 4 * HELD_MAX_BYTES
    sentinel, filler = 0xAA, 0x55
    request_in, send_body, body_done = threading.Event(), threading.Event(), threading.Event()

    def respond(conn, count, _stop):
        if count > 1:
            conn.sendall(_headers(10) + b"0123456789")
            return
        try:
            conn.sendall(_headers(body_bytes))
            request_in.set()
            send_body.wait(30)
            with contextlib.suppress(OSError):  # (the worker may drop the GET once aborted)
                conn.sendall(bytes([filler]) * body_bytes)
        finally:
            body_done.set()

    with socket_store(respond) as (endpoint, _answered):
        engine = WorkerEngine(1, 8, 2.0, 30.0, None)
        url = endpoint + "/bucket/k"
        buffer = bytearray([sentinel]) * body_bytes

        async def main():
            transfer = Transfer.ranged(url, {"Range": f"bytes=0-{body_bytes - 1}"}, buffer, 0, 30.0)
            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(engine.get, transfer)
                    await trio.to_thread.run_sync(request_in.wait, 10)
                    [worker] = engine.workers
                    # On the trio thread, so the engine reads nothing meanwhile: the body
                    # goes, the worker sends its first frame until the socket is full.
                    send_body.set()
                    _wait_until(lambda: _fionread(worker.raw) >= 64 * 1024, 10, "a frame on its way")
                    nursery.cancel_scope.cancel()
                arrived = bytes(buffer)
                # Not even the first frame had all arrived (at most what the socket held):
                # the rest of it comes after the cancel.
                assert arrived.count(filler) < HELD_MAX_BYTES, arrived.count(filler)
                assert transfer.error is None and not transfer.done.is_set()
                await trio.to_thread.run_sync(body_done.wait, 20)
                # A GET on the same worker after the rest: its answer comes after every
                # frame of the cancelled one, which the engine has then taken in.
                after = Transfer.ranged(url, {"Range": "bytes=0-9"}, bytearray(10), 0, 30.0)
                await engine.get(after)
                assert after.error is None and bytes(after.buffer) == b"0123456789"
            assert bytes(buffer) == arrived
            assert engine.restarts_count == 0 and len(engine.workers) == 1

        try:
            trio.run(main)
        finally:
            engine.close()
    _assert_all_reaped(spawned)


# -- 5. across trio runs ---------------------------------------------------------------------


def test_workers_outlive_a_trio_run_and_serve_the_next(rclone_server, s3_bucket, spawned):
    objects = {f"runs/{i}": _pattern(1000 * i, i) for i in range(1, 21)}
    rclone_server.write_files(s3_bucket, objects)
    backend = _rclone_backend(rclone_server, s3_bucket)
    engine = backend.curl

    async def read_all():
        found = await _versions(backend, "runs/")
        results = {}

        async def read(key):
            results[key] = bytes(await backend.read_range(key, 0, found[key][0], found[key][1]))

        async with trio.open_nursery() as nursery:
            for key in objects:
                nursery.start_soon(read, key)
        assert results == objects
        return sorted(engine.pids()), [worker.gets_count for worker in engine.workers]

    try:
        pids_first, gets_first = trio.run(read_all)
        assert len(pids_first) == 2
        pids_second, gets_second = trio.run(read_all)
        assert pids_second == pids_first
        assert all(second > first for first, second in zip(gets_first, gets_second))
        assert engine.restarts_count == 0 and backend.caller.retries_count == 0
    finally:
        trio.run(backend.aclose)
    _assert_all_reaped(spawned)


def test_a_run_that_ends_mid_frame_leaves_the_stream_for_the_next_run(spawned):
    """A run ends while a worker's frame is half received: the next run's reader goes
    on from there (the frame's rest is dropped, its GET failed with the run)."""
    body_bytes = 3 * HELD_MAX_BYTES
    request_in, send_body = threading.Event(), threading.Event()

    def respond(conn, count, _stop):
        if count > 1:
            conn.sendall(_headers(10) + b"0123456789")
            return
        conn.sendall(_headers(body_bytes))
        request_in.set()
        send_body.wait(30)
        with contextlib.suppress(OSError):  # (the worker may drop the GET once aborted)
            conn.sendall(b"x" * body_bytes)

    with socket_store(respond) as (endpoint, answered):
        engine = WorkerEngine(1, 8, 2.0, 30.0, None)
        url = endpoint + "/bucket/k"
        first = Transfer.ranged(url, {"Range": f"bytes=0-{body_bytes - 1}"}, bytearray(body_bytes), 0, 30.0)

        async def first_run():
            trio.lowlevel.spawn_system_task(engine.get, first)  # (cancelled as the run ends)
            await trio.to_thread.run_sync(request_in.wait, 10)
            [worker] = engine.workers
            # On the trio thread: the worker sends its first frame until the socket is full,
            # and is stopped there, so the frame's rest (more than a socket holds) cannot
            # arrive while the run ends (its reader takes a receive or two more).
            send_body.set()
            _wait_until(lambda: _fionread(worker.raw) >= 64 * 1024, 10, "a frame on its way")
            os.kill(worker.pid, signal.SIGSTOP)
            stopped.append(worker.pid)
            _wait_until(lambda: _status_field(worker.pid, "State").startswith("T"), 10, "stopped")
            deadline_s = time.monotonic() + 10
            while worker.body is None:
                assert time.monotonic() < deadline_s, "no frame half received"
                await trio.sleep(0)
            return worker

        async def second_run():
            for _ in range(3):
                transfer = Transfer.ranged(url, {"Range": "bytes=0-9"}, bytearray(10), 0, 30.0)
                with trio.fail_after(20):
                    await engine.get(transfer)
                assert transfer.error is None, transfer.error
                assert bytes(transfer.buffer) == b"0123456789"

        stopped: list = []
        try:
            worker = trio.run(first_run)
            assert worker.body is not None, "the run did not end mid-frame"
            os.kill(stopped.pop(), signal.SIGCONT)
            trio.run(second_run)
            # The same worker, its stream intact: no protocol error, no restart.
            assert engine.workers == [worker] and engine.restarts_count == 0
            assert len(answered) == 4
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
            engine.close()
    _assert_all_reaped(spawned)


# -- 6. close --------------------------------------------------------------------------------


def _answer_ten(conn, _count, _stop):
    conn.sendall(_headers(10) + b"0123456789")


@pytest.mark.parametrize("where", ["in-a-run", "outside-a-run"])
def test_close_kills_and_reaps_every_worker_and_later_gets_fail_at_once(where, spawned):
    with socket_store(_answer_ten) as (endpoint, _answered):
        engine = WorkerEngine(3, 8, 2.0, 10.0, None)
        url = endpoint + "/bucket/k"

        async def use():
            transfer = Transfer.ranged(url, {"Range": "bytes=0-9"}, bytearray(10), 0, 10.0)
            await engine.get(transfer)
            assert transfer.error is None and bytes(transfer.buffer) == b"0123456789"
            assert len(engine.workers) == 3
            if where == "in-a-run":
                engine.close()

        async def get_after_close():
            transfer = Transfer.ranged(url, {"Range": "bytes=0-9"}, bytearray(10), 0, 10.0)
            with trio.fail_after(1), pytest.raises(ConnectionError):
                await engine.get(transfer)

        try:
            trio.run(use)
            if where == "outside-a-run":
                engine.close()
            assert engine.workers == [] and engine.pids() == []
            assert len(spawned) == 3
            _assert_all_reaped(spawned)
            trio.run(get_after_close)
            engine.close()  # (idempotent)
            assert len(spawned) == 3 and engine.restarts_count == 0
        finally:
            engine.close()


def test_close_ends_a_get_in_flight_with_connection_error(spawned):
    headers_sent = threading.Event()

    def respond(conn, _count, stop):
        conn.sendall(_headers(2000))
        headers_sent.set()
        stop.wait(30)

    with socket_store(respond) as (endpoint, _answered):
        engine = WorkerEngine(1, 8, 2.0, 30.0, None)
        transfer = Transfer.ranged(endpoint + "/bucket/k", {"Range": "bytes=0-1999"}, bytearray(2000), 0, 30.0)

        async def main():
            async with trio.open_nursery() as nursery:

                async def close_when_in_flight():
                    await trio.to_thread.run_sync(headers_sent.wait, 10)
                    engine.close()

                nursery.start_soon(close_when_in_flight)
                with trio.fail_after(5):
                    await engine.get(transfer)

        try:
            trio.run(main)
            assert isinstance(transfer.error, ConnectionError)
        finally:
            engine.close()
    _assert_all_reaped(spawned)


# -- 7. the daemon's death ---------------------------------------------------------------------

DAEMON_CODE = """
import sys, trio
from bucketfs.backends.http.curl import Transfer
from bucketfs.backends.http.workerengine import WorkerEngine

engine = WorkerEngine(2, 8, 2.0, 10.0, None)

async def get():
    transfer = Transfer.ranged(sys.argv[1], {"Range": "bytes=0-9"}, bytearray(10), 0, 10.0)
    await engine.get(transfer)
    assert transfer.error is None and bytes(transfer.buffer) == b"0123456789", transfer.error

async def main():
    async with trio.open_nursery() as nursery:  # one GET each: both workers are serving
        nursery.start_soon(get)
        nursery.start_soon(get)
    assert [worker.gets_count for worker in engine.workers] == [1, 1]

trio.run(main)
print(" ".join(map(str, engine.pids())), flush=True)
sys.stdin.read()  # until killed
"""


def _set_child_subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def test_a_daemon_killed_takes_its_workers_with_it():
    """SIGKILL leaves the daemon no chance to close its engine: its workers die all the
    same. One of them is stopped first, so that it cannot exit on its own when its
    socket closes: only the kernel's parent-death signal can end it.

    This process is made a subreaper while the test runs, so the orphaned workers are
    reparented here (not to PID 1, which may never reap them) and each death is seen
    and reaped with waitpid."""
    with socket_store(_answer_ten) as (endpoint, _answered):
        _set_child_subreaper(True)
        daemon = None
        pids: list = []
        try:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_DIR, env.get("PYTHONPATH")]))
            daemon = subprocess.Popen(
                [sys.executable, "-c", DAEMON_CODE, endpoint + "/bucket/k"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            ready, _, _ = select.select([daemon.stdout], [], [], 30)
            assert ready, "the daemon printed no worker pids"
            pids = [int(pid) for pid in daemon.stdout.readline().split()]
            assert len(pids) == 2, pids
            for pid in pids:
                assert int(_status_field(pid, "PPid")) == daemon.pid
            running, stopped = pids
            os.kill(stopped, signal.SIGSTOP)
            _wait_until(lambda: _status_field(stopped, "State").startswith("T"), 10, "stopped")
            daemon.kill()
            daemon.wait(10)
            statuses: dict = {}

            def reaped_all() -> bool:
                for pid in pids:
                    if pid not in statuses:
                        with contextlib.suppress(ChildProcessError):  # (not reparented yet)
                            reaped, status = os.waitpid(pid, os.WNOHANG)
                            if reaped:
                                statuses[pid] = status
                return len(statuses) == len(pids)

            _wait_until(reaped_all, 10, "every worker gone")
            for pid in pids:
                assert not os.path.exists(f"/proc/{pid}")
            # The stopped one could not have exited: the kernel killed it.
            assert os.WIFSIGNALED(statuses[stopped]) and os.WTERMSIG(statuses[stopped]) == signal.SIGKILL
            assert running in statuses
        finally:
            if daemon is not None and daemon.poll() is None:
                daemon.kill()
                daemon.wait(10)
            for pid in pids:  # left over (the test failed): ours to end only if our child
                with contextlib.suppress(OSError, KeyError):
                    if int(_status_field(pid, "PPid")) == os.getpid():
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
            _set_child_subreaper(False)


# -- 8. a worker's memory ----------------------------------------------------------------------


def test_a_workers_memory_stays_bounded_whatever_the_bytes_in_flight(rclone_server, s3_bucket, spawned):
    concurrent_count, rounds_count = 32, 3
    objects = {f"big/{i:02d}": _pattern(SMALL_GET_MAX_BYTES, 100 + i) for i in range(concurrent_count)}
    objects["tiny"] = b"t"
    rclone_server.write_files(s3_bucket, objects)
    backend = _rclone_backend(rclone_server, s3_bucket, fetch_workers_count=1, max_connections_count=concurrent_count)
    engine = backend.curl
    digests = {key: hashlib.sha256(data).digest() for key, data in objects.items()}

    async def main():
        found = await _versions(backend, "")
        # The worker starts, imports and runs one GET: its baseline.
        assert await backend.read_range("tiny", 0, 1, found["tiny"][1]) == b"t"
        [worker] = engine.workers
        baseline_bytes = _vm_hwm_bytes(worker.pid)
        most_pending = [0]

        async def watch_pending():
            while True:
                most_pending[0] = max(most_pending[0], len(worker.pending))
                await trio.sleep(0.002)  # sampling, not synchronisation

        async def read(key):
            data = await backend.read_range(key, 0, SMALL_GET_MAX_BYTES, found[key][1])
            assert hashlib.sha256(data).digest() == digests[key], key

        with trio.fail_after(60):
            async with trio.open_nursery() as watcher:
                watcher.start_soon(watch_pending)
                for _ in range(rounds_count):
                    async with trio.open_nursery() as nursery:
                        for key in objects:
                            if key != "tiny":
                                nursery.start_soon(read, key)
                watcher.cancel_scope.cancel()
        return worker, baseline_bytes, _vm_hwm_bytes(worker.pid), most_pending[0]

    try:
        worker, baseline_bytes, peak_bytes, most_pending = trio.run(main)
        # Every GET on the one worker, most of them in flight at once: 64 MiB of bodies.
        assert engine.workers == [worker] and engine.restarts_count == 0
        assert worker.gets_count == 1 + concurrent_count * rounds_count + backend.requests["list"]
        assert most_pending * SMALL_GET_MAX_BYTES >= 48 * MIB, most_pending
        growth_mib = (peak_bytes - baseline_bytes) / MIB
        print(f"worker VmHWM {baseline_bytes / MIB:.1f} MiB -> {peak_bytes / MIB:.1f} MiB (+{growth_mib:.1f})")
        assert growth_mib < 32, f"+{growth_mib:.1f} MiB with {most_pending} GETs of 2 MiB in flight"
        assert peak_bytes < 96 * MIB
    finally:
        trio.run(backend.aclose)
    _assert_all_reaped(spawned)


def test_a_worker_with_more_gets_holding_bytes_than_one_sendmsg_takes_loses_no_byte(spawned):
    """1,100 GETs in one worker, each with 1 KiB of its body received and the rest held
    back by the store: past HELD_MAX_BYTES held, the worker sends what it holds (1,024+
    pieces). Each piece must reach its buffer, and each GET end with all its bytes."""
    count, piece_bytes = 1100, 1024
    assert count * piece_bytes > HELD_MAX_BYTES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 3 * count + 256  # sockets here and in the worker
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"RLIMIT_NOFILE's hard limit {hard} < {wanted}")
    release = threading.Event()

    def respond(conn, _count, _stop):
        conn.sendall(_headers(2 * piece_bytes) + b"x" * piece_bytes)
        release.wait(30)
        with contextlib.suppress(OSError):
            conn.sendall(b"y" * piece_bytes)

    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    try:
        with socket_store(respond) as (endpoint, answered):
            engine = WorkerEngine(1, count, 5.0, 30.0, None)
            transfers = [
                Transfer.ranged(
                    f"{endpoint}/bucket/k{i}",
                    {"Range": f"bytes=0-{2 * piece_bytes - 1}"},
                    bytearray(2 * piece_bytes),
                    0,
                    30.0,
                )
                for i in range(count)
            ]

            def sent_on() -> bool:
                return sum(1 for t in transfers if t.buffer[0] == ord("x")) >= HELD_MAX_BYTES // piece_bytes

            async def main() -> bool:
                with trio.fail_after(60):
                    async with trio.open_nursery() as nursery:
                        for transfer in transfers:
                            nursery.start_soon(engine.get, transfer)
                        # Every first piece held in the worker, most of them sent on.
                        try:
                            await _await_until(sent_on, 10, "the held pieces sent on")
                        except AssertionError:
                            nursery.cancel_scope.cancel()
                            return False
                        release.set()
                return True

            try:
                assert trio.run(main), "the held pieces never reached their buffers"
                assert len(answered) == count
                wrong = [
                    t
                    for t in transfers
                    if t.error is None and bytes(t.buffer) != b"x" * piece_bytes + b"y" * piece_bytes
                ]
                failed = [t.error for t in transfers if t.error is not None]
                assert not wrong and not failed, (
                    f"{len(wrong)} GETs with wrong bytes, {len(failed)} failed: {failed[:2]}"
                )
                assert engine.restarts_count == 0
            finally:
                release.set()
                engine.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    _assert_all_reaped(spawned)


# -- 9. a worker that cannot start ---------------------------------------------------------------

_NO_EXECUTABLE = "/nonexistent/bucketfs-test/python3"


def _exits_at_once() -> str:
    path = shutil.which("false")
    assert path, "false(1) is needed"
    return path


@pytest.mark.parametrize("how", ["popen-fails", "exits-at-once"])
def test_reads_fail_within_a_bound_when_no_worker_can_start(how, monkeypatch, spawned):
    """The worker's executable is missing (Popen fails), or it exits at once: until the
    GETs go to the daemon's thread (test_gets_go_to_a_thread_...), a read fails with
    TransientError (EIO) within its attempts' bound, never hangs."""
    monkeypatch.setattr(workerengine, "YOUNG_DEATHS_MAX", 1000)  # (no fallback to the thread here)
    monkeypatch.setattr(workerengine.sys, "executable", _NO_EXECUTABLE if how == "popen-fails" else _exits_at_once())
    read_timeout_s, attempts_count = 1.0, 2
    with socket_store(_answer_ten) as (endpoint, answered):
        backend = _socket_backend(endpoint, read_timeout_s=read_timeout_s, attempts_count=attempts_count)

        async def main():
            started_s = time.monotonic()
            with trio.fail_after(20), pytest.raises(errors.TransientError):
                await backend.read_range("k", 0, 10, "v1")
            return time.monotonic() - started_s

        try:
            elapsed_s = trio.run(main)
            # Each attempt waits at most its own deadline for a worker.
            assert elapsed_s < attempts_count * (read_timeout_s + 1) + 2, elapsed_s
            assert answered == []
            if how == "popen-fails":
                assert spawned == [] and backend.curl.restarts_count == 0
        finally:
            trio.run(backend.aclose)
    for proc in spawned:  # (exits-at-once: every one exited, and its engine reaped it)
        assert proc.returncode is not None


def test_a_worker_that_could_not_start_is_started_once_it_can(monkeypatch, spawned):
    real_executable = sys.executable
    monkeypatch.setattr(workerengine, "YOUNG_DEATHS_MAX", 1000)  # (no fallback to the thread here)
    monkeypatch.setattr(workerengine, "RESTART_MIN_INTERVAL_S", 0.2)
    monkeypatch.setattr(workerengine, "RESTART_MAX_INTERVAL_S", 0.5)
    monkeypatch.setattr(workerengine.sys, "executable", _NO_EXECUTABLE)
    with socket_store(_answer_ten) as (endpoint, _answered):
        backend = _socket_backend(endpoint, read_timeout_s=1.0, attempts_count=2)

        async def main():
            with trio.fail_after(20), pytest.raises(errors.TransientError):
                await backend.read_range("k", 0, 10, "v1")
            # The executable is back (a package reinstalled, a full disk freed).
            monkeypatch.setattr(workerengine.sys, "executable", real_executable)
            deadline_s = time.monotonic() + 5
            while True:
                with trio.fail_after(20):
                    try:
                        return bytes(await backend.read_range("k", 0, 10, "v1"))
                    except errors.TransientError:
                        if time.monotonic() > deadline_s:
                            raise AssertionError("no worker started 5 s after it could") from None

        try:
            assert trio.run(main) == b"0123456789"
        finally:
            trio.run(backend.aclose)
    _assert_all_reaped(spawned)


def test_workers_that_die_at_once_are_restarted_at_a_bounded_rate(monkeypatch, spawned):
    monkeypatch.setattr(workerengine, "YOUNG_DEATHS_MAX", 1000)  # (no fallback to the thread here)
    monkeypatch.setattr(workerengine.sys, "executable", _exits_at_once())
    with socket_store(_answer_ten) as (endpoint, _answered):
        backend = _socket_backend(endpoint, read_timeout_s=1.0, attempts_count=2)
        engine = backend.curl

        async def main():
            with trio.fail_after(20), pytest.raises(errors.TransientError):
                await backend.read_range("k", 0, 10, "v1")
            # A window of 2 s: at RESTART_MIN_INTERVAL_S (1 s), doubling, a few restarts.
            await trio.sleep(2)  # (a measuring window, not synchronisation)

        try:
            trio.run(main)
            assert engine.restarts_count <= 6, f"{engine.restarts_count} restarts in ~2 s"
        finally:
            trio.run(backend.aclose)
    for proc in spawned:
        assert proc.returncode is not None


@pytest.mark.parametrize("how", ["popen-fails", "exits-at-once"])
def test_gets_go_to_a_thread_of_the_daemon_once_workers_prove_unable_to_run(how, monkeypatch, spawned):
    """YOUNG_DEATHS_MAX workers in a row that cannot start, or die before they end a
    GET: the GETs go to the daemon's own curl thread (logged), reads return the right
    bytes, and no more workers are started."""
    monkeypatch.setattr(workerengine, "RESTART_MIN_INTERVAL_S", 0.1)
    monkeypatch.setattr(workerengine.sys, "executable", _NO_EXECUTABLE if how == "popen-fails" else _exits_at_once())
    with socket_store(_answer_ten) as (endpoint, answered):
        backend = _socket_backend(endpoint, read_timeout_s=1.0, attempts_count=5)
        engine = backend.curl

        async def main():
            with trio.fail_after(30):
                first = bytes(await backend.read_range("k", 0, 10, "v1"))
            restarts_count = engine.restarts_count
            with trio.fail_after(10):
                second = bytes(await backend.read_range("k", 0, 10, "v1"))
            return first, second, restarts_count

        try:
            first, second, restarts_count = trio.run(main)
            assert first == second == b"0123456789"
            assert engine.fallback is not None and engine.workers == []
            assert engine.restarts_count == restarts_count  # (none started after the switch)
            assert len(answered) == 2  # one GET each, both on the thread
        finally:
            trio.run(backend.aclose)
    for proc in spawned:
        assert proc.returncode is not None


def test_a_worker_that_cannot_get_a_socket_leaves_the_watchdog_on(monkeypatch, spawned):
    monkeypatch.setattr(workerengine, "WORKER_GRACE_S", 0.5)
    real_socketpair = workerengine.socket.socketpair
    received = threading.Event()
    request_lines: list = []

    def respond(conn, count, stop):
        if b"/stuck " not in request_lines[0][count - 1]:
            conn.sendall(_headers(10) + b"0123456789")
            return
        received.set()
        stop.wait(30)

    def no_second_socketpair(*args):  # the second worker's: out of file descriptors
        monkeypatch.setattr(workerengine.socket, "socketpair", real_socketpair)
        raise OSError(errno.EMFILE, "Too many open files")

    def socketpair_once(*args):
        monkeypatch.setattr(workerengine.socket, "socketpair", no_second_socketpair)
        return real_socketpair(*args)

    with socket_store(respond) as (endpoint, answered):
        request_lines.append(answered)
        engine = WorkerEngine(2, 8, 2.0, 1.0, None)

        async def main():
            # (Patched inside the run: trio makes a socketpair of its own as it starts.)
            monkeypatch.setattr(workerengine.socket, "socketpair", socketpair_once)
            with contextlib.suppress(OSError):  # (the GET that met EMFILE may fail)
                await engine.get(Transfer.ranged(endpoint + "/bucket/k", {"Range": "bytes=0-9"}, bytearray(10), 0, 1.0))
            stuck = Transfer.ranged(endpoint + "/bucket/stuck", {"Range": "bytes=0-9"}, bytearray(10), 0, 1.0)
            async with trio.open_nursery() as nursery:

                async def get():
                    with trio.move_on_after(6):
                        await engine.get(stuck)

                nursery.start_soon(get)
                await trio.to_thread.run_sync(received.wait, 10)
                [worker] = [worker for worker in engine.workers if worker.pending]
                worker.proc.send_signal(signal.SIGSTOP)
            return stuck

        try:
            stuck = trio.run(main)
            assert stuck.done.is_set(), "a GET on a stopped worker still waits 6 s on (no watchdog)"
            assert isinstance(stuck.error, ConnectionError)
        finally:
            for proc in spawned:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGCONT)
            engine.close()
    _assert_all_reaped(spawned)


# -- 10. LIST pages through the workers -----------------------------------------------------------


def test_flat_list_pages_through_the_workers_hold_every_key(rclone_server, s3_bucket, spawned):
    keys = sorted(f"list/d{i % 5}/{i:05d}" for i in range(2600))
    rclone_server.write_files(s3_bucket, {key: b"k" for key in keys})
    backend = _rclone_backend(rclone_server, s3_bucket)
    engine = backend.curl

    async def main():
        listed, start_after, pages_count = [], "", 0
        while True:
            page = await backend.list_flat_page("list/", start_after)
            pages_count += 1
            listed += [info.key for info in page.objects]
            if page.next_token is None:
                return listed, pages_count
            start_after = page.next_token

    try:
        listed, pages_count = trio.run(main)
        assert listed == keys
        assert pages_count == 3
        # Each page was one GET on a worker (a page the engine could not serve goes
        # again on a thread: none did).
        assert sum(worker.gets_count for worker in engine.workers) == pages_count
        assert backend.caller.retries_count == 0 and engine.restarts_count == 0
    finally:
        trio.run(backend.aclose)
    _assert_all_reaped(spawned)
