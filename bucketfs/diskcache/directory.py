"""The disk cache's directories under --cache-dir: which one a mount uses, and the
locks that keep each one a single mount's.

Invariants:
- One directory per bucket URL and endpoint (`<scheme>-<bucket>-<digest>`), kept
  across mounts, locked by the mount using it: flock on the directory itself (an
  O_DIRECTORY descriptor), held as long as the process lives, however it ends. No
  file in it matters to the lock, so deleting one cannot hand the directory to a
  second mount.
- The cache works only through that descriptor (dir_fd=, never the path): if the
  directory is deleted under a running mount, its writes fail (ENOENT, a write error)
  and its reads miss, while the next mount makes and locks a new directory at the
  path. Two mounts never write into one directory.
- A second mount of the same URL caches in a private directory
  (`bucketfs-<pid>-<random>`), locked the same way and removed at its exit. A
  private directory whose lock can be taken belongs to no running mount (one killed
  with -9, in whatever PID namespace): every mount removes those before it starts.
  One whose lock is held is never touched (a PID says nothing across namespaces or
  after reuse).
- `bucketfs warm` locks the same kept directory a mount of its URL would, and fails
  (exit 9) rather than warming a private one if a running mount holds it.
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
from typing import Optional

from bucketfs import errors

log = logging.getLogger(__name__)

_PRIVATE_DIR_RE = re.compile(r"bucketfs-\d+-")
# Errors of a full or failing disk: the mount serves without (writing to) the disk
# cache rather than not at all. Anything else is a setup problem for the user.
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})
# A directory deleted or replaced between making it and locking it: try again.
CLAIM_ATTEMPTS = 3


class CacheDir:
    """A cache directory this mount holds: `path` (for messages and removal), `fd` (a
    locked O_DIRECTORY descriptor every cache file operation goes through) and whether
    it is `private` (removed by `close`)."""

    __slots__ = ("path", "fd", "private")

    def __init__(self, path: str, fd: int, private: bool):
        self.path, self.fd, self.private = path, fd, private

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


def _open_locked(path: str) -> Optional[int]:
    """A locked descriptor of the directory `path` (made if missing), or None if
    another mount holds it."""
    for _ in range(CLAIM_ATTEMPTS):
        os.makedirs(path, mode=0o700, exist_ok=True)
        try:
            fd = _open_dir(path)
        except FileNotFoundError:
            continue  # (deleted between the two: make it again)
        if not _try_lock(fd):
            os.close(fd)
            return None
        if _is_dir_of(path, fd):
            return fd
        os.close(fd)  # (deleted or replaced before we held it)
    raise OSError(errno.EAGAIN, f"{path} keeps being replaced")


def claim_dir(path: str, identity: str, name_hint: str) -> Optional[CacheDir]:
    """The cache directory under `path` of the mount `identity` (its bucket URL and
    endpoint), kept across mounts and locked until closed (or the process ends). If
    another live mount holds it: a private directory, removed by close(). None if the
    disk has no room for one (the mount then runs without a disk cache)."""
    directory = shared_dir_path(path, identity, name_hint)
    try:
        remove_stale_private_dirs(path)
        fd = _open_locked(directory)
        if fd is not None:
            return CacheDir(directory, fd, private=False)
        private = _make_private_dir(path)
    except OSError as exc:
        if exc.errno in NO_SPACE_ERRNOS:
            log.warning(
                "disk cache: no room in %s (%s); this mount runs without a disk cache", path, exc.strerror or exc
            )
            return None
        raise dir_error(path, exc) from None
    log.warning(
        "disk cache %s is in use by another mount of %s; this one caches in %s, removed at exit",
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
    """The directory under `path` kept across mounts of `identity`, locked until closed
    (`bucketfs warm`: a private directory would be removed at exit, so one held by a
    running mount is an error, exit 9, not a fallback)."""
    directory = shared_dir_path(path, identity, name_hint)
    try:
        remove_stale_private_dirs(path)
        fd = _open_locked(directory)
    except OSError as exc:
        raise dir_error(path, exc) from None
    if fd is None:
        raise errors.UserError(
            f"cache directory {directory} is in use by a running mount or warm of {identity} "
            "(warm before mounting, e.g. as ExecStartPre=, or warm through the mountpoint)",
            errors.EXIT_BAD_CACHE_DIR,
        )
    return CacheDir(directory, fd, private=False)


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
