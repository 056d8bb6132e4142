"""The FUSE adapter's own logic, driven without a mount (pyfuse3's reply call stubbed)."""

import errno
import json
import os
import stat

import pyfuse3
import trio
import trio.testing

from bucketfs.backends.memory import MemoryBackend
from bucketfs.fuse.ops import FuseOperations
from tests.unit.helpers import resolve, run_fs


class ReplyBuffer:
    """Stands in for pyfuse3's ReaddirToken: room for `room` entries, like the kernel's buffer."""

    def __init__(self, room: int):
        self.room = room
        self.entries: list = []  # (name, inode, next offset)


def fake_readdir_reply(token, name, attrs, next_id):
    if not token.room:
        return False
    token.room -= 1
    token.entries.append((name.decode(), attrs.st_ino, next_id))
    return True


def test_a_file_rewritten_between_readdir_calls_is_listed_once_as_its_new_version(monkeypatch):
    """With a TTL, a directory re-listed between two READDIRPLUS calls of one handle
    (any lookup in it after the TTL does that) may give a file not yet sent a new
    version. It must still be listed, once, with its new inode: it was once left out,
    though it existed before and after."""
    monkeypatch.setattr(pyfuse3, "readdir_reply", fake_readdir_reply)
    backend = MemoryBackend({f"d/f{i}": b"x" for i in range(10)})

    async def body(fs):
        ops = FuseOperations(fs, fs.config)
        d = await resolve(fs, "d")
        dh = await ops.opendir(d.ino, None)
        first = ReplyBuffer(5)
        await ops.readdir(dh, 0, first)  # the kernel's buffer took ., .., f0..f2
        backend.put("d/f5", b"rewritten")
        backend.delete("d/f7")
        await trio.sleep(2)  # past the TTL
        await ops.lookup(d.ino, b"f0", None)  # re-lists d
        rest = ReplyBuffer(100)
        await ops.readdir(dh, first.entries[-1][2], rest)
        new_f5 = await fs.lookup(d.ino, "f5")
        return first.entries + rest.entries, new_f5.ino

    entries, new_f5_ino = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), metadata_ttl_s=1)
    assert [name for name, _, _ in entries] == [".", ".."] + [f"f{i}" for i in range(10) if i != 7]
    assert dict((name, ino) for name, ino, _ in entries)["f5"] == new_f5_ino


def test_rewinddir_shows_the_directory_as_it_is_now_with_a_ttl_and_the_snapshot_without(monkeypatch):
    """rewinddir (a READDIR from offset 0 on a handle already read) must show the
    directory's current state (POSIX); it replayed the snapshot taken at opendir."""
    monkeypatch.setattr(pyfuse3, "readdir_reply", fake_readdir_reply)

    def names_before_and_after_rewind(**config):
        backend = MemoryBackend({"d/a": b"x", "d/b": b"y"})

        async def body(fs):
            ops = FuseOperations(fs, fs.config)
            d = await resolve(fs, "d")
            dh = await ops.opendir(d.ino, None)
            first, again = ReplyBuffer(100), ReplyBuffer(100)
            await ops.readdir(dh, 0, first)
            backend.put("d/new", b"z")
            await trio.sleep(2)  # past the TTL, if any
            await ops.readdir(dh, 0, again)  # rewinddir()
            return [e[0] for e in first.entries[2:]], [e[0] for e in again.entries[2:]]

        return run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), **config)

    assert names_before_and_after_rewind(metadata_ttl_s=1) == (["a", "b"], ["a", "b", "new"])
    # Immutable default: the listing is the mount's for good; a rewind costs no LIST.
    assert names_before_and_after_rewind() == (["a", "b"], ["a", "b"])


def test_dot_and_dotdot_come_first_with_the_directory_and_its_parent_and_take_no_lookup(monkeypatch):
    """Every local file system lists "." and ".." (`ls -a` shows them); the kernel
    takes no reference for them, so counting them as lookups would keep a vanished
    directory's node alive for good in TTL mode. Offsets stay stable across calls."""
    monkeypatch.setattr(pyfuse3, "readdir_reply", fake_readdir_reply)
    backend = MemoryBackend({"d/sub/a": b"x", "d/sub/b": b"y"})

    async def body(fs):
        ops = FuseOperations(fs, fs.config)
        d, sub = await resolve(fs, "d"), await resolve(fs, "d/sub")
        lookups_before = (d.lookups, sub.lookups)
        dh = await ops.opendir(sub.ino, None)
        first, rest = ReplyBuffer(1), ReplyBuffer(100)
        await ops.readdir(dh, 0, first)
        await ops.readdir(dh, first.entries[-1][2], rest)
        root_dh = await ops.opendir(pyfuse3.ROOT_INODE, None)
        root = ReplyBuffer(100)
        await ops.readdir(root_dh, 0, root)
        a, b = await resolve(fs, "d/sub/a"), await resolve(fs, "d/sub/b")
        return (
            first.entries + rest.entries,
            root.entries[:2],
            (d.ino, sub.ino, a.ino, b.ino),
            lookups_before,
            (d.lookups, sub.lookups, a.lookups),
        )

    entries, root_dots, (d_ino, sub_ino, a_ino, b_ino), before, after = run_fs(
        backend, body, clock=trio.testing.MockClock(autojump_threshold=0), metadata_ttl_s=60
    )
    assert entries == [(".", sub_ino, 1), ("..", d_ino, 2), ("a", a_ino, 3), ("b", b_ino, 4)]
    assert root_dots == [(".", pyfuse3.ROOT_INODE, 1), ("..", pyfuse3.ROOT_INODE, 2)]
    # Counted: d once (a child in the root's listing), a once; sub not at all, though
    # sent as "." of its own listing and d as its "..".
    assert before == (0, 0) and after == (1, 0, 1)


