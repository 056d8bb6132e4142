"""Namespace rules and the listing cache, on the in-memory backend."""

import pytest
import trio
import trio.testing

from bucketfs import errors
from bucketfs.backends.memory import MemoryBackend
from bucketfs.core.namespace import LISTED_ENTRY_BYTES
from tests.unit.helpers import resolve, run_fs


def names(nodes):
    return [(n.name, n.is_dir) for n in nodes]


def test_tree_from_keys_prefixes_and_markers(caplog):
    backend = MemoryBackend(
        {
            "data/a.txt": b"a",
            "data/sub/b.txt": b"bb",
            "data/empty/": b"",
            "data/sub/deeper/c": b"c",
            "other/x": b"x",
            "data/sub/": b"marker bytes",  # a marker with content: the directory wins, and says so
        }
    )

    async def body(fs):
        root = await fs.ns.list_dir(1)
        sub = await resolve(fs, "sub")
        return (
            names(root),
            names(await fs.ns.list_dir(sub.ino)),
            names(await fs.ns.list_dir((await resolve(fs, "empty")).ino)),
        )

    root, sub, empty = run_fs(backend, body, prefix="data")
    assert root == [("a.txt", False), ("empty", True), ("sub", True)]
    assert sub == [("b.txt", False), ("deeper", True)]
    assert empty == []
    assert [r.message for r in caplog.records if "skipping key" in r.message] == [
        "skipping key 'data/sub/': a directory marker holding 12 bytes: not shown"
    ]


def test_listed_file_stat_and_open_cost_no_head():
    backend = MemoryBackend({f"d/f{i}": bytes(i) for i in range(50)})

    async def body(fs):
        for i in range(50):
            node = await resolve(fs, f"d/f{i}")
            assert node.size_bytes == i
            fs.release(await fs.open(node.ino, 0))
        return dict(backend.requests)

    requests = run_fs(backend, body)
    assert requests.get("head", 0) == 0
    assert requests["list"] == 2  # root and d/, each listed once


def test_pagination_lists_every_entry_once_in_order():
    keys = [f"big/{i:05d}" for i in range(2500)]
    backend = MemoryBackend({k: b"" for k in keys}, page_size_count=1000)

    async def body(fs):
        return [n.name for n in await fs.ns.list_dir((await resolve(fs, "big")).ino)]

    listed = run_fs(backend, body)
    assert listed == [k.split("/")[1] for k in keys]
    assert backend.requests["list"] == 1 + 3


def test_invalid_components_are_skipped_and_neighbours_survive(caplog):
    backend = MemoryBackend(
        {
            "ok1": b"1",
            "a//b": b"x",
            "./x": b"x",
            "../y": b"y",
            ("n" * 256): b"long",
            "ok2": b"2",
            "nul\x00name": b"z",
        }
    )

    async def body(fs):
        root = sorted(n.name for n in await fs.ns.list_dir(1))
        # `a//b`: `a` is a real directory; its empty component is what gets skipped.
        inside_a = await fs.ns.list_dir((await fs.lookup(1, "a")).ino)
        await fs.ns.list_dir(1)
        return root, inside_a

    root, inside_a = run_fs(backend, body)
    assert root == ["a", "ok1", "ok2"]
    assert inside_a == []
    assert sum("skipping key" in r.message for r in caplog.records) == 5  # once per key


def test_special_characters_round_trip():
    special = ["sp ace", "per%cent", "pl+us", "ha#sh", "qu?est", "eq=ual", "am&p", "ünï cödé ✓", "日本語"]
    backend = MemoryBackend({f"s/{n}": n.encode() for n in special})

    async def body(fs):
        out = {}
        for n in special:
            node = await resolve(fs, f"s/{n}")
            fh = await fs.open(node.ino, 0)
            out[n] = await fs.read(fh, 0, 1000)
        return out

    assert run_fs(backend, body) == {n: n.encode() for n in special}


def test_file_and_prefix_with_same_name_directory_wins():
    backend = MemoryBackend({"a": b"file", "a/b": b"child"})

    async def body(fs):
        node = await resolve(fs, "a")
        return node.is_dir, names(await fs.ns.list_dir(node.ino))

    assert run_fs(backend, body) == (True, [("b", False)])


