"""In-memory fake backend for unit tests of core logic (never used by a real mount).

It behaves like a strict S3: delimited, paginated, lexicographically ordered
listings; versions change on every put; reads honour the version condition. Tests
can inject failures and delays, and count requests by type.

`versions` makes it state versions as S3-compatible stores do (versions.py):
"counter" (opaque ETags "v1", "v2"...), "hash" (16-hex-digit ETags that are no MD5,
as rclone's XXH3), "none" (no ETag: Last-Modified, each put a second later than the
one before), "unpinned" (neither: reads are checked by size only).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from typing import Callable, Optional

import trio

from bucketfs import errors
from bucketfs.backends import versions as version_kinds
from bucketfs.backends.base import (
    PAGE_KEYS_MAX,
    PUSH_FAILED,
    PUSH_NO_INODE,
    PUSH_READ,
    PUSH_REFUSED,
    PUSHED,
    Backend,
    KeptBody,
    ListPage,
    ObjectInfo,
    gone_message,
)

_versions = itertools.count(1)
VERSION_MODES = ("counter", "hash", "none", "unpinned")
DEFAULT_MTIME_NS = 1_700_000_000 * 10**9


class MemoryBackend(Backend):
    receives_into = True  # stands in for S3 in unit tests, so they cover pooled part buffers

    def __init__(
        self,
        objects: Optional[dict] = None,
        page_size_count: int = 1000,
        delay_s: float = 0.0,
        versions: str = "counter",
    ):
        super().__init__()
        if versions not in VERSION_MODES:
            raise ValueError(f"versions={versions!r}: one of {VERSION_MODES}")
        self.versions = versions
        self._puts_count = 0
        self.page_size_count = page_size_count
        self.delay_s = delay_s
        self._data: dict = {}
        self._info: dict = {}
        self._sorted_keys: list = []
        # Hook for tests: called with (op, key) before each request; may raise.
        self.fail_hook: Optional[Callable[[str, str], None]] = None
        for key, data in (objects or {}).items():
            self.put(key, data)

    # -- test helpers -------------------------------------------------------
    def put(self, key: str, data: bytes, mtime_ns: Optional[int] = None) -> ObjectInfo:
        if key not in self._data:
            bisect.insort(self._sorted_keys, key)
        self._data[key] = bytes(data)
        self._puts_count += 1
        if mtime_ns is None:
            # Without ETags a store's times tell versions apart: each put a second later.
            mtime_ns = DEFAULT_MTIME_NS + (self._puts_count * 10**9 if self.versions == "none" else 0)
        if self.versions == "counter":
            version = f"v{next(_versions)}"
        elif self.versions == "hash":
            version = hashlib.blake2b(b"%d:" % next(_versions) + data, digest_size=8).hexdigest()
        else:
            version = version_kinds.of_s3("", mtime_ns if self.versions == "none" else 0)
            mtime_ns = mtime_ns if self.versions == "none" else 0
        info = ObjectInfo(key, len(data), mtime_ns, version)
        self._info[key] = info
        return info

    def delete(self, key: str) -> None:
        del self._data[key], self._info[key]
        self._sorted_keys.remove(key)

    async def _request(self, op: str, key: str) -> None:
        self.requests[op] += 1
        if self.fail_hook is not None:
            self.fail_hook(op, key)
        if self.delay_s:
            await trio.sleep(self.delay_s)
        else:
            await trio.lowlevel.checkpoint()

    # -- contract -----------------------------------------------------------
    async def list_page(self, prefix: str, token: Optional[str] = None) -> ListPage:
        await self._request("list", prefix)
        start_after = token or ""
        i = (
            bisect.bisect_right(self._sorted_keys, start_after)
            if token
            else bisect.bisect_left(self._sorted_keys, prefix)
        )
        objects: list = []
        prefixes: list = []
        last = None
        while i < len(self._sorted_keys) and len(objects) + len(prefixes) < self.page_size_count:
            key = self._sorted_keys[i]
            if not key.startswith(prefix):
                break
            rest = key[len(prefix) :]
            slash = rest.find("/")
            if slash >= 0:
                common = prefix + rest[: slash + 1]
                prefixes.append(common)
                last = common + "\U0010ffff"  # skip every key under this common prefix
                i = bisect.bisect_right(self._sorted_keys, last)
            else:
                objects.append(self._info[key])
                last = key
                i += 1
        more = i < len(self._sorted_keys) and self._sorted_keys[i].startswith(prefix)
        return ListPage(objects, prefixes, last if more else None)

    async def list_flat_page(
        self, prefix: str, start_after: str = "", end: Optional[str] = None, keys_max: int = PAGE_KEYS_MAX
    ) -> ListPage:
        await self._request("list", prefix)
        keys = self._sorted_keys
        i = bisect.bisect_right(keys, start_after) if start_after else bisect.bisect_left(keys, prefix)
        i = max(i, bisect.bisect_left(keys, prefix))
        objects: list = []
        while i < len(keys) and keys[i].startswith(prefix) and len(objects) < min(self.page_size_count, keys_max):
            if end is not None and keys[i] > end:
                return ListPage(objects, [], None)
            objects.append(self._info[keys[i]])
            i += 1
        more = i < len(keys) and keys[i].startswith(prefix)
        return ListPage(objects, [], objects[-1].key if more and objects else None)

    async def upload(self, key: str, data: bytes) -> None:
        await self._request("put", key)
        self.put(key, data)

    async def stat(self, key: str) -> ObjectInfo:
        await self._request("head", key)
        try:
            return self._info[key]
        except KeyError:
            raise errors.NotFound(key) from None

    async def read_range(
        self, key: str, start: int, end: int, version: str, object_bytes: Optional[int] = None
    ) -> bytes:
        await self._request("get", key)
        info = self._info.get(key)
        if info is None:
            raise errors.ObjectChanged(gone_message(key))
        if not self._is(info, version, object_bytes):
            raise errors.ObjectChanged(f"{key}: version {version} is now {info.version}")
        data = self._data[key][start:end]
        self.bytes_fetched += len(data)
        return data

    @staticmethod
    def _is(info: ObjectInfo, version: str, object_bytes: Optional[int]) -> bool:
        """Whether the object now (`info`) is `version`, as a store that states what
        `info.version` states can tell (versions.py), the size a second witness."""
        if object_bytes is not None and object_bytes != info.size_bytes:
            return False
        what = version_kinds.kind(version)
        if what == version_kinds.ETAG:
            return info.version == version
        if what == version_kinds.LASTMOD:
            return info.mtime_ns // version_kinds.NS_PER_S <= (version_kinds.lastmod_s(version) or 0)
        return True

    # -- pushes into a stand-in for the kernel's page cache -----------------------
    def start_pushing(self, kernel_fd: int, workers_count: int, transfers_count: int, keep_bytes: int = 0) -> bool:
        """A fake kernel: `kernel_pages` {ino: bytes} is what push_whole put into its
        page cache (tests read a pushed file from there, as the kernel would, and tell
        the filesystem with a getattr if its push ended its attributes: `attributes_ended`).
        `kernel_inodes`: the inodes it holds (None: all). With `keep_bytes`, a pushed
        file's copy comes back too (a KeptBody), as from the workers' shared memory."""
        self.keeps = keep_bytes > 0
        self.kernel_pages: dict = {}
        self.attributes_ended: set = set()
        self.kernel_inodes: Optional[set] = None
        self._pushing = True
        return True

    @property
    def pushes(self) -> bool:
        return getattr(self, "_pushing", False)

    # Whether push_soon starts pushes (as the workers' engine does once a worker runs);
    # False: every push waits in a task of the caller's (push_whole).
    pushes_soon = True

    def push_soon(self, key: str, version: str, size_bytes: int, ino: int, request, on_end) -> bool:
        """push_whole in a task of the backend's own (a system task: cancelled as the run
        ends, a failure then), `on_end(outcome, body)` once it ended."""
        if not self.pushes_soon:
            return False

        async def push() -> None:
            outcome, body = PUSH_FAILED, None
            try:
                outcome, body = await self.push_whole(key, version, size_bytes, ino, request)
            finally:
                on_end(outcome, body)

        trio.lowlevel.spawn_system_task(push, name=f"push of {key}")
        return True

    async def push_whole(self, key: str, version: str, size_bytes: int, ino: int, request) -> tuple:
        """As a worker would: the GET (fail_hook, delay), the checks, then the bytes into
        `kernel_pages`, or back to the caller if `request` asked for them meanwhile."""
        try:
            data = await self.read_range(key, 0, size_bytes, version, object_bytes=size_bytes)
        except errors.ObjectChanged:
            return PUSH_REFUSED, None
        except errors.BucketfsError:
            return PUSH_FAILED, None
        if request.wanted:
            return PUSH_READ, bytearray(data)
        if self.kernel_inodes is not None and ino not in self.kernel_inodes:
            return PUSH_NO_INODE, None
        self.kernel_pages[ino] = data
        if request.tell_open:
            self.attributes_ended.add(ino)
        return PUSHED, (KeptBody(bytes(data), size_bytes) if self.keeps else None)

    async def check_bucket(self, prefix: str) -> bool:
        await self._request("list", prefix)
        return any(key.startswith(prefix) and key != prefix for key in self._sorted_keys)
