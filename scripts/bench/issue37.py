"""Issue 37's targets ("Use every core"), evaluated on a run: bucketfs against
s3torchconnector (W2 cold epoch with 32 threads, W5), W1 with 4 readers against direct
ranged GETs, W5's peak RSS, and the CPU per unit of the daemon's main thread and of all
of bucketfs: the daemon and its fetch workers (threadcpu.py). Printed after the tables
and kept in --json ("issue37")."""

from __future__ import annotations

import os

from .common import MB
from .procs import parse_cpus
from .s3torch import SYSTEM as S3TORCH
from .threadcpu import DAEMON_MS_PER_FILE, MAIN_MS_PER_FILE, MAIN_S_PER_GB, is_cold_small_files, is_streamed

W2_OVER_S3TORCH = 1.2  # W2 cold epoch, 32 threads: bucketfs / s3torchconnector
W5_OVER_S3TORCH = 1.2  # W5 total MB/s: bucketfs / s3torchconnector
W1_OVER_DIRECT = 1.0  # W1 shards, 4 readers: bucketfs / direct ranged GETs


class Issue37:
    """issue37_results() and its lines, mixed into `Bench` (runner.py)."""

    def issue37_results(self) -> list:
        def val(key, system="bucketfs"):
            row = self.rows.get(key)
            return None if row is None else row.values.get(system)

        def ratio(a, b):
            return None if a is None or not b else round(a / b, 3)

        results = []

        def add(what, figure, target, met):
            results.append({"what": what, "figure": figure, "target": target, "met": met})

        cannot = f" (s3torchconnector {self.s3torch_note})" if self.s3torch_note else ""

        def versus_s3torch(key, what, unit, digits, target):
            r = ratio(val(key), val(key, S3TORCH))
            figures = None if r is None else f"({val(key):,.{digits}f} / {val(key, S3TORCH):,.{digits}f} {unit})"
            add(
                f"{what}: bucketfs / s3torchconnector",
                None if r is None else f"{r:.2f}x {figures}",
                f">= {target}x{cannot}",
                None if r is None else r >= target,
            )

        if "W2.cold32" in self.rows:
            versus_s3torch("W2.cold32", "W2 cold epoch, 32 threads", "files/s", 0, W2_OVER_S3TORCH)
        if "W5.mbps" in self.rows:
            versus_s3torch("W5.mbps", "W5 mixed", "MB/s", 1, W5_OVER_S3TORCH)
            limit_mb = self.max_memory_bytes() / MB + 150
            peaks = [x for x in (val("W5.rss"), val("W5.hwm"), val("W5.mem")) if x is not None]
            add(
                "W5 peak memory (the highest of the daemon's sampled RSS and VmHWM, and its tree's PSS with the arena)",
                f"{max(peaks):,.0f} MB" if peaks else None,
                f"<= {limit_mb:,.0f} MB (--max-memory + 150 MB)",
                max(peaks) <= limit_mb if peaks else None,
            )
        if "W1.4" in self.rows:
            r = ratio(val("W1.4"), val("W1.4", "direct"))
            add(
                "W1 shards, 4 readers: bucketfs / direct ranged GETs",
                None if r is None else f"{r:.2f}x ({val('W1.4'):,.0f} / {val('W1.4', 'direct'):,.0f} MB/s)",
                f">= {W1_OVER_DIRECT}x",
                None if r is None else r >= W1_OVER_DIRECT,
            )
        for row in self.cpu_per_unit_rows():  # (with the fetch-workers variant's runs: fetchworkers.py)
            if is_cold_small_files(row["run"]):
                add(
                    f"{row['run']}: main thread CPU per file (ceiling)",
                    f"{row['main_ms_per_file']:.3f} ms ({row['ceiling_files_s']:,.0f} files/s)",
                    f"<= {MAIN_MS_PER_FILE} ms (>= {1 / MAIN_MS_PER_FILE * 1000:,.0f} files/s)",
                    row["main_ms_per_file"] <= MAIN_MS_PER_FILE,
                )
                add(
                    f"{row['run']}: bucketfs (daemon and fetch workers) CPU per file",
                    f"{row['daemon_ms_per_file']:.3f} ms",
                    f"<= {DAEMON_MS_PER_FILE} ms",
                    row["daemon_ms_per_file"] <= DAEMON_MS_PER_FILE,
                )
            elif is_streamed(row["run"]):
                add(
                    f"{row['run']}: main thread CPU per GB streamed (ceiling)",
                    f"{row['main_s_per_GB']:.3f} s ({row['ceiling_GB_s']:,.2f} GB/s)",
                    f"<= {MAIN_S_PER_GB} s (>= {1 / MAIN_S_PER_GB:,.0f} GB/s)",
                    row["main_s_per_GB"] <= MAIN_S_PER_GB,
                )
        return results

    def issue37_lines(self) -> list:
        lines = []
        for r in self.issue37_results():
            met = {True: "met", False: "MISSED", None: "-"}[r["met"]]
            lines.append(f"  {r['what']}: {r['figure'] or '-'}; target {r['target']}: {met}")
        store_cpus = self.args.store_cpus and len(parse_cpus(self.args.store_cpus))
        return lines + cpu_bounds_lines(self.runs, os.cpu_count() or 1, store_cpus or 0)


