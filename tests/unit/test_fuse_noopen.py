"""OPEN is skipped only once the READ handler put in front of pyfuse3's has seen, at
FH_OFFSET, the handles bucketfs gave out; then READs that come with handle 0 get the
inode there, pyfuse3's own handler always runs, and the core reads by inode through
handles of the inode's own (Filesystem.read_inode)."""

import collections
import ctypes
import errno
import random

import pytest

from bucketfs import errors
from bucketfs.backends.memory import MemoryBackend
from bucketfs.fuse.noopen import _READ_C, FH_OFFSET, INODE_FH, VERIFY_COUNT, KernelOpensFiles
from tests.unit.helpers import resolve, run_fs
from tests.unit.test_fuse_noopendir import FakeSession

pytestmark = pytest.mark.timeout(30)


class FileInfo(ctypes.Structure):
    """libfuse 3's struct fuse_file_info, as far as `fh`."""

    _fields_ = [
        ("flags", ctypes.c_int32),
        ("bits", ctypes.c_uint32),
        ("padding", ctypes.c_uint32),
        ("padding2", ctypes.c_uint32),
        ("fh", ctypes.c_uint64),
        ("lock_owner", ctypes.c_uint64),
    ]


class OriginalRead:
    """Stands in for pyfuse3's C READ handler: records the handle it would pass on."""

    def __init__(self):
        self.handles = []

        def read(req, ino, size, off, fi):
            self.handles.append(ctypes.c_uint64.from_address(fi + FH_OFFSET).value)

        self.callable = _READ_C(read)
        self.address = ctypes.cast(self.callable, ctypes.c_void_p).value


def kernel_read(session: FakeSession, ino: int, fh: int) -> None:
    """What libfuse's do_read does: a fuse_file_info with the request's handle, then
    whatever the table's READ slot holds."""
    fi = FileInfo(fh=fh)
    _READ_C(session.slot("read").value)(None, ino, 4096, 0, ctypes.addressof(fi))


def test_open_is_skipped_only_after_the_handles_were_seen_where_pyfuse3_reads_them():
    original = OriginalRead()
    session = FakeSession(original.address)
    files = KernelOpensFiles(collections.Counter())
    assert not files.skips_open()  # (no handler in place)
    files.install(session.table)
    for fh in range(1, VERIFY_COUNT + 1):
        assert not files.skips_open()
        kernel_read(session, ino=100 + fh, fh=fh)
        files.saw_handle(fh)
    assert original.handles == [1, 2, 3]  # (observing: handles passed on untouched)
    assert files.skips_open() and files.stats["namespace.kernel_opens_files"] == 1
    kernel_read(session, ino=42, fh=0)  # a READ of a file the kernel opened itself
    kernel_read(session, ino=43, fh=7)  # (one opened before: its handle stays)
    assert original.handles[-2:] == [INODE_FH | 42, 7]


def test_handles_never_seen_at_that_offset_keep_open_answered():
    original = OriginalRead()
    session = FakeSession(original.address)
    files = KernelOpensFiles(collections.Counter())
    files.install(session.table)
    for fh in range(1, 10):
        kernel_read(session, ino=fh, fh=fh + 1000)  # (another layout: not the handle read() gets)
        files.saw_handle(fh)
    assert not files.skips_open()
    assert original.handles == [fh + 1000 for fh in range(1, 10)]


FILES = {f"img/{i:03d}.jpg": random.Random(i).randbytes(50_000 + i) for i in range(300)}
FILES["shards/a.tar"] = random.Random(9).randbytes(20 * 1024 * 1024 + 3)


