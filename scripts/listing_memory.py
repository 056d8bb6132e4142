#!/usr/bin/env python3
"""Does --max-memory hold with a big listing? The daemon's RSS per listed object, and
its peak RSS when a full listing cache meets a full block cache.

This starts the local S3 server (`rclone serve s3`) over a bucket of many small
objects in folders (an ImageNet-like tree, scaled down) plus a folder of larger
files, and mounts it with a small --max-memory. It then:
1. walks and `stat`s every small object through the mount, and prints the daemon's
   RSS growth per listed object beside what bucketfs charges the budget for one
   (`memory.listings_bytes` in the stats, LISTED_ENTRY_BYTES each);
2. reads every larger file with 16 threads (twice the budget's worth, so the block
   cache fills) and prints the daemon's peak RSS (VmHWM) against --max-memory plus
   the documented overhead (150 MB).

    python scripts/listing_memory.py                          # 200,000 objects, --max-memory 256M
    python scripts/listing_memory.py --objects 500000 --max-memory 512M

Not part of CI (tests/unit/test_read_path.py checks the accounting).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.procs import proc_status_kib  # noqa: E402 - scripts/ is on the path (this script's directory)

from bucketfs.app.cli import parse_size  # noqa: E402
from bucketfs.testing.mounting import daemon_stats  # noqa: E402

OVERHEAD_BYTES = 150 * 10**6  # the README's documented overhead on top of --max-memory
LARGE_FILE_BYTES = 2 * 1024 * 1024  # whole-object GETs into the block cache


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    return proc_status_kib(pid, field) * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=200_000, help="small objects, in folders of 1,000")
    parser.add_argument("--max-memory", default="256M", help="the mount's --max-memory")
    args = parser.parse_args()
    budget_bytes = parse_size(args.max_memory)
    large_count = 2 * budget_bytes // LARGE_FILE_BYTES

    from bucketfs.testing.mounting import bucketfs_mount
    from bucketfs.testing.servers import rclone_s3_server

    with tempfile.TemporaryDirectory(prefix="bucketfs-listmem-") as work:
        work_dir = pathlib.Path(work)
        with rclone_s3_server(work_dir / "s3") as server:
            bucket = server.new_bucket()
            root = server.root_dir / bucket
            for i in range(args.objects):
                folder = root / "train" / f"c{i // 1000:04d}"
                if i % 1000 == 0:
                    folder.mkdir(parents=True)
                (folder / f"img{i:07d}.jpg").write_bytes(b"x" * 100)
            (root / "large").mkdir()
            payload = os.urandom(LARGE_FILE_BYTES)
            for i in range(large_count):
                (root / "large" / f"f{i:04d}.bin").write_bytes(payload[i:] + payload[:i])
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
                extra_args=["--max-memory", args.max_memory],
            ) as mount:
                pid = mount.proc.pid
                os.listdir(mount.mountpoint)
                before_bytes = rss_bytes(pid)
                started_s = time.perf_counter()
                seen = 0
                for dirpath, _, filenames in os.walk(mount.path("train")):
                    for name in filenames:
                        os.stat(os.path.join(dirpath, name))
                        seen += 1
                walk_s = time.perf_counter() - started_s
                if seen != args.objects:
                    print(f"walk saw {seen} objects, not {args.objects}", file=sys.stderr)
                    return 1
                stats = daemon_stats(mount.mountpoint)
                grown_bytes = rss_bytes(pid) - before_bytes
                listings_bytes = stats.get("memory.listings_bytes")
                print(
                    f"walk+stat of {seen:,} objects: {walk_s:.1f} s; daemon RSS {before_bytes / 1e6:.0f} -> "
                    f"{(before_bytes + grown_bytes) / 1e6:.0f} MB, {grown_bytes / seen:.0f} B per object; "
                    f"charged to the budget: {'-' if listings_bytes is None else f'{listings_bytes / 1e6:.0f} MB'}",
                    flush=True,
                )

                def read(i: int) -> bool:
                    with open(mount.path("large", f"f{i:04d}.bin"), "rb") as f:
                        return f.read() == payload[i:] + payload[:i]

                started_s = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(16) as pool:
                    if not all(pool.map(read, range(large_count))):
                        print("a large file read back wrong", file=sys.stderr)
                        return 1
                stats = daemon_stats(mount.mountpoint)
                peak_bytes = rss_bytes(pid, "VmHWM")
                bound_bytes = budget_bytes + OVERHEAD_BYTES
                print(
                    f"read {large_count} x {LARGE_FILE_BYTES >> 20} MiB in {time.perf_counter() - started_s:.1f} s: "
                    f"block cache {stats['cache.bytes'] / 1e6:.0f} MB, buffers peak {stats['memory.peak_bytes'] / 1e6:.0f} MB; "
                    f"daemon peak RSS {peak_bytes / 1e6:.0f} MB against --max-memory + overhead {bound_bytes / 1e6:.0f} MB: "
                    f"{'within' if peak_bytes <= bound_bytes else 'OVER'}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
