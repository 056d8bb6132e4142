"""Skip OPENDIR and RELEASEDIR in the immutable default: the kernel opens directories itself.

With FOPEN_CACHE_DIR (dircache.py) a directory read again costs no READDIR, but
every opendir() still cost an OPENDIR and a RELEASEDIR round trip through pyfuse3:
402 of them for a cached walk of 200 folders, a third of its time. Answering OPENDIR
with ENOSYS makes the kernel stop sending both for the mount (its `no_opendir`), and
treat every directory as opened with FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR. READDIRPLUS
then arrives with handle 0, and pyfuse3 passes `readdir` only the handle: the inode
that libfuse gives pyfuse3's C handler is dropped there.

So this module puts a small handler in front of pyfuse3's READDIRPLUS in the
session's table of operations: it notes (request, inode) and calls pyfuse3's, which
then runs bucketfs's `readdir` at once, in the same call (no trio checkpoint between);
`readdir` takes the inode noted for its own request, matched through the request
pointer in pyfuse3's ReaddirToken.

Nothing here is assumed unchecked. The session comes from the OPENDIR request
(libfuse's `fuse_req` starts with its session pointer in every 3.x release); the table
is recognised by its contents: at one offset near the session's start, the 44 slots
of libfuse 3's `fuse_lowlevel_ops` must hold exactly pyfuse3 3.x's pattern (33
handlers inside pyfuse3's own code, 11 NULL). Anything else and nothing is written:
OPENDIR is answered as before (dircache.py's flags). Only listings that never
change may be kept this way, so a --metadata-ttl mount never uses it; nor does a
--kernel-dir-cache off mount, or one on an untested pyfuse3 (dircache.py's
`private_layouts_allowed`).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
from typing import Callable, Optional

import pyfuse3

log = logging.getLogger(__name__)

POINTER_BYTES = ctypes.sizeof(ctypes.c_void_p)
# libfuse 3's struct fuse_lowlevel_ops, in order (fuse_lowlevel.h, 3.0-3.18): the
# first 44 slots; later releases add slots after these only.
LOWLEVEL_OPS = (
    "init",
    "destroy",
    "lookup",
    "forget",
    "getattr",
    "setattr",
    "readlink",
    "mknod",
    "mkdir",
    "unlink",
    "rmdir",
    "symlink",
    "rename",
    "link",
    "open",
    "read",
    "write",
    "flush",
    "release",
    "fsync",
    "opendir",
    "readdir",
    "releasedir",
    "fsyncdir",
    "statfs",
    "setxattr",
    "getxattr",
    "listxattr",
    "removexattr",
    "access",
    "create",
    "getlk",
    "setlk",
    "bmap",
    "ioctl",
    "poll",
    "write_buf",
    "retrieve_reply",
    "forget_multi",
    "flock",
    "fallocate",
    "readdirplus",
    "copy_file_range",
    "lseek",
)
# What pyfuse3 (3.x, init_fuse_ops) fills in; every other slot is NULL.
PYFUSE3_OPS = frozenset(
    (
        "init",
        "lookup",
        "forget",
        "getattr",
        "setattr",
        "readlink",
        "mknod",
        "mkdir",
        "unlink",
        "rmdir",
        "symlink",
        "rename",
        "link",
        "open",
        "read",
        "write",
        "flush",
        "release",
        "fsync",
        "opendir",
        "readdirplus",
        "releasedir",
        "fsyncdir",
        "statfs",
        "setxattr",
        "getxattr",
        "listxattr",
        "removexattr",
        "access",
        "create",
        "forget_multi",
        "write_buf",
        "poll",
    )
)
READDIRPLUS_SLOT = LOWLEVEL_OPS.index("readdirplus")
# The table sits after a few fields of struct fuse_session (mountpoint, exited, fd,
# io, mo, debug, deny_others: 40 bytes in 3.14); look a little further either way.
OPS_OFFSET_MAX_BYTES = 128
# What find_ops_table reads of the session (struct fuse_session is larger: ~1 KiB).
SESSION_READ_BYTES = OPS_OFFSET_MAX_BYTES + len(LOWLEVEL_OPS) * POINTER_BYTES
# pyfuse3's ReaddirToken: the PyObject header, then `fuse_req_t req`.
TOKEN_REQ_OFFSET = object.__basicsize__
# Noted requests whose READDIR never ran (pyfuse3 answered it itself): dropped past this.
NOTED_MAX_COUNT = 1024

_READDIRPLUS_C = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64, ctypes.c_void_p
)
# pyfuse3's own handler is Cython code that needs the GIL: called without releasing it.
_READDIRPLUS_PY = ctypes.PYFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64, ctypes.c_void_p
)


def mappings():
    """(start, end, permissions, path) of every mapping of this process."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            yield start, end, fields[1], fields[5].strip() if len(fields) == 6 else ""


