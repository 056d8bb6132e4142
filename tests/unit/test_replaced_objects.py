"""An object replaced while mounted, and stores that state versions differently
(bucketfs/backends/versions.py), on the in-memory backend.

A read of a replaced object is ESTALE for the handle that holds the old version
(never bytes of two versions); the first such read lists the object's directory
again, so later opens of the name read the new version, in the immutable default as
with a TTL."""

import math

import pytest
import trio
import trio.testing

from bucketfs import errors
from bucketfs.backends import versions
from bucketfs.backends.memory import MemoryBackend
from bucketfs.core.stats import Stats
from bucketfs.diskcache.cache import DiskCache
from tests.unit.helpers import read_all, resolve, run_fs

MiB = 1024 * 1024


def blob(size_bytes: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(size_bytes))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ttl_s", [math.inf, 3600.0], ids=["immutable", "ttl"])
@pytest.mark.parametrize("size_bytes", [10_000, 3 * MiB], ids=["small", "large"])
@pytest.mark.parametrize("mode", ["counter", "hash", "none"])
def test_after_a_stale_read_a_new_open_reads_the_new_version(ttl_s, size_bytes, mode):
    old, new = blob(size_bytes, 1), blob(size_bytes, 2)  # the same size: only the version tells
    backend = MemoryBackend({"d/f.bin": old, "d/other": b"x"}, versions=mode)

    async def body(fs):
        node = await resolve(fs, "d/f.bin")
        if fs.ns.tracks_lookups:
            fs.ns.note_lookup(node)  # the kernel holds the entry it was given
        backend.put("d/f.bin", new)  # replaced between the listing and the first GET
        fh = await fs.open(node.ino, 0)
        lists_before = backend.requests["list"]
        with pytest.raises(errors.ObjectChanged):
            await fs.read(fh, 0, 4096)
        await trio.testing.wait_all_tasks_blocked()  # the re-listing, in the background
        assert backend.requests["list"] == lists_before + 1
        with pytest.raises(errors.ObjectChanged):
            await fs.read(fh, size_bytes - 4096, 4096)  # the old handle stays stale
        with pytest.raises(errors.ObjectChanged):
            await fs.open(node.ino, 0)  # the kernel's dentry: ESTALE makes it look the name up again
        fresh = await resolve(fs, "d/f.bin")
        assert fresh.ino != node.ino and fresh.version != node.version
        assert await read_all(fs, "d/f.bin") == new
        assert await read_all(fs, "d/other") == b"x"  # its neighbour kept its node
        fs.release(fh)

    run_fs(backend, body, metadata_ttl_s=ttl_s, small_file_bytes=1 * MiB, list_ahead_count=0)


@pytest.mark.timeout(30)
def test_a_store_answering_changed_again_and_again_costs_one_listing_a_second():
    backend = MemoryBackend({"d/f.bin": b"old"})
    clock = trio.testing.MockClock()

    async def body(fs):
        node = await resolve(fs, "d/f.bin")
        fh = await fs.open(node.ino, 0)

        def always_changed(op, key):
            if op == "get":
                raise errors.ObjectChanged(f"{key}: changed")

        backend.fail_hook = always_changed
        lists_before = backend.requests["list"]
        for _ in range(20):
            with pytest.raises(errors.ObjectChanged):
                await fs.read(fh, 0, 3)
            await trio.testing.wait_all_tasks_blocked()
        assert backend.requests["list"] == lists_before + 1
        # (The re-listing showed the same version: the handle's node is still the listed one.)
        clock.jump(1.5)
        with pytest.raises(errors.ObjectChanged):
            await fs.read(fh, 0, 3)
        await trio.testing.wait_all_tasks_blocked()
        assert backend.requests["list"] == lists_before + 2
        assert fs.stats["namespace.stale_relists"] == 2

    run_fs(backend, body, clock=clock)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["none", "unpinned", "hash"])
def test_every_kind_of_version_reads_whole_files_with_one_get_each(mode):
    tree = {f"c/{i}.jpg": blob(50_000 + i, i) for i in range(20)}
    backend = MemoryBackend(tree, versions=mode)

    async def body(fs):
        for key, data in tree.items():
            assert await read_all(fs, key) == data
        assert backend.requests["get"] == len(tree)

    run_fs(backend, body)


@pytest.mark.timeout(30)
def test_a_replaced_object_of_another_size_is_stale_even_with_no_version():
    backend = MemoryBackend({"f": b"0123456789" * 1000}, versions="unpinned")

    async def body(fs):
        node = await resolve(fs, "f")
        assert node.version == versions.UNPINNED
        fh = await fs.open(node.ino, 0)
        backend.put("f", b"shorter")
        with pytest.raises(errors.ObjectChanged):
            await fs.read(fh, 0, 4096)

    run_fs(backend, body)


@pytest.mark.timeout(30)
def test_objects_with_no_version_stay_out_of_the_disk_cache(tmp_path):
    """A later mount could not tell them from a replacement of the same size."""
    tree = {"pinned/a": blob(100_000, 1)}
    backend = MemoryBackend(tree, versions="unpinned")

    async def main():
        async with trio.open_nursery() as nursery:
            stats = Stats()
            cache = DiskCache(backend, str(tmp_path / "cache"), 100 * MiB, 64 * 1024, stats, nursery, None)
            info = (await backend.list_page("pinned/")).objects[0]
            for _ in range(2):
                assert (
                    await cache.read_range("pinned/a", 0, 100_000, info.version, object_bytes=100_000)
                    == tree["pinned/a"]
                )
            await trio.testing.wait_all_tasks_blocked()
            assert backend.requests["get"] == 2
            assert stats["disk_cache.written_bytes"] == 0 and stats["disk_cache.hits"] == 0
            nursery.cancel_scope.cancel()

    (tmp_path / "cache").mkdir()
    trio.run(main)
