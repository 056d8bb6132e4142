"""Fresh receive buffers: their pages faulted in before a GET, and what that cost."""

from __future__ import annotations

import ctypes
import mmap
import resource
import threading
import time

MADV_POPULATE_WRITE = 23  # (Linux 5.14; Python's mmap module may lack the name)
_libc = ctypes.CDLL(None, use_errno=True)  # (its calls let go of the GIL; mmap.madvise keeps it)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class FreshPages:
    """What faulting in fresh receive buffers cost, counted from the GET threads.

    A part buffer new to the daemon (a mapping of its own: partbuffers.new_part_buffer)
    has no pages yet; the kernel faults them in as the body lands. `fault_in` does that
    in one call just before the GET, and counts the buffers whose pages were missing
    and the CPU they took: the machine's price for new memory, not the read's (~0.05 ms
    per MiB where the memory is the guest's already; ~2-3 ms where a VM's host took the
    pages its guest freed back and backs them again, free page reporting; ad hoc,
    2026-11-29). The bench takes that CPU out of a stream's bound."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (from every GET thread)
        self.buffers = 0
        self.bytes = 0
        self.cpu_s = 0.0

    def fault_in(self, buffer) -> None:
        if not isinstance(buffer, mmap.mmap):
            return  # (a heap buffer, below a huge page: its receive faults it in)
        faults_before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        started_s = time.thread_time()
        address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        if _libc.madvise(address, len(buffer), MADV_POPULATE_WRITE) != 0:
            return  # (before Linux 5.14: the receive faults them in)
        cpu_s = time.thread_time() - started_s
        if resource.getrusage(resource.RUSAGE_THREAD).ru_minflt == faults_before:
            return  # a pooled buffer: its pages are there
        with self._lock:
            self.buffers += 1
            self.bytes += len(buffer)
            self.cpu_s += cpu_s