def test_negative_lookup_cached_and_concurrent_misses_share_one_list():
    backend = MemoryBackend({"d/x": b"1"}, delay_s=0.05)

    async def body(fs):
        d = await resolve(fs, "d")
        lists_before = backend.requests["list"]
        async with trio.open_nursery() as n:
            for _ in range(20):
                n.start_soon(fs.ns.lookup, d.ino, "x")
        for _ in range(5):
            with pytest.raises(errors.NotFound):
                await fs.lookup(d.ino, "missing")
        return lists_before, backend.requests["list"]

    before, after = run_fs(backend, body, list_ahead_count=0)
    assert after == before + 1  # 20 concurrent lookups share one LIST of d/; 5 misses add none


def test_concurrent_first_listing_is_single_flight():
    backend = MemoryBackend({"d/x": b"1"}, delay_s=0.05)

    async def body(fs):
        await fs.ns.list_dir(1)
        d = await fs.lookup(1, "d")
        async with trio.open_nursery() as n:
            for _ in range(10):
                n.start_soon(fs.ns.list_dir, d.ino)

    run_fs(backend, body, list_ahead_count=0)
    assert backend.requests["list"] == 2


def test_subdirectories_listed_ahead_of_the_walk():
    backend = MemoryBackend({f"c{i:02d}/img{j}.jpg": b"x" for i in range(20) for j in range(3)}, delay_s=0.02)

    async def body(fs):
        classes = await fs.ns.list_dir(1)
        await trio.testing.wait_all_tasks_blocked()
        assert backend.requests["list"] == 1  # listing the root alone lists nothing more
        for c in classes[:2]:  # the walker descends into two classes: it is walking
            await fs.ns.list_dir(c.ino)
        # Let the background listings run, then walk on: every class is already listed.
        with trio.fail_after(10):
            while fs.stats["namespace.listed_ahead"] < 18:
                await trio.sleep(0.01)
        lists = backend.requests["list"]
        for c in classes:
            assert len(await fs.ns.list_dir(c.ino)) == 3
        return lists, backend.requests["list"]

    # A mock clock: the backend's delays and the polling below cost no real time.
    lists_after_ahead, lists_after_walk = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert lists_after_ahead == lists_after_walk == 21


def test_class_tree_is_listed_ahead_from_its_first_class_only():
    """A parent of many subdirectories is walked from the first one on; a parent of a
    few (shards/ beside train/) is not pre-listed when one of them is opened."""
    keys = {f"train/c{i:02d}/img{j}.jpg": b"x" for i in range(12) for j in range(2)}
    keys.update({f"other{i}/f": b"y" for i in range(3)})
    keys.update({f"loose{i}.txt": b"z" for i in range(5)})
    backend = MemoryBackend(keys, delay_s=0.01)

    async def body(fs):
        await fs.ns.list_dir((await fs.lookup(1, "other0")).ino)  # root: 4 dirs, 5 files
        await trio.testing.wait_all_tasks_blocked()
        lists_few = backend.requests["list"]
        train = await fs.lookup(1, "train")
        classes = await fs.ns.list_dir(train.ino)
        await fs.ns.list_dir(classes[0].ino)
        with trio.fail_after(10):
            while fs.stats["namespace.listed_ahead"] < 13:
                await trio.sleep(0.01)
        return lists_few, fs.stats["namespace.listed_ahead"]

    lists_few, ahead = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0))
    assert lists_few == 2  # the root and other0/ only
    # Every class but the one the walker listed itself (11), and other1/ and other2/:
    # train/ was the second subdirectory of the root the walker entered.
    assert ahead == 13


