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

from bucketfs import __version__, backends, config, errors
from bucketfs.app import daemon, mountpoints
from bucketfs.config import Config, Option, is_url, parse_bucket_url, parse_object_url
from bucketfs.diskcache.directory import check_cache_dir

# A number, then K/M/G/T (binary; KiB spelled out too) or B or nothing.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i|ib)?|b)?\s*$", re.I)
# KB/MB/GB/TB: decimal to disk vendors and SI, binary to JEDEC and many tools. A guess
# either way is off by 7% at G: refused instead.
_AMBIGUOUS_SIZE_RE = re.compile(r"^\s*\d+(?:\.\d+)?\s*[kmgt]b\s*$", re.I)
SIZE_HELP = (
    "SIZE is a number of bytes, or a number with K, M, G or T (binary: 1K = 1024 bytes; KiB, MiB, GiB, "
    "TiB also), decimals allowed with a suffix (1.5G); KB, MB, GB and TB are refused as ambiguous."
)

# Options of `bucketfs mount` that are no Config field: what the command does.
CHECK = Option(
    flag="--check",
    kind="flag",
    group=config.PROCESS,
    help="check URL and options, then exit 0 without mounting (exit 2 and the reason if one is wrong); "
    "the mountpoint, FUSE and the store are not checked",
    details="an --index file is read and checked too (exit 11, 12 or 13); an --index URL is not fetched",
)
COMMAND_OPTIONS = (CHECK,)


def parse_size(text: str) -> int:
    """'64M', '1GiB', '1.5G', '512k', '1048576' -> bytes (binary multiples, rounded down)."""
    if _AMBIGUOUS_SIZE_RE.match(text):
        unit = text.strip()[-2].upper()
        raise argparse.ArgumentTypeError(
            f"{text!r} is ambiguous (decimal or binary?): sizes here are binary, "
            f"write {unit} or {unit}iB (1{unit} = {1024 ** ' KMGT'.index(unit):,} bytes)"
        )
    m = _SIZE_RE.match(text)
    if not m or ("." in m.group(1) and not m.group(2)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 1048576, 512K, 64M, 1.5G, 2T)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))


def _parse_int(text: str, opt: Option) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {opt.what}") from None


def _parse_seconds(text: str, opt: Option) -> float:
    if opt.kind == "seconds" and text.lower() in ("inf", "forever", "never"):
        return math.inf
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


def _parse_mode(text: str, opt: Option) -> int:
    try:
        return int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 0444") from None


def _parse_ip(text: str, opt: Option) -> str:
    """An IPv4 or IPv6 address to listen on (a name could resolve to several, or none)."""
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        return text  # (refused by the option's check, with its reason)


def _parse_choice(text: str, opt: Option) -> str:
    for choice in opt.choices:
        if text.lower() == choice.lower():
            return choice
    return text  # (argparse names the choices)


_PARSERS = {
    "size": lambda text, opt: parse_size(text),
    "int": _parse_int,
    "seconds": _parse_seconds,
    "timeout": _parse_seconds,
    "mode": _parse_mode,
    "ip": _parse_ip,
    "choice": _parse_choice,
    "list": lambda text, opt: tuple(item.strip() for item in text.split(",") if item.strip()),
}


def value_type(opt: Option):
    """The argparse type of `opt`: its text parsed, then checked as Config checks it (so
    the message quotes what the user typed)."""
    parse = _PARSERS.get(opt.kind, lambda text, opt: text)

    def convert(text: str):
        value = parse(text, opt)
        problem = None if opt.kind == "choice" else opt.problem(value, repr(text))
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = opt.kind  # (argparse's "invalid <name> value" for anything else)
    return convert


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # self.prog is "bucketfs" or "bucketfs mount": the command to ask for help.
        self.exit(errors.EXIT_USAGE, f"bucketfs: {message} (see {self.prog} --help)\n")


def mount_option_specs() -> list:
    """[(Option, Config field name or None, default)] of `bucketfs mount`, in --help's order."""
    specs = [(opt, field.name, field.default) for field, opt in config.options()]
    for opt in COMMAND_OPTIONS:  # first in their group
        at = next(i for i, (o, _, _) in enumerate(specs) if o.group == opt.group)
        specs.insert(at, (opt, None, False))
    return specs


