"""One disk cache directory shared by several mounts on a host (journal.py, cache.py):
what one stores is a hit for the others, the size bound holds for all of them
together, a rewrite by one is followed by the others, and a writer's tear or crash
hides nothing the others wrote. On the in-memory backend, with request counts."""

import os
import pathlib
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


def side_by_side(backend, directory, nursery, **options) -> tuple:
    """(A, B): a first mount alone on `directory`, and a second started beside it."""
    return (
        open_cache(backend, directory, nursery, alone=True, **options),
        open_cache(backend, directory, nursery, alone=False, **options),
    )


def version_of(backend, key) -> tuple:
    """(the object's ObjectInfo, the id of that version in the cache)."""
    info = backend._info[key]
    return info, journal.entry_id(key, info.version)


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
            a, b = side_by_side(backend, tmp_path, nursery)
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
            a, b = side_by_side(backend, tmp_path, nursery, capacity_bytes=capacity_bytes)
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
            a, b = side_by_side(backend, tmp_path, nursery)
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


# -- deletes racing stores: no journal entry without its file ----------------------
def data_file(directory, eid: bytes) -> pathlib.Path:
    return pathlib.Path(directory) / "data" / journal.data_name(eid)


async def rewrite(cache) -> bool:
    return await trio.to_thread.run_sync(
        cache._journal.compact, lambda: trio.from_thread.run_sync(cache._caught_up_entries, True)
    )


def no_entry_without_its_file(backend, directory, nursery) -> None:
    """A mount loading the directory finds a file behind every chunk its journal names."""
    later = open_cache(backend, directory, nursery, alone=False)
    for entry in later._entries.values():
        if entry.present_chunks():
            assert data_file(directory, entry.eid).exists(), entry.definition


def test_a_mount_that_missed_rewrites_drops_what_was_deleted_meanwhile(tmp_path):
    """B does not look at the journal while A rewrites it twice and deletes X in
    between: B reads the newest journal whole and drops X, instead of keeping (and
    writing into its own rewrites) an object whose file is gone."""
    backend = MemoryBackend(FILES)
    key = "img/00.jpg"

    async def main():
        async with trio.open_nursery() as nursery:
            a, b = side_by_side(backend, tmp_path, nursery)
            info, eid = version_of(backend, key)
            await read_key(a, backend, key)
            await a.wait_idle()
            assert b.holds(key, info.version, 0, info.size_bytes)  # (B learned X)
            await rewrite(a)
            a._evict(eid)
            await a.wait_idle()
            await rewrite(a)  # (X's delete is in the journal B never read)
            b._apply_tail()
            held_by_b = eid in b._entries
            gets = backend.requests["get"]
            assert await read_key(b, backend, key) == FILES[key]
            await rewrite(b)
            no_entry_without_its_file(backend, tmp_path, nursery)
            nursery.cancel_scope.cancel()
            return held_by_b, backend.requests["get"] - gets, stat(b, "disk_cache.bad_reads")

    held_by_b, b_gets, b_bad_reads = trio.run(main)
    assert not held_by_b
    assert (b_gets, b_bad_reads) == (1, 0)  # (a miss, not a read of a missing file)


def test_another_mounts_records_never_undo_this_mounts_delete(tmp_path):
    """B evicts X; before B's delete runs, another mount stores X again. B's delete then
    removes that file and is journaled after those records: B must not take them in
    (nor, once its delete is done, the older records it reads before its own delete
    record), or B and its rewrites would name X with no file."""
    backend = MemoryBackend(FILES)
    key = "img/01.jpg"

    async def main():
        async with trio.open_nursery() as nursery:
            a, b = side_by_side(backend, tmp_path, nursery)
            info, eid = version_of(backend, key)
            await read_key(b, backend, key)
            await b.wait_idle()
            assert a.holds(key, info.version, 0, info.size_bytes)
            entry = a._entries.get(eid)
            again = [
                entry.definition,
                journal.chunks_payload(eid, [(i, entry.crcs[i]) for i in entry.present_chunks()]),
            ]
            b._evict(eid)  # (its delete queued, not run yet)
            a._journal.append(again)  # another mount stores X again meanwhile
            b._apply_tail()
            held_while_queued = eid in b._entries
            a._journal.append(again)  # and again, read by B only once its delete is done
            await b.wait_idle()  # B's delete: the file goes, then its record, after both
            b._apply_tail()
            a._apply_tail()
            held = (eid in b._entries, eid in a._entries, data_file(tmp_path, eid).exists())
            await rewrite(b)
            no_entry_without_its_file(backend, tmp_path, nursery)
            nursery.cancel_scope.cancel()
            return held_while_queued, held

    held_while_queued, held = trio.run(main)
    assert not held_while_queued
    assert held == (False, False, False)  # (B's delete record comes after both stores: X is gone everywhere)