def test_metadata_ttl_gives_a_changed_object_a_new_inode():
    """With a TTL, a re-listing that shows a new version of a name gives it a new inode,
    so the kernel never pairs one version's size with another's bytes; an unchanged
    object and a directory keep theirs. An open of the old inode is ESTALE (the kernel
    then looks the path up again), and the new inode opens and reads the new bytes."""
    backend = MemoryBackend({"d/f": b"one", "d/same": b"s"})

    async def body(fs):
        d = await fs.lookup(1, "d")
        old = await fs.lookup(d.ino, "f")
        same = await fs.lookup(d.ino, "same")
        backend.put("d/f", b"three")
        backend.put("d/g", b"new")
        await trio.sleep(0.2)
        with pytest.raises(errors.ObjectChanged):
            await fs.open(old.ino, 0)  # the listing is re-read at open: this inode is not what is there now
        new = await fs.lookup(d.ino, "f")
        fh = await fs.open(new.ino, 0)
        try:
            data = await fs.read(fh, 0, 100)
        finally:
            fs.release(fh)
        return (
            (await fs.lookup(1, "d")).ino == d.ino,
            (await fs.lookup(d.ino, "same")).ino == same.ino,
            new.ino != old.ino,
            (old.size_bytes, old.version != new.version, new.size_bytes),
            data,
            (await fs.lookup(d.ino, "g")).size_bytes,
        )

    # A mock clock: the TTL expires in virtual time, not by waiting.
    result = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), metadata_ttl_s=0.1)
    assert result == (True, True, True, (3, True, 5), b"three", 3)


def test_ttl_drops_a_vanished_node_once_the_kernel_lets_go():
    """With a TTL, memory follows what is listed: a node whose object left the listing
    is dropped when the kernel holds no reference to it (at the re-listing, or at its
    last FORGET); a listed node never is, and no inode number is reused."""
    backend = MemoryBackend({"d/held": b"1", "d/unseen": b"2", "d/stays": b"3"})

    async def body(fs):
        ns = fs.ns
        d = await fs.lookup(1, "d")
        held, stays, unseen = await ns.list_dir(d.ino)  # listing order
        ns.note_lookup(held)  # the kernel was handed `held` (a lookup or a READDIRPLUS entry)
        ns.note_lookup(held)
        entries_before = ns.entries_count
        backend.delete("d/held")
        backend.delete("d/unseen")
        await trio.sleep(0.2)
        assert [n.name for n in await ns.list_dir(d.ino)] == ["stays"]
        with pytest.raises(errors.NotFound):
            ns.node(unseen.ino)  # no reference: dropped at the re-listing
        assert ns.node(held.ino) is held  # the kernel may still name it
        ns.forget(held.ino, 1)
        assert ns.node(held.ino) is held  # one reference left
        ns.forget(held.ino, 1)
        with pytest.raises(errors.NotFound):
            ns.node(held.ino)
        assert (
            fs.budget.listings_bytes == ns.entries_count * LISTED_ENTRY_BYTES
        )  # a dropped node's memory is given back
        ns.forget(stays.ino, 3)  # more than it was counted: still listed, so kept
        assert ns.node(stays.ino) is stays
        backend.put("d/held", b"again")
        await trio.sleep(0.2)
        again = await fs.lookup(d.ino, "held")
        return (
            entries_before,
            ns.entries_count,
            again.ino != held.ino,
            again.size_bytes,
            fs.stats["namespace.nodes_dropped"],
        )

    assert run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), metadata_ttl_s=0.1) == (
        5,
        4,
        True,
        5,
        2,
    )


def test_ttl_drops_a_vanished_directory_with_its_subtree():
    backend = MemoryBackend({"d/x/held": b"1", "d/x/free": b"2", "d/y": b"3"})

    async def body(fs):
        ns = fs.ns
        d = await fs.lookup(1, "d")
        x = await fs.lookup(d.ino, "x")
        free, held = await ns.list_dir(x.ino)  # listing order
        ns.note_lookup(x)
        ns.note_lookup(held)
        for key in ("d/x/held", "d/x/free"):
            backend.delete(key)
        await trio.sleep(0.2)
        assert [n.name for n in await ns.list_dir(d.ino)] == ["y"]
        alive = [ns.is_live(n) for n in (x, held, free)]  # x is held: its listing stays as it was
        ns.forget(x.ino, 1)  # x goes, and with it `free`; `held` waits for its own FORGET
        after_x = [ns.is_live(n) for n in (x, held, free)]
        ns.forget(held.ino, 1)
        return alive, after_x, ns.is_live(held), ns.entries_count

    result = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), metadata_ttl_s=0.1)
    assert result == ([True, True, True], [False, True, False], False, 3)  # root, d, y


