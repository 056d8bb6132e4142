"""Command line: argv -> Config, pre-flight checks, exit codes (daemon.py runs the mount).

Invariants: a user error prints ONE line on stderr (`bucketfs: ...`) and exits with
its distinct code (bucketfs.errors.EXIT_*), never a traceback; `bucketfs mount`
returns only once the mount answers (or has failed and left nothing mounted).
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import math
import os
import re
import sys
import urllib.parse

from bucketfs import __version__, backends, errors
from bucketfs.app import daemon, mountpoints
from bucketfs.config import DEFAULT_METRICS_ADDRESS, DEFAULT_SHARD_GLOBS, Config, parse_bucket_url
from bucketfs.diskcache.directory import check_cache_dir

# A number, then K/M/G/T (binary; KiB spelled out too) or B or nothing.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i|ib)?|b)?\s*$", re.I)
# KB/MB/GB/TB: decimal to disk vendors and SI, binary to JEDEC and many tools. A guess
# either way is off by 7% at G: refused instead.
_AMBIGUOUS_SIZE_RE = re.compile(r"^\s*\d+(?:\.\d+)?\s*[kmgt]b\s*$", re.I)
SIZE_HELP = ("SIZE is a number of bytes, or a number with K, M, G or T (binary: 1K = 1024 bytes; KiB, MiB, GiB, "
             "TiB also), decimals allowed with a suffix (1.5G); KB, MB, GB and TB are refused as ambiguous.")


KiB, MiB = 1024, 1024 * 1024
# Below these a value is nonsense rather than a choice: a block or part smaller than a
# page costs one GET per 4 KiB read; a 64 KiB part keeps a stream's request count sane.
BLOCK_SIZE_MIN_BYTES = 4 * KiB
PART_SIZE_MIN_BYTES = 64 * KiB
SMALL_FILE_MIN_BYTES = 4 * KiB
# The budget must hold a default 8 MiB part beside the reads a caller waits on.
MAX_MEMORY_MIN_BYTES = 16 * MiB
CACHE_SIZE_MIN_BYTES = 1 * MiB
# Each connection is a worker thread: thousands would be threads, not throughput.
MAX_CONNECTIONS_MAX = 1024
LIST_AHEAD_MAX = 1024
RETRIES_MAX = 100
ID_MAX = 2**32 - 2  # (uid_t)-1 means "unchanged" to the kernel: not an owner
PORT_MAX = 65535
MODE_MAX = 0o7777


def parse_size(text: str) -> int:
    """'64M', '1GiB', '1.5G', '512k', '1048576' -> bytes (binary multiples, rounded down)."""
    if _AMBIGUOUS_SIZE_RE.match(text):
        unit = text.strip()[-2].upper()
        raise argparse.ArgumentTypeError(f"{text!r} is ambiguous (decimal or binary?): sizes here are binary, "
                                         f"write {unit} or {unit}iB (1{unit} = {1024 ** ' KMGT'.index(unit):,} bytes)")
    m = _SIZE_RE.match(text)
    if not m or ("." in m.group(1) and not m.group(2)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 1048576, 512K, 64M, 1.5G, 2T)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))


def _human_bytes(n_bytes: int) -> str:
    for unit, factor in (("G", 1024**3), ("M", MiB), ("K", KiB)):
        if n_bytes % factor == 0:
            return f"{n_bytes // factor}{unit}"
    return str(n_bytes)


def size_at_least(min_bytes: int):
    """An argparse type: a size of at least `min_bytes` (0 would break the daemon)."""
    def parse(text: str) -> int:
        value = parse_size(text)
        if value < min_bytes:
            raise argparse.ArgumentTypeError(f"{text!r} is below the minimum of {_human_bytes(min_bytes)}")
        return value
    return parse


def int_between(low: int, high: int, what: str = "a whole number"):
    """An argparse type: an integer in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is outside {low}..{high}")
        return value
    return parse


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
    return value


def parse_seconds(text: str) -> float:
    """A TTL: >= 0 seconds, or 'inf'."""
    if text.lower() in ("inf", "forever", "never"):
        return math.inf
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be >= 0 (or 'inf')")
    return value


def parse_timeout(text: str) -> float:
    """A network timeout: finite and > 0 (0 fails every request, inf hangs a reader)."""
    value = _float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be > 0 and finite")
    return value


