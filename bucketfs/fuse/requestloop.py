"""The FUSE request loop: pyfuse3's, but a task reads the next request at once.

pyfuse3's loop (3.x, internal.pxi `_session_loop`) gives every request a round of
trio's scheduler: its tasks take turns, under a lock, at waiting for /dev/fuse to be
readable (an epoll_ctl, a wake-up, the lock handed on), then read one request and run
its handler. A request libfuse answers itself costs the serving thread that whole
round, and every Python `open()` sends one: it asks `isatty()`, an `ioctl(TCGETS)`
that the kernel forwards as FUSE_IOCTL. That was ~0.04 ms of the serving thread per
file opened, warm or cold, two thirds of it in the interpreter (perf, ad hoc).

Here the descriptor is non-blocking and a task reads the next request as soon as it
is done with one; it waits (as pyfuse3's tasks do: one at a time, under a lock) only
when the read finds none queued (EAGAIN). Every YIELD_EVERY requests served without a
wait it lets trio run the other tasks. The rest is pyfuse3's: libfuse's
`fuse_session_receive_buf` and `fuse_session_process_buf` (through ctypes, the GIL
held, as pyfuse3 calls them), its handlers, a request's coroutine awaited by the task
that read it, and tasks coming and going as in pyfuse3 (one more when none is
waiting, up to max_tasks; one ends when more than min_tasks wait).

pyfuse3's C handlers give each request's coroutine to its private `save_retval`,
which its own loop awaits. Each `fuse_*_async` of pyfuse3's module (looked up by name
when a handler runs) and the operations' `forget` are wrapped to give it to this loop
instead, and hand pyfuse3 None. So pyfuse3's loop must never run once they are:
`install` replaces pyfuse3's `_session_loop` (also looked up by name, by
`pyfuse3.main`) in the same step, before `pyfuse3.main` starts.

A FUSE_IOCTL (libfuse answers it: pyfuse3 has no ioctl handler) may be held: where
`hold_ioctl(inode, resume)` takes it (core/openpush.py: the file is pushed into the
page cache before the reader's first read()), a copy of the request is processed
when it calls `resume()`, if the session still runs; a request held when the loop
ends is left to the kernel, which ends it with the mount.

Installed only where pyfuse3's other private layouts are used
(dircache.private_layouts_allowed), the session was found (requestsize.pyfuse3_session),
libfuse is loaded once in this process and pyfuse3's handlers are exactly the
expected ones; else pyfuse3's own loop serves the mount.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import logging
import os
from typing import Any, Callable, Optional

import pyfuse3
import trio

from bucketfs.fuse.noopendir import PYFUSE3_OPS, mappings

log = logging.getLogger(__name__)

# Requests a task serves in a row without waiting before it lets other trio tasks run
# (a handler that never suspends, and libfuse's own answers, do not yield).
YIELD_EVERY = 32
# pyfuse3 3.x's coroutine makers (handlers.pxi): one per operation its C handlers pass
# to Python but INIT (answered at once) and the FORGETs (the operations' own `forget`).
PYFUSE3_HANDLERS = frozenset(f"fuse_{op}_async" for op in PYFUSE3_OPS - {"init", "forget", "forget_multi"})
# struct fuse_in_header (fuse_kernel.h): u32 len, u32 opcode, u64 unique, u64 nodeid, ...
OPCODE_AT, NODEID_AT = 4, 16
FUSE_IOCTL = 39
FUSE_BUF_IS_FD = 1 << 1  # (fuse_common.h: the request is in a pipe, not in `mem`)


class _FuseBuf(ctypes.Structure):
    """libfuse 3's struct fuse_buf (fuse_common.h), with room to spare after it: later
    releases add fields at its end, which stay zero, as pyfuse3 leaves them."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("flags", ctypes.c_int),
        ("mem", ctypes.c_void_p),
        ("fd", ctypes.c_int),
        ("pos", ctypes.c_int64),
        ("spare", ctypes.c_uint64 * 4),
    ]


