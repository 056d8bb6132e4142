"""`mount.fuse.bucketfs`: the helper mount(8) runs for fstab lines of type fuse.bucketfs.

    s3://bucket/prefix  /mnt/data  fuse.bucketfs  ro,_netdev,allow_other,nofail,max_memory=2G  0 0

mount(8) calls `mount.fuse.bucketfs SOURCE MOUNTPOINT -o OPTIONS`. Every CLI option
can be given as `-o key=value` (dashes or underscores) or `-o flag`; generic mount
options (ro, rw, defaults, _netdev, nofail, x-systemd.*, ...) are accepted and ignored:
the mount is read-only whatever they say (mount(8) itself adds `rw` to any line
without `ro`). Lists inside a value (`shard_globs`) use `:` between items, since `,`
separates the options. The helper daemonises and returns once the mount answers, as
mount(8) expects.
"""

from __future__ import annotations

import sys

from bucketfs import cli, errors

# Options mount(8), systemd or fstab conventions pass along that mean nothing to us.
# `rw` among them: mount(8) adds it to every line without `ro` (`defaults`), and the
# kernel mount is read-only anyway. `default_permissions`: bucketfs always sets it.
_GENERIC = {
    "ro", "rw", "defaults", "default_permissions", "auto", "noauto", "nofail", "_netdev", "user", "users", "nouser", "owner", "group",
    "nosuid", "suid", "nodev", "dev", "exec", "noexec", "relatime", "noatime", "atime", "nodiratime",
    "strictatime", "lazytime", "sync", "async", "loud", "silent",
}
_FLAGS = {"allow_other", "no_sign_request", "foreground"}


def options_to_argv(options: str) -> list:
    argv = []
    for item in filter(None, (o.strip() for o in options.split(","))):
        key, sep, value = item.partition("=")
        name = key.replace("-", "_")
        if name in _GENERIC or key.startswith(("x-", "comment")):
            continue
        if name == "shard_globs":
            value = value.replace(":", ",")  # (the CLI's comma list; commas split fstab options)
        if sep:
            argv += [f"--{name.replace('_', '-')}", value]
        elif name in _FLAGS:
            argv.append(f"--{name.replace('_', '-')}")
        else:
            raise errors.UserError(f"unknown mount option {item!r} (options are bucketfs mount's, as key=value)", errors.EXIT_USAGE)
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


def main(argv=None) -> int:
    try:
        source, mountpoint, options = parse_mount_args(list(sys.argv[1:] if argv is None else argv))
        return cli.main(["mount", source, mountpoint, *options_to_argv(options)])
    except errors.UserError as exc:
        print(f"bucketfs: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
