"""Processes and the machine: the page cache, CPU seconds (a process's, this one's,
everyone else's, the hypervisor's steal), memory (VmRSS, VmHWM; a sampler of a
daemon's peak) and the mount table."""

from __future__ import annotations

import contextlib
import os
import threading

from bucketfs.testing.mounting import drop_page_cache


def drop_caches() -> bool:
    os.sync()
    return drop_page_cache()


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and the processes below it that are still running."""
    total_s = 0.0
    for member in _descendants(pid):
        with contextlib.suppress(OSError):  # (exited meanwhile)
            total_s += proc_cpu_s(member)
    return total_s


class CpuCensus:
    """CPU seconds of every process on the machine, split into this benchmark's (this
    process and its descendants: daemon, proxy, server, webdataset workers) and the
    others' (a shared machine: other people's tests). Exited processes are missed."""

    def __init__(self):
        self.me = os.getpid()
        self.tick = os.sysconf("SC_CLK_TCK")
        self.snapshot = self._take()

    def _take(self) -> dict:
        procs = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            procs[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self.tick)
        return procs

    def others_s(self) -> float:
        """Others' CPU seconds since the last call."""
        now = self._take()
        ours = {self.me}
        changed = True
        while changed:  # descendants of this process, whatever their depth
            changed = False
            for pid, (ppid, _) in now.items():
                if ppid in ours and pid not in ours:
                    ours.add(pid)
                    changed = True
        total = 0.0
        for pid, (_ppid, cpu) in now.items():
            if pid not in ours and pid != 2 and _ppid != 2:  # kthreadd's children are kernel threads
                total += cpu - self.snapshot.get(pid, (0, 0.0))[1]
        self.snapshot = now
        return max(total, 0.0)


def machine_cpu_s() -> tuple[float, float]:
    """Busy and idle CPU seconds of the whole machine since boot (/proc/stat; idle includes iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"), idle / os.sysconf("SC_CLK_TCK")


def steal_s() -> float:
    """CPU seconds the hypervisor gave other guests while this VM wanted them (all CPUs,
    `steal` in /proc/stat): a slow host that no process here accounts for."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def self_cpu_s() -> float:
    """This process's CPU seconds, with its children that were waited for (webdataset runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def proc_status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def is_mounted(path: str) -> bool:
    """From the mount table, without touching the mount (a hung daemon cannot block this)."""
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


class RssSampler:
    """Samples a process's VmRSS every 50 ms in a thread; peak in bytes. And the memory
    of it with its children (a daemon and its fetch-ahead workers), `tree_peak_bytes`:
    tree_memory_bytes."""

    def __init__(self, pid: int, interval_s: float = 0.05):
        self.pid, self.interval_s = pid, interval_s
        self.peak_bytes = 0
        self.tree_peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.peak_bytes = max(self.peak_bytes, proc_status_kib(self.pid, "VmRSS") * 1024)
                self.tree_peak_bytes = max(self.tree_peak_bytes, tree_memory_bytes(self.pid))
            self._stop.wait(self.interval_s)


def tree_memory_bytes(pid: int) -> int:
    """The memory of `pid` and its children, each page once: their private and file
    pages' PSS (shared pages split between the processes that map them), plus the
    resident pages of the memfds `pid` holds (the fetch-ahead workers' shared arena,
    counted whole, whoever maps it: not through PSS)."""
    total_bytes = 0
    for member in _descendants(pid):
        with contextlib.suppress(OSError):
            with open(f"/proc/{member}/smaps_rollup") as f:
                for line in f:
                    name, _, value = line.partition(":")
                    if name in ("Pss_Anon", "Pss_File"):
                        total_bytes += int(value.split()[0]) * 1024
    fd_dir = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for name in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                if os.readlink(f"{fd_dir}/{name}").startswith("/memfd:"):
                    total_bytes += os.stat(f"{fd_dir}/{name}").st_blocks * 512
    return total_bytes


def parse_cpus(text: str) -> set:
    """CPU numbers written as taskset -c does ("1", "0,2", "2-3"); ValueError if not."""
    cpus: set = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    if not cpus:
        raise ValueError(text)
    return cpus


def _descendants(pid: int) -> set:
    """`pid` and every process below it (from /proc: children started so far)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
    tree, changed = {pid}, True
    while changed:
        changed = False
        for child, parent in parents.items():
            if parent in tree and child not in tree:
                tree.add(child)
                changed = True
    return tree


def pin_tree(pid: int, cpus: set) -> int:
    """Every thread of `pid` and of the processes below it runs on `cpus` from now on
    (threads and processes they start later inherit it); how many threads were pinned."""
    pinned = 0
    for proc in _descendants(pid):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{proc}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)
                    pinned += 1
    return pinned
