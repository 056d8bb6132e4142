"""The FUSE request loop (bucketfs/fuse/requestloop.py) against a scripted libfuse: a
task reads requests while they are queued and waits only when none is; requests are
served in the order they came; a handler that waits holds up no other request; every
task ends when the session does; tasks beyond what pyfuse3 keeps end once idle; a
long run of requests lets other trio tasks run; an IOCTL held is processed when let
go, not after the session ended. (The real loop on a real mount:
tests/integration/test_request_loop.py.)"""

import collections
import contextlib
import ctypes
import errno
import functools
import socket
import struct

import pytest
import trio
import trio.testing

from bucketfs.fuse.requestloop import FUSE_IOCTL, NODEID_AT, OPCODE_AT, YIELD_EVERY, RequestLoop

pytestmark = pytest.mark.timeout(30)
# struct fuse_in_header: len, opcode, unique, nodeid (the loop reads the two at their offsets)
_IN_HEADER = struct.Struct("<IIQQ")
assert (struct.calcsize("<I"), struct.calcsize("<IIQ")) == (OPCODE_AT, NODEID_AT)
_malloc = ctypes.CDLL(None).malloc
_malloc.argtypes, _malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
MIN_TASKS = 4


class ScriptedLibfuse:
    """libfuse's receive/process/exited over a queue of requests; the descriptor the
    loop waits on is one end of a socket pair, readable while requests are queued.
    Each request is read into one buffer, as libfuse's: a FUSE header (its opcode and
    inode) and its name."""

    def __init__(self) -> None:
        self.queue: collections.deque = collections.deque()
        self.exited = 0
        self.served: list = []
        self.kernel, self.fd_end = socket.socketpair()
        self.fd_end.setblocking(False)
        self._handlers: dict = {}

    def send(self, name: str, handler=None, opcode: int = 0, nodeid: int = 0) -> None:
        """A request: `handler(name)` runs as pyfuse3's C handler would (None: libfuse
        answers it itself, as IOCTL)."""
        self._handlers[name] = handler
        body = name.encode()
        self.queue.append(_IN_HEADER.pack(_IN_HEADER.size + len(body), opcode, len(self.queue), nodeid) + body)
        self.kernel.send(b"r")

    def fuse_session_receive_buf(self, _session, buf_ref) -> int:
        if self.exited:
            return 0
        if not self.queue:
            return -errno.EAGAIN
        self.fd_end.recv(1)
        request = self.queue.popleft()
        buf = buf_ref._obj
        if not buf.mem:  # (libfuse's: allocated at a buffer's first read, reused, freed by the loop)
            buf.mem = _malloc(4096)
        ctypes.memmove(buf.mem, request, len(request))
        buf.size = len(request)
        return len(request)

    def fuse_session_process_buf(self, _session, buf_ref) -> None:
        name = ctypes.string_at(buf_ref._obj.mem, buf_ref._obj.size)[_IN_HEADER.size :].decode()
        handler = self._handlers[name]
        if handler is None:
            self.served.append(name)
        else:
            handler(name)
        if name.startswith("raising"):
            raise RuntimeError("an error a handler left set (ctypes raises it after the call)")

    def fuse_session_exited(self, _session) -> int:
        return self.exited


def trio_test(fn):
    @functools.wraps(fn)
    def run():
        trio.run(fn)

    return run


def make_loop():
    lib = ScriptedLibfuse()
    loop = RequestLoop(lib, session=1, fuse_fd=lib.fd_end.fileno(), stats=collections.Counter())
    return lib, loop


