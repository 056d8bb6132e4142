"""Let the kernel keep directory listings: FOPEN_CACHE_DIR | FOPEN_KEEP_CACHE on OPENDIR.

With both flags the kernel fills its own cache of a directory's entries from the
first READDIRPLUS and answers every later readdir() of it without asking the
daemon, for as long as it keeps the directory's inode: a cached os.walk() of 200
directories costs OPENDIR and RELEASEDIR per directory instead of OPENDIR, two
READDIRPLUS and RELEASEDIR (measured: 0.197 s -> 0.12-0.16 s for 20,000 entries).
Only right when listings never change while mounted (the immutable default).

pyfuse3 (3.5) has no way to set these flags: `opendir` returns only a handle, and
the `fuse_file_info` it replies with lives in a private request container. So this
wraps pyfuse3's OPENDIR coroutine to see that container, and sets the two bits in
its `fi` before pyfuse3 replies, but only after checking that the memory is laid out
as expected: the request's inode must be where pyfuse3 (handlers.pxi, `_Container`:
PyObject header, `dev_t rdev`, `fuse_file_info fi`, `fuse_ino_t ino`, ...) and
the running libfuse's `fuse_file_info` put it, and the flag bits must still be
clear. The bits' positions depend on the libfuse version (`layout_for`); an unknown
version, or one mismatch, switches this off for the mount (logged once):
directories are then listed by the daemon on every readdir(), as without it.

Nothing here, nor in noopendir.py, runs unless `private_layouts_allowed` says so: the
mount asked for it (`--kernel-dir-cache auto`, the default) and the running pyfuse3 is
one of the releases whose private layouts were checked (PYFUSE3_TESTED; pyproject.toml
pins the same range). Drop this module once pyfuse3 lets `opendir` return a FileInfo.
"""

from __future__ import annotations

import contextvars
import ctypes
import logging
import os
import re
from dataclasses import dataclass
from typing import Optional

import pyfuse3

log = logging.getLogger(__name__)

# The pyfuse3 releases whose private layouts this module and noopendir.py rely on:
# `_Container` (handlers.pxi), `ReaddirToken`, `fuse_opendir_async` looked up by name
# and `init_fuse_ops` (internal.pxi) are the same in 3.3.0, 3.4.0 and 3.5.0 but for 3.5's
# `poll` handler (noopendir.py's pattern expects it: on 3.3 and 3.4 it finds no table and
# answers OPENDIR as before). 3.5.0 is the one the tests run. Outside [min, below), nothing
# is written. pyproject.toml pins the same range (tests/unit/test_kernel_dir_cache.py).
PYFUSE3_TESTED = ((3, 3), (3, 6))


def pyfuse3_version(text: Optional[str] = None) -> Optional[tuple]:
    """(3, 5, 0) for pyfuse3 "3.5.0" (by default the one imported); None if unreadable."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", getattr(pyfuse3, "__version__", "") if text is None else text)
    return tuple(int(part or 0) for part in match.groups()) if match else None


def private_layouts_allowed(mode: str, stats) -> bool:
    """Whether this mount may write into pyfuse3's and libfuse's private memory (the
    directory-cache flags, the no-OPENDIR table patch): `mode` is --kernel-dir-cache,
    and the running pyfuse3 must be a tested one. Says why not once (a warning if the
    version is the reason) and sets the `kernel_dir_cache_off` gauge."""
    version = pyfuse3_version()
    low, below = PYFUSE3_TESTED
    if mode == "off":
        log.info(
            "--kernel-dir-cache off: nothing is written into pyfuse3's or libfuse's private memory; "
            "directory listings are not cached by the kernel"
        )
    elif version is None or not low <= version < below:
        log.warning(
            "pyfuse3 %s is not one whose private memory layout bucketfs has checked (%s to below %s): "
            "directory listings are not cached by the kernel, and every opendir() costs an OPENDIR "
            "round trip",
            getattr(pyfuse3, "__version__", "(version unknown)"),
            ".".join(map(str, low)),
            ".".join(map(str, below)),
        )
    else:
        return True
    stats["namespace.kernel_dir_cache_off"] = 1
    return False


# fuse_file_info begins after the PyObject header and `dev_t rdev`; `ino` follows it.
FILE_INFO_OFFSET = object.__basicsize__ + ctypes.sizeof(ctypes.c_uint64)


@dataclass(frozen=True)
class FlagLayout:
    """Where one libfuse keeps what OPENDIR's reply is built from."""

    file_info_bytes: int  # sizeof(struct fuse_file_info)
    keep_cache_bit: int  # in the bitfield word after `int flags` (GCC allocates from bit 0)
    cache_readdir_bit: int


