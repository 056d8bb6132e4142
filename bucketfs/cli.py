"""Command line: argv -> Config, logging, daemonising, exit codes.

Invariants: a user error prints ONE line on stderr (`bucketfs: ...`) and exits with
its distinct code (bucketfs.errors.EXIT_*), never a traceback; `bucketfs mount`
returns only once the mount answers (or has failed and left nothing mounted).
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import math
import os
import re
import sys

from bucketfs import __version__, errors
from bucketfs.config import DEFAULT_SHARD_GLOBS, Config, parse_bucket_url
from bucketfs.core.diskcache import check_cache_dir

log = logging.getLogger("bucketfs")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.I)


def parse_size(text: str) -> int:
    """'64M', '1GiB', '512k', '1048576' -> bytes (binary multiples)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 1048576, 512K, 64M, 2G)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def parse_seconds(text: str) -> float:
    if text.lower() in ("inf", "forever", "never"):
        return math.inf
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (or 'inf')") from None
    if value < 0:
        raise argparse.ArgumentTypeError("seconds must be >= 0")
    return value


def parse_mode(text: str) -> int:
    try:
        return int(text, 8) & 0o7777
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 0444") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(errors.EXIT_USAGE, f"bucketfs: {message} (see bucketfs {self.prog.split()[-1]} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="bucketfs", description="Mount an S3 or GCS bucket prefix read-only as a fast local directory.")
    parser.add_argument("--version", action="version", version=f"bucketfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    m = sub.add_parser("mount", help="mount URL on MOUNTPOINT", description="Mount s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX] read-only on MOUNTPOINT. Returns once the mount answers.")
    m.add_argument("url", help="s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX]")
    m.add_argument("mountpoint", help="an existing empty directory")
    g = m.add_argument_group("store access")
    g.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, AIStore, Ceph) or a GCS emulator/private endpoint")
    g.add_argument("--region", help="S3 region (default: from the AWS profile or environment)")
    g.add_argument("--profile", help="AWS credentials profile (default: the standard credential chain)")
    g.add_argument("--no-sign-request", action="store_true", help="anonymous access to a public bucket (S3 and GCS)")
    g.add_argument("--key-file", help="GCS service-account JSON key (default: Application Default Credentials)")
    g.add_argument("--addressing-style", choices=("path", "virtual"), help="S3 addressing (default: path with --endpoint-url, virtual otherwise)")
    g.add_argument("--max-connections", type=int, default=32, metavar="N", help="parallel requests and pooled connections (default 32)")
    g.add_argument("--retries", type=int, default=5, metavar="N", help="attempts for throttling, 5xx, resets and timeouts before EIO (default 5)")
    g.add_argument("--connect-timeout", type=float, default=10.0, metavar="S", help="seconds to connect (default 10)")
    g.add_argument("--read-timeout", type=float, default=30.0, metavar="S", help="seconds a response may stall (default 30)")
    g = m.add_argument_group("presentation")
    g.add_argument("--allow-other", action="store_true", help="let other users access the mount (needs user_allow_other in /etc/fuse.conf for non-root)")
    g.add_argument("--uid", type=int, help="owner of every file (default: the mounting user)")
    g.add_argument("--gid", type=int, help="group of every file (default: the mounting user's group)")
    g.add_argument("--file-mode", type=parse_mode, default=0o444, help="permission bits of files, octal (default 0444)")
    g.add_argument("--dir-mode", type=parse_mode, default=0o555, help="permission bits of directories, octal (default 0555)")
    g = m.add_argument_group("caching and prefetch")
    g.add_argument("--metadata-ttl", type=parse_seconds, default=math.inf, metavar="S", help="seconds listings and attributes stay valid; 'inf' (default) for data that does not change while mounted")
    g.add_argument("--negative-ttl", type=parse_seconds, default=None, metavar="S", help="seconds a missing name stays missing, below --metadata-ttl (default: the metadata TTL)")
    g.add_argument("--max-memory", type=parse_size, default=parse_size("1G"), metavar="SIZE", help="one budget for listings (560 B per entry), the disk cache's index (~550 B per object), the block cache and all prefetch buffers (default 1G)")
    g.add_argument("--small-file-bytes", type=parse_size, default=parse_size("8M"), metavar="SIZE", help="files up to this size are fetched whole, in one GET, at open (default 8M)")
    g.add_argument("--block-size", type=parse_size, default=parse_size("64K"), metavar="SIZE", help="block-cache block, the unit of random reads (default 64K)")
    g.add_argument("--part-size", type=parse_size, default=parse_size("8M"), metavar="SIZE", help="size of one ranged GET of sequential read-ahead (default 8M)")
    g.add_argument("--readahead-max", type=parse_size, default=parse_size("128M"), metavar="SIZE", help="largest read-ahead window of one sequential reader (default 128M)")
    g.add_argument("--shard-globs", default=",".join(DEFAULT_SHARD_GLOBS), metavar="GLOBS", help="comma-separated names read as shards: wide read-ahead, next shard warmed (default %(default)s)")
    g.add_argument("--cache-dir", metavar="DIR", help="keep fetched bytes on this local disk too, for epochs the page cache cannot hold and for later mounts (default: off)")
    g.add_argument("--cache-size", type=parse_size, default=parse_size("10G"), metavar="SIZE", help="most bytes --cache-dir may hold (default 10G)")
    g.add_argument("--list-ahead", type=int, default=16, metavar="N", help="subdirectory listings run concurrently ahead of a directory walk (default 16; 0 disables)")
    g = m.add_argument_group("process")
    g.add_argument("-f", "--foreground", action="store_true", help="stay attached and log to stderr (default: daemonise once mounted)")
    g.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level (default INFO)")
    g.add_argument("--log-file", help="log file when daemonised (default: syslog)")
    g.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics")

    u = sub.add_parser("unmount", help="unmount MOUNTPOINT", description="Unmount a bucketfs mount (also recovers a mountpoint left by a crashed daemon).")
    u.add_argument("mountpoint")
    u.add_argument("--lazy", action="store_true", help="detach now even if files are open; finish when they close")

    s = sub.add_parser("stats", help="print a running mount's counters", description="Print requests, cache, read-ahead, memory and error counters of a running mount.")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print the raw counters as JSON")
    return parser