def test_immutable_default_counts_no_lookups():
    backend = MemoryBackend({"f": b"one"})

    async def body(fs):
        return fs.ns.tracks_lookups

    assert run_fs(backend, body) is False


def test_immutable_default_never_relists():
    backend = MemoryBackend({"f": b"one"})

    async def body(fs):
        await fs.lookup(1, "f")
        backend.put("g", b"new")
        with pytest.raises(errors.NotFound):
            await fs.lookup(1, "g")

    run_fs(backend, body)
    assert backend.requests["list"] == 1


def test_listing_error_reaches_every_waiter_then_recovers():
    backend = MemoryBackend({"d/x": b"1"}, delay_s=0.02)
    fail = {"on": True}

    def hook(op, key):
        if op == "list" and fail["on"]:
            raise errors.AccessDenied("denied")

    backend.fail_hook = hook

    async def body(fs):
        results = []

        async def one():
            try:
                await fs.ns.list_dir(1)
                results.append("ok")
            except errors.AccessDenied:
                results.append("denied")

        async with trio.open_nursery() as n:
            for _ in range(3):
                n.start_soon(one)
        fail["on"] = False
        return results, [x.name for x in await fs.ns.list_dir(1)]

    results, listed = run_fs(backend, body)
    assert results == ["denied"] * 3 and listed == ["d"]


def test_walking_one_directory_twice_does_not_list_its_neighbours():
    backend = MemoryBackend(
        {"walked/d1/f": b"1", "walked/d2/f": b"2", "other1/f": b"x", "other2/f": b"x", "other3/f": b"x"}
    )

    async def body(fs):
        await fs.ns.list_dir(1)
        for _ in range(2):  # os.walk(MP/walked), twice
            walked = await fs.lookup(1, "walked")
            for child in await fs.ns.list_dir(walked.ino):
                await fs.ns.list_dir(child.ino)
        await trio.testing.wait_all_tasks_blocked()
        return backend.requests["list"]

    assert run_fs(backend, body) == 4  # root, walked, d1, d2: never other1..3


def test_memory_per_listed_entry_is_bounded():
    """Every listed object stays in memory for the mount's lifetime (an ImageNet is
    1.28M of them), so its cost is a figure users plan with (README).
    The fake backend hands out a fresh ETag string, size and mtime per object and
    page, as a parsed LIST does."""
    import hashlib
    import tracemalloc

    from bucketfs.backends.base import ListPage, ObjectInfo

    dirs_count, files_per_dir = 20, 1000
    backend = MemoryBackend(
        {f"train/n{d:08d}/n{d:08d}_{i:05d}.JPEG": b"" for d in range(dirs_count) for i in range(files_per_dir)}
    )
    list_page = backend.list_page

    async def fresh_page(prefix, token=None):
        page = await list_page(prefix, token)
        fresh = [
            ObjectInfo(o.key, 110_000 + i, 1_700_000_000_123_000_000 + i, hashlib.md5(o.key.encode()).hexdigest())
            for i, o in enumerate(page.objects)
        ]
        return ListPage(fresh, page.prefixes, page.next_token)

    backend.list_page = fresh_page

    async def body(fs):
        train = await resolve(fs, "train")
        tracemalloc.start()
        try:
            for node in await fs.ns.list_dir(train.ino):
                await fs.ns.list_dir(node.ino)
            held_bytes, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert fs.ns.entries_count == 2 + dirs_count + dirs_count * files_per_dir  # root, train/
        return held_bytes / (dirs_count * files_per_dir)

    per_entry_bytes = run_fs(backend, body)
    # ~413 today (Node 120, name, ETag, size, mtime, inode number, table slots); ~516
    # when every file kept its own path string and the inode table was a dict.
    assert per_entry_bytes < 450, per_entry_bytes