def test_a_store_whose_file_another_mount_deletes_meanwhile_is_journaled_as_deleted(tmp_path, monkeypatch):
    """Another mount's delete of the same id removes the file between this mount's write
    and its records (the other's delete record lands before them): the write sees
    the file gone and journals a delete after its records."""
    backend = MemoryBackend(FILES)
    key = "img/02.jpg"
    real_append = journal.Journal.append

    async def main():
        async with trio.open_nursery() as nursery:
            a, other = side_by_side(backend, tmp_path, nursery)
            info, eid = version_of(backend, key)

            def append_after_the_other_deleted(self, payloads):
                if self is a._journal and payloads[0][:1] == b"E":
                    data_file(tmp_path, eid).unlink()  # the other mount's delete: unlink, then its record
                    real_append(other._journal, [journal.delete_payload([eid])])
                return real_append(self, payloads)

            monkeypatch.setattr(journal.Journal, "append", append_after_the_other_deleted)
            assert await read_key(a, backend, key) == FILES[key]
            await a.wait_idle()
            monkeypatch.setattr(journal.Journal, "append", real_append)
            held = eid in a._entries
            no_entry_without_its_file(backend, tmp_path, nursery)
            nursery.cancel_scope.cancel()
            return held, stat(a, "disk_cache.skipped_stores")

    held, skipped = trio.run(main)
    assert not held and skipped == 1


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


def test_the_journals_size_stays_the_files_when_its_tail_is_read_during_an_append(tmp_path, monkeypatch):
    """The trio thread reads the tail while a writing thread appends: a read that sees
    the append's bytes before the append counts them counts them once."""
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    one = journal.Journal(dir_fd, CHUNK_BYTES, alone=True)
    real_lseek = os.lseek

    def lseek_then_read_tail(fd, offset, whence):  # (right after the append's write)
        end = real_lseek(fd, offset, whence)
        one.read_tail()
        return end

    try:
        assert one.compact(lambda: ())
        one.append([journal.entry_payload("x", "v1", 100)])
        monkeypatch.setattr(journal.os, "lseek", lseek_then_read_tail)
        one.append([chunks(journal.entry_id("x", "v1"), 11)])
        monkeypatch.undo()
        assert one.size_bytes == os.stat(tmp_path / "journal").st_size
    finally:
        one.close()
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


