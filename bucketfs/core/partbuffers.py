"""Buffers that read-ahead parts are received into, and the pool that reuses them.

Buffers: a part of 1 MiB or more is received into a reused buffer (`BufferPool`)
where the backend receives straight into one (`Backend.receives_into`),
still counted in the budget while it waits for reuse. A fresh buffer costs page
faults and zeroing to fill and an munmap to free (a third of the daemon's CPU when
streaming shards, before fresh ones became huge-page mappings: `new_part_buffer`;
the kernel zeroing fresh pages was still 15% of it after, over 8 shards).
A part's buffer is its size rounded up to a power of two (at most the part size),
and reserves all of it, so the pool holds a few sizes that later parts fit, never
the odd sizes of shard ends.
A buffer is reused only once nothing else refers to it (no memoryview handed to a
reply or held by a waiter), so a reused buffer never changes bytes someone still
reads. One freed while a reply thread still sends from it waits in the pool until
that view is gone (streaming shards, about a quarter of the parts end so), rather
than being unmapped and replaced by fresh memory the kernel must zero. Nothing is
pooled while a reader is waiting for memory (it is released to that reader).
"""

from __future__ import annotations

import contextlib
import mmap
import sys
from typing import Optional

MiB = 1024 * 1024
# Free part buffers kept for reuse: a reader's window turns over one part at a time,
# so a few suffice; bounded so an idle mount holds little.
POOLED_BYTES_MAX = 64 * MiB
# Smaller parts are cheap to allocate (below glibc's mmap threshold in practice).
POOLED_BUFFER_MIN_BYTES = 1 * MiB
HUGE_PAGE_BYTES = 2 * MiB  # x86-64 and arm64 (4 KiB base pages) transparent huge page


def new_part_buffer(size_bytes: int) -> bytearray | mmap.mmap:
    """A fresh, writable buffer to receive one part into.

    Why not `bytearray(size_bytes)`: it zero-fills the whole buffer on the trio
    thread with the GIL held, taking a page fault per 4 KiB (2,048 for an 8 MiB
    part). With four shard readers that was ~30% of the daemon's CPU (perf: page
    faults, memset, memcg charging). A private anonymous mapping is not touched
    here: its pages are faulted in by the GET's receive, in a worker thread
    without the GIL, and with transparent huge pages (MADV_HUGEPAGE; the kernel
    aligns large private mappings) an 8 MiB part takes 4 faults instead of 2,048.
    Below one huge page, the heap is cheaper. (Where the kernel must compact memory
    to find a huge page, that stall is in the receiving worker thread too.)
    """
    if size_bytes < HUGE_PAGE_BYTES:
        return bytearray(size_bytes)
    buf = mmap.mmap(-1, size_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP on this kernel: 4 KiB pages
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


class BufferPool:
    """Free part buffers for reuse, in a few sizes: powers of two up to the part size
    (`buffer_bytes`), and the part size. Their bytes stay reserved in the budget while
    pooled (they are still resident) and are the first memory reclaimed."""

    RECLAIM_PRIORITY = -1

    def __init__(self, budget, stats, buffer_bytes: int, max_bytes: int = POOLED_BYTES_MAX):
        self.budget, self.stats, self.max_bytes = budget, stats, max_bytes
        self.buffer_bytes = buffer_bytes
        self.pooled_bytes = 0  # free and viewed buffers, all still reserved
        self._free: dict = {}  # buffer size in bytes -> [buffer]
        self._viewed: list = []  # pooled buffers a view still refers to: not reusable yet
        budget.add_reclaimer(self.RECLAIM_PRIORITY, self.shed)

    def held_bytes(self, size_bytes: int) -> int:
        """The size of the buffer a part of `size_bytes` is received into: rounded up to
        a power of two, at most the part size (at most 2x its bytes). A shard's odd last
        part or a demand part then leaves a buffer later parts fit."""
        if size_bytes > self.buffer_bytes:
            return size_bytes
        return min(1 << (size_bytes - 1).bit_length(), self.buffer_bytes)

    def take(self, size_bytes: int) -> Optional[bytearray | mmap.mmap]:
        """A free buffer for a part of this size, its budget reservation passing to the caller."""
        size_bytes = self.held_bytes(size_bytes)
        free = self._free.get(size_bytes)
        if not free and self._viewed:
            self._settle()
            free = self._free.get(size_bytes)
        if not free:
            return None
        buf = free.pop()
        self.pooled_bytes -= len(buf)
        self.stats["prefetch.buffers_reused"] += 1
        return buf

    def give(self, buf: bytearray | mmap.mmap) -> bool:
        """Keep `buf` (and its reservation) for reuse; False if the caller must release it.
        The caller holds the only other reference (one local name): any more is a
        memoryview or a waiter still reading it, and writing into it would change their bytes."""
        if self.budget.demand_pending:
            return False  # a reader is waiting for memory: release it to them
        if self.pooled_bytes + len(buf) > self.max_bytes:
            return False
        if sys.getrefcount(buf) > 3:  # the caller's name, this argument, getrefcount's argument
            self.stats["prefetch.buffers_still_viewed"] += 1
            self._viewed.append(buf)
        else:
            self._free.setdefault(len(buf), []).append(buf)
        self.pooled_bytes += len(buf)
        return True

    def _settle(self) -> None:
        """Viewed buffers whose views are gone become free for reuse."""
        still = []
        for buf in self._viewed:
            if sys.getrefcount(buf) > 3:  # self._viewed, the loop's name, getrefcount's argument
                still.append(buf)
            else:
                self._free.setdefault(len(buf), []).append(buf)
        self._viewed = still

    def shed(self, wanted_bytes: int) -> int:
        """Release pooled buffers' reservations, the viewed ones first (their memory
        goes when their last view does, as an unpooled buffer's would)."""
        freed_bytes = 0
        for free in (self._viewed, *self._free.values()):
            while free and freed_bytes < wanted_bytes:
                size_bytes = len(free.pop())
                self.pooled_bytes -= size_bytes
                self.budget.release(size_bytes)
                freed_bytes += size_bytes
        return freed_bytes