def test_the_stats_file_is_found_at_the_root_only_read_as_one_snapshot_and_never_listed(monkeypatch):
    """`bucketfs stats` reads the counters from a file no listing shows; reads of one
    open agree with each other (a busy mount's counters grow a digit in between)."""
    monkeypatch.setattr(pyfuse3, "readdir_reply", fake_readdir_reply)
    backend = MemoryBackend({"f": b"x", "d/g": b"y"})

    async def body(fs):
        from bucketfs.metrics import STATS_FILE_NAME

        ops = FuseOperations(fs, fs.config)
        name = STATS_FILE_NAME.encode()
        entry = await ops.lookup(pyfuse3.ROOT_INODE, name)
        d = await ops.lookup(pyfuse3.ROOT_INODE, b"d")
        in_subdir = await ops.lookup(d.st_ino, name)
        info = await ops.open(entry.st_ino, os.O_RDONLY, None)
        head = await ops.read(info.fh, 0, 10)
        fs.stats["fuse.read"] += 10**12  # the mount keeps working between two READs
        rest = await ops.read(info.fh, 10, 1 << 20)
        await ops.release(info.fh)
        dh = await ops.opendir(pyfuse3.ROOT_INODE, None)
        listing = ReplyBuffer(100)
        await ops.readdir(dh, 0, listing)
        await ops.getattr(entry.st_ino, None)
        return (
            entry,
            in_subdir.st_ino,
            info,
            head + rest,
            [e[0] for e in listing.entries],
            ops._stats_reads,
            dict(fs.stats),
        )

    entry, in_subdir_ino, info, raw, names, left_open, counts = run_fs(backend, body)
    # Reading the counters is not counted as the mount's work (2 lookups: d, and the name in d).
    assert counts["fuse.lookup"] == 2 and not {"fuse.open", "fuse.release", "fuse.getattr"} & set(counts)
    assert stat.S_ISREG(entry.st_mode) and entry.entry_timeout == 0 and in_subdir_ino == 0
    assert info.direct_io and not info.keep_cache  # each open reads the counters as they are now
    assert json.loads(raw).get("fuse.read", 0) < 10**12  # one snapshot, taken at open
    assert names == [".", "..", "d", "f"] and left_open == {}


def test_each_lookup_of_the_stats_file_is_a_reading_of_its_own_until_forgotten():
    """Read by inode (the kernel opens files itself: no handle per reading), the stats
    file is a new inode per lookup, its size its counters' own length, its bytes the
    same whatever the mount does after; let go of at its FORGET (ESTALE after)."""
    from bucketfs.fuse.noopen import INODE_FH
    from bucketfs.metrics import STATS_FILE_NAME

    backend = MemoryBackend({"f": b"x"})

    async def body(fs):
        ops = FuseOperations(fs, fs.config)
        name = STATS_FILE_NAME.encode()
        first = await ops.lookup(pyfuse3.ROOT_INODE, name)
        fs.stats["fuse.read"] += 10**12  # (longer counters from here on)
        second = await ops.lookup(pyfuse3.ROOT_INODE, name)
        readings = {}
        for entry in (first, second):
            ino = entry.st_ino
            head = await ops.read(INODE_FH | ino, 0, 7)
            rest = await ops.read(INODE_FH | ino, 7, 1 << 20)
            readings[ino] = (entry.st_size, (await ops.getattr(ino, None)).st_size, head + rest)
        await ops.forget([(first.st_ino, 1)])
        try:
            await ops.getattr(first.st_ino, None)
        except pyfuse3.FUSEError as exc:
            after_forget = exc.errno
        return first.st_ino, second.st_ino, readings, after_forget

    first_ino, second_ino, readings, after_forget = run_fs(backend, body)
    assert first_ino != second_ino
    for size, size_again, data in readings.values():
        assert size == size_again == len(data)
        json.loads(data)
    assert (
        json.loads(readings[second_ino][2])["fuse.read"]
        >= 10**12
        > json.loads(readings[first_ino][2]).get("fuse.read", 0)
    )
    assert after_forget == errno.ESTALE


def test_an_object_named_like_the_stats_file_wins():
    from bucketfs.metrics import STATS_FILE_NAME

    backend = MemoryBackend({STATS_FILE_NAME: b"the bucket's bytes"})

    async def body(fs):
        ops = FuseOperations(fs, fs.config)
        entry = await ops.lookup(pyfuse3.ROOT_INODE, STATS_FILE_NAME.encode())
        info = await ops.open(entry.st_ino, os.O_RDONLY, None)
        return await ops.read(info.fh, 0, 100)

    assert run_fs(backend, body) == b"the bucket's bytes"


def test_extended_attributes_answer_enosys_so_the_kernel_stops_asking():
    backend = MemoryBackend({"f": b"x"})

    async def body(fs):
        ops = FuseOperations(fs, fs.config)
        answers = []
        for call in (
            ops.getxattr(pyfuse3.ROOT_INODE, b"security.selinux", None),
            ops.listxattr(pyfuse3.ROOT_INODE, None),
        ):
            try:
                await call
            except pyfuse3.FUSEError as exc:
                answers.append(exc.errno)
        return answers, fs.stats

    answers, stats = run_fs(backend, body)
    assert answers == [errno.ENOSYS, errno.ENOSYS]
    assert not any(key.startswith("errors.") for key in stats)  # not an error of the mount