# The runs whose 1.2x targets the bound lines weigh: (run, unit, the rate's key, units per run).
BOUND_RUNS = (
    ("W2 epoch cold 32t", "files/s", "files/s", W2_OVER_S3TORCH),
    ("W5 mixed", "MB/s", "MB/s", W5_OVER_S3TORCH),
)


def cpu_bounds_lines(runs: list, cpus: int, store_cpus: int) -> list:
    """What this machine's CPUs allow bucketfs and s3torchconnector in W2's 32-thread cold
    epoch and W5, from the CPU each run cost (the store's: server + proxy; the client
    side's: readers, and bucketfs's daemon and workers): the store and the client sharing
    `cpus` (store_cpus 0) allow at most cpus / (store + client CPU per unit); the store on
    `store_cpus` of them, min(store_cpus / store's, the others / client's). Where 1.2x
    s3torchconnector's measured rate is beyond bucketfs's bound, the line says what
    client-side CPU per unit the target needs, or that the store's CPU alone forbids it."""
    by = {(r["run"], r["system"]): r for r in runs}
    lines = []
    for label, unit, key, target in BOUND_RUNS:
        per_unit = {}  # system -> (store CPU s, client-side CPU s) per unit
        for system in ("bucketfs", S3TORCH):
            r = by.get((label, system))
            if not r or not r.get(key) or r.get("error_count"):
                continue
            units = r[key] * r["wall_s"]
            store_s = r["server_cpu_s"] + r.get("proxy_cpu_s", 0)
            per_unit[system] = (store_s / units, (r["client_cpu_s"] + r.get("daemon_cpu_s", 0)) / units)
        if len(per_unit) < 2:
            continue
        if store_cpus:
            bound = {s: min(store_cpus / a, (cpus - store_cpus) / b) for s, (a, b) in per_unit.items()}
            how = f"the store on {store_cpus} CPU(s), the client on {cpus - store_cpus}"
        else:
            bound = {s: cpus / (a + b) for s, (a, b) in per_unit.items()}
            how = f"the store and the client sharing {cpus} CPUs"
        wanted = target * by[(label, S3TORCH)][key]
        milli = "ms per file" if unit == "files/s" else "ms per MB"
        costs = ", ".join(f"{s} {1000 * a:.2f} / {1000 * b:.2f}" for s, (a, b) in per_unit.items())
        line = (
            f"  {label}: CPU per unit (store / client side, {milli}): {costs}; {how} allow at most "
            f"{bound['bucketfs']:,.0f} {unit} for bucketfs, {bound[S3TORCH]:,.0f} for s3torchconnector; "
            f"{target}x s3torchconnector = {wanted:,.0f} {unit}: "
        )
        store_bfs, client_bfs = per_unit["bucketfs"]
        if wanted <= bound["bucketfs"]:
            line += "within bucketfs's bound"
        elif store_cpus and wanted > store_cpus / store_bfs:
            line += (
                f"beyond what the store's {store_cpus} CPU(s) serve ({store_cpus / store_bfs:,.0f}) whatever the client"
            )
        else:
            room = (cpus - store_cpus) / wanted if store_cpus else cpus / wanted - store_bfs
            line += f"needs <= {1000 * room:.2f} {milli} of client-side CPU here (bucketfs: {1000 * client_bfs:.2f})"
        lines.append(line)
    return lines
