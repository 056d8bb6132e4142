"""The local disk cache (--cache-dir) on the in-memory backend: request counts prove
that a later epoch reads the disk, and bad disks cost GETs, never wrong bytes."""

import errno
import fcntl
import os
import pathlib
import random
import shutil
import subprocess
import threading
import time
import types

import pytest
import trio

from bucketfs import errors
from bucketfs.backends import versions
from bucketfs.backends.base import Backend
from bucketfs.backends.memory import MemoryBackend
from bucketfs.core.filesystem import Filesystem
from bucketfs.core.stats import Stats
from bucketfs.diskcache import cache as disk_cache
from bucketfs.diskcache import journal, pagecache
from bucketfs.diskcache.cache import WRITE_FAILURES_MAX, DiskCache
from bucketfs.diskcache.directory import claim_dir, claim_shared_dir
from tests.unit.helpers import make_config, read_all, resolve

MiB = 1024 * 1024


def blob(n_bytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n_bytes)


FILES = {f"img/{i:02d}.jpg": blob(100_000 + 977 * i, i) for i in range(12)}
FILES["shards/a.tar"] = blob(20 * MiB + 12_345, 99)  # read-ahead parts, received into pooled buffers


def run_cached(backend, tmp_path, body, **overrides):
    """`await body(fs)` on a Filesystem whose disk cache is `tmp_path/cache`."""
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(exist_ok=True)
    config = make_config(**overrides)

    async def main():
        async with trio.open_nursery() as nursery:
            fs = Filesystem(backend, config, nursery, str(cache_dir))
            with trio.fail_after(30):
                result = await body(fs)
                await fs.finish_writes()  # background writes and deletes are done (as at unmount)
            nursery.cancel_scope.cancel()
        return result

    return trio.run(main)


async def epoch(fs, files=FILES):
    for path, expected in files.items():
        assert await read_all(fs, path) == expected


def forget_memory(fs):
    """What a later epoch of a data set larger than RAM finds: nothing in the block
    cache, nothing in the kernel's page cache."""
    fs.cache.evict(1 << 62)
    fs.prefetcher.pool.shed(1 << 62)
    for node in fs.ns._nodes[1:]:
        if node is not None:
            node.served = False


def cache_files(tmp_path) -> list:
    return list((tmp_path / "cache" / "data").iterdir())


def disk_use_bytes(tmp_path) -> int:
    """What `du` counts for the cache: its data files, journal and directories."""
    cache = tmp_path / "cache"
    return sum(p.stat().st_blocks * 512 for p in [*cache_files(tmp_path), cache / "journal", cache, cache / "data"])


def test_a_later_epoch_reads_the_disk_not_the_store(tmp_path):
    backend = MemoryBackend(FILES)

    async def body(fs):
        await epoch(fs)
        await fs.backend.wait_idle()
        gets_after_first = backend.requests["get"]
        forget_memory(fs)
        await epoch(fs)
        return gets_after_first, backend.requests["get"], fs.stats.snapshot()

    gets_after_first, gets_after_second, stats = run_cached(backend, tmp_path, body)
    assert gets_after_first > 0
    assert gets_after_second == gets_after_first  # the second epoch cost no request
    assert stats["disk_cache.hits"] >= len(FILES)
    assert stats["disk_cache.read_bytes"] == sum(map(len, FILES.values()))


def test_a_chunk_changed_on_disk_costs_a_get_never_a_wrong_byte(tmp_path):
    backend = MemoryBackend(FILES)

    async def body(fs):
        await epoch(fs)
        await fs.backend.wait_idle()
        for path in cache_files(tmp_path):  # a bad disk: one byte flipped in every file
            with open(path, "r+b") as f:
                f.seek(1000)
                byte = f.read(1)
                f.seek(1000)
                f.write(bytes([byte[0] ^ 0xFF]))
        gets_before = backend.requests["get"]
        forget_memory(fs)
        await epoch(fs)  # byte-identical, or it fails here
        return backend.requests["get"] - gets_before, fs.stats.snapshot()["disk_cache.bad_reads"]

    gets, bad_reads = run_cached(backend, tmp_path, body)
    assert bad_reads == len(FILES)
    assert gets >= len(FILES)


SMALL_FILES = {path: data for path, data in FILES.items() if path.startswith("img/")}
needs_no_wait = pytest.mark.skipif(not pagecache.no_wait_reads(), reason="no openat2 RESOLVE_CACHED / RWF_NOWAIT here")


@needs_no_wait
def test_a_hit_in_the_page_cache_is_read_on_the_loop_and_one_on_disk_in_a_thread(tmp_path, monkeypatch):
    """A cached file whose pages the kernel holds is read on the event loop (no thread
    hand-off); one whose pages it does not (a data set larger than RAM) waits for the
    disk in a thread. Both are checked against their CRCs; neither costs a GET.
    (Which pages the kernel holds is its call: after POSIX_FADV_DONTNEED, a no-wait
    read starts read-ahead and now and then finds it done, so the files "on disk" are
    the ones whose no-wait reads are made to miss.)"""
    backend = MemoryBackend(SMALL_FILES)
    real_pread_cached = pagecache.pread_cached

    async def body(fs):
        await epoch(fs, SMALL_FILES)
        await fs.backend.wait_idle()
        on_disk = {os.path.realpath(p) for p in sorted(cache_files(tmp_path))[::2]}
        epochs = []
        for pages_missing in (set(), on_disk):
            monkeypatch.setattr(
                pagecache,
                "pread_cached",
                lambda fd, view, offset, pages_missing=pages_missing: (
                    os.path.realpath(f"/proc/self/fd/{fd}") not in pages_missing and real_pread_cached(fd, view, offset)
                ),
            )
            forget_memory(fs)
            before, gets_before = fs.stats.snapshot(), backend.requests["get"]
            await epoch(fs, SMALL_FILES)  # byte-identical, or it fails here
            after = fs.stats.snapshot()
            epochs.append(
                (
                    backend.requests["get"] - gets_before,
                    after["disk_cache.hits"] - before.get("disk_cache.hits", 0),
                    after["disk_cache.loop_reads"] - before.get("disk_cache.loop_reads", 0),
                )
            )
        return len(on_disk), epochs

    on_disk_count, epochs = run_cached(backend, tmp_path, body)
    every_file = len(SMALL_FILES)
    assert epochs == [(0, every_file, every_file), (0, every_file, every_file - on_disk_count)]