# The Config fields that reach the store, as `mount` takes them: `bucketfs index build`
# takes these, `bucketfs warm` these and the disk cache's.
STORE_FIELDS = (
    "endpoint_url",
    "region",
    "profile",
    "no_sign_request",
    "key_file",
    "addressing_style",
    "retry_attempts_count",
    "connect_timeout_s",
    "read_timeout_s",
)
# (a mount reads what warm stored only with the same --cache-dir and --block-size)
WARM_FIELDS = STORE_FIELDS + ("cache_dir", "cache_size_bytes", "block_size_bytes")


def warm_option_specs() -> list:
    """[(Option, Config field name or None, default)] of `bucketfs warm`."""
    from bucketfs.app.warm import CONCURRENCY, DEFAULT_CONCURRENCY

    specs = [(opt, field.name, field.default) for field, opt in config.options() if field.name in WARM_FIELDS]
    specs.insert(0, (CONCURRENCY, None, DEFAULT_CONCURRENCY))
    return specs


def warm_config_from_args(args) -> Config:
    """The Config of `bucketfs warm`'s arguments (mount's defaults for the rest)."""
    values = {name: getattr(args, name) for name in WARM_FIELDS}
    if not values["cache_dir"]:
        raise errors.UserError("warm needs --cache-dir DIR (the disk cache to fill)", errors.EXIT_USAGE)
    for name in ("cache_dir", "key_file"):
        if values[name]:
            values[name] = os.path.abspath(values[name])
    try:
        return Config(url=parse_bucket_url(args.url), source=args.url, mountpoint="", **values)
    except ValueError as exc:
        raise errors.UserError(str(exc), errors.EXIT_USAGE) from None


INDEX_FIELDS = STORE_FIELDS  # `bucketfs index build`'s


def index_option_specs(with_concurrency: bool = True) -> list:
    """[(Option, Config field name or None, default)] of `bucketfs index build` (and,
    without --concurrency, `index show`)."""
    from bucketfs.app.indexbuild import CONCURRENCY, DEFAULT_CONCURRENCY

    specs = [(opt, field.name, field.default) for field, opt in config.options() if field.name in INDEX_FIELDS]
    if with_concurrency:
        specs.insert(0, (CONCURRENCY, None, DEFAULT_CONCURRENCY))
    return specs


def index_config_from_args(args, url: str) -> Config:
    """The Config of `bucketfs index`'s store options for the bucket URL `url`."""
    values = {name: getattr(args, name) for name in INDEX_FIELDS}
    if values["key_file"]:
        values["key_file"] = os.path.abspath(values["key_file"])
    try:
        return Config(url=parse_bucket_url(url), source=url, mountpoint="", **values)
    except ValueError as exc:
        raise errors.UserError(str(exc), errors.EXIT_USAGE) from None


def warm_mount_root(args) -> str:
    """`bucketfs warm MOUNTPOINT`: the directory to read (a bucketfs mount or a path in
    one); the store and cache options are the mount's, so none may be given."""
    for opt, field_name, default in warm_option_specs():
        if field_name is not None and getattr(args, field_name) != default:
            raise errors.UserError(
                f"{opt.flag} is for warming a URL: a MOUNTPOINT is warmed with its mount's own options",
                errors.EXIT_USAGE,
            )
    path = os.path.realpath(args.url)
    entry = mountpoints.mount_entry(_stats_root(path))
    if entry is None or entry[0] != mountpoints.FUSE_TYPE:
        raise errors.UserError(
            f"{args.url} is neither a bucket URL (s3://, gs://) nor a bucketfs mount or a path inside one",
            errors.EXIT_BAD_MOUNTPOINT,
        )
    return path


