"""glibc's allocator, tuned for a daemon whose large buffers come and go.

Two measures keep freed memory from staying resident (the daemon's RSS must stay
within --max-memory plus a fixed overhead however long it runs):
- A fixed mmap threshold, so the largest buffers are mappings of their own,
  returned to the system when freed.
- A periodic `malloc_trim`, which returns the whole free pages in the middle of the
  heap: the heap only shrinks from its top by itself, so the holes that many readers'
  buffers of many sizes leave behind stay resident otherwise (fragmentation, not a
  leak).
Elsewhere than glibc (musl) both are skipped: `libc.so.6` does not load there.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import trio

log = logging.getLogger(__name__)

# glibc's mmap threshold: a block this large that no free chunk of the heap fits gets
# a mapping of its own, returned to the system when freed. Just above a READ reply
# joined from two fetches or parts (at most 1 MiB, on the heap: a fresh mapping would
# page-fault on every copy; a READ inside one is a slice, no allocation),
# and at libfuse's request buffer (1 MiB and a page, malloc'd by each pyfuse3 worker
# task: up to 256 when many requests are in progress, freed as idle ones past 4 end).
MMAP_THRESHOLD_BYTES = 1024 * 1024 + 4096
# How often free heap memory past the slack is given back. A trim with nothing to
# give back costs ~0.2 ms; one that returns ~100 MiB ~8 ms (ad hoc, glibc 2.36). Pages
# given back and used again fault in once more, so not after every free: the pages a
# busy daemon reuses within seconds are refaulted at most once per interval.
TRIM_INTERVAL_S = 5.0
# Free heap bytes left alone: a trim is not worth a call below this.
TRIM_SLACK_BYTES = 16 * 1024 * 1024
# Free bytes at the heap's top that a free() leaves in place (glibc's default, 128 KiB,
# gives them back at once, and fixing the mmap threshold stops glibc raising it): each
# small file's buffer then came from fresh pages, faulted in and zeroed again, ~0.05 ms
# of the main thread per cold 100 KB file (a cold epoch: 0.51-0.53 ms/file against
# 0.54-0.61). The periodic trim above still returns what stays free past the slack.
TRIM_THRESHOLD_BYTES = 32 * 1024 * 1024

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


class _Mallinfo2(ctypes.Structure):
    # struct mallinfo2 (glibc 2.33+): every field a size_t.
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _glibc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune() -> None:
    """Fix the mmap threshold and cap the malloc arenas; before any thread starts.

    glibc raises its mmap threshold after freeing a large block, after which 8 MiB
    parts come from the heap and freed ones stay in RSS. A fixed threshold (which
    also disables the dynamic raise) returns every large buffer to the OS on free.
    At 2 MiB, libfuse's request buffers grew the heap by 1 MiB per worker task
    (one per concurrent request at the peak), and the heap only shrinks from its top,
    so what later reads put there stayed resident: with 64-128 concurrent readers on
    --max-memory 16M the malloc heap reached 107 MiB (72 with 8 readers), and RSS
    crept for minutes. Four arenas, not 8 per core: fewer heaps to fragment. The trim
    threshold is fixed too (TRIM_THRESHOLD_BYTES): trimming the heap's top is left to
    the periodic trim.
    """
    libc = _glibc()
    if libc is None:
        return
    try:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        libc.mallopt(_M_ARENA_MAX, 4)
    except AttributeError:
        pass


def _trimmer() -> Optional[ctypes.CDLL]:
    """glibc with mallinfo2 and malloc_trim declared; None without them (not glibc, or
    one older than 2.33)."""
    libc = _glibc()
    if libc is None:
        return None
    try:
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except AttributeError:
        return None
    return libc


def give_back(slack_bytes: int = TRIM_SLACK_BYTES, libc: Optional[ctypes.CDLL] = None) -> bool:
    """Return the heap's free pages to the system if more than `slack_bytes` are free
    (counting pages given back before); whether a trim ran."""
    if libc is None:
        libc = _trimmer()
    if libc is None or libc.mallinfo2().fordblks <= slack_bytes:
        return False
    # On the caller's thread (the event loop): ctypes lets other threads run meanwhile,
    # and a worker thread would only wait for the same arena locks.
    libc.malloc_trim(0)
    return True


async def trim_periodically(interval_s: float = TRIM_INTERVAL_S, slack_bytes: int = TRIM_SLACK_BYTES) -> None:
    """Until cancelled: every `interval_s`, `give_back` what is free past `slack_bytes`."""
    libc = _trimmer()
    if libc is None:
        log.debug("malloc_trim/mallinfo2 unavailable: the heap is not trimmed")
        return
    while True:
        await trio.sleep(interval_s)
        give_back(slack_bytes, libc)
