"""Plain error types shared by every layer, and the CLI's exit codes.

Invariant: this module imports nothing from bucketfs. The FUSE adapter maps these
types to errno in one table; the CLI maps `UserError.exit_code` to the process's
exit status.
"""

import errno


class BucketfsError(Exception):
    """Base of every error bucketfs raises on purpose."""

    errno_value = errno.EIO


class NotFound(BucketfsError):
    """The object, prefix or directory entry does not exist."""

    errno_value = errno.ENOENT


class ObjectChanged(BucketfsError):
    """The object no longer has the version an open handle is pinned to."""

    errno_value = errno.ESTALE


class AccessDenied(BucketfsError):
    """The store refused the request (403, missing or bad credentials)."""

    errno_value = errno.EACCES


class ReadOnly(BucketfsError):
    """A write operation on the read-only mount."""

    errno_value = errno.EROFS


class TransientError(BucketfsError):
    """Throttling, 5xx, resets, timeouts: worth retrying with backoff."""

    errno_value = errno.EIO


class BackendError(BucketfsError):
    """Any other backend failure; the reader gets EIO."""

    errno_value = errno.EIO


class BucketNotFound(BucketfsError):
    """The bucket itself does not exist (checked before mounting)."""

    errno_value = errno.ENOENT


class EndpointUnreachable(BucketfsError):
    """The endpoint could not be reached within the connect deadline."""

    errno_value = errno.EIO


# Exit codes of the CLI: one per class of user error, so scripts can tell them apart.
EXIT_OK = 0
EXIT_FAILURE = 1  # unexpected failure (a bug): logged with its traceback
EXIT_USAGE = 2  # argparse's own code for bad options; also bad URL / unknown scheme
EXIT_BUCKET_NOT_FOUND = 3
EXIT_ACCESS_DENIED = 4
EXIT_ENDPOINT_UNREACHABLE = 5
EXIT_BAD_MOUNTPOINT = 6
EXIT_NO_FUSE = 7
EXIT_MOUNT_FAILED = 8  # the kernel refused the mount or the mount never answered
EXIT_BAD_CACHE_DIR = 9  # --cache-dir cannot be created, written or read


class UserError(Exception):
    """A problem the user must fix: printed as one line, no traceback."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def user_error_for(exc: BucketfsError, what: str) -> UserError:
    """Turn a backend error met while checking the bucket into a UserError."""
    if isinstance(exc, BucketNotFound):
        return UserError(f"{what}: bucket does not exist", EXIT_BUCKET_NOT_FOUND)
    if isinstance(exc, AccessDenied):
        return UserError(f"{what}: access denied ({exc})", EXIT_ACCESS_DENIED)
    if isinstance(exc, (EndpointUnreachable, TransientError)):
        return UserError(f"{what}: endpoint unreachable ({exc})", EXIT_ENDPOINT_UNREACHABLE)
    return UserError(f"{what}: {exc}", EXIT_FAILURE)
