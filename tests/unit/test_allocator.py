"""The daemon's heap gives freed memory back: a trim returns the holes that buffers of
many sizes leave in the middle of the heap, which glibc keeps resident by itself.

Each case runs in a fresh interpreter, so the heap it measures is its own.
"""

import subprocess
import sys
import textwrap

import pytest

from bucketfs import allocator

FRAGMENT_HEAP = textwrap.dedent("""
    import random, sys
    from bucketfs import allocator
    allocator.tune()
    def rss_mib():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
    rng = random.Random(1)
    # Buffers below the mmap threshold (on the heap), every other one freed, with a
    # small live object after each so the holes are not at the heap's top.
    buffers, pins = [], []
    for _ in range(400):
        buffers.append(bytearray(rng.randrange(64 * 1024, allocator.MMAP_THRESHOLD_BYTES - 8192)))
        pins.append(bytearray(64))
    for i in range(0, len(buffers), 2):
        buffers[i] = None
    before = rss_mib()
    trimmed = allocator.give_back(int(sys.argv[1]))
    print(before, rss_mib(), trimmed)
""")


def run_fragmented(slack_bytes: int):
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENT_HEAP, str(slack_bytes)], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    return float(out[0]), float(out[1]), out[2] == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_give_back_returns_free_heap_pages():
    before_mib, after_mib, trimmed = run_fragmented(allocator.TRIM_SLACK_BYTES)
    # ~200 holes of 64 KiB-1 MiB: ~100 MiB free in the middle of the heap.
    assert trimmed
    assert before_mib - after_mib > 60, (before_mib, after_mib)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_free_memory_within_the_slack_is_left_alone():
    before_mib, after_mib, trimmed = run_fragmented(1 << 40)
    assert not trimmed
    assert before_mib - after_mib < 10, (before_mib, after_mib)
