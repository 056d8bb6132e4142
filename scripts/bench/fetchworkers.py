"""The fetch-workers variant (issue 37): the runs whose small GETs `bucketfs mount
--fetch-workers N` moves out of the daemon (libcurl, SigV4 and the MD5 in N worker
processes instead of its curl thread), repeated in the same bench run on a second mount
started with `--fetch-workers N` (--fetch-workers-variant N, default 2; 0 skips it), so
both designs meet the same machine, store and load. After the workloads asked for, for
those of W2, W1 and W5 among them, on that mount (--mount-args too, then
`--fetch-workers N`, which wins over one in --mount-args):
- W2: the cold epoch with 8 and 32 threads, each as W2 runs it: Bench.cold() (a fresh
  daemon, the store primed, the page cache dropped, --cache-dir emptied), the listing
  (measured, as W2's: it loads the fresh mount the same way), then the epoch in W2's
  order for that thread count;
- W1: 4 readers, on a fresh mount;
- W5: the mixed run, on a fresh mount.
Every byte is verified as for the other runs. Each run's label is its base run's with
", fetch workers N" (threadcpu.variant_label): the CPU-by-thread census counts the same
units for it, so the CPU-per-unit table has both designs' rows. The comparison table
puts them side by side, per workload: throughput, the main thread's and all of
bucketfs's CPU per unit, the ceiling 1 / main and the bound on FREE_CORES free cores,
as threadcpu computes them for each row (--json: "fetch_workers_variant")."""

from __future__ import annotations

import dataclasses
import shlex
from typing import Optional

from .common import MB, fmt_num, log, text_table
from .readers import file_reader
from .systems import ModuleSetMount, _option_value, serving
from .threadcpu import FREE_CORES, GB, variant_label
from .workloads import W5_SHARD_READERS, fs_mixed_readers

DEFAULT_FETCH_WORKERS = 2  # --fetch-workers-variant's default
W2_THREADS = (8, 32)  # W2's cold epochs repeated
W1_READERS = 4  # W1's run repeated: the one with issue 37's target against direct reads


@dataclasses.dataclass(frozen=True)
class Compared:
    """A run both designs make: its workload, its base run's label, its title in the
    table, and whether it is counted per small file (else per GB, its throughput in MB/s)."""

    workload: str
    label: str
    title: str
    per_file: bool


COMPARED = (
    Compared("W2", f"W2 epoch cold {W2_THREADS[0]}t", f"W2 cold epoch, {W2_THREADS[0]} threads", True),
    Compared("W2", f"W2 epoch cold {W2_THREADS[1]}t", f"W2 cold epoch, {W2_THREADS[1]} threads", True),
    Compared("W1", f"W1 {W1_READERS} reader(s)", f"W1 shards, {W1_READERS} readers", False),
    Compared("W5", "W5 mixed", "W5 small files and shards", False),
)
MB_PER_GB = GB // MB  # threadcpu's per-GB ceilings, in the MB/s the workloads report


def fetch_workers_in(mount_args: str) -> int:
    """The --fetch-workers a mount gets from --mount-args (0: the daemon's curl thread)."""
    value = _option_value(shlex.split(mount_args), "--fetch-workers")
    return int(value) if value and value.isdigit() else 0


def design_name(fetch_workers: int) -> str:
    return f"{fetch_workers} fetch workers" if fetch_workers else "thread"