def test_hits_go_to_a_thread_where_reads_cannot_promise_not_to_wait(tmp_path, monkeypatch):
    """An older kernel (no openat2 RESOLVE_CACHED or RWF_NOWAIT), or a file whose name
    is not in the dentry cache: the thread reads it, with the same checks."""
    backend = MemoryBackend(SMALL_FILES)
    first_gets, _ = mount_epoch(backend, tmp_path, SMALL_FILES)
    monkeypatch.setattr(pagecache, "no_wait_reads", lambda: False)
    gets, stats = mount_epoch(backend, tmp_path, SMALL_FILES)
    assert (gets, stats.get("disk_cache.loop_reads", 0), stats["disk_cache.hits"]) == (0, 0, len(SMALL_FILES))
    monkeypatch.undo()
    monkeypatch.setattr(pagecache, "open_cached", lambda dir_fd, name: None)  # (the name would need a directory read)
    gets, stats = mount_epoch(backend, tmp_path, SMALL_FILES)
    assert (gets, stats.get("disk_cache.loop_reads", 0), stats["disk_cache.hits"]) == (0, 0, len(SMALL_FILES))
    assert first_gets == len(SMALL_FILES)


@needs_no_wait
def test_a_large_hit_is_never_read_on_the_loop(tmp_path):
    """Past LOOP_READ_MAX_BYTES a hit's copy and CRC would hold every other request."""
    big = {"big/a.bin": blob(3 * disk_cache.LOOP_READ_MAX_BYTES + 5, 7)}
    backend = MemoryBackend(big)
    mount_epoch(backend, tmp_path, big, small_file_bytes=8 * MiB)
    gets, stats = mount_epoch(backend, tmp_path, big, small_file_bytes=8 * MiB)
    assert (gets, stats["disk_cache.hits"], stats.get("disk_cache.loop_reads", 0)) == (0, 1, 0)


def test_disk_use_stays_within_the_cache_size(tmp_path):
    files = {f"f/{i:02d}": blob(256 * 1024, i) for i in range(16)}  # 4 MiB
    backend = MemoryBackend(files)
    capacity_bytes = 1 * MiB

    async def body(fs):
        await epoch(fs, files)
        await fs.backend.wait_idle()
        return fs.backend.stored_bytes, len(fs.backend._entries)

    stored_bytes, entries = run_cached(backend, tmp_path, body, cache_size_bytes=capacity_bytes)
    assert 0 < stored_bytes <= capacity_bytes
    # (four objects fill 1 MiB exactly, and the journal's block counts too)
    assert len(cache_files(tmp_path)) == entries == 3  # the evicted objects' files are deleted
    assert disk_use_bytes(tmp_path) <= capacity_bytes


def test_another_version_never_reads_the_old_chunks(tmp_path):
    backend = MemoryBackend({"k": b"old" * 50_000})

    async def main():
        async with trio.open_nursery() as nursery:
            cache = DiskCache(backend, str(tmp_path), 1 << 30, 64 * 1024, Stats(), nursery)
            old = backend._info["k"]
            assert (
                await cache.read_range("k", 0, old.size_bytes, old.version, object_bytes=old.size_bytes)
                == b"old" * 50_000
            )
            await cache.wait_idle()
            new = backend.put("k", b"new" * 50_000)
            got = await cache.read_range("k", 0, new.size_bytes, new.version, object_bytes=new.size_bytes)
            again_old = await cache.read_range("k", 0, old.size_bytes, old.version, object_bytes=old.size_bytes)
            nursery.cancel_scope.cancel()
        return got, again_old

    got, again_old = trio.run(main)
    assert got == b"new" * 50_000
    assert again_old == b"old" * 50_000  # still on disk under its own version (the store would refuse it)


def test_a_disk_that_fails_is_never_a_read_error(tmp_path):
    backend = MemoryBackend(FILES)

    async def body(fs):
        shutil.rmtree(tmp_path / "cache")  # every write now fails (ENOENT)
        await epoch(fs)
        await fs.backend.wait_idle()
        errors_first = fs.stats.snapshot()["disk_cache.write_errors"]
        forget_memory(fs)
        await epoch(fs)
        await fs.backend.wait_idle()
        return errors_first, fs.stats.snapshot()

    errors_first, stats = run_cached(backend, tmp_path, body)
    assert errors_first >= WRITE_FAILURES_MAX  # (writes already in flight fail too)
    assert stats["disk_cache.write_errors"] == errors_first  # then it stops trying
    assert stats.get("disk_cache.hits", 0) == 0


@pytest.mark.parametrize("start, end", [(0, 70_000), (65_536, 131_072), (1000, 200_000), (130_000, 200_000)])
def test_ranges_across_chunk_boundaries_read_back_exactly(tmp_path, start, end):
    data = blob(200_000, 5)
    backend = MemoryBackend({"k": data})

    async def main():
        async with trio.open_nursery() as nursery:
            cache = DiskCache(backend, str(tmp_path), 1 << 30, 64 * 1024, Stats(), nursery)
            info = backend._info["k"]
            await cache.read_range("k", 0, len(data), info.version, object_bytes=len(data))
            await cache.wait_idle()
            gets = backend.requests["get"]
            got = await cache.read_range("k", start, end, info.version, object_bytes=len(data))
            buffer = bytearray(end - start)
            got_into = await cache.read_range_into("k", start, end, info.version, buffer, object_bytes=len(data))
            nursery.cancel_scope.cancel()
        return got, bytes(buffer[:got_into]), backend.requests["get"] - gets

    got, got_into, gets = trio.run(main)
    assert got == got_into == data[start:end]
    assert gets == 0


