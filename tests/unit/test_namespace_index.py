"""The namespace from a listing index (`bucketfs mount --index`), on the in-memory
backend: every listing as a LIST would give it, with no LIST; reads pinned to the
versions the index names; with a TTL, listings from the index count as loaded at
the start and are listed again once older; the budget charged for what it holds."""

from __future__ import annotations

import trio
import trio.testing

from bucketfs import errors
from bucketfs.backends.memory import MemoryBackend
from bucketfs.core.listing_index import decode_index, encode_index
from bucketfs.core.namespace import LISTED_ENTRY_BYTES, ROOT_INO
from tests.unit.helpers import make_config

PREFIX = "data/"


def _backend() -> MemoryBackend:
    objects = {
        "data/a.txt": b"alpha",
        "data/empty/": b"",  # a marker: an empty directory
        "data/sub/": b"",
        "data/sub/b.bin": b"\x00" * 300,
        "data/sub/deeper/c": b"c",
        "data/both": b"a file and a directory of one name: the directory wins",
        "data/both/x": b"x",
        "data/a//b": b"an empty component: left out",
        "data/" + "n" * 300: b"a name too long: left out",
        "data/ünï/日本": b"unicode",
        "other/not-mounted": b"o",
    }
    objects.update({f"data/many/{i:04d}.jpg": bytes([i % 256]) * (i % 50) for i in range(2500)})
    return MemoryBackend(objects, page_size_count=100)


def _index_of(backend: MemoryBackend, url: str = f"s3://test-bucket/{PREFIX}"):
    entries = [
        (key[len(PREFIX) :], info.size_bytes, info.mtime_ns, info.version)
        for key, info in backend._info.items()
        if key.startswith(PREFIX)
    ]
    return decode_index(encode_index(url, entries, 1_795_000_000 * 10**9), expected_url=url)


def _run(backend, body, index=None, clock=None, **overrides):
    config = make_config(PREFIX, **overrides)

    async def main():
        from bucketfs.core.filesystem import Filesystem

        async with trio.open_nursery() as nursery:
            fs = Filesystem(backend, config, nursery, listing_index=index)
            with trio.fail_after(60):
                result = await body(fs)
            nursery.cancel_scope.cancel()
        return result

    return trio.run(main, clock=clock)


async def _walk(fs, ino: int = ROOT_INO, path: str = "") -> list:
    out = []
    for node in await fs.ns.list_dir(ino):
        out.append(
            (path + node.name, node.is_dir, node.size_bytes, node.mtime_ns if not node.is_dir else 0, node.version)
        )
        if node.is_dir:
            out += await _walk(fs, node.ino, path + node.name + "/")
    return out


def test_every_listing_comes_from_the_index_as_a_list_would_give_it():
    backend = _backend()
    listed = _run(backend, _walk)
    lists_before = backend.requests["list"]
    assert lists_before > 25  # (the walk without an index: pages of 100)
    index = _index_of(backend)

    async def body(fs):
        walked = await _walk(fs)
        return walked, fs.stats["namespace.index_listings"], fs.stats["namespace.list_pages"]

    walked, from_index, pages = _run(backend, body, index=index)
    assert walked == listed
    assert backend.requests["list"] == lists_before and pages == 0  # no LIST at all
    assert from_index == len([entry for entry in listed if entry[1]]) + 1
    # Every directory handed over, but one no path reaches ('a//': a directory named '').
    assert index.directories() == ["a//"]


def test_list_ahead_of_a_walk_takes_from_the_index_too():
    backend = MemoryBackend({f"data/c{d:02d}/img{i}.jpg": b"x" for d in range(30) for i in range(5)})
    index = _index_of(backend)

    async def body(fs):
        for name in ("c00", "c01"):  # a walk starts: the rest is listed ahead
            node = await fs.lookup(ROOT_INO, name)
            await fs.ns.list_dir(node.ino)
        await trio.sleep(0.1)
        return fs.stats["namespace.listed_ahead"], fs.stats["namespace.index_listings"]

    listed_ahead, from_index = _run(backend, body, index=index)
    assert listed_ahead == 28 and from_index == 31
    assert backend.requests["list"] == 0


def test_reads_are_pinned_to_the_versions_the_index_names():
    backend = _backend()
    index = _index_of(backend)
    backend.put("data/sub/b.bin", b"rewritten after the index was built")

    async def body(fs):
        sub = await fs.lookup(ROOT_INO, "sub")
        node = await fs.lookup(sub.ino, "b.bin")
        assert node.size_bytes == 300  # as the index says
        fh = await fs.open(node.ino, 0)
        try:
            await fs.read(fh, 0, 4096)
        except errors.ObjectChanged:
            return "estale"
        finally:
            fs.release(fh)
        return "read"

    assert _run(backend, body, index=index, small_file_bytes=4096) == "estale"
    # An object unchanged since reads as listed.

    async def unchanged(fs):
        node = await fs.lookup(ROOT_INO, "a.txt")
        fh = await fs.open(node.ino, 0)
        try:
            return await fs.read(fh, 0, 100)
        finally:
            fs.release(fh)

    assert _run(backend, unchanged, index=_index_of(backend)) == b"alpha"


def test_with_a_ttl_the_index_counts_as_listed_at_the_start_and_is_listed_again_once_older():
    backend = _backend()
    index = _index_of(backend)
    backend.put("data/new-since", b"n")
    backend.put("data/sub/new-since", b"n")

    async def body(fs):
        names = [node.name for node in await fs.ns.list_dir(ROOT_INO)]
        lists_at_start = backend.requests["list"]
        await trio.sleep(5)
        again = [node.name for node in await fs.ns.list_dir(ROOT_INO)]  # within the TTL: the index's
        lists_within = backend.requests["list"]
        await trio.sleep(6)  # 11 s after the start: older than the TTL
        later = [node.name for node in await fs.ns.list_dir(ROOT_INO)]
        # A directory first looked at after the TTL is listed from the store.
        sub = await fs.lookup(ROOT_INO, "sub")
        sub_names = [node.name for node in await fs.ns.list_dir(sub.ino)]
        return names, lists_at_start, again, lists_within, later, backend.requests["list"], sub_names

    names, at_start, again, within, later, after, sub_names = _run(
        backend, body, index=index, clock=trio.testing.MockClock(autojump_threshold=0), metadata_ttl_s=10.0
    )
    assert "new-since" not in names and again == names
    assert at_start == within == 0
    assert "new-since" in later and after > 0
    assert "new-since" in sub_names


def test_the_budget_is_charged_for_what_the_index_holds_then_for_the_nodes():
    backend = _backend()
    index = _index_of(backend)
    held_bytes = index.held_bytes

    async def body(fs):
        before = fs.budget.listings_bytes
        await _walk(fs)
        return before, fs.budget.listings_bytes, fs.ns.entries_count

    before, after, entries = _run(backend, body, index=index)
    assert before == LISTED_ENTRY_BYTES + held_bytes  # the root, and the index
    # Every directory taken: the nodes alone (and the one no path reaches, 'a//').
    assert index.directories() == ["a//"]
    assert after == entries * LISTED_ENTRY_BYTES + index.held_bytes and index.held_bytes < 200
    assert held_bytes < 2600 * 40  # (compressed: far less than a node per entry)
