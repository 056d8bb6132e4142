"""READs of up to 4 MiB instead of libfuse's 1 MiB: a quarter of the requests per GB.

Every READ costs the serving thread the same whatever its size (the request, a task,
the hand-off of its reply: ~0.2 ms on the test VM), so a shard streamed in 1 MiB READs
costs it ~0.2 s per GB. The kernel sends READs of up to `max_pages` pages, the number
libfuse's INIT reply asks for: (max_write - 1) / page + 1, where max_write is capped
by the session's receive buffer, which libfuse 3 sizes for 256 pages (1 MiB) in
`fuse_session_new`. pyfuse3 offers no way to change it; the kernel allows up to its
`fs.fuse.max_pages_limit` sysctl (256 by default, up to 65535).

So before the session reads its first request (INIT), this module finds libfuse's
`struct fuse_session` and writes a larger receive buffer size into it: INIT then asks
for REQUEST_BYTES, every receive buffer pyfuse3's tasks allocate is that large (the
kernel requires room for max_write), and where the sysctl is lower, root raises it
(a ceiling for every FUSE mount of the host, which each mount's INIT reply then asks
for or not); elsewhere the kernel keeps READs at the sysctl's size, which is safe: the
buffers are only larger than needed.

Nothing is assumed unchecked, as in noopendir.py: the session is the pointer in
pyfuse3's own data whose target holds pyfuse3's table of operations (find_ops_table)
and this process's /dev/fuse descriptor; the buffer size is the one field after that
table holding exactly libfuse's default (256 pages and its 4 KiB header room). Any
doubt, and nothing is written: READs stay at 1 MiB.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from typing import Optional

import pyfuse3

from bucketfs.fuse.noopendir import (
    LOWLEVEL_OPS,
    POINTER_BYTES,
    SESSION_READ_BYTES,
    code_ranges,
    find_ops_table,
    mappings,
    readable_now,
)

log = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE
# libfuse 3 (fuse_i.h): FUSE_MAX_MAX_PAGES, and the header room it adds to a buffer.
LIBFUSE_MAX_PAGES = 256
BUFFER_HEADER_BYTES = 4096
LIBFUSE_DEFAULT_BUFFER_BYTES = LIBFUSE_MAX_PAGES * PAGE_BYTES + BUFFER_HEADER_BYTES
# The largest READ asked for: 4 MiB, the kernel read-ahead bucketfs sets per mount
# (mount.py's KERNEL_READ_AHEAD_KB), so one read-ahead window is one READ.
REQUEST_BYTES = 4 * 1024 * 1024
# struct fuse_session (libfuse 3.0-3.18): `char *mountpoint; volatile int exited; int fd;`
FD_OFFSET = POINTER_BYTES + 4
# How far past the table of operations the buffer size is looked for (3.14: ~900 bytes).
BUFSIZE_SEARCH_BYTES = 2048
MAX_PAGES_LIMIT_PATH = "/proc/sys/fs/fuse/max_pages_limit"


def _words_in(start: int, end: int):
    """The 64-bit words of [start, end), a mapping of this process."""
    return memoryview((ctypes.c_char * (end - start)).from_address(start)).cast("B").cast("Q")


def find_session(fuse_fd: int, code: list) -> Optional[int]:
    """The address of pyfuse3's libfuse session (before or after its INIT), or None:
    the one pointer in pyfuse3's data whose target holds `fuse_fd` where libfuse keeps
    its descriptor and pyfuse3's table of operations. `code`: pyfuse3's code ranges."""
    so_path = os.path.realpath(pyfuse3.__file__)
    maps = list(mappings())
    readable_at = readable_now(maps)

    # pyfuse3's data: its writable mappings, and the anonymous one right after (.bss).
    words: set = set()
    for i, (start, end, perms, path) in enumerate(maps):
        if perms[:2] == "rw" and path.startswith("/") and os.path.realpath(path) == so_path:
            words.update(_words_in(start, end))
            after = maps[i + 1] if i + 1 < len(maps) else None
            if after is not None and after[0] == end and after[2][:2] == "rw" and not after[3]:
                words.update(_words_in(after[0], after[1]))
    found = [
        word
        for word in words
        if not word % POINTER_BYTES
        and readable_at(word, SESSION_READ_BYTES + BUFSIZE_SEARCH_BYTES)
        and ctypes.c_int.from_address(word + FD_OFFSET).value == fuse_fd
        and find_ops_table(word, code) is not None
    ]
    return found[0] if len(found) == 1 else None


def bufsize_field(session: int, code: list) -> Optional[int]:
    """The address of the session's `bufsize`: the one word past its table of
    operations that holds libfuse's default, or None."""
    table = find_ops_table(session, code)
    if table is None:
        return None
    first = table + POINTER_BYTES * len(LOWLEVEL_OPS)
    words = _words_in(first, first + BUFSIZE_SEARCH_BYTES)
    hits = [i for i, word in enumerate(words) if word == LIBFUSE_DEFAULT_BUFFER_BYTES]
    return first + hits[0] * POINTER_BYTES if len(hits) == 1 else None


