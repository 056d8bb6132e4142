"""Several readers of one file through one handle (handlereader.py): every reader of a
file once the kernel opens files itself (READs by inode), or threads that pread one
descriptor. Each keeps a stream of its own; streams never fetch the same bytes; a
reader that starts inside another's window takes its parts over; the handle of the
inode's own stays while any reader still reads."""

import random

import pytest
import trio
import trio.testing

from bucketfs.backends.memory import MemoryBackend
from bucketfs.core import handlereader
from tests.unit.helpers import resolve, run_fs

pytestmark = pytest.mark.timeout(60)
MiB = 1024 * 1024
KEY = "shards/shard-000000.tar"
DATA = random.Random(5).randbytes(64 * MiB + 3)


async def read_slice(fs, ino: int, start: int, stop: int, read_bytes: int = 4 * MiB) -> bytes:
    got, off = bytearray(), start
    while off < stop:
        got += await fs.read_inode(ino, off, min(read_bytes, stop - off))
        off = start + len(got)
    return bytes(got)


@pytest.mark.parametrize("readers", [2, 3, 4])
def test_readers_of_a_files_slices_at_once_each_stream_and_fetch_it_about_once(readers):
    """The way a loader's workers read their slices of one large file. With one stream
    per handle each reader's READ looked like a seek of the others': 108-175 MiB
    fetched for these 64 (this test's model) and 2.7x a shard's bytes on a real mount."""
    backend = MemoryBackend({KEY: DATA}, delay_s=0.01)
    bounds = [len(DATA) * i // readers for i in range(readers + 1)]

    async def body(fs):
        ino = (await resolve(fs, KEY)).ino
        got = {}

        async def reader(i):
            got[i] = await read_slice(fs, ino, bounds[i], bounds[i + 1])

        async with trio.open_nursery() as nursery:
            for i in range(readers):
                nursery.start_soon(reader, i)
        # The handle goes once the file was read to its end and the readers of its
        # other slices have stopped (the mount checks every INODE_HANDLE_IDLE_S / 2).
        await trio.sleep(handlereader.TRACK_IDLE_S * 1.5)
        fs.release_idle_inode_handles()
        return b"".join(got[i] for i in range(readers)), len(fs._inode_handles), fs.stats.snapshot()

    data, inode_handles, stats = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert data == DATA
    assert inode_handles == 0 and "read.idle_handles_released" not in stats
    assert stats["prefetch.streams"] >= 2
    # Each reader's first READs may go through the block cache before its stream runs.
    assert backend.bytes_fetched <= len(DATA) + readers * 4 * MiB


def test_a_reader_starting_inside_anothers_window_takes_its_parts_over():
    backend = MemoryBackend({KEY: DATA})

    async def body(fs):
        ino = (await resolve(fs, KEY)).ino
        first = await read_slice(fs, ino, 0, 4 * MiB)  # a shard from its start: a wide window
        ahead = await fs.read_inode(ino, 32 * MiB, 4 * MiB)  # another reader, inside that window
        rest = await read_slice(fs, ino, 36 * MiB, 48 * MiB)
        behind = await read_slice(fs, ino, 4 * MiB, 32 * MiB)  # the first reader goes on to where the other began
        return first, bytes(ahead), rest, behind, fs.stats.snapshot()

    first, ahead, rest, behind, stats = run_fs(backend, body)
    assert first + behind + ahead + rest == DATA[: 48 * MiB]
    assert stats["prefetch.streams"] == 2 and "cache.misses" not in stats
    # Nothing fetched twice but the second reader's side of the part that holds its
    # first byte, which the first stream keeps (at most half of an 8 MiB part).
    assert backend.bytes_fetched <= len(DATA) + 4 * MiB


def test_a_reader_that_moved_on_has_its_stream_closed_once_another_reads():
    """A track no READ came for in TRACK_IDLE_S (a seek, or a reader done with its
    slice) lets go of its read-ahead at the next READ of another."""
    backend = MemoryBackend({KEY: DATA})

    async def body(fs):
        ino = (await resolve(fs, KEY)).ino
        await read_slice(fs, ino, 0, 4 * MiB)
        reader = fs._handles[fs._inode_handles[ino]].reader
        first = reader.stream
        await trio.sleep(handlereader.TRACK_IDLE_S / 2)
        await fs.read_inode(ino, 60 * MiB, 64 * 1024)  # far from the first reader's window
        kept = first in fs.prefetcher.streams and len(reader.tracks) == 2
        await trio.sleep(handlereader.TRACK_IDLE_S)
        await fs.read_inode(ino, 61 * MiB, 64 * 1024)
        return kept, first in fs.prefetcher.streams, first.parts, len(reader.tracks)

    kept, still_open, parts, tracks = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert kept  # (within TRACK_IDLE_S: another reader, who may read on)
    assert not still_open and not parts and tracks == 1


def test_a_reader_waiting_on_a_slow_store_keeps_its_stream_while_another_reads():
    """Idleness is no READ in TRACK_IDLE_S and none in progress: a READ waiting
    longer than that for its part (a slow first byte) keeps its stream."""
    backend = MemoryBackend({KEY: DATA}, delay_s=handlereader.TRACK_IDLE_S * 2)

    async def body(fs):
        ino = (await resolve(fs, KEY)).ino
        got = {}

        async def first():
            got["first"] = bytes(await fs.read_inode(ino, 0, 4 * MiB))

        async def second():
            await trio.sleep(handlereader.TRACK_IDLE_S * 1.5)  # (the first READ still waits)
            got["second"] = bytes(await fs.read_inode(ino, 60 * MiB, 64 * 1024))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            nursery.start_soon(second)
        return got, fs.stats.snapshot()

    got, stats = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got["first"] == DATA[: 4 * MiB] and got["second"] == DATA[60 * MiB : 60 * MiB + 64 * 1024]
    assert "cache.misses" not in stats and "prefetch.bytes_wasted" not in stats  # (no part given up, none read twice)


def test_the_inodes_handle_stays_while_another_reader_still_reads():
    backend = MemoryBackend({KEY: DATA})

    async def body(fs):
        ino = (await resolve(fs, KEY)).ino
        head = await read_slice(fs, ino, 0, 8 * MiB)  # reader A: its first 8 MiB
        tail = await read_slice(fs, ino, 48 * MiB, len(DATA))  # reader B: to the end
        kept = ino in fs._inode_handles
        middle = await read_slice(fs, ino, 8 * MiB, 48 * MiB)  # A again: its stream still there
        return head + middle + tail, kept, fs.stats.snapshot()

    data, kept, stats = run_fs(backend, body)
    assert data == DATA and kept
    assert stats["open.large"] == 1  # (one handle throughout: none reopened, no throwaway ones)
