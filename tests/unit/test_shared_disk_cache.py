"""One disk cache directory shared by several mounts on a host (journal.py, cache.py):
what one stores is a hit for the others, the size bound holds for all of them
together, a rewrite by one is followed by the others, and a writer's tear or crash
hides nothing the others wrote. On the in-memory backend, with request counts."""

import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import trio

from bucketfs.backends.memory import MemoryBackend
from bucketfs.core.stats import Stats
from bucketfs.diskcache import journal
from bucketfs.diskcache.cache import DiskCache

MiB = 1024 * 1024
CHUNK_BYTES = 64 * 1024
pytestmark = pytest.mark.timeout(120)


def blob(n_bytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n_bytes)


FILES = {f"img/{i:02d}.jpg": blob(100_000 + 977 * i, i) for i in range(12)}


def open_cache(backend, directory, nursery, alone: bool, capacity_bytes: int = 1 << 30, chunk_bytes=CHUNK_BYTES):
    return DiskCache(backend, str(directory), capacity_bytes, chunk_bytes, Stats(), nursery, alone=alone)


async def read_key(cache, backend, key) -> bytes:
    info = backend._info[key]
    return bytes(await cache.read_range(key, 0, info.size_bytes, info.version, object_bytes=info.size_bytes))


def stat(cache, name: str) -> int:
    return cache.stats.snapshot().get(name, 0)


def test_what_one_mount_stores_the_other_reads_with_no_get(tmp_path):
    backend = MemoryBackend(FILES)
    more = {f"more/{i}.jpg": blob(70_000, 50 + i) for i in range(5)}

    async def main():
        async with trio.open_nursery() as nursery:
            a = open_cache(backend, tmp_path, nursery, alone=True)
            b = open_cache(backend, tmp_path, nursery, alone=False)  # started while A runs
            for key, data in FILES.items():
                assert await read_key(a, backend, key) == data
            await a.wait_idle()
            gets = backend.requests["get"]
            for key, data in FILES.items():
                assert await read_key(b, backend, key) == data
            b_gets = backend.requests["get"] - gets
            for key, data in more.items():  # and the other way round
                backend.put(key, data)
                assert await read_key(b, backend, key) == data
            await b.wait_idle()
            gets = backend.requests["get"]
            for key, data in more.items():
                assert await read_key(a, backend, key) == data
            a_gets = backend.requests["get"] - gets
            nursery.cancel_scope.cancel()
            return b_gets, a_gets, stat(b, "disk_cache.hits"), stat(a, "disk_cache.records_from_other_mounts")

    b_gets, a_gets, b_hits, a_learned = trio.run(main)
    assert (b_gets, a_gets) == (0, 0)
    assert b_hits == len(FILES)
    assert a_learned >= 2 * len(more)  # (a definition and a chunks record each)


def test_the_cache_size_bounds_every_mount_together(tmp_path):
    """Two mounts each filling the cache: the directory's disk use stays within the one
    --cache-size, because each counts the other's files before it evicts."""
    files = {f"j/{i:04d}.bin": blob(20_000, i) for i in range(400)}  # 400 x 20 KiB of blocks = 8 MiB
    backend = MemoryBackend(files)
    keys = list(files)
    capacity_bytes = 2 * MiB

    async def main():
        async with trio.open_nursery() as nursery:
            a = open_cache(backend, tmp_path, nursery, alone=True, capacity_bytes=capacity_bytes)
            b = open_cache(backend, tmp_path, nursery, alone=False, capacity_bytes=capacity_bytes)
            for at in range(0, len(keys), 20):  # the two take turns, 20 files each
                for key in keys[at : at + 10]:
                    assert await read_key(a, backend, key) == files[key]
                for key in keys[at + 10 : at + 20]:
                    assert await read_key(b, backend, key) == files[key]
                await a.wait_idle()
                await b.wait_idle()
                assert du_bytes(tmp_path) <= capacity_bytes
            nursery.cancel_scope.cancel()
            return stat(a, "disk_cache.evictions") + stat(b, "disk_cache.evictions")

    evictions = trio.run(main)
    assert evictions > 0
    assert du_bytes(tmp_path) <= capacity_bytes


def du_bytes(directory) -> int:
    """What `du` counts for the cache directory."""
    total = os.stat(directory).st_blocks * 512
    for root, dirs, names in os.walk(directory):
        for name in dirs + names:
            total += os.stat(os.path.join(root, name), follow_symlinks=False).st_blocks * 512
    return total


