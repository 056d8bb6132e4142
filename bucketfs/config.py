"""Configuration: one frozen dataclass built by the CLI and read by every layer.

Invariant: this module imports nothing from bucketfs. Every field name carries its
unit (`_bytes`, `_s`, `_count`) so a reader never has to guess.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

MiB = 1024 * 1024
GiB = 1024 * MiB

SCHEMES = ("s3", "gs")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]$")


@dataclasses.dataclass(frozen=True)
class BucketURL:
    """`scheme://bucket[/prefix]`; `prefix` is '' or ends with '/'."""

    scheme: str
    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}"


def parse_bucket_url(url: str) -> BucketURL:
    """Parse `s3://bucket/prefix` or `gs://bucket/prefix`; raise ValueError with the reason."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"{url!r} is not a bucket URL (expected s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX])")
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r} in {url!r} (supported: s3://, gs://)")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket):
        raise ValueError(f"{bucket!r} is not a valid bucket name")
    # One trailing slash is the usual spelling of a prefix; any other empty component
    # ('//double', 'a//b', 'a//') names keys no mount can show: refuse them all alike.
    parts = prefix.split("/")
    if prefix.endswith("/"):
        parts.pop()
    if prefix and any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"prefix {prefix!r} has an empty, '.' or '..' component")
    prefix = "/".join(parts)
    return BucketURL(scheme, bucket, prefix + "/" if prefix else "")


DEFAULT_SHARD_GLOBS = ("*.tar", "*.tar.gz", "*.tgz", "*.tar.zst")
DEFAULT_METRICS_ADDRESS = "127.0.0.1"  # counters name buckets and prefixes: not for the network unless asked


@dataclasses.dataclass(frozen=True)
class Config:
    url: BucketURL
    mountpoint: str
    # The URL as the user wrote it: the mount's source in /proc/mounts, which mount(8)
    # compares with fstab's first field to tell whether a line is mounted already.
    source: str = ""

    # Backend access.
    endpoint_url: Optional[str] = None
    region: Optional[str] = None
    profile: Optional[str] = None
    no_sign_request: bool = False
    key_file: Optional[str] = None  # GCS service-account JSON
    path_style: bool = True  # path-style addressing works on every S3-compatible store
    max_connections_count: int = 32  # threads and pooled connections for blocking SDK calls
    retry_attempts_count: int = 5  # total attempts for a transient failure before EIO
    retry_base_delay_s: float = 0.1
    retry_max_delay_s: float = 5.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 30.0

    # Presentation.
    allow_other: bool = False
    uid: Optional[int] = None
    gid: Optional[int] = None
    file_mode: int = 0o444
    dir_mode: int = 0o555

    # Metadata cache: math.inf means listings never expire (immutable training data).
    metadata_ttl_s: float = math.inf
    negative_ttl_s: float = math.inf
    list_ahead_count: int = 16  # concurrent subdirectory listings ahead of a walk: 50 classes in ~3 round trips

    # Data path.
    max_memory_bytes: int = 1 * GiB
    block_size_bytes: int = 64 * 1024  # random-read granularity; small keeps W4 overfetch < 4x
    small_file_bytes: int = 8 * MiB  # whole-object GET at open below this size
    part_size_bytes: int = 8 * MiB  # one ranged GET of a sequential stream
    readahead_initial_bytes: int = 1 * MiB
    # A part takes a round trip plus its transfer (~120 ms for 8 MiB at 100 MB/s with
    # 20 ms to first byte), so one reader's MB/s is at most its window / 120 ms: 64 MiB
    # capped it at ~530 MB/s. With 128 MiB, and the window running on through the
    # next shards: 435-514 -> 531-636 MB/s with one reader (paired ad hoc runs). The
    # memory budget still bounds the total.
    readahead_max_bytes: int = 128 * MiB
    # A shard is read to its end: start wide, so one reader has eight 8 MiB GETs in
    # flight at once (one connection gives ~100 MB/s); streams starting beside others share
    # it, and each doubles towards the max while its reader waits for parts.
    shard_readahead_initial_bytes: int = 64 * MiB
    shard_globs: tuple = DEFAULT_SHARD_GLOBS
    # Local disk cache: off unless a directory is given.
    cache_dir: Optional[str] = None
    cache_size_bytes: int = 10 * GiB

    # Process.
    foreground: bool = False
    log_level: str = "INFO"
    log_file: Optional[str] = None
    metrics_port: Optional[int] = None
    metrics_address: str = DEFAULT_METRICS_ADDRESS

    @property
    def immutable(self) -> bool:
        return math.isinf(self.metadata_ttl_s)
