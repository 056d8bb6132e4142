"""The directory-cache flags are set in pyfuse3's real request container only when its
memory holds the request where expected; anything else switches them off, unwritten."""

import collections
import ctypes
import os

import pyfuse3
import pytest
import trio

from bucketfs.fuse import dircache
from bucketfs.fuse.dircache import FILE_INFO_OFFSET, DirCacheFlags, FlagLayout, layout_for, libfuse_version

pytestmark = pytest.mark.timeout(30)

# The libfuse this process runs (Debian 12's 3.14.0 here and in CI): its layout is known.
LAYOUT = layout_for(libfuse_version())
assert LAYOUT is not None, libfuse_version()
INO_OFFSET = FILE_INFO_OFFSET + LAYOUT.file_info_bytes
BOTH_BITS = LAYOUT.keep_cache_bit | LAYOUT.cache_readdir_bit


def container(inode: int, open_flags: int = os.O_RDONLY | os.O_DIRECTORY, ino_offset: int = INO_OFFSET):
    """A real pyfuse3 request container, filled in as pyfuse3's fuse_opendir does."""
    c = pyfuse3._Container()
    ctypes.c_int32.from_address(id(c) + FILE_INFO_OFFSET).value = open_flags
    ctypes.c_uint64.from_address(id(c) + ino_offset).value = inode
    return c


def memory(c) -> bytes:
    """The container's fields (after the object header, whose reference count moves)."""
    header = object.__basicsize__
    return ctypes.string_at(id(c) + header, type(c).__basicsize__ - header)


def flag_bits(c) -> int:
    return ctypes.c_uint32.from_address(id(c) + FILE_INFO_OFFSET + 4).value


def answer(flags: DirCacheFlags, monkeypatch, requests):
    """Run pyfuse3's OPENDIR path (wrapped by `flags`) for (container, inode) pairs;
    the stand-in for pyfuse3's handler calls `mark` as FuseOperations.opendir does."""
    marked = []

    async def pyfuse3_handler(c):
        marked.append(flags.mark(requests[len(marked)][1]))

    monkeypatch.setattr(pyfuse3, "fuse_opendir_async", pyfuse3_handler)  # (restored after the test)
    flags.install()
    assert pyfuse3.fuse_opendir_async is not pyfuse3_handler  # wrapped

    async def main():
        for c, _inode in requests:
            await pyfuse3.fuse_opendir_async(c)

    trio.run(main)
    return marked


def test_the_flags_are_set_on_the_request_that_names_the_inode(monkeypatch):
    stats = collections.Counter()
    flags = DirCacheFlags(stats)
    requests = [(container(1), 1), (container(2), 2), (container(70_001), 70_001)]
    assert answer(flags, monkeypatch, requests) == [True, True, True]
    for c, _inode in requests:
        assert flag_bits(c) == BOTH_BITS
    assert not stats


@pytest.mark.parametrize("bad", ["inode elsewhere", "no inode", "opened for writing", "bits already set"])
def test_a_request_not_laid_out_as_expected_is_left_untouched_and_turns_the_flags_off(monkeypatch, bad):
    stats = collections.Counter()
    flags = DirCacheFlags(stats)
    good = container(5)
    odd = {
        "inode elsewhere": lambda: container(6, ino_offset=INO_OFFSET + 8),
        "no inode": lambda: container(0),
        "opened for writing": lambda: container(6, open_flags=os.O_RDWR),
        "bits already set": lambda: container(6),
    }[bad]()
    if bad == "bits already set":
        ctypes.c_uint32.from_address(id(odd) + FILE_INFO_OFFSET + 4).value = LAYOUT.cache_readdir_bit
    before = memory(odd)
    later = container(7)
    assert answer(flags, monkeypatch, [(good, 5), (odd, 6), (later, 7)]) == [True, False, False]
    assert memory(odd) == before  # not one byte written
    assert flag_bits(later) == 0  # off for the rest of the mount
    assert stats["namespace.kernel_dir_cache_off"] == 1


@pytest.mark.parametrize(
    "version, layout",
    [
        ((3, 10, 5), FlagLayout(40, 1 << 2, 1 << 6)),
        ((3, 14, 0), FlagLayout(40, 1 << 2, 1 << 6)),
        ((3, 14, 1), None),  # not known which side of libfuse's ABI break it is on
        ((3, 15, 0), FlagLayout(40, 1 << 2, 1 << 7)),  # parallel_direct_writes after keep_cache
        ((3, 16, 2), FlagLayout(40, 1 << 2, 1 << 7)),
        ((3, 17, 1), FlagLayout(64, 1 << 2, 1 << 6)),  # moved back; a larger struct
        ((3, 18, 0), FlagLayout(64, 1 << 2, 1 << 6)),
        ((3, 19, 0), None),  # newer than the table
        ((2, 9, 9), None),
        (None, None),
    ],
)
def test_the_layout_follows_the_libfuse_version(version, layout):
    assert layout_for(version) == layout


def test_a_larger_fuse_file_info_moves_the_inode(monkeypatch):
    """With libfuse 3.17's 64-byte fuse_file_info, the inode is 24 bytes further on;
    where a 3.14 build puts it is then not accepted."""
    flags = DirCacheFlags(collections.Counter(), layout=layout_for((3, 17, 0)))
    right = container(1, ino_offset=FILE_INFO_OFFSET + 64)
    assert answer(flags, monkeypatch, [(right, 1), (container(2, ino_offset=FILE_INFO_OFFSET + 40), 2)]) == [
        True,
        False,
    ]
    assert flag_bits(right) == (1 << 2) | (1 << 6)


def test_an_unknown_libfuse_switches_the_flags_off_before_any_request(monkeypatch):
    monkeypatch.setattr(dircache, "libfuse_version", lambda: (3, 14, 1))
    stats = collections.Counter()
    flags = DirCacheFlags(stats)
    c = container(3)
    before = memory(c)
    assert answer(flags, monkeypatch, [(c, 3)]) == [False]
    assert memory(c) == before
    assert stats["namespace.kernel_dir_cache_off"] == 1


def test_an_opendir_the_wrapper_did_not_see_switches_the_flags_off():
    """Were pyfuse3 to stop calling its OPENDIR handler by name, `mark` would find no
    request: that is reported (not silently skipped on every OPENDIR)."""
    stats = collections.Counter()
    flags = DirCacheFlags(stats)
    assert dircache._request.get() is None
    assert flags.mark(1) is False
    assert not flags.enabled and stats["namespace.kernel_dir_cache_off"] == 1
