"""Fetch-ahead of a shuffled pass over small files (core/fetchahead.py), on the
in-memory backend with its request counters."""

import random

import pytest
import trio
import trio.testing

from bucketfs.backends import slots
from bucketfs.backends.memory import MemoryBackend
from bucketfs.core import fetchahead
from tests.unit.helpers import read_all, resolve, run_fs

KiB = 1024
MiB = 1024 * KiB
CLASSES_COUNT = 6
FILES_PER_CLASS = 40


def image_folder(file_bytes=8 * KiB, classes=CLASSES_COUNT, per_class=FILES_PER_CLASS, delay_s=0.02):
    rng = random.Random(7)
    objects = {
        f"train/class{c:02d}/img{i:04d}.jpg": rng.randbytes(file_bytes + rng.randrange(1024))
        for c in range(classes)
        for i in range(per_class)
    }
    return objects, MemoryBackend(objects, delay_s=delay_s)


async def read_epoch(fs, paths, workers=8):
    """Read `paths` whole, in this order, with `workers` concurrent readers (each one
    file at a time, as DataLoader workers do); {path: bytes}."""
    out = {}
    queue = iter(paths)

    async def worker():
        for path in queue:
            out[path] = await read_all(fs, path)

    async with trio.open_nursery() as nursery:
        for _ in range(workers):
            nursery.start_soon(worker)
    return out


def shuffled(objects, seed):
    paths = sorted(objects)
    random.Random(seed).shuffle(paths)
    return paths


def test_a_shuffled_pass_fetches_the_rest_of_the_tree_once():
    objects, backend = image_folder()

    async def body(fs):
        got = await read_epoch(fs, shuffled(objects, 1))
        return got, fs.snapshot()

    got, stats = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == objects
    assert stats["fetch_ahead.passes"] == 1
    # Most of the set came from fetch-ahead, and no object cost two GETs.
    assert stats["fetch_ahead.files"] > len(objects) // 2
    assert backend.requests["get"] <= len(objects)
    assert stats["fetch_ahead.used_files"] == stats["fetch_ahead.files"]
    assert stats.get("fetch_ahead.unused_files", 0) == 0


def test_fetch_ahead_makes_a_cold_shuffled_epoch_faster_than_its_readers_alone():
    """8 readers at 20 ms per GET: ~400 files/s alone; with fetch-ahead the epoch's
    time is bound by the detection and one round of GETs in flight."""
    objects, backend = image_folder()

    def epoch_s(mode):
        async def body(fs):
            start_s = trio.current_time()
            await read_epoch(fs, shuffled(objects, 1))
            return trio.current_time() - start_s

        return run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), fetch_ahead=mode)

    assert epoch_s("auto") < epoch_s("off") / 3


def test_a_walk_in_listing_order_does_not_start_a_pass():
    objects, backend = image_folder()

    async def body(fs):
        got = await read_epoch(fs, sorted(objects), workers=8)  # interleaved workers, listing order
        return got, fs.snapshot()

    got, stats = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == objects
    assert stats.get("fetch_ahead.passes", 0) == 0 and stats.get("fetch_ahead.files", 0) == 0
    assert backend.requests["get"] == len(objects)


def test_a_reader_of_a_few_files_or_with_fetch_ahead_off_or_a_ttl_fetches_nothing_ahead():
    objects, backend = image_folder()
    few = shuffled(objects, 2)[: fetchahead.DETECT_WINDOW - 1]
    cases = [
        (few, {}),
        (shuffled(objects, 3), {"fetch_ahead": "off"}),
        (shuffled(objects, 4), {"metadata_ttl_s": 60.0}),
    ]
    for paths, overrides in cases:
        backend.requests.clear()

        async def body(fs, paths=paths):
            got = await read_epoch(fs, paths)
            return got, fs.snapshot()

        got, stats = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), **overrides)
        assert got == {path: objects[path] for path in paths}
        assert stats.get("fetch_ahead.files", 0) == 0, overrides
        assert backend.requests["get"] == len(paths)


def test_held_files_stay_inside_the_room_and_none_is_evicted_before_it_is_read():
    """A data set twice the buffer memory: fetch-ahead runs only as far as the
    loader's reads make room, and everything it fetched is read from memory."""
    objects, backend = image_folder(file_bytes=100 * KiB, per_class=60)  # ~36 MiB
    peaks = []

    async def body(fs):
        async def watch():
            while True:
                peaks.append((fs.cache.held_bytes, fs.fetch_ahead.room_bytes))
                await trio.sleep(0.005)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            got = await read_epoch(fs, shuffled(objects, 5))
            nursery.cancel_scope.cancel()
        return got, fs.snapshot()

    got, stats = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), max_memory_bytes=16 * MiB)
    assert got == objects
    assert stats["fetch_ahead.files"] > 0
    largest_bytes = max(len(data) for data in objects.values())
    assert all(held <= room + largest_bytes for held, room in peaks)
    assert backend.requests["get"] <= len(objects)  # nothing fetched twice: held files were never evicted
    assert stats["fetch_ahead.used_files"] == stats["fetch_ahead.files"]
    assert stats["memory.peak_bytes"] <= stats["memory.budget_bytes"]


