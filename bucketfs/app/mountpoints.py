"""The mountpoint and the host's FUSE: checks before mounting, and finding and
detaching our mounts (`bucketfs unmount`, a dead mount left by a crashed daemon).

Invariants: a check raises UserError with its exit code and one line; only a bucketfs
mount, or a dead FUSE mount, is ever detached.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat as stat_mod
import subprocess
from typing import Optional

from bucketfs import errors

log = logging.getLogger(__name__)

# What fuse_options names our mounts in /proc/self/mountinfo: the type; the source is
# the URL as given (fstab's first field, so mount(8) sees the line is mounted).
FUSE_TYPE = "fuse.bucketfs"
# fusectl: one directory per FUSE connection, named by the mount's device number.
FUSECTL_DIR = "/sys/fs/fuse/connections"


def fusectl_dir(dev: int) -> str:
    """The fusectl directory of the mount whose st_dev is `dev` (named by the kernel's dev_t)."""
    return os.path.join(FUSECTL_DIR, str((os.major(dev) << 20) | os.minor(dev)))


# -- pre-flight ----------------------------------------------------------------
def fusermount_path() -> Optional[str]:
    return shutil.which("fusermount3")


def check_fuse_available() -> None:
    # BUCKETFS_FUSE_DEVICE exists so tests can play a machine without FUSE.
    device = os.environ.get("BUCKETFS_FUSE_DEVICE", "/dev/fuse")
    if not os.path.exists(device):
        raise errors.UserError(
            f"FUSE is not available: {device} does not exist (install fuse3 and load the fuse module)",
            errors.EXIT_NO_FUSE,
        )
    if not os.access(device, os.R_OK | os.W_OK):
        raise errors.UserError(f"FUSE is not available: no read/write access to {device}", errors.EXIT_NO_FUSE)
    if os.geteuid() != 0 and fusermount_path() is None:
        raise errors.UserError(
            "FUSE is not available: fusermount3 not found on PATH (apt-get install fuse3)", errors.EXIT_NO_FUSE
        )


def check_allow_other_permitted(allow_other: bool, fuse_conf: str = "/etc/fuse.conf") -> None:
    """fusermount3 refuses allow_other to a user other than root unless fuse.conf says
    user_allow_other; said here, since a daemonised mount would only report "failed"."""
    if not allow_other or os.geteuid() == 0:
        return
    try:
        with open(fuse_conf) as f:
            if any(line.split("#", 1)[0].strip() == "user_allow_other" for line in f):
                return
    except OSError:
        pass
    raise errors.UserError(f"--allow-other needs root or a 'user_allow_other' line in {fuse_conf}", errors.EXIT_USAGE)


def _is_dead_mount(path: str) -> bool:
    try:
        os.listdir(path)
        return False
    except OSError as exc:
        return exc.errno == errno.ENOTCONN


def check_mountpoint(path: str) -> None:
    """The mountpoint must be an existing, empty directory that is not a mount.

    A dead FUSE mount left by a crashed daemon (ENOTCONN) is detached first, so a new
    mount recovers the path without a reboot.
    """
    try:
        if os.path.lexists(path) and _is_dead_mount(path):
            log.warning("%s is a dead FUSE mount (crashed daemon?); detaching it", path)
            unmount(path, lazy=True)
        st = os.stat(path)
    except FileNotFoundError:
        raise errors.UserError(f"mountpoint {path} does not exist", errors.EXIT_BAD_MOUNTPOINT) from None
    except OSError as exc:
        raise errors.UserError(f"mountpoint {path}: {exc.strerror}", errors.EXIT_BAD_MOUNTPOINT) from None
    if not stat_mod.S_ISDIR(st.st_mode):
        raise errors.UserError(f"mountpoint {path} is not a directory", errors.EXIT_BAD_MOUNTPOINT)
    if os.path.ismount(path):
        raise errors.UserError(
            f"mountpoint {path} is already a mount (bucketfs unmount {path} first)", errors.EXIT_BAD_MOUNTPOINT
        )
    try:
        if os.listdir(path):
            raise errors.UserError(f"mountpoint {path} is not empty", errors.EXIT_BAD_MOUNTPOINT)
    except PermissionError:
        raise errors.UserError(f"mountpoint {path}: permission denied", errors.EXIT_BAD_MOUNTPOINT) from None


def _unescape_mountinfo(field: str) -> str:
    # The kernel writes space, tab, newline and backslash as \ooo octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_entry(path: str) -> Optional[tuple]:
    """(fstype, source) of the topmost mount on `path` (a resolved path), or None.

    Read from /proc/self/mountinfo rather than by stat: a stat of a mount this very
    process serves could wait on itself, and a dead one fails."""
    entry = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            separator = fields.index("-")
            if _unescape_mountinfo(fields[4]) == path:
                entry = (fields[separator + 1], _unescape_mountinfo(fields[separator + 2]))  # later lines are on top
    return entry


def check_ours_to_unmount(path: str) -> None:
    """Only a bucketfs mount, or a dead FUSE mount (a crashed daemon), may be unmounted:
    `bucketfs unmount` on a path holding some other filesystem must not detach it."""
    entry = mount_entry(path)
    if entry is None:
        raise errors.UserError(f"{path} is not mounted", errors.EXIT_BAD_MOUNTPOINT)
    fstype, source = entry
    if fstype == FUSE_TYPE:
        return
    if fstype.split(".")[0] in ("fuse", "fuseblk") and _is_dead_mount(path):
        return
    raise errors.UserError(
        f"{path} is not a bucketfs mount (it is {fstype} from {source}); not unmounting it", errors.EXIT_BAD_MOUNTPOINT
    )


def unmount(path: str, lazy: bool = False, timeout_s: float = 30) -> None:
    """Detach a mount (ours or a dead one); raises UserError if it cannot."""
    check_ours_to_unmount(path)
    tool = fusermount_path()
    if tool is not None:
        cmd = [tool, "-u"] + (["-z"] if lazy else []) + [path]
    elif os.geteuid() == 0:
        cmd = ["umount"] + (["-l"] if lazy else []) + [path]
    else:
        raise errors.UserError("cannot unmount: fusermount3 not found on PATH", errors.EXIT_NO_FUSE)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise errors.UserError(
            f"unmount {path}: {cmd[0]} did not finish within {timeout_s:.0f} s", errors.EXIT_BAD_MOUNTPOINT
        ) from None
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        detail = msg[-1] if msg else f"exit {proc.returncode}"
        if "busy" in detail.lower() and not lazy:
            detail += " (files are open; use --lazy to detach now and finish when they close)"
        raise errors.UserError(f"unmount {path}: {detail}", errors.EXIT_BAD_MOUNTPOINT)
