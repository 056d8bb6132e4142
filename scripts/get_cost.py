#!/usr/bin/env python3
"""CPU per small GET on each of a backend's two paths, against the SDK's own GET, in one run.

Why: an ImageFolder sample is one GET, and on a machine whose cores are busy the
daemon's CPU per GET sets the files/s. This measures it apart from FUSE and the
loaders: `S3Backend.read_range` of ~100 KB objects from trio tasks, N at once, on the
curl engine (backends/http/curl.py) and on urllib3 worker threads, and boto3's
get_object on a thread pool of the same size, against `rclone serve s3` behind
scripts/latency_proxy.py. CPU is this process's (getrusage): the server and the proxy
are other processes. Every body is compared with the bytes written.

`--store gcs` does the same for GCSBackend against the GCS emulator, with
google-cloud-storage's `download_as_bytes` as the direct read. The emulator sends no
generation header; a GCS-like front in a child process (bucketfs/testing/http_front.py,
GCSLikeAdapter) adds it, as GCS does, so a read costs one GET and no metadata GET.
The emulator serves one request at a time: its wall times are not GCS's.

    python scripts/get_cost.py                      # 20 ms first byte, 8 and 32 at once
    python scripts/get_cost.py --latency-ms 0 --objects 2000
    python scripts/get_cost.py --store gcs --objects 500
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import random
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import botocore.config  # noqa: E402
import trio  # noqa: E402
from latency_proxy import ProxyProcess  # noqa: E402 - scripts/ is on the path (this script's directory)

from bucketfs.backends.gcs import GCSBackend  # noqa: E402
from bucketfs.backends.s3 import S3Backend  # noqa: E402
from bucketfs.testing.gcs_server import GCSServer, start_gcs_emulator  # noqa: E402
from bucketfs.testing.servers import rclone_s3_server, without_curl  # noqa: E402

BUCKET = "get-cost"


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_backend(server, endpoint: str, objects: dict, infos: list, concurrency: int, curl: bool) -> tuple:
    """(CPU us per GET, wall us per GET) of read_range over `infos`, `concurrency` at once."""
    config = server.config(BUCKET, endpoint_url=endpoint, max_connections_count=concurrency)
    backend = GCSBackend(config) if isinstance(server, GCSServer) else S3Backend(config, session=server.session())
    if not curl:
        without_curl(backend)

    async def main():
        async def worker(items):
            for info in items:
                data = await backend.read_range(
                    info.key, 0, info.size_bytes, info.version, object_bytes=info.size_bytes
                )
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
    client = server.session().client(
        "s3",
        endpoint_url=endpoint,
        config=botocore.config.Config(
            region_name=server.region,
            s3={"addressing_style": "path"},
            max_pool_connections=concurrency,
            response_checksum_validation="when_required",
        ),
    )

    return run_on_threads(
        lambda info: client.get_object(Bucket=BUCKET, Key=info.key)["Body"].read(), objects, infos, concurrency
    )


def run_on_threads(get, objects: dict, infos: list, concurrency: int) -> tuple:
    """(CPU us per GET, wall us per GET) of `get(info) -> bytes` over `infos` on a pool
    of `concurrency` threads, every body checked."""

    def checked(info):
        if get(info) != objects[info.key]:
            raise SystemExit(f"wrong bytes for {info.key}")

    with ThreadPoolExecutor(concurrency) as pool:
        cpu0, wall0 = cpu_s(), time.perf_counter()
        list(pool.map(checked, infos))
        cpu, wall = cpu_s() - cpu0, time.perf_counter() - wall0
    return cpu / len(infos) * 1e6, wall / len(infos) * 1e6


def run_gcs_library(server, endpoint: str, objects: dict, infos: list, concurrency: int) -> tuple:
    """The same reads with google-cloud-storage's download_as_bytes on `concurrency` threads."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    bucket = storage.Client(
        project="p", credentials=AnonymousCredentials(), client_options={"api_endpoint": endpoint}
    ).bucket(BUCKET)

    return run_on_threads(
        lambda info: bucket.blob(info.key, generation=int(info.version)).download_as_bytes(raw_download=True),
        objects,
        infos,
        concurrency,
    )


@contextlib.contextmanager
def gcs_like_front(upstream_url: str):
    """bucketfs/testing/http_front.py serving GCSLikeAdapter before the emulator, in a child process
    (its CPU is not this process's). Yields its URL."""
    code = (
        "import sys; from bucketfs.testing.http_front import adapter_front; from bucketfs.testing.gcs_server import GCSLikeAdapter\n"
        f"with adapter_front(GCSLikeAdapter(paging=False), {upstream_url!r}) as url:\n"
        "    print(url, flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        yield proc.stdout.readline().strip()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


@contextlib.contextmanager
def store(kind: str, objects: dict):
    """(server, endpoint of the server itself, SDK reader) with `objects` in BUCKET."""
    if kind == "s3":
        with tempfile.TemporaryDirectory(prefix="get-cost-") as root, rclone_s3_server(root) as server:
            server.write_files(BUCKET, objects)
            yield server, server.endpoint_url, ("boto3 get_object, threads", run_boto3)
        return
    with start_gcs_emulator() as emulator:
        server = GCSServer(emulator)
        emulator.client.create_bucket(BUCKET)
        server.put_many(BUCKET, objects)
        with gcs_like_front(emulator.endpoint_url) as front_url:
            yield server, front_url, ("google-cloud-storage", run_gcs_library)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=1000, help="objects of --object-kb (default 1000)")
    p.add_argument("--object-kb", type=int, default=100)
    p.add_argument("--latency-ms", type=float, default=20, help="added time to first byte (default 20)")
    p.add_argument("--concurrency", default="8,32", help="GETs at once, comma-separated (default 8,32)")
    p.add_argument(
        "--store",
        choices=("s3", "gcs"),
        default="s3",
        help="s3: rclone serve s3 (default); gcs: the GCS emulator behind a GCS-like front",
    )
    args = p.parse_args()
    rng = random.Random(1)
    objects = {f"o/{i:05d}.jpg": rng.randbytes(args.object_kb * 1000) for i in range(args.objects)}
    with store(args.store, objects) as (server, endpoint, (sdk_label, run_sdk)):
        proxy = ProxyProcess(endpoint, args.latency_ms, 0)
        try:
            probe = (
                GCSBackend(server.config(BUCKET, endpoint_url=endpoint))
                if args.store == "gcs"
                else S3Backend(server.config(BUCKET), session=server.session())
            )
            infos = trio.run(lambda: probe.list_page("o/")).objects
            trio.run(probe.aclose)
            threads_label = "bucketfs, library threads" if args.store == "gcs" else "bucketfs, urllib3 threads"
            print(
                f"{len(infos)} objects of {args.object_kb} KB, +{args.latency_ms:g} ms first byte; CPU of this process"
            )
            print(f"{'at once':>8} | {'path':<26} | {'CPU us/GET':>10} | {'wall us/GET':>11} | CPU vs the SDK")
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                sdk_cpu, sdk_wall = run_sdk(server, proxy.url, objects, infos, concurrency)
                rows = [(sdk_label, sdk_cpu, sdk_wall)]
                for label, curl in (("bucketfs, curl engine", True), (threads_label, False)):
                    rows.append((label, *run_backend(server, proxy.url, objects, infos, concurrency, curl)))
                for label, cpu, wall in rows:
                    print(f"{concurrency:>8} | {label:<26} | {cpu:>10.0f} | {wall:>11.0f} | {cpu / sdk_cpu:.2f}x")
        finally:
            proxy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