def config_from_args(args) -> Config:
    try:
        url = parse_bucket_url(args.url)
    except ValueError as exc:
        raise errors.UserError(str(exc), errors.EXIT_USAGE) from None
    if args.negative_ttl is not None and math.isinf(args.metadata_ttl) and not math.isinf(args.negative_ttl):
        # Silently ignoring it would leave a user waiting for names that never appear.
        raise errors.UserError("--negative-ttl needs --metadata-ttl: without it every listing is kept for the "
                               "mount's life, so a missing name stays missing", errors.EXIT_USAGE)
    path_style = (args.addressing_style == "path") if args.addressing_style else bool(args.endpoint_url)
    return Config(
        url=url,
        mountpoint=os.path.abspath(args.mountpoint),
        endpoint_url=args.endpoint_url,
        region=args.region,
        profile=args.profile,
        no_sign_request=args.no_sign_request,
        key_file=args.key_file,
        path_style=path_style,
        max_connections_count=args.max_connections,
        retry_attempts_count=max(1, args.retries),
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
        log_file=args.log_file,
        metrics_port=args.metrics_port,
    )


def setup_logging(config: Config, daemon: bool) -> None:
    root = logging.getLogger()
    root.handlers.clear()
    if not daemon:
        handler = logging.StreamHandler(sys.stderr)
        # Under systemd stderr goes to the journal, which stamps each line itself.
        stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
        handler.setFormatter(logging.Formatter(stamp + "%(levelname)s %(name)s: %(message)s"))
    elif config.log_file:
        handler = logging.FileHandler(config.log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    elif os.path.exists("/dev/log"):
        handler = logging.handlers.SysLogHandler("/dev/log")
        handler.setFormatter(logging.Formatter("bucketfs[%(process)d]: %(levelname)s %(name)s: %(message)s"))
    else:
        handler = logging.NullHandler()
    root.addHandler(handler)
    root.setLevel(config.log_level)
    # SDK debug logs carry request signatures and headers: never let them through.
    for noisy in ("botocore", "boto3", "urllib3", "google", "s3transfer"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def run_mount(config: Config) -> int:
    from bucketfs import mount  # imports pyfuse3: only needed for mounting

    mount.check_fuse_available()
    mount.check_mountpoint(config.mountpoint)
    if config.cache_dir:
        check_cache_dir(config.cache_dir)
    if config.foreground:
        setup_logging(config, daemon=False)
        return _serve_here(config, on_ready=lambda: mount.sd_notify("READY=1"))
    return _daemonise(config)


def _serve_here(config: Config, on_ready) -> int:
    import trio

    from bucketfs import mount

    mount.tune_memory_allocator()
    trio.run(mount.serve, config, on_ready)
    return errors.EXIT_OK


def _daemonise(config: Config) -> int:
    """Fork; the child mounts and reports readiness or its error through a pipe."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        setup_logging(config, daemon=True)
        report = os.fdopen(write_fd, "w")

        def on_ready():
            report.write("READY\n")
            report.flush()

        code = errors.EXIT_FAILURE
        try:
            code = _serve_here(config, on_ready)
        except errors.UserError as exc:
            report.write(f"ERROR {exc.exit_code} {exc}\n")
            code = exc.exit_code
        except BaseException:  # noqa: BLE001 - the parent must hear of it, the log gets the trace
            log.exception("bucketfs daemon failed")
            report.write(f"ERROR {errors.EXIT_FAILURE} daemon failed; see the log\n")
        finally:
            try:
                report.close()
            except OSError:
                pass
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as report:
        line = report.readline().strip()
    if line == "READY":
        return errors.EXIT_OK
    if line.startswith("ERROR "):
        _, code, message = line.split(" ", 2)
        raise errors.UserError(message, int(code))
    _, status = os.waitpid(pid, 0)
    raise errors.UserError(f"mount failed: the daemon exited ({os.waitstatus_to_exitcode(status)}) before the mount answered", errors.EXIT_MOUNT_FAILED)


def print_stats(mountpoint: str, as_json: bool) -> int:
    import json

    from bucketfs.metrics import STATS_XATTR, format_stats

    try:
        raw = os.getxattr(mountpoint, STATS_XATTR)
    except OSError as exc:
        raise errors.UserError(f"{mountpoint} is not a running bucketfs mount ({exc.strerror})", errors.EXIT_BAD_MOUNTPOINT) from None
    snapshot = json.loads(raw)
    print(json.dumps(snapshot, indent=2, sort_keys=True) if as_json else format_stats(snapshot))
    return errors.EXIT_OK


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "mount":
            return run_mount(config_from_args(args))
        if args.command == "unmount":
            from bucketfs import mount

            mount.unmount(os.path.abspath(args.mountpoint), lazy=args.lazy)
            return errors.EXIT_OK
        if args.command == "stats":
            return print_stats(args.mountpoint, args.json)
    except errors.UserError as exc:
        print(f"bucketfs: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return errors.EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
