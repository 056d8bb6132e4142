"""`Bench`: the systems compared (bucketfs, direct SDK reads, local disk, alternative
mounts), a cold start of each, and `measure()`, one run of a workload on a system with
its costs around it (the proxy's requests and bytes, the CPU of the mount (bucketfs's
daemon and fetch workers, or an alternative mount's process), of the client, proxy,
server and of other processes), a watchdog for hangs and the verification."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import threading
import time
import traceback
from typing import Callable, Optional

from .common import MB, RUN_TIMEOUT_S, SYSTEMS, log
from .copythenread import CopyThenRead
from .datasets import Dataset, Verifier
from .epochs import CacheEpochs
from .fetchworkers import FetchWorkersVariant
from .issue37 import Issue37
from .procs import CpuCensus, drop_caches, proc_cpu_s, self_cpu_s, steal_s
from .report import Report
from .s3torch import S3TorchConnector, s3torch_missing
from .systems import ALTERNATIVE_MOUNTS, Mount, _empty_disk_cache, _option_value
from .threadcpu import ThreadCensus, ThreadCpuReport
from .warmcopy import WarmAgainstCopy
from .workloads import Workloads


@dataclasses.dataclass
class Row:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    target: str = ""
    values: dict = dataclasses.field(default_factory=dict)
    met: Optional[bool] = None


# The daemon's stat of its serving thread's CPU, exact (threadcpu.ThreadCensus.finish).
SERVING_THREAD_CPU = "process.serving_thread_cpu_s"


class Bench(
    Workloads,
    CopyThenRead,
    WarmAgainstCopy,
    CacheEpochs,
    S3TorchConnector,
    FetchWorkersVariant,
    ThreadCpuReport,
    Issue37,
    Report,
):
    """One benchmark over a data set and a store: the systems it compares, the rows of the
    result and every run's costs. The workloads (W1-W5, W2's copy-then-read and warm, W6,
    s3torchconnector's runs, the fetch-workers variant's runs) and the report (with
    bucketfs's CPU per unit by thread and process) are its mixins."""

    def __init__(self, args, dataset: Dataset, backend, work_dir: str):
        self.args, self.ds, self.backend, self.work_dir = args, dataset, backend, work_dir
        self.rows: dict = {}
        self.runs: list = []
        self.failures: list = []
        self.mountpoint = os.path.join(work_dir, "mnt")
        os.makedirs(self.mountpoint)
        self.mount = Mount(
            backend,
            dataset.bucket,
            self.mountpoint,
            args.max_memory,
            work_dir,
            [*backend.mount_extra_args, *shlex.split(args.mount_args)],
        )
        self.cache_dir = _option_value(shlex.split(args.mount_args), "--cache-dir")
        self.local_root = str(dataset.bucket_dir)
        self.alt_mounts: dict = {}  # system -> its _MountProcess
        self.alt_notes: list = []
        for cls in ALTERNATIVE_MOUNTS if args.alternatives else ():
            missing = cls.missing()
            if missing:
                self.alt_notes.append(missing)
                continue
            alt_mountpoint = os.path.join(work_dir, f"{cls.name}-mnt")
            os.makedirs(alt_mountpoint)
            self.alt_mounts[cls.name] = cls(backend, dataset.bucket, alt_mountpoint, work_dir)
        self.systems = SYSTEMS + tuple(self.alt_mounts)
        self.dropped_ok = True
        self.census = CpuCensus()
        self.copy_then_read_runs: dict = {}  # W2 threads -> {"copy": run, "epoch": run}
        self.copy_then_read_note: Optional[str] = None  # why it was not measured
        self.warm_runs: dict = {}  # W2 threads -> {"warm": run, "epoch": run} (warmcopy.py)
        self.cache_epoch_results: list = []  # W6: one dict per variant (epochs.py)
        self.cache_epoch_note: Optional[str] = None
        self.s3torch_note: Optional[str] = s3torch_missing(backend)  # why its column is empty (s3torch.py)
        self.s3torch_logged = False
        self.thread_census = ThreadCensus()  # bucketfs's CPU by thread and fetch worker in each run (threadcpu.py)
        self.fetch_workers_variant_count: Optional[int] = None  # N once its runs were made (fetchworkers.py)

    # -- bookkeeping ------------------------------------------------------------
    def row(self, key, label, unit, higher_is_better, target="") -> Row:
        if key not in self.rows:
            self.rows[key] = Row(key, label, unit, higher_is_better, target)
        return self.rows[key]

    def record(self, key: str, system: str, value) -> None:
        self.rows[key].values[system] = value

    def cold(self, system: str) -> None:
        """Drop the page cache; a fresh mount for bucketfs; server metadata primed for remote runs."""
        self.mount.stop()  # also before other systems: a mount's background work (listing ahead) must not overlap them
        for alt in self.alt_mounts.values():
            alt.stop()
        if system != "local":
            # All of them, not only the run's: bucketfs lists sibling directories ahead.
            self.backend.prime(self.ds.bucket, ["shards/", "imagefolder/", "flat/", "tree/"])
        self.dropped_ok = drop_caches() and self.dropped_ok
        if system == "bucketfs":
            if self.cache_dir:
                _empty_disk_cache(self.cache_dir)
            self.mount.start()
        elif system in self.alt_mounts:
            self.alt_mounts[system].start()

    def root(self, system: str) -> str:
        if system in self.alt_mounts:
            return self.alt_mounts[system].mountpoint
        return self.mountpoint if system == "bucketfs" else self.local_root

    def stop_mounts(self) -> None:
        self.mount.stop()
        for alt in self.alt_mounts.values():
            alt.stop()

    def measure(self, label: str, system: str, fn: Callable[[Verifier], dict]) -> dict:
        """Run fn(verifier) once, with the proxy's, the daemon's and our own costs around it."""
        verifier = Verifier(self.ds)
        remote = system != "local"
        self.backend.mark(f"start {label} [{system}]")
        before = self.backend.stats() if remote else None
        threads_before = self.thread_census.start(self.mount.pid) if system == "bucketfs" else None
        serving_before_s = (self._daemon_stats() or {}).get(SERVING_THREAD_CPU) if system == "bucketfs" else None
        alt = self.alt_mounts.get(system)
        alt_before = None
        if alt is not None:
            alt_before = proc_cpu_s(alt.pid)
            alt.label += ("; " if alt.label else "") + label
        self_before = self_cpu_s()
        steal_before = steal_s()
        self.census.others_s()
        server_before = self.backend.server_cpu_s()
        proxy_before = self.backend.proxy_cpu_s()
        if system == "bucketfs":
            self.mount.label += ("; " if self.mount.label else "") + label
        profiler = self._start_profiler(label) if system == "bucketfs" and self.args.py_spy else None
        watchdog = threading.Timer(RUN_TIMEOUT_S, self._hung, args=(label, system, verifier))
        watchdog.daemon = True
        watchdog.start()
        t0 = time.perf_counter()
        try:
            result = fn(verifier) or {}
        except Exception as exc:  # noqa: BLE001 - reported as a failed run
            verifier.fail(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")
            result = {}
        finally:
            watchdog.cancel()
        wall_s = time.perf_counter() - t0
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            try:
                profiler.wait(30)
            except subprocess.TimeoutExpired:
                profiler.kill()
                profiler.wait()
        run = {"run": label, "system": system, "wall_s": round(wall_s, 4), **result}
        run["client_cpu_s"] = round(self_cpu_s() - self_before, 3)
        run["server_cpu_s"] = round(self.backend.server_cpu_s() - server_before, 3)
        proxy_cpu_s = self.backend.proxy_cpu_s() - proxy_before
        if system == "bucketfs" and self.mount.proc is not None and self.mount.proc.poll() is None:
            # By thread and process: main (trio, FUSE), curl, workers, fetch workers (threadcpu.py); after the
            # client's CPU was read.
            stats = self._daemon_stats()  # (--json: counters since the mount)
            if stats is not None:
                run["daemon_stats"] = stats
            serving_after_s = None if stats is None else stats.get(SERVING_THREAD_CPU)
            exact_s = None if None in (serving_before_s, serving_after_s) else serving_after_s - serving_before_s
            threads = run["daemon_threads_cpu_s"] = self.thread_census.finish(threads_before, exact_s)
            # The mount's CPU (the "mount CPU" of the tables, the per-MB figures): all of bucketfs, the daemon
            # and its fetch workers (--fetch-workers), not the daemon process alone. The key keeps its name,
            # for --json files of earlier runs, as threadcpu's "daemon_*" keys do.
            run["daemon_cpu_s"] = threads["total"]
        elif system == "bucketfs":
            verifier.fail(
                f"the bucketfs daemon died during the run (exit {self.mount.proc.returncode if self.mount.proc else '?'}): {self.mount._tail(800)}"
            )
        elif alt is not None and alt.proc is not None and alt.proc.poll() is None:
            run["daemon_cpu_s"] = round(proc_cpu_s(alt.pid) - alt_before, 3)
        elif alt is not None:
            verifier.fail(f"{alt.title} died during the run: {alt._tail(800)}")
        # CPU used by processes that are not part of this benchmark (a shared machine): noise.
        run["foreign_cpu_s"] = round(self.census.others_s(), 2)
        run["steal_s"] = round(steal_s() - steal_before, 2)
        if remote:
            after = self.backend.stats()
            requests = collections.Counter(after["requests"])
            requests.subtract(before["requests"])
            statuses = collections.Counter(after["statuses"])
            statuses.subtract(before["statuses"])
            run["requests"] = {k: v for k, v in sorted(requests.items()) if v}
            run["statuses"] = {k: v for k, v in sorted(statuses.items()) if v}
            run["fetched_bytes"] = after["body_bytes_down"] - before["body_bytes_down"]
            run["proxy_cpu_s"] = round(proxy_cpu_s, 3)
        run["errors"] = verifier.errors[:5]
        run["error_count"] = len(verifier.errors)
        self.runs.append(run)
        summary = " ".join(f"{k}={v}" for k, v in result.items() if k not in ("errors",))
        extra = ""
        if remote:
            extra = f" | requests {run['requests']} fetched {run['fetched_bytes'] / MB:.1f} MB"
            if run.get("daemon_cpu_s") is not None:
                extra += f" mount_cpu {run['daemon_cpu_s']:.2f}s"
            extra += f" proxy_cpu {run['proxy_cpu_s']:.2f}s"
        log(
            f"  {label:<28} {system:<9} {summary}{extra} client_cpu {run['client_cpu_s']:.2f}s server_cpu {run['server_cpu_s']:.2f}s"
            + (f" (other processes: {run['foreign_cpu_s']:.1f} CPU s)" if run["foreign_cpu_s"] >= 0.5 else "")
            + (f" (host steal: {run['steal_s']:.1f} CPU s)" if run["steal_s"] >= 0.5 else "")
        )
        if verifier.errors:
            self.failures.append(f"{label} [{system}]: {len(verifier.errors)} error(s), first: {verifier.errors[0]}")
            print(f"\n!!!!!!!! FAIL {label} [{system}]: {len(verifier.errors)} error(s)", flush=True)
            for e in verifier.errors[:5]:
                print(f"!!!!!!!!   {e}", flush=True)
            print(flush=True)
            run["failed"] = True
        return run

    def _daemon_stats(self) -> Optional[dict]:
        """The daemon's counters (its stats file), or None."""
        from bucketfs.testing.mounting import daemon_stats

        with contextlib.suppress(OSError, ValueError):
            return daemon_stats(self.mountpoint)
        return None

    def _start_profiler(self, label: str) -> Optional[subprocess.Popen]:
        """py-spy on the daemon for one run: collapsed stacks (flamegraph.pl input) in --py-spy DIR."""
        self.args.py_spy.mkdir(parents=True, exist_ok=True)
        name = "".join(c if c.isalnum() else "-" for c in label.lower())
        out = self.args.py_spy / f"{len(self.runs):02d}-{name}.txt"
        try:
            proc = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-p",
                    str(self.mount.pid),
                    "-o",
                    str(out),
                    "--format",
                    "raw",
                    "-r",
                    "100",
                    "--nonblocking",
                    "--gil",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except OSError as exc:
            log(f"  py-spy not started ({exc}): pip install py-spy")
            return None
        time.sleep(0.5)  # py-spy attaches in ~0.1 s; the first samples of the run are not worth racing for
        return proc

    def _hung(self, label, system, verifier) -> None:
        verifier.fail(f"no result after {RUN_TIMEOUT_S:.0f}s: hung; aborting")
        log(f"  {label} [{system}]: no result after {RUN_TIMEOUT_S:.0f}s; aborting the run")
        if system == "bucketfs":
            self.mount.abort()
        elif system in self.alt_mounts:
            self.alt_mounts[system].abort()

    def max_memory_bytes(self) -> int:
        from bucketfs.app.cli import parse_size

        return parse_size(self.args.max_memory)
