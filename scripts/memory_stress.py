#!/usr/bin/env python3
"""Many sequential readers on a small --max-memory: slow is allowed, stalled is not.

Starts the local S3 server (`rclone serve s3`), writes 16 objects of 20 MiB (or
--objects of --object-mb; --mix adds objects of many sizes), mounts
the bucket with a small memory budget and has THREADS threads each open a random
object, drop its pages from the kernel's cache, and read it in 1 MiB preads, over
and over, comparing every byte. Prints the bytes read, the READ latency (p50, p99,
max), the daemon's memory figures (budget peak, demand waits, overcommits: READs
that waited `DEMAND_WAIT_MAX_S` and took memory past the budget) and its peak RSS.

    python scripts/memory_stress.py                                  # 64 threads, 30 s, --max-memory 16M --part-size 1M
    python scripts/memory_stress.py --threads 64 --seconds 30 --mount-args "--max-memory 16M"
    python scripts/memory_stress.py --suffix .tar                    # shard names: wide windows, warmed heads
    python scripts/memory_stress.py --mix --threads 32 --seconds 300 # long churn of mixed sizes (heap fragmentation)
    python scripts/memory_stress.py --objects 64 --object-mb 7 --mount-args "--max-memory 256M"  # small files, fetched whole

Exits 1 on a wrong byte, an overcommit, or a READ slower than the overcommit deadline.
Not part of CI (tests/unit/test_read_path.py checks the behaviour on the fake backend).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import random
import shlex
import sys
import tempfile
import threading
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.procs import proc_status_kib  # noqa: E402 - scripts/ is on the path (this script's directory)

from bucketfs.core.memory import DEMAND_WAIT_MAX_S  # noqa: E402

MiB = 1024 * 1024
READ_BYTES = 1 * MiB


def read_loop(mount, objects: dict, seed: int, stop_s: float, latencies_s: list, wrong: list, lock) -> int:
    """One reader: whole objects in 1 MiB preads until `stop_s`; returns bytes read."""
    rng = random.Random(seed)
    names = sorted(objects)
    read_bytes = 0
    while time.monotonic() < stop_s:
        name = rng.choice(names)
        want = objects[name]
        fd = os.open(mount.path(name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the READs reach the daemon
            off = 0
            while off < len(want) and time.monotonic() < stop_s:
                started_s = time.monotonic()
                got = os.pread(fd, READ_BYTES, off)
                took_s = time.monotonic() - started_s
                with lock:
                    latencies_s.append(took_s)
                    if not got or got != want[off : off + len(got)]:
                        wrong.append((name, off))
                if not got:
                    break
                off += len(got)
                read_bytes += len(got)
        finally:
            os.close(fd)
    return read_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--mount-args", default="--max-memory 16M --part-size 1M", help="bucketfs mount options")
    parser.add_argument("--suffix", default=".bin", help="object name suffix (.tar: shard names)")
    parser.add_argument("--objects", type=int, default=16, help="how many objects of --object-mb")
    parser.add_argument(
        "--object-mb",
        type=float,
        default=20.0,
        help="their size in MiB (up to --small-file-bytes, 8M by default, they are fetched whole at open)",
    )
    parser.add_argument(
        "--mix",
        action="store_true",
        help="add 400 small objects (1 KiB-6 MiB, fetched whole at open) and 16 of 2-12 MB: "
        "buffers of many sizes, the churn that fragments the heap",
    )
    args = parser.parse_args()

    from bucketfs.testing.mounting import bucketfs_mount
    from bucketfs.testing.servers import rclone_s3_server

    rng = random.Random(1)
    objects = {f"big/f{i:03d}{args.suffix}": rng.randbytes(int(args.object_mb * MiB) + i) for i in range(args.objects)}
    if args.mix:
        objects.update({f"small/s{i:03d}.jpg": rng.randbytes(int(1024 * 6144 ** rng.random())) for i in range(400)})
        objects.update(
            {f"mid/m{i:02d}{args.suffix}": rng.randbytes(rng.randrange(2 * MiB, 12 * MiB)) for i in range(16)}
        )
    with tempfile.TemporaryDirectory(prefix="bucketfs-memory-stress-") as work:
        work_dir = pathlib.Path(work)
        with rclone_s3_server(work_dir / "s3") as server:
            bucket = server.new_bucket()
            server.write_files(bucket, objects)
            env = dict(os.environ, **server.env())
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
            mountpoint = work_dir / "mnt"
            mountpoint.mkdir()
            with bucketfs_mount(
                f"s3://{bucket}/",
                str(mountpoint),
                str(work_dir / "bucketfs.log"),
                endpoint_url=server.endpoint_url,
                env=env,
                extra_args=shlex.split(args.mount_args),
            ) as mount:
                latencies_s, wrong, lock = [], [], threading.Lock()
                started_s = time.monotonic()
                stop_s = started_s + args.seconds
                with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
                    futures = [
                        pool.submit(read_loop, mount, objects, i, stop_s, latencies_s, wrong, lock)
                        for i in range(args.threads)
                    ]
                    total_bytes = sum(f.result() for f in futures)
                elapsed_s = time.monotonic() - started_s
                peak_rss_kib = proc_status_kib(mount.proc.pid, "VmHWM")  # the kernel's own peak
                end_rss_kib = proc_status_kib(mount.proc.pid, "VmRSS")
                stats = mount.stats()
    latencies_s.sort()
    slow_count = sum(t > DEMAND_WAIT_MAX_S for t in latencies_s)
    overcommits = stats.get("memory.overcommits", 0)
    print(
        f"{args.threads} threads, {args.seconds:.0f} s, mount options: {args.mount_args}, names *{args.suffix}"
        f"{', mixed sizes' if args.mix else ''}"
    )
    print(
        f"read {total_bytes / 1e6:,.0f} MB in {elapsed_s:.1f} s ({total_bytes / 1e6 / elapsed_s:,.0f} MB/s), "
        f"{len(latencies_s):,} READs; wrong bytes: {len(wrong)}"
    )
    if latencies_s:
        print(
            f"READ latency p50 {latencies_s[len(latencies_s) // 2]:.3f} s, "
            f"p99 {latencies_s[int(len(latencies_s) * 0.99)]:.2f} s, max {latencies_s[-1]:.1f} s; "
            f"over {DEMAND_WAIT_MAX_S:.0f} s: {slow_count}"
        )
    print(
        f"memory: budget {stats['memory.budget_bytes'] / MiB:.0f} MiB, peak {stats['memory.peak_bytes'] / MiB:.1f} MiB, "
        f"demand waits {stats.get('memory.demand_waits', 0):,}, overcommits {overcommits}; "
        f"daemon peak RSS {peak_rss_kib / 1024:.0f} MiB, at the end {end_rss_kib / 1024:.0f} MiB; GETs {stats.get('backend.requests.get', 0):,}"
    )
    return 1 if wrong or overcommits or slow_count else 0


if __name__ == "__main__":
    sys.exit(main())