class FetchWorkersVariant:
    """The variant's runs and its comparison table, mixed into `Bench` (runner.py);
    self.fetch_workers_variant_count is N once its runs were made (else None)."""

    def fetch_workers_variant(self, workloads: list) -> None:
        """After the workloads: W2's cold epochs, W1 and W5 again (those among
        `workloads`) on a mount with --fetch-workers N."""
        count = self.args.fetch_workers_variant
        wanted = [w for w in ("W2", "W1", "W5") if w in workloads]
        if not count or not wanted:
            return
        base = fetch_workers_in(self.args.mount_args)
        if base == count:
            log(f"fetch-workers variant: --mount-args already has --fetch-workers {count}: skipped")
            return
        self.fetch_workers_variant_count = count
        log(f"fetch-workers variant: {', '.join(wanted)} again on a mount with --fetch-workers {count}")
        mount = ModuleSetMount(
            self.backend,
            self.ds.bucket,
            self.mountpoint,
            self.args.max_memory,
            self.work_dir,
            [*self.mount.extra_args, "--fetch-workers", str(count)],
            name=f"bucketfs-fetch-workers-{count}",
        )
        try:
            with serving(self, mount):
                for workload in wanted:
                    getattr(self, f"_fetch_workers_{workload.lower()}")(count)
        except Exception as exc:  # noqa: BLE001 - the variant is reported as failed, the report goes on
            self.failures.append(f"fetch-workers variant: {type(exc).__name__}: {exc}")
            log(f"  fetch-workers variant: FAILED: {type(exc).__name__}: {exc}")

    def _fetch_workers_w2(self, count: int) -> None:
        for threads in W2_THREADS:
            self.cold("bucketfs")  # the variant's mount (serving() made it bench.mount), fresh
            self.measure(variant_label("W2 listing", count), "bucketfs", lambda v: self._w2_list_fs(v, self.mountpoint))
            order, read = self.w2_order(threads), file_reader(self.mountpoint)
            self.measure(
                variant_label(f"W2 epoch cold {threads}t", count),
                "bucketfs",
                lambda v: self._epoch(v, order, threads, read),
            )

    def _fetch_workers_w1(self, count: int) -> None:
        self.cold("bucketfs")
        label = variant_label(f"W1 {W1_READERS} reader(s)", count)
        self.measure(label, "bucketfs", self.w1_fs_run(self.mountpoint, W1_READERS))

    def _fetch_workers_w5(self, count: int) -> None:
        self.cold("bucketfs")
        small, stream = fs_mixed_readers(self.mountpoint)
        fn = self.w5_run("bucketfs", small, stream, [None] * W5_SHARD_READERS)
        self.measure(variant_label("W5 mixed", count), "bucketfs", fn)

    # -- report -----------------------------------------------------------------------
    def fetch_workers_rows(self) -> list:
        """Per compared run, one dict per design (the default mount's first), where both
        designs ran it; [] without the variant."""
        count = self.fetch_workers_variant_count
        if not count:
            return []
        cpu_rows = {r["run"]: r for r in self.cpu_per_unit_rows()}
        runs = {r["run"]: r for r in self.runs if r["system"] == "bucketfs"}
        base = fetch_workers_in(self.args.mount_args)
        rows = []
        for compared in COMPARED:
            labels = (compared.label, variant_label(compared.label, count))
            if not all(label in runs for label in labels):
                continue
            first = None
            for fetch_workers, label in zip((base, count), labels):
                row = _design_row(compared, fetch_workers, runs[label], cpu_rows.get(label), first)
                first = first or row
                rows.append(row)
        return rows

    def fetch_workers_results(self) -> Optional[dict]:
        """--json's "fetch_workers_variant": None without the variant."""
        if not self.fetch_workers_variant_count:
            return None
        return {"fetch_workers": self.fetch_workers_variant_count, "rows": self.fetch_workers_rows()}

    def fetch_workers_title(self) -> str:
        """The lines printed above fetch_workers_table()."""
        base = fetch_workers_in(self.args.mount_args)
        where = "the daemon's curl thread" if not base else f"{base} fetch workers (--mount-args)"
        return (
            f"The small GETs in {where} against --fetch-workers {self.fetch_workers_variant_count} "
            "(--fetch-workers-variant; fetchworkers.py):\nthe same runs, each on a fresh mount, in this bench run. "
            "CPU per unit, ceiling and bounds as in the table above\n(bucketfs = the daemon and its fetch workers; "
            "W1 and W5 per GB, their throughput in MB/s):"
        )

    def fetch_workers_table(self) -> str:
        rows = self.fetch_workers_rows()
        if not rows:
            return ""
        base = design_name(fetch_workers_in(self.args.mount_args))
        cores = "/".join(str(n) for n in FREE_CORES)
        header = (
            "workload",
            "design",
            "throughput",
            f"vs {base}",
            "CPU per unit: main / bucketfs",
            "small GETs' CPU s: curl thread / fetch workers",
            "ceiling 1 / main",
            f"bound on {cores} free cores",
        )
        lines = []
        for r in rows:
            unit, cpu_unit = r["throughput_unit"], r["cpu_unit"]
            digits = 0 if unit == "files/s" else 1
            failed = "FAILED (see FAIL)" if r["failed"] else None
            lines.append(
                (
                    r["title"],
                    r["design"] + (" (none started)" if _none_started(r) else ""),
                    failed or f"{fmt_num(r['throughput'], digits)} {unit}",
                    "-" if r["over_first_design"] is None else f"{r['over_first_design']:.2f}x",
                    f"{fmt_num(r['main_cpu_per_unit'], 3)} / {fmt_num(r['bucketfs_cpu_per_unit'], 3)} {cpu_unit}",
                    f"{fmt_num(r['curl_cpu_s'], 2)} / {fmt_num(r['fetch_workers_cpu_s'], 2)}",
                    f"{fmt_num(r['ceiling'], 0)} {unit}",
                    " / ".join(fmt_num(r["bound"][n], 0) for n in FREE_CORES) + f" {unit}",
                )
            )
        table = text_table(header, lines)
        if any(_none_started(r) for r in rows):
            # Not a failure: the workers start at the mount's first small GET, and shards are large GETs.
            table += "\n(none started: no fetch worker was running at the run's end; they start at the first small GET)"
        return table


