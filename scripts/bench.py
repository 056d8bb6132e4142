#!/usr/bin/env python3
"""Benchmark bucketfs against direct boto3 reads and local-disk reads, in one run.

    python scripts/bench.py                      # everything, full scale (~10 min)
    python scripts/bench.py --scale 0.25 --only W1,W3
    python scripts/bench.py --backend gcs        # GCS emulator vs google-cloud-storage, scale 0.15 (~3 min)

Setup: `rclone serve s3` (bucketfs/testing/servers.py) serves the data directory; a proxy
(scripts/latency_proxy.py, its own process) in front of it delays the first byte of
every response (--latency-ms, default 20) and caps each connection (--conn-mbps,
default 100 MB/s), so 127.0.0.1 behaves like a remote bucket. bucketfs and the
direct boto3 reads both go through the proxy, which counts the requests and bytes of
each run. Local-disk reads use the same files straight from the data directory.

The data set is generated once into --data-dir (default .bench-data/, reused):
8 WebDataset shards (~64 MB of ~100 KB samples), an ImageFolder tree (50 classes x
200 files of ~100 KB), a directory of 20,000 ~1 KB objects and 20,000 objects in
200 folders. --scale shrinks it.

Workloads (MB = 10^6 bytes): W1 shard streaming (1 and 4 readers; webdataset +
DataLoader), W2 ImageFolder (listing, cold epochs with 8 and 32 threads, warm epoch, an
epoch after the page cache is dropped, and with --mount-args "--cache-dir DIR" an epoch
on a new mount that finds the disk cache the last one left),
W3 metadata (listdir of 20k, walk+stat of 20k; cold and cached; ls -l of 20k, cached), W4 random preads in
shards, W5 small files and shards at once (with the daemon's peak RSS).

Cold runs: page cache dropped (`echo 3 > /proc/sys/vm/drop_caches`, root) and, for
bucketfs, a fresh mount (with --cache-dir DIR in --mount-args: bucketfs's cache
directories in DIR are deleted first, so cold is cold). Before remote runs the server's metadata is primed by
listing directly (not through the proxy): rclone computes MD5 ETags by reading whole
files the first time it lists or serves them, which a real store does not do.
Every byte read is verified against the data set (xxh3 or crc32 digests): a wrong
answer, a reader error or a hang (a run over 300 s) prints FAIL and the script exits 1.
Targets missed are reported, not failures.

Per run it reports the requests (LIST/GET/HEAD) and response bytes the proxy saw, the
CPU seconds of the daemon, of this script, of the proxy and of the server, and those
of processes that are not part of the benchmark (the machine may be shared: numbers
taken while others' CPU or the host's steal time is high are noise). Diagnostics: --py-spy DIR profiles the
daemon in each bucketfs run (collapsed stacks, GIL holders only); --proxy-log FILE
records every request with its byte range, with a `# start RUN` line per run.
Needs root for drop_caches and FUSE; optional: pip install xxhash webdataset torch py-spy.

--alternatives (S3 only) adds existing FUSE mounts as further systems, each through the
same proxy: "rclone mount" (`rclone mount :s3:BUCKET`, --vfs-cache-mode off,
--dir-cache-time/--attr-timeout 1h, --use-server-modtime so that a stat is no HEAD) and,
where installed (`apt-get install s3fs`), "s3fs" (s3fs-fuse: stat cache of an hour with
misses cached, 16 parallel ranged GETs, no disk cache). Each runs the file-system reader
code of every workload, cold runs on a fresh mount with the page cache dropped, as for
bucketfs; their columns and bucketfs/alternative ratios are added to the table. Off by
default.

--backend gcs runs the same workloads against gcp-storage-emulator (bucketfs/testing/gcs_server.py)
behind the same proxy, beside direct google-cloud-storage reads (anonymous client on the
proxy endpoint: ranged `download_as_bytes(raw_download=True)`, delimited `list_blobs`)
and local disk. The emulator keeps objects in memory, so the data set is uploaded into
it at startup (bare media uploads, as bucketfs/testing/gcs_server.py's GCSServer.put_many). It is slow and
serves one request at a time (HTTP/1.0, listen backlog 5), so: the data set defaults
to --scale 0.15 (see GCSBackend.default_scale); both clients are held to 4 requests in
flight (`--max-connections 4` for the mount, a blocking 4-connection pool for the
direct client; see GCS_MAX_CONNECTIONS); targets that are absolute speeds set for S3
are not evaluated. The ratios are what count. The proxy counts an object metadata GET
(what a stat costs; GCS has no HEAD) as HEAD. The emulator ignores `generation=` and
`ifGenerationMatch` and sends no x-goog-generation header, where GCS does all three; a
GCS-like front between the proxy and the emulator (scripts/get_cost.py's
gcs_like_front: bucketfs/testing/gcs_server.py's GCSLikeAdapter in a child process) answers as GCS
would, looking the live generation up itself, so each client's read is one request
through the proxy, as on GCS. (Without it, bucketfs confirmed each read with a metadata
GET of its own: two round trips per file, 0.5x direct on W2 and W5.)
"""

from __future__ import annotations

import argparse
import shlex
import collections
import contextlib
import dataclasses
import importlib
import io
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import urllib.parse
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Optional

REPO = Path(__file__).resolve().parent.parent
for _path in (str(REPO), str(REPO / "scripts")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

MB = 1_000_000  # throughput unit (like the targets and --conn-mbps)
MiB = 1024 * 1024
PART_BYTES = 8 * MiB  # direct boto3: one ranged GET of a large object
PARALLEL_PARTS = 16  # direct boto3: ranged GETs in flight per large-object reader
READ_BYTES = 1 * MiB  # shard readers' read size
CACHED_PASSES = 5  # W3 cached rows: the median of this many passes (each ~0.1 s; see w3)
RUN_TIMEOUT_S = 300.0  # a run taking longer is a hang: the mount is aborted and the run FAILs
MOUNT_DEADLINE_S = 30.0
SYSTEMS = ("bucketfs", "direct", "local")
WDS_WORKERS = 2  # DataLoader worker processes of the webdataset runs
# GCS emulator: requests in flight, for the mount (--max-connections) and the direct client
# alike. The emulator (http.server) serves one request at a time with a listen backlog of 5:
# with more connections than that waiting, the kernel drops SYNs and each dropped connect
# costs a 1 s (then 3 s, 7 s) retransmit, which would measure the backlog, not the client.
# 4 stays under it and still hides the proxy's first-byte latency behind other requests.
GCS_MAX_CONNECTIONS = 4
GCS_SEED_THREADS = 4  # uploads in flight while seeding the emulator (same backlog limit)

try:
    import xxhash

    HASH_NAME = "xxh3_64"

    def new_hash():
        return xxhash.xxh3_64()

    def digest(data) -> int:
        return xxhash.xxh3_64_intdigest(data)
except ImportError:  # crc32 is 5x slower but always there
    HASH_NAME = "crc32"

    class _Crc:
        __slots__ = ("value",)

        def __init__(self):
            self.value = 0

        def update(self, data):
            self.value = zlib.crc32(data, self.value)

        def intdigest(self):
            return self.value

    def new_hash():
        return _Crc()

    def digest(data) -> int:
        return zlib.crc32(data)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# =============================================================================
# Data set
# =============================================================================
@dataclasses.dataclass(frozen=True)
class Spec:
    scale: float
    shard_count: int = 8
    shard_bytes: int = 64 * MB
    sample_bytes: int = 100_000  # mean size of a sample / ImageFolder file (80-120 KB)
    class_count: int = 50
    files_per_class: int = 200
    flat_count: int = 20_000
    tree_dirs: int = 200
    tree_per_dir: int = 100
    small_bytes: int = 1_000  # mean size of a W3 object (500-1500 B)

    @classmethod
    def for_scale(cls, scale: float) -> "Spec":
        return cls(scale=scale, shard_bytes=max(2 * MB, int(64 * MB * scale)),
                   files_per_class=max(2, round(200 * scale)), flat_count=max(100, round(20_000 * scale)),
                   tree_per_dir=max(1, round(100 * scale)))

    @property
    def bucket(self) -> str:
        return "bench-full" if self.scale == 1 else f"bench-s{self.scale:g}"


def _random_bytes_factory(seed: int) -> Callable[[int], bytes]:
    try:
        import numpy

        rng = numpy.random.default_rng(seed)
        return rng.bytes
    except ImportError:
        return os.urandom


def _jpeg_like(rand, size: int, name: str) -> bytes:
    head = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00" + name.encode() + b"\x00"
    return head + rand(max(0, size - len(head) - 2)) + b"\xff\xd9"


def generate(spec: Spec, bucket_dir: Path) -> None:
    """Write the data set into a scratch directory, then rename it into place."""
    scratch = bucket_dir.parent.parent / f"partial-{spec.bucket}"
    shutil.rmtree(scratch, ignore_errors=True)
    rand = _random_bytes_factory(1234)
    sizes = random.Random(42)
    t0 = time.perf_counter()
    (scratch / "shards").mkdir(parents=True)
    sample = 0
    for s in range(spec.shard_count):
        with tarfile.open(scratch / "shards" / f"shard-{s:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            written = 0
            while written < spec.shard_bytes:
                key = f"{sample:06d}"
                jpg = _jpeg_like(rand, sizes.randint(80_000, 120_000), key)
                cls = str(sizes.randrange(1000)).encode()
                for name, data in ((f"{key}.jpg", jpg), (f"{key}.cls", cls)):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
                    tar.addfile(info, io.BytesIO(data))
                written += len(jpg) + len(cls) + 1024
                sample += 1
    for c in range(spec.class_count):
        d = scratch / "imagefolder" / f"class-{c:03d}"
        d.mkdir(parents=True)
        for i in range(spec.files_per_class):
            name = f"img-{c:03d}-{i:05d}.jpg"
            (d / name).write_bytes(_jpeg_like(rand, sizes.randint(80_000, 120_000), name))
    (scratch / "flat").mkdir()
    for i in range(spec.flat_count):
        (scratch / "flat" / f"obj-{i:06d}.bin").write_bytes(rand(sizes.randint(500, 1500)))
    for d in range(spec.tree_dirs):
        sub = scratch / "tree" / f"dir-{d:03d}"
        sub.mkdir(parents=True)
        for i in range(spec.tree_per_dir):
            (sub / f"obj-{i:05d}.bin").write_bytes(rand(sizes.randint(500, 1500)))
    os.sync()
    shutil.rmtree(bucket_dir, ignore_errors=True)
    bucket_dir.parent.mkdir(parents=True, exist_ok=True)
    os.rename(scratch, bucket_dir)
    log(f"generated {spec.bucket} in {time.perf_counter() - t0:.1f}s")


def build_manifest(spec: Spec, bucket_dir: Path) -> dict:
    """Sizes and digests of every file, and of every sample in the shards."""
    files, samples = {}, {}
    for dirpath, _dirs, names in os.walk(bucket_dir):
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, bucket_dir)
            h = new_hash()
            size = 0
            with open(path, "rb", buffering=0) as f:
                while chunk := f.read(8 * MiB):
                    h.update(chunk)
                    size += len(chunk)
            files[rel] = [size, h.intdigest()]
    for rel in sorted(files):
        if rel.startswith("shards/"):
            entries = {}
            with tarfile.open(bucket_dir / rel) as tar:
                for member in tar:
                    key, _, ext = member.name.partition(".")
                    data = tar.extractfile(member).read()
                    entry = entries.setdefault(key, [None, None])
                    if ext == "jpg":
                        entry[0] = digest(data)
                    else:
                        entry[1] = data.decode()
            samples[rel] = entries
    return {"version": 1, "spec": dataclasses.asdict(spec), "hash": HASH_NAME, "files": files, "samples": samples}


def ensure_dataset(spec: Spec, data_dir: Path) -> tuple:
    """(bucket_dir, manifest): generated once, reused while the spec matches."""
    bucket_dir = data_dir / "srv" / spec.bucket
    manifest_path = data_dir / f"{spec.bucket}.manifest.json"
    manifest = None
    if manifest_path.exists() and bucket_dir.is_dir():
        with contextlib.suppress(ValueError, OSError):
            manifest = json.loads(manifest_path.read_text())
        if manifest and manifest.get("spec") != dataclasses.asdict(spec):
            manifest = None
        elif manifest and not _files_present(bucket_dir, manifest):
            log(f"{bucket_dir} does not match its manifest: regenerating")
            manifest = None
        elif manifest and manifest.get("hash") != HASH_NAME:
            log(f"re-hashing {bucket_dir} with {HASH_NAME}")
            manifest = build_manifest(spec, bucket_dir)
            manifest_path.write_text(json.dumps(manifest))
    if manifest is None:
        log(f"generating the data set {spec.bucket} in {bucket_dir} (once; reused afterwards)")
        manifest_path.unlink(missing_ok=True)
        generate(spec, bucket_dir)
        manifest = build_manifest(spec, bucket_dir)
        manifest_path.write_text(json.dumps(manifest))
    else:
        log(f"reusing the data set in {bucket_dir}")
    return bucket_dir, manifest


def _files_present(bucket_dir: Path, manifest: dict) -> bool:
    try:
        return all(os.stat(bucket_dir / rel).st_size == size for rel, (size, _) in manifest["files"].items())
    except OSError:
        return False


class Dataset:
    def __init__(self, spec: Spec, bucket_dir: Path, manifest: dict):
        self.spec, self.bucket_dir, self.manifest = spec, bucket_dir, manifest
        self.bucket = spec.bucket
        self.files = manifest["files"]
        self.shards = sorted(r for r in self.files if r.startswith("shards/"))
        self.images = sorted(r for r in self.files if r.startswith("imagefolder/"))
        self.flat = sorted(r for r in self.files if r.startswith("flat/"))
        self.tree = sorted(r for r in self.files if r.startswith("tree/"))
        self.sample_count = sum(len(v) for v in manifest["samples"].values())

    def size(self, rel: str) -> int:
        return self.files[rel][0]

    def bytes_of(self, rels) -> int:
        return sum(self.files[r][0] for r in rels)


class Verifier:
    """Collects mismatches (thread safe); a run with any is a FAIL."""

    def __init__(self, dataset: Dataset):
        self.files = dataset.files
        self.errors: list = []
        self._lock = threading.Lock()

    def fail(self, what: str) -> None:
        with self._lock:
            self.errors.append(what)

    def check(self, rel: str, size: int, value: int) -> None:
        want_size, want = self.files[rel]
        if size != want_size or value != want:
            self.fail(f"{rel}: got {size} bytes digest {value:x}, expected {want_size} bytes digest {want:x}")


# =============================================================================
# Backends: the one place that knows S3 and GCS
# =============================================================================
class S3Direct:
    """Direct boto3 access (the baseline): a thread-safe client sized for `pool` threads."""

    def __init__(self, endpoint_url: str, access_key: str, secret_key: str, region: str, pool: int):
        import boto3
        import botocore.config

        session = boto3.session.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key, region_name=region)
        self.client = session.client("s3", endpoint_url=endpoint_url, config=botocore.config.Config(
            s3={"addressing_style": "path"}, max_pool_connections=pool, retries={"total_max_attempts": 3},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",  # rclone sends whole-object CRCs on ranged GETs
        ))

    @classmethod
    def from_env(cls, pool: int) -> "S3Direct":
        return cls(os.environ["AWS_ENDPOINT_URL"], os.environ["AWS_ACCESS_KEY_ID"],
                   os.environ["AWS_SECRET_ACCESS_KEY"], os.environ.get("AWS_DEFAULT_REGION", "us-east-1"), pool)

    def get(self, bucket: str, key: str, start: Optional[int] = None, end: Optional[int] = None) -> bytes:
        kwargs = {"Range": f"bytes={start}-{end - 1}"} if start is not None else {}
        body = self.client.get_object(Bucket=bucket, Key=key, **kwargs)["Body"]
        try:
            return body.read()
        finally:
            body.close()

    def list_all(self, bucket: str, prefix: str) -> tuple:
        """Every page of a delimited listing, one after another: ([(key, size)], [prefix])."""
        objects, prefixes, token = [], [], None
        while True:
            kwargs = {"ContinuationToken": token} if token else {}
            page = self.client.list_objects_v2(Bucket=bucket, Prefix=prefix, Delimiter="/", MaxKeys=1000, **kwargs)
            objects += [(o["Key"], o["Size"]) for o in page.get("Contents", ())]
            prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", ())]
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return objects, prefixes

    def close(self) -> None:
        self.client.close()


