"""The disk cache's directories under --cache-dir: which one a mount uses, and the
locks that say who uses it.

Invariants:
- One directory per bucket URL and endpoint (`<scheme>-<bucket>-<digest>`), kept
  across mounts and shared by every mount and `bucketfs warm` of them on the host
  (the journal, journal.py, makes that safe). Each holds a shared flock on the
  directory itself (an O_DIRECTORY descriptor) as long as its process lives, however
  it ends; one that finds it could take the lock exclusively is `alone` at start
  (it may then repair and rewrite what the others would be reading). No file in it
  matters to the lock.
- The cache works only through that descriptor (dir_fd=, never the path): if the
  directory is deleted under a running mount, its writes fail (ENOENT, a write error)
  and its reads miss, while the next mount makes and locks a new directory at the
  path. A mount never writes into a directory it did not lock.
- A directory locked exclusively (by an earlier version of bucketfs, whose cache
  was one mount's) leaves a new mount a private directory
  (`bucketfs-<pid>-<random>`), locked the same way and removed at its exit. A
  private directory whose lock can be taken belongs to no running mount (one killed
  with -9, in whatever PID namespace): every mount removes those before it starts.
  One whose lock is held is never touched (a PID says nothing across namespaces or
  after reuse).
- `bucketfs warm` shares the kept directory a mount of its URL uses, and fails
  (exit 9) rather than warming a private one.
- No space to make a directory (ENOSPC, EDQUOT, EIO): the mount runs without a disk
  cache (logged). A directory that cannot be made for any other reason (EACCES,
  EROFS, ENOTDIR...) is the user's to fix: exit 9.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Optional

from bucketfs import errors

log = logging.getLogger(__name__)

_PRIVATE_DIR_RE = re.compile(r"bucketfs-\d+-")
# Errors of a full or failing disk: the mount serves without (writing to) the disk
# cache rather than not at all. Anything else is a setup problem for the user.
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})
# A directory deleted or replaced between making it and locking it: try again.
CLAIM_ATTEMPTS = 3
# A kept directory held exclusively for a moment (another mount turning its
# exclusive lock into a shared one) is tried again for up to this long.
CLAIM_WAIT_S = 1.0
CLAIM_RETRY_S = 0.01


class CacheDir:
    """A cache directory this mount holds: `path` (for messages and removal), `fd` (a
    locked O_DIRECTORY descriptor every cache file operation goes through), whether
    it is `private` (removed by `close`) and whether no other process used it when
    it was claimed (`alone`)."""

    __slots__ = ("path", "fd", "private", "alone")

    def __init__(self, path: str, fd: int, private: bool, alone: bool = True):
        self.path, self.fd, self.private, self.alone = path, fd, private, alone

    def close(self) -> None:
        """Release it (removing it first if private, while still locked, so no other
        mount removes it at the same time)."""
        try:
            if self.private and _is_dir_of(self.path, self.fd):
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            os.close(self.fd)

    def __repr__(self) -> str:
        return f"CacheDir({self.path!r}, private={self.private})"


def check_cache_dir(path: str) -> None:
    """--cache-dir must be a directory this process can create files in (created if missing)."""
    if os.path.exists(path) and not os.path.isdir(path):
        # (makedirs would say "File exists")
        raise errors.UserError(f"--cache-dir {path} is not a directory", errors.EXIT_BAD_CACHE_DIR)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        probe = tempfile.TemporaryFile(dir=path)
        probe.close()
    except OSError as exc:
        raise dir_error(path, exc) from None


def dir_error(path: str, exc: OSError) -> errors.UserError:
    return errors.UserError(f"cache directory {path}: {exc.strerror or exc}", errors.EXIT_BAD_CACHE_DIR)


def _open_dir(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _is_dir_of(path: str, fd: int) -> bool:
    """`path` still names the directory `fd` is open on (not deleted, not replaced)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _share_lock(fd: int) -> Optional[bool]:
    """Hold a shared lock of `fd`: whether it could have been exclusive (no other
    holder), or None if another process holds it exclusively (past CLAIM_WAIT_S)."""
    deadline_s = time.monotonic() + CLAIM_WAIT_S
    while True:
        if _try_lock(fd):
            fcntl.flock(fd, fcntl.LOCK_SH)  # (from exclusive: never waits)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            if time.monotonic() >= deadline_s:
                return None
            time.sleep(CLAIM_RETRY_S)  # (another mount between its exclusive and shared lock)


