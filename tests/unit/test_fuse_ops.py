"""The FUSE adapter's own logic, driven without a mount (pyfuse3's reply call stubbed)."""

import json

import pyfuse3
import trio
import trio.testing

from bucketfs.backends.memory import MemoryBackend
from bucketfs.fuse_ops import FuseOperations
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
        first = ReplyBuffer(3)
        await ops.readdir(dh, 0, first)  # the kernel's buffer took f0..f2
        backend.put("d/f5", b"rewritten")
        backend.delete("d/f7")
        await trio.sleep(2)  # past the TTL
        await ops.lookup(d.ino, b"f0", None)  # re-lists d
        rest = ReplyBuffer(100)
        await ops.readdir(dh, first.entries[-1][2], rest)
        new_f5 = await fs.lookup(d.ino, "f5")
        return first.entries + rest.entries, new_f5.ino

    entries, new_f5_ino = run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), metadata_ttl_s=1)
    assert [name for name, _, _ in entries] == [f"f{i}" for i in range(10) if i != 7]
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
            return [e[0] for e in first.entries], [e[0] for e in again.entries]

        return run_fs(backend, body, clock=trio.testing.MockClock(autojump_threshold=0), **config)

    assert names_before_and_after_rewind(metadata_ttl_s=1) == (["a", "b"], ["a", "b", "new"])
    # Immutable default: the listing is the mount's for good; a rewind costs no LIST.
    assert names_before_and_after_rewind() == (["a", "b"], ["a", "b"])


def test_the_stats_size_query_and_read_get_the_same_bytes():
    """getxattr(size 0) then getxattr(that size): counters that grow a digit in between
    (a busy mount) made the read fail with ERANGE for callers that do not retry."""
    backend = MemoryBackend({"f": b"x"})

    async def body(fs):
        from bucketfs.metrics import STATS_XATTR
        ops = FuseOperations(fs, fs.config)
        sized = await ops.getxattr(pyfuse3.ROOT_INODE, STATS_XATTR.encode(), None)
        fs.stats["fuse.read"] += 10**12  # the mount keeps working between the two requests
        read = await ops.getxattr(pyfuse3.ROOT_INODE, STATS_XATTR.encode(), None)
        return sized, read

    sized, read = run_fs(backend, body)
    assert len(read) == len(sized) and json.loads(read)["fuse.read"] >= 10**12