def _add_option(group, opt: Option, dest: str, default) -> None:
    help_text = opt.help_line(default).replace("%", "%%")
    if opt.kind == "flag":
        group.add_argument(*opt.flags, dest=dest, action="store_true", help=help_text)
        return
    group.add_argument(
        *opt.flags,
        dest=dest,
        type=value_type(opt),
        default=default,
        help=help_text,
        choices=opt.choices or None,
        metavar=None if opt.kind == "choice" else opt.value_name,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="bucketfs", description="Mount an S3 or GCS bucket prefix read-only as a fast local directory."
    )
    parser.add_argument("--version", action="version", version=f"bucketfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    m = sub.add_parser(
        "mount",
        help="mount URL on MOUNTPOINT",
        description="Mount s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX] read-only on MOUNTPOINT. Returns once the mount answers.",
        epilog=SIZE_HELP,
    )
    m.add_argument("url", help="s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX]")
    m.add_argument("mountpoint", help="an existing empty directory")
    _add_options(m, mount_option_specs())

    u = sub.add_parser(
        "unmount",
        help="unmount MOUNTPOINT",
        description="Unmount a bucketfs mount (also recovers a mountpoint left by a crashed daemon).",
    )
    u.add_argument("mountpoint")
    u.add_argument("--lazy", action="store_true", help="detach now even if files are open; finish when they close")

    w = sub.add_parser(
        "warm",
        help="fill --cache-dir with URL (or PATHs under it) before mounting",
        description="Fetch s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX] (or the PATHs under it) into the disk "
        "cache a later `bucketfs mount URL --cache-dir DIR` reads, with many GETs in flight. Resumable: what the "
        "cache holds at the listed version is not fetched again. Progress on a terminal; quiet without one.",
        epilog=SIZE_HELP,
    )
    w.add_argument(
        "url",
        metavar="URL-or-MOUNTPOINT",
        help="s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX]; or a running bucketfs mount (or a path in one), "
        "whose files are then read through it, filling its own caches",
    )
    w.add_argument("paths", nargs="*", metavar="PATH", help="files or directories under it (default: all of it)")
    _add_options(w, warm_option_specs())

    i = sub.add_parser(
        "index",
        help="build a listing index of URL, or show one",
        description="A listing index holds every object of a prefix (key, size, mtime, version) in one "
        "checksummed file: `bucketfs mount URL MOUNTPOINT --index FILE-or-URL` mounts from it with no LIST "
        "request (docs/index-format.md).",
    )
    isub = i.add_subparsers(dest="index_command", required=True, parser_class=_Parser)
    b = isub.add_parser(
        "build",
        help="list URL with many LISTs in flight and write its index",
        description="List s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX] as fast as the store allows (key ranges "
        "listed in parallel, ranges split as they prove large) and write its listing index to --out: a local "
        "file, or s3://BUCKET/KEY or gs://BUCKET/KEY on the same store (the bucket itself, so every node of a "
        "job loads the same one). Progress on a terminal; quiet without one.",
    )
    b.add_argument("url", metavar="URL", help="s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX]")
    b.add_argument(
        "--out",
        required=True,
        metavar="FILE-or-URL",
        help="where the index goes: a file (written whole, then renamed into place), or s3://BUCKET/KEY or "
        "gs://BUCKET/KEY on the same store",
    )
    _add_options(b, index_option_specs())
    show = isub.add_parser(
        "show",
        help="print what an index holds",
        description="Check an index (its format version and checksum) and print its URL, when it was built, and "
        "its counts. FILE-or-URL as for bucketfs mount --index.",
    )
    show.add_argument("location", metavar="FILE-or-URL", help="an index file, or s3://BUCKET/KEY or gs://BUCKET/KEY")
    _add_options(show, index_option_specs(with_concurrency=False))

    s = sub.add_parser(
        "stats",
        help="print a running mount's counters",
        description="Print requests, cache, read-ahead, memory and error counters of a running mount.",
    )
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print the raw counters as JSON")
    return parser


def _add_options(parser: argparse.ArgumentParser, specs) -> None:
    """Every (Option, field name or None, default) of `specs`, in its group of `parser`."""
    groups: dict = {}
    for opt, field_name, default in specs:
        if opt.group not in groups:
            groups[opt.group] = parser.add_argument_group(opt.group)
        _add_option(groups[opt.group], opt, field_name or opt.flag[2:].replace("-", "_"), default)


def mount_parser() -> argparse.ArgumentParser:
    """The parser of `bucketfs mount` (argparse has no public way to reach a subparser)."""
    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return subparsers.choices["mount"]


def mount_options() -> dict:
    """{long option of `bucketfs mount`: whether it takes a value}, for the fstab helper."""
    return {
        name: action.nargs != 0
        for action in mount_parser()._actions
        for name in action.option_strings
        if name.startswith("--") and name != "--help"
    }


