#!/usr/bin/env python3
"""CPU per small GET on each of S3Backend's two paths, against direct boto3, in one run.

Why: an ImageFolder sample is one GET, and on a machine whose cores are busy the
daemon's CPU per GET sets the files/s. This measures it apart from FUSE and the
loaders: `S3Backend.read_range` of ~100 KB objects from trio tasks, N at once, on the
curl engine (backends/curl_engine.py) and on urllib3 worker threads, and boto3's
get_object on a thread pool of the same size, against `rclone serve s3` behind
scripts/latency_proxy.py. CPU is this process's (getrusage): the server and the proxy
are other processes. Every body is compared with the bytes written.

    python scripts/get_cost.py                      # 20 ms first byte, 8 and 32 at once
    python scripts/get_cost.py --latency-ms 0 --objects 2000
"""

from __future__ import annotations

import argparse
import pathlib
import random
import resource
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import botocore.config  # noqa: E402
import trio  # noqa: E402

from bucketfs.backends.s3 import S3Backend  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402 - scripts/ is on the path (this script's directory)
from tests.servers import rclone_s3_server, without_curl  # noqa: E402

BUCKET = "get-cost"


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_backend(server, endpoint: str, objects: dict, infos: list, concurrency: int, curl: bool) -> tuple:
    """(CPU us per GET, wall us per GET) of read_range over `infos`, `concurrency` at once."""
    backend = S3Backend(server.config(BUCKET, endpoint_url=endpoint, max_connections_count=concurrency),
                        session=server.session())
    if not curl:
        without_curl(backend)

    async def main():
        async def worker(items):
            for info in items:
                data = await backend.read_range(info.key, 0, info.size_bytes, info.version, object_bytes=info.size_bytes)
                if bytes(data) != objects[info.key]:
                    raise SystemExit(f"wrong bytes for {info.key}")

        await backend.list_page("")  # (resolves the endpoint, as a mount's first LIST does)
        cpu0, wall0 = cpu_s(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(worker, infos[i::concurrency])
        return cpu_s() - cpu0, time.perf_counter() - wall0

    try:
        cpu, wall = trio.run(main)
    finally:
        trio.run(backend.aclose)
    assert backend.get_paths["curl" if curl else "threads"] == len(infos)
    return cpu / len(infos) * 1e6, wall / len(infos) * 1e6


def run_boto3(server, endpoint: str, objects: dict, infos: list, concurrency: int) -> tuple:
    """The same reads with boto3's get_object on `concurrency` threads (what a training
    script that reads S3 itself does)."""
    client = server.session().client("s3", endpoint_url=endpoint, config=botocore.config.Config(
        region_name=server.region, s3={"addressing_style": "path"}, max_pool_connections=concurrency,
        response_checksum_validation="when_required"))

    def get(info):
        body = client.get_object(Bucket=BUCKET, Key=info.key)["Body"].read()
        if body != objects[info.key]:
            raise SystemExit(f"wrong bytes for {info.key}")

    with ThreadPoolExecutor(concurrency) as pool:
        cpu0, wall0 = cpu_s(), time.perf_counter()
        list(pool.map(get, infos))
        cpu, wall = cpu_s() - cpu0, time.perf_counter() - wall0
    return cpu / len(infos) * 1e6, wall / len(infos) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=1000, help="objects of --object-kb (default 1000)")
    p.add_argument("--object-kb", type=int, default=100)
    p.add_argument("--latency-ms", type=float, default=20, help="added time to first byte (default 20)")
    p.add_argument("--concurrency", default="8,32", help="GETs at once, comma-separated (default 8,32)")
    args = p.parse_args()
    rng = random.Random(1)
    objects = {f"o/{i:05d}.jpg": rng.randbytes(args.object_kb * 1000) for i in range(args.objects)}
    with tempfile.TemporaryDirectory(prefix="get-cost-") as root, rclone_s3_server(root) as server:
        server.write_files(BUCKET, objects)
        proxy = ProxyProcess(server.endpoint_url, args.latency_ms, 0)
        try:
            probe = S3Backend(server.config(BUCKET), session=server.session())
            infos = trio.run(lambda: probe.list_page("o/")).objects
            trio.run(probe.aclose)
            print(f"{len(infos)} objects of {args.object_kb} KB, +{args.latency_ms:g} ms first byte; CPU of this process")
            print(f"{'at once':>8} | {'path':<25} | {'CPU us/GET':>10} | {'wall us/GET':>11} | CPU vs boto3")
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                boto3_cpu, boto3_wall = run_boto3(server, proxy.url, objects, infos, concurrency)
                rows = [("boto3 get_object, threads", boto3_cpu, boto3_wall)]
                for label, curl in (("bucketfs, curl engine", True), ("bucketfs, urllib3 threads", False)):
                    rows.append((label, *run_backend(server, proxy.url, objects, infos, concurrency, curl)))
                for label, cpu, wall in rows:
                    print(f"{concurrency:>8} | {label:<25} | {cpu:>10.0f} | {wall:>11.0f} | {cpu / boto3_cpu:.2f}x")
        finally:
            proxy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