class _ProxiedServer:
    """What every backend shares: a server behind the latency proxy (`self.server` and
    `self.proxy` are set by the subclass's serve())."""

    def __init__(self, root_dir: Path, latency_ms: float, conn_mbps: float, proxy_log: Optional[Path] = None):
        self.root_dir, self.latency_ms, self.conn_mbps, self.proxy_log = root_dir, latency_ms, conn_mbps, proxy_log
        self.server = self.proxy = None

    @property
    def endpoint_url(self) -> str:
        return self.proxy.url

    def stats(self) -> dict:
        return self.proxy.stats()

    def mark(self, text: str) -> None:
        if self.proxy_log:
            self.proxy.mark(text)

    def server_cpu_s(self) -> float:
        return proc_cpu_s(self.server.pid)

    def proxy_cpu_s(self) -> float:
        return proc_cpu_s(self.proxy.pid)


class S3Backend(_ProxiedServer):
    """rclone serve s3 over the data directory, behind the latency proxy."""

    name = "s3"
    url_scheme = "s3"
    direct_label = "direct boto3"  # the direct column of the table
    wds_scheme = "benchs3"  # webdataset URL scheme of the direct runs (see _wds_open_direct)
    default_scale = 1.0
    mount_extra_args: tuple = ()  # mount options this backend needs (before --mount-args)
    absolute_targets = True  # targets in MB/s, ops/s and seconds apply to this server
    title = ""  # added to the result's title line
    targets_note = ""  # printed after the targets
    expected_log_lines: tuple = ()  # daemon warnings this server always causes: not reported

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._primed: dict = {}  # directory -> when its server-side metadata was last rebuilt

    @contextlib.contextmanager
    def serve(self) -> Iterator["S3Backend"]:
        from latency_proxy import ProxyProcess
        from bucketfs.testing.servers import rclone_s3_server

        with rclone_s3_server(self.root_dir) as server:
            with ProxyProcess(server.endpoint_url, self.latency_ms, self.conn_mbps,
                              log_path=str(self.proxy_log) if self.proxy_log else None) as proxy:
                self.server, self.proxy = server, proxy
                self._unproxied = S3Direct(server.endpoint_url, server.access_key, server.secret_key, server.region, 8)
                try:
                    yield self
                finally:
                    self._unproxied.close()
                    self.server = self.proxy = None

    @property
    def description(self) -> str:
        return f"rclone serve s3 (pid {self.server.pid})"

    def seed(self, dataset: "Dataset") -> None:
        """Nothing to do: rclone serves the data directory itself."""

    def wds_direct_spec(self) -> dict:
        """What a webdataset child needs to build its direct client (S3: AWS_* in env())."""
        return {}

    def env(self) -> dict:
        """AWS_* variables for a mount or a child process: the proxy as the endpoint."""
        env = self.server.env()
        env["AWS_ENDPOINT_URL"] = self.proxy.url
        return env

    def mount_argv(self, bucket: str) -> list:
        return [f"{self.url_scheme}://{bucket}/", "--endpoint-url", self.proxy.url]

    def direct(self, pool: int) -> S3Direct:
        return S3Direct(self.proxy.url, self.server.access_key, self.server.secret_key, self.server.region, pool)

    def prime(self, bucket: str, prefixes) -> None:
        """Have the server's ETags ready, as a real store has: rclone computes them (MD5 of
        whole files) when it first lists or serves a file and keeps them ~5 minutes with its
        directory cache. Rebuild a directory's if older than 200 s; not through the proxy."""
        now = time.monotonic()
        for prefix in prefixes:
            if now - self._primed.get(prefix, -math.inf) < 200:
                continue
            self.server.rclone_rc("vfs/forget", dir=f"{bucket}/{prefix.rstrip('/')}")
            _objects, subdirs = self._unproxied.list_all(bucket, prefix)
            for sub in subdirs:
                self._unproxied.list_all(bucket, sub)
            self._primed[prefix] = time.monotonic()



class GCSDirect:
    """Direct google-cloud-storage access (the baseline on GCS): one anonymous Client on
    the proxy endpoint, shared by `pool` threads, with at most `max_connections` requests
    in flight (a blocking connection pool: see GCS_MAX_CONNECTIONS)."""

    def __init__(self, endpoint_url: str, pool: int, max_connections: int = GCS_MAX_CONNECTIONS):
        import requests.adapters
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        self.client = storage.Client(project="bench", credentials=AnonymousCredentials(),
                                     client_options={"api_endpoint": endpoint_url})
        self.client._bucket_metadata_cache = None  # no background bucket GETs (as bucketfs)
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=max(1, min(pool, max_connections)),
                                                pool_block=True)
        self.client._http.mount("http://", adapter)
        self.client._http.mount("https://", adapter)

    def get(self, bucket: str, key: str, start: Optional[int] = None, end: Optional[int] = None) -> bytes:
        blob = self.client.bucket(bucket).blob(key)
        if start is None:
            return blob.download_as_bytes(raw_download=True, checksum=None)
        # GCS ranges are inclusive; no checksum, like boto3's when_required
        return blob.download_as_bytes(start=start, end=end - 1, raw_download=True, checksum=None)

    def list_all(self, bucket: str, prefix: str) -> tuple:
        """Every page of a delimited listing, one after another: ([(key, size)], [prefix])."""
        objects, prefixes = [], []
        for page in self.client.list_blobs(bucket, prefix=prefix or None, delimiter="/").pages:
            objects += [(blob.name, blob.size) for blob in page]
            prefixes += page.prefixes
        return objects, sorted(prefixes)

    def close(self) -> None:
        self.client.close()


