"""The report: targets (which are met), the result table (every system, ratios,
targets), the cost table of every run, what the emulated store leaves this machine,
and the summary printed after a run (with --json)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time

from .common import MB, SYSTEMS, MiB, text_table
from .s3torch import SYSTEM as S3TORCH

# The rows s3torchconnector has a value in (W1 threads, W2 listing and cold epochs, W5).
S3TORCH_KEYS = ("W1.1", "W1.4", "W2.list", "W2.cold8", "W2.cold32", "W5.mbps", "W5.p50", "W5.p99")


class Report:
    """evaluate() and the tables, mixed into `Bench` (runner.py)."""

    # -- report ---------------------------------------------------------------------
    def evaluate(self) -> None:
        def val(key, system="bucketfs"):
            row = self.rows.get(key)
            return None if row is None else row.values.get(system)

        def ge(a, b):
            return None if a is None or b is None else a >= b

        def le(a, b):
            return None if a is None or b is None else a <= b

        checks = {
            "W1.1": lambda: ge(val("W1.1"), 570),
            "W1.4": lambda: ge(val("W1.4"), 800),
            "W1.wds": lambda: ge(val("W1.wds"), 0.9 * val("W1.wds", "local")) if val("W1.wds", "local") else None,
            "W2.list": lambda: le(val("W2.list"), 0.5),
            "W2.cold8": lambda: ge(val("W2.cold8"), val("W2.cold8", "direct")),
            "W2.cold32": lambda: ge(val("W2.cold32"), val("W2.cold32", "direct")),
            "W2.warm8": lambda: ge(val("W2.warm8"), 6000),
            "W2.warm32": lambda: ge(val("W2.warm32"), 6000),
            "W2.shared32": lambda: le(val("W2.shared32.gets"), 0) if val("W2.shared32") is not None else None,
            "W2.shared32.gets": lambda: le(val("W2.shared32.gets"), 0),
            "W3.flat.cold": lambda: (
                None
                if val("W3.flat.cold") is None
                else bool(le(val("W3.flat.cold"), val("W3.flat.cold", "direct")) and not self.w3_heads.get("flat"))
            ),
            "W3.flat.cached": lambda: le(val("W3.flat.cached"), 0.1),
            "W3.tree.cold": lambda: (
                None
                if val("W3.tree.cold") is None
                else bool(le(val("W3.tree.cold"), val("W3.tree.cold", "direct")) and not self.w3_heads.get("tree"))
            ),
            "W3.tree.cached": lambda: le(val("W3.tree.cached"), 0.1),
            "W4.ops": lambda: ge(val("W4.ops"), 2000),
            "W4.amp": lambda: le(val("W4.amp"), 4),
            "W5.mbps": lambda: ge(val("W5.mbps"), val("W5.mbps", "direct")),
            "W5.rss": lambda: le(val("W5.rss"), self.max_memory_bytes() / MB + 150),
            "W2.hwm": lambda: le(val("W2.hwm"), self.max_memory_bytes() / MB + 150),
            "W5.hwm": lambda: le(val("W5.hwm"), self.max_memory_bytes() / MB + 150),
            "W5.mem": lambda: le(val("W5.mem"), self.max_memory_bytes() / MB + 150),
            **self.cache_epochs_checks(),
        }
        if not self.backend.absolute_targets:  # speeds of the server, not of bucketfs: compare the ratios
            for key in ABSOLUTE_TARGET_KEYS:
                checks.pop(key, None)
                if key in self.rows:
                    self.rows[key].target += " (n/a here)"
        for key, row in self.rows.items():
            with contextlib.suppress(TypeError, ZeroDivisionError):
                row.met = checks[key]() if key in checks else None

    def table(self) -> str:
        def fmt(x):
            if x is None:
                return "-"
            if isinstance(x, int):  # a count (W2.shared32.gets): no decimals
                return f"{x:,}"
            if isinstance(x, float) and abs(x) < 10:
                return f"{x:.3f}"
            return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}"

        def ratio(a, b):
            if a is None or b is None or b == 0:
                return "-"
            return f"{a / b:.2f}x"

        alts = list(self.alt_mounts)
        titles = [self.alt_mounts[a].title for a in alts]
        # s3torchconnector (s3torch.py): a column on S3 whenever a workload it runs did; its
        # cells say why where it could not run ("not installed").
        s3torch = self.s3torch_note != "S3 only" and any(key in self.rows for key in S3TORCH_KEYS)
        header = (
            "workload",
            "unit",
            "bucketfs",
            self.backend.direct_label,
            "local",
            *titles,
            *((S3TORCH,) if s3torch else ()),
            "bucketfs/direct",
            "bucketfs/local",
            *(f"bucketfs/{t}" for t in titles),
            *((f"bucketfs/{S3TORCH}",) if s3torch else ()),
            "target",
            "met",
        )
        lines = []
        for row in self.rows.values():
            b, d, l = (row.values.get(s) for s in SYSTEMS)  # noqa: E741 - bucketfs, direct, local
            others = [row.values.get(a) for a in alts]
            t = row.values.get(S3TORCH)
            if not s3torch:
                t_cells = ()
            elif self.s3torch_note and row.key in S3TORCH_KEYS:
                t_cells = ((self.s3torch_note,), (self.s3torch_note,))
            else:
                t_cells = ((fmt(t),), (ratio(b, t),))
            met = {True: "yes", False: "NO", None: "-"}[row.met]
            lines.append(
                (
                    row.label,
                    row.unit + ("" if row.higher_is_better else " (lower better)"),
                    fmt(b),
                    fmt(d),
                    fmt(l),
                    *(fmt(r) for r in others),
                    *(t_cells[0] if t_cells else ()),
                    ratio(b, d),
                    ratio(b, l),
                    *(ratio(b, r) for r in others),
                    *(t_cells[1] if t_cells else ()),
                    row.target,
                    met,
                )
            )
        return text_table(header, lines)

    def cost_table(self) -> str:
        header = (
            "run",
            "system",
            "wall s",
            "LIST",
            "GET",
            "HEAD",
            "other req",
            "fetched MB",
            "mount CPU s",
            "client CPU s",
            "proxy CPU s",
            "server CPU s",
            "others' CPU s",
            "steal s",
        )
        lines = []
        for run in self.runs:
            req = dict(run.get("requests", {}))
            other = sum(v for k, v in req.items() if k not in ("LIST", "GET", "HEAD"))
            lines.append(
                (
                    run["run"],
                    run["system"],
                    f"{run['wall_s']:.2f}",
                    req.get("LIST", 0),
                    req.get("GET", 0),
                    req.get("HEAD", 0),
                    other,
                    f"{run.get('fetched_bytes', 0) / MB:.1f}",
                    "-" if run.get("daemon_cpu_s") is None else f"{run['daemon_cpu_s']:.2f}",
                    f"{run['client_cpu_s']:.2f}",
                    f"{run.get('proxy_cpu_s', 0):.2f}",
                    f"{run['server_cpu_s']:.2f}",
                    f"{run['foreign_cpu_s']:.1f}",
                    f"{run.get('steal_s', 0):.1f}",
                )
            )
        return text_table(header, lines)


def emulation_ceilings(runs: list, cpus: int) -> list:
    """What this machine allows any client of the emulated store, from the CPU the store
    itself (server + proxy) used in this run: lines for the W1 rows. On a real
    deployment that CPU is the store's and the network's, not the training machine's;
    here it shares the machine's cores with the client, so it caps every client.
    - W1 MB/s: the store's CPU per MB (the lower of bucketfs's and direct's runs) plus
      each system's own CPU per MB (its readers', and bucketfs's: its daemon's and its
      fetch workers'), on `cpus` cores: a reader side that cheap cannot pass cpus / (that
      sum) MB/s. The local disk's readers are the least any reader side spends: no
      client passes that one.
    - W1 bucketfs: what faulting in its fresh part buffers cost (fresh_buffer_line).
    - webdataset: the local loop keeps the cores busy (its busy CPU is ~cpus x its
      seconds), so a mount's run needs at least (the local loop's busy CPU + the store's
      CPU) / cpus seconds even if its daemon cost nothing: a ceiling on mount / local."""
    by = {(r["run"], r["system"]): r for r in runs}
    lines = []
    for label in ("W1 1 reader(s)", "W1 4 reader(s)", "W1 4 reader(s), next epoch"):
        runs_of = {system: by.get((label, system)) for system in ("local", "direct", S3TORCH, "bucketfs")}
        remote = [
            r
            for r in (runs_of["bucketfs"], runs_of["direct"], runs_of[S3TORCH])
            if r and r.get("fetched_bytes") and not r.get("error_count")
        ]
        if not runs_of["local"] or not remote or not runs_of["local"].get("MB/s"):
            continue
        store_s_per_mb = min((r["server_cpu_s"] + r.get("proxy_cpu_s", 0)) / (r["fetched_bytes"] / MB) for r in remote)
        client_s_per_mb = {}  # everything on this machine that is not the store, per MB read
        for system, r in runs_of.items():
            if r and r.get("MB/s") and not r.get("error_count"):
                client_s_per_mb[system] = (r["client_cpu_s"] + r.get("daemon_cpu_s", 0)) / (r["MB/s"] * r["wall_s"])
        parts = ", ".join(f"{system} {1000 * v:.2f}" for system, v in client_s_per_mb.items())
        bounds = " / ".join(f"{cpus / (store_s_per_mb + v):,.0f}" for v in client_s_per_mb.values())
        lines.append(
            f"  {label}: the store used {1000 * store_s_per_mb:.2f} ms of CPU per MB (server + proxy); the reader "
            f"side ({'bucketfs daemon and fetch workers + ' if 'bucketfs' in client_s_per_mb else ''}readers) used, "
            f"per MB: {parts} ms. "
            f"On {cpus} CPUs, store + that reader side allow at most {bounds} MB/s "
            f"({' / '.join(client_s_per_mb)})"
        )
        if "bucketfs" in client_s_per_mb:
            lines += fresh_buffer_line(by, label, cpus, store_s_per_mb, client_s_per_mb["bucketfs"])
    local, mount = by.get(("W1 webdataset", "local")), by.get(("W1 webdataset", "bucketfs"))
    if local and mount and local.get("loop_busy_cpu_s") and local.get("samples/s"):
        store_s = mount["server_cpu_s"] + mount.get("proxy_cpu_s", 0)
        ratio = local["loop_busy_cpu_s"] / (local["loop_busy_cpu_s"] + store_s)
        lines.append(
            f"  W1 webdataset: the local loop kept {local['loop_busy_cpu_s']:.1f} CPU s busy and the store used "
            f"{store_s:.1f} CPU s for the mount's run: with a daemon that cost nothing, a mount reaches at most "
            f"{ratio:.2f}x local here ({ratio * local['samples/s']:,.0f} samples/s)"
        )
    return lines


def fresh_buffer_line(by: dict, label: str, cpus: int, store_s_per_mb: float, client_s_per_mb: float) -> list:
    """bucketfs's W1 run `label`: the fresh part buffers it faulted in (the daemon's
    backend.fresh_* counters; a next epoch's are its mount's since the run before) and
    the CPU that took, which is the machine's price for new memory, not the read's (a
    VM whose host takes back the pages its guest frees backs them again at each first
    touch); and the bound store + reader side would allow without it. A stream that
    runs ~1 s from a new mount pays for its whole window's memory: the process reading
    directly reuses its own heap."""
    r = by[(label, "bucketfs")]
    stats = r.get("daemon_stats") or {}
    if "backend.fresh_buffers" not in stats:  # (a daemon that does not count them)
        return []
    before = (by.get((label.removesuffix(", next epoch"), "bucketfs")) or {}) if label.endswith(", next epoch") else {}
    before_stats = before.get("daemon_stats") or {}

    def delta(name):
        return stats.get(name, 0) - before_stats.get(name, 0)

    buffers, mib, fault_s = (
        delta("backend.fresh_buffers"),
        delta("backend.fresh_bytes") / MiB,
        delta("backend.fresh_fault_cpu_s"),
    )
    without_s_per_mb = client_s_per_mb - fault_s / (r["MB/s"] * r["wall_s"])
    return [
        f"  {label}: bucketfs faulted in {buffers} fresh part buffers ({mib:,.0f} MiB) at "
        f"{1000 * fault_s / mib if mib else 0:.2f} ms of CPU per MiB: {fault_s:.2f} CPU s of the daemon's "
        f"{r.get('daemon_cpu_s', 0):.2f}; without it its reader side {1000 * without_s_per_mb:.2f} ms per MB, and "
        f"store + reader side would allow {cpus / (store_s_per_mb + without_s_per_mb):,.0f} MB/s"
    ]


# Targets that are absolute speeds of a remote read (set for S3 at full scale): not
# evaluated on a backend that cannot reach them whatever the client (the GCS emulator).
ABSOLUTE_TARGET_KEYS = ("W1.1", "W1.4", "W2.list", "W4.ops")

TARGETS = """Targets (from the issue):
  W1: 1 reader >= 570 MB/s; 4 readers >= 800 MB/s; webdataset >= 0.9x local disk.
  W2: listing <= 0.5 s cold; cold epoch >= 1.0x direct boto3 at the same thread count; warm epoch >= 6,000 files/s;
      cold epoch against copy-then-read (issue 36): 8 threads >= 1.0x copy-then-read and >= 2.5x direct, 32 threads >= 1.2x;
      `bucketfs warm` of the ImageFolder set >= 0.9x the s5cmd copy's rate (issue 36).
  W3: cold no slower than the LIST requests it needs (no HEADs); cached <= 0.1 s.
  W4: >= 2,000 ops/s with bytes fetched <= 4x bytes read.
  W5: total >= direct; peak RSS <= --max-memory + 150 MB.
  W6: random-order epochs over a data set twice the cache (disk cache, and memory budget): epochs 2 and 3 find >= 45%
      of files cached; LRU's figure beside it (issue 36).
  Issue 37: W2 cold epoch, 32 threads >= 1.2x s3torchconnector; W5 >= 1.2x s3torchconnector with peak RSS <=
      --max-memory + 150 MB; W1 4 readers >= 1.0x direct ranged GETs; the daemon's main thread (trio, FUSE) <= 0.25 ms
      of CPU per cold ~100 KB file (>= 4,000 files/s) and <= 0.25 s per GB streamed (>= 4 GB/s); all of bucketfs
      (the daemon and its fetch workers) <= 1 ms per file."""


def print_report(bench, args, backend_cls, started: float) -> int:
    """Everything printed after the runs (and --json); 1 if a run failed, else 0."""
    bench.evaluate()
    print()
    print(
        f"bucketfs benchmark: scale {args.scale:g}, +{args.latency_ms:g} ms first byte, {args.conn_mbps:g} MB/s per connection, "
        f"--max-memory {args.max_memory}{backend_cls.title}, {time.perf_counter() - started:.0f} s"
        + (f"; the store and proxy on CPUs {args.store_cpus}, the rest on the others" if args.store_cpus else "")
        + (
            f"; ImageFolder files and shards uploaded with their {args.object_checksum}"
            if args.object_checksum != "none"
            else ""
        )
    )
    print(bench.table())
    print()
    copy_then_read = bench.copy_then_read_table()
    if copy_then_read:
        print(
            "W2 cold epoch against copy-then-read (s5cmd copies imagefolder/ to local disk through the proxy, then the\n"
            "same epoch on the copy, page cache dropped; its rate = files / (copy s + epoch s)):"
        )
        print(copy_then_read)
        print()
    warm = bench.warm_table()
    if warm:
        print(
            f"W2 `bucketfs warm` of imagefolder/ into an empty --cache-dir ({bench.warm_concurrency_label()}), right after\n"
            "each s5cmd copy, through the same proxy; then a mount on that cache reads every file (verified; GETs counted):"
        )
        print(warm)
        print()
    cache_epochs = bench.cache_epochs_table()
    if cache_epochs:
        print(
            "W6 random-order epochs over a data set twice the cache (page cache dropped before each epoch; files cached =\n"
            "files that cost no GET; from disk = the daemon's disk cache hits):"
        )
        print(cache_epochs)
        print()
    cpu_per_unit = bench.cpu_per_unit_table()
    if cpu_per_unit:
        print(
            "bucketfs's CPU per unit by thread and process (issue 37; threadcpu.py): main = trio and FUSE (by the daemon's\n"
            "own clock of that thread; user+sys in 10 ms ticks), curl = the\n"
            "libcurl thread, workers = trio's thread cache (and threads that exited), fetch workers = the daemon's fetch\n"
            "worker processes (--fetch-workers; and those reaped); bucketfs total = the daemon and its fetch workers.\n"
            "Ceiling = 1 / main-thread CPU per unit (no extra core lifts it); bound on N free cores = min(ceiling,\n"
            "N / bucketfs CPU per unit). W5 charges its whole run to each unit:"
        )
        print(cpu_per_unit)
        print()
    fetch_workers = bench.fetch_workers_table()
    if fetch_workers:
        print(bench.fetch_workers_title())
        print(fetch_workers)
        print()
    print("Requests and costs of each run (requests and bytes counted by the proxy; fetched = response bodies):")
    print(bench.cost_table())
    print(
        "(mount CPU = bucketfs's daemon and its fetch workers, or an alternative mount's process; client CPU = this\n"
        " script's threads and children; others' CPU = CPU time of processes that are not part of this\n"
        " benchmark during the run: noise from a shared machine, which has 2 CPUs = 2 CPU s per second of wall time;\n"
        " steal = CPU time the hypervisor gave other guests while this VM wanted it: a slow host)"
    )
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    # (With --store-cpus the store has cores of its own: it caps no client by its CPU.)
    ceilings = [] if args.store_cpus else emulation_ceilings(bench.runs, os.cpu_count() or 1)
    if ceilings:
        print("\nWhat the emulated store leaves this machine (its CPU is on the same cores as the client's):")
        print("\n".join(ceilings))
    print()
    print(TARGETS)
    if backend_cls.targets_note:
        print(backend_cls.targets_note)
    issue37 = bench.issue37_lines()
    if issue37:
        print("\nIssue 37 in this run:")
        print("\n".join(issue37))
    if bench.mount.notes:
        print("\nbucketfs daemon log notes:")
        for note in bench.mount.notes:
            print(f"  {note}")
    for alt in bench.alt_mounts.values():
        if alt.notes:
            print(f"\n{alt.title} log notes:")
            for note in alt.notes:
                print(f"  {note}")
    for note in bench.alt_notes:
        print(f"\nNOTE: {note}")
    if not bench.dropped_ok:
        print("\nNOTE: the page cache could not be dropped: cold local runs were warm.")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "config": {k: str(v) for k, v in vars(args).items() if k != "wds_child"},
                    "rows": [dataclasses.asdict(r) for r in bench.rows.values()],
                    "copy_then_read": bench.copy_then_read_rows(),
                    "warm_vs_copy": bench.warm_rows(),
                    "cache_epochs": bench.cache_epoch_results,
                    "s3torchconnector": bench.s3torch_rows(),
                    "cpu_per_unit": bench.cpu_per_unit_rows(),
                    "fetch_workers_variant": bench.fetch_workers_results(),
                    "issue37": bench.issue37_results(),
                    "runs": bench.runs,
                    "failures": bench.failures,
                },
                indent=1,
            )
        )
    if bench.failures:
        print("\n" + "!" * 78)
        print(f"FAIL: {len(bench.failures)} run(s) returned wrong bytes, errors or hung:")
        for f in bench.failures:
            print(f"  FAIL {f}")
        print("!" * 78)
        return 1
    print("\nAll reads verified.")
    return 0