def list_options() -> set:
    """Long options of `bucketfs mount` whose value is a comma-separated list."""
    return {opt.flag for opt, _, _ in mount_option_specs() if opt.kind == "list"}


def config_from_args(args) -> Config:
    """The Config of `bucketfs mount`'s parsed arguments; every check is Config's own."""
    values = {field.name: getattr(args, field.name) for field, _ in config.options()}
    for field, opt in config.options():
        if opt.kind == "path" and values[field.name] and not is_url(values[field.name]):
            # Absolute: the daemon changes its directory to /. (An --index may be a URL.)
            values[field.name] = os.path.abspath(values[field.name])
    try:
        # realpath, not abspath: the kernel records the resolved path, and the signal
        # handler's ismount() and check_mountpoint must look at that one.
        return Config(
            url=parse_bucket_url(args.url), source=args.url, mountpoint=os.path.realpath(args.mountpoint), **values
        )
    except ValueError as exc:
        raise errors.UserError(str(exc), errors.EXIT_USAGE) from None


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
            raise errors.UserError(
                f"{path} is a dead mount (its daemon exited): bucketfs unmount {path}", errors.EXIT_BAD_MOUNTPOINT
            ) from None
        raise errors.UserError(f"{path}: {exc.strerror}", errors.EXIT_BAD_MOUNTPOINT) from None
    root = path
    while not os.path.ismount(root) and root != "/":
        root = os.path.dirname(root)  # (a path inside the mount: the counters are its root's)
    return root


def print_stats(mountpoint: str, as_json: bool) -> int:
    import json

    from bucketfs.metrics import STATS_FILE_NAME, decode_stats, format_stats

    mountpoint = os.path.realpath(mountpoint)
    root = _stats_root(mountpoint)
    entry = mountpoints.mount_entry(root)
    if entry is None or entry[0] != mountpoints.FUSE_TYPE:
        raise errors.UserError(f"{mountpoint} is not a bucketfs mount or a path inside one", errors.EXIT_BAD_MOUNTPOINT)
    try:
        with open(os.path.join(root, STATS_FILE_NAME), "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise errors.UserError(
            f"{mountpoint} is not a running bucketfs mount ({exc.strerror})", errors.EXIT_BAD_MOUNTPOINT
        ) from None
    try:
        snapshot = decode_stats(raw)
    except ValueError:
        raise errors.UserError(
            f"{root}/{STATS_FILE_NAME} is an object of the bucket, which hides the counters: "
            "read them with --metrics-port",
            errors.EXIT_BAD_MOUNTPOINT,
        ) from None
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
                if config.index and not is_url(config.index):
                    from bucketfs.app import indexload

                    # (An index in a file is read and checked too; one in the store is not.)
                    indexload.decode(indexload.read_file(config.index), config.index, str(config.url))
                return errors.EXIT_OK
            return run_mount(config)
        if args.command == "unmount":
            # realpath: mountinfo lists the resolved path, whatever symlink led to it.
            mountpoints.unmount(os.path.realpath(args.mountpoint), lazy=args.lazy)
            return errors.EXIT_OK
        if args.command == "warm":
            from bucketfs.app import warm

            if "://" not in args.url and os.path.lexists(args.url):  # (else a URL, malformed: exit 2)
                return warm.run_warm_mount(warm_mount_root(args), args.paths, args.concurrency)
            return warm.run_warm(warm_config_from_args(args), args.paths, args.concurrency)
        if args.command == "stats":
            return print_stats(args.mountpoint, args.json)
        if args.command == "index":
            from bucketfs.app import indexbuild, indexload

            if args.index_command == "build":
                return indexbuild.run_index_build(index_config_from_args(args, args.url), args.out, args.concurrency)
            show_config = None
            if is_url(args.location):
                try:
                    scheme, bucket, _key = parse_object_url(args.location)
                except ValueError as exc:
                    raise errors.UserError(str(exc), errors.EXIT_USAGE) from None
                show_config = index_config_from_args(args, f"{scheme}://{bucket}/")
            return indexload.run_index_show(args.location, show_config)
    except errors.UserError as exc:
        print(f"bucketfs: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("bucketfs: interrupted", file=sys.stderr)
        return errors.EXIT_INTERRUPTED
    return errors.EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