def _none_started(row: dict) -> bool:
    return bool(row["fetch_workers"]) and not row["fetch_workers_seen"]


def _design_row(compared: Compared, fetch_workers: int, run: dict, cpu: Optional[dict], first: Optional[dict]) -> dict:
    """One design's figures for a compared run: its throughput (the workload's own), and
    threadcpu's per-unit CPU, ceiling and bounds (`cpu`, its CPU-per-unit row; None for a
    failed run); `first` is the other design's row, the ratio's base."""
    cpu = cpu or {}
    throughput = None if run.get("error_count") else run.get("files/s" if compared.per_file else "MB/s")
    if compared.per_file:
        main, total = cpu.get("main_ms_per_file"), cpu.get("daemon_ms_per_file")
        ceiling, bound = cpu.get("ceiling_files_s"), cpu.get("bound_files_s") or {}
    else:  # threadcpu's GB/s, in the workloads' MB/s
        main, total = cpu.get("main_s_per_GB"), cpu.get("daemon_s_per_GB")
        ceiling = None if cpu.get("ceiling_GB_s") is None else cpu["ceiling_GB_s"] * MB_PER_GB
        bound = {n: None if x is None else x * MB_PER_GB for n, x in (cpu.get("bound_GB_s") or {}).items()}
    base_throughput = first["throughput"] if first else None
    census = run.get("daemon_threads_cpu_s") or {}
    return {
        "workload": compared.workload,
        "title": compared.title,
        "run": run["run"],
        "design": design_name(fetch_workers),
        "fetch_workers": fetch_workers,
        "fetch_workers_seen": census.get("fetch_workers_count", 0),  # live at the run's end
        "throughput": throughput,
        "throughput_unit": "files/s" if compared.per_file else "MB/s",
        "over_first_design": round(throughput / base_throughput, 3) if throughput and base_throughput else None,
        "main_cpu_per_unit": main,
        "bucketfs_cpu_per_unit": total,  # the daemon and its fetch workers
        "cpu_unit": "ms/file" if compared.per_file else "s/GB",
        # Where the small GETs' own work ran: the daemon's curl thread, or the fetch workers.
        "curl_cpu_s": (cpu.get("cpu_s") or {}).get("curl"),
        "fetch_workers_cpu_s": (cpu.get("cpu_s") or {}).get("fetch_workers"),
        "ceiling": ceiling,
        "bound": {n: bound.get(n) for n in FREE_CORES},
        "failed": bool(run.get("error_count")),
    }