def ip_address(text: str) -> str:
    """An IPv4 or IPv6 address to listen on (a name could resolve to several, or none)."""
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address (examples: 127.0.0.1, 0.0.0.0, ::)") from None


def parse_mode(text: str) -> int:
    try:
        value = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 0444") from None
    if not 0 <= value <= MODE_MAX:
        # Masking would turn -1 into 0o7777 plus a file-type bit: refuse instead.
        raise argparse.ArgumentTypeError(f"{text!r} is outside 0..7777 (octal)")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # self.prog is "bucketfs" or "bucketfs mount": the command to ask for help.
        self.exit(errors.EXIT_USAGE, f"bucketfs: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="bucketfs", description="Mount an S3 or GCS bucket prefix read-only as a fast local directory.")
    parser.add_argument("--version", action="version", version=f"bucketfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    m = sub.add_parser("mount", help="mount URL on MOUNTPOINT", description="Mount s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX] read-only on MOUNTPOINT. Returns once the mount answers.", epilog=SIZE_HELP)
    m.add_argument("url", help="s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX]")
    m.add_argument("mountpoint", help="an existing empty directory")
    g = m.add_argument_group("store access")
    g.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, AIStore, Ceph) or a GCS emulator/private endpoint")
    g.add_argument("--region", help="S3 region (default: from the AWS profile or environment)")
    g.add_argument("--profile", help="AWS credentials profile (default: the standard credential chain)")
    g.add_argument("--no-sign-request", action="store_true", help="anonymous access to a public bucket (S3 and GCS)")
    g.add_argument("--key-file", help="GCS service-account JSON key (default: Application Default Credentials)")
    g.add_argument("--addressing-style", choices=("path", "virtual"), help="S3 addressing (default: path with --endpoint-url, virtual otherwise)")
    g.add_argument("--max-connections", type=int_between(1, MAX_CONNECTIONS_MAX), default=32, metavar="N", help=f"parallel requests and pooled connections, 1..{MAX_CONNECTIONS_MAX} (default 32)")
    g.add_argument("--retries", type=int_between(1, RETRIES_MAX), default=5, metavar="N", help=f"attempts for throttling, 5xx, resets and timeouts before EIO, 1..{RETRIES_MAX} (default 5)")
    g.add_argument("--connect-timeout", type=parse_timeout, default=10.0, metavar="S", help="seconds to connect, > 0 (default 10)")
    g.add_argument("--read-timeout", type=parse_timeout, default=30.0, metavar="S", help="seconds a response may stall, > 0 (default 30)")
    g = m.add_argument_group("presentation")
    g.add_argument("--allow-other", action="store_true", help="let other users access the mount (needs user_allow_other in /etc/fuse.conf for non-root)")
    g.add_argument("--uid", type=int_between(0, ID_MAX), help=f"owner of every file, 0..{ID_MAX}; another user than the one mounting needs --allow-other (default: the mounting user)")
    g.add_argument("--gid", type=int_between(0, ID_MAX), help=f"group of every file, 0..{ID_MAX}; another group than the mounting user's needs --allow-other (default: the mounting user's group)")
    g.add_argument("--file-mode", type=parse_mode, default=0o444, help="permission bits of files, octal 0..7777 (default 0444)")
    g.add_argument("--dir-mode", type=parse_mode, default=0o555, help="permission bits of directories, octal 0..7777 (default 0555)")
    g = m.add_argument_group("caching and prefetch")
    g.add_argument("--metadata-ttl", type=parse_seconds, default=math.inf, metavar="S", help="seconds listings and attributes stay valid; 'inf' (default) for data that does not change while mounted")
    g.add_argument("--negative-ttl", type=parse_seconds, default=None, metavar="S", help="seconds a missing name stays missing; needs --metadata-ttl, and at most its value (default: the metadata TTL)")
    g.add_argument("--max-memory", type=size_at_least(MAX_MEMORY_MIN_BYTES), default=parse_size("1G"), metavar="SIZE", help="one budget for listings (560 B per entry), the disk cache's index (~550 B per object), the block cache and all prefetch buffers; at least 16M (default 1G)")
    g.add_argument("--small-file-bytes", type=size_at_least(SMALL_FILE_MIN_BYTES), default=parse_size("8M"), metavar="SIZE", help="files up to this size are fetched whole, in one GET, at open; 4K up to half of --max-memory (default 8M)")
    g.add_argument("--block-size", type=size_at_least(BLOCK_SIZE_MIN_BYTES), default=parse_size("64K"), metavar="SIZE", help="block-cache block, the unit of random reads; 4K up to half of --max-memory (default 64K)")
    g.add_argument("--part-size", type=size_at_least(PART_SIZE_MIN_BYTES), default=parse_size("8M"), metavar="SIZE", help="size of one ranged GET of sequential read-ahead; 64K up to half of --max-memory (default 8M)")
    g.add_argument("--readahead-max", type=size_at_least(PART_SIZE_MIN_BYTES), default=parse_size("128M"), metavar="SIZE", help="largest read-ahead window of one sequential reader; at least 64K, raised to --part-size if below (default 128M)")
    g.add_argument("--shard-globs", default=",".join(DEFAULT_SHARD_GLOBS), metavar="GLOBS", help="comma-separated names read as shards: wide read-ahead, next shard warmed (default %(default)s)")
    g.add_argument("--cache-dir", metavar="DIR", help="keep fetched bytes on this local disk too, for epochs the page cache cannot hold and for later mounts (default: off)")
    g.add_argument("--cache-size", type=size_at_least(CACHE_SIZE_MIN_BYTES), default=parse_size("10G"), metavar="SIZE", help="most disk space --cache-dir may take, as du counts it; at least 1M (default 10G)")
    g.add_argument("--list-ahead", type=int_between(0, LIST_AHEAD_MAX), default=16, metavar="N", help=f"subdirectory listings run concurrently ahead of a directory walk, 0..{LIST_AHEAD_MAX} (default 16; 0 disables)")
    g = m.add_argument_group("process")
    g.add_argument("--check", action="store_true", help="check URL and options, then exit 0 without mounting (exit 2 and the reason if one is wrong); the mountpoint, FUSE and the store are not checked")
    g.add_argument("-f", "--foreground", action="store_true", help="stay attached and log to stderr (default: daemonise once mounted)")
    g.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level (default INFO)")
    g.add_argument("--log-file", metavar="PATH", help="write the log to this file, daemonised or with --foreground (default: syslog when daemonised, stderr with --foreground); a file rotated away is reopened by itself")
    g.add_argument("--metrics-port", type=int_between(1, PORT_MAX, "a port number"), metavar="PORT", help="serve Prometheus metrics on http://ADDRESS:PORT/metrics, 1..65535 (default: off)")
    g.add_argument("--metrics-address", type=ip_address, metavar="ADDRESS", help=f"the local IP address --metrics-port listens on: 0.0.0.0 (or ::) for every interface, so Prometheus on another host can scrape (default {DEFAULT_METRICS_ADDRESS}: this host only)")

    u = sub.add_parser("unmount", help="unmount MOUNTPOINT", description="Unmount a bucketfs mount (also recovers a mountpoint left by a crashed daemon).")
    u.add_argument("mountpoint")
    u.add_argument("--lazy", action="store_true", help="detach now even if files are open; finish when they close")

    s = sub.add_parser("stats", help="print a running mount's counters", description="Print requests, cache, read-ahead, memory and error counters of a running mount.")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print the raw counters as JSON")
    return parser


