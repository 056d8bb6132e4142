"""`mount.fuse.bucketfs`: the helper mount(8) runs for fstab lines of type fuse.bucketfs.

    s3://bucket/prefix  /mnt/data  fuse.bucketfs  ro,_netdev,allow_other,nofail,max_memory=2G  0 0

mount(8) calls `mount.fuse.bucketfs SOURCE MOUNTPOINT -o OPTIONS`. Every CLI option
can be given as `-o key=value` (dashes or underscores) or `-o flag`; generic mount
options (ro, rw, defaults, _netdev, nofail, x-systemd.*, ...) are accepted and ignored:
the mount is read-only whatever they say (mount(8) itself adds `rw` to any line
without `ro`). Lists inside a value (`shard_globs`) use `:` between items, since `,`
separates the options. The helper daemonises and returns once the mount answers, as
mount(8) expects (so `foreground` is refused). An unknown option is named as fstab
writes it; a bad value is reported by the mount's own parser (as `--max-memory`). A line already mounted and serving is not mounted again (exit 0): the mount's
source is SOURCE as written, which is also how `mount -a` tells it is mounted.
"""

from __future__ import annotations

import os
import sys

from bucketfs import errors
from bucketfs.app import cli, mountpoints

# Options mount(8), systemd or fstab conventions pass along that mean nothing to us.
# `rw` among them: mount(8) adds it to every line without `ro` (`defaults`), and the
# kernel mount is read-only anyway. `default_permissions`: bucketfs always sets it.
_GENERIC = {
    "ro",
    "rw",
    "defaults",
    "default_permissions",
    "auto",
    "noauto",
    "nofail",
    "_netdev",
    "user",
    "users",
    "nouser",
    "owner",
    "group",
    "nosuid",
    "suid",
    "nodev",
    "dev",
    "exec",
    "noexec",
    "relatime",
    "noatime",
    "atime",
    "nodiratime",
    "strictatime",
    "lazytime",
    "sync",
    "async",
    "loud",
    "silent",
}
# mount(8) waits for its helper to return: a foreground mount never would.
_REFUSED = {
    "foreground": "mount(8) would wait forever for a mount that never returns (the helper "
    "daemonises once mounted, as mount(8) expects)",
    "check": "it would mount nothing (run bucketfs mount --check instead)",
}


def options_to_argv(options: str) -> list:
    known = cli.mount_options()  # {"--max-memory": takes a value, ...}
    lists = cli.list_options()
    argv = []
    for item in filter(None, (o.strip() for o in options.split(","))):
        key, sep, value = item.partition("=")
        name = key.replace("-", "_")
        if name in _GENERIC or key.startswith(("x-", "comment")):
            continue
        if name in _REFUSED:
            raise errors.UserError(f"fstab option {name!r} cannot be used: {_REFUSED[name]}", errors.EXIT_USAGE)
        option = f"--{name.replace('_', '-')}"
        if option not in known:
            raise errors.UserError(
                f"unknown fstab option {key!r} (bucketfs mount's options, written as "
                "max_memory=4G or allow_other; see bucketfs mount --help)",
                errors.EXIT_USAGE,
            )
        if known[option] != bool(sep):
            wanted = f"{name}=VALUE" if known[option] else f"{name}, without a value"
            raise errors.UserError(f"fstab option {item!r}: write it as {wanted}", errors.EXIT_USAGE)
        if option in lists:
            value = value.replace(":", ",")  # (the CLI's comma list; commas split fstab options)
        argv += [option, value] if sep else [option]
    return argv


def parse_mount_args(args: list):
    """SOURCE MOUNTPOINT [-o OPTS] [-n] [-s] [-f] [-v] [-N NS], as mount(8) passes them."""
    positional, options = [], []
    it = iter(args)
    for arg in it:
        if arg == "-o":
            options.append(next(it, ""))
        elif arg.startswith("-o") and len(arg) > 2:
            options.append(arg[2:])
        elif arg == "-N":
            next(it, None)  # a mount namespace: we mount in the caller's
        elif arg in ("-n", "-s", "-f", "-v", "-r"):
            continue  # no mtab, sloppy, fake, verbose, read-only: nothing to do
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise errors.UserError("usage: mount.fuse.bucketfs SOURCE MOUNTPOINT [-o key=value,...]", errors.EXIT_USAGE)
    return positional[0], positional[1], ",".join(options)


def already_mounted(source: str, mountpoint: str) -> bool:
    """This very line is mounted and serving: `mount /mnt/data` again is then a no-op, as
    `mount -a` makes it (a dead mount is not: a new mount recovers it)."""
    path = os.path.realpath(mountpoint)
    if mountpoints.mount_entry(path) != (mountpoints.FUSE_TYPE, source):
        return False
    try:
        os.stat(path)  # the daemon answers this itself, without asking the store
    except OSError:
        return False  # ENOTCONN: its daemon died
    return True


def main(argv=None) -> int:
    try:
        source, mountpoint, options = parse_mount_args(list(sys.argv[1:] if argv is None else argv))
        mount_argv = options_to_argv(options)
        if already_mounted(source, mountpoint):
            print(f"bucketfs: {source} is already mounted on {mountpoint}", file=sys.stderr)
            return errors.EXIT_OK
        return cli.main(["mount", source, mountpoint, *mount_argv])
    except errors.UserError as exc:
        print(f"bucketfs: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