def test_the_next_epoch_ends_the_pass_and_costs_no_get_when_everything_fits():
    objects, backend = image_folder()

    async def body(fs):
        await read_epoch(fs, shuffled(objects, 6))
        first_gets = backend.requests["get"]
        for node in [await resolve(fs, path) for path in objects]:
            node.served = False  # as if the kernel dropped its pages: every open reaches the cache
        got = await read_epoch(fs, shuffled(objects, 7))
        return got, first_gets, fs.snapshot()

    got, first_gets, stats = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == objects
    assert backend.requests["get"] == first_gets  # the second epoch: all from the block cache
    assert stats["fetch_ahead.passes"] == 2  # ended by the second epoch's repeated opens, then detected again
    assert stats["fetch_ahead.files"] <= len(objects)


def test_a_pass_whose_loader_stops_lets_go_of_what_it_holds(monkeypatch):
    monkeypatch.setattr(fetchahead, "PASS_IDLE_S", 5.0)  # (the test's whole run has 30 s of trio time)
    objects, backend = image_folder(file_bytes=100 * KiB, per_class=60)

    async def body(fs):
        await read_epoch(fs, shuffled(objects, 8)[:100])
        held_while_running = fs.cache.held_bytes
        await trio.sleep(fetchahead.PASS_IDLE_S + 5)
        return held_while_running, fs.cache.held_bytes, fs.snapshot()

    held_while_running, held_after, stats = run_fs(
        backend, body, clock=trio.testing.MockClock(autojump_threshold=0), max_memory_bytes=16 * MiB
    )
    assert held_while_running > 0
    assert held_after == 0
    assert stats["fetch_ahead.unused_files"] > 0
    assert stats["fetch_ahead.unused_files"] + stats["fetch_ahead.used_files"] == stats["fetch_ahead.files"]


def test_a_failed_fetch_ahead_get_is_fetched_again_by_its_reader():
    """Fetch-ahead GETs of files nobody has opened yet fail; their readers, later,
    fetch them themselves and get the right bytes."""
    objects, backend = image_folder()
    order = shuffled(objects, 10)
    failing = set(order[-40:])
    failed = []

    def fail_once(op, key):
        if op == "get" and key in failing and key not in failed:
            failed.append(key)
            raise OSError("connection reset")

    backend.fail_hook = fail_once

    async def body(fs):
        got = await read_epoch(fs, order[:100])
        await trio.testing.wait_all_tasks_blocked()  # the walk has reached every file
        got.update(await read_epoch(fs, order[100:]))
        return got, fs.snapshot()

    got, stats = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == objects
    assert sorted(failed) == sorted(failing)
    assert stats["fetch_ahead.failed"] == len(failing)
    assert backend.requests["get"] == len(objects) + len(failing)


def test_fetch_ahead_calls_take_their_own_slots_and_never_delay_a_reader():
    """Two shared slots, both held by readers, and a pool of three for fetch-ahead:
    three fetch-ahead calls start at once; a fourth waits in the shared pool as
    read-ahead does, and an urgent call that arrives after it gets the next shared
    slot that frees."""

    class Ticket:
        own_slots = True
        urgent = False
        in_own_slot = False

    pool = slots.PrioritySlots(2, fetch_ahead_count=3)
    entered = []
    releases: dict = {}

    async def call(name, ticket=None, task_status=trio.TASK_STATUS_IGNORED):
        if ticket is not None:
            slots.mark_speculative(ticket)
        releases[name] = trio.Event()
        task_status.started()
        async with pool:
            entered.append(name)
            await releases[name].wait()

    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for name in ("reader1", "reader2"):
                    await nursery.start(call, name)
                for i in range(4):
                    await nursery.start(call, f"ahead{i}", Ticket())
                await trio.testing.wait_all_tasks_blocked()
                assert entered == ["reader1", "reader2", "ahead0", "ahead1", "ahead2"]
                assert pool.fetch_ahead_busy_count == 3 and pool.busy_count == 2
                await nursery.start(call, "reader3")
                await trio.testing.wait_all_tasks_blocked()  # reader3 queued behind ahead3
                releases["ahead0"].set()  # a fetch-ahead slot frees: nobody waiting takes it
                await trio.testing.wait_all_tasks_blocked()
                assert entered[5:] == [] and pool.fetch_ahead_busy_count == 2
                releases["reader1"].set()  # a shared slot frees: the reader goes first
                await trio.testing.wait_all_tasks_blocked()
                assert entered[5:] == ["reader3"]
                for event in releases.values():
                    event.set()
        assert entered[6:] == ["ahead3"]
        assert pool.busy_count == 0 and pool.fetch_ahead_busy_count == 0

    trio.run(main)


