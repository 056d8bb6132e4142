"""Skip OPEN and RELEASE in the immutable default: the kernel opens files itself.

Every file a loader reads cost an OPEN and a RELEASE round trip besides its READs
(0.073 ms of daemon CPU a pair, measured on a real mount), and a warm epoch, whose
bytes all come from the page cache, cost nothing else: the daemon's work for it was
only those. Answering OPEN with ENOSYS makes the kernel stop sending both for the
mount (its `no_open`) and treat every file as opened with FOPEN_KEEP_CACHE, which is
what OPEN answered anyway: a warm epoch then never reaches the daemon.

READs then arrive with handle 0, and pyfuse3 passes `read` only the handle, not the
inode libfuse gives its C handler. So this module puts a small handler in front of
pyfuse3's READ in the session's table of operations (found by noopendir.py): it
writes `INODE_FH | inode` into the request's `fuse_file_info.fh` when that is 0,
before pyfuse3's handler copies it. `read` then reads by inode (Filesystem.read_inode).

Nothing here is assumed unchecked. The handler is put in place in observing mode
first: it notes the `fh` it finds at FH_OFFSET of each READ's `fuse_file_info`, and
OPEN is answered with ENOSYS only once VERIFY_COUNT READs of handles bucketfs gave
out were seen there (so the offset is the one the running libfuse uses). Until then,
and if the table was never found, files are opened as before.
"""

from __future__ import annotations

import collections
import ctypes
import logging
from typing import Optional

from bucketfs.fuse.noopendir import LOWLEVEL_OPS, POINTER_BYTES

log = logging.getLogger(__name__)

# struct fuse_file_info: `int flags`, the bitfield word, a padding word, then `uint64_t
# fh` at 16 (libfuse 3.0 to 3.18: fuse_common.h). Checked on live READs before use.
FH_OFFSET = 16
# A handle that is an inode: the top bit, above any handle the core or the stats file
# gives out (ops.py's STATS_FH_FIRST is 1 << 62) and any inode (the stats file's are the highest).
INODE_FH = 1 << 63
# READs whose handle must be seen at FH_OFFSET before OPEN is answered with ENOSYS.
VERIFY_COUNT = 3
READ_SLOT = LOWLEVEL_OPS.index("read")

_READ_C = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64, ctypes.c_void_p)
# pyfuse3's own handler is Cython code that needs the GIL: called without releasing it.
_READ_PY = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64, ctypes.c_void_p)


class KernelOpensFiles:
    """Answers OPEN with ENOSYS once READs can be told which file they read."""

    def __init__(self, stats, serve_read=None) -> None:
        """`serve_read(req, fh, off, size)`: once active, READs are offered to it
        before pyfuse3's handler: it returns True if it took one (and replies to `req`
        itself: replies.py); False or an exception, pyfuse3's handler serves it."""
        self.stats = stats
        self.serve_read = serve_read
        self.active = False
        self._seen: collections.deque = collections.deque(maxlen=64)  # handles found at FH_OFFSET
        self._verified_count = 0
        self._handler: Optional[tuple] = None  # the C callable in the table: kept alive as long as the mount
        self.handles_released = False  # the handles the daemon had opened were let go of (no RELEASE comes)

    @property
    def installed(self) -> bool:
        return self._handler is not None

    def install(self, table: int) -> None:
        """Put the READ handler in front of pyfuse3's in the table at `table` (noopendir's
        find_ops_table found and checked it), observing until verified."""
        slot = ctypes.c_void_p.from_address(table + READ_SLOT * POINTER_BYTES)
        original = _READ_PY(slot.value or 0)  # (not NULL: checked with the table)
        seen = self._seen

        def read(req, ino, size, off, fi):
            served = False
            try:
                fh = ctypes.c_uint64.from_address(fi + FH_OFFSET)
                if not self.active:
                    seen.append(fh.value)
                elif fh.value == 0:
                    fh.value = INODE_FH | ino
                # (Once FH_OFFSET is verified, before any OPEN is skipped: the files opened
                # before, a reader streaming its first shard, are served so too.)
                if self.serve_read is not None and self._verified_count >= VERIFY_COUNT:
                    try:
                        served = self.serve_read(req, fh.value, off, size)
                    except Exception:  # noqa: BLE001 - (not taken: pyfuse3's handler answers it)
                        log.exception("serving a READ by its own task failed")
            finally:
                if not served:
                    original(req, ino, size, off, fi)  # always: a request must get its reply

        handler = _READ_C(read)
        self._handler = (handler, original)
        slot.value = ctypes.cast(handler, ctypes.c_void_p).value

    def saw_handle(self, fh: int) -> None:
        """A READ of handle `fh` reached `read` (before OPEN is skipped): one more check
        of FH_OFFSET if the handler found it there."""
        if not self.active and fh in self._seen:
            self._verified_count += 1

    def skips_open(self) -> bool:
        """Whether to answer this OPEN with ENOSYS (and so every later one)."""
        if not self.active and self.installed and self._verified_count >= VERIFY_COUNT:
            self.active = True
            self.stats["namespace.kernel_opens_files"] = 1
            log.debug("OPEN answered ENOSYS: the kernel opens files; READs come by inode")
        return self.active
