"""Small GETs for trio tasks, run by fetch worker processes (fetchworker.py): the
daemon's side. A drop-in for CurlEngine (`get(transfer)`, `close()`).

Why: the process that answers FUSE runs every request under one GIL. With the GETs'
HTTP work (libcurl and its callbacks, SigV4 signing, a whole object's MD5) in other
processes, the daemon's part of a GET is a request queued and its body copied in
(docs/design.md, "Fetch workers").

Invariants:
- A body lands in the caller's buffer, reserved by the caller in the daemon's memory
  budget; the worker keeps none past HELD_MAX_BYTES. Nothing is written into a buffer
  after its GET was cancelled or failed: frames of a GET nobody waits for are dropped.
- No reader waits forever: a worker that dies fails its GETs at once
  (ConnectionError: the backend's retries send them again, to a live worker), and one
  silent past a GET's deadline plus WORKER_GRACE_S is killed, with the same effect.
  A dead worker that served is replaced at once; one that died before it ended a GET
  (it cannot start, or crashes at once) after RESTART_MIN_INTERVAL_S, doubling up to
  RESTART_MAX_INTERVAL_S while that goes on: no busy loop of interpreters starting.
- No worker outlives the engine: close() kills them, and the kernel kills them when
  the daemon's thread that started them ends (PR_SET_PDEATHSIG, fetchworker.py).
- Workers outlive a trio run (the CLI's commands and the tests run several): their
  reader and writer tasks are the run's system tasks, and keep their stream's state
  on the worker, so the next run's tasks go on where they stopped. The GETs of a run
  that ended fail (nobody waits for them).
"""

from __future__ import annotations

import logging
import marshal
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import trio

import bucketfs
from bucketfs.backends.http.arena import PushArena
from bucketfs.backends.http.curl import BodyTransfer, CurlEngine, Transfer
from bucketfs.backends.http.fetchworker import (
    ABORT,
    BODY,
    DATA,
    DONE,
    FRAME,
    GET,
    PUSH,
    RANGED,
    REFUSED,
    RELEASED,
    REQUEST_LENGTH,
    WANT,
    signed_lines,
)

log = logging.getLogger(__name__)

# A worker that says nothing this long past a GET's own deadline (which curl enforces
# in the worker) is stuck: it is killed and its GETs fail, to be retried.
WORKER_GRACE_S = 5.0
# Replacements of workers that die before they end a GET are spaced by this much,
# doubled per such death up to RESTART_MAX_INTERVAL_S: no busy loop of interpreters.
RESTART_MIN_INTERVAL_S = 1.0
RESTART_MAX_INTERVAL_S = 30.0
# How long the trio thread waits for a killed worker to exit before a thread reaps it.
REAP_WAIT_S = 0.05
# Workers in a row that die before they end a GET (or cannot be started) before the
# GETs go to a thread of the daemon instead.
YOUNG_DEATHS_MAX = 3
# Frames are received this much at a time: a 100 KB body in one or two receives.
RECEIVE_BUFFER_BYTES = 1 << 20


class PushRefused(Exception):
    """A PUSH's answer failed a check, or the kernel refused its bytes (fetchworker.py)."""


_ERRORS = {"timeout": TimeoutError, "connection": ConnectionError, "os": OSError, REFUSED: PushRefused}
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(bucketfs.__file__)))


class _Digest:
    """The checksum a worker computed (its kind `name`), where answer_of expects a
    checksums.BodyHash."""

    __slots__ = ("name", "_digest")

    def __init__(self, name: str, digest: bytes):
        self.name, self._digest = name, digest

    def digest(self) -> bytes:
        return self._digest


