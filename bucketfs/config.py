"""Configuration: one frozen dataclass built by the CLI and read by every layer.

Invariant: this module imports nothing from bucketfs. Every field name carries its
unit (`_bytes`, `_s`, `_count`) so a reader never has to guess.

Each option of `bucketfs mount` is written once, here, on its field: default, unit,
limits and help text (an `Option` in the field's metadata). The CLI's parser, the
fstab helper and docs/configuration.md are derived from these, and `Config` checks
itself against them when built, from argv or in code: a value or a combination the
daemon cannot work with raises ValueError with the one line the CLI prints.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
import os
import re
import urllib.parse
from typing import Any, Optional

KiB = 1024
MiB = 1024 * KiB
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


def parse_object_url(url: str) -> tuple:
    """(scheme, bucket, key) of `s3://bucket/key` or `gs://bucket/key`, one object (a
    key not ending in '/'); raise ValueError with the reason."""
    scheme, sep, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"{url!r} is not an object URL (expected s3://BUCKET/KEY or gs://BUCKET/KEY)")
    if not _BUCKET_RE.match(bucket):
        raise ValueError(f"{bucket!r} is not a valid bucket name")
    if not key or key.endswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"{url!r} names no object (a key with no empty, '.' or '..' component, not ending in '/')")
    return scheme.lower(), bucket, key


def is_url(location: str) -> bool:
    """Whether a FILE-or-URL option names an object URL rather than a local file."""
    return "://" in location


DEFAULT_SHARD_GLOBS = ("*.tar", "*.tar.gz", "*.tgz", "*.tar.zst")
DEFAULT_METRICS_ADDRESS = "127.0.0.1"  # counters name buckets and prefixes: not for the network unless asked

# Limits. Below these a value is nonsense rather than a choice: a block or part smaller
# than a page costs one GET per 4 KiB read; a 64 KiB part keeps a stream's request count sane.
BLOCK_SIZE_MIN_BYTES = 4 * KiB
PART_SIZE_MIN_BYTES = 64 * KiB
SMALL_FILE_MIN_BYTES = 4 * KiB
# The budget must hold a default 8 MiB part beside the reads a caller waits on.
MAX_MEMORY_MIN_BYTES = 16 * MiB
CACHE_SIZE_MIN_BYTES = 1 * MiB
# Each connection is a worker thread: thousands would be threads, not throughput.
MAX_CONNECTIONS_MAX = 1024
FETCH_WORKERS_MAX = 64
LIST_AHEAD_MAX = 1024
FETCH_AHEAD_REQUESTS_MAX = 4096
RETRIES_MAX = 100
ID_MAX = 2**32 - 2  # (uid_t)-1 means "unchanged" to the kernel: not an owner
PORT_MAX = 65535
MODE_MAX = 0o7777

# What a value of each kind of option is, as --help and the docs name it.
KIND_METAVARS = {
    "size": "SIZE",
    "int": "N",
    "seconds": "S",
    "timeout": "S",
    "mode": "MODE",
    "path": "PATH",
    "ip": "ADDRESS",
    "url": "URL",
    "text": "NAME",
    "list": "LIST",
}
KINDS = frozenset(KIND_METAVARS) | {"flag", "choice"}


@dataclasses.dataclass(frozen=True)
class Option:
    """How one Config field is given to `bucketfs mount` and documented.

    `help` may name the limits as {range} (low..high) or {min}, and the default as
    {default}; without {default}, " (default X)" is appended. `default_text`: the
    default in words, where the value does not say it (None: "the mounting user").
    `details`: more than --help has room for, for docs/configuration.md only."""

    flag: str
    kind: str  # one of KINDS: what the value is, how it is parsed and checked
    group: str
    help: str
    metavar: Optional[str] = None  # (default: the kind's, KIND_METAVARS)
    low: Optional[int] = None
    high: Optional[int] = None
    choices: tuple = ()
    default_text: Optional[str] = None
    details: str = ""
    short: Optional[str] = None  # "-f"
    what: str = "a whole number"  # what an int is, for "'x' is not a whole number"

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        assert (self.kind == "choice") == bool(self.choices), self.flag

    @property
    def flags(self) -> tuple:
        return (self.short, self.flag) if self.short else (self.flag,)

    @property
    def takes_value(self) -> bool:
        return self.kind != "flag"

    @property
    def value_name(self) -> str:
        """What --help and the docs show after the flag ('' for a flag)."""
        if self.kind == "flag":
            return ""
        if self.kind == "choice":
            return self.metavar or "|".join(self.choices)
        return self.metavar or KIND_METAVARS[self.kind]

    def show(self, value: Any) -> str:
        """`value` as a user would write it: 1G, 0444, inf, 10, *.tar,*.tgz."""
        if value is None:
            return "none"
        if self.kind == "size":
            return human_bytes(value)
        if self.kind == "mode":
            return f"{value:04o}"
        if self.kind in ("seconds", "timeout"):
            return "inf" if value == math.inf else f"{value:g}"
        if self.kind == "list":
            return ",".join(value)
        if self.kind == "flag":
            return "on" if value else "off"
        return str(value)

    def default_shown(self, default: Any) -> str:
        return self.default_text if self.default_text is not None else self.show(default)

    def _fill(self, text: str, default: Any) -> str:
        low = self.show(self.low) if self.low is not None else ""
        high = self.show(self.high) if self.high is not None else ""
        return text.format(range=f"{low}..{high}", min=low, default=self.default_shown(default))

    def help_line(self, default: Any) -> str:
        """The help text with its limits and its default, as --help prints it."""
        text = self._fill(self.help, default)
        if "{default}" in self.help:
            return text
        shown = self.default_shown(default)
        return f"{text} (default{':' if ' ' in shown else ''} {shown})"

    def doc_line(self, default: Any) -> str:
        """The help text with its limits (the default has its own column) and the details."""
        text = self._fill(self.help, default)
        return f"{text}; {self.details}" if self.details else text

    def problem(self, value: Any, shown: str) -> Optional[str]:
        """Why `value` (written `shown`) is not a value of this option, or None."""
        kind = self.kind
        if value is None or kind in ("text", "path"):
            return None
        if kind == "flag":
            return None if isinstance(value, bool) else f"{shown} is not on or off"
        if kind in ("int", "size", "mode"):
            if not isinstance(value, int) or isinstance(value, bool):
                return f"{shown} is not {self.what}"
            if kind == "size":
                assert self.low is not None
                return f"{shown} is below the minimum of {human_bytes(self.low)}" if value < self.low else None
            if kind == "mode":
                return f"{shown} is outside 0..7777 (octal)" if not 0 <= value <= MODE_MAX else None
            assert self.low is not None and self.high is not None
            return f"{shown} is outside {self.low}..{self.high}" if not self.low <= value <= self.high else None
        if kind in ("seconds", "timeout"):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                return f"{shown} is not a number of seconds"
            if kind == "seconds":
                return f"{shown}: seconds must be >= 0 (or 'inf')" if value < 0 else None
            return f"{shown}: seconds must be > 0 and finite" if not 0 < value < math.inf else None
        if kind == "choice":
            return None if value in self.choices else f"{shown} is not one of {', '.join(self.choices)}"
        if kind == "ip":
            try:
                ipaddress.ip_address(value)
            except ValueError:
                return f"{shown} is not an IP address (examples: 127.0.0.1, 0.0.0.0, ::)"
            return None
        if kind == "url":
            return _url_problem(value, shown)
        if kind == "list":
            ok = isinstance(value, tuple) and all(isinstance(item, str) and item for item in value)
            return None if ok else f"{shown} is not a list of names"
        raise AssertionError(kind)


def human_bytes(n_bytes: int) -> str:
    """1073741824 -> '1G'; a size that is no whole multiple stays in bytes."""
    for unit, factor in (("T", 1024**4), ("G", GiB), ("M", MiB), ("K", KiB)):
        if n_bytes and n_bytes % factor == 0:
            return f"{n_bytes // factor}{unit}"
    return str(n_bytes)


def _url_problem(url: str, shown: str) -> Optional[str]:
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        return f"{shown} is not an http:// or https:// URL with a host"
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        return f"{shown} is not an http:// or https:// URL with a host"
    if parts.netloc.endswith(":"):  # urlsplit reads 'host:' as no port; botocore then fails to connect (exit 5)
        return f"{shown} has an empty port (write host:PORT, or no ':')"
    return None


def option(default: Any, **spec: Any) -> Any:
    """A Config field given on the command line: its default and its `Option`."""
    return dataclasses.field(default=default, metadata={"option": Option(**spec)})


STORE, PRESENTATION, CACHING, PROCESS = "store access", "presentation", "caching and prefetch", "process"
GROUPS = (STORE, PRESENTATION, CACHING, PROCESS)
KERNEL_DIR_CACHE_MODES = ("auto", "off")
FETCH_AHEAD_MODES = ("auto", "off")


@dataclasses.dataclass(frozen=True)
class Config:
    url: BucketURL
    mountpoint: str
    # The URL as the user wrote it: the mount's source in /proc/mounts, which mount(8)
    # compares with fstab's first field to tell whether a line is mounted already.
    source: str = ""

    # Backend access.
    endpoint_url: Optional[str] = option(
        None,
        flag="--endpoint-url",
        kind="url",
        group=STORE,
        default_text="AWS / Google",
        help="S3-compatible endpoint (MinIO, AIStore, Ceph) or a GCS emulator or private endpoint",
    )
    region: Optional[str] = option(
        None,
        flag="--region",
        kind="text",
        metavar="REGION",
        group=STORE,
        default_text="from the AWS profile or environment",
        help="S3 region (s3:// only)",
    )
    profile: Optional[str] = option(
        None,
        flag="--profile",
        kind="text",
        group=STORE,
        default_text="the standard credential chain",
        help="AWS credentials profile (s3:// only)",
    )
    no_sign_request: bool = option(
        False,
        flag="--no-sign-request",
        kind="flag",
        group=STORE,
        help="anonymous access to a public bucket (S3 and GCS; not with --key-file)",
    )
    key_file: Optional[str] = option(  # GCS service-account JSON
        None,
        flag="--key-file",
        kind="path",
        group=STORE,
        default_text="Application Default Credentials",
        help="GCS service-account JSON key (gs:// only)",
    )
    # None: path-style with --endpoint-url (it works on every S3-compatible store), virtual otherwise.
    addressing_style: Optional[str] = option(
        None,
        flag="--addressing-style",
        kind="choice",
        choices=("path", "virtual"),
        group=STORE,
        default_text="path with --endpoint-url, virtual otherwise",
        help="S3 addressing (s3:// only)",
    )
    max_connections_count: int = option(  # threads and pooled connections for blocking SDK calls
        32,
        flag="--max-connections",
        kind="int",
        low=1,
        high=MAX_CONNECTIONS_MAX,
        group=STORE,
        help="parallel requests and pooled connections, {range}",
        details="when all are busy, requests a reader waits for go first",
    )
    fetch_workers_count: int = option(
        0,
        flag="--fetch-workers",
        kind="int",
        low=0,
        high=FETCH_WORKERS_MAX,
        group=STORE,
        help="processes that run the small GETs (libcurl, signing, the whole-object checksum) on other cores, "
        "{range}; 0: a thread of the daemon (docs/design.md#fetch-workers: no gain measured yet)",
        details="bodies stream into the daemon's buffers (the memory budget covers them); a worker that dies "
        "is replaced and its GETs retried; takes effect where pycurl is installed",
    )
    retry_attempts_count: int = option(  # total attempts for a transient failure before EIO
        5,
        flag="--retries",
        kind="int",
        low=1,
        high=RETRIES_MAX,
        group=STORE,
        help="attempts for throttling, 5xx, resets and timeouts before EIO, {range}",
        details="throttling is 503 SlowDown and 429; attempts are spaced by jittered exponential backoff",
    )
    retry_base_delay_s: float = 0.1
    retry_max_delay_s: float = 5.0
    connect_timeout_s: float = option(
        10.0, flag="--connect-timeout", kind="timeout", group=STORE, help="seconds to connect, > 0 and finite"
    )
    read_timeout_s: float = option(
        30.0,
        flag="--read-timeout",
        kind="timeout",
        group=STORE,
        help="seconds a response may stall, > 0 and finite",
        details="no read waits forever: a body that keeps trickling in is also cut, at the read timeout "
        "plus its size at 64 KiB/s, and retried",
    )

    # Presentation.
    allow_other: bool = option(
        False,
        flag="--allow-other",
        kind="flag",
        group=PRESENTATION,
        help="let other users access the mount (needs user_allow_other in /etc/fuse.conf for non-root)",
        details="without it in fuse.conf, a user other than root gets exit 2",
    )
    uid: Optional[int] = option(
        None,
        flag="--uid",
        kind="int",
        low=0,
        high=ID_MAX,
        group=PRESENTATION,
        default_text="the mounting user",
        help="owner of every file, {range}; another user than the one mounting needs --allow-other",
        details="FUSE lets no one else into the mount without it (else exit 2)",
    )
    gid: Optional[int] = option(
        None,
        flag="--gid",
        kind="int",
        low=0,
        high=ID_MAX,
        group=PRESENTATION,
        default_text="the mounting user's group",
        help="group of every file, {range}; another group than the mounting user's needs --allow-other",
    )
    file_mode: int = option(
        0o444, flag="--file-mode", kind="mode", group=PRESENTATION, help="permission bits of files, octal 0..7777"
    )
    dir_mode: int = option(
        0o555, flag="--dir-mode", kind="mode", group=PRESENTATION, help="permission bits of directories, octal 0..7777"
    )

    # Metadata cache: math.inf means listings never expire (immutable training data).
    metadata_ttl_s: float = option(
        math.inf,
        flag="--metadata-ttl",
        kind="seconds",
        group=CACHING,
        help="seconds listings and attributes stay valid, >= 0; inf for data that does not change while mounted",
    )
    # inf: the metadata TTL (a missing name is looked for again when its listing expires).
    negative_ttl_s: float = option(
        math.inf,
        flag="--negative-ttl",
        kind="seconds",
        group=CACHING,
        default_text="the metadata TTL",
        help="seconds a missing name stays missing; needs --metadata-ttl, and at most its value",
        details="a miss in a listing older than this lists the directory again; refused without "
        "--metadata-ttl, where listings are kept for the mount's life, and above it, where the listing "
        "is fetched again anyway",
    )

    # A listing index (bucketfs index build): the namespace comes from it, not LISTs.
    index: Optional[str] = option(
        None,
        flag="--index",
        kind="path",
        metavar="FILE-or-URL",
        group=CACHING,
        default_text="off: directories are listed",
        help="take every listing from this index (bucketfs index build): a file, or s3://BUCKET/KEY or "
        "gs://BUCKET/KEY on the mount's store; the mount then sends no LIST request",
        details="it must be the index of this very URL (else exit 13), intact (else exit 11) and of a format "
        "version this bucketfs reads (else exit 12); reads stay pinned to the versions it names (a changed "
        "object gives ESTALE); with --metadata-ttl its listings count as listed when the mount started and "
        "are listed again once older than the TTL",
    )

    # Data path.
    max_memory_bytes: int = option(
        1 * GiB,
        flag="--max-memory",
        kind="size",
        low=MAX_MEMORY_MIN_BYTES,
        group=CACHING,
        help="one budget for listings (560 B per entry), the disk cache's index (~590 B per object), "
        "the block cache and all prefetch buffers; at least {min}",
    )
    small_file_bytes: int = option(  # whole-object GET at open below this size
        8 * MiB,
        flag="--small-file-bytes",
        kind="size",
        low=SMALL_FILE_MIN_BYTES,
        group=CACHING,
        help="files up to this size are fetched whole, in one GET, at open; {min} up to half of --max-memory",
    )
    block_size_bytes: int = option(  # random-read granularity; small keeps W4 overfetch < 4x
        64 * KiB,
        flag="--block-size",
        kind="size",
        low=BLOCK_SIZE_MIN_BYTES,
        group=CACHING,
        help="block-cache block, the unit of random reads; {min} up to half of --max-memory",
    )
    part_size_bytes: int = option(  # one ranged GET of a sequential stream
        8 * MiB,
        flag="--part-size",
        kind="size",
        low=PART_SIZE_MIN_BYTES,
        group=CACHING,
        help="size of one ranged GET of sequential read-ahead; {min} up to half of --max-memory",
    )
    readahead_initial_bytes: int = 1 * MiB
    # A part takes a round trip plus its transfer (~120 ms for 8 MiB at 100 MB/s with
    # 20 ms to first byte), so one reader's MB/s is at most its window / 120 ms: 64 MiB
    # capped it at ~530 MB/s. With 128 MiB, and the window running on through the
    # next shards: 435-514 -> 531-636 MB/s with one reader (paired ad hoc runs). The
    # memory budget still bounds the total. Raised to part_size_bytes if below.
    readahead_max_bytes: int = option(
        128 * MiB,
        flag="--readahead-max",
        kind="size",
        low=PART_SIZE_MIN_BYTES,
        group=CACHING,
        help="largest read-ahead window of one sequential reader; at least {min}, raised to --part-size if below",
    )
    # A shard is read to its end: start wide, so one reader has eight 8 MiB GETs in
    # flight at once (one connection gives ~100 MB/s); streams starting beside others share
    # it, and each doubles towards the max while its reader waits for parts.
    shard_readahead_initial_bytes: int = 64 * MiB
    shard_globs: tuple = option(
        DEFAULT_SHARD_GLOBS,
        flag="--shard-globs",
        kind="list",
        metavar="GLOBS",
        group=CACHING,
        help="comma-separated names read as shards: wide read-ahead, next shard warmed",
        details="in /etc/fstab, separated by ':' (shard_globs=*.tar:*.tgz)",
    )
    # Local disk cache: off unless a directory is given.
    cache_dir: Optional[str] = option(
        None,
        flag="--cache-dir",
        kind="path",
        metavar="DIR",
        group=CACHING,
        default_text="off",
        help="keep fetched bytes on this local disk too, for epochs the page cache cannot hold and for later mounts",
        details="created if missing; one subdirectory per bucket URL and endpoint, kept at exit and shared by "
        "every mount and warm of them on the host; a full disk at start: the mount runs without writing to it",
    )
    cache_size_bytes: int = option(
        10 * GiB,
        flag="--cache-size",
        kind="size",
        low=CACHE_SIZE_MIN_BYTES,
        group=CACHING,
        help="most disk space --cache-dir may take, as du counts it; at least {min}",
        details="each file rounded up to the file system's block (4 KiB), the journal and the directories "
        "count; slack: a second journal copy while it is rewritten; mounts sharing the directory are bounded "
        "together. A scan-resistant policy picks what goes (docs/design.md)",
    )
    list_ahead_count: int = option(  # concurrent subdirectory listings ahead of a walk: 50 classes in ~3 round trips
        16,
        flag="--list-ahead",
        kind="int",
        low=0,
        high=LIST_AHEAD_MAX,
        group=CACHING,
        help="subdirectory listings run concurrently ahead of a directory walk, {range} (default {default}; 0 disables)",
    )
    # A shuffled epoch over small files has one request in flight per loader worker;
    # a parallel copier keeps hundreds (core/fetchahead.py).
    fetch_ahead: str = option(
        "auto",
        flag="--fetch-ahead",
        kind="choice",
        choices=FETCH_AHEAD_MODES,
        group=CACHING,
        help="auto: once small files of a tree are opened in an order that is not the listing's (a shuffled "
        "epoch), the rest of the tree is fetched ahead of the reader, with many GETs in flight, into memory "
        "the readers do not need; off: only what is read is fetched",
        details="only in the immutable default (not with --metadata-ttl); each file at most once per pass, "
        "none already cached; a file fetched ahead is kept until it is read or the pass stops, within half "
        "of --max-memory; with --cache-dir the fetched files are stored on disk too, no faster than the disk "
        "takes them; a tree read in part per epoch (one node's share of a DistributedSampler) is not fetched "
        "ahead after its first epoch: use off on nodes that read a share",
    )
    fetch_ahead_requests_count: int = option(
        256,
        flag="--fetch-ahead-requests",
        kind="int",
        low=1,
        high=FETCH_AHEAD_REQUESTS_MAX,
        group=CACHING,
        help="GETs fetch-ahead keeps in flight, on top of --max-connections, {range}",
        details="requests a reader waits for never queue behind them; without pycurl (GETs on worker "
        "threads) fetch-ahead shares --max-connections instead",
    )
    # A cold shuffled epoch's files, fetched ahead into the kernel's page cache by other
    # processes, cost the daemon one GETATTR each, not a GET's work and the READs
    # (core/fetchahead.py; docs/design.md#fetch-ahead-workers).
    fetch_ahead_workers_count: int = option(
        1,
        flag="--fetch-ahead-workers",
        kind="int",
        low=0,
        high=FETCH_WORKERS_MAX,
        group=CACHING,
        help="processes that fetch a pass's files (--fetch-ahead) straight into the kernel's page cache, "
        "{range}; 0: into the daemon's memory",
        details="S3 and S3-compatible stores, where pycurl is installed, without --cache-dir; each file is "
        "checked (whole, the pinned version, the ETag's MD5) before the kernel gets it; the memory budget "
        "covers the bodies being fetched, and the files waiting for the loader stay within --fetch-ahead-window. "
        "The workers receive the files into shared memory the daemon keeps as its copy, up to half of --max-memory "
        "(the first memory given back to anything else), so an epoch after the kernel dropped its page cache "
        "(memory pressure) reads what it kept from there",
    )
    # A random-order loader finds a file pushed with odds of about the pushed files it has
    # yet to open over the files it has yet to open: that window, in the kernel's page
    # cache (not the daemon's memory), is sized by the memory the machine has free.
    fetch_ahead_window_bytes: int = option(
        0,
        flag="--fetch-ahead-window",
        kind="size",
        low=0,
        group=CACHING,
        default_text="auto",
        help="how far --fetch-ahead-workers run ahead of the loader: the pushed files it has not opened yet; "
        "0: a quarter of the memory the kernel reports available when a pass starts (less under a container's "
        "memory limit), at least half of --max-memory",
        details="those files are the kernel's page cache, which it may drop under memory pressure (a file "
        "dropped is read from the daemon's kept copy, else fetched again); the daemon's own memory stays within "
        "--max-memory. Larger, a loader reading a data set many times that size in random order finds more of "
        "its files pushed",
    )
    # The kernel's directory cache needs writes into pyfuse3's and libfuse's private
    # memory (fuse/dircache.py, fuse/noopendir.py): "off" makes none.
    kernel_dir_cache: str = option(
        "auto",
        flag="--kernel-dir-cache",
        kind="choice",
        choices=KERNEL_DIR_CACHE_MODES,
        group=CACHING,
        help="auto: in the immutable default the kernel keeps directory listings, where pyfuse3 and libfuse "
        "are versions whose private memory layout bucketfs knows (docs/kernel.md); off: nothing is written "
        "into pyfuse3's or libfuse's private memory",
        details="with off, or with --metadata-ttl, every readdir() is answered by the daemon (from its own "
        "cache of the listing) and every opendir() costs an OPENDIR and a RELEASEDIR round trip",
    )

    # Process.
    foreground: bool = option(
        False,
        flag="--foreground",
        short="-f",
        kind="flag",
        group=PROCESS,
        help="stay attached and log to stderr (or --log-file) instead of daemonising once mounted",
    )
    log_level: str = option(
        "INFO",
        flag="--log-level",
        kind="choice",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        group=PROCESS,
        help="log level",
    )
    log_file: Optional[str] = option(
        None,
        flag="--log-file",
        kind="path",
        group=PROCESS,
        default_text="syslog; stderr with --foreground",
        help="write the log to this file, daemonised or with --foreground; a file rotated away is reopened by itself",
        details="under systemd too; opened before mounting (an unwritable one is exit 2)",
    )
    metrics_port: Optional[int] = option(
        None,
        flag="--metrics-port",
        kind="int",
        low=1,
        high=PORT_MAX,
        what="a port number",
        group=PROCESS,
        metavar="PORT",
        default_text="off",
        help="serve Prometheus metrics on http://ADDRESS:PORT/metrics, {range}",
        details="bound before mounting",
    )
    metrics_address: str = option(
        DEFAULT_METRICS_ADDRESS,
        flag="--metrics-address",
        kind="ip",
        group=PROCESS,
        help="the local IP address --metrics-port listens on: 0.0.0.0 (or ::) for every interface, so "
        "Prometheus on another host can scrape; needs --metrics-port",
        details=f"an IP address, not a name; the default, {DEFAULT_METRICS_ADDRESS}, is this host only",
    )

    def __post_init__(self) -> None:
        for field, opt in options():
            value = getattr(self, field.name)
            if opt.kind == "list" and isinstance(value, list):
                value = tuple(value)
                object.__setattr__(self, field.name, value)
            shown = repr(value) if isinstance(value, str) else opt.show(value)
            problem = opt.problem(value, shown)
            if problem:
                raise ValueError(f"{opt.flag} {problem}")
        for name in ("retry_base_delay_s", "retry_max_delay_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("readahead_initial_bytes", "shard_readahead_initial_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        self._check_ttls()
        self._check_index()
        self._check_store_options()
        self._check_cross_limits()
        self._check_owner_can_enter()
        if self.metrics_address != DEFAULT_METRICS_ADDRESS and self.metrics_port is None:
            raise ValueError("--metrics-address needs --metrics-port")
        # A window smaller than one part would still fetch a whole part.
        object.__setattr__(self, "readahead_max_bytes", max(self.readahead_max_bytes, self.part_size_bytes))

    def _check_ttls(self) -> None:
        if math.isinf(self.negative_ttl_s):
            return  # (the default: the metadata TTL)
        if math.isinf(self.metadata_ttl_s):
            # Silently ignoring it would leave a user waiting for names that never appear.
            raise ValueError(
                "--negative-ttl needs --metadata-ttl: without it every listing is kept for the "
                "mount's life, so a missing name stays missing"
            )
        if self.negative_ttl_s > self.metadata_ttl_s:
            raise ValueError(
                f"--negative-ttl {self.negative_ttl_s:g} is above --metadata-ttl {self.metadata_ttl_s:g}: "
                "a listing is fetched again after the metadata TTL anyway, so it would mean nothing"
            )

    def _check_index(self) -> None:
        """An --index URL names one object of the mount's own store (its options reach it)."""
        if self.index is None:
            return
        if not self.index:
            raise ValueError("--index '' names no file or object")
        if not is_url(self.index):
            return
        try:
            scheme, _bucket, _key = parse_object_url(self.index)
        except ValueError as exc:
            raise ValueError(f"--index {exc}") from None
        if scheme != self.url.scheme:
            raise ValueError(
                f"--index {self.index} is on another store than {self.source or self.url} (keep the index on the "
                "mount's store, or in a file)"
            )

    def _check_store_options(self) -> None:
        """An option for the other store would be silently ignored: the user would mount
        with other credentials, region or addressing than they asked for."""
        url = self.source or str(self.url)
        if self.url.scheme == "gs":
            for flag, value in (
                ("--profile", self.profile),
                ("--region", self.region),
                ("--addressing-style", self.addressing_style),
            ):
                if value is not None:
                    raise ValueError(
                        f"{flag} is an S3 option and {url} is a GCS URL "
                        "(GCS: --key-file, or Application Default Credentials)"
                    )
        elif self.key_file is not None:
            raise ValueError(
                f"--key-file is a GCS option and {url} is an S3 URL (S3: --profile, or the AWS credential chain)"
            )
        if self.key_file is not None and self.no_sign_request:
            raise ValueError(
                "--key-file and --no-sign-request contradict each other: a key signs requests, "
                "--no-sign-request sends them anonymously"
            )

    def _check_cross_limits(self) -> None:
        """Buffers of one request must fit the budget twice over: a bigger one is let
        through alone past the budget (so a reader never deadlocks), i.e. unbounded RSS."""
        half_budget_bytes = self.max_memory_bytes // 2
        for flag, value_bytes in (
            ("--block-size", self.block_size_bytes),
            ("--part-size", self.part_size_bytes),
            ("--small-file-bytes", self.small_file_bytes),
        ):
            if value_bytes > half_budget_bytes:
                raise ValueError(
                    f"{flag} {human_bytes(value_bytes)} is more than half of --max-memory "
                    f"{human_bytes(self.max_memory_bytes)}"
                )

    def _check_owner_can_enter(self) -> None:
        """FUSE lets only the mounting user into a mount without allow_other: files given
        to another owner or group would show them as owners and deny them every read."""
        if self.allow_other:
            return
        for flag, value, mine in (("--uid", self.uid, os.geteuid()), ("--gid", self.gid, os.getegid())):
            if value is not None and value != mine:
                raise ValueError(
                    f"{flag} {value} names another user than the one mounting, and FUSE lets no other "
                    "user into the mount without --allow-other: add --allow-other"
                )

    @property
    def immutable(self) -> bool:
        return math.isinf(self.metadata_ttl_s)

    @property
    def path_style(self) -> bool:
        """S3 path-style addressing: asked for, or by default with --endpoint-url."""
        return self.addressing_style == "path" if self.addressing_style else bool(self.endpoint_url)


@functools.cache
def options() -> tuple:
    """[(dataclasses.Field, Option)] of every Config field given on the command line, in --help's order."""
    found = [(field, field.metadata["option"]) for field in dataclasses.fields(Config) if "option" in field.metadata]
    return tuple(sorted(found, key=lambda pair: GROUPS.index(pair[1].group)))  # (stable: field order within a group)