def _gcs_request_kind(method: str, target: str) -> str:
    """The proxy's request kinds for the GCS JSON API (latency_proxy knows S3's paths):
    a media download is a GET, a listing of /b/BUCKET/o a LIST, and an object's
    metadata GET (/b/BUCKET/o/NAME: what a stat costs; GCS has no HEAD) a HEAD."""
    if method != "GET":
        return method
    split = urllib.parse.urlsplit(target)
    segments = [s for s in split.path.split("/") if s]
    if segments[:1] == ["download"] or "alt=media" in split.query.split("&"):
        return "GET"
    if segments[:3] == ["storage", "v1", "b"] and len(segments) >= 5 and segments[4] == "o":
        return "LIST" if len(segments) == 5 else "HEAD"  # names are one %2F-escaped segment
    if segments[:3] == ["storage", "v1", "b"] and len(segments) == 4:
        return "GET_BUCKET"
    return "GET_OTHER"


def gcs_proxy_child(proxy_argv: list) -> int:
    """scripts/latency_proxy.py's main, counting GCS request kinds (GCSProxyProcess runs it)."""
    import latency_proxy

    latency_proxy._kind = _gcs_request_kind
    return latency_proxy.main(proxy_argv)


def _gcs_proxy_process(upstream_url: str, latency_ms: float, conn_mbps: float, log_path: Optional[str] = None):
    """A latency_proxy.ProxyProcess whose child is gcs_proxy_child (this script)."""
    import latency_proxy

    class GCSProxyProcess(latency_proxy.ProxyProcess):
        def __init__(self, start_deadline_s: float = 10.0):  # ProxyProcess.__init__, another argv
            proxy_argv = ["--upstream", upstream_url, "--latency-ms", str(latency_ms), "--conn-mbps", str(conn_mbps)]
            if log_path:
                proxy_argv += ["--log", log_path]
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--gcs-proxy-child", json.dumps(proxy_argv)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         preexec_fn=latency_proxy._die_with_parent)
            self.pid = self.proc.pid
            self._lock = threading.Lock()
            line = latency_proxy._readline_with_deadline(self.proc, start_deadline_s)
            if not line.startswith("LISTENING "):
                self.close()
                raise RuntimeError(f"latency proxy did not start: {line!r}")
            self.url = line.split(" ", 1)[1].strip()

    return GCSProxyProcess()