class _Worker:
    def __init__(self, proc: subprocess.Popen, raw: socket.socket):
        self.proc, self.raw = proc, raw  # (raw: the non-blocking socket under `sock`)
        self.sock = trio.socket.from_stdlib_socket(raw)
        self.pid = proc.pid
        self.alive = True
        self.gets_count = 0  # GETs sent to it
        self.answered = False  # it has ended a GET: it started and serves
        self.pending: dict = {}  # tid -> Transfer
        self.deadlines: dict = {}  # tid -> when (time.monotonic) its DONE is overdue
        # tid -> its PUSH's arena extent, until the worker is done with it (a DONE
        # without a body, or a RELEASED): pushes waited on, given up on, or WANTed.
        self.extents: dict = {}
        self.on_end: dict = {}  # tid -> what push_soon calls once the PUSH ended
        self.outbox = bytearray()  # requests not sent yet
        self.outbox_ready = trio.Event()
        self.run_token: Optional[trio.lowlevel.TrioToken] = None  # the run its tasks belong to
        # The receiving stream's state, kept here across trio runs (see the invariants).
        self.inbox = bytearray(RECEIVE_BUFFER_BYTES)
        self.inbox_bytes = 0
        # The frame whose body is being received: [tid, transfer or None, offset, bytes
        # left, appended (a BODY transfer's), meta (a DONE's) or None]; else None.
        self.body: Optional[list] = None