def _libfuse() -> Optional[ctypes.PyDLL]:
    """The libfuse 3 this process runs (pyfuse3's), its functions declared; None if it
    is not loaded exactly once. A PyDLL: called with the GIL held, as pyfuse3's
    handlers, which libfuse calls back, need."""
    paths = {
        os.path.realpath(path) for _s, _e, _p, path in mappings() if os.path.basename(path).startswith("libfuse3.so")
    }
    if len(paths) != 1:
        return None
    lib = ctypes.PyDLL(paths.pop())
    lib.fuse_session_receive_buf.argtypes = [ctypes.c_void_p, ctypes.POINTER(_FuseBuf)]
    lib.fuse_session_receive_buf.restype = ctypes.c_int
    lib.fuse_session_process_buf.argtypes = [ctypes.c_void_p, ctypes.POINTER(_FuseBuf)]
    lib.fuse_session_process_buf.restype = None
    lib.fuse_session_exited.argtypes = [ctypes.c_void_p]
    lib.fuse_session_exited.restype = ctypes.c_int
    return lib


_free = ctypes.CDLL(None).free
_free.argtypes = [ctypes.c_void_p]
_free.restype = None


class RequestLoop:
    """pyfuse3's request loop, reading on while requests are queued (module doc)."""

    def __init__(self, lib: Any, session: int, fuse_fd: int, stats) -> None:
        self.lib, self.session, self.fuse_fd, self.stats = lib, session, fuse_fd, stats
        self.coroutine: Any = None  # the coroutine of the request being processed
        self.tasks_count = 0
        self.waiting_count = 0  # tasks waiting for a request (for the lock, or readable)
        self._lock: Optional[trio.Lock] = None
        self._serial = 0
        # (inode, resume) -> whether a FUSE_IOCTL of the inode is held until resume()
        self.hold_ioctl: Optional[Callable[[int, Callable[[], None]], bool]] = None

    def capturing(self, make: Callable) -> Callable:
        """`make` (a coroutine maker pyfuse3's handlers call), its coroutine kept for
        this loop; pyfuse3's `save_retval` gets None."""

        def handler(*args):
            self.coroutine = make(*args)

        return handler

    async def first_task(self, nursery: trio.Nursery, min_tasks: int, max_tasks: int) -> None:
        """What pyfuse3.main starts (as its `_session_loop`)."""
        self.tasks_count += 1
        await self._serve(nursery, min_tasks, max_tasks)

    def _start_task(self, nursery: trio.Nursery, min_tasks: int, max_tasks: int) -> None:
        self.tasks_count += 1
        self._serial += 1
        nursery.start_soon(self._serve, nursery, min_tasks, max_tasks, name=f"bucketfs-fuse-{self._serial}")

    async def _serve(self, nursery: trio.Nursery, min_tasks: int, max_tasks: int) -> None:
        lib, session = self.lib, self.session
        receive, process = lib.fuse_session_receive_buf, lib.fuse_session_process_buf
        buf = _FuseBuf()  # (libfuse allocates its memory at the first read)
        buf_ref = ctypes.byref(buf)
        in_a_row = 0
        waited = True
        try:
            while not lib.fuse_session_exited(session):
                res = receive(session, buf_ref)
                if res == -errno.EAGAIN:  # none queued: wait, unless enough tasks do
                    if self.waiting_count > min_tasks:
                        break
                    in_a_row = 0
                    waited = True
                    if not await self._wait_readable():
                        break
                    continue
                if res == -errno.EINTR:
                    continue
                if res < 0:
                    raise OSError(-res, f"fuse_session_receive_buf failed with {os.strerror(-res)}")
                if res == 0:  # (unmounted: libfuse marked the session exited)
                    break
                if not waited:
                    self.stats["fuse_loop.requests_read_at_once"] += 1
                waited = False
                if self.hold_ioctl is not None and not buf.flags & FUSE_BUF_IS_FD and self._held(buf.mem, res):
                    continue
                self.coroutine = None
                try:
                    process(session, buf_ref)
                except Exception:  # noqa: BLE001 - (an error a handler left set, which ctypes raises)
                    log.exception("a FUSE request's handler raised")  # (its coroutine, if any, still runs)
                coroutine, self.coroutine = self.coroutine, None
                if coroutine is not None:
                    if not self.waiting_count and self.tasks_count < max_tasks:
                        self._start_task(nursery, min_tasks, max_tasks)  # one to read the next meanwhile
                    await coroutine
                in_a_row += 1
                if in_a_row >= YIELD_EVERY:
                    in_a_row = 0
                    await trio.lowlevel.checkpoint()
        finally:
            self.tasks_count -= 1
            _free(buf.mem)

    def _held(self, mem: int, size: int) -> bool:
        """Whether the request in `mem` is a FUSE_IOCTL that hold_ioctl holds (every
        request's opcode is read: one word)."""
        if ctypes.c_uint32.from_address(mem + OPCODE_AT).value != FUSE_IOCTL:
            return False
        nodeid = ctypes.c_uint64.from_address(mem + NODEID_AT).value
        assert self.hold_ioctl is not None
        try:
            if not self.hold_ioctl(nodeid, functools.partial(self._process_held, ctypes.string_at(mem, size))):
                return False
        except Exception:  # noqa: BLE001 - (processed now, as any other request)
            log.exception("holding a FUSE_IOCTL failed")
            return False
        self.stats["fuse_loop.ioctls_held"] += 1
        return True

    def _process_held(self, request: bytes) -> None:
        """Process a held request (a copy of it), if the session still runs."""
        # (No task serves once the session has ended, and pyfuse3 may have freed it then.)
        if not self.tasks_count or self.lib.fuse_session_exited(self.session):
            return
        copy = ctypes.create_string_buffer(request, len(request))
        held = _FuseBuf(size=len(request), flags=0, mem=ctypes.addressof(copy))
        self.coroutine = None
        try:
            self.lib.fuse_session_process_buf(self.session, ctypes.byref(held))
        except Exception:  # noqa: BLE001 - (as in _serve)
            log.exception("a held FUSE request's handler raised")
        coroutine, self.coroutine = self.coroutine, None
        if coroutine is not None:  # (libfuse answers an IOCTL itself: none is expected)
            coroutine.close()
            log.error("a held FUSE request was given to a Python handler, which was not run")

    async def _wait_readable(self) -> bool:
        """Wait, one task at a time, until a request may be queued; False once the
        session ends (pyfuse3.terminate() closes the descriptor's waits)."""
        if self._lock is None:
            self._lock = trio.Lock()
        self.waiting_count += 1
        try:
            async with self._lock:
                if self.lib.fuse_session_exited(self.session):
                    return False
                await trio.lowlevel.wait_readable(self.fuse_fd)
        except trio.ClosedResourceError:
            return False
        finally:
            self.waiting_count -= 1
        return True