def test_files_the_kernel_dropped_are_fetched_ahead_again_and_files_it_keeps_are_not():
    """Epoch 2 over files served whole in epoch 1. When their READs reach the daemon
    (the kernel dropped its pages: a data set larger than the page cache), the pass
    fetches them ahead; when opens find them in the kernel (no READ), it fetches
    nothing."""
    objects, backend = image_folder(file_bytes=100 * KiB, per_class=60)  # ~36 MiB, twice the room

    async def open_only(fs, paths):
        for path in paths:  # the kernel's page cache answers: open and release, no READ
            fs.release(await fs.open((await resolve(fs, path)).ino, 0))

    def second_epoch(kernel_dropped):
        async def body(fs):
            await read_epoch(fs, shuffled(objects, 11))
            first = fs.snapshot()["fetch_ahead.files"]
            gets_before = backend.requests["get"]
            if kernel_dropped:
                got = await read_epoch(fs, shuffled(objects, 12))
                assert got == objects
            else:
                await open_only(fs, shuffled(objects, 12))
            return fs.snapshot()["fetch_ahead.files"] - first, backend.requests["get"] - gets_before

        backend.requests.clear()
        return run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), max_memory_bytes=16 * MiB)

    fetched_ahead, gets = second_epoch(kernel_dropped=True)
    assert fetched_ahead > len(objects) // 4 and gets <= len(objects)
    fetched_ahead, gets = second_epoch(kernel_dropped=False)
    assert fetched_ahead == 0 and gets == 0


def test_fetch_ahead_makes_room_with_files_its_pass_has_read_never_with_those_it_has_yet_to_read():
    """A data set a little larger than the memory for buffers, read once, then a
    second shuffled pass with the kernel's pages gone: the files the block cache still
    holds are read from it, and only those it lacks are fetched (each once): the room
    fetch-ahead needs comes from files this pass has read."""
    objects, backend = image_folder(file_bytes=100 * KiB, per_class=60)  # ~36 MiB

    async def body(fs):
        await read_epoch(fs, shuffled(objects, 13))
        nodes = {path: await resolve(fs, path) for path in objects}
        lacking = [p for p in objects if not fs.cache.holds(fs.key_prefix + nodes[p].path, nodes[p].version, 0)]
        for node in nodes.values():
            node.served = False  # the kernel dropped its pages: every open reaches the cache
        gets_before = backend.requests["get"]
        got = await read_epoch(fs, shuffled(objects, 14))
        return got, lacking, backend.requests["get"] - gets_before, fs.snapshot()

    got, lacking, gets, stats = run_fs(
        backend, body, clock=trio.testing.MockClock(autojump_threshold=0), max_memory_bytes=32 * MiB
    )
    assert got == objects
    assert 0 < len(lacking) < len(objects) // 2
    assert stats["fetch_ahead.passes"] == 2 and stats["fetch_ahead.files"] > 0
    # A few more than lacking: a reader's own misses reclaim memory by the cache's policy.
    # (Taking fetch-ahead's room by that policy too: 213 GETs for 77 files lacking.)
    assert gets <= len(lacking) * 1.25


def test_a_loader_reading_one_share_per_epoch_gets_no_pass_after_its_first_epoch():
    """One node of four under a DistributedSampler: each epoch opens a different
    quarter of the tree. The first epoch looks like a shuffled pass (its waste is
    bounded by the room); when the second begins, the mount sees the first opened a
    quarter of the tree, and fetches nothing ahead there any more."""
    objects, backend = image_folder()
    order = shuffled(objects, 15)
    quarter = len(order) // 4

    async def body(fs):
        await read_epoch(fs, order[:quarter])
        first = fs.snapshot()
        for node in [await resolve(fs, path) for path in objects]:
            node.served = False
        gets_before = backend.requests["get"]
        second_share = shuffled(objects, 16)[:quarter]
        got = await read_epoch(fs, second_share)
        assert got == {path: objects[path] for path in second_share}
        return first, fs.snapshot(), backend.requests["get"] - gets_before

    first, after, _gets = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert first["fetch_ahead.passes"] == 1 and first["fetch_ahead.files"] > 0
    assert after["fetch_ahead.passes"] == 1
    assert after["fetch_ahead.files"] == first["fetch_ahead.files"]
    assert after.get("fetch_ahead.partial_passes_skipped", 0) >= 1


def test_one_share_of_a_tree_larger_than_the_room_is_told_by_what_the_pass_still_holds():
    """The same node's share, on a tree whose walk stops at a room full of files the
    node never opens: the held files tell the share when the next epoch begins."""
    objects, backend = image_folder(file_bytes=100 * KiB, per_class=60)  # ~36 MiB, the room 8 MiB
    order = shuffled(objects, 17)
    quarter = len(order) // 4

    async def body(fs):
        await read_epoch(fs, order[:quarter])
        first = fs.snapshot()
        assert not fs.fetch_ahead._pass.walked  # (the room stopped the walk)
        second_share = shuffled(objects, 18)[:quarter]
        got = await read_epoch(fs, second_share)
        assert got == {path: objects[path] for path in second_share}
        return first, fs.snapshot()

    first, after = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), max_memory_bytes=16 * MiB)
    assert first["fetch_ahead.passes"] == 1 and first["fetch_ahead.files"] > 0
    assert after["fetch_ahead.passes"] == 1
    assert after["fetch_ahead.files"] == first["fetch_ahead.files"]