def mount_parser() -> argparse.ArgumentParser:
    """The parser of `bucketfs mount` (argparse has no public way to reach a subparser)."""
    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return subparsers.choices["mount"]


def mount_options() -> dict:
    """{long option of `bucketfs mount`: whether it takes a value}, for the fstab helper."""
    return {name: action.nargs != 0 for action in mount_parser()._actions
            for name in action.option_strings if name.startswith("--") and name != "--help"}


def _check_endpoint_url(url: str) -> None:
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        parts = None
    if parts is None or parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise errors.UserError(f"--endpoint-url {url!r} is not an http:// or https:// URL with a host", errors.EXIT_USAGE)
    if parts.netloc.endswith(":"):  # urlsplit reads 'host:' as no port; botocore then fails to connect (exit 5)
        raise errors.UserError(f"--endpoint-url {url!r} has an empty port (write host:PORT, or no ':')", errors.EXIT_USAGE)


def _check_store_options(args, url) -> None:
    """An option for the other store would be silently ignored: the user would mount
    with other credentials, region or addressing than they asked for."""
    if url.scheme == "gs":
        for option, value in (("--profile", args.profile), ("--region", args.region),
                              ("--addressing-style", args.addressing_style)):
            if value is not None:
                raise errors.UserError(f"{option} is an S3 option and {args.url} is a GCS URL "
                                       "(GCS: --key-file, or Application Default Credentials)", errors.EXIT_USAGE)
    elif args.key_file is not None:
        raise errors.UserError(f"--key-file is a GCS option and {args.url} is an S3 URL "
                               "(S3: --profile, or the AWS credential chain)", errors.EXIT_USAGE)
    if args.key_file is not None and args.no_sign_request:
        raise errors.UserError("--key-file and --no-sign-request contradict each other: a key signs requests, "
                               "--no-sign-request sends them anonymously", errors.EXIT_USAGE)


