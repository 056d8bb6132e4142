"""The fetch-ahead workers' shared memory (bucketfs/backends/http/arena.py): a ring of
extents the daemon hands out, kept copies that give way to new pushes, extents of a
killed worker held until it exited, and pages given back only when idle or asked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bucketfs.backends.http.arena import FREE, KEPT, LOST, PAGE_BYTES, PushArena

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def arena():
    a = PushArena(16 * PAGE_BYTES)
    yield a
    a.close()


def resident_pages(arena: PushArena) -> int:
    return os.fstat(arena.fd).st_blocks * 512 // PAGE_BYTES


def write(arena: PushArena, extent, byte: int) -> None:
    """As a worker receives a body into its extent."""
    os.pwrite(arena.fd, bytes([byte]) * extent.length_bytes, extent.offset)


def test_extents_are_whole_pages_in_ring_order_and_the_ring_is_full_when_the_oldest_is_in_flight(arena):
    first = arena.allocate(1)
    second = arena.allocate(PAGE_BYTES + 1)
    assert (first.offset, first.length_bytes) == (0, PAGE_BYTES)
    assert (second.offset, second.length_bytes) == (PAGE_BYTES, 2 * PAGE_BYTES)
    assert arena.allocate(13 * PAGE_BYTES).offset == 3 * PAGE_BYTES
    assert arena.allocate(1) is None  # (every page is a worker's)
    assert arena.allocate(17 * PAGE_BYTES) is None and arena.allocate(0) is None


def test_a_freed_extent_in_the_middle_is_reused_only_once_the_ring_passes_it(arena):
    a, b, c = (arena.allocate(5 * PAGE_BYTES) for _ in range(3))
    arena.free(b)
    assert arena.allocate(2 * PAGE_BYTES) is None  # (one page at the end; a, the oldest, still in flight)
    arena.free(a)  # the tail moves past a and b
    d = arena.allocate(8 * PAGE_BYTES)
    assert d.offset == 0 and c.offset == 10 * PAGE_BYTES
    assert arena.live_bytes == 13 * PAGE_BYTES


def test_the_oldest_kept_copies_give_way_to_a_new_extent_and_their_keeper_is_told(arena):
    dropped = []
    bodies = []
    for i in range(4):
        extent = arena.allocate(4 * PAGE_BYTES)
        write(arena, extent, i)
        body = arena.keep(extent, 4 * PAGE_BYTES - 10)
        body.on_dropped = lambda i=i: dropped.append(i)
        bodies.append(body)
    extent = arena.allocate(6 * PAGE_BYTES)  # needs the two oldest
    assert extent is not None and extent.offset == 0
    assert dropped == [0, 1]
    assert bodies[0].read(0, 10) is None  # (gone)
    assert bodies[2].read(0, 1 << 20) == bytes([2]) * (4 * PAGE_BYTES - 10)  # a kept copy never changes
    assert bodies[3].read(5, 9) == bytes([3]) * 4
    assert arena.live_bytes == 6 * PAGE_BYTES + 2 * 4 * PAGE_BYTES


def test_a_killed_workers_extent_is_not_reused_until_its_process_has_exited(arena):
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        extent = arena.allocate(16 * PAGE_BYTES)
        arena.lose(extent, proc)
        assert extent.state == LOST
        assert arena.allocate(1) is None  # (its write into the kernel may still read the pages)
    finally:
        proc.stdin.close()
        proc.wait(timeout=20)
    assert arena.allocate(16 * PAGE_BYTES) is not None
    assert extent.state == FREE


def test_a_kept_copy_discarded_to_give_memory_back_frees_its_pages_at_once(arena):
    extent = arena.allocate(8 * PAGE_BYTES)
    write(arena, extent, 7)
    body = arena.keep(extent, 8 * PAGE_BYTES)
    assert extent.state == KEPT and resident_pages(arena) == 8
    assert body.read(0, 8 * PAGE_BYTES) == bytes([7]) * (8 * PAGE_BYTES)
    assert resident_pages(arena) == 8  # (read without mapping: nothing else changes)
    body.discard(give_back=True)
    assert resident_pages(arena) == 0 and arena.live_bytes == 0
    assert body.read(0, 1) is None


def test_trim_gives_back_only_pages_free_since_the_last_trim(arena):
    a = arena.allocate(4 * PAGE_BYTES)
    b = arena.allocate(4 * PAGE_BYTES)
    write(arena, a, 1)
    write(arena, b, 2)
    arena.free(a)  # (kept resident for reuse)
    assert resident_pages(arena) == 8
    arena.trim()  # a's pages were not free at the (absent) last trim: kept
    assert resident_pages(arena) == 8
    arena.trim()  # free a whole interval: given back; b, in flight, untouched
    assert resident_pages(arena) == 4
    assert os.pread(arena.fd, 4 * PAGE_BYTES, b.offset) == bytes([2]) * (4 * PAGE_BYTES)


def test_pages_reused_between_trims_are_not_given_back(arena):
    a = arena.allocate(16 * PAGE_BYTES)
    write(arena, a, 1)
    arena.free(a)
    arena.trim()
    b = arena.allocate(16 * PAGE_BYTES)  # the same pages, a new push
    write(arena, b, 2)
    arena.trim()
    assert resident_pages(arena) == 16


def test_after_close_a_kept_copy_reads_nothing():
    arena = PushArena(4 * PAGE_BYTES)
    body = arena.keep(arena.allocate(PAGE_BYTES), PAGE_BYTES)
    arena.close()
    assert body.read(0, 1) is None
    assert arena.allocate(PAGE_BYTES) is None