class WorkerEngine:
    signs_requests = True  # a Transfer's `signing` is signed in the worker

    def __init__(
        self,
        workers_count: int,
        max_transfers_count: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        ca_bundle_path: Optional[str],
        kernel_fd: Optional[int] = None,
        arena_bytes: int = 0,
    ):
        """`kernel_fd`: the mount's /dev/fuse descriptor, for workers that push (push());
        `arena_bytes`: the shared memory they push from (arena.py), kept for the daemon."""
        self.workers_count = workers_count
        self.kernel_fd = kernel_fd
        self.arena: Optional[PushArena] = None
        if kernel_fd is not None and arena_bytes > 0:
            try:
                self.arena = PushArena(arena_bytes)
            except OSError as exc:
                log.warning("no shared memory for pushed files (%s): the daemon keeps no copy of them", exc)
        self.what = "fetch worker" if kernel_fd is None else "fetch-ahead worker"  # (for the log)
        # Each worker's CurlLoop's, and the fallback thread engine's.
        self._engine_args = (max_transfers_count, connect_timeout_s, read_timeout_s, ca_bundle_path)
        self.workers: list = []  # live _Worker
        self.restarts_count = 0  # workers replaced after they died or were killed
        self._token: Optional[trio.lowlevel.TrioToken] = None  # the run the engine serves
        self._next_tid = 0
        self._closed = False
        self._changed = trio.Event()  # set when a worker starts or the engine closes
        self._restart_interval_s = RESTART_MIN_INTERVAL_S
        self._respawning = False
        self._young_deaths_count = 0  # workers in a row that died before ending a GET
        self._signers: dict = {}  # region -> Signer, for the fallback's GETs
        # The thread engine the GETs go to once workers proved unable to run (_young_death).
        self.fallback: Optional[CurlEngine] = None

    def pids(self) -> list:
        return [worker.pid for worker in self.workers]

    async def get(self, transfer: Transfer) -> Transfer:
        """Run `transfer` in a worker; its results are set when this returns (error included)."""
        if self.fallback is not None:
            return await self._on_fallback(transfer)
        if self._token is not trio.lowlevel.current_trio_token():
            self._attach_run()
        worker = await self._worker_for(transfer.timeout_s)
        if worker is None:
            return await self._on_fallback(transfer)
        kind = BODY if isinstance(transfer, BodyTransfer) else RANGED
        return await self._run(
            worker,
            transfer,
            lambda tid: (
                GET,
                tid,
                kind,
                transfer.url,
                transfer.header_lines,
                len(transfer.buffer),
                transfer.skip_bytes,
                transfer.timeout_s,
                transfer.signing,
            ),
        )

    async def push(self, transfer: Transfer, length_bytes: int, ino: int, checks: tuple, request) -> tuple:
        """Have a worker GET the whole object `transfer` names (`length_bytes`, from its
        first byte; `transfer.buffer` stays empty: no body comes back) and put it into
        inode `ino`'s page cache after `checks` (fetchworker.answer_refusal). Its error
        when this returns: None (pushed), PushRefused, or a transport error. Never on
        the fallback thread: PushRefused when no worker runs. `request` (a
        base.PushRequest) gets its `want`: the worker sends the body back then (into
        `transfer.buffer`, a BodyTransfer's) instead of writing it into the kernel.
        (transfer, the pushed body kept in the arena (an ArenaBody) or None)."""
        if self.kernel_fd is None or self.fallback is not None:
            raise PushRefused("no worker pushes")
        if self._token is not trio.lowlevel.current_trio_token():
            self._attach_run()
        worker = await self._worker_for(transfer.timeout_s)
        if worker is None:
            raise PushRefused("no worker pushes")
        extent, request_of = self._push_request(worker, transfer, length_bytes, ino, checks, request)
        ended = False
        try:
            await self._run(worker, transfer, request_of)
            ended = True
        finally:
            kept = self._push_ended(worker, transfer, extent, length_bytes, ended)
        return transfer, kept

    @property
    def pushes_now(self) -> bool:
        """Whether push_soon may be called: a worker that pushes runs."""
        return self.kernel_fd is not None and self.fallback is None and bool(self.workers)

    def push_soon(self, transfer: Transfer, length_bytes: int, ino: int, checks: tuple, request, on_end) -> None:
        """push() with no task waiting, where `pushes_now`: `on_end(transfer, kept)` is
        called once it ended, whatever happened (its DONE, its worker lost, the trio
        run ended), from this engine's tasks: no task per push (its start, wake and
        exit were half of the serving thread's CPU per push in an ad hoc bench of this
        engine: 50-57 against 107-151 us)."""
        assert self.pushes_now
        if self._token is not trio.lowlevel.current_trio_token():
            self._attach_run()
        worker = min(self.workers, key=_load)
        extent, request_of = self._push_request(worker, transfer, length_bytes, ino, checks, request)

        def ended() -> None:
            on_end(transfer, self._push_ended(worker, transfer, extent, length_bytes, True))

        worker.on_end[self._start(worker, transfer, request_of)] = ended

    def _push_request(self, worker: _Worker, transfer: Transfer, length_bytes: int, ino: int, checks, request):
        """(The arena extent the push's body goes into or None, its request_of)."""
        request.want = lambda: self._want(worker, transfer)
        if request.wanted:  # (asked before the push was sent: right after it)
            trio.lowlevel.current_trio_token().run_sync_soon(request.want)
        arena = self.arena
        # A body asked for before the push was sent comes back through the socket: no
        # extent of the ring, whose oldest kept copies it would take (after the page
        # cache was dropped, the very files the loader reads next).
        extent = arena.allocate(length_bytes) if arena is not None and not request.wanted else None

        def request_of(tid: int) -> tuple:
            if extent is not None:
                worker.extents[tid] = extent
            at = -1 if extent is None else extent.offset
            fields = (transfer.url, transfer.header_lines, length_bytes, transfer.timeout_s, transfer.signing)
            return (PUSH, tid, *fields, ino, checks, request.tell_open, at)

        return extent, request_of

    def _push_ended(self, worker: _Worker, transfer: Transfer, extent, length_bytes: int, ended: bool):
        """The pushed body kept in the arena (an ArenaBody), or None. `ended`: the push
        was not given up on (cancelled)."""
        arena = self.arena
        pushed = ended and transfer.error is None and not transfer.buffer
        # The extent is the daemon's once the worker returned it (else it is freed
        # when the worker does: a DONE, a RELEASED, its exit).
        # (Not the daemon's if the worker was lost meanwhile: it went with it.)
        if arena is not None and extent is not None and extent.returned:
            if worker.extents.pop(transfer.tid, None) is not None:
                if pushed:
                    return arena.keep(extent, length_bytes)
                arena.free(extent)
        return None

    def _want(self, worker: _Worker, transfer: Transfer) -> None:
        """Ask `worker` for the body of the PUSH `transfer` (if it still runs there)."""
        tid = transfer.tid
        if worker.alive and worker.pending.get(tid) is transfer:
            want = marshal.dumps((WANT, tid))
            self._send(worker, REQUEST_LENGTH.pack(len(want)) + want)

    def _start(self, worker: _Worker, transfer: Transfer, request_of) -> int:
        """Send `worker` the request `request_of(tid)` for `transfer`; its tid."""
        tid = transfer.tid = self._next_tid = (self._next_tid + 1) & 0xFFFFFFFF
        request = marshal.dumps(request_of(tid))
        worker.pending[tid] = transfer
        worker.gets_count += 1
        worker.deadlines[tid] = time.monotonic() + transfer.timeout_s + WORKER_GRACE_S
        self._send(worker, REQUEST_LENGTH.pack(len(request)) + request)
        return tid

    async def _run(self, worker: _Worker, transfer: Transfer, request_of) -> Transfer:
        """Send `worker` the request `request_of(tid)` for `transfer` and wait for its DONE."""
        tid = self._start(worker, transfer, request_of)
        try:
            await transfer.done.wait()
        except BaseException:
            # Cancelled: the frames still coming for it are dropped, so nothing writes
            # into its buffer after this returns; the worker stops its transfer.
            worker.deadlines.pop(tid, None)
            if worker.pending.pop(tid, None) is not None and worker.alive:
                self._send(worker, _abort_request(tid))
            raise
        return transfer

    async def _on_fallback(self, transfer: Transfer) -> Transfer:
        assert self.fallback is not None
        if transfer.signing is not None:  # (signed here: the thread's loop sends headers as they are)
            transfer.header_lines, transfer.signing = signed_lines(self._signers, transfer.url, transfer.signing), None
        return await self.fallback.get(transfer)

    def close(self) -> None:
        """Kill every worker; GETs still running end with ConnectionError. Idempotent."""
        self._closed = True
        self._changed.set()
        for worker in list(self.workers):
            self._lost(worker, "the HTTP engine is closed")
        if self.fallback is not None:
            self.fallback.close()
        if self.arena is not None:
            self.arena.close()

    # -- workers -----------------------------------------------------------------
    def _attach_run(self) -> None:
        """Serve the current trio run: the workers' tasks, the watchdog, and the workers
        the count lacks (all of them on first use)."""
        self._token = trio.lowlevel.current_trio_token()
        if self._closed:
            return
        trio.lowlevel.spawn_system_task(self._watch, self._token, name="bucketfs fetch worker watchdog")
        for worker in self.workers:
            self._start_tasks(worker)
        while len(self.workers) < self.workers_count:
            if not self._spawn():
                # Tried again later, at the doubling interval (or the GETs go to a thread).
                self._young_death()
                self._schedule_respawn(self._restart_interval_s)
                break

    def _start_tasks(self, worker: _Worker) -> None:
        worker.run_token = self._token
        trio.lowlevel.spawn_system_task(self._read, worker, name=f"bucketfs fetch worker {worker.pid}")
        trio.lowlevel.spawn_system_task(self._write, worker, name=f"bucketfs fetch worker {worker.pid} requests")

    def _spawn(self) -> bool:
        """Start a worker; False (logged) if it cannot be (no descriptors, no process)."""
        try:
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("a fetch worker could not start: %s", exc)
            return False
        try:
            child.set_inheritable(True)
            pass_fds: tuple = (child.fileno(),)
            if self.kernel_fd is not None:
                pass_fds += (self.kernel_fd,)
            arena_args: tuple = ()
            if self.arena is not None:
                pass_fds += (self.arena.fd,)
                arena_args = (str(self.arena.fd), str(self.arena.size_bytes))
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_PARENT, env.get("PYTHONPATH")]))
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bucketfs.backends.http.fetchworker"
                    if self.kernel_fd is None
                    else "bucketfs.backends.http.pushworker",
                    str(child.fileno()),
                    str(os.getpid()),
                    *(repr(arg) if isinstance(arg, float) else str(arg or "") for arg in self._engine_args),
                    "" if self.kernel_fd is None else str(self.kernel_fd),
                    *arena_args,
                ],
                pass_fds=pass_fds,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        except OSError as exc:
            parent.close()
            log.warning("a fetch worker could not start: %s", exc)
            return False
        finally:
            child.close()
        parent.setblocking(False)
        worker = _Worker(proc, parent)
        self.workers.append(worker)
        self._start_tasks(worker)
        self._changed.set()
        self._changed = trio.Event()
        return True

    async def _watch(self, token) -> None:
        """Kill workers that are silent past a GET's deadline (curl enforces it in the
        worker, so a live one has answered by then): their GETs fail and are retried.
        And give back the arena's pages that stayed free since the last round."""
        try:
            while self._token is token and not self._closed:
                await trio.sleep(WORKER_GRACE_S / 2)
                if self.arena is not None:
                    self.arena.trim()
                now_s = time.monotonic()
                for worker in list(self.workers):
                    if worker.deadlines and min(worker.deadlines.values()) < now_s:
                        log.warning("%s %d: silent past a GET's deadline; killing it", self.what, worker.pid)
                        self._lost(worker, "killed: silent past a GET's deadline")
        except trio.Cancelled:
            pass  # the run ended

    async def _worker_for(self, timeout_s: float) -> Optional[_Worker]:
        """The live worker with the fewest GETs; waits (within `timeout_s`) for one to
        start; None once the GETs go to the fallback thread."""
        if self.workers:
            return min(self.workers, key=_load)
        with trio.move_on_after(max(timeout_s, 0)):
            while True:
                if self._closed:
                    raise ConnectionError("the HTTP engine is closed")
                if self.workers:
                    return min(self.workers, key=_load)
                if self.fallback is not None:
                    return None
                await self._changed.wait()
        raise ConnectionError("no fetch worker is running")

    def _lost(self, worker: _Worker, reason: str) -> None:
        """`worker` is gone (or made to go): its GETs fail, its process is killed and
        reaped, and a replacement is started unless the engine is closed."""
        if not worker.alive:
            return
        worker.alive = False
        self.workers.remove(worker)
        try:
            worker.sock.close()  # (wakes its tasks, in the run they wait in)
        except RuntimeError:  # outside a trio run: no task waits on it
            worker.raw.close()
        worker.outbox_ready.set()  # (its writer ends)
        code = _end(worker.proc)
        if self.arena is not None:
            for extent in worker.extents.values():
                self.arena.lose(extent, worker.proc)  # (free once it exited: it may still read one)
            worker.extents.clear()
        self._fail_pending(worker, f"{self.what} {worker.pid}: {reason}")
        if self._closed:
            return
        log.warning("%s %d ended (%s, exit status %s); starting another", self.what, worker.pid, reason, code)
        self.restarts_count += 1
        # One that served is replaced at once; one that died before it ended a GET (it
        # cannot start, or crashes at once) after a delay that doubles each time.
        delay_s = 0.0
        if worker.answered:
            self._restart_interval_s = RESTART_MIN_INTERVAL_S
        else:
            delay_s = self._restart_interval_s
            self._young_death()
        self._schedule_respawn(delay_s)

    def _schedule_respawn(self, delay_s: float) -> None:
        if self._token is not None and not self._respawning and self.fallback is None and not self._closed:
            self._respawning = True
            trio.lowlevel.spawn_system_task(self._respawn, delay_s, self._token, name="bucketfs fetch worker restart")

    async def _respawn(self, delay_s: float, token) -> None:
        """Bring the workers back to their count, the first after `delay_s`, any more
        (while they cannot start) at the doubling interval."""
        try:
            while (
                not self._closed
                and self._token is token
                and self.fallback is None
                and len(self.workers) < self.workers_count
            ):
                await trio.sleep(delay_s)
                if self._closed or self._token is not token:
                    return
                if not self._spawn():
                    self._young_death()
                delay_s = self._restart_interval_s
        except trio.Cancelled:
            pass  # the run ended: the next one starts what is lacking
        finally:
            self._respawning = False

    def _young_death(self) -> None:
        """A worker died before it ended a GET, or could not be started: the next
        replacement waits twice as long, and after YOUNG_DEATHS_MAX in a row the GETs go
        to a thread of this process instead (logged): reads keep working where workers
        cannot (a sandbox that forbids starting processes, a broken interpreter path)."""
        self._restart_interval_s = min(self._restart_interval_s * 2, RESTART_MAX_INTERVAL_S)
        self._young_deaths_count += 1
        if self._young_deaths_count >= YOUNG_DEATHS_MAX and self.fallback is None:
            log.error(
                "fetch workers: %d in a row ended before serving a GET; the GETs run on a thread of the daemon",
                self._young_deaths_count,
            )
            self.fallback = CurlEngine(*self._engine_args)
            self._changed.set()  # (GETs waiting for a worker take the thread)

    @staticmethod
    def _fail_pending(worker: _Worker, message: str) -> None:
        for transfer in worker.pending.values():
            transfer.error = ConnectionError(message)
            transfer.done.set()
        worker.pending.clear()
        worker.deadlines.clear()
        on_end, worker.on_end = worker.on_end, {}
        for call in on_end.values():
            _call(call)

    def _run_ended(self, worker: _Worker) -> None:
        """The trio run of `worker`'s tasks is ending: its GETs fail (nobody waits for
        them); the worker stays, for the next run's tasks."""
        if self._token is worker.run_token:
            self._token = None
        self._fail_pending(worker, "the trio run ended")

    # -- the socket ----------------------------------------------------------------
    @staticmethod
    def _send(worker: _Worker, data: bytes) -> None:
        """Queue `data` for `worker`, in order. The worker's writer task sends what the
        tasks of one scheduling batch queued with one system call (each call also wakes
        the worker: ~10 us of the daemon's CPU each, per GET when sent at once)."""
        if not worker.outbox:
            worker.outbox_ready.set()
        worker.outbox += data

    async def _write(self, worker: _Worker) -> None:
        try:
            while worker.alive:
                if not worker.outbox:
                    await worker.outbox_ready.wait()
                    worker.outbox_ready = trio.Event()
                while worker.outbox and worker.alive:
                    sent = await worker.sock.send(worker.outbox)
                    del worker.outbox[:sent]
        except (OSError, trio.ClosedResourceError) as exc:
            self._lost(worker, f"its socket failed: {exc}")
        except trio.Cancelled:
            self._run_ended(worker)

    async def _read(self, worker: _Worker) -> None:
        """Receive `worker`'s frames until it is gone: bodies copied into the buffers of
        the GETs still waited on, each DONE ending its GET once its body is in."""
        view = memoryview(worker.inbox)
        try:
            while True:
                received = await worker.sock.recv_into(view[worker.inbox_bytes :])
                if not received:
                    self._lost(worker, "its socket closed")
                    return
                worker.inbox_bytes += received
                self._take_frames(worker, view)
        except (OSError, trio.ClosedResourceError) as exc:
            self._lost(worker, f"its socket failed: {exc}")
        except (ValueError, EOFError, TypeError) as exc:
            log.error("%s %d broke the protocol: %s", self.what, worker.pid, exc)
            self._lost(worker, f"it broke the protocol: {exc}")
        except trio.Cancelled:
            self._run_ended(worker)

    def _take_frames(self, worker: _Worker, view: memoryview) -> None:
        """Consume the frames in `worker`'s inbox, keeping a frame's start that has not
        fully arrived (bodies are copied out as they arrive)."""
        have, at = worker.inbox_bytes, 0
        while at < have:
            if worker.body is not None:
                tid, transfer, offset, left, appended, meta = worker.body
                piece = min(left, have - at)
                live = transfer is not None and transfer is worker.pending.get(tid)
                if live:
                    if appended:
                        transfer.buffer += view[at : at + piece]
                    else:
                        transfer.buffer[offset : offset + piece] = view[at : at + piece]
                at += piece
                if piece < left:
                    worker.body[2], worker.body[3] = offset + piece, left - piece
                    continue
                worker.body = None
                if live and meta is not None:
                    self._done(worker, tid, transfer, meta)
                continue
            if have - at < FRAME.size:
                break
            kind, tid, offset, body_bytes, meta_bytes = FRAME.unpack_from(view, at)
            if kind == RELEASED and not (body_bytes or meta_bytes):
                at += FRAME.size
                self._extent_returned(worker, tid, released=True)
                continue
            if kind not in (DATA, DONE) or (kind == DATA) == bool(meta_bytes):
                raise ValueError(f"a frame of type {kind} with {meta_bytes} bytes of meta")
            if have - at < FRAME.size + meta_bytes:
                if FRAME.size + meta_bytes > len(view):
                    raise ValueError(f"{meta_bytes} bytes of meta")
                break
            meta = marshal.loads(view[at + FRAME.size : at + FRAME.size + meta_bytes]) if meta_bytes else None
            at += FRAME.size + meta_bytes
            transfer = worker.pending.get(tid)
            if kind == DONE and not body_bytes and worker.extents:
                self._extent_returned(worker, tid, released=False)
            appended = isinstance(transfer, BodyTransfer)
            if transfer is not None and not appended and offset + body_bytes > len(transfer.buffer):
                raise ValueError(f"a body past its buffer ({offset + body_bytes} > {len(transfer.buffer)})")
            if body_bytes:
                worker.body = [tid, transfer, offset, body_bytes, appended, meta]
            elif meta is not None and transfer is not None:
                self._done(worker, tid, transfer, meta)
        if at:
            # What is left is at most a frame's start: a small copy, never an overlapping one.
            worker.inbox[: have - at] = bytes(view[at:have])
            worker.inbox_bytes = have - at

    def _extent_returned(self, worker: _Worker, tid: int, released: bool) -> None:
        """PUSH `tid`'s worker is done with its arena extent: a RELEASED, or a DONE with no
        body. Freed now unless its push() still waits, which keeps or frees it."""
        extent = worker.extents.get(tid)
        if extent is None:
            return
        extent.returned = True
        if released or tid not in worker.pending:
            del worker.extents[tid]
            assert self.arena is not None
            self.arena.free(extent)

    def _done(self, worker: _Worker, tid: int, transfer: Transfer, meta: tuple) -> None:
        if not worker.answered:
            worker.answered = True
            self._young_deaths_count = 0
        del worker.pending[tid]
        del worker.deadlines[tid]
        _finish(transfer, meta)
        on_end = worker.on_end.pop(tid, None)
        if on_end is not None:
            _call(on_end)