def _check_ttls(args) -> None:
    if args.negative_ttl is None:
        return
    if math.isinf(args.metadata_ttl) and not math.isinf(args.negative_ttl):
        # Silently ignoring it would leave a user waiting for names that never appear.
        raise errors.UserError("--negative-ttl needs --metadata-ttl: without it every listing is kept for the "
                               "mount's life, so a missing name stays missing", errors.EXIT_USAGE)
    if args.negative_ttl > args.metadata_ttl:
        raise errors.UserError(f"--negative-ttl {args.negative_ttl:g} is above --metadata-ttl {args.metadata_ttl:g}: "
                               "a listing is fetched again after the metadata TTL anyway, so it would mean nothing",
                               errors.EXIT_USAGE)


def _check_cross_limits(args) -> None:
    """Buffers of one request must fit the budget twice over: a bigger one is let
    through alone past the budget (so a reader never deadlocks), i.e. unbounded RSS."""
    half_budget_bytes = args.max_memory // 2
    for option, value_bytes in (("--block-size", args.block_size), ("--part-size", args.part_size),
                                ("--small-file-bytes", args.small_file_bytes)):
        if value_bytes > half_budget_bytes:
            raise errors.UserError(f"{option} {_human_bytes(value_bytes)} is more than half of --max-memory "
                                   f"{_human_bytes(args.max_memory)}", errors.EXIT_USAGE)


def _check_owner_can_enter(args) -> None:
    """FUSE lets only the mounting user into a mount without allow_other: files given
    to another owner or group would show them as owners and deny them every read."""
    if args.allow_other:
        return
    for option, value, mine in (("--uid", args.uid, os.geteuid()), ("--gid", args.gid, os.getegid())):
        if value is not None and value != mine:
            raise errors.UserError(f"{option} {value} names another user than the one mounting, and FUSE lets no other "
                                   "user into the mount without --allow-other: add --allow-other", errors.EXIT_USAGE)


def config_from_args(args) -> Config:
    try:
        url = parse_bucket_url(args.url)
    except ValueError as exc:
        raise errors.UserError(str(exc), errors.EXIT_USAGE) from None
    _check_ttls(args)
    _check_store_options(args, url)
    _check_cross_limits(args)
    _check_owner_can_enter(args)
    if args.endpoint_url is not None:
        _check_endpoint_url(args.endpoint_url)
    if args.metrics_address is not None and args.metrics_port is None:
        raise errors.UserError("--metrics-address needs --metrics-port", errors.EXIT_USAGE)
    path_style = (args.addressing_style == "path") if args.addressing_style else bool(args.endpoint_url)
    return Config(
        url=url,
        source=args.url,
        # realpath, not abspath: the kernel records the resolved path, and the signal
        # handler's ismount() and check_mountpoint must look at that one. Absolute
        # also because the daemon changes its directory to /.
        mountpoint=os.path.realpath(args.mountpoint),
        endpoint_url=args.endpoint_url,
        region=args.region,
        profile=args.profile,
        no_sign_request=args.no_sign_request,
        key_file=os.path.abspath(args.key_file) if args.key_file else None,
        path_style=path_style,
        max_connections_count=args.max_connections,
        retry_attempts_count=args.retries,
        connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.read_timeout,
        allow_other=args.allow_other,
        uid=args.uid,
        gid=args.gid,
        file_mode=args.file_mode,
        dir_mode=args.dir_mode,
        metadata_ttl_s=args.metadata_ttl,
        negative_ttl_s=args.metadata_ttl if args.negative_ttl is None else args.negative_ttl,
        max_memory_bytes=args.max_memory,
        small_file_bytes=args.small_file_bytes,
        block_size_bytes=args.block_size,
        part_size_bytes=args.part_size,
        readahead_max_bytes=max(args.readahead_max, args.part_size),
        shard_globs=tuple(g.strip() for g in args.shard_globs.split(",") if g.strip()),
        list_ahead_count=args.list_ahead,
        cache_dir=os.path.abspath(args.cache_dir) if args.cache_dir else None,
        cache_size_bytes=args.cache_size,
        foreground=args.foreground,
        log_level=args.log_level,
        log_file=os.path.abspath(args.log_file) if args.log_file else None,
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address or DEFAULT_METRICS_ADDRESS,
    )