def test_reads_by_inode_return_every_byte_and_leave_no_handle_once_read_to_the_end():
    backend = MemoryBackend(FILES)

    async def body(fs):
        for path, data in FILES.items():
            ino = (await resolve(fs, path)).ino
            got, off = b"", 0
            while off < len(data):
                got += await fs.read_inode(ino, off, 128 * 1024)
                off = len(got)
            assert got == data, path
        return len(fs._inode_handles), len(fs._handles), fs.stats.snapshot()

    inode_handles, handles, stats = run_fs(backend, body)
    assert inode_handles == handles == 0
    assert stats["open.small"] == len(FILES) - 1 and stats["open.large"] == 1


def test_a_file_read_again_from_its_start_streams_while_reads_sent_before_its_end_go_at_once():
    """Within a moment of the READ that read a shard to its end, a READ near that end
    was sent before it (the kernel's read-ahead): a handle let go of at once. A READ
    from the start is the file read again (another reader, or the next epoch with its
    pages evicted): a handle of its own that streams, not a block-cache miss per READ."""
    import trio

    from bucketfs.core import filesystem

    path, MiB = "shards/a.tar", 1024 * 1024
    data = FILES[path]
    assert len(data) > filesystem.LATE_READ_SPAN_BYTES + 2 * MiB
    backend = MemoryBackend(FILES)

    async def read_through(fs, ino) -> bytes:
        got = bytearray()
        while len(got) < len(data):
            got += await fs.read_inode(ino, len(got), MiB)
        return bytes(got)

    async def body(fs):
        start_s = trio.current_time()
        ino = (await resolve(fs, path)).ino
        assert await read_through(fs, ino) == data
        before = fs.stats.snapshot()
        fetched_before = backend.bytes_fetched
        late_off = len(data) - 3 * MiB
        assert await fs.read_inode(ino, late_off, MiB) == data[late_off : late_off + MiB]
        late_left = len(fs._inode_handles)
        again = await read_through(fs, ino)
        within_window_s = trio.current_time() - start_s < filesystem.LATE_READ_WINDOW_S
        fetched = backend.bytes_fetched - fetched_before
        return late_left, again, within_window_s, len(fs._handles), before, fs.stats.snapshot(), fetched

    late_left, again, within_window_s, handles, before, after, fetched = run_fs(backend, body)
    assert within_window_s  # (else every READ above was an ordinary one)
    assert late_left == 0 and again == data and handles == 0
    assert after["open.large"] - before["open.large"] == 2  # the late READ's, then the second pass's
    assert after["prefetch.streams"] - before["prefetch.streams"] == 1
    assert fetched <= len(data) + 2 * MiB  # (the late READ's, then the file once)


def test_files_read_in_part_keep_at_most_inode_handles_max_open(monkeypatch):
    from bucketfs.core import filesystem

    monkeypatch.setattr(filesystem, "INODE_HANDLES_MAX", 8)
    backend = MemoryBackend(FILES)

    async def body(fs):
        for path in list(FILES)[:50]:
            ino = (await resolve(fs, path)).ino
            assert await fs.read_inode(ino, 0, 100) == FILES[path][:100]  # (a header only)
        return len(fs._inode_handles), len(fs._handles)

    assert run_fs(backend, body) == (8, 8)


def test_an_inode_handle_no_read_came_for_is_released_and_the_next_read_opens_afresh():
    """A file whose last pages the kernel already holds never gets the READ that would
    end its handle (a hole a killed reader left, read late): idleness ends it."""
    import trio.testing

    from bucketfs.core import filesystem

    backend = MemoryBackend(FILES)
    path = "img/001.jpg"

    async def body(fs):
        ino = (await resolve(fs, path)).ino
        assert await fs.read_inode(ino, 0, 100) == FILES[path][:100]
        await trio.sleep(filesystem.INODE_HANDLE_IDLE_S / 2)
        fs.release_idle_inode_handles()
        kept = len(fs._handles)
        await trio.sleep(filesystem.INODE_HANDLE_IDLE_S / 2)
        fs.release_idle_inode_handles()
        released = len(fs._handles)
        assert await fs.read_inode(ino, 100, 100) == FILES[path][100:200]
        return kept, released, len(fs._inode_handles), fs.stats.snapshot()["read.idle_handles_released"]

    clock = trio.testing.MockClock(autojump_threshold=0)
    assert run_fs(backend, body, clock=clock) == (1, 0, 1, 1)