# -- several processes at once, under pressure ------------------------------------
STRESS_OBJECTS = 200
STRESS_CAPACITY_BYTES = 2 * MiB  # ~1/8 of the 17 MB data set: every process evicts all the time
STRESS_COMPACT_MIN_BYTES = 4096  # (the cache takes min(this, capacity // 16)): rewritten every few KB
STRESS_SEED = 20261201
STRESS_CHILD = textwrap.dedent(
    """
    import collections, faulthandler, logging, random, sys, trio
    from bucketfs.backends.memory import MemoryBackend
    from bucketfs.core.stats import Stats
    from bucketfs.diskcache import journal
    from bucketfs.diskcache.cache import DiskCache

    directory, index, alone = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "alone"
    seed, capacity_bytes, reads_count = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    journal.COMPACT_MIN_BYTES = int(sys.argv[7])
    faulthandler.dump_traceback_later(100, exit=True)  # a hang reports where every thread was

    logged = collections.Counter()

    class Count(logging.Handler):
        def emit(self, record):
            logged[record.levelname] += 1

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger().addHandler(Count())

    sizes = [random.Random(-1 - i).randrange(20_000, 150_000) for i in range({objects})]
    expected = {{f"s/{{i:03d}}": random.Random(i).randbytes(sizes[i]) for i in range({objects})}}
    gets = collections.Counter()  # GETs of the store, by the trio task that made them

    class Store(MemoryBackend):
        async def read_range(self, key, start, end, version, object_bytes=None):
            gets[trio.lowlevel.current_task()] += 1
            return await super().read_range(key, start, end, version, object_bytes=object_bytes)

    # Every process puts the keys in one order: the same versions (v1, v2... a per-process counter).
    backend = Store(expected)
    keys = list(expected)
    hot = keys[:20]
    counts = collections.Counter()
    seen = set()

    async def reader(cache, rng, n):
        task = trio.lowlevel.current_task()
        for _ in range(n):
            key = rng.choice(hot) if rng.random() < 0.4 else rng.choice(keys)
            info, data = backend._info[key], expected[key]
            start, end = 0, info.size_bytes
            if rng.random() < 0.25:  # a part of it (only the whole chunks in it are stored)
                start = rng.randrange(info.size_bytes)
                end = rng.randrange(start, info.size_bytes) + 1
            new, gets_before = key not in seen, gets[task]
            seen.add(key)
            got = await cache.read_range(key, start, end, info.version, object_bytes=info.size_bytes)
            counts["reads"] += 1
            if bytes(got) != data[start:end]:
                counts["wrong"] += 1
                print(f"WRONG {{key}} [{{start}}, {{end}}) version {{info.version}}", file=sys.stderr, flush=True)
            if gets[task] == gets_before:
                counts["hits"] += 1
                counts["foreign_hits"] += new  # (never read here before: another process stored it)

    async def main():
        async with trio.open_nursery() as nursery:
            cache = DiskCache(backend, directory, capacity_bytes, 65536, Stats(), nursery, alone=alone)
            print("ready", flush=True)
            assert await trio.to_thread.run_sync(sys.stdin.readline) == "go\\n"
            async with trio.open_nursery() as readers:
                for t in range(3):
                    rng = random.Random(seed * 1000 + index * 10 + t)
                    readers.start_soon(reader, cache, rng, reads_count // 3)
            await cache.wait_idle()
            stats = cache.stats.snapshot()
            for name in ("evictions", "journal_rewrites", "bad_reads", "records_from_other_mounts"):
                counts[name] = stats.get("disk_cache." + name, 0)
            counts["warnings"] = sum(logged.values())
            nursery.cancel_scope.cancel()
        print(" ".join(f"{{name}}={{counts[name]}}" for name in (
            "reads", "wrong", "hits", "foreign_hits", "evictions", "journal_rewrites", "bad_reads",
            "records_from_other_mounts", "warnings")), flush=True)
        sys.exit(1 if counts["wrong"] else 0)

    trio.run(main)
    """
).format(objects=STRESS_OBJECTS)


def stress_expected(key: str) -> bytes:
    i = int(key[2:])
    return blob(random.Random(-1 - i).randrange(20_000, 150_000), i)


