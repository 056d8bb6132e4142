"""`bucketfs warm` against the s5cmd copy (issue 36: "`bucketfs warm` of the ImageFolder
set: >= 0.9x the s5cmd copy's rate"). Run in W2, right after each of copy-then-read's
s5cmd copies (copythenread.py), under the same conditions: the mounts stopped, the
store primed, the page cache dropped, the same latency proxy, credentials in the
environment as for the mounts. Timed from its start to its exit:

    python3 -m bucketfs warm s3://BUCKET/imagefolder/ --endpoint-url PROXY --cache-dir EMPTYDIR

(warm's default --concurrency, 256; --warm-concurrency N sets it), EMPTYDIR on the same
disk as the copy. Its CPU and peak RSS are the child's own rusage (wait4). Then every byte it stored is checked:
a mount of the same URL with `--cache-dir EMPTYDIR` (and the bench's --max-memory),
page cache dropped, reads every file with the epoch's threads and order, verified,
and the proxy must count no GET (`warm_then_read_gets`). Reported (`warm_table`):
files/s and MB/s of the copy and of warm, warm / s5cmd (the ratio of the rates), both
CPU seconds (warm's from wait4: its own rusage), its peak RSS, warm's requests, and the epoch on the warmed cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Optional

from .common import MB, REPO, RUN_TIMEOUT_S, fmt_num, log, text_table
from .datasets import Verifier
from .systems import ModuleSetMount, serving

WARM_SYSTEM = "bucketfs warm"  # the warm's system name in the runs (--json)
TARGET = 0.9  # issue 36: warm's rate >= 0.9x the s5cmd copy's
PREFIX = "imagefolder/"


class WarmAgainstCopy:
    """W2's timed `bucketfs warm` beside the s5cmd copy, mixed into `Bench` (runner.py)."""

    def warm_argv(self, cache_dir: str) -> list:
        url, *store_args = self.backend.mount_argv(f"{self.ds.bucket}/{PREFIX.rstrip('/')}")
        concurrency = getattr(self.args, "warm_concurrency", None)
        return [
            sys.executable,
            "-m",
            "bucketfs",
            "warm",
            url,
            *store_args,
            "--cache-dir",
            cache_dir,
            *(["--concurrency", str(concurrency)] if concurrency else []),
        ]

    def w2_warm(self, threads: int, order: list) -> None:
        """After the copy for `threads`: warm imagefolder/ into an empty cache directory,
        then read it all through a mount on that cache (the check, and the epoch)."""
        ds = self.ds
        cache_dir = os.path.join(self.work_dir, "warm-cache")
        shutil.rmtree(cache_dir, ignore_errors=True)
        os.makedirs(cache_dir)
        argv = self.warm_argv(cache_dir)
        env = dict(os.environ, **self.backend.env())
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        runs = self.warm_runs.setdefault(threads, {})
        try:
            self.cold(WARM_SYSTEM)  # as before the copy: mounts stopped, store primed, page cache dropped
            if threads == min(self.warm_runs):
                log(f"  W2 warm: {' '.join(argv[2:])}")
            runs["warm"] = warm_run = self.measure(
                f"W2 bucketfs warm {threads}t", WARM_SYSTEM, lambda v: self._warm(v, argv, env)
            )
            if warm_run.get("error_count"):
                return
            # Every byte warm stored, through a mount of the same URL on that cache (page cache dropped).
            self.cold(WARM_SYSTEM)
            mount = ModuleSetMount(
                self.backend,
                f"{ds.bucket}/{PREFIX.rstrip('/')}",  # (mount_argv makes s3://BUCKET/imagefolder/ of it)
                self.mountpoint,
                self.args.max_memory,
                self.work_dir,
                [*self.backend.mount_extra_args, "--cache-dir", cache_dir],
                name="bucketfs-warmed",
            )
            with serving(self, mount):
                root = self.mountpoint

                def read(rel):
                    with open(os.path.join(root, rel[len(PREFIX) :]), "rb") as f:
                        return f.read()

                runs["epoch"] = self.measure(
                    f"W2 epoch on warmed cache {threads}t", "bucketfs", lambda v: self._epoch(v, order, threads, read)
                )
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)

    def _warm(self, v: Verifier, argv: list, env: dict) -> dict:
        """Run warm to its exit: wall time, and its own CPU and peak RSS (wait4's rusage of
        that child alone: RUSAGE_CHILDREN's peak would be the largest child ever, a mount)."""
        log_path = os.path.join(self.work_dir, "warm.log")
        t0 = time.perf_counter()
        with open(log_path, "w") as out:
            proc = subprocess.Popen(
                argv, env=env, cwd=self.work_dir, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        killer = threading.Timer(RUN_TIMEOUT_S, proc.kill)
        killer.start()
        try:
            _pid, status, usage = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # (reaped here: Popen must not wait for it again)
        if seconds >= RUN_TIMEOUT_S:
            v.fail(f"bucketfs warm did not finish in {RUN_TIMEOUT_S:.0f}s (killed)")
        elif proc.returncode != 0:
            with open(log_path, errors="replace") as f:
                v.fail(f"bucketfs warm exited with {proc.returncode}: {f.read()[-600:]}")
        files = len(self.ds.images)
        return {
            "s": round(seconds, 4),
            "files": files,
            "files/s": round(files / seconds, 1),
            "MB/s": round(self.ds.bytes_of(self.ds.images) / seconds / MB, 1),
            "warm_cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
            "warm_user_s": round(usage.ru_utime, 3),
            "warm_sys_s": round(usage.ru_stime, 3),
            "warm_max_rss_MB": round(usage.ru_maxrss * 1024 / MB, 1),
        }

    # -- report ---------------------------------------------------------------------
    def warm_rows(self) -> list:
        """One dict per s5cmd copy and the warm after it (--json: warm_vs_copy)."""
        rows = []
        files, data_bytes = len(self.ds.images), self.ds.bytes_of(self.ds.images)
        for threads, runs in sorted(self.warm_runs.items()):
            copy_run = (self.copy_then_read_runs.get(threads) or {}).get("copy") or {}
            warm_run, epoch_run = runs.get("warm") or {}, runs.get("epoch") or {}
            copy_ok = bool(copy_run) and not copy_run.get("error_count")
            warm_ok = bool(warm_run) and not warm_run.get("error_count")
            epoch_ok = bool(epoch_run) and not epoch_run.get("error_count")
            copy_s = copy_run.get("s") if copy_ok else None
            warm_s = warm_run.get("s") if warm_ok else None
            ratio = round(copy_s / warm_s, 2) if copy_s and warm_s else None
            rows.append(
                {
                    "after_copy_for_threads": threads,
                    "files": files,
                    "MB": round(data_bytes / MB, 1),
                    "copy_s": copy_s,
                    "copy_files_s": round(files / copy_s, 1) if copy_s else None,
                    "copy_MB_s": round(data_bytes / copy_s / MB, 1) if copy_s else None,
                    "s5cmd_cpu_s": copy_run.get("s5cmd_cpu_s") if copy_ok else None,
                    "warm_s": warm_s,
                    "warm_files_s": warm_run.get("files/s") if warm_ok else None,
                    "warm_MB_s": warm_run.get("MB/s") if warm_ok else None,
                    "warm_cpu_s": warm_run.get("warm_cpu_s") if warm_ok else None,
                    "warm_max_rss_MB": warm_run.get("warm_max_rss_MB") if warm_ok else None,
                    "warm_gets": warm_run.get("requests", {}).get("GET") if warm_ok else None,
                    "warm_lists": warm_run.get("requests", {}).get("LIST") if warm_ok else None,
                    "warm_over_s5cmd": ratio,
                    "warm_then_read_epoch_s": epoch_run.get("wall_s") if epoch_ok else None,
                    "warm_then_read_epoch_files_s": epoch_run.get("files/s") if epoch_ok else None,
                    "warm_then_read_gets": epoch_run.get("requests", {}).get("GET", 0) if epoch_ok else None,
                    "target": f">= {TARGET:.1f}x the s5cmd copy's rate",
                    "met": None if ratio is None else ratio >= TARGET,
                    "note": None if warm_ok else "warm failed (see FAIL)" if warm_run else "not run",
                }
            )
        return rows

    def warm_table(self) -> str:
        fmt = fmt_num

        header = (
            "after the copy of",
            "s5cmd copy s",
            "s5cmd files/s",
            "s5cmd MB/s",
            "s5cmd CPU s",
            "warm s",
            "warm files/s",
            "warm MB/s",
            "warm CPU s",
            "warm peak RSS MB",
            "warm GETs / LISTs",
            "warm/s5cmd",
            "epoch on warmed cache files/s (GETs)",
            "target",
            "met",
        )
        lines = []
        for r in self.warm_rows():
            lines.append(
                (
                    f"{r['after_copy_for_threads']} threads",
                    fmt(r["copy_s"], 2),
                    fmt(r["copy_files_s"], 0),
                    fmt(r["copy_MB_s"], 1),
                    fmt(r["s5cmd_cpu_s"], 1),
                    fmt(r["warm_s"], 2) if r["note"] is None else r["note"],
                    fmt(r["warm_files_s"], 0),
                    fmt(r["warm_MB_s"], 1),
                    fmt(r["warm_cpu_s"], 1),
                    fmt(r["warm_max_rss_MB"], 0),
                    f"{fmt(r['warm_gets'], 0)} / {fmt(r['warm_lists'], 0)}",
                    "-" if r["warm_over_s5cmd"] is None else f"{r['warm_over_s5cmd']:.2f}x",
                    f"{fmt(r['warm_then_read_epoch_files_s'], 0)} ({fmt(r['warm_then_read_gets'], 0)})",
                    r["target"],
                    {True: "yes", False: "NO", None: "-"}[r["met"]],
                )
            )
        if not lines:
            return ""
        return text_table(header, lines)

    def warm_concurrency_label(self) -> str:
        concurrency: Optional[int] = getattr(self.args, "warm_concurrency", None)
        return f"--concurrency {concurrency}" if concurrency else "its default --concurrency (256)"