def hold_exclusively(path) -> int:
    """A descriptor of the directory `path`, locked as an earlier bucketfs's mount locked
    its cache directory (one mount's)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def kept_dir_path(tmp_path, identity: str = "s3://b/ at x") -> str:
    claimed = claim_dir(str(tmp_path), identity, "s3-b")
    claimed.close()
    return claimed.path


def test_a_new_mount_removes_the_private_directories_no_mount_holds_only(tmp_path):
    """Liveness is the directory's lock, not a PID: a PID is meaningless in another
    PID namespace (containers sharing a cache disk) or once reused, and a mount killed
    with -9 leaves a directory whose lock is free."""
    identity = "s3://b/ at x"
    kept = kept_dir_path(tmp_path, identity)
    old_mount = hold_exclusively(kept)  # an earlier bucketfs's live mount: the next gets a private one
    pid_max = int(pathlib.Path("/proc/sys/kernel/pid_max").read_text())
    held = tmp_path / f"bucketfs-{pid_max + 1}-abc"  # a live mount in another PID namespace: no such PID here
    left = tmp_path / f"bucketfs-{os.getpid()}-def"  # a mount killed with -9 (its PID reused, here by us)
    other = tmp_path / "someone-elses"
    for d in (held, left, other):
        d.mkdir()
        (d / "0000000001").write_bytes(b"x")
    held_fd = hold_exclusively(held)  # as its mount holds it
    try:
        mine = claim_dir(str(tmp_path), identity, "s3-b")
        try:
            assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
                [held.name, other.name, pathlib.Path(kept).name, pathlib.Path(mine.path).name]
            )
            assert mine.private and not os.listdir(mine.path)
            os.close(
                os.open(tmp_path / "bucketfs-1-ghi", os.O_RDONLY | os.O_CREAT)
            )  # (a file of that name: left alone)
            again = claim_dir(str(tmp_path), identity, "s3-b")  # ours is held too: not removed
            assert again.private and os.path.isdir(mine.path) and os.path.isdir(again.path)
            again.close()
            assert not os.path.exists(again.path)  # a private one goes at close
        finally:
            mine.close()
    finally:
        os.close(held_fd)
        os.close(old_mount)
    left.mkdir()  # the next ordinary mount cleans up too (not only one that needs a private directory)
    claimed = claim_dir(str(tmp_path), "s3://b/ at x", "s3-b")
    try:
        assert not claimed.private and not left.exists() and not held.exists()  # (its lock went with its holder)
    finally:
        claimed.close()


def test_one_cache_directory_per_bucket_shared_by_its_mounts(tmp_path):
    first = claim_dir(str(tmp_path), "s3://b/train/ at x", "s3-b")
    try:
        assert not first.private and first.alone
        second = claim_dir(str(tmp_path), "s3://b/train/ at x", "s3-b")  # a second mount of the same
        other = claim_dir(str(tmp_path), "s3://b/val/ at x", "s3-b")  # another prefix
        assert second.path == first.path and not second.private and not second.alone
        assert not other.private and other.alone and other.path != first.path
        other.close()
        second.close()
        assert os.path.isdir(first.path)  # (a shared one is kept)
    finally:
        first.close()
    again = claim_dir(str(tmp_path), "s3://b/train/ at x", "s3-b")  # the next mount after them
    again.close()
    assert again.path == first.path and again.alone and not again.private


def test_a_directory_an_earlier_version_holds_leaves_a_private_one_and_refuses_warm(tmp_path):
    """An earlier bucketfs locked its directory exclusively (one mount's cache): a new
    mount beside it caches in a private directory, and warm refuses (exit 9) rather
    than fill one that goes at its exit."""
    old_mount = hold_exclusively(kept_dir_path(tmp_path))
    try:
        busy = claim_dir(str(tmp_path), "s3://b/ at x", "s3-b")
        assert busy.private and pathlib.Path(busy.path).name.startswith(f"bucketfs-{os.getpid()}-")
        busy.close()
        assert not os.path.exists(busy.path)
        with pytest.raises(errors.UserError) as refused:
            claim_shared_dir(str(tmp_path), "s3://b/ at x", "s3-b")
        assert refused.value.exit_code == errors.EXIT_BAD_CACHE_DIR
    finally:
        os.close(old_mount)


def test_deleting_a_file_in_a_cache_directory_never_frees_its_lock(tmp_path):
    """The lock is the directory's own: a tmp cleaner deleting a `lock` file or
    anything else does not make the next mount think it is alone (and cut or rewrite
    what the first is using)."""
    claimed = claim_dir(str(tmp_path), "s3://b/ at x", "s3-b")
    try:
        for name in ("lock", "journal", "journal.lock"):  # what a cleaner finds in a used cache directory
            (pathlib.Path(claimed.path) / name).write_bytes(b"x")
        for name in os.listdir(claimed.path):
            os.unlink(os.path.join(claimed.path, name))
        second = claim_dir(str(tmp_path), "s3://b/ at x", "s3-b")
        try:
            assert second.path == claimed.path and not second.alone
        finally:
            second.close()
    finally:
        claimed.close()


# -- kept across mounts ------------------------------------------------------------
def mount_epoch(backend, tmp_path, files=FILES, **overrides):
    """One mount's epoch over `files`: (GETs it cost, its stats)."""

    async def body(fs):
        gets_before = backend.requests["get"]
        await epoch(fs, files)
        return backend.requests["get"] - gets_before, fs.stats.snapshot()

    return run_cached(backend, tmp_path, body, **overrides)


@pytest.mark.parametrize("load_block_bytes", [8 * MiB, 97])  # 97: every record straddles a block
def test_a_later_mount_reads_what_an_earlier_one_stored(tmp_path, monkeypatch, load_block_bytes):
    monkeypatch.setattr(journal, "LOAD_BLOCK_BYTES", load_block_bytes)
    backend = MemoryBackend(FILES)
    first_gets, _ = mount_epoch(backend, tmp_path)
    gets, stats = mount_epoch(backend, tmp_path)  # a new Filesystem and DiskCache on the same directory
    assert first_gets >= len(FILES)
    assert gets == 0
    assert stats["disk_cache.loaded_bytes"] == sum(map(len, FILES.values()))
    assert stats["disk_cache.read_bytes"] == sum(map(len, FILES.values()))


def test_a_later_mount_reads_its_most_recent_files_ahead_within_half_the_free_memory(tmp_path, monkeypatch):
    """After a reboot the kept files are on disk only: the next mount asks the kernel to
    read the most recently used ones into the page cache (so its epoch reads them on
    the event loop), newest first, up to half the memory available."""
    partial = blob(10 * MiB, 8)
    backend = MemoryBackend(dict(SMALL_FILES, **{"big/partial.bin": partial}))

    async def one_by_one(fs):  # stored in a known order: 00 first, 11 last (most recent)
        for path, expected in SMALL_FILES.items():
            assert await read_all(fs, path) == expected
            await fs.backend.wait_idle()
        fh = await fs.open((await resolve(fs, "big/partial.bin")).ino, 0)  # one random read: a sparse file,
        assert bytes(await fs.read(fh, 4 * MiB, 1000)) == partial[4 * MiB : 4 * MiB + 1000]  # never read ahead whole
        fs.release(fh)
        await fs.backend.wait_idle()

    run_cached(backend, tmp_path, one_by_one)
    asked, asked_done = [], threading.Event()
    real_read_ahead = pagecache.read_ahead

    def read_ahead(dir_fd, names, stop):
        asked.extend(names)
        real_read_ahead(dir_fd, names, stop)
        asked_done.set()

    monkeypatch.setattr(pagecache, "read_ahead", read_ahead)
    half_of_free_bytes = 350_000
    monkeypatch.setattr(pagecache, "available_memory_bytes", lambda: 2 * half_of_free_bytes)

    async def epoch_and_read_ahead(fs):
        gets_before = backend.requests["get"]
        await epoch(fs, SMALL_FILES)
        # The read-ahead runs on a thread of its own, which an unmount does not wait for
        # (a test that ended first found nothing asked, in one CI run).
        assert await trio.to_thread.run_sync(asked_done.wait, 20), "the mount never read ahead"
        return backend.requests["get"] - gets_before, fs.stats.snapshot()

    gets, stats = run_cached(backend, tmp_path, epoch_and_read_ahead)

    by_content = {data: path for path, data in SMALL_FILES.items()}
    data_dir = tmp_path / "cache" / "data"
    asked_keys = [by_content.get((data_dir / name).read_bytes(), "a partly stored object") for name in asked]
    newest_first = list(SMALL_FILES)[::-1]
    sizes = [len(SMALL_FILES[key]) for key in newest_first]
    count = next(n for n in range(1, len(sizes) + 1) if sum(sizes[:n]) >= half_of_free_bytes)
    assert asked_keys == newest_first[:count]
    assert stats["disk_cache.read_ahead_bytes"] == sum(sizes[:count])
    assert gets == 0


def test_an_unmount_does_not_wait_for_the_read_ahead(tmp_path, monkeypatch):
    backend = MemoryBackend(SMALL_FILES)
    mount_epoch(backend, tmp_path, SMALL_FILES)
    stopped, returned = [], threading.Event()

    def read_ahead(dir_fd, names, stop):  # longer than the mount lasts: told to stop when it ends
        stopped.append(stop.wait(10))
        returned.set()

    monkeypatch.setattr(pagecache, "read_ahead", read_ahead)
    mount_epoch(backend, tmp_path, SMALL_FILES)  # would take the 10 s if the mount waited for it
    assert returned.wait(10)
    assert stopped == [True]


def test_a_later_mount_fetches_an_object_changed_in_between(tmp_path):
    backend = MemoryBackend(FILES)
    mount_epoch(backend, tmp_path)
    changed = dict(FILES, **{"img/03.jpg": blob(100_000 + 977 * 3, 1003)})  # same key and size, new bytes
    backend.put("img/03.jpg", changed["img/03.jpg"])
    gets, stats = mount_epoch(backend, tmp_path, changed)  # byte-identical to the new version, or it fails here
    assert gets == 1
    assert stats.get("disk_cache.bad_reads", 0) == 0


def test_a_chunk_changed_between_mounts_costs_a_get_never_a_wrong_byte(tmp_path):
    """The CRCs outlive the mount: a file changed while nothing was mounted is caught."""
    backend = MemoryBackend(FILES)
    mount_epoch(backend, tmp_path)
    for path in cache_files(tmp_path):
        with open(path, "r+b") as f:
            f.seek(70_000)  # in the second chunk
            byte = f.read(1)
            f.seek(70_000)
            f.write(bytes([byte[0] ^ 0x01]))
    gets, stats = mount_epoch(backend, tmp_path)
    assert stats["disk_cache.bad_reads"] == len(FILES)
    assert gets >= len(FILES)


@pytest.mark.parametrize(
    "tear",
    [
        journal.frame(journal.chunks_payload(bytes(16), [(0, 123), (1, 456)]), 1)[:-3],  # a record cut short
        journal.SYNC + b"\xff\xff\xff\x7f" + bytes(20),  # a torn length field
        journal.frame(journal.chunks_payload(bytes(16), [(0, 123)]), 1)[:-1] + b"!",  # a CRC that does not match
    ],
)
def test_a_torn_journal_keeps_every_record_before_the_tear(tmp_path, monkeypatch, tear):
    """A crash mid-append: the next mount loads what came before, cuts the tear, and
    appends after it (a third mount finds those too)."""
    monkeypatch.setattr(journal, "LOAD_BLOCK_BYTES", 1000)
    backend = MemoryBackend(FILES)
    mount_epoch(backend, tmp_path)
    journal_path = tmp_path / "cache" / "journal"
    with open(journal_path, "ab") as f:
        f.write(tear)
    gets, stats = mount_epoch(backend, tmp_path)
    assert gets == 0
    extra = {"more/x.bin": blob(300_000, 7)}
    backend.put("more/x.bin", extra["more/x.bin"])
    mount_epoch(backend, tmp_path, extra)
    gets, _ = mount_epoch(backend, tmp_path, dict(FILES, **extra))
    assert gets == 0


def test_a_later_mount_with_a_smaller_cache_size_evicts_down_to_it(tmp_path):
    files = {f"f/{i:02d}": blob(256 * 1024, i) for i in range(16)}  # 4 MiB
    backend = MemoryBackend(files)
    mount_epoch(backend, tmp_path, files)

    async def body(fs):
        await fs.backend.wait_idle()  # the evictions done at start
        return fs.backend.stored_bytes, [
            key for key in files if journal.entry_id(key, backend._info[key].version) in fs.backend._entries
        ]

    stored_bytes, kept = run_cached(backend, tmp_path, body, cache_size_bytes=1 * MiB)
    assert 0 < stored_bytes <= 1 * MiB and len(kept) == 3  # the last stored (in the journal's order)
    assert disk_use_bytes(tmp_path) <= 1 * MiB
    kept_first = {
        key: files[key] for key in [*kept, *files]
    }  # (an LRU cache read in order evicts each before its turn)
    gets, _ = mount_epoch(backend, tmp_path, kept_first, cache_size_bytes=1 * MiB)
    assert gets == 13  # the three kept come from disk; every other one is fetched


def test_a_later_mount_counts_the_data_directory_and_journal_an_earlier_one_grew(tmp_path):
    """600 small objects grow the data directory to several blocks (ext4 never shrinks
    it), and the files a smaller --cache-size evicts at load are journaled as deleted:
    both count, so the directory stays within the later mount's size."""
    files = {f"many/{i:04d}": blob(1000 + i, i) for i in range(600)}
    backend = MemoryBackend(files)
    mount_epoch(backend, tmp_path, files, cache_size_bytes=64 * MiB)
    assert (tmp_path / "cache" / "data").stat().st_blocks * 512 > 4096  # (else nothing to count)

    async def body(fs):
        await fs.backend.wait_idle()  # (the evicted files removed, their deletes journaled)
        return fs.backend.stored_bytes

    for cache_size_bytes in (1 * MiB + 5000, 1 * MiB + 2500, 1 * MiB):
        stored_bytes = run_cached(backend, tmp_path, body, cache_size_bytes=cache_size_bytes)
        assert stored_bytes <= cache_size_bytes
        assert disk_use_bytes(tmp_path) <= cache_size_bytes


def test_a_later_mount_with_another_block_size_starts_empty(tmp_path):
    backend = MemoryBackend(FILES)
    mount_epoch(backend, tmp_path)
    gets, stats = mount_epoch(backend, tmp_path, block_size_bytes=128 * 1024)
    assert gets >= len(FILES)
    assert stats["disk_cache.loaded_bytes"] == 0
    assert stats.get("disk_cache.bad_reads", 0) == 0


def test_data_files_no_record_names_are_removed_at_start(tmp_path):
    backend = MemoryBackend(FILES)
    mount_epoch(backend, tmp_path)
    stray = tmp_path / "cache" / "data" / f"{10**9:012d}"  # written, then a crash before its record
    stray.write_bytes(b"x" * 1000)
    gets, _ = mount_epoch(backend, tmp_path)
    assert gets == 0
    assert not stray.exists()


def test_the_index_is_charged_to_the_memory_budget_and_leaves_buffers_the_rest(tmp_path):
    """A cache of many objects found at start takes its share of --max-memory at once:
    the budget holds the daemon's memory, not just its buffers."""
    backend = MemoryBackend(FILES)
    mount_epoch(backend, tmp_path)
    chunks_count = sum(-(-len(data) // (64 * 1024)) for data in FILES.values())

    async def body(fs):
        return fs.budget.disk_index_bytes, fs.budget.capacity_bytes, fs.budget.budget_bytes

    index_bytes, capacity_bytes, budget_bytes = run_cached(backend, tmp_path, body)
    definitions_bytes = sum(
        len(journal.entry_payload(key, backend._info[key].version, len(data))) for key, data in FILES.items()
    )
    # (a byte of bitmap a chunk for objects past INT_BITMAP_CHUNKS_MAX chunks)
    bitmap_bytes = sum(
        n for n in (-(-len(data) // (64 * 1024)) for data in FILES.values()) if n > journal.INT_BITMAP_CHUNKS_MAX
    )
    assert bitmap_bytes  # (shards/a.tar)
    assert index_bytes == len(FILES) * journal.INDEX_ENTRY_BYTES + definitions_bytes + 4 * chunks_count + bitmap_bytes
    assert capacity_bytes == budget_bytes - index_bytes


def test_the_journal_is_rewritten_while_mounted_and_stays_bounded(tmp_path, monkeypatch):
    """A cache smaller than the data set evicts on every epoch, and each eviction
    leaves dead records: the journal is rewritten from the index while mounted, and
    the next mount still finds every object that was kept."""
    monkeypatch.setattr(journal, "COMPACT_MIN_BYTES", 4096)
    files = {f"f/{i:03d}": blob(70_000 + i, i) for i in range(120)}  # 8.4 MB through a 1 MiB cache
    backend = MemoryBackend(files)

    async def body(fs):
        for _ in range(3):
            await epoch(fs, files)
            await fs.backend.wait_idle()
            forget_memory(fs)
        cache = fs.backend
        kept = [key for key in files if journal.entry_id(key, backend._info[key].version) in cache._entries]
        return fs.stats.snapshot(), cache._journal.size_bytes, cache._live_record_bytes, kept

    stats, journal_bytes, live_bytes, kept = run_cached(backend, tmp_path, body, cache_size_bytes=1 * MiB)
    assert stats["disk_cache.journal_rewrites"] >= 1
    assert journal_bytes == os.path.getsize(tmp_path / "cache" / "journal")
    assert journal_bytes <= 2 * live_bytes + 4096 + 10_000  # (+ the appends since the last rewrite began)
    assert kept
    gets, _ = mount_epoch(backend, tmp_path, {key: files[key] for key in kept}, cache_size_bytes=1 * MiB)
    assert gets == 0


# -- review fixes ------------------------------------------------------------------
SAME_SIZE = {f"s/f{i}": blob(4096, 40 + i) for i in range(4)}  # same size, other bytes


async def read_key(cache, backend, key):
    info = backend._info[key]
    return bytes(await cache.read_range(key, 0, info.size_bytes, info.version, object_bytes=info.size_bytes))


def test_a_mount_whose_directory_was_deleted_never_writes_into_the_next_ones(tmp_path):
    """Mount A's directory is deleted ("clear the cache") and mount B makes a new one
    at the same path: A's later writes fail (they are relative to the directory A
    holds), so A never writes into B's journal, and a third mount serves every
    object's own bytes."""
    backend = MemoryBackend(SAME_SIZE)
    directory = tmp_path / "c"
    directory.mkdir()

    async def main():
        async with trio.open_nursery() as nursery:
            a = DiskCache(backend, str(directory), 1 << 30, 64 * 1024, Stats(), nursery)
            assert await read_key(a, backend, "s/f0") == SAME_SIZE["s/f0"]
            await a.wait_idle()
            shutil.rmtree(directory)
            directory.mkdir()
            b = DiskCache(backend, str(directory), 1 << 30, 64 * 1024, Stats(), nursery)
            assert await read_key(a, backend, "s/f1") == SAME_SIZE["s/f1"]  # A: to nowhere
            await a.wait_idle()
            for key in ("s/f2", "s/f3"):  # B
                assert await read_key(b, backend, key) == SAME_SIZE[key]
                await b.wait_idle()
            c = DiskCache(backend, str(directory), 1 << 30, 64 * 1024, Stats(), nursery)
            got = {key: await read_key(c, backend, key) for key in SAME_SIZE}
            nursery.cancel_scope.cancel()
            return (
                got,
                a.stats.snapshot().get("disk_cache.write_errors", 0),
                c.stats.snapshot().get("disk_cache.hits", 0),
            )

    got, a_write_errors, c_hits = trio.run(main)
    assert got == SAME_SIZE
    assert a_write_errors >= 1 and c_hits == 2  # (f2 and f3, B's)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs (root only), unmounted however the test ends."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True, timeout=30
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)


def fill(disk) -> None:
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def test_a_full_disk_never_refuses_the_mount(tiny_disk):
    """A torn journal on a full disk is cut in place (no space needed), and a new
    cache on a full disk starts without writing: both serve every read, from the
    store or what the disk holds, instead of failing the mount."""
    files = {f"f/{i}": blob(50_000, i) for i in range(3)}
    backend = MemoryBackend(files)
    kept, new = tiny_disk / "kept", tiny_disk / "new"
    kept.mkdir()
    new.mkdir()

    async def epoch_on(directory, check=None):
        async with trio.open_nursery() as nursery:
            stats = Stats()
            with trio.fail_after(30):
                cache = DiskCache(backend, str(directory), 1 << 30, 64 * 1024, stats, nursery)
                if check:
                    check(cache)
                for key in files:
                    assert await read_key(cache, backend, key) == files[key]
                await cache.wait_idle()
            nursery.cancel_scope.cancel()
        return stats.snapshot()

    trio.run(epoch_on, kept)
    journal_path = kept / "journal"
    good_bytes = journal_path.stat().st_size
    with open(journal_path, "ab") as f:
        f.write(journal.frame(journal.chunks_payload(bytes(16), [(0, 1)]), 1)[:-3])  # a crash mid-append
    fill(tiny_disk)
    gets = backend.requests["get"]
    stats = trio.run(epoch_on, kept)
    assert journal_path.stat().st_size == good_bytes  # the tear cut in place
    assert stats["disk_cache.hits"] == len(files) and backend.requests["get"] == gets
    stats = trio.run(epoch_on, new, lambda cache: cache._journal.broken or pytest.fail("expected a broken journal"))
    assert stats.get("disk_cache.hits", 0) == 0 and stats.get("disk_cache.write_errors", 0) == 0
    assert sorted(os.listdir(new)) == ["data", "journal.lock"]  # (no journal, no journal.new left behind)


def test_a_journal_rewrite_that_fails_leaves_no_new_file(tmp_path, monkeypatch):
    backend = MemoryBackend(SMALL_FILES)
    mount_epoch(backend, tmp_path, SMALL_FILES)
    (tmp_path / "cache" / "journal.new").write_bytes(b"half a rewrite")  # a crash mid-rewrite
    mount_epoch(backend, tmp_path, SMALL_FILES)
    assert not (tmp_path / "cache" / "journal.new").exists()

    def failing_fsync(fd):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    opened = journal.Journal(os.open(tmp_path / "cache", os.O_RDONLY | os.O_DIRECTORY), 64 * 1024)
    with pytest.raises(OSError):
        opened.compact(lambda: ())
    opened.close()
    os.close(opened.dir_fd)
    assert sorted(os.listdir(tmp_path / "cache")) == ["data", "journal", "journal.lock"]


def write_journal(directory, entries_count: int, chunk_bytes: int = 64 * 1024) -> None:
    """What an earlier mount left: `entries_count` objects of two chunks each (110 KB)."""
    (directory / "data").mkdir(parents=True, exist_ok=True)
    with open(directory / "journal", "wb") as f:
        f.write(journal.MAGIC + journal._HEADER.pack(chunk_bytes, 1, 0))
        for no in range(1, entries_count + 1):
            key, version = f"train/{no:06d}.JPEG", "0123456789abcdef"
            eid = journal.entry_id(key, version)
            f.write(journal.frame(journal.entry_payload(key, version, 110_000), 1))
            f.write(journal.frame(journal.chunks_payload(eid, [(0, 1), (1, 2)]), 1))
            (directory / "data" / journal.data_name(eid)).write_bytes(b"")


def test_a_smaller_cache_size_evicts_at_load_in_one_pass_and_deletes_with_one_worker(tmp_path):
    """200,000 evictions at start made 200,000 tasks at once (1.3 GB RSS): the load
    drops them in one pass (one journal rewrite, one thread removing their files),
    and evictions while mounted go through one delete worker."""
    write_journal(tmp_path, 3000)

    async def main():
        async with trio.open_nursery() as nursery:
            with trio.fail_after(60):
                cache = DiskCache(MemoryBackend({}), str(tmp_path), 1 * MiB, 64 * 1024, Stats(), nursery)
                tasks_at_load = len(nursery.child_tasks)
                await cache.wait_idle()
                kept = len(cache._entries)
                for eid in list(cache._entries):  # (every one, while mounted)
                    cache._evict(eid)
                tasks_mounted = len(nursery.child_tasks)
                await cache.wait_idle()
            nursery.cancel_scope.cancel()
            return cache, tasks_at_load, kept, tasks_mounted

    cache, tasks_at_load, kept, tasks_mounted = trio.run(main)
    assert tasks_at_load <= 3 and tasks_mounted <= 3  # (the delete worker, orphan removal, read-ahead)
    assert 0 < kept < 3000 and cache.stats.snapshot()["disk_cache.evictions"] == 3000
    assert not os.listdir(tmp_path / "data")
    loaded = journal.Journal(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), 64 * 1024)
    loaded.close()
    os.close(loaded.dir_fd)
    assert not loaded.entries  # (the deletes are journaled)


def test_bytes_waiting_for_the_disk_are_held_within_the_memory_budget(tmp_path, monkeypatch):
    """A disk slower than the network: fetched bytes waiting to be written are lent by
    --max-memory (past it they are not stored), not held beside it."""
    files = {f"img/{i:03d}.bin": blob(2 * MiB, i) for i in range(24)}  # 48 MiB through a 16 MiB budget
    disk_free = threading.Event()
    real_write_chunks = disk_cache._write_chunks

    def slow_write(*args):
        disk_free.wait(30)
        return real_write_chunks(*args)

    monkeypatch.setattr(disk_cache, "_write_chunks", slow_write)
    backend = MemoryBackend(files)
    peaks = {"pending": 0, "over": 0}

    async def body(fs):
        cache = fs.backend
        try:
            for path, data in files.items():
                assert await read_all(fs, path) == data
                peaks["pending"] = max(peaks["pending"], cache._pending_bytes)
                peaks["over"] = max(peaks["over"], fs.budget.used_bytes - fs.budget.capacity_bytes)
        finally:
            disk_free.set()
        await cache.wait_idle()
        return fs.stats.snapshot()

    stats = run_cached(backend, tmp_path, body, max_memory_bytes=16 * MiB)
    assert 0 < peaks["pending"] <= 16 * MiB
    assert peaks["over"] <= 0
    assert stats["disk_cache.skipped_bytes"] > 0  # refused by the budget: not stored


def test_the_cache_size_bounds_the_blocks_small_files_take(tmp_path):
    """A 300-byte object takes a 4 KiB block: --cache-size counts blocks (and the
    journal), so the directory's disk use stays within it."""
    files = {f"j/{i:04d}.json": blob(300, i) for i in range(600)}  # 600 x 4 KiB = 2.4 MiB of blocks
    backend = MemoryBackend(files)

    async def body(fs):
        await epoch(fs, files)
        await fs.backend.wait_idle()
        return fs.stats.snapshot()

    stats = run_cached(backend, tmp_path, body, cache_size_bytes=1 * MiB)
    assert stats["disk_cache.evictions"] > 0
    assert disk_use_bytes(tmp_path) <= 1 * MiB


@pytest.mark.timeout(90)
def test_storing_and_checking_a_chunk_of_a_huge_object_costs_the_same_as_a_small_ones():
    """The chunk bitmap of a huge object was an int rebuilt on every change and shift:
    quadratic (loading a 64 GiB object's records took 8.5 s, 128 GiB four times
    that). Now each chunk costs the same: 256 GiB (4 M chunks) in a few seconds."""
    chunk_bytes = 64 * 1024
    entry = journal.Entry(bytes(16), 256 << 30, chunk_bytes, b"")
    chunks_count = len(entry.crcs)
    deadline_s = time.monotonic() + 30
    for i in range(chunks_count):
        entry.add(i, i, chunk_bytes)
        if not i % 65536:
            assert time.monotonic() < deadline_s, f"only {i} chunks stored in 30 s"
    assert entry.stored_bytes == 256 << 30
    for i in range(0, chunks_count, 128):  # one check per 8 MiB part
        assert entry.has(i, i + 128)
    assert time.monotonic() < deadline_s
    for chunks in (3, 1000):  # (an int bitmap, a bytearray one)
        part = journal.Entry(b"2" * 16, chunks * chunk_bytes - 7, chunk_bytes, b"E")
        for i in (1, chunks - 1):
            part.add(i, i + 10, chunk_bytes)
        assert (part.has(0, 2), part.has(1, 2), part.has(chunks - 1, chunks)) == (False, True, True)
        assert part.records() == journal.frame(b"E", 0) + journal.frame(
            journal.chunks_payload(b"2" * 16, [(1, 11), (chunks - 1, chunks + 9)]), 0
        )


def contract_names(backend_class=Backend) -> set:
    """Every public name of a backend contract: its methods and class attributes, and
    the attributes its __init__ sets (requests, bytes_fetched, get_paths)."""
    instance_attributes = types.SimpleNamespace()
    backend_class.__init__(instance_attributes)
    return {name for name in dir(backend_class) if not name.startswith("_")} | set(vars(instance_attributes))


def test_the_disk_cache_defines_every_name_of_the_backend_contract_itself():
    """An explicit wrapper: a name of the contract it did not define would reach the
    store past the cache (as a forwarding __getattr__ let every new method do)."""
    names = contract_names()
    assert {
        "list_page",
        "stat",
        "read_range",
        "read_range_into",
        "check_bucket",
        "aclose",
        "confirm_past_end",
        "receives_into",
        "redirects_count",
        "requests",
        "bytes_fetched",
        "get_paths",
    } <= names
    assert sorted(names - set(vars(DiskCache))) == []
    assert "__getattr__" not in vars(DiskCache) and DiskCache.__mro__ == (DiskCache, object)


def test_a_new_contract_method_fails_the_check_until_the_wrapper_defines_it():
    class GrownBackend(Backend):
        extra_count = 0

        async def list_versions(self, key: str) -> list:
            return []

    assert contract_names(GrownBackend) - set(vars(DiskCache)) == {"extra_count", "list_versions"}


def test_what_the_disk_cache_does_not_keep_is_the_stores(tmp_path):
    """Listings, metadata, the probe, a 416's confirmation and closing go to the store;
    the counters the stats read are the store's."""
    backend = MemoryBackend({"d/a.bin": b"0123456789"})
    closed = []

    async def aclose():
        closed.append(True)

    backend.aclose = aclose

    async def main():
        async with trio.open_nursery() as nursery:
            cache = DiskCache(backend, str(tmp_path), 1 << 30, 64 * 1024, Stats(), nursery)
            page = await cache.list_page("d/")
            info = page.objects[0]
            assert (await cache.stat("d/a.bin")) == info
            assert await cache.check_bucket("d/")
            assert await cache.confirm_past_end("d/a.bin", info.version, 10) == b""
            assert await cache.read_range("d/a.bin", 0, 10, info.version, object_bytes=10) == b"0123456789"
            await cache.wait_idle()
            assert await cache.read_range("d/a.bin", 0, 10, info.version, object_bytes=10) == b"0123456789"  # a hit
            assert dict(backend.requests) == {"list": 2, "head": 2, "get": 1}
            assert cache.requests is backend.requests and cache.get_paths is backend.get_paths
            assert cache.bytes_fetched == backend.bytes_fetched == 10
            assert cache.receives_into is backend.receives_into and cache.redirects_count == 0
            assert cache.caller is None  # (the in-memory backend has no BlockingCaller)
            await cache.aclose()
            assert closed == [True]
            nursery.cancel_scope.cancel()

    trio.run(main)


def random_epochs(directory, files: dict, capacity_bytes: int, orders: list, mounts: int = 1) -> tuple:
    """Read every file of `files` in each of `orders` through a DiskCache of
    `capacity_bytes` on `directory` (the orders split evenly over `mounts` DiskCaches in
    turn, as new mounts): each epoch's share of files found on disk, and the most the
    directory took on disk at any time."""
    backend = MemoryBackend(files)
    shares, peak_bytes = [], 0
    directory.mkdir(parents=True, exist_ok=True)

    async def mount(mount_orders):
        nonlocal peak_bytes
        async with trio.open_nursery() as nursery:
            cache = DiskCache(backend, str(directory), capacity_bytes, 64 * 1024, Stats(), nursery)
            for order in mount_orders:
                gets_before = backend.requests["get"]
                for key in order:
                    data = files[key]
                    assert await cache.read_range(key, 0, len(data), backend._info[key].version, len(data)) == data
                    await cache.wait_idle()
                    peak_bytes = max(peak_bytes, cache.stored_bytes, disk_use_bytes(directory.parent))
                shares.append(1 - (backend.requests["get"] - gets_before) / len(order))
            nursery.cancel_scope.cancel()

    per_mount = len(orders) // mounts
    for at in range(0, len(orders), per_mount):
        trio.run(mount, orders[at : at + per_mount])
    return shares, peak_bytes


def test_random_epochs_over_twice_the_cache_find_nearly_half_of_it_on_disk(tmp_path, monkeypatch):
    """Epochs read the data set in a new random order each time. Under LRU a data set
    twice the cache found each file evicted before its next turn (~15% hits); the
    policy (policy.py) keeps a resident set that new files do not evict: ~47.5% of each
    later epoch is on disk, across mounts too, within the cache size throughout.
    `python3 -m pytest -q -s -k random_epochs tests/unit/test_disk_cache.py` prints
    the figures."""
    # (the journal may grow to capacity/16 before a rewrite, which the resident set
    # leaves room for: a test-sized cache would lose 6% to it, a real one ~0)
    monkeypatch.setattr(journal, "COMPACT_MIN_BYTES", 16 * 1024)
    files = {f"train/{i:04d}.jpg": blob(64 * 1024, i) for i in range(240)}  # a chunk each, 15 MiB
    capacity_bytes = sum(map(len, files.values())) // 2
    rng = random.Random(11)
    orders = [rng.sample(list(files), len(files)) for _ in range(4)]
    figures = {}
    for name, lru in (("policy", False), ("LRU", True)):
        monkeypatch.setattr(disk_cache, "LRU_POLICY", lru)
        directory = tmp_path / name / "cache"
        figures[name] = random_epochs(directory, files, capacity_bytes, orders, mounts=2)
    print(
        "\nrandom epochs 1-4 over twice the disk cache (a new mount at epoch 3): "
        + "; ".join(f"{name} {', '.join(f'{s:.1%}' for s in shares)}" for name, (shares, _) in figures.items())
    )
    shares, peak_bytes = figures["policy"]
    assert shares[0] == 0 and min(shares[1:]) >= 0.45
    assert peak_bytes <= capacity_bytes
    lru_shares, lru_peak_bytes = figures["LRU"]
    assert max(lru_shares[1:]) < 0.3 and lru_peak_bytes <= capacity_bytes


def test_a_one_time_scan_does_not_evict_the_files_read_every_epoch(tmp_path):
    """A working set read before and after a scan of more files than the cache holds
    (a `find -exec cat`, another data set read once) is still on disk after it."""
    hot = {f"hot/{i:02d}": blob(64 * 1024, i) for i in range(20)}  # 1.25 MiB
    scan = {f"scan/{i:03d}": blob(64 * 1024, 100 + i) for i in range(64)}  # 4 MiB, read once
    shares, peak_bytes = random_epochs(tmp_path / "cache", {**hot, **scan}, 3 * MiB, [list(hot), list(scan), list(hot)])
    assert shares == [0, 0, 1]
    assert peak_bytes <= 3 * MiB


def test_a_new_working_set_takes_the_disk_cache_over_after_a_few_epochs(tmp_path):
    """The resident set is not forever: files left unread while three cache sizes of
    new files were stored give way, and a new data set's epochs then all hit."""
    old = {f"old/{i:02d}": blob(64 * 1024, i) for i in range(40)}  # 2.5 MiB
    new = {f"new/{i:02d}": blob(64 * 1024, 100 + i) for i in range(40)}
    orders = [list(old)] * 2 + [list(new)] * 7
    shares, peak_bytes = random_epochs(tmp_path / "cache", {**old, **new}, 3 * MiB, orders)
    assert shares[:2] == [0, 1]
    assert max(shares[2:4]) < 0.5 and shares[-2:] == [1, 1]
    assert peak_bytes <= 3 * MiB


def test_holds_says_which_parts_of_a_version_are_on_disk_without_a_read(tmp_path):
    """`bucketfs warm` asks before each GET: held parts are skipped, other versions and
    objects with no version never are held, and asking reads nothing."""
    data = blob(200_000, 7)
    backend = MemoryBackend({"k": data})

    async def main():
        async with trio.open_nursery() as nursery:
            stats = Stats()
            cache = DiskCache(backend, str(tmp_path), 1 << 30, 64 * 1024, stats, nursery)
            version = backend._info["k"].version
            before = cache.holds("k", version, 0, 200_000)
            buffer = bytearray(131_072)
            await cache.read_range_into("k", 0, 131_072, version, buffer, object_bytes=200_000)
            answers = (
                before,
                cache.holds("k", version, 0, 131_072),
                cache.holds("k", version, 65_536, 131_072),
                cache.holds("k", version, 0, 200_000),  # (the last chunk is not stored yet)
                cache.holds("k", "another-version", 0, 131_072),
                cache.holds("k", versions.UNPINNED, 0, 131_072),
            )
            await cache.read_range_into("k", 131_072, 200_000, version, buffer, object_bytes=200_000)
            whole = cache.holds("k", version, 0, 200_000)
            reads = stats["disk_cache.hits"] + stats["disk_cache.misses"]
            nursery.cancel_scope.cancel()
        return answers, whole, reads

    answers, whole, reads = trio.run(main)
    assert answers == (False, True, True, False, False, False)
    assert whole
    assert reads == 2  # the two reads' misses: holds() counts none


def _system(tmp_path, cgroup_lines, files, available_kb=8 * 1024 * 1024):
    """A /proc and a /sys/fs/cgroup of this process's, written under tmp_path."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 16000000 kB\nMemAvailable: {available_kb} kB\n")
    (proc / "self" / "cgroup").write_text("".join(line + "\n" for line in cgroup_lines))
    for path, text in files.items():
        target = tmp_path / "cgroup" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return str(proc), str(tmp_path / "cgroup")


def test_available_memory_is_memavailable_or_the_room_left_under_the_tightest_cgroup_limit(tmp_path):
    """Fetch-ahead's default window and the disk cache's read-ahead after a restart take
    a share of this: a container's page cache counts against its memory limit, so the
    host's MemAvailable alone would overshoot it."""
    GiB = 1 << 30
    # No limit anywhere (cgroup v2 "max"): the kernel's MemAvailable.
    unlimited = _system(
        tmp_path / "a", ["0::/pod/daemon"], {"pod/daemon/memory.max": "max", "pod/daemon/memory.current": "5"}
    )
    assert pagecache.available_memory_bytes(*unlimited) == 8 * GiB
    # cgroup v2: the pod's limit, a level above the process's own cgroup, leaves 1 GiB.
    v2 = _system(
        tmp_path / "b",
        ["0::/pod/daemon"],
        {
            "pod/memory.max": str(3 * GiB),
            "pod/memory.current": str(2 * GiB),
            "pod/daemon/memory.max": "max",
            "pod/daemon/memory.current": str(2 * GiB),
        },
    )
    assert pagecache.available_memory_bytes(*v2) == 1 * GiB
    # cgroup v1's memory controller; its "no limit" is a huge number.
    v1 = _system(
        tmp_path / "c",
        ["4:memory:/job", "3:cpuset:/"],
        {
            "memory/job/memory.limit_in_bytes": str(6 * GiB),
            "memory/job/memory.usage_in_bytes": str(2 * GiB),
            "memory/memory.limit_in_bytes": "9223372036854771712",
            "memory/memory.usage_in_bytes": str(9 * GiB),
        },
    )
    assert pagecache.available_memory_bytes(*v1) == 4 * GiB
    # A limit already exceeded leaves nothing; a kernel that says nothing, None.
    over = _system(tmp_path / "d", ["0::/"], {"memory.max": str(GiB), "memory.current": str(2 * GiB)})
    assert pagecache.available_memory_bytes(*over) == 0
    assert pagecache.available_memory_bytes(str(tmp_path / "nowhere"), str(tmp_path / "nowhere")) is None


def test_a_part_dropped_once_its_bytes_are_here_still_stores_them(tmp_path):
    """The read-ahead part whose GET returns just as it is dropped (a warmed head let go,
    a stream closed): trio hands back the GET's bytes, and the store that follows runs
    though its scope is cancelled: the bytes were fetched, and a later mount finds them
    on disk instead of fetching them again."""
    data = blob(200_000, 8)
    backend = MemoryBackend({"k": data})
    inner_read_into = backend.read_range_into

    async def main():
        async with trio.open_nursery() as nursery:
            stats = Stats()
            cache = DiskCache(backend, str(tmp_path), 1 << 30, 64 * 1024, stats, nursery)
            version = backend._info["k"].version
            buffer = bytearray(200_000)
            with trio.CancelScope() as scope:

                async def dropped_as_it_returns(*args, **kwargs):
                    got = await inner_read_into(*args, **kwargs)
                    scope.cancel()  # (the part's drop, with no checkpoint before the store)
                    return got

                backend.read_range_into = dropped_as_it_returns
                await cache.read_range_into("k", 0, 200_000, version, buffer, object_bytes=200_000)
            held = cache.holds("k", version, 0, 200_000)
            nursery.cancel_scope.cancel()
        return held, stats

    held, stats = trio.run(main)
    assert held
    assert stats["disk_cache.written_bytes"] == 200_000
