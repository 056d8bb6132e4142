#!/usr/bin/env python3
"""Benchmark a cache tier on an existing distributed store (issue 38): four bucketfs
mounts ("nodes") of a SeaweedFS S3 gateway that caches the origin bucket, against
the same four mounts straight on the origin.

    python scripts/seaweed_tier.py                          # 10,000 files, tier and direct
    python scripts/seaweed_tier.py --files 2000 --variants tier
    python scripts/seaweed_tier.py --variants tier,direct,tier-fetch-ahead,direct-fetch-ahead

Setup: `rclone serve s3` (bucketfs/testing/servers.py) serves the data set, behind the
latency proxy (scripts/latency_proxy.py: +--latency-ms to each first byte, --conn-mbps
per connection), which logs every request it forwards: the origin's GETs are counted
per object from that log. The tier is one `weed server` (bucketfs/testing/seaweed.py)
whose remote storage is the proxy, the bucket `remote.mount`ed; a GET through its S3
gateway copies the object into the tier once. Nodes are four `bucketfs mount`s on
this machine, each with its own page cache, as four machines would have.

The data set: an ImageFolder tree, --classes x (--files / --classes) JPEG-like files of
80-120 KB (10,000 by default, ~1 GB), generated once into --data-dir (reused while its
manifest matches). Each epoch, every node reads its disjoint share as torch's
DistributedSampler(shuffle=True) gives it after set_epoch(epoch): a permutation seeded
with seed + epoch, node r taking every 4th index from r, with --workers threads; every
byte is compared with the manifest's digest. Two epochs (--epochs): a new shuffle and so
a new split in each, the mounts kept (a node's page cache holds what it read).

Variants (each on fresh mounts and, for the tier, a fresh weed server):
- tier: the four mounts on the tier's gateway, --fetch-ahead off (a node reads its share);
- direct: the four mounts on the origin (the proxy), --fetch-ahead off;
- tier-fetch-ahead, direct-fetch-ahead: the same with fetch-ahead on (the default): each
  node's shuffled reads start a pass that fetches the whole tree ahead.

Printed per variant: origin GETs per object over all epochs and per epoch, the most any
object took, GETs the nodes sent (to the tier, or to the origin), seconds per epoch and
files/s, bytes verified; the issue's target is <= 1.05 origin GETs per object through
the tier. --json PATH writes the figures.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import datetime
import hashlib
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from latency_proxy import ProxyProcess  # noqa: E402

from bucketfs.testing.mounting import Mount, server_env  # noqa: E402
from bucketfs.testing.seaweed import seaweed_server  # noqa: E402
from bucketfs.testing.servers import boto3_client, rclone_s3_server  # noqa: E402

BUCKET = "tier-bench"
SEED = 38
VARIANTS = ("tier", "direct", "tier-fetch-ahead", "direct-fetch-ahead")
TARGET_GETS_PER_OBJECT = 1.05
MB = 1_000_000


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# -- the data set --------------------------------------------------------------------


def _jpeg_like(rng: random.Random, size: int, name: str) -> bytes:
    head = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00" + name.encode() + b"\x00"
    return head + rng.randbytes(max(0, size - len(head) - 2)) + b"\xff\xd9"


def dataset(root: Path, files: int, classes: int) -> dict:
    """{key: sha256 hex} of the ImageFolder tree in root/BUCKET (generated if missing
    or not as its manifest says)."""
    bucket_dir, manifest_path = root / BUCKET, root / f"{BUCKET}.manifest.json"
    spec = {"files": files, "classes": classes, "seed": SEED}
    with contextlib.suppress(OSError, ValueError):
        manifest = json.loads(manifest_path.read_text())
        if manifest["spec"] == spec and all((bucket_dir / key).is_file() for key in manifest["digests"]):
            return manifest["digests"]
    log(f"generating {files} files in {classes} classes into {bucket_dir}")
    shutil.rmtree(bucket_dir, ignore_errors=True)
    rng, digests = random.Random(SEED), {}
    per_class = files // classes
    for c in range(classes):
        (bucket_dir / "train" / f"class-{c:03d}").mkdir(parents=True)
        for i in range(per_class + (1 if c < files % classes else 0)):
            key = f"train/class-{c:03d}/img-{c:03d}-{i:05d}.jpg"
            data = _jpeg_like(rng, rng.randint(80_000, 120_000), key)
            (bucket_dir / key).write_bytes(data)
            digests[key] = hashlib.sha256(data).hexdigest()
    manifest_path.write_text(json.dumps({"spec": spec, "digests": digests}))
    return digests


# -- nodes and epochs ----------------------------------------------------------------


def distributed_shares(keys, epoch: int, nodes: int) -> list:
    """DistributedSampler(shuffle=True, seed=SEED) after set_epoch(epoch), over the
    sorted keys (ImageFolder's index order): node r's indices are perm[r::nodes]."""
    order = sorted(keys)
    random.Random(SEED + epoch).shuffle(order)
    return [order[rank::nodes] for rank in range(nodes)]


def read_checked(mount: Mount, key: str, digest: str) -> int:
    with open(mount.path(key), "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != digest:
        raise AssertionError(f"{key}: bytes differ from the origin's")
    return len(data)


def run_epoch(mounts: list, digests: dict, epoch: int, workers: int) -> dict:
    """Every node reads its share at once (workers threads each): seconds, bytes verified."""
    shares = distributed_shares(digests, epoch, len(mounts))
    pools = [concurrent.futures.ThreadPoolExecutor(workers) for _ in mounts]
    t0 = time.perf_counter()
    try:
        futures = [
            pool.submit(read_checked, mount, key, digests[key])
            for pool, mount, share in zip(pools, mounts, shares)
            for key in share
        ]
        verified = sum(f.result() for f in futures)
    finally:
        for pool in pools:
            pool.shutdown(cancel_futures=True)
    return {"seconds": time.perf_counter() - t0, "bytes_verified": verified, "files": len(futures)}


def scan(mount: Mount) -> int:
    """ImageFolder's scan: a walk of the tree (listings only)."""
    return sum(len(files) for _root, _dirs, files in os.walk(mount.path("train")))


# -- counting the origin's GETs from the proxy's request log -------------------------


class RequestLog:
    def __init__(self, path: Path):
        self.path = path
        self.path.write_text("")

    def gets_per_key(self) -> collections.Counter:
        """Object GETs of BUCKET in the log so far, per key."""
        prefix, counts = f"/{BUCKET}/", collections.Counter()
        with open(self.path, errors="replace") as f:
            for line in f:
                parts = line.split(" ")
                if len(parts) >= 4 and parts[2] == "GET" and parts[3].startswith(prefix):
                    counts[parts[3][len(prefix) :].split("?", 1)[0]] += 1
        return counts


# -- one variant ---------------------------------------------------------------------


def prime(origin) -> None:
    """Have rclone's ETags ready, as a real store has (it computes MD5s when it first
    lists a file): one full listing, not through the proxy."""
    origin.rclone_rc("vfs/forget")
    client = boto3_client(origin)
    try:
        for _page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
            pass
    finally:
        client.close()


@contextlib.contextmanager
def endpoint_for(variant: str, origin, proxy_url: str, keep):
    """(endpoint URL, environment, description) the nodes mount, and the tier's setup time."""
    if variant.startswith("direct"):
        yield proxy_url, server_env(origin), {"setup_s": 0.0}
        return
    t0 = time.perf_counter()
    log_path, verbosity = (str(keep / f"weed-{variant}.log"), 1) if keep else (None, 0)
    with seaweed_server(volume_size_mb=1024, log_path=log_path, verbosity=verbosity) as tier:
        tier.configure_remote(proxy_url, origin.access_key, origin.secret_key, origin.region)
        tier.mount_remote(BUCKET)
        yield tier.endpoint_url, server_env(tier), {"setup_s": time.perf_counter() - t0, "weed_pid": tier.pid}


def run_variant(variant: str, args, origin, proxy, request_log: RequestLog, digests: dict, work_dir: Path) -> dict:
    prime(origin)
    before = request_log.gets_per_key()
    fetch_ahead = "auto" if variant.endswith("fetch-ahead") else "off"
    result: dict = {"variant": variant, "fetch_ahead": fetch_ahead, "epochs": []}
    with endpoint_for(variant, origin, proxy.url, args.keep) as (endpoint_url, env, setup):
        result.update(setup)
        mounts: list = []
        try:
            for rank in range(args.nodes):
                mountpoint = work_dir / f"{variant}-node{rank}"
                mountpoint.mkdir()
                mounts.append(
                    Mount(
                        f"s3://{BUCKET}/",
                        str(mountpoint),
                        env,
                        ("--fetch-ahead", fetch_ahead, *args.mount_args.split()),
                        log_path=str(args.keep / f"{variant}-node{rank}.log") if args.keep else None,
                        endpoint_url=endpoint_url,
                    )
                )
            t0 = time.perf_counter()
            listed = [scan(m) for m in mounts]
            result["scan_s"] = time.perf_counter() - t0
            if any(n != len(digests) for n in listed):
                raise AssertionError(f"the nodes list {listed} files, the origin holds {len(digests)}")
            gets = request_log.gets_per_key()
            for epoch in range(args.epochs):
                log(f"{variant}: epoch {epoch + 1}")
                proxy.mark(f"{variant} epoch {epoch + 1}")
                figures = run_epoch(mounts, digests, epoch, args.workers)
                now = request_log.gets_per_key()
                figures["origin_gets"] = sum((now - gets).values())
                gets = now
                result["epochs"].append(figures)
            node_gets = [m.stats().get("backend.requests.get", 0) for m in mounts]
        finally:
            for m in mounts:
                m.close()
    per_key = request_log.gets_per_key() - before
    total = sum(per_key.values())
    result.update(
        objects=len(digests),
        origin_gets=total,
        origin_gets_per_object=total / len(digests),
        most_gets_of_one_object=max(per_key.values(), default=0),
        objects_never_fetched=len(set(digests) - set(per_key)),
        node_gets=sum(node_gets),
        node_gets_per_object=sum(node_gets) / len(digests),
        bytes_verified=sum(e["bytes_verified"] for e in result["epochs"]),
    )
    return result


def report(results: list, args) -> str:
    lines = [
        f"{args.nodes} nodes x {args.workers} threads, {len(results[0]['epochs'])} epochs over "
        f"{results[0]['objects']} files; origin behind +{args.latency_ms:g} ms, {args.conn_mbps:g} MB/s per connection",
        "",
        "| variant | origin GETs / object (epoch 1, 2, ...) | most GETs of one object | node GETs / object "
        "| s per epoch (files/s) | bytes verified |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        per_epoch = ", ".join(f"{e['origin_gets'] / r['objects']:.3f}" for e in r["epochs"])
        times = ", ".join(f"{e['seconds']:.1f} ({e['files'] / e['seconds']:.0f})" for e in r["epochs"])
        lines.append(
            f"| {r['variant']} | {r['origin_gets_per_object']:.3f} ({per_epoch}) | {r['most_gets_of_one_object']} "
            f"| {r['node_gets_per_object']:.2f} | {times} | {r['bytes_verified'] / MB:.0f} MB |"
        )
    for r in results:
        if r["variant"] == "tier":
            met = r["origin_gets_per_object"] <= TARGET_GETS_PER_OBJECT
            lines.append(
                f"\ntarget (issue 38): <= {TARGET_GETS_PER_OBJECT} origin GETs per object through the tier: "
                f"{r['origin_gets_per_object']:.3f} {'met' if met else 'MISSED'}"
                f" (tier set up in {r['setup_s']:.1f} s, scan {r['scan_s']:.1f} s)"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=10_000, help="ImageFolder files (default 10000)")
    parser.add_argument("--classes", type=int, default=50, help="class folders (default 50)")
    parser.add_argument("--nodes", type=int, default=4, help="bucketfs mounts, one per node (default 4)")
    parser.add_argument("--workers", type=int, default=8, help="reader threads per node (default 8)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (default 2)")
    parser.add_argument("--variants", default="tier,direct", help=f"comma-separated, of {','.join(VARIANTS)}")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="origin's added time to first byte (20)")
    parser.add_argument("--conn-mbps", type=float, default=100.0, help="origin's per-connection cap, MB/s (100)")
    parser.add_argument("--mount-args", default="", help="more bucketfs mount options for every node")
    parser.add_argument("--data-dir", type=Path, default=REPO / ".bench-data" / "seaweed-tier")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--keep",
        type=Path,
        help="keep the origin's request log, weed's logs (at -v=1) and the mounts' in this directory",
    )
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")

    root = args.data_dir / "origin"
    root.mkdir(parents=True, exist_ok=True)
    digests = dataset(root, args.files, args.classes)
    results = []
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="seaweed-tier-") as tmp:
        work_dir = Path(tmp)
        request_log = RequestLog((args.keep or work_dir) / "origin-requests.log")
        with (
            rclone_s3_server(root) as origin,
            ProxyProcess(origin.endpoint_url, args.latency_ms, args.conn_mbps, log_path=str(request_log.path)) as proxy,
        ):
            for variant in variants:
                log(f"{variant}: starting")
                results.append(run_variant(variant, args, origin, proxy, request_log, digests, work_dir))
                log(f"{variant}: {results[-1]['origin_gets_per_object']:.3f} origin GETs per object")
    text = report(results, args)
    print(
        f"{datetime.date.today()} {platform.node()} ({os.cpu_count()} cores): "
        f"python scripts/seaweed_tier.py {' '.join(argv if argv is not None else sys.argv[1:])}\n{text}"
    )
    if args.json:
        options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"args": options, "results": results}, indent=1))
    return (
        0
        if all(r["variant"] != "tier" or r["origin_gets_per_object"] <= TARGET_GETS_PER_OBJECT for r in results)
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