def test_fetch_ahead_runs_no_faster_than_the_disk_cache_stores(tmp_path, monkeypatch):
    """A store far faster than the disk (in memory, 2 ms a GET, against real writes)
    and a small queue of writes: a pass fetches the tree no faster than the disk cache
    stores it, so nothing it fetched is left unstored, and a new mount on the cache
    reads the epoch with no GET."""
    from bucketfs.core.filesystem import Filesystem
    from bucketfs.diskcache import cache as disk_cache
    from tests.unit.helpers import make_config

    monkeypatch.setattr(disk_cache, "PENDING_WRITES_MAX_BYTES", 1 * MiB)
    objects, backend = image_folder(file_bytes=60 * KiB, delay_s=0.002)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()

    def mount(body):
        async def main():
            async with trio.open_nursery() as nursery:
                fs = Filesystem(backend, make_config(), nursery, str(cache_dir))
                with trio.fail_after(60):
                    result = await body(fs)
                    await fs.finish_writes()
                nursery.cancel_scope.cancel()
            return result

        return trio.run(main)  # (real time: the disk's writes run on real threads)

    async def first(fs):
        order = shuffled(objects, 19)
        got = await read_epoch(fs, order[:40], workers=1)  # (one reader: few stores of its own)
        while not fs.fetch_ahead._pass.walked or fs.fetch_ahead._in_flight_count:
            await trio.sleep(0.01)  # (a condition polled, under fail_after)
        got.update(await read_epoch(fs, order[40:]))
        return got, fs.snapshot()

    got, stats = mount(first)
    assert got == objects
    assert stats.get("disk_cache.skipped_stores", 0) == 0
    assert stats["fetch_ahead.files"] >= len(objects) - 40 and stats["fetch_ahead.disk_waits"] > 0

    backend.requests.clear()
    got = mount(lambda fs: read_epoch(fs, shuffled(objects, 20)))
    assert got == objects
    assert backend.requests["get"] == 0


# -- into the kernel's page cache (--fetch-ahead-workers: MemoryBackend's fake kernel) ---
async def kernel_read(fs, backend, path: str) -> bytes:
    """A loader's read as the kernel serves it: from the page cache if a push put the
    file there (the daemon hears one GETATTR if the push ended its cached attributes),
    else through the daemon's READs."""
    node = await resolve(fs, path)
    pages = backend.kernel_pages.get(node.ino)
    if pages is not None:
        if node.ino in backend.attributes_ended:
            backend.attributes_ended.discard(node.ino)
            await fs.getattr(node.ino)  # (stat() asks)
        return pages
    return await read_all(fs, path)


async def pushed_epoch(fs, backend, objects, seed, workers=8, listed=True, list_to_kernel=None):
    fs.start_pushing(-1, list_to_kernel)
    if listed:
        for directory in sorted({path.rsplit("/", 1)[0] for path in objects}):
            fs.note_listed_to_kernel(await resolve(fs, directory))
    out = {}
    queue = iter(shuffled(objects, seed))

    async def worker():
        for path in queue:
            out[path] = await kernel_read(fs, backend, path)

    async with trio.open_nursery() as nursery:
        for _ in range(workers):
            nursery.start_soon(worker)
    return out


async def end_the_pass(fs, objects) -> None:
    """The next epoch's first opens, through the daemon (as if the kernel had dropped
    the pages): the first of a file whose open the pass heard of ends it."""
    for path in sorted(objects):
        if fs.fetch_ahead._pass is None:
            return
        await read_all(fs, path)


@pytest.mark.parametrize("pushes_soon", [True, False], ids=["no-task-per-push", "a-task-per-push"])
def test_a_pushed_pass_puts_most_files_into_the_page_cache_each_fetched_once(pushes_soon):
    objects, backend = image_folder()
    backend.pushes_soon = pushes_soon  # (False: the backend's workers are not running yet)
    getattrs = []

    async def body(fs):
        getattr_of = fs.getattr

        async def counted_getattr(ino):
            getattrs.append(ino)
            return await getattr_of(ino)

        fs.getattr = counted_getattr
        got = await pushed_epoch(fs, backend, objects, seed=1)
        epoch, gets = fs.snapshot(), backend.requests["get"]
        await end_the_pass(fs, objects)
        return got, epoch, gets, fs.snapshot()

    got, stats, gets, ended = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == objects
    assert stats["fetch_ahead.passes"] == 1
    pushed = stats.get("fetch_ahead.push_pushed", 0)
    assert pushed > len(objects) // 2, stats
    assert len(backend.kernel_pages) == pushed
    # No object cost two GETs: the READs of a file whose push was running took its body.
    assert gets <= len(objects)
    assert stats.get("fetch_ahead.failed", 0) == 0
    # Few pushes cost their reader's stat() a GETATTR; the rest nothing.
    told = stats["fetch_ahead.push_told"]
    assert 0 < told <= stats["fetch_ahead.files"] // 8 + 1, stats
    assert len([ino for ino in getattrs if ino in backend.kernel_pages]) <= told  # (not the walks' of the root)
    # The pushed files' bytes never went through the daemon's memory.
    assert stats["cache.fetched_bytes"] <= sum(map(len, objects.values())) - pushed * 8 * KiB
    # Every told file was opened: so, the pass counts, were the others.
    assert ended["fetch_ahead.used_files"] == ended["fetch_ahead.files"], ended
    assert ended.get("fetch_ahead.unused_files", 0) == 0, ended


