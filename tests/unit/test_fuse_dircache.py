"""The directory-cache flags are set in pyfuse3's real request container only when its
memory holds the request where expected; anything else switches them off, unwritten."""

import collections
import ctypes
import os

import pyfuse3
import pytest
import trio

from bucketfs import fuse_dircache
from bucketfs.fuse_dircache import CACHE_READDIR_BIT, FILE_INFO_OFFSET, KEEP_CACHE_BIT, DirCacheFlags

pytestmark = pytest.mark.timeout(30)

INO_OFFSET = FILE_INFO_OFFSET + 40  # libfuse <= 3.16's fuse_file_info, as on this machine


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

    monkeypatch.setattr(pyfuse3, "fuse_opendir_async", pyfuse3_handler)
    flags.install()
    try:
        async def main():
            for c, _inode in requests:
                await pyfuse3.fuse_opendir_async(c)
        trio.run(main)
    finally:
        flags.uninstall()
    assert pyfuse3.fuse_opendir_async is pyfuse3_handler  # uninstall restores the original
    return marked


def test_the_flags_are_set_on_the_request_that_names_the_inode(monkeypatch):
    stats = collections.Counter()
    flags = DirCacheFlags(stats)
    requests = [(container(1), 1), (container(2), 2), (container(70_001), 70_001)]
    assert answer(flags, monkeypatch, requests) == [True, True, True]
    for c, _inode in requests:
        assert flag_bits(c) == KEEP_CACHE_BIT | CACHE_READDIR_BIT
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
        ctypes.c_uint32.from_address(id(odd) + FILE_INFO_OFFSET + 4).value = CACHE_READDIR_BIT
    before = memory(odd)
    later = container(7)
    assert answer(flags, monkeypatch, [(good, 5), (odd, 6), (later, 7)]) == [True, False, False]
    assert memory(odd) == before  # not one byte written
    assert flag_bits(later) == 0  # off for the rest of the mount
    assert stats["namespace.kernel_dir_cache_off"] == 1


def test_a_second_layout_is_recognised_and_then_kept(monkeypatch):
    """libfuse 3.17's larger fuse_file_info moves the inode to FILE_INFO_OFFSET + 64;
    once learned from the first request, the offset is the only one accepted."""
    stats = collections.Counter()
    flags = DirCacheFlags(stats)
    requests = [(container(1, ino_offset=FILE_INFO_OFFSET + 64), 1), (container(9), 9)]
    assert answer(flags, monkeypatch, requests) == [True, False]
    assert stats["namespace.kernel_dir_cache_off"] == 1


def test_nothing_is_marked_outside_an_opendir_request():
    flags = DirCacheFlags(collections.Counter())
    assert flags.mark(1) is False
    assert flags.enabled  # not a layout problem: nothing to check
    assert fuse_dircache._request.get() is None