def _open_shared(path: str) -> Optional[CacheDir]:
    """The kept directory `path` (made if missing), locked shared, or None if a process
    holds it exclusively."""
    for _ in range(CLAIM_ATTEMPTS):
        os.makedirs(path, mode=0o700, exist_ok=True)
        try:
            fd = _open_dir(path)
        except FileNotFoundError:
            continue  # (deleted between the two: make it again)
        alone = _share_lock(fd)
        if alone is None:
            os.close(fd)
            return None
        if _is_dir_of(path, fd):
            return CacheDir(path, fd, private=False, alone=alone)
        os.close(fd)  # (deleted or replaced before we held it)
    raise OSError(errno.EAGAIN, f"{path} keeps being replaced")


def claim_dir(path: str, identity: str, name_hint: str) -> Optional[CacheDir]:
    """The cache directory under `path` of the mount `identity` (its bucket URL and
    endpoint), kept across mounts, shared with the other mounts of it and locked until
    closed (or the process ends). If a process holds it exclusively (an earlier
    version's mount): a private directory, removed by close(). None if the disk has no
    room for one (the mount then runs without a disk cache)."""
    directory = shared_dir_path(path, identity, name_hint)
    try:
        remove_stale_private_dirs(path)
        shared = _open_shared(directory)
        if shared is not None:
            return shared
        private = _make_private_dir(path)
    except OSError as exc:
        if exc.errno in NO_SPACE_ERRNOS:
            log.warning(
                "disk cache: no room in %s (%s); this mount runs without a disk cache", path, exc.strerror or exc
            )
            return None
        raise dir_error(path, exc) from None
    log.warning(
        "disk cache %s is held exclusively by another mount of %s (an earlier bucketfs); "
        "this one caches in %s, removed at exit",
        directory,
        identity,
        private.path,
    )
    return private


def mount_identity(url, endpoint_url: Optional[str]) -> tuple:
    """(identity, name hint) of the cache directory of a mount of `url` (a BucketURL)
    at `endpoint_url`: what claim_dir and claim_shared_dir are given."""
    return f"{url} at {endpoint_url or 'the default endpoint'}", f"{url.scheme}-{url.bucket}"


def shared_dir_path(path: str, identity: str, name_hint: str) -> str:
    """The directory under `path` kept across mounts of `identity`."""
    digest = hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(path, f"{re.sub(r'[^A-Za-z0-9._-]', '_', name_hint)[:64]}-{digest}")


def claim_shared_dir(path: str, identity: str, name_hint: str) -> CacheDir:
    """The directory under `path` kept across mounts of `identity`, shared and locked
    until closed (`bucketfs warm`: a private directory would be removed at exit, so one
    held exclusively is an error, exit 9, not a fallback)."""
    directory = shared_dir_path(path, identity, name_hint)
    try:
        remove_stale_private_dirs(path)
        shared = _open_shared(directory)
    except OSError as exc:
        raise dir_error(path, exc) from None
    if shared is None:
        raise errors.UserError(
            f"cache directory {directory} is held exclusively by a running mount of {identity} "
            "(an earlier bucketfs: warm once it is unmounted, or through the mountpoint)",
            errors.EXIT_BAD_CACHE_DIR,
        )
    return shared


def _make_private_dir(path: str) -> CacheDir:
    """This mount's own locked directory under `path`, removed by close()."""
    for _ in range(CLAIM_ATTEMPTS):
        private = tempfile.mkdtemp(prefix=f"bucketfs-{os.getpid()}-", dir=path)
        try:
            fd = _open_dir(private)
        except FileNotFoundError:
            continue  # (another mount took it for stale before we locked it)
        # Another mount may have locked it as stale in between (our lock fails), or
        # removed it already (it is no longer at its path).
        if _try_lock(fd) and _is_dir_of(private, fd):
            return CacheDir(private, fd, private=True)
        os.close(fd)
    raise OSError(errno.EAGAIN, f"could not make a private directory in {path}")


def remove_stale_private_dirs(path: str) -> int:
    """Remove the private directories under `path` no running mount holds (their lock
    can be taken); how many."""
    removed = 0
    for name in os.listdir(path):
        if not _PRIVATE_DIR_RE.match(name):
            continue
        private = os.path.join(path, name)
        try:
            fd = _open_dir(private)
        except OSError:
            continue  # (not a directory, or gone)
        try:
            if _try_lock(fd):  # nobody holds it: its mount is gone
                log.info("removing %s, left by a mount that is gone", private)
                shutil.rmtree(private, ignore_errors=True)
                removed += 1
        finally:
            os.close(fd)
    return removed