@pytest.mark.parametrize("pushes_soon", [True, False], ids=["no-task-per-push", "a-task-per-push"])
def test_a_read_that_comes_while_its_file_is_pushed_gets_the_pushed_body(pushes_soon):
    objects, backend = image_folder(delay_s=0.05)
    backend.pushes_soon = pushes_soon

    async def body(fs):
        fs.start_pushing(-1)
        fs.note_listed_to_kernel(await resolve(fs, "train/class00"))
        node = await resolve(fs, "train/class00/img0000.jpg")
        outcomes = []
        flight = fs.cache.push_ahead(
            fs.key_prefix + node.path, node.version, node.size_bytes, node.ino, True, outcomes.append
        )
        assert flight is not None
        data = await read_all(fs, "train/class00/img0000.jpg")  # (the push's GET is still running)
        await flight.done.wait()
        return data, flight.outcome, outcomes, node.ino

    data, outcome, outcomes, ino = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert data == objects["train/class00/img0000.jpg"]
    assert outcome == "read"
    assert outcomes == ["read"]  # (told once, with the flight's outcome)
    assert ino not in backend.kernel_pages
    assert backend.requests["get"] == 1


@pytest.mark.parametrize("outcome", ["read", "refused", "failed"])
def test_a_small_file_opened_where_workers_push_is_fetched_through_one_and_not_pushed(outcome):
    """No pass runs: the open's fetch goes to a worker whose body comes back for the
    READs (never into the kernel); a push refused or failed leaves the READs to fetch it."""
    objects, backend = image_folder()
    path = "train/class01/img0003.jpg"
    pushed_by_the_store = backend.push_whole
    wanted = []

    async def push_whole(key, version, size_bytes, ino, request):
        wanted.append(request.wanted)
        if outcome != "read":
            await trio.sleep(backend.delay_s)
            return outcome, None
        return await pushed_by_the_store(key, version, size_bytes, ino, request)

    backend.push_whole = push_whole

    async def body(fs):
        fs.start_pushing(-1)
        fs.note_listed_to_kernel(await resolve(fs, "train/class01"))
        data = await read_all(fs, path)
        return data, fs.snapshot(), (await resolve(fs, path)).ino

    data, stats, ino = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert data == objects[path]
    assert wanted == [True]  # (asked for the body before the worker had it)
    assert stats[f"open.worker_{outcome}"] == 1
    assert ino not in backend.kernel_pages
    assert stats.get("fetch_ahead.passes", 0) == 0
    # Fetched once: by the worker, or (this fake's refused and failed pushes GET nothing) by the READs.
    assert backend.requests["get"] == 1


def test_a_read_by_inode_of_a_file_the_kernel_dropped_is_fetched_through_a_worker():
    """Served whole before (the kernel held it), READ again (it dropped the pages), no
    kept copy: the READ's file comes through a worker, not a GET of the daemon's, and
    counts as a file the kernel dropped (as the daemon's own GET of it would: the
    tests that allow such GETs, and fetch-ahead's note_kernel_miss, go by it)."""
    objects, backend = image_folder()
    path = "train/class01/img0003.jpg"

    async def body(fs):
        fs.start_pushing(-1)
        backend.keeps = False
        first = await read_all(fs, path)
        node = await resolve(fs, path)
        assert node.served
        # (Nor does the daemon hold it any more.)
        assert fs.cache.drop_read(fs.key_prefix + node.path, node.version, node.size_bytes) is not None
        gets_before = backend.requests["get"]
        data, off = bytearray(), 0
        while chunk := await fs.read_inode(node.ino, off, 64 * KiB):
            data += chunk
            off += len(chunk)
        return first, bytes(data), fs.snapshot(), backend.requests["get"] - gets_before

    first, data, stats, gets = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert first == data == objects[path]
    assert stats["open.worker_read"] == 2
    assert gets == 1
    assert stats["read.kernel_dropped_gets"] == 1


@pytest.mark.parametrize("pushing", [False, True], ids=["no-fetch-ahead-workers", "with-fetch-workers"])
def test_without_workers_or_with_fetch_workers_an_opened_small_file_is_fetched_by_the_daemon(pushing):
    """No fetch-ahead workers: the daemon's GET. --fetch-workers: the daemon's GET too,
    which runs in those workers."""
    objects, backend = image_folder()
    path = "train/class01/img0003.jpg"

    async def body(fs):
        if pushing:
            fs.start_pushing(-1)
        return await read_all(fs, path), fs.snapshot()

    overrides = {"fetch_workers_count": 2} if pushing else {}
    data, stats = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), **overrides)
    assert data == objects[path]
    assert not [name for name in stats if name.startswith("open.worker_")]
    assert backend.requests["get"] == 1