def code_ranges(path: str) -> list:
    """[start, end) of every executable mapping of `path` in this process."""
    real = os.path.realpath(path)
    return [
        (start, end)
        for start, end, perms, mapped in mappings()
        if perms[2] == "x" and mapped.startswith("/") and os.path.realpath(mapped) == real
    ]


def readable_now(maps=None) -> Callable[[int, int], bool]:
    """readable(), against one reading of this process's mappings (`maps`: mappings()'s,
    already read): for checking many pointers at once."""
    ranges = sorted(
        (start, end) for start, end, perms, _path in (maps if maps is not None else mappings()) if perms[0] == "r"
    )
    starts = [start for start, _ in ranges]

    def check(address: int, size_bytes: int) -> bool:
        i = bisect.bisect_right(starts, address) - 1
        return i >= 0 and address + size_bytes <= ranges[i][1]

    return check


def readable(address: int, size_bytes: int) -> bool:
    """Whether [address, address + size_bytes) lies in one readable mapping: a pointer
    that is not what it should be is refused here instead of crashing the daemon."""
    return readable_now()(address, size_bytes)


def find_ops_table(session: int, code: list) -> Optional[int]:
    """The address of pyfuse3's operation table inside the session at `session`, or
    None if no offset holds exactly pyfuse3's pattern."""

    def in_code(pointer: int) -> bool:
        return any(start <= pointer < end for start, end in code)

    for offset in range(0, OPS_OFFSET_MAX_BYTES + POINTER_BYTES, POINTER_BYTES):
        table = session + offset
        slots = (ctypes.c_void_p * len(LOWLEVEL_OPS)).from_address(table)
        if all(
            (slot is not None and in_code(slot)) if name in PYFUSE3_OPS else slot is None
            for name, slot in zip(LOWLEVEL_OPS, slots)
        ):
            return table
    return None


class KernelOpensDirs:
    """Answers OPENDIR with ENOSYS once READDIRPLUS can be told which directory it reads."""

    def __init__(self, stats) -> None:
        self.stats = stats
        self.active = False
        self.refused = False  # tried once and not possible: never again for this mount
        self._noted: dict = {}  # request pointer -> inode, from the READDIRPLUS handler
        self._handler: Optional[tuple] = None  # the C callable in the table: kept alive as long as the mount
        self.table: Optional[int] = None  # pyfuse3's table of operations, once found

    def skips_opendir(self, request_of: Callable[[], Optional[int]], code: Optional[list] = None) -> bool:
        """Whether to answer this OPENDIR with ENOSYS (and so every later one). The
        first time, `request_of()` gives the OPENDIR's libfuse request pointer (None if
        dircache.py could not read it) and the READDIRPLUS handler is put in place;
        after that the answer is remembered. `code`: where handlers may point (default:
        pyfuse3's executable mappings)."""
        if self.active:
            return True
        if self.refused:
            return False
        request = request_of()
        table = None
        try:
            if request and readable(request, POINTER_BYTES):
                session = ctypes.c_void_p.from_address(request).value
                code = code_ranges(pyfuse3.__file__) if code is None else code
                if session and code and readable(session, SESSION_READ_BYTES):
                    table = find_ops_table(session, code)
        except (OSError, ValueError, IndexError) as exc:  # /proc/self/maps unreadable or odd: off
            log.debug("reading this process's mappings: %s", exc)
        if table is None:
            self.refused = True
            log.warning(
                "pyfuse3's session is not laid out as expected (pyfuse3 %s): every opendir() "
                "still costs an OPENDIR and a RELEASEDIR",
                getattr(pyfuse3, "__version__", "?"),
            )
            return False
        slot = ctypes.c_void_p.from_address(table + READDIRPLUS_SLOT * POINTER_BYTES)
        original = _READDIRPLUS_PY(slot.value or 0)  # (not NULL: checked with the table above)
        noted = self._noted

        def readdirplus(req, ino, size, off, fi):
            try:
                if len(noted) >= NOTED_MAX_COUNT:
                    noted.clear()
                noted[req] = ino
            finally:
                original(req, ino, size, off, fi)  # always: a request must get its reply

        handler = _READDIRPLUS_C(readdirplus)
        self._handler = (handler, original)
        slot.value = ctypes.cast(handler, ctypes.c_void_p).value
        self.table = table  # (noopen.py puts its READ handler in it too)
        self.active = True
        self.stats["namespace.kernel_opens_dirs"] = 1
        log.debug("OPENDIR answered ENOSYS: the kernel opens directories and keeps their listings")
        return True

    def inode_of(self, token) -> Optional[int]:
        """The directory a handle-less READDIRPLUS reads (`token`: pyfuse3's
        ReaddirToken for it), as the handler noted it; None if it did not."""
        if type(token) is not pyfuse3.ReaddirToken or type(token).__basicsize__ < TOKEN_REQ_OFFSET + POINTER_BYTES:
            return None
        req = ctypes.c_void_p.from_address(id(token) + TOKEN_REQ_OFFSET).value
        return self._noted.pop(req, None)
