"""The filesystem core: what the FUSE adapter calls, in terms of inodes and handles.

`Filesystem` holds the open file and directory handles and orchestrates open, read
and release over the components that components.py builds (namespace, block cache,
prefetcher, shard warming, the disk cache in front of the backend).

Invariants:
- Read-only: any open for writing raises ReadOnly; nothing here writes to a backend.
- An open handle is pinned to the version its node had at open; every read of
  that handle asks for that version, so a changed object gives ObjectChanged
  (ESTALE), never bytes of two versions.
- Small files (size <= small_file_bytes, known from the listing) start one GET for
  the whole object at open, so a sample costs one request however the kernel
  splits its READs. Not when the kernel was already given the whole file (the
  page cache is kept across opens, and a node is one version): a second epoch is
  served from the page cache and must not cost a GET. If the kernel did evict it,
  the first READ fetches it whole. Where fetch-ahead workers push (start_pushing),
  that GET is a worker's, its body sent back for the READs (_push_for_reader).
- Small files opened are told to `FetchAhead` (fetchahead.py), which fetches the
  rest of a tree ahead of a shuffled pass over it.
- Shard-like files are read through a `HandleReader` whose read-ahead window warms
  the heads of the shards after them; the policy is `ShardWarming` (shards.py),
  told of every open and release.
- Reads by inode (`read_inode`: the kernel opens files itself and sends READs with
  no handle) go through a handle of the inode's own, opened at its first READ as an
  open would be but pinning nothing, released once a READ reaches the file's end or
  fails, or once no READ of it came for INODE_HANDLE_IDLE_S, and at most
  INODE_HANDLES_MAX of them at once (the least recently read released first). The
  handles open when the kernel starts opening files itself become their inodes' own
  (release_all_open_handles): it sends no RELEASE for them.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import time
from typing import Optional

import cachetools
import trio

from bucketfs import errors
from bucketfs.core.components import build_components
from bucketfs.core.handlereader import HandleReader
from bucketfs.core.kept import KeptCopies
from bucketfs.core.namespace import ROOT_INO, Node
from bucketfs.core.openpush import OpenPushes
from bucketfs.core.pieces import Pieces, nbytes_of, one_buffer

log = logging.getLogger(__name__)

# What makes an open a write. Not O_APPEND: it only places writes, and a read-only
# open with it reads (as on any read-only file system).
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_CREAT

# A READ that failed after every retry is sent again by the kernel at once (a failed
# read-ahead, then the single page the reader waits on): without this, a reader of a
# store that stopped answering waited 2 x --read-timeout x --retries for its EIO. The
# same handle's next READ, if inside the failed range and within this long, fails at once.
# Only after a READ that itself waited out at least one --read-timeout: one that met a
# part failed earlier (read-ahead that ran into an outage now over) gets the kernel's
# second try, which fetches again. Short: the kernel's second try follows the failure
# at once, and a read-ahead READ that fails with no reader waiting gets none, so a
# READ later than this is a reader's own, and the store may be back (with 1 s, a
# reader who read again just after an outage was refused: a short read in CI).
KERNEL_RETRY_WINDOW_S = 0.25
# Failed READs remembered per handle: the kernel's read-ahead READs of one stream fail
# together, each a moment before the page retry of another; remembering only the last
# one made the reader wait out a second round of retries (seen in the outage test).
FAILED_READS_KEPT = 8
# Handles of reads by inode kept open at once (files read in part, or by many readers):
# each may pin a small file's bytes, as an open file does.
INODE_HANDLES_MAX = 256
# READs of a file that arrive this soon after the one that read it to its end, and
# start at most LATE_READ_SPAN_BYTES before that one, were sent before it (the kernel's
# read-ahead): they are answered through a handle that goes at once, instead of opening
# one no later READ would end. The span: the kernel's READs of one reader come from its
# read-ahead window (4 MiB where the mount could set read_ahead_kb) in READs of at most
# 4 MiB. A READ further back is another reader's, or the file read again (the next
# epoch of a small data set, its pages evicted): it opens a handle of its own and
# streams, where through throwaway handles every READ was a block-cache miss (a shard
# read again within the second: 35 handles, 1,785 misses and 25% more bytes fetched).
LATE_READ_WINDOW_S = 1.0
LATE_READ_SPAN_BYTES = 16 * 1024 * 1024
# An inode's handle no READ came for in this long is released: a READ that reaches the
# end never comes for a file whose last pages the kernel already holds (a READ of a hole
# a killed reader left, queued behind others past LATE_READ_WINDOW_S). Its next READ
# opens afresh; a stream this slow loses only its read-ahead's head start.
INODE_HANDLE_IDLE_S = 10.0


class FileHandle:
    __slots__ = (
        "node",
        "key",
        "version",
        "size_bytes",
        "reader",
        "failed_reads",
        "pinned",
        "read_bytes",
        "at_end",
        "reads_in_progress",
        "read_at_s",
    )

    def __init__(self, node: Node, key: str, reader):
        self.node, self.key = node, key
        self.version, self.size_bytes = node.version, node.size_bytes
        self.reader = reader
        self.failed_reads: list = []  # (start, end, trio time) of recent READs out of retries, oldest first
        self.pinned = False  # a small file: its blocks stay cached until it is read (BlockCache.pin)
        self.read_bytes = 0  # while pinned: read through once this reaches the size
        self.at_end = False  # a READ reached the file's end
        self.reads_in_progress = 0
        self.read_at_s = trio.current_time()  # when a READ of it last ended (trio time)


# A directory's own entries, listed ahead of its children; no child has these names.
DOT_NAMES = (".", "..")
# Child lists kept for READDIRs with no handle (8 bytes a child): directories the
# kernel is reading at once, such as 16 listed ahead plus a few walkers.
DIR_CHILDREN_KEPT_COUNT = 32


class DirHandle:
    """A snapshot of a directory's children: offsets stay stable while it is open.
    `read_from_start`: a READDIR has been answered from it (a later one from offset 0
    is a rewinddir)."""

    __slots__ = ("node", "children", "read_from_start")

    def __init__(self, node: Node, children):
        self.node, self.children, self.read_from_start = node, children, False

    def entries(self, start_index: int):
        """(name, node) from `start_index` on: "." and ".." (as every local file system
        lists them: `ls -a`, and tools that count them, expect both), then the children.
        An iterator, not a slice: copying the rest of a 100,000-entry snapshot for each
        READDIR made a listing quadratic."""
        dots = tuple(zip(DOT_NAMES, (self.node, self.node.parent)))  # the root is its own parent
        yield from dots[start_index:]
        children = self.children
        for i in range(max(start_index - len(dots), 0), len(children)):
            yield children[i].name, children[i]


class Filesystem:
    """Inodes and handles: what the FUSE adapter calls. It orchestrates the components that
    `build_components` (components.py) makes: the namespace answers metadata, the
    block cache and the prefetcher serve reads, `ShardWarming` decides what a
    shard reader warms."""

    def __init__(
        self,
        backend,
        config,
        nursery: trio.Nursery,
        disk_cache_dir: Optional[str] = None,
        disk_cache_dir_fd: Optional[int] = None,
        listing_index=None,
        disk_cache_alone: bool = True,
    ):
        """Builds its components with `build_components` (the arguments are its own)."""
        parts = build_components(
            backend, config, nursery, disk_cache_dir, disk_cache_dir_fd, listing_index, disk_cache_alone
        )
        self.config = config
        self.stats = parts.stats
        self.budget = parts.budget
        self.backend = parts.backend
        self.disk_cache = parts.disk_cache
        self.key_prefix = config.url.prefix
        self.ns = parts.namespace
        self.cache = parts.cache
        self.prefetcher = parts.prefetcher
        self.shards = parts.shards
        self.fetch_ahead = parts.fetch_ahead
        self.open_pushes = OpenPushes(
            config, self.ns, self.cache, self.prefetcher, self.fetch_ahead, self.backend, self.stats, nursery
        )
        self._handles: dict = {}
        self._inode_handles: collections.OrderedDict = collections.OrderedDict()  # ino -> fh, least recent first
        # ino -> (until when, from which offset) a READ is a late one (LATE_READ_WINDOW_S)
        self._inode_ended: collections.OrderedDict = collections.OrderedDict()
        self._opened_before: dict = {}  # fh -> ino of handles the kernel will not RELEASE (release_all_open_handles)
        self._dir_handles: dict = {}
        self._fh_counter = itertools.count(1)
        # Directory inode -> (its listing, its children in order), for readdir_inode.
        # A few: the kernel reads one directory's READDIRs in a row and then keeps them.
        self._dir_children: cachetools.LRUCache = cachetools.LRUCache(maxsize=DIR_CHILDREN_KEPT_COUNT)

    # -- metadata ----------------------------------------------------------------
    async def lookup(self, parent_ino: int, name: str) -> Node:
        return await self.ns.lookup(parent_ino, name)

    async def getattr(self, ino: int) -> Node:
        node = self.ns.node(ino)
        self.fetch_ahead.note_getattr(node)
        return node

    def note_listed_to_kernel(self, directory: Node) -> None:
        """The kernel was handed every entry of `directory` (READDIRPLUS: with inodes)."""
        self.fetch_ahead.note_listed_to_kernel(directory)

    def start_pushing(self, kernel_fd: int, list_to_kernel=None) -> bool:
        """Let fetch-ahead push files into the kernel's page cache (fetchahead.py) through
        --fetch-ahead-workers processes writing to `kernel_fd`, the mount's /dev/fuse
        descriptor; False where it cannot: fetch-ahead off, --cache-dir (its files go to
        disk too), a backend without the worker engine (no pycurl, GCS).
        `list_to_kernel`: FetchAhead.start_pushing's."""
        workers_count = self.config.fetch_ahead_workers_count
        if not (workers_count and self.fetch_ahead.enabled) or self.disk_cache is not None:
            return False
        # Pushes in flight and the copies kept of pushed files share fetch-ahead's room (half
        # the budget for buffers, as the files it holds itself with 0 workers). Kept copies
        # allowed all of it ran W5 at 136-149 MB/s against 165 (bench, 2026-11-28).
        keep_bytes = self.fetch_ahead.room_bytes
        # The workers' connections: a pass's GETs, and as many again as the daemon's own
        # for the files readers open (_push_for_reader): past its pool, each GET would
        # open a connection and close it after (the proxy's CPU doubled in a W2 run).
        transfers_count = self.config.fetch_ahead_requests_count + self.config.max_connections_count
        if not self.backend.start_pushing(kernel_fd, workers_count, transfers_count, keep_bytes):
            return False
        if self.cache.kept is None:
            self.cache.kept = KeptCopies(self.budget, self.stats)
        self.fetch_ahead.start_pushing(list_to_kernel)
        return True

    async def opendir(self, ino: int) -> int:
        handle = DirHandle(self.ns.node(ino), await self.ns.list_dir(ino))
        dh = next(self._fh_counter)
        self._dir_handles[dh] = handle
        return dh

    async def readdir(self, dh: int, start_index: int):
        """Entries (name, node) from `start_index` on; entry i's next offset is i + 1."""
        try:
            handle = self._dir_handles[dh]
        except KeyError:
            raise errors.NotFound(f"directory handle {dh}") from None
        if start_index == 0 and handle.read_from_start and not self.config.immutable:
            # rewinddir(): POSIX asks for the directory as it is now, not as it was at
            # opendir (within the TTL, the same listing).
            handle.children = await self.ns.list_dir(handle.node.ino)
        handle.read_from_start = True
        return handle.entries(start_index)

    async def readdir_inode(self, ino: int, start_index: int):
        """Entries of directory `ino` from `start_index` on, with no handle: the FUSE
        adapter lets the kernel open directories itself in the immutable mode, where a
        listing never changes, so an offset names the same entry in every READDIR.
        The child lists of the last few directories are kept: a 20,000-entry listing
        read in a hundred READDIRs is not rebuilt for each."""
        if not self.config.immutable:
            raise errors.BucketfsError("a READDIR with no handle needs listings that never change")
        listing = await self.ns.listing(ino)
        kept = self._dir_children.get(ino)  # (read after the await: another READDIR may have kept it)
        if kept is None or kept[0] is not listing:
            kept = self._dir_children[ino] = (listing, await self.ns.list_dir(ino))
        return DirHandle(self.ns.node(ino), kept[1]).entries(start_index)

    def releasedir(self, dh: int) -> None:
        self._dir_handles.pop(dh, None)

    # -- data --------------------------------------------------------------------
    async def open(self, ino: int, flags: int, pin: bool = True, reading: bool = False) -> int:
        """A handle of `ino`; `pin`: a small file's bytes are kept until it was read
        through (not for reads by inode: no RELEASE would undo a pin). `reading`: a
        READ waits (a read by inode), so the kernel lacks the file's pages even if it
        was served whole before."""
        if flags & WRITE_FLAGS:
            raise errors.ReadOnly("read-only mount")
        node = self.ns.node(ino)
        if node.is_dir:
            raise errors.BucketfsError("is a directory")
        if not self.config.immutable:
            await self.ns.refresh_file(node)
        elif not self.ns.is_current(node):
            # Replaced while mounted (a read found it changed, and its directory was
            # listed again): ESTALE makes the kernel look the name up again and open
            # the version listed now.
            raise errors.ObjectChanged(f"{node.path}: replaced since it was looked up")
        key = self.key_prefix + node.path
        fh = next(self._fh_counter)
        # A short shard (a data set's last) whose head the previous shard's window warmed
        # is read as a shard, from that head: as a small file it would be fetched again.
        if node.size_bytes <= self.config.small_file_bytes and not self.prefetcher.is_warming(key, node.version):
            reader = None
            # A file served whole before is in the page cache, unless a READ of it waits
            # (the kernel dropped its pages): that READ fetches it, if a worker does not.
            if not node.served or reading:
                if self._push_for_reader(node, key):
                    if node.served:  # (what _read counts when the READ fetches it itself)
                        self._note_kernel_dropped(node)
                elif not node.served:
                    self.cache.start_read(key, node.version, node.size_bytes, 0, node.size_bytes)
            self.stats["open.small"] += 1
        else:
            shard = self.shards.is_shard(node.name)
            on_progress = self.shards.shard_opened(node, key, fh) if shard else None
            reader = HandleReader(
                self.prefetcher, self.cache, key, node.version, node.size_bytes, shard, self.config, on_progress
            )
            self.stats["open.large"] += 1
        handle = self._handles[fh] = FileHandle(node, key, reader)
        if reader is None and node.size_bytes:
            if pin:
                self.cache.pin(key, node.version)
                handle.pinned = True
            self.fetch_ahead.note_open(node, key)  # (after the pin: a held file is never evictable between)
        self.shards.handle_opened(key)
        return fh

    def _push_for_reader(self, node: Node, key: str) -> bool:
        """Where fetch-ahead workers push: fetch a small file being opened through one of
        them, its body sent back for the READs about to come (not pushed), rather than
        with a GET of the daemon's own: the worker signs, receives and checks it, off
        the serving thread, and no GET wakes the daemon's curl thread (which takes the
        GIL for its callbacks). False if none took it (cached or on its way already, no
        memory now): the caller reads it as usual. A push refused or failed leaves the
        READs to fetch it, with every retry. Not with --fetch-workers: the daemon's own
        GETs run in worker processes then."""
        if self.config.fetch_workers_count or not self.backend.pushes:  # (workers run: start_pushing)
            return False
        flight = self.cache.push_ahead(
            key, node.version, node.size_bytes, node.ino, False, self._pushed_for_reader, for_reader=True
        )
        return flight is not None

    def _note_kernel_dropped(self, node: Node) -> None:
        """A READ of a file given to the kernel whole (read through, or pushed) is fetched
        again: the kernel dropped its pages (memory pressure, or a host's proactive
        reclaim, DAMON, of pages not read yet)."""
        self.stats["read.kernel_dropped_gets"] += 1
        self.fetch_ahead.note_kernel_miss(node)

    def _pushed_for_reader(self, outcome: str) -> None:
        self.stats[f"open.worker_{outcome}"] += 1

    async def read(self, fh: int, off: int, size: int, pieces: bool = False):
        """Bytes [off, off + size) of handle `fh` (fewer at its end): one buffer, or with
        `pieces` a Pieces where they lie in several (pieces.py)."""
        ino = self._opened_before.get(fh)
        if ino is not None:  # (opened before the kernel opened files itself: by its inode now)
            return await self.read_inode(ino, off, size, pieces)
        data = await self._read(fh, off, size)
        ino = self._opened_before.get(fh)
        if ino is not None and self._read_through(fh, off + nbytes_of(data)):
            self._release_inode(ino, fh)  # (its inode's since this READ began, and now read to its end)
        return data if pieces else one_buffer(data)

    async def _read(self, fh: int, off: int, size: int):
        handle = self._handles.get(fh)
        if handle is None:
            raise errors.NotFound(f"file handle {fh}")
        end = min(off + size, handle.size_bytes)
        if off >= end:
            return b""
        self.stats["read.calls"] += 1
        self.stats["read.bytes"] += end - off
        if handle.failed_reads and self._failed_a_moment_ago(handle, off):
            self.stats["read.kernel_retries_failed"] += 1
            raise errors.TransientError(f"{handle.key}: [{off}, {end}) failed a moment ago, after every retry")
        started_s, started_trio_s = time.monotonic(), trio.current_time()
        handle.reads_in_progress += 1
        try:
            if handle.reader is None:
                if handle.pinned:
                    self.cache.touch(handle.key, handle.version)
                if not self.cache.holds(handle.key, handle.version, off):
                    # A miss (evicted, or the kernel dropped its pages): the whole object in one GET.
                    if handle.node.served:
                        self._note_kernel_dropped(handle.node)
                    self.cache.start_read(handle.key, handle.version, handle.size_bytes, 0, handle.size_bytes)
                data = await self.cache.read(handle.key, handle.version, handle.size_bytes, off, end)
            else:
                data = await handle.reader.read(off, end)
        except errors.ObjectChanged:
            self.ns.relist_after_stale(handle.node)
            raise
        except errors.TransientError:
            now_s = trio.current_time()
            if now_s - started_trio_s >= self.config.read_timeout_s:
                handle.failed_reads = handle.failed_reads[-(FAILED_READS_KEPT - 1) :] + [(off, end, now_s)]
            raise
        finally:
            self.stats["read.wait_seconds"] += time.monotonic() - started_s  # type: ignore[assignment]  # (a float counter)
            handle.reads_in_progress -= 1
            handle.read_at_s = trio.current_time()
        if end == handle.size_bytes:
            handle.node.served = handle.at_end = True
        if handle.pinned:
            handle.read_bytes += end - off
            if handle.read_bytes >= handle.size_bytes:
                handle.pinned = False  # (the page cache has it now)
                self.cache.unpin(handle.key, handle.version)
        return data

    async def read_inode(self, ino: int, off: int, size: int, pieces: bool = False):
        """A READ of `ino` with no handle (the kernel opened the file itself): through
        the inode's own handle (see the module's invariants). `pieces`: as read's."""
        fh = self._inode_handles.get(ino)
        if fh is None and self._is_late_read(ino, off):
            # A READ sent before the one that reached the end, answered after it (the
            # kernel's read-ahead): through a handle of its own, let go of at once, so
            # that it leaves none behind that no later READ would end.
            fh = await self.open(ino, os.O_RDONLY, pin=False, reading=True)
            try:
                data = await self._read(fh, off, size)
            finally:
                self.release(fh)
            return data if pieces else one_buffer(data)
        if fh is None:
            # Not pinned: nothing releases a file a reader read in part and left (killed,
            # or done with its header), and pinned bytes are never evicted.
            fh = await self.open(ino, os.O_RDONLY, pin=False, reading=True)
            if ino in self._inode_handles:  # (another READ opened one meanwhile: a --metadata-ttl refresh)
                self.release(fh)
                fh = self._inode_handles[ino]
            else:
                self._inode_handles[ino] = fh
                if len(self._inode_handles) > INODE_HANDLES_MAX:
                    self.release(self._inode_handles.popitem(last=False)[1])
        else:
            self._inode_handles.move_to_end(ino)
        try:
            data = await self._read(fh, off, size)
        except BaseException:
            self._release_inode(ino, fh)  # (the next READ opens afresh: a replaced object gives ESTALE there)
            raise
        if self._read_through(fh, off + nbytes_of(data)):
            self._release_inode(ino, fh)  # (read to its end: the kernel keeps its pages)
            self._inode_ended[ino] = (trio.current_time() + LATE_READ_WINDOW_S, off - LATE_READ_SPAN_BYTES)
            if len(self._inode_ended) > INODE_HANDLES_MAX:
                self._inode_ended.popitem(last=False)
        return data if pieces else one_buffer(data)

    def _read_through(self, fh: int, end: int) -> bool:
        """After a READ of `fh` up to `end`: whether the file has been read to its end
        and no reader of it is still reading (readers of its other slices keep the
        handle: handlereader.py)."""
        handle = self._handles.get(fh)
        if handle is None or handle.reader is None:
            return end >= self._handle_bytes(fh)
        return handle.reader.finished()

    def _is_late_read(self, ino: int, off: int) -> bool:
        """Whether a READ of `ino` at `off` was sent before the one that read the file
        to its end (see LATE_READ_WINDOW_S)."""
        until_s, late_from_off = self._inode_ended.get(ino, (-1.0, 0))
        return trio.current_time() < until_s and off >= late_from_off

    def release_all_open_handles(self) -> None:
        """The kernel has stopped sending RELEASE (it opens files itself from now on,
        and lets go of those it opened before without telling): every open handle
        becomes its inode's own, as if the kernel had opened the file itself (later
        READs of it go by inode, it pins nothing, it goes at the file's end or with the
        least recently read), so that a file being streamed keeps its read-ahead (let
        go of here, a second stream fetched its parts again: W1, 4 readers, 85-108
        GETs for 64 ranges). One already read to its end, or a second handle of an
        inode that has one, is released."""
        implicit = set(self._inode_handles.values())
        for fh in [fh for fh in self._handles if fh not in implicit]:
            handle = self._handles[fh]
            ino = handle.node.ino
            self._opened_before[fh] = ino
            if ino in self._inode_handles or handle.at_end:
                # (read to its end: its RELEASE was on its way; a READ in progress keeps
                # the handle it started with)
                self.release(fh)
                continue
            if handle.pinned:
                handle.pinned = False
                self.cache.unpin(handle.key, handle.version)
            self._inode_handles[ino] = fh
        while len(self._inode_handles) > INODE_HANDLES_MAX:
            self.release(self._inode_handles.popitem(last=False)[1])

    def release_idle_inode_handles(self) -> None:
        """Release every inode's handle that no READ is in and none came for in
        INODE_HANDLE_IDLE_S (see the module's invariants)."""
        now_s = trio.current_time()
        for ino, fh in list(self._inode_handles.items()):
            handle = self._handles.get(fh)
            if handle is None:  # (released already: a RELEASE sent before the kernel began opening files)
                del self._inode_handles[ino]
            elif handle.reads_in_progress:
                continue
            elif now_s - handle.read_at_s >= INODE_HANDLE_IDLE_S:
                self._release_inode(ino, fh)
                self.stats["read.idle_handles_released"] += 1
            elif handle.reader is not None and handle.reader.finished():
                self._release_inode(ino, fh)  # (read to its end, its other readers done with their slices)

    async def release_idle_inode_handles_periodically(self) -> None:
        """Until cancelled."""
        while True:
            await trio.sleep(INODE_HANDLE_IDLE_S / 2)
            self.release_idle_inode_handles()

    def _handle_bytes(self, fh: int) -> int:
        handle = self._handles.get(fh)
        return 0 if handle is None else handle.size_bytes

    def _release_inode(self, ino: int, fh: int) -> None:
        if self._inode_handles.get(ino) == fh:
            del self._inode_handles[ino]
            self.release(fh)

    @staticmethod
    def _failed_a_moment_ago(handle: FileHandle, off: int) -> bool:
        """Whether a READ at `off` is the kernel's second try of one that just failed
        after every retry. Each failure answers one second try: a reader's own retry
        after that reaches the store."""
        now_s = trio.current_time()
        recent = [failure for failure in handle.failed_reads if now_s - failure[2] < KERNEL_RETRY_WINDOW_S]
        hit = next((failure for failure in recent if failure[0] <= off < failure[1]), None)
        if hit is not None:
            recent.remove(hit)
        handle.failed_reads = recent
        return hit is not None

    def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if handle is None:
            return
        if handle.pinned:
            # A READ of this handle may still be in progress (a killed reader's file is
            # released without waiting for it): it must not unpin a second time.
            handle.pinned = False
            self.cache.unpin(handle.key, handle.version)
        if handle.reader is not None:
            handle.reader.close()
        self.shards.handle_released(handle.key, fh, warmed=handle.reader is not None)

    # -- the kernel's references and vanished names (with a TTL) ------------------
    @property
    def tracks_lookups(self) -> bool:
        """Whether the namespace drops vanished nodes once the kernel lets go of them
        (with a TTL): then every entry reply must be noted (`note_lookup`) and every
        FORGET passed on (`forget`). Never in the immutable default."""
        return self.ns.tracks_lookups

    def note_lookup(self, node: Node) -> None:
        """The kernel was handed `node` in an entry reply (lookup, READDIRPLUS)."""
        self.ns.note_lookup(node)

    def forget(self, ino: int, count: int) -> None:
        """The kernel dropped `count` references to `ino`."""
        self.ns.forget(ino, count)

    def current(self, node: Node) -> Optional[Node]:
        """The node now listed under `node`'s name (itself, a newer version, or None if
        the name is gone)."""
        return self.ns.current(node)

    def watch_vanished(self, callback) -> None:
        """Call `callback(parent_ino, name)` for each name that vanished or changed while
        the kernel may still hold it, so the adapter can ask the kernel to let go."""
        self.ns.on_vanished = callback

    # -- counters and sizes ---------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to the counter `name` (the stats file and the metrics show it)."""
        self.stats[name] += n

    def uncount(self, name: str) -> None:
        """Take one back from the counter `name`; one taken back to zero is removed, as
        if never counted."""
        self.stats[name] -= 1
        if not self.stats[name]:
            del self.stats[name]

    @property
    def entries_count(self) -> int:
        """Live nodes: files and directories listed so far."""
        return self.ns.entries_count

    @property
    def listed_file_bytes(self) -> int:
        """The sizes of the files listed so far (what statfs reports as used)."""
        return self.ns.listed_file_bytes

    # -- misc ---------------------------------------------------------------------
    async def finish_writes(self) -> None:
        """Until the disk cache's background work is done: its queued writes (at most
        PENDING_WRITES_MAX_BYTES; at unmount, bytes already fetched are worth a next
        mount's GET), deletes and a journal rewrite under way."""
        if self.disk_cache is not None:
            await self.disk_cache.wait_idle()

    def snapshot(self) -> dict:
        stats = self.stats.snapshot()
        stats.update(
            {
                "memory.used_bytes": self.budget.used_bytes,
                "memory.peak_bytes": self.budget.peak_bytes,
                "memory.budget_bytes": self.budget.budget_bytes,
                "memory.listings_bytes": self.budget.listings_bytes,
                "memory.disk_index_bytes": self.budget.disk_index_bytes,
                "cache.bytes": self.cache.cached_bytes,
                "fetch_ahead.held_bytes": self.cache.held_bytes,
                "fetch_ahead.kept_bytes": 0 if self.cache.kept is None else self.cache.kept.kept_bytes,
                "namespace.entries": self.ns.entries_count,
                "handles.open": len(self._handles),
                # Snapshots are taken on the trio thread (the stats file's READ, the metrics
                # server through trio.from_thread): the CPU of the thread that serves every FUSE
                # request, whose saturation no other core relieves. Exact, where /proc counts
                # threads' CPU in 10 ms ticks.
                "process.serving_thread_cpu_s": round(time.thread_time(), 6),
            }
        )
        if self.disk_cache is not None:
            stats["disk_cache.stored_bytes"] = self.disk_cache.stored_bytes
            stats["disk_cache.capacity_bytes"] = self.disk_cache.capacity_bytes
        for op, count in self.backend.requests.items():
            stats[f"backend.requests.{op}"] = count
        stats["backend.bytes_fetched"] = self.backend.bytes_fetched
        stats["backend.redirects"] = self.backend.redirects_count
        stats["backend.fetch_workers"], stats["backend.fetch_worker_restarts"] = self.backend.fetch_workers
        workers, restarts = self.backend.fetch_ahead_workers
        stats["backend.fetch_ahead_workers"], stats["backend.fetch_ahead_worker_restarts"] = workers, restarts
        for path, count in getattr(self.backend, "get_paths", {}).items():
            stats[f"backend.get_path.{path}"] = count
        fresh = getattr(self.backend, "fresh_pages", None)
        if fresh is not None:
            stats["backend.fresh_buffers"], stats["backend.fresh_bytes"] = fresh.buffers, fresh.bytes
            stats["backend.fresh_fault_cpu_s"] = round(fresh.cpu_s, 6)
        caller = getattr(self.backend, "caller", None)  # the backend's BlockingCaller, if it has one
        if caller is not None:
            stats["backend.retries"] = caller.retries_count
            stats["backend.corrupt_bodies"] = caller.corrupt_bodies_count
            stats["backend.calls_queued"] = caller.slots.queued_count
            stats["backend.urgent_overtakes"] = caller.slots.overtakes_count
            for name, count in caller.failures.items():
                stats[f"backend.failures.{name}"] = count
        return stats


__all__ = ["Filesystem", "Pieces", "ROOT_INO"]