def test_an_inode_handle_a_read_is_in_is_not_released_however_long_it_takes():
    import trio.testing

    from bucketfs.core import filesystem

    backend = MemoryBackend(FILES)
    path = "img/001.jpg"

    async def body(fs):
        ino = (await resolve(fs, path)).ino
        backend.delay_s = 2 * filesystem.INODE_HANDLE_IDLE_S  # (its GET)
        got = []

        async def read():
            got.append(await fs.read_inode(ino, 0, 100))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.sleep(1.5 * filesystem.INODE_HANDLE_IDLE_S)
            fs.release_idle_inode_handles()
            during = len(fs._handles)
        return during, got

    clock = trio.testing.MockClock(autojump_threshold=0)
    assert run_fs(backend, body, clock=clock, read_timeout_s=1000) == (1, [FILES["img/001.jpg"][:100]])


def test_a_read_by_inode_of_a_replaced_object_fails_and_the_next_gets_estale():
    backend = MemoryBackend(FILES)
    path = "img/001.jpg"

    async def body(fs):
        ino = (await resolve(fs, path)).ino
        assert await fs.read_inode(ino, 0, 1 << 20) == FILES[path]  # (read whole: its handle released)
        backend.put(path, b"new bytes")  # replaced while mounted
        fs.cache.evict(1 << 62)  # (and the kernel let go of its pages)
        outcomes = []
        for _ in range(2):
            try:
                await fs.read_inode(ino, 100, 100)
                outcomes.append("read")
            except errors.BucketfsError as exc:
                outcomes.append(exc.errno_value)
        return outcomes, len(fs._inode_handles)

    outcomes, inode_handles = run_fs(backend, body)
    assert outcomes == [errno.ESTALE, errno.ESTALE] and inode_handles == 0


def test_handles_opened_before_the_kernel_opens_files_become_their_inodes_and_go_at_the_end():
    """No RELEASE comes for files the daemon opened before the switch: each handle
    becomes its inode's own, so a file being streamed keeps its one read-ahead stream
    (its READs, by the old handle or by inode, read through it), and it goes once a
    READ reaches the file's end. A second handle of the same inode goes at once."""
    backend = MemoryBackend(FILES)
    path = "shards/a.tar"

    async def body(fs):
        ino = (await resolve(fs, path)).ino
        fh = await fs.open(ino, 0)
        second = await fs.open(ino, 0)
        first = bytes(await fs.read(fh, 0, 1 << 20))
        streams_before = fs.stats["prefetch.streams"]
        fs.release_all_open_handles()
        open_after_switch = len(fs._handles)
        rest, off = b"", len(first)
        while off < len(FILES[path]):
            # (the kernel still sends the old handle for some READs, none for others)
            chunk = await (fs.read(fh, off, 1 << 20) if off % (2 << 20) else fs.read_inode(ino, off, 1 << 20))
            rest += chunk
            off += len(chunk)
        streams_after = fs.stats["prefetch.streams"]
        open_at_end = len(fs._handles)
        # A READ by the released second handle: by inode. From the file's start, it is a
        # reader starting over, not one sent before the end: the inode's own handle.
        late = bytes(await fs.read(second, 0, 10))
        return first + rest, late, open_after_switch, open_at_end, len(fs._inode_handles), streams_before, streams_after

    data, late, open_after_switch, open_at_end, inode_handles, streams_before, streams_after = run_fs(backend, body)
    assert data == FILES[path] and late == FILES[path][:10]
    assert open_after_switch == 1 and open_at_end == 0 and inode_handles == 1
    assert streams_before >= 1 and streams_after == streams_before  # (no second stream of the file)
