"""`python scripts/bench.py`'s options and main(): checks them, gets the data set,
starts the store behind the proxy, runs the workloads asked for and prints the report.
Also the entry of the child processes (--wds-child, --gcs-proxy-child)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import HASH_NAME, MB, REPO, log
from .copythenread import S5CMD_WORKERS
from .datasets import Dataset, Spec, ensure_dataset
from .fetchworkers import DEFAULT_FETCH_WORKERS
from .procs import drop_caches, is_mounted, parse_cpus, pin_tree
from .report import print_report
from .runner import Bench
from .stores import BACKENDS, gcs_proxy_child
from .wds import wds_child


def parse_args(argv):
    p = argparse.ArgumentParser(description="bucketfs vs direct SDK reads vs local disk, on emulated-remote S3 or GCS.")
    p.add_argument(
        "--latency-ms", type=float, default=20.0, help="added time to first byte of every response (default 20)"
    )
    p.add_argument(
        "--conn-mbps", type=float, default=100.0, help="per-connection cap, MB/s (10^6 B/s); 0 = none (default 100)"
    )
    p.add_argument(
        "--data-dir", type=Path, default=REPO / ".bench-data", help="generated data set, reused (default .bench-data/)"
    )
    p.add_argument("--only", default="W1,W2,W3,W4,W5,W6", help="comma-separated workloads (default all)")
    p.add_argument("--max-memory", default="1G", help="passed to the mount (default 1G)")
    p.add_argument("--mount-args", default="", help="extra bucketfs mount options, e.g. '--part-size 4M' (tuning runs)")
    p.add_argument(
        "--scale", type=float, help="shrink the data set, e.g. 0.25 for a quick run (default 1; 0.15 for gcs)"
    )
    p.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="s3",
        help="s3: rclone serve s3 vs boto3 (default); gcs: gcp-storage-emulator vs google-cloud-storage",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--py-spy",
        type=Path,
        metavar="DIR",
        help="profile the daemon in every bucketfs run with py-spy (collapsed stacks in DIR)",
    )
    p.add_argument(
        "--proxy-log",
        type=Path,
        metavar="FILE",
        help="the proxy appends one line per request here (time, connection, kind, key, range)",
    )
    p.add_argument(
        "--alternatives",
        action="store_true",
        help="also run every workload over existing FUSE mounts (rclone mount; s3fs where installed) for comparison (s3 only)",
    )
    p.add_argument(
        "--s5cmd-workers",
        type=int,
        default=S5CMD_WORKERS,
        help=f"W2 copy-then-read: s5cmd --numworkers (default {S5CMD_WORKERS}; s5cmd's own default is 256)",
    )
    p.add_argument(
        "--warm-concurrency",
        type=int,
        help="W2's `bucketfs warm` beside the s5cmd copy: its --concurrency (default: warm's own, 256)",
    )
    p.add_argument(
        "--fetch-workers-variant",
        type=int,
        default=DEFAULT_FETCH_WORKERS,
        metavar="N",
        help="after the workloads, W2's cold epochs, W1 (4 readers) and W5 again on a mount with --fetch-workers N, "
        f"compared with the default mount's runs (default {DEFAULT_FETCH_WORKERS}; 0: not run)",
    )
    p.add_argument(
        "--store-cpus",
        metavar="CPUS",
        help="run the store's server and the latency proxy on these CPUs (taskset -c's form, e.g. 1) and "
        "everything else (this script, the mounts, every client) on the others: the client side gets "
        "cores of its own, as it would where the store is another machine",
    )
    p.add_argument(
        "--object-checksum",
        choices=("none", "crc32", "crc32c"),
        default="none",
        help="S3: upload the ImageFolder files and the shards again through the server's API with this "
        "full-object checksum, as AWS's SDKs upload by default, so that the store states it in its answers "
        "(default none: the files as written, whose only checksum is the ETag's MD5)",
    )
    p.add_argument("--wds-child", help=argparse.SUPPRESS)
    p.add_argument("--gcs-proxy-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.scale is None:
        args.scale = BACKENDS[args.backend].default_scale
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.wds_child:
        return wds_child(json.loads(args.wds_child))
    if args.gcs_proxy_child:
        return gcs_proxy_child(json.loads(args.gcs_proxy_child))
    only = [w.strip().upper() for w in args.only.split(",") if w.strip()]
    unknown = set(only) - {"W1", "W2", "W3", "W4", "W5", "W6"}
    if unknown:
        print(f"bench: unknown workload(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.alternatives and args.backend != "s3":
        print("bench: --alternatives needs --backend s3 (rclone mount :s3:, s3fs)", file=sys.stderr)
        return 2
    if args.warm_concurrency is not None and args.warm_concurrency < 1:
        print("bench: --warm-concurrency must be at least 1", file=sys.stderr)
        return 2
    if args.fetch_workers_variant < 0:
        print("bench: --fetch-workers-variant must be at least 0", file=sys.stderr)
        return 2
    if args.s5cmd_workers < 1:
        print("bench: --s5cmd-workers must be at least 1", file=sys.stderr)
        return 2
    if args.object_checksum != "none" and args.backend != "s3":
        print("bench: --object-checksum needs --backend s3", file=sys.stderr)
        return 2
    if not 0 < args.scale <= 1:
        print("bench: --scale must be in (0, 1]", file=sys.stderr)
        return 2
    client_cpus = None
    if args.store_cpus is not None:
        available = os.sched_getaffinity(0)
        try:
            store_cpus = parse_cpus(args.store_cpus)
        except ValueError:
            print(f"bench: --store-cpus {args.store_cpus!r}: not a CPU list like 1, 0,2 or 2-3", file=sys.stderr)
            return 2
        client_cpus = available - store_cpus
        if not store_cpus <= available or not client_cpus:
            print(
                f"bench: --store-cpus {args.store_cpus}: must be some, not all, of this machine's CPUs "
                f"{sorted(available)}",
                file=sys.stderr,
            )
            return 2
    args.data_dir = args.data_dir.resolve()
    spec = Spec.for_scale(args.scale)
    bucket_dir, manifest = ensure_dataset(spec, args.data_dir)
    ds = Dataset(spec, bucket_dir, manifest)
    log(
        f"data: {len(ds.shards)} shards ({ds.bytes_of(ds.shards) / MB:.0f} MB, {ds.sample_count} samples), "
        f"{len(ds.images)} ImageFolder files ({ds.bytes_of(ds.images) / MB:.0f} MB), {len(ds.flat)} flat, {len(ds.tree)} tree objects; "
        f"digests {HASH_NAME}"
    )
    log(f"load average {os.getloadavg()[0]:.2f}")
    log(
        f"emulation: +{args.latency_ms:g} ms to first byte, {args.conn_mbps:g} MB/s per connection; "
        f"--max-memory {args.max_memory}; {os.cpu_count()} CPUs"
    )
    if not drop_caches():
        log("WARNING: cannot drop the page cache (not root?): 'cold' local runs are warm")
    backend_cls = BACKENDS[args.backend]
    started = time.perf_counter()
    work_dir = tempfile.mkdtemp(prefix="bucketfs-bench-")
    bench = None
    try:
        with backend_cls(args.data_dir / "srv", args.latency_ms, args.conn_mbps, args.proxy_log).serve() as backend:
            backend.seed(ds)
            if args.object_checksum != "none":
                backend.upload_with_checksum(ds, ds.images + ds.shards, args.object_checksum)
            log(f"server: {backend.description} behind the proxy {backend.proxy.url} (pid {backend.proxy.pid})")
            if client_cpus is not None:
                # This process's tree first (the server and proxy are in it), then theirs.
                pin_tree(os.getpid(), client_cpus)
                pinned = pin_tree(backend.server.pid, store_cpus) + pin_tree(backend.proxy.pid, store_cpus)
                log(
                    f"CPUs: the server and the proxy ({pinned} threads) on {sorted(store_cpus)}; this script, "
                    f"the mounts and the clients on {sorted(client_cpus)}"
                )
            bench = Bench(args, ds, backend, work_dir)
            try:
                for name in only:
                    log(f"{name}")
                    getattr(bench, name.lower())()
                bench.fetch_workers_variant(only)  # the same runs on a mount with --fetch-workers N (fetchworkers.py)
            finally:
                bench.stop_mounts()
    finally:
        if bench is not None and is_mounted(bench.mountpoint):
            subprocess.run(["fusermount3", "-uz", bench.mountpoint], capture_output=True)
        for alt in bench.alt_mounts.values() if bench is not None else ():
            if alt.proc is not None:
                alt.abort()
                alt.proc.wait()
            if is_mounted(alt.mountpoint):
                subprocess.run([*alt.lazy_unmount_cmd, alt.mountpoint], capture_output=True)
        shutil.rmtree(work_dir, ignore_errors=True)
    return print_report(bench, args, backend_cls, started)
