"""Shared memory that fetch-ahead workers receive pushed files into (workerengine.py),
so that the daemon keeps a copy of each pushed file with no byte crossing a socket or
the serving thread: after the worker checked the body and wrote it into the kernel,
the same pages are the daemon's copy (a KeptBody, for an epoch after the kernel
dropped its page cache).

One memfd, mapped by every worker; the daemon reads kept copies out of it with pread
(one copy per READ, as the kernel's own copy of a reply; nothing it replies from can
change under it, and the pages never count in its RSS). The daemon alone hands out its
extents, as a ring: each new extent goes right after the newest one, and space comes
back as the oldest ones go. Kept copies are the oldest in the steady state of a pass,
so the ring reuses the pages a dropped copy leaves, still resident: no page fault and
no zeroing in the worker (a fresh shared page costs ~3 us, ~75 us per 100 KB file).

Invariants:
- Only a worker writes an extent, only while the extent is IN_FLIGHT for it; the
  daemon takes it back (free, or KEPT) only when that worker says it is done with it
  (its DONE, or a RELEASED after it sent a body the daemon asked for), or once the
  worker's process has exited (LOST until then: a worker killed inside a write into
  the kernel still reads its extent until that write returns). So an extent is never
  written by two, and a kept copy never changes.
- The daemon's memory budget covers in-flight and kept extents (their callers reserve
  them). Free pages stay resident (reused next) until `trim` gives back those free for
  a whole interval, or a caller frees with `give_back` (memory going to others).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
from typing import Callable, Optional

log = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE
IN_FLIGHT, KEPT, FREE, LOST = "in flight", "kept", "free", "lost"
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2


class Extent:
    __slots__ = ("offset", "length_bytes", "state", "body", "proc", "returned")

    def __init__(self, offset: int, length_bytes: int):
        self.offset, self.length_bytes = offset, length_bytes
        self.state = IN_FLIGHT
        self.body: Optional[ArenaBody] = None  # while KEPT
        self.proc = None  # while LOST: the worker's Popen, whose exit frees it
        self.returned = False  # (IN_FLIGHT) its worker is done with it: the daemon's to keep or free


class ArenaBody:
    """A kept copy in the arena: `length_bytes` at its extent (base.KeptBody's
    interface: this layer imports no other backend module)."""

    __slots__ = ("_arena", "_extent", "length_bytes", "on_dropped")

    def __init__(self, arena: "PushArena", extent: Extent, length_bytes: int):
        self._arena, self.length_bytes = arena, length_bytes
        self._extent: Optional[Extent] = extent  # (None once discarded or taken back)
        self.on_dropped: Optional[Callable[[], None]] = None  # (set by its keeper)

    def read(self, start: int, end: int) -> Optional[bytes]:
        """A copy of bytes [start, end): pread from the memfd, one copy and no page
        fault (the daemon never maps these pages: nothing of it can change under a
        reply, and its RSS is its own)."""
        extent = self._extent
        if extent is None or self._arena.closed:
            return None
        end = min(end, self.length_bytes)
        return os.pread(self._arena.fd, max(end - start, 0), extent.offset + start)

    def discard(self, give_back: bool) -> None:
        extent, self._extent = self._extent, None
        if extent is not None:
            self._arena.free(extent, give_back)


class PushArena:
    def __init__(self, size_bytes: int):
        self.size_bytes = size_bytes // PAGE_BYTES * PAGE_BYTES
        # (The daemon does not map it: it reads kept copies with pread.)
        self.fd = os.memfd_create("bucketfs-push-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size_bytes)
        except OSError:
            os.close(self.fd)
            raise
        self.closed = False
        self._ring: collections.deque = collections.deque()  # extents, oldest first
        self._head = 0  # where the next extent goes (right after the newest)
        self.live_bytes = 0  # in flight, kept or lost
        self._idle: list = []  # the free spans at the last trim: [(start, end)]
        self._libc = ctypes.CDLL(None, use_errno=True)

    def allocate(self, n_bytes: int) -> Optional[Extent]:
        """An extent of at least `n_bytes` for a worker to write, or None when the ring
        has no room even after its oldest kept copies went (each body's `on_dropped` is
        called: its owner forgets it)."""
        length = -(-n_bytes // PAGE_BYTES) * PAGE_BYTES
        if self.closed or not 0 < length <= self.size_bytes:
            return None
        while True:
            at = self._fit(length)
            if at is not None:
                extent = Extent(at, length)
                self._ring.append(extent)
                self._head = at + length
                self.live_bytes += length
                return extent
            oldest = self._ring[0]
            if oldest.state == KEPT:
                body = oldest.body
                assert body is not None
                body.discard(give_back=False)  # (frees it: its pages are the next extent's)
                if body.on_dropped is not None:
                    body.on_dropped()
            elif oldest.state == LOST and oldest.proc.poll() is not None:
                self._release(oldest)
            else:
                return None  # the oldest is still a worker's
            self._pop_free()

    def _fit(self, length: int) -> Optional[int]:
        if not self._ring:
            self._head = 0
            return 0
        tail, head = self._ring[0].offset, self._head
        if head > tail:  # free: [head, end) and [0, tail)
            if length <= self.size_bytes - head:
                return head
            return 0 if length <= tail else None
        return head if length <= tail - head else None  # free: [head, tail)

    def keep(self, extent: Extent, length_bytes: int) -> ArenaBody:
        """The worker is done with `extent`, whose first `length_bytes` are a pushed file."""
        extent.state = KEPT
        extent.body = ArenaBody(self, extent, length_bytes)
        return extent.body

    def free(self, extent: Extent, give_back: bool = False) -> None:
        """No one uses `extent` any more; with `give_back`, its pages go back to the
        system now (the memory is going to others), else they are kept for reuse."""
        if extent.state == FREE:
            return
        self._release(extent)
        if give_back:
            self._punch(extent.offset, extent.offset + extent.length_bytes)
        self._pop_free()

    def lose(self, extent: Extent, proc) -> None:
        """The worker writing `extent` was killed: free once `proc` has exited."""
        if proc.poll() is not None:
            self.free(extent)
        else:
            extent.state, extent.proc = LOST, proc

    def _release(self, extent: Extent) -> None:
        extent.state, extent.body, extent.proc = FREE, None, None
        self.live_bytes -= extent.length_bytes

    def _pop_free(self) -> None:
        ring = self._ring
        while ring and ring[0].state == FREE:
            ring.popleft()

    def free_spans(self) -> list:
        """[(start, end)] not in any live extent, in offset order."""
        spans, at = [], 0
        for extent in sorted((e for e in self._ring if e.state != FREE), key=lambda e: e.offset):
            if extent.offset > at:
                spans.append((at, extent.offset))
            at = extent.offset + extent.length_bytes
        if at < self.size_bytes:
            spans.append((at, self.size_bytes))
        return spans

    def trim(self) -> int:
        """Give back the pages free since the last trim (reuse takes free pages within
        an interval; pages idle that long hold memory the budget no longer counts);
        the bytes of the spans punched."""
        if self.closed:
            return 0
        spans = self.free_spans()
        punched_bytes = 0
        previous, i = self._idle, 0
        for start, end in spans:
            while i < len(previous) and previous[i][1] <= start:
                i += 1
            j = i
            while j < len(previous) and previous[j][0] < end:
                lo, hi = max(start, previous[j][0]), min(end, previous[j][1])
                if lo < hi:
                    self._punch(lo, hi)
                    punched_bytes += hi - lo
                j += 1
        self._idle = spans
        return punched_bytes

    def _punch(self, start: int, end: int) -> None:
        if self.closed:
            return
        flags = _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE
        if self._libc.fallocate(self.fd, flags, ctypes.c_long(start), ctypes.c_long(end - start)) != 0:
            log.debug("giving back push arena pages: %s", os.strerror(ctypes.get_errno()))

    def close(self) -> None:
        """Close (kept copies read nothing from then on: read() is None); the workers'
        mappings keep the memory until they exit."""
        if self.closed:
            return
        self.closed = True
        os.close(self.fd)