def install(session: Optional[int], fuse_fd: Optional[int], operations: Any, stats) -> Optional[RequestLoop]:
    """Before pyfuse3.main: serve the mount with a RequestLoop (`session`:
    requestsize.pyfuse3_session's); None (pyfuse3's loop serves it) where anything is
    not as checked."""
    if fuse_fd is None or getattr(pyfuse3, "_session_loop", None) is None:
        return None
    if session is None:
        log.info("libfuse's session was not found where expected: pyfuse3's request loop serves the mount")
        return None
    handlers = {name for name in dir(pyfuse3) if name.startswith("fuse_") and name.endswith("_async")}
    if handlers != PYFUSE3_HANDLERS:
        log.info("pyfuse3's handlers are not the expected ones: its own request loop serves the mount")
        return None
    lib = _libfuse()
    if lib is None:
        log.info("libfuse is not loaded once in this process: pyfuse3's request loop serves the mount")
        return None
    flags = fcntl.fcntl(fuse_fd, fcntl.F_GETFL)
    fcntl.fcntl(fuse_fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    loop = RequestLoop(lib, session, fuse_fd, stats)
    for name in PYFUSE3_HANDLERS:
        setattr(pyfuse3, name, loop.capturing(getattr(pyfuse3, name)))
    operations.forget = loop.capturing(operations.forget)
    setattr(pyfuse3, "_session_loop", loop.first_task)  # noqa: B010 - (not in pyfuse3's stub)
    stats["fuse_loop.active"] = 1
    return loop