def test_a_refused_or_failed_push_leaves_the_file_to_its_reader():
    objects, backend = image_folder()
    unlucky = sorted(objects)[::3]
    pushed_by_the_store = backend.push_whole

    async def push_whole(key, version, size_bytes, ino, request):
        if key in unlucky:  # (a wrong MD5, or a reset: the worker gives up on it)
            await trio.sleep(backend.delay_s)
            return ("refused" if len(key) % 2 else "failed"), None
        return await pushed_by_the_store(key, version, size_bytes, ino, request)

    backend.push_whole = push_whole

    async def body(fs):
        got = await pushed_epoch(fs, backend, objects, seed=2)
        return got, fs.snapshot()

    got, stats = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == objects
    not_pushed = stats.get("fetch_ahead.push_refused", 0) + stats.get("fetch_ahead.push_failed", 0)
    assert not_pushed > 0, stats
    # Counted failed unless its reader had opened it by then (it read it itself anyway).
    assert 0 < stats["fetch_ahead.failed"] <= not_pushed


def test_files_of_directories_the_kernel_never_listed_are_fetched_into_memory():
    """A loader that opens paths it never listed: the kernel holds none of their inodes,
    so a push would be refused and its GET wasted."""
    objects, backend = image_folder()

    async def body(fs):
        got = await pushed_epoch(fs, backend, objects, seed=3, listed=False)
        return got, fs.snapshot()

    got, stats = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == objects
    assert stats["fetch_ahead.files"] > len(objects) // 2
    assert not backend.kernel_pages
    assert stats.get("fetch_ahead.push_pushed", 0) == 0
    assert backend.requests["get"] <= len(objects)


def test_directories_the_kernel_never_listed_are_listed_through_the_mount_and_their_files_pushed():
    objects, backend = image_folder()
    listed = []

    async def body(fs):
        def list_to_kernel(directory):  # (on a thread, as the mount's own listing is)
            listed.append(directory.path)
            trio.from_thread.run_sync(fs.note_listed_to_kernel, directory)  # (its READDIRPLUS, read to the end)

        got = await pushed_epoch(fs, backend, objects, seed=3, listed=False, list_to_kernel=list_to_kernel)
        return got, fs.snapshot()

    got, stats = run_fs(backend, body)  # (real time: the listing runs on a thread)
    assert got == objects
    assert sorted(p.rstrip("/") for p in listed) == sorted(
        {path.rsplit("/", 1)[0] for path in objects}
    )  # (not the root)
    assert stats["fetch_ahead.dirs_listed_to_kernel"] == len(listed)
    assert stats.get("fetch_ahead.push_pushed", 0) > len(objects) // 2, stats
    assert backend.requests["get"] <= len(objects)


def test_a_pass_stops_pushing_once_the_kernel_has_dropped_most_inodes():
    objects, backend = image_folder()

    async def body(fs):
        fs.start_pushing(-1)
        backend.kernel_inodes = set()  # (evicted: every push is refused with ENOENT)
        for directory in sorted({path.rsplit("/", 1)[0] for path in objects}):
            fs.note_listed_to_kernel(await resolve(fs, directory))
        got = {}
        for path in shuffled(objects, 4):
            got[path] = await kernel_read(fs, backend, path)
        return got, fs.snapshot()

    got, stats = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == objects
    no_inode = stats.get("fetch_ahead.push_no_inode", 0)
    assert fetchahead.PUSH_NO_INODE_MAX < no_inode <= fetchahead.PUSH_OUTCOMES_KEPT + 256, stats
    # The rest of the pass went into memory: most files were fetched ahead all the same.
    assert stats["fetch_ahead.files"] - no_inode > len(objects) // 3, stats


def test_after_the_kernel_dropped_the_pushed_files_the_next_epoch_pushes_them_again(monkeypatch):
    """The page cache dropped (memory pressure, drop_caches), and the daemon kept no
    copies: the next epoch's READs of pushed files are opens of a new epoch, which end
    the pass; the next pass pushes them again, rather than leaving each to its reader,
    one GET at a time."""
    objects, backend = image_folder()
    start_pushing = backend.start_pushing
    monkeypatch.setattr(
        backend, "start_pushing", lambda fd, workers, transfers, keep: start_pushing(fd, workers, transfers)
    )

    async def body(fs):
        await pushed_epoch(fs, backend, objects, seed=5)
        first = fs.snapshot()
        backend.kernel_pages.clear()
        await trio.sleep(2 * fetchahead.SAME_OPEN_S)  # (an epoch's length, at least)
        out = {}
        queue = iter(shuffled(objects, 6))

        async def worker():
            for path in queue:
                out[path] = await kernel_read(fs, backend, path)

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(worker)
        return out, first, fs.snapshot()

    got, first, second = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == objects
    assert second["fetch_ahead.passes"] == 2, second
    assert second["fetch_ahead.push_pushed"] - first["fetch_ahead.push_pushed"] > len(objects) // 2, second


