"""OPENDIR is skipped only where the session's operation table is recognised for
certain; READDIRPLUS is then routed through a handler that notes its inode, pyfuse3's
own handler always runs, and the READDIR that follows reads the noted directory."""

import collections
import ctypes
import errno

import pyfuse3
import pytest

from bucketfs import errors
from bucketfs.backends.memory import MemoryBackend
from bucketfs.fuse.noopendir import (
    _READDIRPLUS_C,
    LOWLEVEL_OPS,
    OPS_OFFSET_MAX_BYTES,
    POINTER_BYTES,
    PYFUSE3_OPS,
    TOKEN_REQ_OFFSET,
    KernelOpensDirs,
    code_ranges,
    find_ops_table,
)
from bucketfs.fuse.ops import FuseOperations
from tests.unit.helpers import resolve, run_fs

pytestmark = pytest.mark.timeout(30)

SESSION_WORDS = 128  # room for a header and the table at any offset searched
TABLE_OFFSET_BYTES = 40  # where libfuse 3.14 puts it


class FakeSession:
    """A struct fuse_session's first bytes: a header, then pyfuse3's table of handlers
    (every handler slot `handler`, every other slot NULL), and a request pointing to it."""

    def __init__(self, handler: int, offset_bytes: int = TABLE_OFFSET_BYTES):
        self.memory = (ctypes.c_void_p * SESSION_WORDS)()
        self.memory[0] = 0x1000  # mountpoint, exited/fd: header words that are not the table
        self.memory[1] = 0x7
        first = offset_bytes // POINTER_BYTES
        for i, name in enumerate(LOWLEVEL_OPS):
            self.memory[first + i] = handler if name in PYFUSE3_OPS else None
        self.address = ctypes.addressof(self.memory)
        self.request = ctypes.c_void_p(self.address)  # fuse_req: its session pointer first
        self.table = self.address + offset_bytes

    def slot(self, name: str) -> ctypes.c_void_p:
        return ctypes.c_void_p.from_address(self.table + LOWLEVEL_OPS.index(name) * POINTER_BYTES)


class Original:
    """Stands in for pyfuse3's C READDIRPLUS handler: records its calls."""

    def __init__(self):
        self.calls = []
        self.callable = _READDIRPLUS_C(lambda *args: self.calls.append(args[:4]))
        self.address = ctypes.cast(self.callable, ctypes.c_void_p).value
        self.code = [(self.address, self.address + 1)]


def token_for(req: int) -> pyfuse3.ReaddirToken:
    token = pyfuse3.ReaddirToken()
    ctypes.c_void_p.from_address(id(token) + TOKEN_REQ_OFFSET).value = req
    return token


def call_slot(session: FakeSession, req: int, ino: int) -> None:
    """What libfuse's do_readdirplus does: call whatever the table's slot holds."""
    _READDIRPLUS_C(session.slot("readdirplus").value)(req, ino, 4096, 0, None)


def test_the_table_is_found_at_any_offset_searched():
    original = Original()
    for offset in (0, TABLE_OFFSET_BYTES, OPS_OFFSET_MAX_BYTES):
        session = FakeSession(original.address, offset)
        assert find_ops_table(session.address, original.code) == session.table


@pytest.mark.parametrize("change", ["handler missing", "extra handler", "outside pyfuse3", "too far", "no code"])
def test_anything_but_pyfuse3s_pattern_is_refused_and_nothing_is_written(change):
    original = Original()
    session = FakeSession(
        original.address, OPS_OFFSET_MAX_BYTES + POINTER_BYTES if change == "too far" else TABLE_OFFSET_BYTES
    )
    code = [] if change == "no code" else original.code
    if change == "handler missing":
        session.slot("lookup").value = None
    elif change == "extra handler":
        session.slot("ioctl").value = original.address  # pyfuse3 has no ioctl handler
    elif change == "outside pyfuse3":
        session.slot("statfs").value = original.address + 4096
    before = bytes(session.memory)
    stats = collections.Counter()
    opens = KernelOpensDirs(stats)
    assert not opens.skips_opendir(lambda: ctypes.addressof(session.request), code)
    assert opens.refused and not opens.active and "namespace.kernel_opens_dirs" not in stats
    assert bytes(session.memory) == before
    assert not opens.skips_opendir(lambda: ctypes.addressof(session.request), original.code)  # refused once: for good


def test_no_request_is_refused():
    opens = KernelOpensDirs(collections.Counter())
    assert not opens.skips_opendir(lambda: None) and opens.refused


def test_pointers_into_unmapped_memory_are_refused_without_reading_them():
    """A request or session pointer that is not one (a layout not as expected) must
    not crash the daemon: it is checked against the process's mappings first."""
    original = Original()
    assert not KernelOpensDirs(collections.Counter()).skips_opendir(
        lambda: 0x1000, original.code
    )  # page 1: never mapped
    session = FakeSession(original.address)
    session.request.value = 0x1000  # a request whose session pointer leads nowhere
    assert not KernelOpensDirs(collections.Counter()).skips_opendir(
        lambda: ctypes.addressof(session.request), original.code
    )


