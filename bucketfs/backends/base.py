"""The backend contract, and the one helper through which blocking SDK calls run.

Contract (every backend, tested by tests/contract):
- Keys are full object keys (the mount prefix included). Ranges are half-open
  `[start, end)`; `end` past the object's size is clipped; `start >= size` gives b"".
- `version` is an opaque string (S3 ETag without quotes, GCS generation; on stores
  that state no ETag, what versions.py derives from what they do state). A read
  pinned to a version either returns bytes of exactly that version or raises
  ObjectChanged: never bytes of another version.
- Errors are the types of bucketfs.errors: NotFound, AccessDenied, ObjectChanged,
  TransientError (already retried), BackendError, BucketNotFound,
  EndpointUnreachable.
- Every backend counts its requests by type in `self.requests` (a Counter) and the
  payload bytes it fetched in `self.bytes_fetched`.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import logging
import random
import time
from typing import Awaitable, Callable, Optional, TypeVar

import trio

from bucketfs import errors
from bucketfs.backends import versions
from bucketfs.backends.digests import CorruptBody
from bucketfs.backends.slots import PrioritySlots

log = logging.getLogger(__name__)

T = TypeVar("T")


# A body must keep arriving. The socket's read timeout bounds each wait for bytes, not
# a body that trickles in (a byte every few seconds held a reader for hours, past
# --read-timeout x --retries). An attempt gets the read timeout plus its body at this
# rate, then it is cut and retried: 8 MiB may take 2 min, far below any store's pace.
MIN_BODY_RATE_BYTES_PER_S = 64 * 1024
# read1's most per receive: a receive returns what the socket has, usually far less.
READ1_MAX_BYTES = 1 << 20


def body_deadline_s(read_timeout_s: float, body_bytes: int) -> float:
    """When (time.monotonic) an attempt receiving `body_bytes` is given up."""
    return time.monotonic() + read_timeout_s + body_bytes / MIN_BODY_RATE_BYTES_PER_S


def read_body(response, deadline_s: float, start: int = 0, end: Optional[int] = None) -> bytes:
    """The body's bytes `[start, end)` as stored (never decoded; by default all of it),
    received one socket read at a time; TimeoutError past `deadline_s` (the connection
    is closed, never handed back half read). A body shorter than its length raises as
    urllib3 does. With `end`, for a server that ignored Range and sends the whole
    object: what comes before `start` is dropped as it arrives, and reading stops at
    `end` and closes the connection, so a small read of a huge object holds only its
    range in memory."""
    chunks = []
    offset_bytes = 0
    try:
        while end is None or offset_bytes < end:
            chunk = response.read1(READ1_MAX_BYTES, decode_content=False)
            if not chunk:
                break
            # (The whole chunk, the common case, is the same object: no copy.)
            piece = chunk[max(start - offset_bytes, 0):None if end is None else end - offset_bytes]
            if piece:
                chunks.append(piece)
            offset_bytes += len(chunk)
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"body still arriving at its deadline ({offset_bytes} bytes)")
    except BaseException:
        response.close()
        raise
    if end is not None:
        response.close()  # the rest of the body was not read: the connection is spent
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_range_body(response, read_timeout_s: float, start: int, end: int, whole_object: bool) -> bytes:
    """A ranged GET's body, `[start, end)`. `whole_object`: the server ignored Range (a
    200 without Content-Range) and sends the whole object, of which only the range is
    kept (read_body)."""
    if whole_object:
        return read_body(response, body_deadline_s(read_timeout_s, end), start, end)
    return read_body(response, body_deadline_s(read_timeout_s, end - start))


def copy_into(buffer: bytearray, data: bytes) -> int:
    """`data` written at the start of `buffer`; its length (read_range_into's answer)."""
    buffer[: len(data)] = data
    return len(data)


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str
    size_bytes: int
    mtime_ns: int
    version: str


@dataclasses.dataclass(frozen=True)
class ListPage:
    """One page of a delimited listing: objects and common prefixes directly under `prefix`."""

    objects: list  # list[ObjectInfo]
    prefixes: list  # list[str], full prefixes ending in the delimiter
    next_token: Optional[str]


class Backend(abc.ABC):
    """Async, read-only access to one bucket."""

    # True where read_range_into receives the body into the caller's buffer itself.
    # Elsewhere it only copies read_range's bytes into it, and the prefetcher does
    # better to keep those bytes than to pay a second copy into a part buffer.
    receives_into = False
    redirects_count = 0  # redirects followed (S3: AIStore's gateways send GETs to targets)

    def __init__(self) -> None:
        self.requests: collections.Counter = collections.Counter()
        self.bytes_fetched = 0
        # GETs by the way they went, where a backend has more than one (S3 and GCS:
        # "curl" or "threads"); the counters show which one a mount's reads take.
        self.get_paths: collections.Counter = collections.Counter()

    @abc.abstractmethod
    async def list_page(self, prefix: str, token: Optional[str] = None) -> ListPage:
        """One page (<= 1000 entries) of the listing of `prefix` with delimiter '/'."""

    @abc.abstractmethod
    async def stat(self, key: str) -> ObjectInfo:
        """Metadata of one object; NotFound if it does not exist."""

    @abc.abstractmethod
    async def read_range(self, key: str, start: int, end: int, version: str, object_bytes: Optional[int] = None) -> bytes:
        """Bytes `[start, end)` of `key` at `version`; ObjectChanged if it changed or is
        gone (a handle was opened on a listed object: "no such file" would contradict
        the listing the reader just saw). `object_bytes`: the size the object has at `version`; an answer that reports
        another total size (Content-Range) is ObjectChanged too."""

    async def read_range_into(self, key: str, start: int, end: int, version: str, buffer: bytearray,
                              object_bytes: Optional[int] = None) -> int:
        """Like read_range, into `buffer` (any writable buffer of at least `end - start`
        bytes: a bytearray or an anonymous mmap): the number of bytes written.
        Backends that can receive straight into it override this."""
        return copy_into(buffer, await self.read_range(key, start, end, version, object_bytes=object_bytes))

    @abc.abstractmethod
    async def check_bucket(self, prefix: str) -> bool:
        """Cheap probe before mounting: raises BucketNotFound, AccessDenied or
        EndpointUnreachable. True if `prefix` lists anything besides its own directory
        marker (a mistyped prefix mounts as an empty directory: the caller says so)."""

    async def aclose(self) -> None:
        """Release connections and threads."""

    async def confirm_past_end(self, key: str, version: str, start: int) -> bytes:
        """A 416 (range starts past the end) names no version: a replacement shorter
        than the range would read as EOF. Rare (the core knows sizes from the listing):
        confirm with one metadata request that the pinned version is still there, and
        that `start` is past its end (else the server is wrong: EIO, not an EOF the core
        would take for a changed object)."""
        try:
            current = await self.stat(key)
        except errors.NotFound:
            raise errors.ObjectChanged(gone_message(key)) from None
        if not versions.still(version, current):
            raise errors.ObjectChanged(f"{key}: version {version} is now {current.version}")
        if start < current.size_bytes:
            raise errors.BackendError(f"{key}: 416 for bytes from {start}, inside its {current.size_bytes} bytes")
        return b""


class ShortBody(ConnectionError):
    """An answer for the pinned version with fewer bytes than the range asked for (a
    cut Content-Length, a proxy's partial answer): the object did not change, so it is
    retried like a reset, not reported as ESTALE."""


def check_answer(key: str, start: int, end: int, received_bytes: Optional[int], content_range: Optional[str],
                 object_bytes: Optional[int]) -> None:
    """Check a ranged GET's answer, once it is known to be of the pinned version (a
    short answer of another version is ObjectChanged, not retried), against its
    `Content-Range: bytes a-b/TOTAL`, parsed here only. In the worker thread: there
    BlockingCaller retries the ShortBody, and passes the bucketfs errors on at once.
    - ShortBody: fewer than the `[start, end)` bytes asked for came, clipped at TOTAL
      (a range may run past the object's end). `received_bytes` None: not checked.
    - BackendError: an answer for a range starting elsewhere (its bytes belong at
      another offset).
    - ObjectChanged: TOTAL is not `object_bytes`, the pinned version's size (None: not
      compared). A server that ignores If-Match and serves a rewrite can still name the
      old ETag (a store whose writes are not atomic); the size is a second witness.
    Nothing to check without the header (the whole object came, read as far as the
    range: it cannot be short; a body cut early raises in read_body) or with `*`."""
    if not content_range:
        return
    span, _, total = content_range.removeprefix("bytes").strip().partition("/")
    first, total = span.partition("-")[0], total.strip()
    answered_bytes = int(total) if total.isdigit() else None
    if received_bytes is not None and answered_bytes is not None:
        expected_bytes = max(min(end, answered_bytes) - start, 0)
        if received_bytes < expected_bytes:
            raise ShortBody(f"GET {key!r} [{start}, {end}): {received_bytes} bytes of {expected_bytes}")
    if first.isdigit() and int(first) != start:
        raise errors.BackendError(f"{key}: asked for bytes from {start}, answered {content_range!r}")
    if object_bytes is not None and answered_bytes is not None and answered_bytes != object_bytes:
        raise errors.ObjectChanged(f"{key}: {object_bytes} bytes when listed, {total} now")


def lists_entries(keys, prefixes_count: int, prefix: str) -> bool:
    """What check_bucket answers, from a probe page of at most two entries (the
    first of which may be the prefix's own directory marker)."""
    return prefixes_count > 0 or any(key != prefix for key in keys)


def gone_message(key: str) -> str:
    return (f"{key}: gone since it was listed (deleted, or a name the store lists but "
            "cannot serve)")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    attempts_count: int = 5
    base_delay_s: float = 0.1
    max_delay_s: float = 5.0

    def delay_s(self, attempt: int) -> float:
        # "Full jitter" backoff: spreads retries of many readers hitting one throttled prefix.
        return random.uniform(0, min(self.max_delay_s, self.base_delay_s * (2**attempt)))


class BlockingCaller:
    """Runs blocking SDK calls off the trio thread (or non-blocking ones: run), bounded, with retries.

    `classify(exc)` maps an SDK exception to a bucketfs error; TransientError is
    retried with jittered exponential backoff up to `policy.attempts_count` attempts.
    """

    def __init__(self, max_threads_count: int, policy: RetryPolicy, classify: Callable[[BaseException], errors.BucketfsError]):
        self.slots = PrioritySlots(max_threads_count)  # who goes next: urgent calls first
        self.limiter = trio.CapacityLimiter(max_threads_count)  # threads, abandoned ones included
        self.policy = policy
        self.classify = classify
        self.retries_count = 0
        self.corrupt_bodies_count = 0  # answers whose bytes did not match the store's checksum
        self.failures: collections.Counter = collections.Counter()  # error type name -> count

    async def call(self, what: str, fn: Callable[..., T], *args, abandon_on_cancel: bool = False) -> T:
        # abandon_on_cancel: a cancelled prefetch leaves its thread to finish alone;
        # the limiter slot is still held until then, which keeps the pool bounded.
        return await self.run(what, trio.to_thread.run_sync, fn, *args, limiter=self.limiter,
                              abandon_on_cancel=abandon_on_cancel)

    async def run(self, what: str, attempt_fn: Callable[..., Awaitable[T]], *args, **kwargs) -> T:
        """`await attempt_fn(*args, **kwargs)` in a slot, with call()'s retries and
        classification: for calls that do not block (http/curl.py's transfers)."""
        attempt = 0
        while True:
            try:
                async with self.slots:
                    return await attempt_fn(*args, **kwargs)
            except errors.BucketfsError:
                raise
            except Exception as exc:  # noqa: BLE001 - every SDK failure is classified here
                if isinstance(exc, CorruptBody):
                    self.corrupt_bodies_count += 1
                err = self.classify(exc)
                attempt += 1
                if isinstance(err, errors.TransientError) and attempt < self.policy.attempts_count:
                    self.retries_count += 1
                    delay_s = self.policy.delay_s(attempt)
                    log.warning("%s failed (%s); retry %d/%d in %.2fs", what, err, attempt, self.policy.attempts_count - 1, delay_s)
                    await trio.sleep(delay_s)
                    continue
                self.failures[type(err).__name__] += 1
                raise err from exc
