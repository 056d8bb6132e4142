"""s3torchconnector (issue 37): Amazon's PyTorch connector for S3 (a Rust client on the
AWS CRT) as a column beside direct boto3, through the same latency proxy: its map-style
dataset for the ImageFolder files (W2), its sequential reader for the shards (W1), and
its client for both parts of the mixed workload (W5). Every byte is verified as for the
other systems.

- Client: `S3ClientConfig(force_path_style=True)` (its other settings its defaults:
  throughput_target_gbps 10, part_size 8 MiB), `endpoint=` the proxy, region the
  server's. Its credentials come from the CRT's default chain: the bench puts the
  server's keys (rclone's, as the direct boto3 client gets them) in this process's
  environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) before the first client is
  made; every other client of the bench is given its keys explicitly.
- W2: `S3MapDataset.from_prefix("s3://BUCKET/imagefolder/")`; its listing (the LIST
  pages of the prefix, timed as "W2 listing") gives each object's size, so a
  `dataset[i].read()` is one GET. The cold epoch reads `dataset[i]` in the same
  shuffled order as the other systems with 8 and 32 threads (a fresh dataset, and so a
  fresh client, for each).
- W1: one S3Client per run; each reader reads its shards one after another with
  `client.get_object(bucket, key, reader_constructor=S3ReaderConstructor.sequential())`
  and 1 MiB `readinto`s, as the file-system readers do.
- W5: one S3Client: the 32 small-file readers `get_object(...).read()`, the 4 shard
  readers the sequential reader.

It runs in this process (importing torch, which s3torchconnector imports), so its CPU
is the "client CPU" of its runs, as boto3's is for the direct column. `pip install
s3torchconnector` (it needs torch; not a bucketfs dependency); without it, or on
--backend gcs, its column says why and the bench goes on."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import Optional

from .common import READ_BYTES, log, new_hash

SYSTEM = "s3torchconnector"
REGION = "us-east-1"


def s3torch_missing(backend) -> Optional[str]:
    """Why s3torchconnector cannot be measured here (its column's cells), or None."""
    if backend.name != "s3":
        return "S3 only"
    if importlib.util.find_spec("s3torchconnector") is None:
        return "not installed"
    return None


def s3torch_version() -> str:
    try:
        return importlib.metadata.version("s3torchconnector")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def read_s3reader_streaming(reader, buf: bytearray) -> tuple:
    """A whole object through an S3Reader with 1 MiB readinto's: (size, digest)."""
    h, n, view = new_hash(), 0, memoryview(buf)
    while True:
        k = reader.readinto(buf)
        if not k:
            return n, h.intdigest()
        h.update(view[:k])
        n += k


class S3TorchConnector:
    """s3torchconnector's runs, mixed into `Bench` (runner.py): the workloads (W1, W2, W5)
    call these for system SYSTEM."""

    def s3torch_systems(self) -> tuple:
        """(SYSTEM,) where it can run, else () (self.s3torch_note says why: the table's cells)."""
        if self.s3torch_note is None and not self.s3torch_logged:
            self.s3torch_logged = True
            log(f"  s3torchconnector {s3torch_version()}: S3ClientConfig(force_path_style=True), region {REGION}")
        elif self.s3torch_note is not None and not self.s3torch_logged:
            self.s3torch_logged = True
            log(f"  s3torchconnector: {self.s3torch_note} (pip install s3torchconnector): its column says so")
        return () if self.s3torch_note else (SYSTEM,)

    def _s3torch_credentials(self) -> None:
        server = self.backend.server
        os.environ["AWS_ACCESS_KEY_ID"] = server.access_key
        os.environ["AWS_SECRET_ACCESS_KEY"] = server.secret_key
        os.environ.pop("AWS_SESSION_TOKEN", None)
        os.environ.pop("AWS_PROFILE", None)

    def _s3torch_config(self):
        from s3torchconnector import S3ClientConfig

        self._s3torch_credentials()
        return S3ClientConfig(force_path_style=True)

    def s3torch_client(self):
        """A new S3Client on the proxy (its native client is made at the first request)."""
        from s3torchconnector._s3client import S3Client

        return S3Client(REGION, endpoint=self.backend.endpoint_url, s3client_config=self._s3torch_config())

    def s3torch_dataset(self, prefix: str):
        """A new S3MapDataset over s3://BUCKET/PREFIX (listed at its first len())."""
        from s3torchconnector import S3MapDataset

        return S3MapDataset.from_prefix(
            f"s3://{self.ds.bucket}/{prefix}",
            region=REGION,
            endpoint=self.backend.endpoint_url,
            s3client_config=self._s3torch_config(),
        )

    def s3torch_stream(self, client, key: str, buf: bytearray) -> tuple:
        """(size, digest) of a whole object through the sequential reader."""
        from s3torchconnector import S3ReaderConstructor

        reader = client.get_object(self.ds.bucket, key, reader_constructor=S3ReaderConstructor.sequential())
        try:
            return read_s3reader_streaming(reader, buf)
        finally:
            reader.close()

    def s3torch_get(self, client, key: str) -> bytes:
        """A whole small object: one GET (no size is known, so no HEAD)."""
        reader = client.get_object(self.ds.bucket, key)
        try:
            return reader.read()
        finally:
            reader.close()

    @staticmethod
    def s3torch_read_buffer() -> bytearray:
        return bytearray(READ_BYTES)

    def s3torch_rows(self) -> dict:
        """--json: why it did not run (or its version), and bucketfs / s3torchconnector per row."""
        ratios = {}
        for key, row in self.rows.items():
            b, t = row.values.get("bucketfs"), row.values.get(SYSTEM)
            if b is not None and t:
                ratios[key] = round(b / t, 3)
        return {
            "note": self.s3torch_note,
            "version": None if self.s3torch_note else s3torch_version(),
            "bucketfs_over_s3torchconnector": ratios,
        }