def test_a_rewrite_by_one_mount_is_followed_by_the_others(tmp_path):
    """B follows A's journal rewrite: it reads the old file to its end, then the new one
    from the end of A's snapshot (nothing it knows twice), and still finds what A
    stores after it; a later mount loads the rewritten journal whole."""
    backend = MemoryBackend(FILES)
    keys = list(FILES)

    async def main():
        async with trio.open_nursery() as nursery:
            a = open_cache(backend, tmp_path, nursery, alone=True)
            b = open_cache(backend, tmp_path, nursery, alone=False)
            for key in keys[:6]:
                await read_key(a, backend, key)
            await a.wait_idle()
            for key in keys[:6]:
                await read_key(b, backend, key)
            learned = stat(b, "disk_cache.records_from_other_mounts")
            generation = a._journal.generation
            rewrote = await trio.to_thread.run_sync(
                a._journal.compact, lambda: trio.from_thread.run_sync(a._caught_up_entries, True)
            )
            for key in keys[6:]:
                await read_key(a, backend, key)
            await a.wait_idle()
            gets = backend.requests["get"]
            for key, data in FILES.items():
                assert await read_key(b, backend, key) == data
            b_gets = backend.requests["get"] - gets
            c = open_cache(backend, tmp_path, nursery, alone=False)
            gets = backend.requests["get"]
            for key, data in FILES.items():
                assert await read_key(c, backend, key) == data
            c_gets = backend.requests["get"] - gets
            nursery.cancel_scope.cancel()
            return (
                rewrote,
                b._journal.generation - generation,
                stat(b, "disk_cache.records_from_other_mounts") - learned,
                b_gets,
                c_gets,
                len(b._entries),
            )

    rewrote, generations, learned_after, b_gets, c_gets, b_entries = trio.run(main)
    assert rewrote and generations == 1
    assert learned_after == 2 * len(keys[6:])  # only what A stored after its rewrite
    assert (b_gets, c_gets) == (0, 0)
    assert b_entries == len(FILES)


def test_another_block_size_beside_running_mounts_runs_without_the_cache(tmp_path):
    """A mount with another --block-size cannot use the running mounts' cache: it
    reads the store and stores nothing, and leaves their journal as it was."""
    backend = MemoryBackend(FILES)
    keys = list(FILES)

    async def main():
        async with trio.open_nursery() as nursery:
            a = open_cache(backend, tmp_path, nursery, alone=True)
            for key in keys:
                await read_key(a, backend, key)
            await a.wait_idle()
            other = open_cache(backend, tmp_path, nursery, alone=False, chunk_bytes=128 * 1024)
            gets = backend.requests["get"]
            for key, data in FILES.items():
                assert await read_key(other, backend, key) == data
            await other.wait_idle()
            other_gets = backend.requests["get"] - gets
            c = open_cache(backend, tmp_path, nursery, alone=False)
            gets = backend.requests["get"]
            for key in keys:
                await read_key(c, backend, key)
            nursery.cancel_scope.cancel()
            return other_gets, stat(other, "disk_cache.written_bytes"), backend.requests["get"] - gets

    other_gets, other_written, c_gets = trio.run(main)
    assert other_gets == len(FILES) and other_written == 0
    assert c_gets == 0


# -- the journal's records across writers -----------------------------------------
def record(kind_payload: bytes, writer: int = 7) -> bytes:
    return journal.frame(kind_payload, writer)


def chunks(eid: bytes, crc: int) -> bytes:
    return journal.chunks_payload(eid, [(0, crc)])


def test_a_record_still_being_written_is_waited_for_and_a_torn_one_skipped():
    one, two, three = (record(chunks(bytes([n]) * 16, n)) for n in (1, 2, 3))
    ops, used, skipped = journal.parse(one + two[:10])  # two is being written
    assert [op[1] for op in ops] == [bytes([1]) * 16] and used == len(one) and skipped == 0
    ops, used, skipped = journal.parse(two)  # (the rest arrived)
    assert len(ops) == 1 and used == len(two)
    ops, used, skipped = journal.parse(one + two[:10] + three)  # a whole record after it: two was torn
    assert [op[1] for op in ops] == [bytes([1]) * 16, bytes([3]) * 16] and skipped == 10
    ops, used, skipped = journal.parse(one + bytes(40) + three)  # zeros (a power loss)
    assert len(ops) == 2 and used == len(one) + 40 + len(three) and skipped == 40
    ops, _, _ = journal.parse(one + record(chunks(bytes(16), 9), writer=5) + three, skip_writer=5)
    assert len(ops) == 2  # (a writer's own records are skipped in its tail)