def test_after_the_kernel_dropped_the_pushed_files_the_next_epoch_reads_the_kept_copies():
    """The daemon kept a copy of each pushed file (within its budget): once the page
    cache is dropped, the next epoch's READs are served from those copies, no GET."""
    objects, backend = image_folder()

    async def body(fs):
        await pushed_epoch(fs, backend, objects, seed=5)
        first = fs.snapshot()
        backend.kernel_pages.clear()
        await trio.sleep(2 * fetchahead.SAME_OPEN_S)
        gets_before = backend.requests["get"]
        out = {}
        for path in shuffled(objects, 6):
            out[path] = await kernel_read(fs, backend, path)
        return out, first, fs.snapshot(), backend.requests["get"] - gets_before

    got, first, second, gets = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == objects
    assert first["fetch_ahead.kept_files"] >= first["fetch_ahead.push_pushed"] > len(objects) // 2, first
    assert second["fetch_ahead.kept_read"] == first["fetch_ahead.kept_files"], second
    assert gets == 0, second  # (the files read through the daemon are in its block cache)
    assert second["fetch_ahead.kept_bytes"] == first["fetch_ahead.kept_bytes"] > 0, second  # (kept for the next)


def test_kept_copies_give_way_to_memory_anyone_else_needs():
    """Kept copies fill what the budget leaves free, and are the first memory a reader
    or a push takes back: the budget never overflows for them and nothing stays reserved."""
    objects, backend = image_folder()

    async def body(fs):
        await pushed_epoch(fs, backend, objects, seed=5)
        kept_bytes = fs.cache.kept.kept_bytes
        used_bytes = fs.budget.used_bytes
        await fs.budget.reserve(fs.budget.capacity_bytes)  # (a demand for all of it)
        after = fs.snapshot()
        after["all taken"] = fs.budget.used_bytes == fs.budget.capacity_bytes
        fs.budget.release(fs.budget.capacity_bytes)
        return kept_bytes, used_bytes, after

    kept_bytes, used_bytes, after = run_fs(
        backend, body, clock=trio.testing.MockClock(autojump_threshold=0), max_memory_bytes=64 * MiB
    )
    assert 0 < kept_bytes <= used_bytes, (kept_bytes, used_bytes)
    assert after["fetch_ahead.kept_bytes"] == 0, after
    assert after["all taken"], after


def test_a_readers_push_takes_free_memory_only_never_a_kept_copy():
    """After the page cache was dropped the loader reads the kept copies next: a file
    fetched for a reader through a worker must not drop them (a pass's push may)."""
    objects, backend = image_folder(file_bytes=256 * KiB)  # (more than the memory keeps)

    async def body(fs):
        await pushed_epoch(fs, backend, objects, seed=6)
        kept = fs.cache.kept
        nodes = [await resolve(fs, path) for path in sorted(objects)]
        lacking = [
            node
            for node in nodes
            if (fs.key_prefix + node.path, node.version) not in kept
            and not fs.cache.holds(fs.key_prefix + node.path, node.version, 0)
        ]
        assert len(kept) and len(lacking) >= 2, (len(kept), len(lacking))
        room_bytes = fs.budget.prefetch_room_bytes
        assert fs.budget.try_reserve(room_bytes)  # (no free memory left)
        kept_before = len(kept)
        reader, walker = lacking[:2]
        for_reader = fs.cache.push_ahead(
            fs.key_prefix + reader.path, reader.version, reader.size_bytes, reader.ino, False, lambda _: None, True
        )
        kept_after_reader = len(kept)
        for_pass = fs.cache.push_ahead(
            fs.key_prefix + walker.path, walker.version, walker.size_bytes, walker.ino, False, lambda _: None
        )
        kept_after_pass = len(kept)
        if for_pass is not None:
            await for_pass.done.wait()
        fs.budget.release(room_bytes)
        return for_reader, kept_before, kept_after_reader, for_pass, kept_after_pass, fs.snapshot()

    for_reader, before, after_reader, for_pass, after_pass, stats = run_fs(
        backend, body, clock=trio.testing.MockClock(autojump_threshold=0), max_memory_bytes=64 * MiB
    )
    assert for_reader is None and after_reader == before  # (its READ fetches it instead)
    assert stats["open.worker_memory_refused"] == 1
    assert for_pass is not None and after_pass < before