@contextlib.asynccontextmanager
async def serving(lib, loop):
    """The loop started as pyfuse3.main starts it, waiting for a request; on leaving,
    the session ended (what pyfuse3.terminate() does), and every task of the loop gone."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(loop.first_task, nursery, MIN_TASKS, 256)
        await trio.testing.wait_all_tasks_blocked()
        yield nursery
        lib.exited = 1
        trio.lowlevel.notify_closing(lib.fd_end.fileno())
    assert loop.tasks_count == 0 and loop.waiting_count == 0


def async_handler(loop, lib, body=None):
    """A request whose handler is a coroutine (as pyfuse3's `fuse_*_async`): served
    by the loop's task; `body` awaited first if given."""

    async def coroutine(name):
        if body is not None:
            await body(name)
        lib.served.append(name)

    return loop.capturing(coroutine)


@trio_test
async def test_requests_queued_together_are_served_in_order_after_one_wait():
    lib, loop = make_loop()
    async with serving(lib, loop):
        for i in range(20):
            lib.send(f"r{i}", async_handler(loop, lib) if i % 3 == 0 else None)
        await trio.testing.wait_all_tasks_blocked()
        assert lib.served == [f"r{i}" for i in range(20)]
        # One wake-up for the lot: the other 19 were read with no wait before them.
        assert loop.stats["fuse_loop.requests_read_at_once"] == 19


@trio_test
async def test_a_handler_that_waits_holds_up_no_other_request():
    lib, loop = make_loop()
    store_answered = trio.Event()

    async def wait_for_the_store(_name):
        await store_answered.wait()

    async with serving(lib, loop):
        lib.send("cold read", async_handler(loop, lib, wait_for_the_store))
        lib.send("ioctl")
        lib.send("getattr", async_handler(loop, lib))
        await trio.testing.wait_all_tasks_blocked()
        assert lib.served == ["ioctl", "getattr"]  # while the READ waits on the store
        store_answered.set()
        await trio.testing.wait_all_tasks_blocked()
        assert lib.served == ["ioctl", "getattr", "cold read"]


@trio_test
async def test_every_task_ends_with_the_session_and_idle_ones_beyond_the_minimum_before():
    lib, loop = make_loop()
    store_answered = trio.Event()

    async def wait_for_the_store(_name):
        await store_answered.wait()

    async with serving(lib, loop):
        for i in range(12):  # twelve READs waiting at once: a task each, and one more reading
            lib.send(f"read{i}", async_handler(loop, lib, wait_for_the_store))
            await trio.testing.wait_all_tasks_blocked()
        assert loop.tasks_count == 13 and lib.served == []
        store_answered.set()
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(lib.served) == sorted(f"read{i}" for i in range(12))
        # Idle: as in pyfuse3, a task ends rather than wait beside more than MIN_TASKS others.
        assert loop.tasks_count == MIN_TASKS + 1 == loop.waiting_count


@trio_test
async def test_an_unmount_ends_the_task_that_reads_it_and_those_waiting():
    lib, loop = make_loop()
    async with serving(lib, loop):
        lib.exited = 1  # libfuse's read saw ENODEV: the session is over
        lib.kernel.send(b"x")  # (the descriptor reports it)
        await trio.testing.wait_all_tasks_blocked()
        assert loop.tasks_count == 0  # (before the descriptor's waits are closed)


@trio_test
async def test_a_request_whose_handler_raises_still_gets_its_coroutine_run_and_the_loop_goes_on():
    lib, loop = make_loop()
    async with serving(lib, loop):
        lib.send("raising getattr", async_handler(loop, lib))
        lib.send("raising ioctl")
        lib.send("lookup", async_handler(loop, lib))
        await trio.testing.wait_all_tasks_blocked()
        assert lib.served == ["raising getattr", "raising ioctl", "lookup"]


@trio_test
async def test_a_long_run_of_queued_requests_lets_other_tasks_run_meanwhile():
    lib, loop = make_loop()
    seen_served: list = []

    async def other_task():
        while len(seen_served) < 1000 and (not seen_served or seen_served[-1] < 200):
            seen_served.append(len(lib.served))
            await trio.lowlevel.checkpoint()

    async with serving(lib, loop) as nursery:
        for i in range(200):
            lib.send(f"ioctl{i}")
        nursery.start_soon(other_task)
        await trio.testing.wait_all_tasks_blocked()
        assert len(lib.served) == 200
        # The other task ran between runs of at most YIELD_EVERY requests (it saw at
        # most two of them go by: trio runs the tasks of one batch in random order).
        during = sorted({n for n in seen_served if 0 < n < 200})
        assert during and all(b - a <= 2 * YIELD_EVERY for a, b in zip([0, *during], [*during, 200]))


@trio_test
async def test_a_held_ioctl_is_processed_when_let_go_and_holds_up_no_other_request():
    lib, loop = make_loop()
    offered, resumes = [], []

    def hold(nodeid, resume):
        offered.append(nodeid)
        if nodeid == 7:
            resumes.append(resume)
            return True
        return False

    loop.hold_ioctl = hold
    async with serving(lib, loop):
        lib.send("ioctl of 7", opcode=FUSE_IOCTL, nodeid=7)
        lib.send("getattr of 7", async_handler(loop, lib), nodeid=7)  # (not an IOCTL: never offered)
        lib.send("ioctl of 8", opcode=FUSE_IOCTL, nodeid=8)  # (not held)
        await trio.testing.wait_all_tasks_blocked()
        assert lib.served == ["getattr of 7", "ioctl of 8"] and offered == [7, 8]
        assert loop.stats["fuse_loop.ioctls_held"] == 1
        (resume,) = resumes
        resume()  # (its push ended): the request, as it was read, though the buffer was reused since
        assert lib.served == ["getattr of 7", "ioctl of 8", "ioctl of 7"]


@trio_test
async def test_a_held_ioctl_let_go_after_the_session_ended_is_not_processed():
    lib, loop = make_loop()
    resumes: list = []
    loop.hold_ioctl = lambda nodeid, resume: resumes.append(resume) is None
    async with serving(lib, loop):
        lib.send("ioctl", opcode=FUSE_IOCTL, nodeid=3)
        await trio.testing.wait_all_tasks_blocked()
    resumes[0]()  # (libfuse's session may be freed: the kernel ended the request with the mount)
    assert lib.served == []