def test_a_torn_record_of_one_writer_hides_none_of_the_others(tmp_path):
    """Writer 1 is killed mid-append; writer 2 goes on appending after the tear: 2's
    records reach a running reader and a later load, and nothing is cut while
    other mounts use the directory."""
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    one = journal.Journal(dir_fd, CHUNK_BYTES, alone=True)
    assert one.compact(lambda: ())  # (a new journal)
    two = journal.Journal(dir_fd, CHUNK_BYTES, alone=False)
    x, y = journal.entry_id("x", "v1"), journal.entry_id("y", "v1")
    one.append([journal.entry_payload("x", "v1", 100), chunks(x, 11)])
    with open(tmp_path / "journal", "ab") as f:
        f.write(journal.frame(chunks(x, 12), one.writer)[:-5])  # writer 1's last append, torn
    two.append([journal.entry_payload("y", "v1", 100), chunks(y, 22)])
    size_bytes = os.stat(tmp_path / "journal").st_size
    tail = one.read_tail()
    assert [op[0] for op in tail] == ["E", "C"] and tail[0][1] == y
    later = journal.Journal(dir_fd, CHUNK_BYTES, alone=False)
    alone_later = journal.Journal(dir_fd, CHUNK_BYTES, alone=True)  # (the tear is not at the tail: kept)
    try:
        for loaded in (later, alone_later):
            assert set(loaded.entries) == {x, y} and loaded.skipped_bytes > 0
            assert loaded.entries[x].crcs[0] == 11 and loaded.entries[y].crcs[0] == 22
        assert os.stat(tmp_path / "journal").st_size == size_bytes
    finally:
        for opened in (one, two, later, alone_later):
            opened.close()
        os.close(dir_fd)


def test_a_torn_tail_is_cut_only_by_a_mount_alone(tmp_path):
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    first = journal.Journal(dir_fd, CHUNK_BYTES, alone=True)
    try:
        first.compact(lambda: ())
        first.append([journal.entry_payload("x", "v1", 100)])
        good_bytes = os.stat(tmp_path / "journal").st_size
        with open(tmp_path / "journal", "ab") as f:
            f.write(record(chunks(bytes(16), 1))[:-3])  # being written by a live mount, or torn
        journal.Journal(dir_fd, CHUNK_BYTES, alone=False).close()
        assert os.stat(tmp_path / "journal").st_size == good_bytes + len(record(chunks(bytes(16), 1))) - 3
        journal.Journal(dir_fd, CHUNK_BYTES, alone=True).close()
        assert os.stat(tmp_path / "journal").st_size == good_bytes
    finally:
        first.close()
        os.close(dir_fd)


CHILD = textwrap.dedent(
    """
    import random, sys, trio
    from bucketfs.backends.memory import MemoryBackend
    from bucketfs.core.stats import Stats
    from bucketfs.diskcache.cache import DiskCache

    files = {f"child/{i:04d}": random.Random(i).randbytes(30_000) for i in range(100000)}

    async def main():
        backend = MemoryBackend({})
        async with trio.open_nursery() as nursery:
            cache = DiskCache(backend, sys.argv[1], 1 << 30, 65536, Stats(), nursery, alone=False)
            for n, key in enumerate(files):
                backend.put(key, files[key])
                info = backend._info[key]
                await cache.read_range(key, 0, info.size_bytes, info.version, object_bytes=info.size_bytes)
                if n == 50:
                    await cache.wait_idle()
                    print("stored", flush=True)

    trio.run(main)
    """
)


def test_a_mount_killed_while_storing_damages_nothing_for_the_others(tmp_path):
    """A mount is SIGKILLed in the middle of storing (its writes and appends cut
    wherever they were): the running mount goes on storing and reading, and a later
    mount finds every object either kept with its right bytes or not at all."""
    backend = MemoryBackend(FILES)

    async def main():
        async with trio.open_nursery() as nursery:
            a = open_cache(backend, tmp_path, nursery, alone=True)
            child = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(tmp_path)],
                stdout=subprocess.PIPE,
                cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
            )
            try:
                assert await trio.to_thread.run_sync(child.stdout.readline) == b"stored\n"
                for key in list(FILES)[:6]:
                    await read_key(a, backend, key)  # while the child stores
                child.send_signal(signal.SIGKILL)
            finally:
                child.kill()
                child.wait(30)
                child.stdout.close()
            for key in list(FILES)[6:]:
                await read_key(a, backend, key)
            await a.wait_idle()
            later = open_cache(backend, tmp_path, nursery, alone=False)
            child_read = child_wrong = 0
            for eid, entry in [(e.eid, e) for e in later._entries.values()]:
                _, size, key_len = journal._ENTRY.unpack_from(entry.definition)
                key = entry.definition[journal._ENTRY.size : journal._ENTRY.size + key_len].decode()
                if not key.startswith("child/"):
                    continue
                got = await later._read_disk(eid, 0, size, size)  # None: a CRC that does not match
                if got is not None:
                    child_read += 1
                    child_wrong += bytes(got) != random.Random(int(key[6:])).randbytes(30_000)
            gets = backend.requests["get"]
            for key, data in FILES.items():
                assert await read_key(later, backend, key) == data
            later_gets = backend.requests["get"] - gets
            nursery.cancel_scope.cancel()
            return child_read, child_wrong, later_gets

    child_read, child_wrong, later_gets = trio.run(main)
    assert child_read >= 50 and child_wrong == 0  # (what the child stored before it was killed is kept too)
    assert later_gets == 0
