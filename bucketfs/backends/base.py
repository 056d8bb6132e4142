"""The backend contract: what every backend answers, and the checks of an answer
every HTTP backend applies.

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
- Read-only, but for `upload`, which only `bucketfs index build --out URL` calls
  (the index may live in the bucket it describes).

The machinery behind it lives beside it: retries and the worker threads of blocking
calls in calls.py, connection slots in slots.py, receiving bodies in http/body.py.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import typing
from typing import Callable, Optional

from bucketfs import errors
from bucketfs.backends import versions
from bucketfs.backends.pages import FreshPages


class ObjectInfo(typing.NamedTuple):
    """One listed object. A named tuple, not a dataclass: a listing makes one per key
    (index build: hundreds of thousands), and a tuple is made in a third of the time
    and takes half the memory; immutable and compared by value all the same."""

    key: str
    size_bytes: int
    mtime_ns: int
    version: str


PAGE_KEYS_MAX = 1000  # the most a LIST page holds, on S3 and GCS


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

    def __init__(self) -> None:
        self.requests: collections.Counter = collections.Counter()
        self.bytes_fetched = 0
        # GETs by the way they went, where a backend has more than one (S3 and GCS:
        # "curl" or "threads"); the counters show which one a mount's reads take.
        self.get_paths: collections.Counter = collections.Counter()
        # Fresh receive buffers faulted in before their GETs, and what that cost.
        self.fresh_pages = FreshPages()

    @property
    def redirects_count(self) -> int:
        """Redirects followed (S3: AIStore's gateways send GETs to their targets)."""
        return 0

    @property
    def fetch_workers(self) -> tuple:
        """(fetch worker processes running, workers replaced after they ended): (0, 0)
        without --fetch-workers."""
        return 0, 0

    @property
    def fetch_ahead_workers(self) -> tuple:
        """(fetch-ahead worker processes running, workers replaced): start_pushing's."""
        return 0, 0

    def start_pushing(self, kernel_fd: int, workers_count: int, transfers_count: int, keep_bytes: int = 0) -> bool:
        """Start worker processes that fetch whole objects straight into the kernel's page
        cache of the mount whose /dev/fuse descriptor is `kernel_fd` (push_whole), each
        with up to `transfers_count` GETs in flight; False where this backend cannot.
        `keep_bytes`: the most that pushes in flight and their kept copies (KeptBody)
        take together; 0: nothing kept."""
        return False

    @property
    def pushes(self) -> bool:
        """Whether a push may succeed now: start_pushing's workers run, and the store
        gave no reason to stop (an S3 store that answers GETs with redirects)."""
        return False

    async def push_whole(self, key: str, version: str, size_bytes: int, ino: int, request: PushRequest) -> tuple:
        """Fetch object `key` of `version` (`size_bytes`) whole, check it, and put it into
        inode `ino`'s page cache, in a worker (start_pushing): (outcome, body). PUSHED;
        PUSH_READ with the checked body, once `request` asked for it; or why not
        (PUSH_NO_INODE: the kernel holds no such inode; PUSH_REFUSED: the answer failed
        a check; PUSH_FAILED: the GET failed), not retried: the reader's READ fetches
        what was not pushed, with every check and retry. `body` is None but for PUSH_READ
        and, where `start_pushing` was given `keep_bytes`, a KeptBody for PUSHED."""
        return PUSH_REFUSED, None

    def push_soon(
        self, key: str, version: str, size_bytes: int, ino: int, request: PushRequest, on_end: Callable
    ) -> bool:
        """push_whole with no task waiting on it, where the backend can start it now:
        `on_end(outcome, body)` is called once it ended (push_whole's result), from the
        backend's own tasks. False, and nothing started, where it cannot: push_whole."""
        return False

    @abc.abstractmethod
    async def list_page(self, prefix: str, token: Optional[str] = None) -> ListPage:
        """One page (<= 1000 entries) of the listing of `prefix` with delimiter '/'."""

    async def list_flat_page(
        self, prefix: str, start_after: str = "", end: Optional[str] = None, keys_max: int = PAGE_KEYS_MAX
    ) -> ListPage:
        """One page (<= `keys_max`, at most 1000 objects) of every key under `prefix`, subdirectories' too
        (no delimiter), strictly after `start_after`, in key order (UTF-8 byte order,
        which is code point order); `prefixes` is empty. `next_token` is the key to
        give as `start_after` for the next page (the page's last), or None at the end.
        A listing can thus start anywhere: `bucketfs index build` lists key ranges of
        one prefix in parallel (S3 StartAfter, GCS startOffset).
        `end`: the caller wants no key past it. A page may still hold some (a store
        answers whole pages), but a backend need not decode them, nor ask for them
        where the store takes an end (GCS endOffset). `keys_max` below 1000 asks the
        store for a shorter page (S3 max-keys): a caller that expects `end` within a
        few keys spares the store the rest of a page it would throw away."""
        raise NotImplementedError(f"{type(self).__name__} has no flat listing")

    async def upload(self, key: str, data: bytes) -> None:
        """Store `data` as object `key` (replacing it): the one write, used only by
        `bucketfs index build --out URL`; a mount never writes."""
        raise NotImplementedError(f"{type(self).__name__} cannot store objects")

    @abc.abstractmethod
    async def stat(self, key: str) -> ObjectInfo:
        """Metadata of one object; NotFound if it does not exist."""

    @abc.abstractmethod
    async def read_range(
        self, key: str, start: int, end: int, version: str, object_bytes: Optional[int] = None
    ) -> bytes:
        """Bytes `[start, end)` of `key` at `version`; ObjectChanged if it changed or is
        gone (a handle was opened on a listed object: "no such file" would contradict
        the listing the reader just saw). `object_bytes`: the size the object has at `version`; an answer that reports
        another total size (Content-Range) is ObjectChanged too."""

    async def read_range_into(
        self, key: str, start: int, end: int, version: str, buffer: bytearray, object_bytes: Optional[int] = None
    ) -> int:
        """Like read_range, into `buffer` (any writable buffer of at least `end - start`
        bytes: a bytearray or an anonymous mmap): the number of bytes written.
        Backends that can receive straight into it override this."""
        data = await self.read_range(key, start, end, version, object_bytes=object_bytes)
        buffer[: len(data)] = data
        return len(data)

    @abc.abstractmethod
    async def check_bucket(self, prefix: str) -> bool:
        """Cheap probe before mounting: raises BucketNotFound, AccessDenied or
        EndpointUnreachable. True if `prefix` lists anything besides its own directory
        marker (a mistyped prefix mounts as an empty directory: the caller says so)."""

    async def aclose(self) -> None:  # noqa: B027 - nothing to release by default (the in-memory fake)
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


# push_whole's outcomes. PUSH_READ: a reader's READ waited for the file, and its body
# came back to the daemon instead (PushRequest.ask_for_body).
PUSHED, PUSH_READ, PUSH_NO_INODE, PUSH_REFUSED, PUSH_FAILED = "pushed", "read", "no_inode", "refused", "failed"


class PushRequest:
    """One push_whole call's link to its caller: `ask_for_body()` (a READ of the file
    waits) has the worker send the body back rather than write it into the kernel (whose
    write would wait for that READ's pages). `tell_open`: the push also ends the inode's
    cached attributes, so that its reader's first stat() is a GETATTR (the daemon hears
    of the open)."""

    __slots__ = ("wanted", "want", "tell_open")

    def __init__(self, tell_open: bool) -> None:
        self.tell_open = tell_open
        self.wanted = False
        self.want: Optional[Callable[[], None]] = None  # set by the backend once the push is sent

    def ask_for_body(self) -> None:
        if not self.wanted:
            self.wanted = True
            if self.want is not None:
                self.want()


class KeptBody:
    """A copy of a pushed file that push_whole hands back with PUSHED, for the daemon to
    keep (an epoch after the kernel dropped its page cache reads it from there):
    `length_bytes`, reserved in the memory budget by the caller while it keeps it.
    `read(start, end)` copies bytes out of it (None once it is gone), until it is
    `discard`ed; the backend may take it back itself (for room: http/arena.py), and
    calls `on_dropped` then. This one holds bytes; the fetch-ahead workers' are pages
    of shared memory."""

    __slots__ = ("_data", "length_bytes", "on_dropped")

    def __init__(self, data: Optional[bytes], length_bytes: int):
        self._data, self.length_bytes = data, length_bytes
        self.on_dropped: Optional[Callable[[], None]] = None  # (set by its keeper)

    def read(self, start: int, end: int) -> Optional[bytes]:
        return None if self._data is None else self._data[start:end]

    def discard(self, give_back: bool) -> None:
        """Let go of it; `give_back`: its memory goes back to the system now."""
        self._data = None


def check_answer(
    key: str,
    start: int,
    end: int,
    received_bytes: Optional[int],
    content_range: Optional[str],
    object_bytes: Optional[int],
) -> None:
    """Check a ranged GET's answer, once it is known to be of the pinned version (a
    short answer of another version is ObjectChanged, not retried), against its
    `Content-Range: bytes a-b/TOTAL`, parsed here only. In the worker thread: there
    BlockingCaller (calls.py) retries the ShortBody, and passes the bucketfs errors on
    at once.
    - ShortBody: fewer than the `[start, end)` bytes asked for came, clipped at TOTAL
      (a range may run past the object's end). `received_bytes` None: not checked.
    - BackendError: an answer for a range starting elsewhere (its bytes belong at
      another offset).
    - ObjectChanged: TOTAL is not `object_bytes`, the pinned version's size (None: not
      compared). A server that ignores If-Match and serves a rewrite can still name the
      old ETag (a store whose writes are not atomic); the size is a second witness.
    Nothing to check without the header (the whole object came, read as far as the
    range: it cannot be short; a body cut early raises in http/body.py's read_body) or
    with `*`."""
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
    return f"{key}: gone since it was listed (deleted, or a name the store lists but cannot serve)"
