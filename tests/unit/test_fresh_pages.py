"""Fresh receive buffers faulted in before their GETs (bucketfs/backends/pages.py): in
one call, off the event loop, counted only where pages were missing."""

import resource
import threading

import pytest

from bucketfs.backends.pages import FreshPages
from bucketfs.core.partbuffers import new_part_buffer

pytestmark = pytest.mark.timeout(30)
MiB = 1024 * 1024


def thread_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_a_fresh_buffer_is_faulted_in_at_once_and_counted_once():
    fresh = FreshPages()
    buf = new_part_buffer(8 * MiB)
    fresh.fault_in(buf)
    assert (fresh.buffers, fresh.bytes) == (1, 8 * MiB) and fresh.cpu_s > 0
    body = bytes(range(256)) * (8 * MiB // 256)
    before = thread_faults()
    memoryview(buf)[:] = body  # the body landing
    assert thread_faults() - before < 16  # (2,048 4 KiB pages, had they been missing)
    fresh.fault_in(buf)  # reused from the pool: its pages are there
    assert (fresh.buffers, fresh.bytes) == (1, 8 * MiB)
    assert buf[:3] == b"\x00\x01\x02"  # (faulting in again changes no byte)


def test_heap_buffers_are_left_to_their_receive():
    fresh = FreshPages()
    fresh.fault_in(new_part_buffer(1 * MiB))  # (below a huge page: a bytearray)
    fresh.fault_in(bytearray(4 * MiB))
    assert (fresh.buffers, fresh.bytes, fresh.cpu_s) == (0, 0, 0.0)


def test_buffers_faulted_in_from_many_threads_are_all_counted():
    fresh = FreshPages()
    buffers = [new_part_buffer(2 * MiB) for _ in range(16)]
    threads = [threading.Thread(target=fresh.fault_in, args=(buf,)) for buf in buffers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert (fresh.buffers, fresh.bytes) == (16, 32 * MiB)