class GCSBackend(_ProxiedServer):
    """gcp-storage-emulator (in memory, seeded from the data directory) behind the latency proxy."""

    name = "gcs"
    url_scheme = "gs"
    direct_label = "direct google-cloud-storage"
    wds_scheme = "benchgs"
    # The emulator is slow and serves one request at a time: 15% of the data set (~240 MB,
    # ~7,500 objects) keeps a run to a few minutes. Not less: shards must stay larger than
    # the mount's --small-file-bytes (8 MiB; 0.15 gives 9.6 MB), or W1 and W4 would measure
    # whole-file fetches at open instead of shard read-ahead and the block cache.
    default_scale = 0.15
    mount_extra_args = ("--max-connections", str(GCS_MAX_CONNECTIONS))  # see GCS_MAX_CONNECTIONS
    absolute_targets = False  # set for S3 at full scale: the emulator reaches none of them
    title = f", GCS emulator, {GCS_MAX_CONNECTIONS} connections per client"
    targets_note = (f"  (gcs: W1 1/4 readers, W2 listing and W4 ops/s are not evaluated: absolute speeds set for S3, which the\n"
                    f"   emulator reaches for no client. Compare bucketfs with direct google-cloud-storage, both held to\n"
                    f"   {GCS_MAX_CONNECTIONS} requests in flight, through a front that serves generations as GCS does.)")

    @contextlib.contextmanager
    def serve(self) -> Iterator["GCSBackend"]:
        from get_cost import gcs_like_front
        from bucketfs.testing.gcs_server import start_gcs_emulator

        with start_gcs_emulator() as server, gcs_like_front(server.endpoint_url) as front_url:
            with _gcs_proxy_process(front_url, self.latency_ms, self.conn_mbps,
                                    str(self.proxy_log) if self.proxy_log else None) as proxy:
                self.server, self.proxy = server, proxy
                try:
                    yield self
                finally:
                    self.server = self.proxy = None

    @property
    def description(self) -> str:
        return f"gcp-storage-emulator (pid {self.server.pid})"

    def seed(self, dataset: "Dataset") -> None:
        """Upload the data set into the emulator (not through the proxy): one bare media
        upload per object over http.client (as bucketfs/testing/gcs_server.py's GCSServer.put_many), a few in
        flight; then check the listing has every object at its size."""
        import http.client

        bucket = dataset.bucket
        t0 = time.perf_counter()
        self.server.client.create_bucket(bucket)
        netloc = urllib.parse.urlsplit(self.server.endpoint_url).netloc

        def upload(rel: str) -> None:
            data = (dataset.bucket_dir / rel).read_bytes()
            if not data:  # the emulator drops a media upload with no body; the library sends it multipart
                self.server.put(bucket, rel, data)
                return
            connection = http.client.HTTPConnection(netloc, timeout=60.0)
            try:
                connection.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={urllib.parse.quote(rel, safe='')}",
                                   body=data, headers={"Content-Type": "application/octet-stream"})
                response = connection.getresponse()
                response.read()
            finally:
                connection.close()  # HTTP/1.0: one request per connection
            if response.status != 200:
                raise RuntimeError(f"seeding {rel!r} into the GCS emulator: HTTP {response.status}")

        with ThreadPoolExecutor(GCS_SEED_THREADS) as executor:
            list(executor.map(upload, sorted(dataset.files)))
        listed = {blob.name: blob.size for blob in self.server.client.list_blobs(bucket)}
        expected = {rel: size for rel, (size, _digest) in dataset.files.items()}
        if listed != expected:
            raise RuntimeError(f"the GCS emulator lists {len(listed)} objects after seeding, expected {len(expected)} (or sizes differ)")
        log(f"seeded the GCS emulator with {len(expected)} objects ({sum(expected.values()) / MB:.0f} MB) "
            f"in {time.perf_counter() - t0:.1f}s")

    def wds_direct_spec(self) -> dict:
        # Each DataLoader worker has its own client: together they keep to GCS_MAX_CONNECTIONS.
        return {"gcs": {"endpoint_url": self.proxy.url, "max_connections": max(1, GCS_MAX_CONNECTIONS // WDS_WORKERS)}}

    def env(self) -> dict:
        """Nothing: the mount gets --endpoint-url (an http:// endpoint is read anonymously)."""
        return {}

    def mount_argv(self, bucket: str) -> list:
        return [f"{self.url_scheme}://{bucket}/", "--endpoint-url", self.proxy.url]

    def direct(self, pool: int) -> GCSDirect:
        return GCSDirect(self.proxy.url, pool)

    def prime(self, bucket: str, prefixes) -> None:
        """Nothing to do: the emulator keeps every object's metadata in memory."""



BACKENDS = {"s3": S3Backend, "gcs": GCSBackend}


# =============================================================================
# Processes, mounts, caches
# =============================================================================
def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def median_run(passes: int, fn: Callable[[], dict]) -> dict:
    """fn()'s result of median "s" over `passes` runs, every pass's seconds beside it."""
    results = sorted((fn() for _ in range(passes)), key=lambda r: r.get("s", 0.0))
    middle = dict(results[len(results) // 2])
    if passes > 1:
        middle["passes_s"] = [r.get("s") for r in results]
    return middle


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuCensus:
    """CPU seconds of every process on the machine, split into this benchmark's (this
    process and its descendants: daemon, proxy, server, webdataset workers) and the
    others' (a shared machine: other people's tests). Exited processes are missed."""

    def __init__(self):
        self.me = os.getpid()
        self.tick = os.sysconf("SC_CLK_TCK")
        self.snapshot = self._take()

    def _take(self) -> dict:
        procs = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            procs[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self.tick)
        return procs

    def others_s(self) -> float:
        """Others' CPU seconds since the last call."""
        now = self._take()
        ours = {self.me}
        changed = True
        while changed:  # descendants of this process, whatever their depth
            changed = False
            for pid, (ppid, _) in now.items():
                if ppid in ours and pid not in ours:
                    ours.add(pid)
                    changed = True
        total = 0.0
        for pid, (_ppid, cpu) in now.items():
            if pid not in ours and pid != 2 and _ppid != 2:  # kthreadd's children are kernel threads
                total += cpu - self.snapshot.get(pid, (0, 0.0))[1]
        self.snapshot = now
        return max(total, 0.0)


def machine_cpu_s() -> tuple[float, float]:
    """Busy and idle CPU seconds of the whole machine since boot (/proc/stat; idle includes iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"), idle / os.sysconf("SC_CLK_TCK")


def steal_s() -> float:
    """CPU seconds the hypervisor gave other guests while this VM wanted them (all CPUs,
    `steal` in /proc/stat): a slow host that no process here accounts for."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def self_cpu_s() -> float:
    """This process's CPU seconds, with its children that were waited for (webdataset runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def proc_status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def is_mounted(path: str) -> bool:
    """From the mount table, without touching the mount (a hung daemon cannot block this)."""
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


class _MountProcess:
    """A FUSE mount served by a foreground subprocess: start, wait for the mount with a
    deadline, stop (unmount, wait, terminate if needed, check nothing is left), keep
    the log of a run that logged problems. Subclasses give the command and details."""

    name = "mount"  # its system's name in the runs (--json)
    title = "mount"  # its column in the table
    unmount_cmds = (["fusermount3", "-u"], ["fusermount3", "-uz"])
    lazy_unmount_cmd = ["fusermount3", "-uz"]
    clean_exit_codes = (0,)

    def __init__(self, backend, bucket: str, mountpoint: str, work_dir: str):
        self.backend, self.bucket, self.mountpoint, self.work_dir = backend, bucket, mountpoint, work_dir
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = None
        self.count = 0
        self.label = ""  # the runs this process served, for its notes
        self.notes: list = []  # warnings/errors it logged

    @property
    def pid(self) -> int:
        return self.proc.pid

    def argv(self) -> list:
        raise NotImplementedError

    def env(self) -> Optional[dict]:
        return None

    @staticmethod
    def missing() -> Optional[str]:
        """Why this mount cannot run here (a note for the report), or None."""
        return None

    def is_problem_line(self, line: str) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        self.count += 1
        self.label = ""
        self.log_path = os.path.join(self.work_dir, f"{self.name}-{self.count}.log")
        argv = self.argv()
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(argv, cwd=self.work_dir, env=self.env(), stdin=subprocess.DEVNULL,
                                         stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + MOUNT_DEADLINE_S
        while not (is_mounted(self.mountpoint) and os.path.ismount(self.mountpoint)):
            if self.proc.poll() is not None:
                tail, self.proc = self._tail(), None
                raise RuntimeError(f"{self.name} exited before mounting: {tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not mount within {MOUNT_DEADLINE_S}s: {self._tail()}")
            time.sleep(0.02)  # polling interval, with a deadline

    def stop(self) -> None:
        """Unmount, wait for the process, and make sure nothing is left."""
        if self.proc is None:
            return
        if is_mounted(self.mountpoint):
            for cmd in self.unmount_cmds:
                if subprocess.run([*cmd, self.mountpoint], capture_output=True).returncode == 0:
                    break
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.notes.append(f"{self.name} {self.count}: still running 15 s after unmount; terminated")
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if is_mounted(self.mountpoint):
            subprocess.run([*self.lazy_unmount_cmd, self.mountpoint], capture_output=True)
        if self.proc.returncode not in self.clean_exit_codes:
            self.notes.append(f"{self.name} {self.count} ({self.label}): exited with {self.proc.returncode} after unmount")
        self._collect_log_notes()
        self.proc = None

    def abort(self) -> None:
        """A hung run: kill our process so blocked readers get errors, then detach."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        subprocess.run([*self.lazy_unmount_cmd, self.mountpoint], capture_output=True)

    def _tail(self, chars: int = 1500) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return "(no log)"

    def _collect_log_notes(self) -> None:
        """Keep the log of a process that logged problems (the work dir is removed)."""
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [ln.rstrip() for ln in f if self.is_problem_line(ln)]
        except OSError:
            return
        if lines:
            kept = os.path.join(tempfile.gettempdir(), f"bucketfs-bench-{os.getpid()}-{self.name}{self.count}.log")
            shutil.copy(self.log_path, kept)
            distinct = list(dict.fromkeys(ln.strip(" |+")[:240] for ln in lines if "Traceback" not in ln))
            self.notes.append(f"{self.name} {self.count} ({self.label}): {len(lines)} warning/error line(s), log kept in {kept}; "
                              + " | ".join(distinct[:3]))


class Mount(_MountProcess):
    """One bucketfs daemon (`mount -f` as a subprocess); remount() gives a fresh one."""

    name = "bucketfs"

    def __init__(self, backend, bucket: str, mountpoint: str, max_memory: str, work_dir: str, extra_args=()):
        super().__init__(backend, bucket, mountpoint, work_dir)
        self.max_memory, self.extra_args = max_memory, list(extra_args)

    def argv(self) -> list:
        return [sys.executable, "-m", "bucketfs.cli", "mount", *self.backend.mount_argv(self.bucket), self.mountpoint,
                "-f", "--max-memory", self.max_memory, *self.extra_args]

    def env(self) -> dict:
        env = dict(os.environ, **self.backend.env())
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def is_problem_line(self, line: str) -> bool:
        return bool((" WARNING " in line or " ERROR " in line or "Traceback" in line
                     or re.search(r"^[\s|+]*\w*(Error|Exception)\b.*:", line))
                    and not any(known in line for known in self.backend.expected_log_lines))

    def remount(self, drop: bool = True) -> None:
        self.stop()
        if drop:
            drop_caches()
        self.start()


class RcloneMount(_MountProcess):
    """--alternatives: `rclone mount :s3:BUCKET` as a foreground subprocess, through the proxy."""

    name = "rclone-mount"
    title = "rclone mount"
    unmount_cmds = (["fusermount", "-u"], ["fusermount3", "-u"], ["fusermount", "-uz"], ["fusermount3", "-uz"])
    lazy_unmount_cmd = ["fusermount", "-uz"]
    clean_exit_codes = (0, -signal.SIGTERM)

    def argv(self) -> list:
        from bucketfs.testing.servers import rclone_binary

        config = os.path.join(self.work_dir, "rclone.conf")  # empty: the remote is all on the command line
        open(config, "a").close()
        server = self.backend.server
        return [rclone_binary(), "mount", f":s3:{self.bucket}", self.mountpoint, "--read-only",
                "--s3-provider", "Other", "--s3-endpoint", self.backend.proxy.url,
                "--s3-access-key-id", server.access_key, "--s3-secret-access-key", server.secret_key,
                "--s3-region", server.region, "--s3-force-path-style",
                "--vfs-cache-mode", "off", "--dir-cache-time", "1h", "--attr-timeout", "1h", "--daemon-wait", "0",
                # Without it rclone HEADs every file it stats or opens (for the mtime in its metadata):
                # W3's 20,000 stats one after another would take ~8 min, past RUN_TIMEOUT_S.
                "--use-server-modtime", "--config", config]

    def is_problem_line(self, line: str) -> bool:
        return "ERROR" in line or "panic" in line


class S3fsMount(_MountProcess):
    """--alternatives: s3fs-fuse (`apt-get install s3fs`) in the foreground, through the
    proxy. Its caches set for data that does not change, as bucketfs's immutable default:
    stats cached for an hour (and misses), no local disk cache (`use_cache` unset: reads
    go to the store, as bucketfs without --cache-dir), 16 parallel ranged GETs."""

    name = title = "s3fs"
    clean_exit_codes = (0, -signal.SIGTERM)

    @staticmethod
    def missing() -> Optional[str]:
        return None if shutil.which("s3fs") else "s3fs not installed (apt-get install s3fs): its column is left out"

    def argv(self) -> list:
        server = self.backend.server
        passwd = os.path.join(self.work_dir, "s3fs.passwd")
        with open(os.open(passwd, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(f"{server.access_key}:{server.secret_key}\n")
        options = [f"url={self.backend.proxy.url}", "use_path_request_style", f"endpoint={server.region}", f"passwd_file={passwd}",
                   "ro", "stat_cache_expire=3600", "enable_noobj_cache", "max_stat_cache_size=200000", "parallel_count=16",
                   "multireq_max=32"]
        return ["s3fs", self.bucket, self.mountpoint, "-f", "-o", ",".join(options)]

    def is_problem_line(self, line: str) -> bool:
        return "[ERR]" in line or "[CRT]" in line


# --alternatives: existing FUSE mounts run as further systems, in this order.
ALTERNATIVE_MOUNTS = (RcloneMount, S3fsMount)


class RssSampler:
    """Samples a process's VmRSS every 50 ms in a thread; peak in bytes."""

    def __init__(self, pid: int, interval_s: float = 0.05):
        self.pid, self.interval_s = pid, interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.peak_bytes = max(self.peak_bytes, proc_status_kib(self.pid, "VmRSS") * 1024)
            self._stop.wait(self.interval_s)


def run_threads(target: Callable, args_list: list, verifier: Verifier) -> float:
    """Run target(*args) in one thread each; return the wall time. Exceptions become FAILs."""
    def wrapped(*args):
        try:
            target(*args)
        except Exception as exc:  # noqa: BLE001 - a reader error is a failed run, reported
            verifier.fail(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=wrapped, args=args, daemon=True) for args in args_list]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def pull_loop(items: list, worker_fn: Callable) -> Callable:
    """A thread body that takes the next item from a shared list until none are left."""
    counter = itertools.count()

    def body():
        n = len(items)
        while True:
            i = next(counter)  # atomic under the GIL
            if i >= n:
                return
            worker_fn(i, items[i])

    return body


# =============================================================================
# Reading primitives (file systems vs direct boto3)
# =============================================================================
def read_file_streaming(path: str, buf: bytearray) -> tuple:
    """Whole file with 1 MiB reads: (size, digest)."""
    h, n, view = new_hash(), 0, memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n, h.intdigest()
            h.update(view[:k])
            n += k


def iter_object_parallel(client: S3Direct, bucket: str, key: str, size: int, executor) -> Iterator[bytes]:
    """A large object as 8 MiB ranged GETs, 16 in flight, yielded in order."""
    starts = iter(range(0, size, PART_BYTES))
    futures = collections.deque()
    for start in itertools.islice(starts, PARALLEL_PARTS):
        futures.append(executor.submit(client.get, bucket, key, start, min(start + PART_BYTES, size)))
    while futures:
        data = futures.popleft().result()
        start = next(starts, None)
        if start is not None:
            futures.append(executor.submit(client.get, bucket, key, start, min(start + PART_BYTES, size)))
        yield data


def read_object_direct(client, bucket, key, size, executor) -> tuple:
    h, n = new_hash(), 0
    for data in iter_object_parallel(client, bucket, key, size, executor):
        h.update(data)
        n += len(data)
    return n, h.intdigest()


class IterReader(io.RawIOBase):
    """A readable raw stream over an iterator of bytes chunks (direct objects for webdataset)."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks, self._current, self._pos = chunks, b"", 0

    def readable(self):
        return True

    def readinto(self, b) -> int:
        while self._pos >= len(self._current):
            self._current = next(self._chunks, None)
            self._pos = 0
            if self._current is None:
                self._current = b""
                return 0
        n = min(len(b), len(self._current) - self._pos)
        b[:n] = self._current[self._pos:self._pos + n]
        self._pos += n
        return n


# =============================================================================
# The benchmark
# =============================================================================
@dataclasses.dataclass
class Row:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    target: str = ""
    values: dict = dataclasses.field(default_factory=dict)
    met: Optional[bool] = None


def _option_value(argv: list, option: str) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def _empty_disk_cache(cache_dir: str) -> None:
    """Delete what bucketfs cached in `cache_dir` (its own directories only: the ones
    with a journal, or a mount's private one)."""
    if not os.path.isdir(cache_dir):
        return
    for entry in os.scandir(cache_dir):
        if entry.is_dir() and (os.path.exists(os.path.join(entry.path, "journal")) or re.match(r"bucketfs-\d+-", entry.name)):
            shutil.rmtree(entry.path, ignore_errors=True)


class Bench:
    def __init__(self, args, dataset: Dataset, backend, work_dir: str):
        self.args, self.ds, self.backend, self.work_dir = args, dataset, backend, work_dir
        self.rows: dict = {}
        self.runs: list = []
        self.failures: list = []
        self.mountpoint = os.path.join(work_dir, "mnt")
        os.makedirs(self.mountpoint)
        self.mount = Mount(backend, dataset.bucket, self.mountpoint, args.max_memory, work_dir,
                           [*backend.mount_extra_args, *shlex.split(args.mount_args)])
        self.cache_dir = _option_value(shlex.split(args.mount_args), "--cache-dir")
        self.local_root = str(dataset.bucket_dir)
        self.alt_mounts: dict = {}  # system -> its _MountProcess
        self.alt_notes: list = []
        for cls in ALTERNATIVE_MOUNTS if args.alternatives else ():
            missing = cls.missing()
            if missing:
                self.alt_notes.append(missing)
                continue
            alt_mountpoint = os.path.join(work_dir, f"{cls.name}-mnt")
            os.makedirs(alt_mountpoint)
            self.alt_mounts[cls.name] = cls(backend, dataset.bucket, alt_mountpoint, work_dir)
        self.systems = SYSTEMS + tuple(self.alt_mounts)
        self.dropped_ok = True
        self.census = CpuCensus()

    # -- bookkeeping ------------------------------------------------------------
    def row(self, key, label, unit, higher_is_better, target="") -> Row:
        if key not in self.rows:
            self.rows[key] = Row(key, label, unit, higher_is_better, target)
        return self.rows[key]

    def record(self, key: str, system: str, value) -> None:
        self.rows[key].values[system] = value

    def cold(self, system: str) -> None:
        """Drop the page cache; a fresh mount for bucketfs; server metadata primed for remote runs."""
        self.mount.stop()  # also before other systems: a mount's background work (listing ahead) must not overlap them
        for alt in self.alt_mounts.values():
            alt.stop()
        if system != "local":
            # All of them, not only the run's: bucketfs lists sibling directories ahead.
            self.backend.prime(self.ds.bucket, ["shards/", "imagefolder/", "flat/", "tree/"])
        self.dropped_ok = drop_caches() and self.dropped_ok
        if system == "bucketfs":
            if self.cache_dir:
                _empty_disk_cache(self.cache_dir)
            self.mount.start()
        elif system in self.alt_mounts:
            self.alt_mounts[system].start()

    def root(self, system: str) -> str:
        if system in self.alt_mounts:
            return self.alt_mounts[system].mountpoint
        return self.mountpoint if system == "bucketfs" else self.local_root

    def stop_mounts(self) -> None:
        self.mount.stop()
        for alt in self.alt_mounts.values():
            alt.stop()

    def measure(self, label: str, system: str, fn: Callable[[Verifier], dict]) -> dict:
        """Run fn(verifier) once, with the proxy's, the daemon's and our own costs around it."""
        verifier = Verifier(self.ds)
        remote = system != "local"
        self.backend.mark(f"start {label} [{system}]")
        before = self.backend.stats() if remote else None
        daemon_before = proc_cpu_s(self.mount.pid) if system == "bucketfs" else None
        alt = self.alt_mounts.get(system)
        if alt is not None:
            daemon_before = proc_cpu_s(alt.pid)
            alt.label += ("; " if alt.label else "") + label
        self_before = self_cpu_s()
        steal_before = steal_s()
        self.census.others_s()
        server_before = self.backend.server_cpu_s()
        proxy_before = self.backend.proxy_cpu_s()
        if system == "bucketfs":
            self.mount.label += ("; " if self.mount.label else "") + label
        profiler = self._start_profiler(label) if system == "bucketfs" and self.args.py_spy else None
        watchdog = threading.Timer(RUN_TIMEOUT_S, self._hung, args=(label, system, verifier))
        watchdog.daemon = True
        watchdog.start()
        t0 = time.perf_counter()
        try:
            result = fn(verifier) or {}
        except Exception as exc:  # noqa: BLE001 - reported as a failed run
            verifier.fail(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")
            result = {}
        finally:
            watchdog.cancel()
        wall_s = time.perf_counter() - t0
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            try:
                profiler.wait(30)
            except subprocess.TimeoutExpired:
                profiler.kill()
                profiler.wait()
        run = {"run": label, "system": system, "wall_s": round(wall_s, 4), **result}
        run["client_cpu_s"] = round(self_cpu_s() - self_before, 3)
        run["server_cpu_s"] = round(self.backend.server_cpu_s() - server_before, 3)
        proxy_cpu_s = self.backend.proxy_cpu_s() - proxy_before
        if system == "bucketfs" and self.mount.proc is not None and self.mount.proc.poll() is None:
            run["daemon_cpu_s"] = round(proc_cpu_s(self.mount.pid) - daemon_before, 3)
            from bucketfs.testing.mounting import daemon_stats
            with contextlib.suppress(OSError, ValueError):
                run["daemon_stats"] = daemon_stats(self.mountpoint)  # (--json only: counters since the mount)
        elif system == "bucketfs":
            verifier.fail(f"the bucketfs daemon died during the run (exit {self.mount.proc.returncode if self.mount.proc else '?'}): {self.mount._tail(800)}")
        elif alt is not None and alt.proc is not None and alt.proc.poll() is None:
            run["daemon_cpu_s"] = round(proc_cpu_s(alt.pid) - daemon_before, 3)
        elif alt is not None:
            verifier.fail(f"{alt.title} died during the run: {alt._tail(800)}")
        # CPU used by processes that are not part of this benchmark (a shared machine): noise.
        run["foreign_cpu_s"] = round(self.census.others_s(), 2)
        run["steal_s"] = round(steal_s() - steal_before, 2)
        if remote:
            after = self.backend.stats()
            requests = collections.Counter(after["requests"])
            requests.subtract(before["requests"])
            statuses = collections.Counter(after["statuses"])
            statuses.subtract(before["statuses"])
            run["requests"] = {k: v for k, v in sorted(requests.items()) if v}
            run["statuses"] = {k: v for k, v in sorted(statuses.items()) if v}
            run["fetched_bytes"] = after["body_bytes_down"] - before["body_bytes_down"]
            run["proxy_cpu_s"] = round(proxy_cpu_s, 3)
        run["errors"] = verifier.errors[:5]
        run["error_count"] = len(verifier.errors)
        self.runs.append(run)
        summary = " ".join(f"{k}={v}" for k, v in result.items() if k not in ("errors",))
        extra = ""
        if remote:
            extra = f" | requests {run['requests']} fetched {run['fetched_bytes'] / MB:.1f} MB"
            if run.get("daemon_cpu_s") is not None:
                extra += f" daemon_cpu {run['daemon_cpu_s']:.2f}s"
            extra += f" proxy_cpu {run['proxy_cpu_s']:.2f}s"
        log(f"  {label:<28} {system:<9} {summary}{extra} client_cpu {run['client_cpu_s']:.2f}s server_cpu {run['server_cpu_s']:.2f}s"
            + (f" (other processes: {run['foreign_cpu_s']:.1f} CPU s)" if run["foreign_cpu_s"] >= 0.5 else "")
            + (f" (host steal: {run['steal_s']:.1f} CPU s)" if run["steal_s"] >= 0.5 else ""))
        if verifier.errors:
            self.failures.append(f"{label} [{system}]: {len(verifier.errors)} error(s), first: {verifier.errors[0]}")
            print(f"\n!!!!!!!! FAIL {label} [{system}]: {len(verifier.errors)} error(s)", flush=True)
            for e in verifier.errors[:5]:
                print(f"!!!!!!!!   {e}", flush=True)
            print(flush=True)
            run["failed"] = True
        return run

    def _start_profiler(self, label: str) -> Optional[subprocess.Popen]:
        """py-spy on the daemon for one run: collapsed stacks (flamegraph.pl input) in --py-spy DIR."""
        self.args.py_spy.mkdir(parents=True, exist_ok=True)
        name = "".join(c if c.isalnum() else "-" for c in label.lower())
        out = self.args.py_spy / f"{len(self.runs):02d}-{name}.txt"
        try:
            proc = subprocess.Popen(["py-spy", "record", "-p", str(self.mount.pid), "-o", str(out), "--format", "raw",
                                     "-r", "100", "--nonblocking", "--gil"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as exc:
            log(f"  py-spy not started ({exc}): pip install py-spy")
            return None
        time.sleep(0.5)  # py-spy attaches in ~0.1 s; the first samples of the run are not worth racing for
        return proc

    def _hung(self, label, system, verifier) -> None:
        verifier.fail(f"no result after {RUN_TIMEOUT_S:.0f}s: hung; aborting")
        log(f"  {label} [{system}]: no result after {RUN_TIMEOUT_S:.0f}s; aborting the run")
        if system == "bucketfs":
            self.mount.abort()
        elif system in self.alt_mounts:
            self.alt_mounts[system].abort()

    # -- W1 shards --------------------------------------------------------------
    def w1(self) -> None:
        ds = self.ds
        total = ds.bytes_of(ds.shards)
        for readers, target in ((1, 570), (4, 800)):
            key = f"W1.{readers}"
            self.row(key, f"W1 shards, {readers} reader{'s' if readers > 1 else ''}", "MB/s", True, f">= {target} MB/s")
            groups = [ds.shards[r::readers] for r in range(readers)]
            for system in self.systems:
                self.cold(system)
                if system == "direct":
                    client = self.backend.direct(readers * PARALLEL_PARTS)
                    executors = [ThreadPoolExecutor(PARALLEL_PARTS) for _ in groups]

                    def fn(v, client=client, executors=executors):
                        def reader(group, ex):
                            for rel in group:
                                v.check(rel, *read_object_direct(client, ds.bucket, rel, ds.size(rel), ex))
                        wall = run_threads(reader, list(zip(groups, executors)), v)
                        return {"MB/s": round(total / wall / MB, 1)}
                else:
                    root = self.root(system)

                    def fn(v, root=root):
                        def reader(group):
                            buf = bytearray(READ_BYTES)
                            for rel in group:
                                v.check(rel, *read_file_streaming(os.path.join(root, rel), buf))
                        wall = run_threads(reader, [(g,) for g in groups], v)
                        return {"MB/s": round(total / wall / MB, 1)}
                run = self.measure(f"W1 {readers} reader(s)", system, fn)
                if system == "direct":
                    for ex in executors:
                        ex.shutdown()
                    client.close()
                self.record(key, system, run.get("MB/s"))
        self.w1_webdataset()

    def w1_webdataset(self) -> None:
        ds = self.ds
        row = self.row("W1.wds", "W1 webdataset DataLoader(2)", "samples/s", True, ">= 0.9x local")
        probe = subprocess.run([sys.executable, "-c", "import webdataset, torch"], capture_output=True)
        if probe.returncode != 0:
            row.target += " (skipped: pip install webdataset torch)"
            log("  W1 webdataset: skipped: pip install webdataset torch")
            return
        brace = f"shards/shard-{{000000..{ds.spec.shard_count - 1:06d}}}.tar"
        for system in self.systems:
            self.cold(system)
            if system == "direct":
                spec = {"urls": f"{self.backend.wds_scheme}://{ds.bucket}/{brace}", "mode": "direct",
                        "sizes": {r: ds.size(r) for r in ds.shards}, **self.backend.wds_direct_spec()}
                env = dict(os.environ, **self.backend.env())
            else:
                spec = {"urls": os.path.join(self.root(system), brace), "mode": "fs"}
                env = dict(os.environ)
            spec["manifest"] = str(self.args.data_dir / f"{ds.bucket}.manifest.json")

            def fn(v, spec=spec, env=env):
                proc = subprocess.run([sys.executable, __file__, "--wds-child", json.dumps(spec)], env=env,
                                      capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
                lines = proc.stdout.strip().splitlines()
                if proc.returncode != 0 or not lines:
                    v.fail(f"webdataset child failed ({proc.returncode}): {proc.stderr[-1500:]}")
                    return {}
                out = json.loads(lines[-1])
                for e in out["errors"]:
                    v.fail(e)
                # Loop-only machine CPU: every process's, the server's and proxy's included.
                return {"samples/s": round(out["samples"] / out["seconds"], 1), "samples": out["samples"],
                        "loop_busy_cpu_s": round(out["busy_cpu_s"], 2), "loop_idle_cpu_s": round(out["idle_cpu_s"], 2)}
            run = self.measure("W1 webdataset", system, fn)
            self.record("W1.wds", system, run.get("samples/s"))

    # -- W2 ImageFolder -----------------------------------------------------------
    def w2(self) -> None:
        ds = self.ds
        self.row("W2.list", "W2 ImageFolder listing, cold", "s", False, "<= 0.5 s")
        for threads in (8, 32):
            self.row(f"W2.cold{threads}", f"W2 epoch cold, {threads} threads", "files/s", True, ">= 1.0x direct")
        for threads in (8, 32):
            self.row(f"W2.warm{threads}", f"W2 epoch warm, {threads} threads", "files/s", True, ">= 6000 files/s")
        # A data set larger than RAM: the next epoch finds no page cache (try --mount-args "--cache-dir DIR").
        self.row("W2.evicted32", "W2 epoch, page cache dropped, 32t", "files/s", True, "-")
        if self.cache_dir:  # the disk cache outlives the mount: the next one starts from it
            # after a reboot (its files on disk only), and in a new job (its files still in the page cache)
            self.row("W2.remount32", "W2 epoch, new mount, disk cache kept, 32t", "files/s", True, "-")
            self.row("W2.rejob32", "W2 epoch, new mount, disk cache in page cache, 32t", "files/s", True, "-")
        for system in self.systems:
            for threads in (8, 32):
                self.cold(system)
                if system == "direct":
                    client = self.backend.direct(threads)
                    run = self.measure("W2 listing", system, lambda v: self._w2_list_direct(v, client))
                else:
                    run = self.measure("W2 listing", system, lambda v: self._w2_list_fs(v, self.root(system)))
                if threads == 8:  # the 32-thread pass lists again only to load the fresh mount
                    self.record("W2.list", system, run.get("s"))
                order = list(ds.images)
                random.Random(threads).shuffle(order)
                passes = ("cold", "warm") if system != "direct" else ("cold",)
                if system != "direct" and threads == 32:
                    passes += ("evicted",)
                    if system == "bucketfs" and self.cache_dir:
                        passes += ("remount", "rejob")
                for temp in passes:
                    if temp == "evicted":
                        drop_caches()  # the same mount: its block cache and --cache-dir stay
                    elif temp == "remount":
                        self.mount.remount()  # a new daemon; --cache-dir is kept, the page cache dropped
                    elif temp == "rejob":
                        self.mount.remount(drop=False)  # the last epoch left the cache's files in the page cache
                    if system == "direct":
                        run = self.measure(f"W2 epoch {temp} {threads}t", system,
                                           lambda v: self._epoch(v, order, threads, lambda rel: client.get(ds.bucket, rel)))
                    else:
                        root = self.root(system)

                        def read(rel, root=root):
                            with open(os.path.join(root, rel), "rb") as f:
                                return f.read()
                        run = self.measure(f"W2 epoch {temp} {threads}t", system, lambda v: self._epoch(v, order, threads, read))
                    self.record(f"W2.{temp}{threads}", system, run.get("files/s"))
                if system == "direct":
                    client.close()

    def _w2_list_fs(self, v: Verifier, root: str) -> dict:
        t0 = time.perf_counter()
        top = os.path.join(root, "imagefolder")
        classes = sorted(e.name for e in os.scandir(top) if e.is_dir())
        found = []
        for cls in classes:
            for dirpath, _dirs, names in sorted(os.walk(os.path.join(top, cls), followlinks=True)):
                for name in sorted(names):
                    found.append(os.path.join(dirpath, name))
        seconds = time.perf_counter() - t0
        rels = sorted(os.path.relpath(p, root) for p in found)
        if rels != self.ds.images:
            v.fail(f"ImageFolder listing found {len(rels)} files, expected {len(self.ds.images)}")
        return {"s": round(seconds, 4), "files": len(found), "classes": len(classes)}

    def _w2_list_direct(self, v: Verifier, client: S3Direct) -> dict:
        t0 = time.perf_counter()
        _objs, class_prefixes = client.list_all(self.ds.bucket, "imagefolder/")
        found = []
        for prefix in sorted(class_prefixes):
            objs, _ = client.list_all(self.ds.bucket, prefix)
            found += [k for k, _size in objs]
        seconds = time.perf_counter() - t0
        if sorted(found) != self.ds.images:
            v.fail(f"listing found {len(found)} objects, expected {len(self.ds.images)}")
        return {"s": round(seconds, 4), "files": len(found), "classes": len(class_prefixes)}

    def _epoch(self, v: Verifier, order: list, threads: int, read: Callable[[str], bytes]) -> dict:
        def one(_i, rel):
            data = read(rel)
            v.check(rel, len(data), digest(data))
        wall = run_threads(pull_loop(order, one), [()] * threads, v)
        return {"files/s": round(len(order) / wall, 1), "MB/s": round(self.ds.bytes_of(order) / wall / MB, 1)}

    # -- W3 metadata ----------------------------------------------------------------
    def w3(self) -> None:
        ds = self.ds
        self.row("W3.flat.cold", f"W3 listdir {len(ds.flat)}, cold", "s", False, "<= direct LISTs, 0 HEAD")
        self.row("W3.flat.cached", f"W3 listdir {len(ds.flat)}, cached", "s", False, "<= 0.1 s")
        # ls -l: a stat of each entry (from the listing's attributes) and the ACL and
        # label lookups ls makes on every file (no target: what a user at a shell sees).
        self.row("W3.flat.ls", f"W3 ls -l {len(ds.flat)}, cached", "s", False)
        self.row("W3.tree.cold", f"W3 walk+stat {len(ds.tree)}, cold", "s", False, "<= direct LISTs, 0 HEAD")
        self.row("W3.tree.cached", f"W3 walk+stat {len(ds.tree)}, cached", "s", False, "<= 0.1 s")
        self.w3_heads = {}
        for what in ("flat", "tree"):
            for system in self.systems:
                self.cold(system)
                temps = ("cold",) if system == "direct" else ("cold", "cached", *(("ls",) if what == "flat" else ()))
                for temp in temps:
                    if system == "direct":
                        client = self.backend.direct(4)
                        fn = (lambda v: self._w3_direct(v, client, what))
                    else:
                        # A cached pass takes ~0.1 s, where one stall of this shared VM moves
                        # it by a third: the median of CACHED_PASSES (local disk the same).
                        passes = 1 if temp == "cold" else CACHED_PASSES
                        fn = (lambda v: median_run(passes, lambda: self._w3_fs(v, self.root(system), what,
                                                                                long_listing=temp == "ls")))
                    run = self.measure(f"W3 {what} {temp}", system, fn)
                    if system == "direct":
                        client.close()
                    self.record(f"W3.{what}.{temp}", system, run.get("s"))
                    if system == "bucketfs" and temp == "cold":
                        self.w3_heads[what] = run.get("requests", {}).get("HEAD", 0)

    def _w3_fs(self, v: Verifier, root: str, what: str, long_listing: bool = False) -> dict:
        expected = self.ds.flat if what == "flat" else self.ds.tree
        t0 = time.perf_counter()
        if long_listing:
            out = subprocess.run(["ls", "-l", os.path.join(root, "flat")], stdout=subprocess.PIPE, check=True,
                                 env=dict(os.environ, LC_ALL="C")).stdout.decode()
            seconds = time.perf_counter() - t0
            names = [line.split()[-1] for line in out.splitlines()[1:]]  # (after the "total" line)
            if sorted("flat/" + n for n in names) != expected:
                v.fail(f"ls -l listed {len(names)} names, expected {len(expected)}")
            return {"s": round(seconds, 4), "entries": len(names)}
        if what == "flat":
            names = os.listdir(os.path.join(root, "flat"))
            seconds = time.perf_counter() - t0
            if sorted("flat/" + n for n in names) != expected:
                v.fail(f"listdir found {len(names)} names, expected {len(expected)}")
            return {"s": round(seconds, 4), "entries": len(names)}
        found = []  # (path, size); the verification's bookkeeping (relpath) is not timed
        for dirpath, _dirs, names in os.walk(os.path.join(root, "tree")):
            for name in names:
                path = os.path.join(dirpath, name)
                found.append((path, os.stat(path).st_size))
        seconds = time.perf_counter() - t0
        sizes = {os.path.relpath(path, root): size for path, size in found}
        if sizes != {rel: self.ds.size(rel) for rel in expected}:
            v.fail(f"walk+stat found {len(sizes)} files (or wrong sizes), expected {len(expected)}")
        return {"s": round(seconds, 4), "entries": len(sizes)}

    def _w3_direct(self, v: Verifier, client: S3Direct, what: str) -> dict:
        """The LISTs a mount needs, one after another: the bucket root (path lookup), then
        the directory's pages (flat) or the tree's folders one by one (tree)."""
        expected = self.ds.flat if what == "flat" else self.ds.tree
        t0 = time.perf_counter()
        client.list_all(self.ds.bucket, "")
        objs, prefixes = client.list_all(self.ds.bucket, f"{what}/")
        for prefix in prefixes:
            objs += client.list_all(self.ds.bucket, prefix)[0]
        seconds = time.perf_counter() - t0
        if dict(objs) != {rel: self.ds.size(rel) for rel in expected}:
            v.fail(f"listing found {len(objs)} objects (or wrong sizes), expected {len(expected)}")
        return {"s": round(seconds, 4), "entries": len(objs)}

    # -- W4 random preads -------------------------------------------------------------
    def w4(self) -> None:
        ds = self.ds
        self.row("W4.ops", "W4 random 4-64K preads, 4 thr", "ops/s", True, ">= 2000 ops/s")
        self.row("W4.amp", "W4 bytes fetched / bytes read", "x", False, "<= 4x")
        # The same preads again on the same mount: what a reader that revisits its
        # samples (a second epoch) gets from the page cache and the block cache.
        self.row("W4.again", "W4 the same preads again", "ops/s", True, ">= 2000 ops/s")
        count = max(200, round(2000 * ds.spec.scale))
        rnd = random.Random(4)
        ops = []
        for _ in range(count):
            s = rnd.randrange(len(ds.shards))
            length = rnd.randint(4 * 1024, 64 * 1024)
            ops.append((s, rnd.randrange(0, ds.size(ds.shards[s]) - length), length))
        read_bytes = sum(op[2] for op in ops)
        # Expected digests from the local files (read outside any timing).
        expected = []
        local_fds = [os.open(os.path.join(self.local_root, rel), os.O_RDONLY) for rel in ds.shards]
        try:
            for s, off, length in ops:
                expected.append(digest(os.pread(local_fds[s], length, off)))
        finally:
            for fd in local_fds:
                os.close(fd)
        for system in self.systems:
            self.cold(system)
            got = [None] * len(ops)
            if system == "direct":
                client = self.backend.direct(4)

                def read_op(i, op, client=client):
                    s, off, length = op
                    got[i] = digest(client.get(ds.bucket, ds.shards[s], off, off + length))
                fds = []
            else:
                fds = [os.open(os.path.join(self.root(system), rel), os.O_RDONLY) for rel in ds.shards]

                def read_op(i, op, fds=fds):
                    s, off, length = op
                    got[i] = digest(os.pread(fds[s], length, off))

            def fn(v):
                wall = run_threads(pull_loop(ops, read_op), [()] * 4, v)
                bad = [i for i in range(len(ops)) if got[i] != expected[i]]
                if bad:
                    s, off, length = ops[bad[0]]
                    v.fail(f"{len(bad)} preads returned wrong bytes, first {ds.shards[s]} [{off}, {off + length})")
                return {"ops/s": round(len(ops) / wall, 1), "ops": len(ops), "read_MB": round(read_bytes / MB, 2)}
            run = self.measure("W4 random preads", system, fn)
            if system != "direct":
                again = self.measure("W4 random preads again", system, fn)
                self.record("W4.again", system, again.get("ops/s"))
            for fd in fds:
                os.close(fd)
            if system == "direct":
                client.close()
            self.record("W4.ops", system, run.get("ops/s"))
            if system != "local":
                amp = run["fetched_bytes"] / read_bytes
                run["fetched_over_read"] = round(amp, 3)
                self.record("W4.amp", system, round(amp, 3))
                log(f"  W4 {system}: fetched {run['fetched_bytes'] / MB:.1f} MB through the proxy for {read_bytes / MB:.1f} MB read = {amp:.2f}x")

    # -- W5 mixed -------------------------------------------------------------------
    def w5(self) -> None:
        ds = self.ds
        self.row("W5.mbps", "W5 32 small + 4 shard readers", "MB/s", True, ">= direct")
        limit_mb = self.max_memory_bytes() / MB + 150
        self.row("W5.rss", "W5 daemon peak RSS (sampled)", "MB", False, f"<= {limit_mb:.0f} MB")
        self.row("W5.hwm", "W5 daemon VmHWM", "MB", False, f"<= {limit_mb:.0f} MB")
        # How long a small-file reader (a DataLoader worker) waits while shards stream.
        self.row("W5.p50", "W5 small file p50 latency", "ms", False, "-")
        self.row("W5.p99", "W5 small file p99 latency", "ms", False, "-")
        total = ds.bytes_of(ds.images) + ds.bytes_of(ds.shards)
        order = list(ds.images)
        random.Random(5).shuffle(order)
        groups = [ds.shards[r::4] for r in range(4)]
        for system in self.systems:
            self.cold(system)
            if system == "direct":
                client = self.backend.direct(32 + 4 * PARALLEL_PARTS)
                executors = [ThreadPoolExecutor(PARALLEL_PARTS) for _ in groups]

                def small(_i, rel, client=client):
                    data = client.get(ds.bucket, rel)
                    return rel, len(data), digest(data)

                def stream(group, ex, client=client):
                    return [(rel, *read_object_direct(client, ds.bucket, rel, ds.size(rel), ex)) for rel in group]
            else:
                root = self.root(system)

                def small(_i, rel, root=root):
                    with open(os.path.join(root, rel), "rb") as f:
                        data = f.read()
                    return rel, len(data), digest(data)

                def stream(group, _ex, root=root):
                    buf = bytearray(READ_BYTES)
                    return [(rel, *read_file_streaming(os.path.join(root, rel), buf)) for rel in group]
                executors = [None] * 4

            def fn(v):
                sampler = RssSampler(self.mount.pid) if system == "bucketfs" else contextlib.nullcontext()
                latencies_s = []

                def timed_small(i, rel):
                    started_s = time.monotonic()
                    result = small(i, rel)
                    latencies_s.append(time.monotonic() - started_s)
                    v.check(*result)

                with sampler:
                    body_small = pull_loop(order, timed_small)

                    def body_stream(group, ex):
                        for rel, n, h in stream(group, ex):
                            v.check(rel, n, h)
                    args = [(body_small, None)] * 32 + [(body_stream, (g, ex)) for g, ex in zip(groups, executors)]
                    wall = run_threads(lambda f, a: f(*a) if a else f(), args, v)
                out = {"MB/s": round(total / wall / MB, 1)}
                if len(latencies_s) >= 2:
                    percentiles_s = statistics.quantiles(latencies_s, n=100)
                    out["p50_ms"] = round(percentiles_s[49] * 1000, 1)
                    out["p99_ms"] = round(percentiles_s[98] * 1000, 1)
                if system == "bucketfs":
                    out["peak_rss_MB"] = round(sampler.peak_bytes / MB, 1)
                    out["vm_hwm_MB"] = round(proc_status_kib(self.mount.pid, "VmHWM") * 1024 / MB, 1)
                return out
            run = self.measure("W5 mixed", system, fn)
            if system == "direct":
                for ex in executors:
                    ex.shutdown()
                client.close()
            self.record("W5.mbps", system, run.get("MB/s"))
            self.record("W5.p50", system, run.get("p50_ms"))
            self.record("W5.p99", system, run.get("p99_ms"))
            if system == "bucketfs":
                self.record("W5.rss", system, run.get("peak_rss_MB"))
                self.record("W5.hwm", system, run.get("vm_hwm_MB"))

    def max_memory_bytes(self) -> int:
        from bucketfs.cli import parse_size

        return parse_size(self.args.max_memory)

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
            "W3.flat.cold": lambda: None if val("W3.flat.cold") is None else bool(le(val("W3.flat.cold"), val("W3.flat.cold", "direct")) and not self.w3_heads.get("flat")),
            "W3.flat.cached": lambda: le(val("W3.flat.cached"), 0.1),
            "W3.tree.cold": lambda: None if val("W3.tree.cold") is None else bool(le(val("W3.tree.cold"), val("W3.tree.cold", "direct")) and not self.w3_heads.get("tree")),
            "W3.tree.cached": lambda: le(val("W3.tree.cached"), 0.1),
            "W4.ops": lambda: ge(val("W4.ops"), 2000),
            "W4.amp": lambda: le(val("W4.amp"), 4),
            "W5.mbps": lambda: ge(val("W5.mbps"), val("W5.mbps", "direct")),
            "W5.rss": lambda: le(val("W5.rss"), self.max_memory_bytes() / MB + 150),
            "W5.hwm": lambda: le(val("W5.hwm"), self.max_memory_bytes() / MB + 150),
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
            if isinstance(x, float) and abs(x) < 10:
                return f"{x:.3f}"
            return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}"

        def ratio(a, b):
            if a is None or b is None or b == 0:
                return "-"
            return f"{a / b:.2f}x"

        alts = list(self.alt_mounts)
        titles = [self.alt_mounts[a].title for a in alts]
        header = ("workload", "unit", "bucketfs", self.backend.direct_label, "local", *titles,
                  "bucketfs/direct", "bucketfs/local", *(f"bucketfs/{t}" for t in titles), "target", "met")
        lines = []
        for row in self.rows.values():
            b, d, l = (row.values.get(s) for s in SYSTEMS)
            others = [row.values.get(a) for a in alts]
            met = {True: "yes", False: "NO", None: "-"}[row.met]
            lines.append((row.label, row.unit + ("" if row.higher_is_better else " (lower better)"), fmt(b), fmt(d), fmt(l),
                          *(fmt(r) for r in others), ratio(b, d), ratio(b, l), *(ratio(b, r) for r in others), row.target, met))
        widths = [max(len(str(x[i])) for x in [header] + lines) for i in range(len(header))]
        out = [" | ".join(str(h).ljust(w) for h, w in zip(header, widths)),
               "-+-".join("-" * w for w in widths)]
        out += [" | ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines]
        return "\n".join(out)

    def cost_table(self) -> str:
        header = ("run", "system", "wall s", "LIST", "GET", "HEAD", "other req", "fetched MB", "daemon CPU s", "client CPU s",
                  "proxy CPU s", "server CPU s", "others' CPU s", "steal s")
        lines = []
        for run in self.runs:
            req = dict(run.get("requests", {}))
            other = sum(v for k, v in req.items() if k not in ("LIST", "GET", "HEAD"))
            lines.append((run["run"], run["system"], f"{run['wall_s']:.2f}", req.get("LIST", 0), req.get("GET", 0), req.get("HEAD", 0),
                          other, f"{run.get('fetched_bytes', 0) / MB:.1f}",
                          "-" if run.get("daemon_cpu_s") is None else f"{run['daemon_cpu_s']:.2f}",
                          f"{run['client_cpu_s']:.2f}", f"{run.get('proxy_cpu_s', 0):.2f}", f"{run['server_cpu_s']:.2f}",
                          f"{run['foreign_cpu_s']:.1f}", f"{run.get('steal_s', 0):.1f}"))
        widths = [max(len(str(x[i])) for x in [header] + lines) for i in range(len(header))]
        out = [" | ".join(str(h).ljust(w) for h, w in zip(header, widths)), "-+-".join("-" * w for w in widths)]
        out += [" | ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines]
        return "\n".join(out)


def emulation_ceilings(runs: list, cpus: int) -> list:
    """What this machine allows any client of the emulated store, from the CPU the store
    itself (server + proxy) used in this run: lines for the W1 rows. On a real
    deployment that CPU is the store's and the network's, not the training machine's;
    here it shares the machine's cores with the client, so it caps every client.
    - W1 MB/s: the store's CPU per MB (the lower of bucketfs's and direct's runs) plus
      each system's own CPU per MB (its readers', and bucketfs's daemon's), on `cpus`
      cores: a reader side that cheap cannot pass cpus / (that sum) MB/s. The local
      disk's readers are the least any reader side spends: no client passes that one.
    - webdataset: the local loop keeps the cores busy (its busy CPU is ~cpus x its
      seconds), so a mount's run needs at least (the local loop's busy CPU + the store's
      CPU) / cpus seconds even if its daemon cost nothing: a ceiling on mount / local."""
    by = {(r["run"], r["system"]): r for r in runs}
    lines = []
    for label in ("W1 1 reader(s)", "W1 4 reader(s)"):
        runs_of = {system: by.get((label, system)) for system in ("local", "direct", "bucketfs")}
        remote = [r for r in (runs_of["bucketfs"], runs_of["direct"]) if r and r.get("fetched_bytes") and not r.get("error_count")]
        if not runs_of["local"] or not remote or not runs_of["local"].get("MB/s"):
            continue
        store_s_per_mb = min((r["server_cpu_s"] + r.get("proxy_cpu_s", 0)) / (r["fetched_bytes"] / MB) for r in remote)
        client_s_per_mb = {}  # everything on this machine that is not the store, per MB read
        for system, r in runs_of.items():
            if r and r.get("MB/s") and not r.get("error_count"):
                client_s_per_mb[system] = (r["client_cpu_s"] + r.get("daemon_cpu_s", 0)) / (r["MB/s"] * r["wall_s"])
        parts = ", ".join(f"{system} {1000 * v:.2f}" for system, v in client_s_per_mb.items())
        bounds = " / ".join(f"{cpus / (store_s_per_mb + v):,.0f}" for v in client_s_per_mb.values())
        lines.append(f"  {label}: the store used {1000 * store_s_per_mb:.2f} ms of CPU per MB (server + proxy); the reader "
                     f"side ({'daemon + ' if 'bucketfs' in client_s_per_mb else ''}readers) used, per MB: {parts} ms. "
                     f"On {cpus} CPUs, store + that reader side allow at most {bounds} MB/s "
                     f"({' / '.join(client_s_per_mb)})")
    local, mount = by.get(("W1 webdataset", "local")), by.get(("W1 webdataset", "bucketfs"))
    if local and mount and local.get("loop_busy_cpu_s") and local.get("samples/s"):
        store_s = mount["server_cpu_s"] + mount.get("proxy_cpu_s", 0)
        ratio = local["loop_busy_cpu_s"] / (local["loop_busy_cpu_s"] + store_s)
        lines.append(f"  W1 webdataset: the local loop kept {local['loop_busy_cpu_s']:.1f} CPU s busy and the store used "
                     f"{store_s:.1f} CPU s for the mount's run: with a daemon that cost nothing, a mount reaches at most "
                     f"{ratio:.2f}x local here ({ratio * local['samples/s']:,.0f} samples/s)")
    return lines


# Targets that are absolute speeds of a remote read (set for S3 at full scale): not
# evaluated on a backend that cannot reach them whatever the client (the GCS emulator).
ABSOLUTE_TARGET_KEYS = ("W1.1", "W1.4", "W2.list", "W4.ops")

TARGETS = """Targets (from the issue):
  W1: 1 reader >= 570 MB/s; 4 readers >= 800 MB/s; webdataset >= 0.9x local disk.
  W2: listing <= 0.5 s cold; cold epoch >= 1.0x direct boto3 at the same thread count; warm epoch >= 6,000 files/s.
  W3: cold no slower than the LIST requests it needs (no HEADs); cached <= 0.1 s.
  W4: >= 2,000 ops/s with bytes fetched <= 4x bytes read.
  W5: total >= direct; peak RSS <= --max-memory + 150 MB."""


# =============================================================================
# webdataset child (its own process: torch stays out of the benchmark process, and
# the DataLoader forks a process that has no other threads)
# =============================================================================
_direct_state: dict = {}


def _wds_open_direct(url, mode="rb", bufsize=8192, **_kw):
    """gopen handler for benchs3:// (benchgs://) bucket/key: 16 parallel 8 MiB ranged GETs, in order."""
    from urllib.parse import urlsplit

    pid = os.getpid()
    if _direct_state.get("pid") != pid:  # a DataLoader worker: its own client and threads
        gcs = _direct_state.get("gcs")
        client = (GCSDirect(gcs["endpoint_url"], PARALLEL_PARTS, gcs["max_connections"]) if gcs
                  else S3Direct.from_env(PARALLEL_PARTS))
        _direct_state.update(pid=pid, client=client, executor=ThreadPoolExecutor(PARALLEL_PARTS))
    parts = urlsplit(url)
    key = parts.path.lstrip("/")
    size = _direct_state["sizes"][key]
    chunks = iter_object_parallel(_direct_state["client"], parts.netloc, key, size, _direct_state["executor"])
    return io.BufferedReader(IterReader(chunks), buffer_size=READ_BYTES)


def _wds_sample_digest(sample: dict) -> tuple:
    return sample["__key__"], os.path.basename(sample["__url__"]), digest(sample["jpg"]), sample["cls"].decode()


def wds_child(spec: dict) -> int:
    import warnings

    import torch.utils.data
    import webdataset as wds

    warnings.filterwarnings("ignore")
    manifest = json.loads(Path(spec["manifest"]).read_text())
    if spec["mode"] == "direct":
        _direct_state["sizes"] = spec["sizes"]
        _direct_state["gcs"] = spec.get("gcs")
        # `webdataset.gopen` is also the name of a function in the package namespace.
        schemes = importlib.import_module("webdataset.gopen").gopen_schemes
        schemes["benchs3"] = schemes["benchgs"] = _wds_open_direct
    dataset = wds.WebDataset(spec["urls"], shardshuffle=False, empty_check=False).map(_wds_sample_digest)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=WDS_WORKERS)
    # The machine's CPU over the loop alone: this child's imports run on one core and
    # would read as idle time if counted.
    cpu0 = machine_cpu_s()
    t0 = time.perf_counter()
    seen = list(loader)
    seconds = time.perf_counter() - t0
    busy_s, idle_s = (b - a for a, b in zip(cpu0, machine_cpu_s()))
    expected = {(f"shards/{shard.split('/')[-1]}", key): tuple(v) for shard, entries in manifest["samples"].items() for key, v in entries.items()}
    got = {(f"shards/{name}", key): (h, cls) for key, name, h, cls in seen}
    errors = []
    if len(got) != len(seen):
        errors.append(f"{len(seen) - len(got)} samples delivered twice")
    missing = expected.keys() - got.keys()
    if missing:
        errors.append(f"{len(missing)} samples missing, e.g. {sorted(missing)[0]}")
    wrong = [k for k in expected.keys() & got.keys() if expected[k] != got[k]]
    if wrong:
        errors.append(f"{len(wrong)} samples with wrong bytes, e.g. {sorted(wrong)[0]}")
    print(json.dumps({"samples": len(seen), "seconds": seconds, "busy_cpu_s": busy_s, "idle_cpu_s": idle_s, "errors": errors}), flush=True)
    return 0


# =============================================================================
# main
# =============================================================================
def parse_args(argv):
    p = argparse.ArgumentParser(description="bucketfs vs direct SDK reads vs local disk, on emulated-remote S3 or GCS.")
    p.add_argument("--latency-ms", type=float, default=20.0, help="added time to first byte of every response (default 20)")
    p.add_argument("--conn-mbps", type=float, default=100.0, help="per-connection cap, MB/s (10^6 B/s); 0 = none (default 100)")
    p.add_argument("--data-dir", type=Path, default=REPO / ".bench-data", help="generated data set, reused (default .bench-data/)")
    p.add_argument("--only", default="W1,W2,W3,W4,W5", help="comma-separated workloads (default all)")
    p.add_argument("--max-memory", default="1G", help="passed to the mount (default 1G)")
    p.add_argument("--mount-args", default="", help="extra bucketfs mount options, e.g. '--part-size 4M' (tuning runs)")
    p.add_argument("--scale", type=float, help="shrink the data set, e.g. 0.25 for a quick run (default 1; 0.15 for gcs)")
    p.add_argument("--backend", choices=sorted(BACKENDS), default="s3",
                   help="s3: rclone serve s3 vs boto3 (default); gcs: gcp-storage-emulator vs google-cloud-storage")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--py-spy", type=Path, metavar="DIR", help="profile the daemon in every bucketfs run with py-spy (collapsed stacks in DIR)")
    p.add_argument("--proxy-log", type=Path, metavar="FILE", help="the proxy appends one line per request here (time, connection, kind, key, range)")
    p.add_argument("--alternatives", action="store_true",
                   help="also run every workload over existing FUSE mounts (rclone mount; s3fs where installed) for comparison (s3 only)")
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
    unknown = set(only) - {"W1", "W2", "W3", "W4", "W5"}
    if unknown:
        print(f"bench: unknown workload(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.alternatives and args.backend != "s3":
        print("bench: --alternatives needs --backend s3 (rclone mount :s3:, s3fs)", file=sys.stderr)
        return 2
    if not 0 < args.scale <= 1:
        print("bench: --scale must be in (0, 1]", file=sys.stderr)
        return 2
    args.data_dir = args.data_dir.resolve()
    spec = Spec.for_scale(args.scale)
    bucket_dir, manifest = ensure_dataset(spec, args.data_dir)
    ds = Dataset(spec, bucket_dir, manifest)
    log(f"data: {len(ds.shards)} shards ({ds.bytes_of(ds.shards) / MB:.0f} MB, {ds.sample_count} samples), "
        f"{len(ds.images)} ImageFolder files ({ds.bytes_of(ds.images) / MB:.0f} MB), {len(ds.flat)} flat, {len(ds.tree)} tree objects; "
        f"digests {HASH_NAME}")
    log(f"load average {os.getloadavg()[0]:.2f}")
    log(f"emulation: +{args.latency_ms:g} ms to first byte, {args.conn_mbps:g} MB/s per connection; "
        f"--max-memory {args.max_memory}; {os.cpu_count()} CPUs")
    if not drop_caches():
        log("WARNING: cannot drop the page cache (not root?): 'cold' local runs are warm")
    backend_cls = BACKENDS[args.backend]
    started = time.perf_counter()
    work_dir = tempfile.mkdtemp(prefix="bucketfs-bench-")
    bench = None
    try:
        with backend_cls(args.data_dir / "srv", args.latency_ms, args.conn_mbps, args.proxy_log).serve() as backend:
            backend.seed(ds)
            log(f"server: {backend.description} behind the proxy {backend.proxy.url} (pid {backend.proxy.pid})")
            bench = Bench(args, ds, backend, work_dir)
            try:
                for name in only:
                    log(f"{name}")
                    getattr(bench, name.lower())()
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
    bench.evaluate()
    print()
    print(f"bucketfs benchmark: scale {args.scale:g}, +{args.latency_ms:g} ms first byte, {args.conn_mbps:g} MB/s per connection, "
          f"--max-memory {args.max_memory}{backend_cls.title}, {time.perf_counter() - started:.0f} s")
    print(bench.table())
    print()
    print("Requests and costs of each run (requests and bytes counted by the proxy; fetched = response bodies):")
    print(bench.cost_table())
    print("(client CPU = this script's threads and children; others' CPU = CPU time of processes that are not part of this\n"
          " benchmark during the run: noise from a shared machine, which has 2 CPUs = 2 CPU s per second of wall time;\n"
          " steal = CPU time the hypervisor gave other guests while this VM wanted it: a slow host)")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    ceilings = emulation_ceilings(bench.runs, os.cpu_count() or 1)
    if ceilings:
        print("\nWhat the emulated store leaves this machine (its CPU is on the same cores as the client's):")
        print("\n".join(ceilings))
    print()
    print(TARGETS)
    if backend_cls.targets_note:
        print(backend_cls.targets_note)
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
        args.json.write_text(json.dumps({
            "config": {k: str(v) for k, v in vars(args).items() if k != "wds_child"},
            "rows": [dataclasses.asdict(r) for r in bench.rows.values()],
            "runs": bench.runs, "failures": bench.failures,
        }, indent=1))
    if bench.failures:
        print("\n" + "!" * 78)
        print(f"FAIL: {len(bench.failures)} run(s) returned wrong bytes, errors or hung:")
        for f in bench.failures:
            print(f"  FAIL {f}")
        print("!" * 78)
        return 1
    print("\nAll reads verified.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