def max_pages_limit() -> Optional[int]:
    try:
        with open(MAX_PAGES_LIMIT_PATH) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None  # (older kernels: 256 pages, fixed)


def _raise_max_pages_limit(pages: int) -> Optional[int]:
    """The kernel's ceiling on a request's pages, raised to `pages` where it is lower and
    this process may (root); the ceiling in force, None if unknown."""
    limit = max_pages_limit()
    if limit is not None and limit < pages and os.geteuid() == 0:
        try:
            with open(MAX_PAGES_LIMIT_PATH, "w") as f:
                f.write(str(pages))
            log.info(
                "raised fs.fuse.max_pages_limit from %d to %d (READs of up to %d KiB)",
                limit,
                pages,
                pages * PAGE_BYTES // 1024,
            )
            limit = pages
        except OSError as exc:
            log.info(
                "could not raise fs.fuse.max_pages_limit (%s): READs of up to %d KiB", exc, limit * PAGE_BYTES // 1024
            )
    return limit


def pyfuse3_session(fuse_fd: Optional[int]) -> Optional[int]:
    """The address of pyfuse3's libfuse session (find_session), found once for the
    modules that use it (this one, requestloop.py); None where it is not found (a
    failed search logged)."""
    if fuse_fd is None or POINTER_BYTES != 8:  # (the search reads 64-bit words)
        return None
    try:
        return find_session(fuse_fd, code_ranges(os.path.realpath(pyfuse3.__file__)))
    except Exception:  # noqa: BLE001 - (a layout not foreseen: nothing is written)
        log.exception("looking for libfuse's session failed")
        return None


def ask_for_large_reads(session: Optional[int], stats) -> int:
    """Before pyfuse3.main (the session has read no request yet): have INIT ask for READs
    of REQUEST_BYTES. `session`: pyfuse3_session's. The largest READ the kernel will
    send (bytes)."""
    default_bytes = LIBFUSE_MAX_PAGES * PAGE_BYTES
    field = None
    if session is not None:
        try:
            field = bufsize_field(session, code_ranges(os.path.realpath(pyfuse3.__file__)))
        except Exception:  # noqa: BLE001 - (a layout not foreseen: READs stay as they were)
            log.exception("looking for libfuse's buffer size failed")
    if field is None:
        log.info("libfuse's session was not found where expected: READs of up to %d KiB", default_bytes // 1024)
        return default_bytes
    ctypes.c_size_t.from_address(field).value = REQUEST_BYTES + BUFFER_HEADER_BYTES
    limit = _raise_max_pages_limit(REQUEST_BYTES // PAGE_BYTES)
    largest_bytes = min(REQUEST_BYTES, (limit or LIBFUSE_MAX_PAGES) * PAGE_BYTES)
    stats["fuse.max_read_bytes"] = largest_bytes
    return largest_bytes