def layout_for(version: Optional[tuple]) -> Optional[FlagLayout]:
    """The layout of libfuse `version` (from its fuse_common.h), None if not known.
    The bitfield is writepage, direct_io, keep_cache, flush, nonseekable,
    flock_release, cache_readdir, noflush, except from 3.15 to 3.16, which put
    parallel_direct_writes after keep_cache (libfuse issue 1029; 3.17 moved it back,
    grew the struct to 64 bytes and changed the soname)."""
    if version is None or version >= (3, 19):
        return None  # a libfuse newer than this table: its headers not read yet
    if version >= (3, 17):
        return FlagLayout(64, 1 << 2, 1 << 6)
    if version >= (3, 15):
        return FlagLayout(40, 1 << 2, 1 << 7)
    if (3, 0) <= version <= (3, 14, 0):
        return FlagLayout(40, 1 << 2, 1 << 6)
    return None  # 3.14.1-3.14.x: which of the two is not known here


def libfuse_version() -> Optional[tuple]:
    """The version of the libfuse3 this process has loaded (pyfuse3's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libfuse3.so" in line}
        if len(paths) != 1:
            return None
        lib = ctypes.CDLL(paths.pop())  # the loaded library again, not a second copy
        lib.fuse_pkgversion.restype = ctypes.c_char_p
        match = re.match(rb"(\d+)\.(\d+)(?:\.(\d+))?", lib.fuse_pkgversion() or b"")
    except (OSError, AttributeError):
        return None
    return tuple(int(part or 0) for part in match.groups()) if match else None


_request = contextvars.ContextVar("bucketfs_opendir_request", default=None)


class DirCacheFlags:
    """Sets the kernel's directory-cache flags on the OPENDIR being answered."""

    def __init__(self, stats, layout: Optional[FlagLayout] = None) -> None:
        """`layout`: the running libfuse's (by default, looked up)."""
        self.stats = stats
        version = None
        if layout is None:
            version = libfuse_version()
            layout = layout_for(version)
        self.layout = layout
        self.enabled = layout is not None
        if not self.enabled:
            self._switch_off(
                f"libfuse {'.'.join(map(str, version)) if version else '(version unknown)'} "
                "is not one whose fuse_file_info layout is known"
            )

    @staticmethod
    def install() -> None:
        """Wrap pyfuse3's OPENDIR handler (looked up by name for every request) so
        `mark` can see the request it runs in. Once per daemon: it serves one mount."""
        original = pyfuse3.fuse_opendir_async  # type: ignore[attr-defined]  # (pyfuse3's Cython internals)

        async def fuse_opendir_async(container):
            token = _request.set(container)
            try:
                await original(container)
            finally:
                _request.reset(token)

        pyfuse3.fuse_opendir_async = fuse_opendir_async  # type: ignore[attr-defined]

    def mark(self, inode: int) -> bool:
        """Ask the kernel to cache the listing of `inode`, whose OPENDIR is being
        answered in this task. False (and nothing written) when it cannot be done."""
        if not self.enabled:
            return False
        container = _request.get()
        if container is None:
            self._switch_off(
                "pyfuse3 did not run its OPENDIR handler through the wrapper "
                f"(pyfuse3 {getattr(pyfuse3, '__version__', '?')})"
            )
            return False
        bits = self._checked_bits(container, inode)
        if bits is None:
            self._switch_off(
                f"pyfuse3's OPENDIR request is not laid out as expected (pyfuse3 "
                f"{getattr(pyfuse3, '__version__', '?')})"
            )
            return False
        bits.value |= self.layout.keep_cache_bit | self.layout.cache_readdir_bit
        return True

    def request_pointer(self, inode: int) -> Optional[int]:
        """The libfuse request (`fuse_req_t`) of the OPENDIR of `inode` being answered
        in this task, read from pyfuse3's container once its layout checks out (after
        `ino` come `parent` and `req`); None if it cannot be read."""
        container = _request.get()
        if not self.enabled or container is None or self._checked_bits(container, inode) is None:
            return None
        req_offset = FILE_INFO_OFFSET + self.layout.file_info_bytes + 2 * ctypes.sizeof(ctypes.c_uint64)
        if req_offset + ctypes.sizeof(ctypes.c_void_p) > type(container).__basicsize__:
            return None
        return ctypes.c_void_p.from_address(id(container) + req_offset).value

    def _switch_off(self, reason: str) -> None:
        self.enabled = False
        self.stats["namespace.kernel_dir_cache_off"] = 1
        log.warning("%s: directory listings are not cached by the kernel", reason)

    def _checked_bits(self, container, inode: int):
        """The `fuse_file_info` flag word of `container`, if its memory holds this
        request as expected; None otherwise."""
        base, layout = id(container), self.layout
        assert layout is not None  # (marking is on only with a known layout)
        ino_offset = FILE_INFO_OFFSET + layout.file_info_bytes
        if ino_offset + 8 > type(container).__basicsize__:
            return None
        if ctypes.c_uint64.from_address(base + ino_offset).value != inode:
            return None
        open_flags = ctypes.c_int32.from_address(base + FILE_INFO_OFFSET).value
        bits = ctypes.c_uint32.from_address(base + FILE_INFO_OFFSET + 4)
        wanted = layout.keep_cache_bit | layout.cache_readdir_bit
        if open_flags & os.O_ACCMODE != os.O_RDONLY or bits.value & wanted:
            return None  # a directory is opened read-only, and libfuse clears the bits
        return bits
