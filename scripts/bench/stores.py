"""The emulated remote stores, the one place that knows S3 and GCS: each serves the
data set behind the latency proxy (scripts/latency_proxy.py) and builds the direct
SDK client that is the baseline (boto3; google-cloud-storage). BACKENDS by name."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional

from .common import ENTRY, GCS_MAX_CONNECTIONS, GCS_SEED_THREADS, MB, WDS_WORKERS, log
from .datasets import Dataset
from .procs import proc_cpu_s

UPLOAD_THREADS = 16  # --object-checksum: PUTs in flight


class S3Direct:
    """Direct boto3 access (the baseline): a thread-safe client sized for `pool` threads."""

    def __init__(self, endpoint_url: str, access_key: str, secret_key: str, region: str, pool: int):
        import boto3
        import botocore.config

        session = boto3.session.Session(
            aws_access_key_id=access_key, aws_secret_access_key=secret_key, region_name=region
        )
        self.client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            config=botocore.config.Config(
                s3={"addressing_style": "path"},
                max_pool_connections=pool,
                retries={"total_max_attempts": 3},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",  # rclone sends whole-object CRCs on ranged GETs
            ),
        )

    @classmethod
    def from_env(cls, pool: int) -> "S3Direct":
        return cls(
            os.environ["AWS_ENDPOINT_URL"],
            os.environ["AWS_ACCESS_KEY_ID"],
            os.environ["AWS_SECRET_ACCESS_KEY"],
            os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            pool,
        )

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
            with ProxyProcess(
                server.endpoint_url,
                self.latency_ms,
                self.conn_mbps,
                log_path=str(self.proxy_log) if self.proxy_log else None,
            ) as proxy:
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

    def upload_with_checksum(self, dataset: "Dataset", rels: list, kind: str) -> None:
        """PUT `rels` again (the same bytes), not through the proxy, with their full-object
        CRC `kind`: rclone then states it in its answers, as AWS does for objects its SDKs
        uploaded. (rclone keeps it in memory: every run uploads them again.)"""
        t0 = time.perf_counter()

        def upload(rel: str) -> None:
            self.server.put_with_crc(dataset.bucket, rel, (dataset.bucket_dir / rel).read_bytes(), kind)

        with ThreadPoolExecutor(UPLOAD_THREADS) as executor:
            list(executor.map(upload, rels))
        log(f"uploaded {len(rels)} objects with their {kind} in {time.perf_counter() - t0:.1f}s")

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

        self.client = storage.Client(
            project="bench", credentials=AnonymousCredentials(), client_options={"api_endpoint": endpoint_url}
        )
        self.client._bucket_metadata_cache = None  # no background bucket GETs (as bucketfs)
        adapter = requests.adapters.HTTPAdapter(
            pool_connections=1, pool_maxsize=max(1, min(pool, max_connections)), pool_block=True
        )
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
            self.proc = subprocess.Popen(
                [sys.executable, ENTRY, "--gcs-proxy-child", json.dumps(proxy_argv)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                preexec_fn=latency_proxy._die_with_parent,
            )
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
    targets_note = (
        f"  (gcs: W1 1/4 readers, W2 listing and W4 ops/s are not evaluated: absolute speeds set for S3, which the\n"
        f"   emulator reaches for no client. Compare bucketfs with direct google-cloud-storage, both held to\n"
        f"   {GCS_MAX_CONNECTIONS} requests in flight, through a front that serves generations as GCS does.)"
    )

    @contextlib.contextmanager
    def serve(self) -> Iterator["GCSBackend"]:
        from get_cost import gcs_like_front

        from bucketfs.testing.gcs_server import start_gcs_emulator

        with start_gcs_emulator() as server, gcs_like_front(server.endpoint_url) as front_url:
            with _gcs_proxy_process(
                front_url, self.latency_ms, self.conn_mbps, str(self.proxy_log) if self.proxy_log else None
            ) as proxy:
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
                connection.request(
                    "POST",
                    f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={urllib.parse.quote(rel, safe='')}",
                    body=data,
                    headers={"Content-Type": "application/octet-stream"},
                )
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
            raise RuntimeError(
                f"the GCS emulator lists {len(listed)} objects after seeding, expected {len(expected)} (or sizes differ)"
            )
        log(
            f"seeded the GCS emulator with {len(expected)} objects ({sum(expected.values()) / MB:.0f} MB) "
            f"in {time.perf_counter() - t0:.1f}s"
        )

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