@pytest.mark.timeout(180)
def test_processes_reading_storing_evicting_and_rewriting_at_once_never_read_a_wrong_byte(tmp_path):
    """Three processes (the first alone at start, as the first mount is) share one small
    cache directory and read random parts of 200 objects at once, three readers each:
    every process evicts all the time and rewrites the journal every few KB, while the
    others append to it, follow its rewrites and delete each other's files. No read
    returns a wrong byte, each finds what the others stored, every object a later mount
    loads reads back right, and the directory stays within the --cache-size."""
    directory = tmp_path / "cache"
    directory.mkdir()
    reads_count = 600
    children, errs = [], []

    def start(index: int, alone: bool):
        err = open(tmp_path / f"child{index}.err", "wb")
        errs.append(err)
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                STRESS_CHILD,
                str(directory),
                str(index),
                "alone" if alone else "shared",
                str(STRESS_SEED),
                str(STRESS_CAPACITY_BYTES),
                str(reads_count),
                str(STRESS_COMPACT_MIN_BYTES),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
        )
        children.append(child)
        return child

    def evidence() -> str:
        return "\n".join(
            f"child {i} (exit {child.returncode}), seed {STRESS_SEED}, stderr:\n"
            + (tmp_path / f"child{i}.err").read_text(errors="replace")[-6000:]
            for i, child in enumerate(children)
        )

    outputs = []
    try:
        # The first is alone on the directory (as a mount that could lock it exclusively);
        # the others start once it has loaded, and all begin reading together.
        assert start(0, alone=True).stdout.readline() == b"ready\n", evidence()
        for index in (1, 2):
            assert start(index, alone=False).stdout.readline() == b"ready\n", evidence()
        for child in children:
            child.stdin.write(b"go\n")
            child.stdin.flush()  # (communicate closes it)
        for child in children:
            outputs.append(child.communicate(timeout=120)[0].decode())
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(30)
            child.stdout.close()
        for err in errs:
            err.close()
    results = []
    for output, child in zip(outputs, children):
        last = output.strip().splitlines()[-1] if output.strip() else ""
        assert child.returncode == 0 and "wrong=0" in last, evidence()
        results.append({name: int(value) for name, value in (item.split("=") for item in last.split())})
    print("stress counts:", results)
    total = {name: sum(r[name] for r in results) for name in results[0]}
    assert total["reads"] == len(children) * 3 * (reads_count // 3) and total["wrong"] == 0  # (3 readers each)
    assert total["warnings"] == 0, evidence()  # (a background task's exception is logged, not raised)
    assert total["journal_rewrites"] > 0  # while the others appended and followed
    assert all(r["evictions"] > 0 and r["records_from_other_mounts"] > 0 for r in results)
    assert total["foreign_hits"] > 0  # what one process stored, another read with no GET
    # What the processes left: each bounds the files of all of them by its capacity once
    # it has read their records, and the last eviction (after the last write) had read all
    # of them. Past that, a write that raced another process's delete of the same object
    # may leave a file no record names (an orphan, removed by the next mount alone) and a
    # rewrite's journal.new is gone with its rename: two of the largest objects' worth of
    # blocks (150 KB each, in 64 KiB chunks) per process covers it.
    left_bytes = du_bytes(directory)
    assert left_bytes <= STRESS_CAPACITY_BYTES + 3 * 2 * 160 * 1024, left_bytes

    async def main():
        async with trio.open_nursery() as nursery:
            later = open_cache(MemoryBackend({}), directory, nursery, alone=True, capacity_bytes=STRESS_CAPACITY_BYTES)
            await later.wait_idle()  # (orphans removed)
            checked, wrong, unreadable = 0, [], []
            for eid, entry in [(e.eid, e) for e in later._entries.values()]:
                _, size, key_len = journal._ENTRY.unpack_from(entry.definition)
                key = entry.definition[journal._ENTRY.size : journal._ENTRY.size + key_len].decode()
                data = stress_expected(key)
                assert size == len(data)
                for chunk in entry.present_chunks():  # (a part read stores only some chunks)
                    start, end = chunk * CHUNK_BYTES, min((chunk + 1) * CHUNK_BYTES, size)
                    got = await later._read_disk(eid, start, end, size)  # None: a CRC that does not match
                    checked += 1
                    if got is None:  # (and the entry is evicted: its other chunks are not tried)
                        data_file = directory / journal.DATA_DIR_NAME / journal.data_name(eid)
                        unreadable.append((key, chunk, "file exists" if data_file.exists() else "no file"))
                        break
                    if bytes(got) != data[start:end]:
                        wrong.append((key, chunk))
            nursery.cancel_scope.cancel()
            return checked, wrong, unreadable, du_bytes(directory)

    checked, wrong, unreadable, later_bytes = trio.run(main)
    print("later mount:", dict(checked=checked, wrong=wrong, unreadable=unreadable, du=later_bytes, left=left_bytes))
    assert not wrong
    assert not unreadable  # (the journal names chunks the directory does not hold)
    assert checked > 0  # (the processes left the cache holding something)
    assert later_bytes <= STRESS_CAPACITY_BYTES  # (alone, it evicts at load and removes the orphans)