def run_mount(config: Config) -> int:
    mountpoints.check_fuse_available()
    mountpoints.check_allow_other_permitted(config.allow_other)
    mountpoints.check_mountpoint(config.mountpoint)
    if config.cache_dir:
        check_cache_dir(config.cache_dir)
    if config.log_file:
        daemon.check_log_file(config.log_file)
    if config.foreground:
        from bucketfs.app import mount  # imports pyfuse3: only needed for mounting

        daemon.setup_logging(config, daemon=False)
        return daemon.serve_here(config, on_ready=lambda: mount.sd_notify("READY=1"))
    return daemon.daemonise(config)


def _stats_root(path: str) -> str:
    """The root of the mount holding `path` (whose counters `bucketfs stats` reads)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        raise errors.UserError(f"{path} does not exist", errors.EXIT_BAD_MOUNTPOINT) from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise errors.UserError(f"{path} is a dead mount (its daemon exited): bucketfs unmount {path}",
                                   errors.EXIT_BAD_MOUNTPOINT) from None
        raise errors.UserError(f"{path}: {exc.strerror}", errors.EXIT_BAD_MOUNTPOINT) from None
    root = path
    while not os.path.ismount(root) and root != "/":
        root = os.path.dirname(root)  # (a path inside the mount: the counters are its root's)
    return root


def print_stats(mountpoint: str, as_json: bool) -> int:
    import json

    from bucketfs.metrics import STATS_FILE_NAME, format_stats

    mountpoint = os.path.realpath(mountpoint)
    root = _stats_root(mountpoint)
    entry = mountpoints.mount_entry(root)
    if entry is None or entry[0] != mountpoints.FUSE_TYPE:
        raise errors.UserError(f"{mountpoint} is not a bucketfs mount or a path inside one", errors.EXIT_BAD_MOUNTPOINT)
    try:
        with open(os.path.join(root, STATS_FILE_NAME), "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise errors.UserError(f"{mountpoint} is not a running bucketfs mount ({exc.strerror})", errors.EXIT_BAD_MOUNTPOINT) from None
    try:
        snapshot = json.loads(raw)
    except ValueError:
        raise errors.UserError(f"{root}/{STATS_FILE_NAME} is an object of the bucket, which hides the counters: "
                               "read them with --metrics-port", errors.EXIT_BAD_MOUNTPOINT) from None
    try:
        print(json.dumps(snapshot, indent=2, sort_keys=True) if as_json else format_stats(snapshot), flush=True)
    except BrokenPipeError:
        # The reader left: no traceback, and no second one from the interpreter's own
        # flush of stdout at exit (the Python docs' recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return errors.EXIT_BROKEN_PIPE
    return errors.EXIT_OK


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "mount":
            config = config_from_args(args)
            if args.check:
                try:
                    backends.check_options(config)
                except errors.BucketfsError as exc:
                    raise errors.user_error_for(exc, str(config.url)) from None
                return errors.EXIT_OK
            return run_mount(config)
        if args.command == "unmount":
            # realpath: mountinfo lists the resolved path, whatever symlink led to it.
            mountpoints.unmount(os.path.realpath(args.mountpoint), lazy=args.lazy)
            return errors.EXIT_OK
        if args.command == "stats":
            return print_stats(args.mountpoint, args.json)
    except errors.UserError as exc:
        print(f"bucketfs: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("bucketfs: interrupted", file=sys.stderr)
        return errors.EXIT_INTERRUPTED
    return errors.EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