def _load(worker: _Worker) -> int:
    return len(worker.pending)


def _call(on_end: Callable[[], None]) -> None:
    """A push_soon caller's end: its failure is logged, never the engine's."""
    try:
        on_end()
    except Exception:  # noqa: BLE001 - (the receiving task goes on with the other GETs)
        log.exception("ending a push failed")


def _abort_request(tid: int) -> bytes:
    request = marshal.dumps((ABORT, tid))
    return REQUEST_LENGTH.pack(len(request)) + request


def _finish(transfer: Transfer, meta: tuple) -> None:
    status, headers, received_bytes, error_body, error_kind, error_text, body_hash = meta
    transfer.status, transfer.headers, transfer.received_bytes = status, headers, received_bytes
    transfer.error_body = bytearray(error_body)
    if error_kind:
        transfer.error = _ERRORS.get(error_kind, OSError)(error_text)
    transfer.body_hash = None if body_hash is None else _Digest(*body_hash)
    transfer.done.set()


def _end(proc: subprocess.Popen) -> Optional[int]:
    """End a worker; its exit status, or None if it has not exited yet. Killed at once
    if it has not exited: it holds no state (the daemon's buffers and caches are not
    its). Never waited for on the trio thread: a fetch-ahead worker's thread can sit in
    the kernel, unkillable until it returns, in a STORE that waits for a READ only this
    thread can answer (its pages are locked); a worker under a debugger is reaped only
    once the debugger lets go. Reaped by a thread then."""
    if proc.poll() is None:
        proc.kill()
        try:
            return proc.wait(timeout=REAP_WAIT_S)
        except subprocess.TimeoutExpired:
            threading.Thread(target=proc.wait, name="bucketfs worker reaper", daemon=True).start()
            return None
    return proc.returncode


def engine_workers(engine) -> tuple:
    """(fetch workers running, workers replaced) of a backend's engine: (0, 0) for
    CurlEngine or none."""
    if isinstance(engine, WorkerEngine):
        return len(engine.workers), engine.restarts_count
    return 0, 0


def small_get_engine(
    workers_count: int,
    max_transfers_count: int,
    connect_timeout_s: float,
    read_timeout_s: float,
    ca_bundle_path: Optional[str],
):
    """The engine of small GETs: worker processes (--fetch-workers), else a thread of
    this process."""
    if workers_count > 0:
        return WorkerEngine(workers_count, max_transfers_count, connect_timeout_s, read_timeout_s, ca_bundle_path)
    return CurlEngine(max_transfers_count, connect_timeout_s, read_timeout_s, ca_bundle_path)
