#!/usr/bin/env python3
"""Daemon memory under churn with --metadata-ttl: does it follow the bucket?

A prefix that changes while mounted (`--metadata-ttl`) sees objects come and go.
This starts the local S3 server (`rclone serve s3`), mounts a bucket with a short
TTL, and for each round replaces every object in one folder with new names, then
lists and `stat`s the folder through the mount (as a loader's rescan would). After
each round it prints the daemon's live namespace entries, the nodes dropped so far,
and its RSS; at the end, the same after the kernel drops its dentry cache
(needs root). Entries that track the folder's size mean bounded memory; entries
that grow by the folder's size each round mean every object ever seen is kept.

    python scripts/churn.py                       # 5,000 objects, 6 rounds
    python scripts/churn.py --objects 20000 --rounds 10

With `--stress SECONDS` it checks bytes instead: a writer rewrites (with sizes that
differ between versions) and deletes 80 small objects through S3 while 6 readers open
and read them through a TTL-0 mount; every read must be one whole version of its
object, or fail with ESTALE or ENOENT. It prints the outcomes and exits 1 on a wrong
read.

Not part of CI (tests/integration/test_mount_s3.py checks the behaviour).
"""

from __future__ import annotations

import argparse
import errno
import os
import pathlib
import random
import sys
import tempfile
import threading
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.procs import proc_status_kib  # noqa: E402 - scripts/ is on the path (this script's directory)

from bucketfs.testing.mounting import daemon_stats  # noqa: E402


def report(label: str, mount, elapsed_s: float | None = None) -> None:
    stats = daemon_stats(mount.mountpoint)
    took = f" in {elapsed_s:.2f} s" if elapsed_s is not None else ""
    print(
        f"{label}{took}: live entries {stats['namespace.entries']:,}, dropped {stats.get('namespace.nodes_dropped', 0):,}, "
        f"daemon RSS {proc_status_kib(mount.proc.pid, 'VmRSS') * 1024 / 1e6:.0f} MB",
        flush=True,
    )


def versioned(name: str, generation: int) -> bytes:
    """Version `generation` of object `name`: its length differs between versions
    with different digit counts, so a version cut at another's size shows."""
    return f"{name}:{generation}:".encode() * 50


def stress(server, bucket: str, mount, seconds: float) -> int:
    client = server.client
    names = [f"d{i % 4}/f{i:03d}" for i in range(80)]
    for name in names:
        client.put_object(Bucket=bucket, Key=name, Body=versioned(name, 0))
    stop_s = time.monotonic() + seconds
    outcomes: dict = {"whole version": 0}
    wrong: list = []
    lock = threading.Lock()

    def writer():
        rand = random.Random(1)
        while time.monotonic() < stop_s:
            name = rand.choice(names)
            if rand.random() < 0.3:
                client.delete_object(Bucket=bucket, Key=name)
            else:
                client.put_object(Bucket=bucket, Key=name, Body=versioned(name, rand.randrange(1000)))

    def reader(seed: int):
        rand = random.Random(seed)
        while time.monotonic() < stop_s:
            name = rand.choice(names)
            try:
                if rand.random() < 0.2:
                    os.listdir(mount.path(name.split("/")[0]))
                    continue
                with open(mount.path(name), "rb") as f:
                    data = f.read()
                fields = data.split(b":")
                ok = len(fields) > 2 and fields[1].isdigit() and data == versioned(name, int(fields[1]))
                with lock:
                    outcomes["whole version"] += ok
                    if not ok:
                        wrong.append((name, len(data), data[:24]))
            except OSError as exc:
                with lock:
                    key = errno.errorcode.get(exc.errno, str(exc.errno))
                    outcomes[key] = outcomes.get(key, 0) + 1

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"{seconds:.0f} s of churn: reads {outcomes}; wrong {len(wrong)} {wrong[:5]}")
    return 1 if wrong else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=5000, help="objects in the folder, replaced each round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--ttl", type=float, default=0.5, help="--metadata-ttl of the mount, seconds")
    parser.add_argument("--stress", type=float, metavar="SECONDS", help="check bytes under churn instead (TTL 0)")
    args = parser.parse_args()

    from bucketfs.testing.mounting import bucketfs_mount
    from bucketfs.testing.servers import rclone_s3_server

    with tempfile.TemporaryDirectory(prefix="bucketfs-churn-") as work:
        work_dir = pathlib.Path(work)
        with rclone_s3_server(work_dir / "s3") as server:
            bucket = server.new_bucket()
            folder = server.root_dir / bucket / "live"
            folder.mkdir(parents=True)
            env = dict(os.environ, **server.env())
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
            mountpoint = work_dir / "mnt"
            mountpoint.mkdir()
            ttl_s = 0.0 if args.stress else args.ttl
            with bucketfs_mount(
                f"s3://{bucket}/",
                str(mountpoint),
                str(work_dir / "bucketfs.log"),
                endpoint_url=server.endpoint_url,
                env=env,
                extra_args=["--metadata-ttl", str(ttl_s)],
            ) as mount:
                if args.stress:
                    return stress(server, bucket, mount, args.stress)
                previous: list = []
                for round_ in range(args.rounds):
                    names = [f"r{round_}-{i:06d}" for i in range(args.objects)]
                    for name in names:
                        (folder / name).write_bytes(b"x")  # on disk: seeding over S3 would dominate the run
                    for name in previous:
                        (folder / name).unlink()
                    server.rclone_rc("vfs/forget")
                    time.sleep(args.ttl * 1.2)  # let the mount's listing expire
                    started_s = time.perf_counter()
                    listed = os.listdir(mount.path("live"))
                    if sorted(listed) != names:
                        print(f"round {round_}: listing wrong ({len(listed)} names)", file=sys.stderr)
                        return 1
                    for name in names:
                        os.stat(mount.path("live", name))
                    report(f"round {round_}", mount, time.perf_counter() - started_s)
                    previous = names
                try:
                    with open("/proc/sys/vm/drop_caches", "w") as f:
                        f.write("2")  # dentries and inodes: the kernel FORGETs what it held
                    time.sleep(1.0)  # FORGETs arrive asynchronously
                    report("after the kernel dropped its dentries", mount)
                except PermissionError:
                    print("(not root: the kernel's dentry cache was not dropped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
