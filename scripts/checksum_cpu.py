#!/usr/bin/env python3
"""bucketfs's CPU per cold small file by the checksum its store states: the same files
uploaded three ways to `rclone serve s3` on 127.0.0.1 (as files, so only the ETag's
MD5; with a CRC32C; with a CRC32, as AWS's SDKs upload by default), each read once by
32 threads in shuffled order on a fresh mount, every byte verified.

    python3 scripts/checksum_cpu.py [--files 4000] [--rounds 3]

Prints, per kind and round, files/s and the CPU of the daemon and its fetch-ahead
workers per file (their /proc ticks), and each kind's mean against the MD5's. Needs
rclone (`pip install -e '.[test]'`); as root the page cache is dropped before each epoch.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.procs import drop_caches, tree_cpu_s  # noqa: E402 - (scripts/bench, beside this file)

from bucketfs.testing.mounting import Mount, server_env  # noqa: E402
from bucketfs.testing.servers import rclone_s3_server  # noqa: E402

FILE_BYTES = 100_000  # an ImageFolder sample
READER_THREADS = 32
KINDS = ("md5", "crc32c", "crc32")


def epoch(server, bucket: str, files: dict, seed: int) -> tuple:
    """(files/s, CPU ms per file) of one cold shuffled epoch on a fresh mount."""
    drop_caches()
    mountpoint = tempfile.mkdtemp(prefix="bucketfs-checksum-")
    mount = Mount(f"s3://{bucket}/", mountpoint, server_env(server), (), endpoint_url=server.endpoint_url)
    try:
        order = sorted(files)
        random.Random(seed).shuffle(order)

        def read(key: str) -> None:
            with open(os.path.join(mountpoint, key), "rb") as f:
                if f.read() != files[key]:
                    raise AssertionError(f"{key}: wrong bytes")

        cpu0_s, t0_s = tree_cpu_s(mount.proc.pid), time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(READER_THREADS) as pool:
            list(pool.map(read, order))
        wall_s, cpu_s = time.monotonic() - t0_s, tree_cpu_s(mount.proc.pid) - cpu0_s
        return len(files) / wall_s, cpu_s / len(files) * 1000
    finally:
        mount.close()
        os.rmdir(mountpoint)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=4000, help="files of 100 KB per kind (default 4000)")
    parser.add_argument("--rounds", type=int, default=3, help="epochs per kind, alternated (default 3)")
    args = parser.parse_args()
    if args.files < 100 or args.rounds < 1:
        print("checksum_cpu: --files must be >= 100 and --rounds >= 1", file=sys.stderr)
        return 2
    rng = random.Random(20261129)
    files = {f"train/class{i % 50:02d}/img{i:05d}.jpg": rng.randbytes(FILE_BYTES) for i in range(args.files)}
    with rclone_s3_server(tempfile.mkdtemp(prefix="bucketfs-checksum-root-")) as server:
        buckets = {kind: server.new_bucket() for kind in KINDS}
        server.write_files(buckets["md5"], files)
        for kind in KINDS[1:]:
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda item, k=kind: server.put_with_crc(buckets[k], *item, k), files.items()))
        results: dict = {kind: [] for kind in KINDS}
        for round_index in range(args.rounds):
            for kind in KINDS:
                rate, cpu_ms = epoch(server, buckets[kind], files, round_index)
                results[kind].append((rate, cpu_ms))
                print(f"round {round_index}  {kind:6s}  {rate:6.0f} files/s  {cpu_ms:.3f} ms of bucketfs CPU per file")
        base_rate = sum(r for r, _ in results["md5"]) / args.rounds
        base_cpu = sum(c for _, c in results["md5"]) / args.rounds
        print(f"\nmeans of {args.rounds} rounds, {args.files} files of {FILE_BYTES} bytes, {READER_THREADS} threads:")
        for kind in KINDS:
            rate = sum(r for r, _ in results[kind]) / args.rounds
            cpu = sum(c for _, c in results[kind]) / args.rounds
            print(
                f"  {kind:6s}  {rate:6.0f} files/s ({rate / base_rate:.2f}x md5)  "
                f"{cpu:.3f} ms CPU per file ({cpu / base_cpu:.2f}x md5)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
