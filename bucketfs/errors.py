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


class InvalidOption(BucketfsError):
    """The SDK refused an option value (an endpoint URL, a region) while building a client."""

    errno_value = errno.EINVAL


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
EXIT_METRICS_PORT = 10  # --metrics-port cannot be bound (in use, or not allowed)
EXIT_BAD_INDEX = 11  # --index missing, unreadable, no bucketfs index, or damaged
EXIT_INDEX_VERSION = 12  # --index of a format version this bucketfs does not read
EXIT_INDEX_OTHER_URL = 13  # --index built for another bucket URL
EXIT_INTERRUPTED = 130  # Ctrl-C before the mount answered (128 + SIGINT, as shells report it)
# Output cut short (`bucketfs stats M | head -1`): exit as a tool killed by SIGPIPE does,
# as shells report it (128 + 13), without a traceback.
EXIT_BROKEN_PIPE = 141

# What each code means, as docs/configuration.md lists them (generated from this).
EXIT_MEANINGS = {
    EXIT_OK: "mounted (or unmounted)",
    EXIT_FAILURE: "unexpected failure (a bug: the message names the exception; the log, or `--foreground`, has the trace)",
    EXIT_USAGE: "bad usage: malformed URL, unknown scheme, bad option value",
    EXIT_BUCKET_NOT_FOUND: "the bucket does not exist",
    EXIT_ACCESS_DENIED: "access denied, or no credentials",
    EXIT_ENDPOINT_UNREACHABLE: "endpoint unreachable (answers within ~30 s)",
    EXIT_BAD_MOUNTPOINT: "mountpoint missing, not a directory, not empty, or already a mount",
    EXIT_NO_FUSE: "FUSE unavailable (`/dev/fuse` or `fusermount3` missing)",
    EXIT_MOUNT_FAILED: "the kernel or fusermount3 refused the mount (the message gives their reason), or the daemon "
    "exited before the mount answered",
    EXIT_BAD_CACHE_DIR: "`--cache-dir` cannot be created, written or read (its journal included)",
    EXIT_METRICS_PORT: "`--metrics-port` cannot be bound (in use by another process)",
    EXIT_BAD_INDEX: "`--index` cannot be read (no such file or object), is no bucketfs index, or is damaged "
    "(its checksum does not match): build it again",
    EXIT_INDEX_VERSION: "`--index` has a format version this bucketfs does not read (a newer bucketfs wrote it)",
    EXIT_INDEX_OTHER_URL: "`--index` is the index of another bucket URL than the one mounted",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C) before the mount answered; nothing is left mounted or running",
    EXIT_BROKEN_PIPE: "`bucketfs stats` output cut short by its reader (`| head -1`), quietly, as a tool killed by SIGPIPE",
}

# Codes no restart can fix without a change by the user: systemd's unit lists them in
# RestartPreventExitStatus= (tests check it matches). An unreachable endpoint (5), a
# mount the kernel refused (8) or a port still held by the instance before (10) may
# clear by themselves, so those are retried.
PERMANENT_EXIT_CODES = (
    EXIT_USAGE,
    EXIT_BUCKET_NOT_FOUND,
    EXIT_ACCESS_DENIED,
    EXIT_BAD_MOUNTPOINT,
    EXIT_NO_FUSE,
    EXIT_BAD_CACHE_DIR,
    EXIT_BAD_INDEX,
    EXIT_INDEX_VERSION,
    EXIT_INDEX_OTHER_URL,
)


class UserError(Exception):
    """A problem the user must fix: printed as one line, no traceback."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def user_error_for(exc: BucketfsError, what: str, endpoint_given: bool = True) -> UserError:
    """Turn a backend error met while building the backend or checking the bucket
    (`what` is the bucket URL) into a UserError. `endpoint_given`: the user named the
    endpoint (--endpoint-url or STORAGE_EMULATOR_HOST), so a hint may point at it."""
    if isinstance(exc, InvalidOption):
        return UserError(f"{what}: {exc}", EXIT_USAGE)
    if isinstance(exc, BucketNotFound):
        return UserError(f"{what}: bucket does not exist", EXIT_BUCKET_NOT_FOUND)
    if isinstance(exc, AccessDenied):
        return UserError(f"{what}: access denied ({exc})", EXIT_ACCESS_DENIED)
    if isinstance(exc, (EndpointUnreachable, TransientError)):
        return UserError(f"{what}: endpoint unreachable ({exc})", EXIT_ENDPOINT_UNREACHABLE)
    if isinstance(exc, (NotFound, BackendError)):
        # A store names a missing bucket (NoSuchBucket: BucketNotFound above); a plain
        # 404 or an answer that is no listing at all comes from something else at
        # that address (a web server, a wrong path): the endpoint is wrong.
        # Without a named endpoint the default one answered oddly: a proxy in between,
        # not the user's option, is the suspect.
        kind = "a GCS" if what.startswith("gs://") else "an S3"
        hint = f"is --endpoint-url {kind} endpoint?" if endpoint_given else "is a proxy (HTTPS_PROXY) in the way?"
        return UserError(
            f"{what}: the endpoint's answer is not a bucket listing ({exc}): {hint}", EXIT_ENDPOINT_UNREACHABLE
        )
    return UserError(f"{what}: {exc}", EXIT_FAILURE)
