"""Issue 37's measure: the CPU bucketfs spends per unit of work, by thread and process,
and the throughput ceilings it implies.

bucketfs is the daemon and the worker processes it starts: --fetch-workers N fetch
workers, and --fetch-ahead-workers N (default 1) that fetch a shuffled pass's files into
the page cache.
The daemon's main thread runs trio and serves FUSE (every request the kernel sends goes
through it); a libcurl thread ("bucketfs-curl") runs the small GETs, or the fetch
workers run them (fetchworker.py: libcurl and the MD5 on other cores); trio's thread
cache runs the larger GETs (urllib3) and the disk I/O. A per-thread census
(/proc/PID/task/TID/stat) and a census of the daemon's children (/proc/PID/stat)
before and after each bucketfs run split bucketfs's CPU into those roles:

- main: the thread whose id is the process's (trio, the FUSE loop); its CPU comes
  from the daemon's own clock of that thread where its stats say it
  (`process.serving_thread_cpu_s`, read before and after the run), exact where
  /proc counts 10 ms ticks (0.15 s of a W1 run is 15 of them);
- curl: the thread Python names "bucketfs-curl" (py-spy dump names the threads where
  py-spy is installed; else it is the one other thread that keeps the process's own
  name, since trio names its cache's threads for the OS);
- workers: trio's cache threads (named "Trio thread N", or after the function a job
  runs), and the CPU of threads that exited during the run (the process's total less
  its live threads': trio's idle cache threads exit after 10 s; main and curl do not);
- fetch workers: the daemon's worker processes, fetch workers and fetch-ahead
  workers: its children whose command line names bucketfs.backends.http.fetchworker
  or .pushworker (workers that start during the run count from 0),
  and the daemon's reaped children (a worker that dies is replaced, and the daemon's
  cutime and cstime then hold its CPU);
- other: any other thread (none today).

bucketfs's total is the daemon's CPU (all its threads) plus its fetch workers'.

Per run (W1, W2 epochs, W5): CPU per small file (ms) and per GB read (s), of the main
thread and of bucketfs in total, and the bounds they imply: on unlimited cores the
main thread alone caps a mount at 1 / (its CPU per unit), which no extra core lifts; on
N free cores bucketfs also needs its total per unit from N of them: min(1 / main,
N / bucketfs). (Python threads share one GIL, so the daemon's other threads' Python
work is not fully parallel either, though the fetch workers' is: the bound is a
ceiling, not a forecast.) For W5 (small files and shards at once) each figure charges
the whole run to one unit: per file as if the shards were free, per GB over both. The
fetch-workers variant's runs (fetchworkers.py: "<run>, fetch workers N") count the units
of the run they repeat, and have its targets.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Optional

from .common import MB, text_table
from .procs import proc_cpu_s

ROLES = ("main", "curl", "workers", "fetch_workers", "other")
CURL_THREAD_NAME = "bucketfs-curl"  # bucketfs/backends/http/curl.py
# The daemon's worker processes (workerengine.py runs them with `python -m`): fetch
# workers (--fetch-workers) and fetch-ahead workers (--fetch-ahead-workers).
WORKER_MODULES = (b"bucketfs.backends.http.fetchworker", b"bucketfs.backends.http.pushworker")
FREE_CORES = (2, 4, 8)  # bounds printed for these numbers of free cores
# Issue 37's machine-independent targets (per cold ~100 KB file, per GB streamed).
MAIN_MS_PER_FILE = 0.25
MAIN_S_PER_GB = 0.25
DAEMON_MS_PER_FILE = 1.0
GB = 1000 * MB


def task_cpu(pid: int) -> dict:
    """tid -> (comm, user s, system s) of every live thread of `pid`."""
    tick = os.sysconf("SC_CLK_TCK")
    tasks = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return tasks
    for name in tids:
        try:
            with open(f"/proc/{pid}/task/{name}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        tasks[int(name)] = (comm, int(fields[11]) / tick, int(fields[12]) / tick)
    return tasks


def _stat_fields(pid: int) -> Optional[list]:
    """The fields of /proc/PID/stat after the command's name (state first), or None if
    the process is gone; the name is skipped, since it may hold spaces and brackets."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def reaped_children_cpu_s(pid: int) -> float:
    """CPU s (user+sys) of the children `pid` has reaped (cutime + cstime): a fetch
    worker that died and was replaced leaves its CPU there."""
    fields = _stat_fields(pid)
    return 0.0 if fields is None else (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def _is_fetch_worker(pid: int, state: str) -> bool:
    if state == "Z":
        # Exited but not yet reaped: the kernel has emptied its command line, and its
        # CPU reaches the daemon's cutime only when reaped. The daemon starts no other
        # processes while it serves.
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
        return any(module in command for module in WORKER_MODULES)
    except OSError:  # exited meanwhile
        return False


def fetch_workers_cpu(pid: int) -> dict:
    """(worker pid, start ticks) -> CPU s (user+sys) of each fetch worker of the daemon
    `pid`; the start time tells a worker from a later one that got its pid back."""
    tick = os.sysconf("SC_CLK_TCK")
    workers = {}
    for name in os.listdir("/proc"):  # /proc/PID/task/TID/children needs CONFIG_PROC_CHILDREN
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is None or int(fields[1]) != pid or not _is_fetch_worker(int(name), fields[0]):
            continue
        workers[(int(name), int(fields[19]))] = (int(fields[11]) + int(fields[12])) / tick
    return workers


def fetch_workers_snapshot(pid: int) -> tuple:
    """(fetch_workers_cpu, reaped_children_cpu_s) of the daemon `pid`, read again if a
    worker was reaped between the two reads: else its CPU would count twice, or not at all."""
    for _attempt in range(5):
        reaped_s = reaped_children_cpu_s(pid)
        workers = fetch_workers_cpu(pid)
        if reaped_children_cpu_s(pid) == reaped_s:
            break
    return workers, reaped_s


def fetch_workers_delta_s(before: dict, after: dict, reaped_s: float) -> float:
    """CPU s the fetch workers spent between two fetch_workers_cpu() (`reaped_s`: the
    daemon's reaped children's CPU between them). A worker that started meanwhile counts
    from 0; one reaped meanwhile counts through `reaped_s`, which holds its whole life,
    less what it had spent before."""
    live_s = sum(cpu_s - before.get(key, 0.0) for key, cpu_s in after.items())
    reaped_before_s = sum(cpu_s for key, cpu_s in before.items() if key not in after)
    return max(0.0, live_s + reaped_s - reaped_before_s)


_PY_SPY_THREAD = re.compile(r'^Thread (\d+) \([^)]*\): "(.*)"$')


def python_thread_names(pid: int) -> dict:
    """tid -> Python thread name, from `py-spy dump` (read from the process's memory,
    without stopping it); {} if py-spy is not installed or fails."""
    binary = shutil.which("py-spy")
    if binary is None:
        return {}
    try:
        out = subprocess.run(
            [binary, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    names = {}
    for line in out.splitlines():
        match = _PY_SPY_THREAD.match(line.strip())
        if match:
            names[int(match.group(1))] = match.group(2)
    return names


class ThreadCensus:
    """bucketfs's CPU by role over one run (the daemon's threads, its fetch worker
    processes): start() before, finish() after."""

    def __init__(self):
        self._names: dict = {}  # (pid, tid) -> Python thread name, kept across runs of one daemon

    def start(self, pid: int) -> tuple:
        return pid, task_cpu(pid), proc_cpu_s(pid), fetch_workers_snapshot(pid)

    def finish(self, snapshot: tuple, main_exact_s: Optional[float] = None) -> dict:
        """`main_exact_s`: the serving thread's CPU over the run from the daemon's own
        clock (its stats), where /proc counts it in 10 ms ticks: replaces the ticks' figure
        for "main" (kept as "main_ticks"), the total moved by the difference."""
        pid, before, total_before, (workers_before, reaped_before_s) = snapshot
        after = task_cpu(pid)
        total = proc_cpu_s(pid) - total_before  # the daemon's own: its threads, live and exited
        workers_after, reaped_after_s = fetch_workers_snapshot(pid)
        fetch_workers_s = fetch_workers_delta_s(workers_before, workers_after, reaped_after_s - reaped_before_s)
        own_comm = after.get(pid, before.get(pid, ("", 0, 0)))[0]
        unnamed = [tid for tid, (comm, *_cpu) in after.items() if tid != pid and comm == own_comm]
        if any((pid, tid) not in self._names for tid in unnamed):
            for tid, name in python_thread_names(pid).items():
                self._names[(pid, tid)] = name
        by_role = dict.fromkeys(ROLES, 0.0)
        main_user = main_sys = 0.0
        for tid, (comm, user_s, sys_s) in after.items():
            _comm0, user0, sys0 = before.get(tid, (comm, 0.0, 0.0))
            delta = max(0.0, (user_s - user0) + (sys_s - sys0))
            if tid == pid:
                role = "main"
                main_user, main_sys = user_s - user0, sys_s - sys0
            elif comm != own_comm:
                role = "workers"  # trio names its thread cache's threads for the OS
            else:
                name = self._names.get((pid, tid))
                if name == CURL_THREAD_NAME or (name is None and len(unnamed) == 1):
                    role = "curl"
                else:
                    role = "other"
            by_role[role] += delta
        exited = max(0.0, total - sum(by_role.values()))
        by_role["workers"] += exited
        by_role["fetch_workers"] = fetch_workers_s
        out = {role: round(value, 3) for role, value in by_role.items()}
        out.update(
            main_user=round(main_user, 3),
            main_sys=round(main_sys, 3),
            exited=round(exited, 3),
            total=round(total + fetch_workers_s, 3),  # all of bucketfs: the daemon and its fetch workers
            threads=len(after),
            fetch_workers_count=len(workers_after),
        )
        if main_exact_s is not None and main_exact_s >= 0:
            out["main_ticks"] = out["main"]
            out["main"] = round(main_exact_s, 4)
            out["total"] = round(out["total"] + out["main"] - out["main_ticks"], 3)
        return out


# A run repeated on a mount with other options (fetchworkers.py: --fetch-workers N) is
# labelled "<its base run's label>, fetch workers N": it reads what its base run reads.
_VARIANT_SUFFIX = re.compile(r", fetch workers \d+$")


def variant_label(label: str, fetch_workers: int) -> str:
    """The label of `label`'s run repeated on a mount with --fetch-workers `fetch_workers`."""
    return f"{label}, fetch workers {fetch_workers}"


def base_label(label: str) -> str:
    """The label of the run `label` repeats (itself for a run of the default mount): its
    units and targets are that run's."""
    return _VARIANT_SUFFIX.sub("", label)


def run_units(label: str, ds) -> Optional[tuple]:
    """(small files, bytes) a bucketfs run read, by its label; None for runs not counted."""
    label = base_label(label)
    shards = ds.bytes_of(ds.shards)
    images = ds.bytes_of(ds.images)
    if label in ("W1 1 reader(s)", "W1 4 reader(s)", "W1 webdataset"):
        return None, shards
    if label.startswith("W2 epoch"):
        return len(ds.images), images
    if label == "W5 mixed":
        return len(ds.images), images + shards
    return None


def is_cold_small_files(label: str) -> bool:
    return base_label(label).startswith("W2 epoch cold")


def is_streamed(label: str) -> bool:
    return base_label(label) in ("W1 1 reader(s)", "W1 4 reader(s)")


class ThreadCpuReport:
    """The CPU-per-unit table and its targets, mixed into `Bench` (runner.py). "daemon"
    in its keys (daemon_cpu_s, daemon_ms_per_file, ...) is all of bucketfs: the daemon
    and its fetch workers (ThreadCensus's total)."""

    def cpu_per_unit_rows(self) -> list:
        rows = []
        for run in self.runs:
            threads = run.get("daemon_threads_cpu_s")
            if run["system"] != "bucketfs" or not threads or run.get("error_count"):
                continue
            units = run_units(run["run"], self.ds)
            if units is None:
                continue
            files, nbytes = units
            main, total = threads["main"], threads["total"]
            gb = nbytes / GB

            def per_file(cpu_s):
                return None if not files else round(1000 * cpu_s / files, 4)

            def per_gb(cpu_s):
                return round(cpu_s / gb, 4) if gb else None

            main_ms, total_ms = per_file(main), per_file(total)
            main_s_gb, total_s_gb = per_gb(main), per_gb(total)

            # 4 decimals: a GB/s ceiling of ~0.1 (W5) to 0.1 MB/s, for tables that print it in MB/s.
            def ceiling(per_unit, scale):
                return None if not per_unit else round(scale / per_unit, 4)

            def bound(main_unit, total_unit, cores, scale):
                if not main_unit or not total_unit:
                    return None
                return round(min(scale / main_unit, cores * scale / total_unit), 4)

            targets, met = [], []
            if is_cold_small_files(run["run"]):
                targets += [f"main <= {MAIN_MS_PER_FILE} ms/file", f"bucketfs <= {DAEMON_MS_PER_FILE} ms/file"]
                met += [main_ms <= MAIN_MS_PER_FILE, total_ms <= DAEMON_MS_PER_FILE]
            if is_streamed(run["run"]):
                targets.append(f"main <= {MAIN_S_PER_GB} s/GB")
                met.append(main_s_gb <= MAIN_S_PER_GB)
            rows.append(
                {
                    "run": run["run"],
                    "files": files,
                    "GB": round(gb, 3),
                    "wall_s": run["wall_s"],
                    "cpu_s": {role: threads[role] for role in ROLES},
                    "main_user_s": threads["main_user"],
                    "main_sys_s": threads["main_sys"],
                    "daemon_cpu_s": total,
                    "main_ms_per_file": main_ms,
                    "daemon_ms_per_file": total_ms,
                    "main_s_per_GB": main_s_gb,
                    "daemon_s_per_GB": total_s_gb,
                    # 1 / main-thread CPU per unit: what no extra core lifts.
                    "ceiling_files_s": ceiling(main_ms, 1000.0),
                    "ceiling_GB_s": ceiling(main_s_gb, 1.0),
                    "bound_files_s": {n: bound(main_ms, total_ms, n, 1000.0) for n in FREE_CORES},
                    "bound_GB_s": {n: bound(main_s_gb, total_s_gb, n, 1.0) for n in FREE_CORES},
                    "achieved_files_s": round(files / run["wall_s"], 1) if files else None,
                    "achieved_GB_s": round(gb / run["wall_s"], 3),
                    "target": "; ".join(targets),
                    "met": None if not met else all(met),
                }
            )
        return rows

    def cpu_per_unit_table(self) -> str:
        rows = self.cpu_per_unit_rows()
        if not rows:
            return ""

        def fmt(x, digits=3):
            if x is None:
                return "-"
            return f"{x:,.{digits}f}" if abs(x) < 100 else f"{x:,.0f}"

        cores = "/".join(str(n) for n in FREE_CORES)
        header = (
            "bucketfs run",
            "files",
            "GB",
            "CPU s: main (user+sys) / curl / workers / worker processes / other = bucketfs total",
            "ms/file: main / bucketfs",
            "s/GB: main / bucketfs",
            "ceiling, main thread: files/s / GB/s",
            f"bound on {cores} free cores: files/s",
            f"bound on {cores} free cores: GB/s",
            "achieved: files/s / GB/s",
            "target (issue 37)",
            "met",
        )
        lines = []
        for r in rows:
            cpu = r["cpu_s"]
            lines.append(
                (
                    r["run"],
                    "-" if not r["files"] else f"{r['files']:,}",
                    f"{r['GB']:.2f}",
                    f"{cpu['main']:.2f} ({r['main_user_s']:.2f}+{r['main_sys_s']:.2f}) / {cpu['curl']:.2f} / "
                    f"{cpu['workers']:.2f} / {cpu['fetch_workers']:.2f} / {cpu['other']:.2f} = {r['daemon_cpu_s']:.2f}",
                    f"{fmt(r['main_ms_per_file'])} / {fmt(r['daemon_ms_per_file'])}",
                    f"{fmt(r['main_s_per_GB'])} / {fmt(r['daemon_s_per_GB'])}",
                    f"{fmt(r['ceiling_files_s'], 0)} / {fmt(r['ceiling_GB_s'], 2)}",
                    " / ".join(fmt(r["bound_files_s"][n], 0) for n in FREE_CORES),
                    " / ".join(fmt(r["bound_GB_s"][n], 2) for n in FREE_CORES),
                    f"{fmt(r['achieved_files_s'], 0)} / {fmt(r['achieved_GB_s'], 2)}",
                    r["target"] or "-",
                    {True: "yes", False: "NO", None: "-"}[r["met"]],
                )
            )
        return text_table(header, lines)