def test_at_ttl_zero_concurrent_lookups_still_share_one_listing():
    """A waiter takes the listing it waited for: at --metadata-ttl 0 it is already
    'expired' when it lands, and each waiter once listed again (10 lookups, 10 LISTs)."""
    backend = MemoryBackend({f"d/f{i}": b"x" for i in range(10)}, delay_s=0.01)

    async def body(fs):
        d = await resolve(fs, "d")
        before = backend.requests["list"]
        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(fs.lookup, d.ino, f"f{i}")
        return backend.requests["list"] - before

    assert run_fs(backend, body, metadata_ttl_s=0, list_ahead_count=0) == 1  # real clock: time passes during the LIST


def test_a_negative_ttl_shorter_than_the_metadata_ttl_finds_a_new_name():
    """--metadata-ttl 60 --negative-ttl 1: a name created after a miss is found once the
    negative TTL has passed (the kernel asks again then), from a new listing; within the
    negative TTL a miss costs no LIST."""
    backend = MemoryBackend({"d/a": b"a"})

    async def body(fs):
        d = await resolve(fs, "d")
        with pytest.raises(errors.NotFound):
            await fs.lookup(d.ino, "new")
        lists_before = backend.requests["list"]
        backend.put("d/new", b"n")
        with pytest.raises(errors.NotFound):
            await fs.lookup(d.ino, "new")  # within the negative TTL: the cached listing answers
        assert backend.requests["list"] == lists_before
        await trio.sleep(5)  # past the negative TTL, well within the metadata TTL
        found = await fs.lookup(d.ino, "new")
        assert (await fs.lookup(d.ino, "a")).size_bytes == 1  # a hit never re-lists
        return found.size_bytes, backend.requests["list"] - lists_before

    assert run_fs(
        backend,
        body,
        clock=trio.testing.MockClock(autojump_threshold=0),
        metadata_ttl_s=60,
        negative_ttl_s=1,
        list_ahead_count=0,
    ) == (1, 1)


def test_a_directory_dropped_while_its_listing_is_in_flight_gets_no_children():
    """A directory that vanished (and the kernel let go of) while a listing ahead of the
    walk was fetching its pages: attaching that listing made children nothing could
    reach or ever drop (entries and their memory leaked)."""
    backend = MemoryBackend({"D/x1": b"1", "D/x2": b"2", "E/y": b"3"})
    gate = trio.Event()
    list_page = backend.list_page

    async def gated_list_page(prefix, token=None):
        page = await list_page(prefix, token)
        if prefix == "D/":
            await gate.wait()  # D's LIST has answered; hold it before it is built
        return page

    backend.list_page = gated_list_page

    async def body(fs):
        ns = fs.ns
        await ns.list_dir(1)
        d = await fs.lookup(1, "D")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ns._list_ahead, d)
            await trio.testing.wait_all_tasks_blocked()
            backend.delete("D/x1")
            backend.delete("D/x2")
            await trio.sleep(2)  # past the TTL
            await ns.list_dir(1)  # the root re-listed without D, which nothing holds: dropped
            assert not ns.is_live(d)
            gate.set()
        return ns.entries_count, fs.budget.listings_bytes

    entries, charged_bytes = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), metadata_ttl_s=1)
    assert entries == 2  # the root and E
    assert charged_bytes == 2 * LISTED_ENTRY_BYTES


def test_a_prefix_or_key_repeated_on_a_later_page_is_one_entry():
    """Some servers repeat a common prefix (or a key) on the next LIST page. The entry
    must be listed once, and no second node made for it: nothing could reach or drop it."""
    from bucketfs.backends.base import ListPage

    backend = MemoryBackend({"d/x": b"1", "a": b"22"})
    list_page_once = backend.list_page

    async def list_page(prefix, token=None):
        page = await list_page_once(prefix, None)
        if prefix != "":
            return page
        # The root's one page served as two, each carrying both entries.
        return ListPage(page.objects, page.prefixes, "page-2" if token is None else None)

    backend.list_page = list_page

    async def body(fs):
        root = await fs.ns.list_dir(1)
        return names(root), fs.ns.entries_count

    listed, entries = run_fs(backend, body, list_ahead_count=0)
    assert listed == [("a", False), ("d", True)]
    assert entries == 3  # the root, a and d