def test_pushed_files_not_yet_read_stay_about_inside_the_window_though_few_opens_are_told(monkeypatch):
    """The pass hears of one pushed file's open in several (TELL_OPEN_EVERY_MAX): its
    estimate of what the kernel holds unread keeps the real amount near the window
    (--fetch-ahead-window), and the counts it makes when the loader stops are near the
    truth."""
    monkeypatch.setattr(fetchahead, "PASS_IDLE_S", 5.0)  # (the test's whole run has 30 s of trio time)
    objects, backend = image_folder(file_bytes=100 * KiB, per_class=170)  # ~100 MiB: 3 rooms
    read_paths: set = set()
    peaks = []

    async def body(fs):
        async def watch():
            while True:
                unread = [len(data) for ino, data in backend.kernel_pages.items() if ino not in read_inos]
                peaks.append(sum(unread))
                await trio.sleep(0.005)

        read_inos = set()

        async def counted(path):
            read_inos.add((await resolve(fs, path)).ino)
            read_paths.add(path)

        fs.start_pushing(-1)
        for directory in sorted({path.rsplit("/", 1)[0] for path in objects}):
            fs.note_listed_to_kernel(await resolve(fs, directory))
        order = shuffled(objects, 21)[:700]
        got = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            for path in order:
                await counted(path)
                got[path] = await kernel_read(fs, backend, path)
                await trio.sleep(0.002)  # (a loader slower than the store: the room is what bounds the pass)
            nursery.cancel_scope.cancel()
        unread_pushed = sum(1 for ino in backend.kernel_pages if ino not in read_inos)
        await trio.sleep(fetchahead.PASS_IDLE_S + 1)  # (the loader stopped: the pass goes idle)
        return got, unread_pushed, fs.snapshot()

    clock = trio.testing.MockClock(autojump_threshold=0)
    window_bytes = 32 * MiB
    got, unread_pushed, stats = run_fs(
        backend, body, clock=clock, max_memory_bytes=64 * MiB, fetch_ahead_window_bytes=window_bytes
    )
    assert got == {path: objects[path] for path in read_paths}
    assert stats["fetch_ahead.push_told"] * 4 <= stats["fetch_ahead.push_pushed"], stats
    largest_bytes = max(len(data) for data in objects.values())
    assert window_bytes / 2 <= max(peaks) <= 1.25 * window_bytes + largest_bytes, max(peaks) / window_bytes
    assert stats["fetch_ahead.unused_files"] + stats["fetch_ahead.used_files"] == stats["fetch_ahead.files"]
    assert abs(stats["fetch_ahead.unused_files"] - unread_pushed) <= max(8, unread_pushed // 4), (unread_pushed, stats)


def _unread_pushed_peak(objects, backend, paths, monkeypatch, available_bytes):
    """Read `paths` (a loader slower than the store) on a mount whose kernel reports
    `available_bytes` available; (the most pushed bytes held unread, the room, the
    default window)."""
    monkeypatch.setattr(fetchahead, "available_memory_bytes", lambda: available_bytes)
    peaks = [0]

    async def body(fs):
        read_inos: set = set()

        async def watch():
            while True:
                peaks.append(sum(len(data) for ino, data in backend.kernel_pages.items() if ino not in read_inos))
                await trio.sleep(0.005)

        fs.start_pushing(-1)
        for directory in sorted({path.rsplit("/", 1)[0] for path in objects}):
            fs.note_listed_to_kernel(await resolve(fs, directory))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            for path in paths:
                read_inos.add((await resolve(fs, path)).ino)
                assert await kernel_read(fs, backend, path) == objects[path]
                await trio.sleep(0.004)
            nursery.cancel_scope.cancel()
        assert fs.snapshot()["fetch_ahead.window_bytes"] == fs.fetch_ahead._window_bytes()  # (the stats say it)
        return fs.fetch_ahead.room_bytes, fs.fetch_ahead._window_bytes()

    room_bytes, window_bytes = run_fs(
        backend, body, clock=trio.testing.MockClock(autojump_threshold=0), max_memory_bytes=64 * MiB
    )
    return max(peaks), room_bytes, window_bytes


def test_a_loader_of_the_whole_tree_gets_pushes_past_the_room_within_a_quarter_of_the_memory_available(monkeypatch):
    """Pushed files wait in the kernel's page cache, not in the daemon's budget: past
    the room (half the budget for buffers), up to a quarter of MemAvailable when the
    pass starts."""
    objects, backend = image_folder(file_bytes=100 * KiB, per_class=170)  # ~135 MiB
    peak_bytes, room_bytes, window_bytes = _unread_pushed_peak(
        objects, backend, shuffled(objects, 3), monkeypatch, 240 * MiB
    )
    assert window_bytes == 60 * MiB
    # (What the pass counts unread is told by one push in several: the other test's slack.)
    assert room_bytes * 1.25 < peak_bytes <= 1.25 * window_bytes + 101 * KiB, (room_bytes, peak_bytes)


def test_the_window_is_the_room_where_the_kernel_says_nothing_of_its_memory(monkeypatch):
    monkeypatch.setattr(fetchahead, "available_memory_bytes", lambda: None)
    objects, backend = image_folder()

    async def body(fs):
        return fs.fetch_ahead._window_bytes(), fs.fetch_ahead.room_bytes

    window_bytes, room_bytes = run_fs(backend, body)
    assert window_bytes == room_bytes