def test_readdirplus_notes_its_inode_and_always_runs_pyfuse3s_handler():
    original = Original()
    session = FakeSession(original.address)
    stats = collections.Counter()
    opens = KernelOpensDirs(stats)
    assert opens.skips_opendir(lambda: ctypes.addressof(session.request), original.code)
    assert opens.active and stats["namespace.kernel_opens_dirs"] == 1
    assert session.slot("readdirplus").value != original.address
    assert session.slot("opendir").value == original.address  # only READDIRPLUS is replaced
    call_slot(session, 0xA0, 7)
    call_slot(session, 0xB0, 9)
    assert original.calls == [(0xA0, 7, 4096, 0), (0xB0, 9, 4096, 0)]
    assert opens.inode_of(token_for(0xB0)) == 9
    assert opens.inode_of(token_for(0xA0)) == 7
    assert opens.inode_of(token_for(0xA0)) is None  # taken once
    assert opens.inode_of(object()) is None  # not pyfuse3's token: its memory is not read
    assert opens.skips_opendir(lambda: None)  # already on


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the MemoryError, reported by ctypes
def test_pyfuse3s_handler_runs_even_when_noting_fails():
    original = Original()
    session = FakeSession(original.address)
    opens = KernelOpensDirs(collections.Counter())

    class Broken(dict):
        def __setitem__(self, key, value):
            raise MemoryError

    opens._noted = Broken()
    assert opens.skips_opendir(lambda: ctypes.addressof(session.request), original.code)
    call_slot(session, 0xC0, 3)
    assert original.calls == [(0xC0, 3, 4096, 0)]  # the request still gets its reply


def test_pyfuse3s_own_code_is_mapped_executable():
    ranges = code_ranges(pyfuse3.__file__)
    assert ranges and all(start < end for start, end in ranges)


class Replies:
    """pyfuse3.readdir_reply's stand-in: the entries sent, up to `room` per token."""

    def __init__(self, room: int):
        self.room, self.sent = room, collections.defaultdict(list)

    def __call__(self, token, name, attrs, next_id):
        if len(self.sent[id(token)]) == self.room:
            return False
        self.sent[id(token)].append((name.decode(), attrs.st_ino, next_id))
        return True


def test_readdir_with_no_handle_lists_the_noted_directory_in_stable_pages(monkeypatch):
    replies = Replies(room=7)
    monkeypatch.setattr(pyfuse3, "readdir_reply", replies)
    backend = MemoryBackend({**{f"d/f{i:03d}": b"x" for i in range(20)}, "e/other": b"y"})

    async def body(fs):
        ops = FuseOperations(fs, fs.config)
        d = await resolve(fs, "d")
        listed, offset, req, tokens = [], 0, 0x100, []
        while True:  # the kernel's READDIRPLUS calls, each with handle 0, until one is empty
            ops._kernel_opens_dirs._noted[req] = d.ino  # as the READDIRPLUS handler notes it
            token = token_for(req)
            tokens.append(token)  # alive: Replies tells tokens apart by id()
            await ops.readdir(0, offset, token)
            page = replies.sent[id(token)]
            if not page:
                break
            listed += page
            offset, req = page[-1][2], req + 1
        dh = await ops.opendir(d.ino, None)  # the same directory through a handle
        token = token_for(0x999)
        replies.room = 100
        await ops.readdir(dh, 0, token)
        return listed, replies.sent[id(token)], fs.ns.node(d.ino).parent_ino

    listed, with_handle, parent_ino = run_fs(backend, body)
    assert listed == with_handle
    assert [name for name, _, _ in listed] == [".", ".."] + [f"f{i:03d}" for i in range(20)]
    assert [ino for name, ino, _ in listed if name == ".."] == [parent_ino]


def test_readdir_with_no_handle_and_nothing_noted_is_an_error_not_a_wrong_listing(monkeypatch):
    monkeypatch.setattr(pyfuse3, "readdir_reply", Replies(room=100))

    async def body(fs):
        ops = FuseOperations(fs, fs.config)
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await ops.readdir(0, 0, token_for(0x200))
        return raised.value.errno

    assert run_fs(MemoryBackend({"d/f": b"x"}), body) == errno.EIO


def test_a_ttl_mount_keeps_opendir():
    """Listings that change must not be kept by the kernel: no ENOSYS, no handle-less READDIR."""

    async def body(fs):
        ops = FuseOperations(fs, fs.config)
        d = await resolve(fs, "d")
        assert ops._kernel_opens_dirs is None
        assert await ops.opendir(d.ino, None) > 0
        with pytest.raises(errors.BucketfsError):
            await fs.readdir_inode(d.ino, 0)

    run_fs(MemoryBackend({"d/f": b"x"}), body, metadata_ttl_s=60)


def test_the_kept_child_lists_are_bounded():
    backend = MemoryBackend({f"d{i:02d}/f": b"x" for i in range(50)})

    async def body(fs):
        for i in range(50):
            d = await resolve(fs, f"d{i:02d}")
            assert [name for name, _ in await fs.readdir_inode(d.ino, 2)] == ["f"]
        return len(fs._dir_children)

    assert run_fs(backend, body) <= 32
