"""Local disk cache (`--cache-dir`): object bytes kept on a local disk, so an epoch
after the kernel's page cache let go of them (a data set larger than RAM) reads the
disk, not the bucket.

It sits in front of the backend and speaks the Backend contract (backends/base.py),
every name of it defined here, explicitly: a read whose chunks are all on disk is
answered from there; any other read goes to the store, and the whole chunks it covers
are written to disk after it; listings, metadata, the probe and the counters are the
store's. There is no attribute forwarding: a method added to the contract fails
tests/unit/test_disk_cache.py until it is handled here, rather than bypassing the cache.

Invariants:
- Chunks are keyed by (key, version): a changed object never reads an old chunk.
  Objects with no version (a store that states neither ETag nor modification time,
  versions.UNPINNED) are not kept: a later mount could not tell them from a
  replacement of the same size.
- Every stored chunk's CRC-32 is kept in memory and checked on every read from disk:
  a disk that hands back other bytes (a bad sector, a file changed behind our back,
  a crash that kept a chunk's record but not its bytes) costs a GET, never a wrong byte.
- Only whole chunks are stored (a chunk is the block-cache block, so random reads
  fill it too), plus an object's shorter last chunk when its size is known.
- Disk use stays within `capacity_bytes`: each stored chunk counts as the blocks it
  takes (rounded up to the file system's allocation unit: a 300-byte object takes
  4 KiB), the journal counts too, and the policy's victims are deleted first (at load
  in one pass, while mounted by one delete worker).
- Which objects go: policy.py, a scan-resistant policy, not LRU. A resident set that
  new objects do not evict, new objects admitted into the room outside it, turnover
  when resident objects go unread for a few passes' worth of new bytes: random-order
  passes over a data set N times the cache find ~1/N of it cached (LRU: ~15% at
  2x, ~1% at 8x).
- Bytes waiting to be written are lent by the memory budget (refused: not stored).
- Kept across mounts: the journal (journal.py) records each object's
  (key, version, size) and its chunks' CRCs, and is loaded at start. A later mount
  finds a chunk only under the version its listing names, so an object changed
  in between is fetched again. The directory is one mount's at a time (directory.py),
  and every file operation goes through descriptors of it held for the mount's life
  (dir_fd=): a directory deleted under the mount fails writes and misses reads, it
  never writes into the directory a later mount made at the same path.
- A hit whose file the kernel holds in its page cache is read on the event loop with
  reads that cannot wait for a disk (pagecache.py); any other goes to a disk thread.
  At start, the newest kept objects are read ahead into the page cache (after a
  reboot they are on disk only).
- Disk trouble (full, I/O errors) is never a read error: the read goes to the store,
  and the cache stops storing after `WRITE_FAILURES_MAX` failed writes. A journal
  that cannot be written at start (no space, I/O errors) leaves the mount serving
  what the disk holds and storing nothing.
"""

from __future__ import annotations

import collections
import logging
import os
import time
import weakref
from typing import Any, Optional

import trio

from bucketfs.backends import versions
from bucketfs.backends.base import PAGE_KEYS_MAX, PUSH_REFUSED
from bucketfs.diskcache import files, journal, pagecache, policy
from bucketfs.diskcache.directory import NO_SPACE_ERRNOS, dir_error

# (module globals, looked up at each call: tests and benchmarks may replace them)
from bucketfs.diskcache.files import WOULD_BLOCK as _WOULD_BLOCK
from bucketfs.diskcache.files import delete_files as _delete_files
from bucketfs.diskcache.files import read_chunks as _read_chunks
from bucketfs.diskcache.files import write_chunks as _write_chunks

log = logging.getLogger(__name__)

# Bytes handed to background writes and not on disk yet: past this, or past what the
# memory budget lends them, a read's bytes are simply not stored (a slow disk must not
# hold the memory of a fast network).
PENDING_WRITES_MAX_BYTES = 64 * 1024 * 1024
# Deletes handed to one thread call by the delete worker (one journal append for all).
DELETE_BATCH_MAX = 1024
INDEX_CHARGE_STEP_BYTES = 1024 * 1024
# A disk that failed this many writes (full, read-only, failing) is left alone.
WRITE_FAILURES_MAX = 8
# Hits up to this size whose file is in the page cache are read on the event loop
# (no-wait reads): a copy and a CRC, ~0.1 ms per 100 KB, instead of a worker thread's
# hand-offs. Larger ones go to a thread, where their copy and CRC do not hold the loop.
LOOP_READ_MAX_BYTES = 1024 * 1024
# At start, the most recently used files are read ahead into the page cache up to this
# share of the memory available: the kernel's to give back, but an epoch after a reboot
# finds them there.
READ_AHEAD_MEMORY_FRACTION = 0.5
# The replacement policy: policy.Residency's scan-resistant one; True: plain LRU (for
# comparisons: tests and benchmarks may set it).
LRU_POLICY = False


def _take_one(counter: collections.Counter, key) -> None:
    if counter[key] > 1:
        counter[key] -= 1
    else:
        counter.pop(key, None)


class DiskCache:
    """A backend in front of `inner` whose reads are kept in `directory`. Not a subclass
    of Backend: nothing of the contract is inherited, each name is defined here."""

    def __init__(
        self,
        inner,
        directory: str,
        capacity_bytes: int,
        chunk_bytes: int,
        stats,
        nursery: trio.Nursery,
        budget=None,
        dir_fd: Optional[int] = None,
        alone: bool = True,
    ):
        """`budget`: the MemoryBudget the index and pending writes are charged to, if any.
        `dir_fd`: a descriptor of `directory` the caller holds (locked) for the cache's
        life; without it, `directory` is opened here (tests). `alone`: no other mount
        shares the directory now (directory.CacheDir.alone)."""
        self.inner = inner
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.chunk_bytes = chunk_bytes
        self.stats = stats
        self.nursery = nursery
        self._alone = alone
        # entry_id(key, version) -> Entry, in the policy's segments (policy.py)
        self._entries = policy.Residency(self._disk_bytes, lru=LRU_POLICY)
        self._data_disk_bytes = 0  # what the data files take on disk (see _disk_bytes)
        self._dirs_disk_bytes = 0  # and the directories (_measure_dirs)
        self._pending_bytes = 0
        self.on_write_done = None  # called (no arguments) when a queued write is done: fetch-ahead's wake-up
        self._background_count = 0  # writes and deletes in flight or queued
        self._idle = trio.Event()  # set whenever _background_count is 0
        self._idle.set()
        self._write_failures = 0
        # Disk threads: a few keep an SSD busy. Reads have their own, so that writes
        # (and a journal rewrite holding them) never stand between a reader and the disk.
        self._read_limiter = trio.CapacityLimiter(4)
        self._loop_reads = pagecache.no_wait_reads()
        self._write_limiter = trio.CapacityLimiter(4)
        self._live_record_bytes = 0  # what a rewritten journal would hold
        self._compacting = False
        # A journal's dead records are rewritten away past this much (a small cache
        # must not spend its --cache-size on them: the journal counts).
        self._compact_min_bytes = min(journal.COMPACT_MIN_BYTES, capacity_bytes // 16)
        self._budget = budget
        self.index_bytes = 0  # memory the index takes (Entry objects and their CRCs)
        self._charged_index_bytes = 0
        self._deletes_send, self._deletes_receive = trio.open_memory_channel(float("inf"))  # ids
        # Ids this mount deletes (how many times): queued or in progress, and journaled but
        # not yet read back in the journal. Meanwhile they are not stored again (the
        # delete removes the file by id), nor taken from the other mounts' records:
        # those read before this mount's own delete record come before it in the
        # journal, so its delete undoes them for every mount.
        self._deletes_queued: collections.Counter = collections.Counter()
        self._deletes_unread: collections.Counter = collections.Counter()
        # Deletes have a thread of their own: behind queued writes they fell minutes
        # behind, and the files of evicted objects stayed on disk past --cache-size.
        self._delete_limiter = trio.CapacityLimiter(1)
        try:
            if dir_fd is None:
                dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                weakref.finalize(self, os.close, dir_fd)
            self._dir_fd = dir_fd
            # Disk blocks are what --cache-size bounds (du), not object bytes.
            self._unit_bytes = os.fstatvfs(dir_fd).f_frsize or 4096
        except OSError as exc:
            raise dir_error(directory, exc) from None
        self._data_fd: Any = None  # the data directory's descriptor (an int) once it is open
        self._journal: Any = None
        self._load()
        self._charge_index(force=True)
        self.nursery.start_soon(self._delete_worker)
        self._start_read_ahead()

    @property
    def stored_bytes(self) -> int:
        """What the cache takes on disk (as of the last _measure_dirs)."""
        return self._disk_use_bytes(self._journal.size_bytes)

    def _disk_use_bytes(self, journal_bytes: int) -> int:
        """The cache's data files' blocks, a journal of `journal_bytes`, and its directories."""
        return self._data_disk_bytes + self._round_up(journal_bytes) + self._dirs_disk_bytes

    def _round_up(self, n_bytes: int) -> int:
        """`n_bytes` rounded up to the file system's allocation unit."""
        return -(-n_bytes // self._unit_bytes) * self._unit_bytes

    def _measure_dirs(self) -> None:
        """The blocks of the cache's directories (the data directory grows by a block
        per ~100 files, and never shrinks on ext4), and one for --cache-dir's own: an
        fstat each, cheap beside the write that calls this. Before the data directory
        is opened (at load), an earlier mount's counts as it stands, a new one as a block."""
        blocks = os.fstat(self._dir_fd).st_blocks
        if self._data_fd is not None:
            data_dir_bytes = os.fstat(self._data_fd).st_blocks * 512
        else:
            try:
                data_dir_bytes = (
                    os.stat(journal.DATA_DIR_NAME, dir_fd=self._dir_fd, follow_symlinks=False).st_blocks * 512
                )
            except FileNotFoundError:
                data_dir_bytes = 0
            data_dir_bytes = max(data_dir_bytes, self._unit_bytes)
        self._dirs_disk_bytes = blocks * 512 + data_dir_bytes + self._unit_bytes

    def _disk_bytes(self, entry: journal.Entry) -> int:
        """The blocks the entry's data file takes: its chunks sit at multiples of the
        chunk size, so each chunk takes its bytes rounded up to the allocation unit
        (one unit more where the chunk size is not a multiple of it)."""
        return self._disk_bytes_for(entry.stored_bytes)

    def _disk_bytes_for(self, stored_bytes: int) -> int:
        rounded = self._round_up(stored_bytes)
        if self.chunk_bytes % self._unit_bytes:
            rounded += (stored_bytes // self.chunk_bytes + 1) * self._unit_bytes
        return rounded

    def _load(self) -> None:
        """The journal (`_journal`), its entries (from earlier mounts) taken in, LRU
        first, evicted down to the capacity (in one pass if alone on the directory),
        and the data files no entry names removed in the background. Runs before the
        mount serves."""
        started_s = time.monotonic()
        try:
            self._journal = loaded = journal.Journal(self._dir_fd, self.chunk_bytes, alone=self._alone)
        except OSError as exc:
            raise dir_error(self.directory, exc) from None
        weakref.finalize(self, loaded.close)
        loaded_bytes = 0
        for eid, entry in loaded.entries.items():
            entry.recorded = True
            self._entries.load(eid, entry)
            loaded_bytes += entry.stored_bytes
            self._data_disk_bytes += self._disk_bytes(entry)
            self.index_bytes += entry.index_bytes()
            self._live_record_bytes += entry.record_bytes()
        loaded.entries.clear()  # (the index is _entries now)
        if loaded.skipped_bytes:
            log.warning(
                "disk cache %s: %d bytes of torn or damaged journal records skipped (a crash or a full disk)",
                self.directory,
                loaded.skipped_bytes,
            )
        if loaded.incompatible:
            log.warning(
                "disk cache %s is in use by mounts with another block size; this mount runs without it",
                self.directory,
            )
            self._write_failures = WRITE_FAILURES_MAX
        self._measure_dirs()
        # Alone, the evicted entries' records go with the rewrite below and their files
        # with the orphans; beside other mounts, evictions are journaled one by one.
        evicted_count = self._evict_at_load(journal.HEADER_BYTES) if self._alone else 0
        self._entries.settle(self._room_bytes(journal.HEADER_BYTES + self._live_record_bytes))
        self.stats["disk_cache.loaded_bytes"] = loaded_bytes
        try:
            self._data_fd = self._open_data_dir()
            try:
                # (alone, the cache fits with the journal rewritten to its live records, as
                # _evict_at_load counted it: the evicted objects' and dead records go)
                must_rewrite = (
                    loaded.fresh
                    or evicted_count
                    or (self._alone and self._disk_use_bytes(loaded.size_bytes) > self.capacity_bytes)
                )
                if not loaded.incompatible and (
                    must_rewrite or loaded.needs_compacting(self._live_record_bytes, self._compact_min_bytes)
                ):
                    loaded.compact(lambda: self._caught_up_entries(force=bool(must_rewrite)))
            except OSError as exc:
                if exc.errno not in NO_SPACE_ERRNOS:
                    raise
                # (serving what the disk holds; a new journal has nothing to serve)
                log.warning(
                    "disk cache %s: cannot write its journal (%s); this mount stores nothing in it",
                    self.directory,
                    exc.strerror or exc,
                )
                loaded.broken = True
                self._write_failures = WRITE_FAILURES_MAX
            # (beside other mounts, a young file may be a write whose record is on its way)
            orphans = journal.find_orphans(self._data_fd, self._entries, 0 if self._alone else journal.ORPHAN_AGE_S)
        except OSError as exc:
            if exc.errno not in NO_SPACE_ERRNOS:
                raise dir_error(self.directory, exc) from None
            log.warning(
                "disk cache %s: cannot make its data directory (%s); this mount runs without it",
                self.directory,
                exc.strerror or exc,
            )
            loaded.broken = True
            self._write_failures = WRITE_FAILURES_MAX
            self._entries.clear()
            self._data_disk_bytes = self.index_bytes = self._live_record_bytes = 0
            return
        if not self._alone:
            self._evict_to_capacity()
        if orphans:
            self._in_background(self._remove_orphans, orphans)
        if self._entries or orphans:
            log.info(
                "disk cache %s: %d objects, %.1f MiB kept from earlier mounts (%d evicted, %d stray files to remove) "
                "in %.2f s",
                self.directory,
                len(self._entries),
                loaded_bytes / 2**20,
                evicted_count,
                len(orphans) - evicted_count,
                time.monotonic() - started_s,
            )

    def _caught_up_entries(self, force: bool):
        """The entries a journal rewrite keeps, once every record appended so far is
        taken in (called with appends held: journal.compact); None if the journal no
        longer needs it (another mount rewrote it meanwhile) and `force` is false."""
        self._apply_tail()
        if not force and not self._journal.needs_compacting(self._live_record_bytes, self._compact_min_bytes):
            return None
        return self._entries.values()

    def _apply_tail(self) -> bool:
        """Take in what the other mounts of this directory stored and evicted since the
        last look (their journal records); whether there was any. A look costs an fstat."""
        if self._data_fd is None:
            return False
        try:
            ops = self._journal.read_tail()
        except OSError as exc:
            log.warning("disk cache %s: cannot read its journal (%s)", self.directory, exc)
            return False
        if not ops:
            return False
        cb = self.chunk_bytes
        for op in ops:
            kind, eid = op[0], op[1]
            if kind == "R":  # a rewrite was missed: what the journal does not hold was deleted
                self._drop_unheld(eid)
                self._deletes_unread.clear()  # (this mount's deletes not read back were in a file it skipped)
            elif kind in ("D", "OD"):  # deleted, files and all (by this mount: what came before is undone)
                for gone in eid:
                    self._drop(gone)
                    if kind == "OD":
                        _take_one(self._deletes_unread, gone)
            elif self._deleting(eid):
                # Being deleted here: this mount's delete removes the file the other mount
                # stored and journals it, which every mount but this one then reads.
                continue
            elif kind == "C":
                entry = self._entries.get(eid)
                if entry is None:
                    continue  # (of an object evicted here meanwhile)
                before_bytes, stored_before = self._disk_bytes(entry), entry.stored_bytes
                entry.add_pairs(op[2], cb)
                grown_bytes = self._disk_bytes(entry) - before_bytes
                self._data_disk_bytes += grown_bytes
                # (another mount's new bytes take room here too: they age the resident set)
                self._entries.grew(eid, grown_bytes, entry.stored_bytes - stored_before)
            elif eid not in self._entries:  # (kind "E")
                entry = journal.Entry(eid, op[2], cb, op[3])
                entry.recorded = True
                self._entries.admit(eid, entry, self._disk_bytes_for(op[2]))
                self.index_bytes += entry.index_bytes()
                self._live_record_bytes += entry.record_bytes()
        self._charge_index()
        self.stats["disk_cache.records_from_other_mounts"] += len(ops)
        return True

    def _drop_unheld(self, held: set) -> None:
        """Forget the journaled entries `held` lacks (a write not journaled yet stays)."""
        for eid in list(self._entries):
            entry = self._entries.get(eid)
            if entry is not None and entry.recorded and eid not in held:
                self._drop(eid)

    def _drop(self, eid: bytes) -> None:
        """Forget the entry `eid`, if any, with no delete (its file is gone or not ours)."""
        entry = self._entries.pop(eid, None)
        if entry is not None:
            self._forget(entry)

    def _deleting(self, eid: bytes) -> bool:
        """This mount deletes `eid` (queued, or journaled and not read back yet)."""
        return eid in self._deletes_queued or eid in self._deletes_unread

    def _open_data_dir(self) -> int:
        try:
            os.mkdir(journal.DATA_DIR_NAME, 0o700, dir_fd=self._dir_fd)
        except FileExistsError:
            pass
        fd = os.open(journal.DATA_DIR_NAME, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._dir_fd)
        weakref.finalize(self, os.close, fd)
        return fd

    def _room_bytes(self, journal_bytes: int) -> int:
        """What the data files may take beside the directories and a journal of
        `journal_bytes`, or of the most it grows to before a rewrite: the policy's
        resident set is sized by this, so it must not shrink and grow back with each
        journal append and rewrite (probation takes that)."""
        journal_bytes = max(journal_bytes, journal.COMPACT_RATIO * self._live_record_bytes + self._compact_min_bytes)
        return max(0, self.capacity_bytes - self._round_up(journal_bytes) - self._dirs_disk_bytes)

    def _evict_at_load(self, header_bytes: int) -> int:
        """Drop the least recently written entries until the cache fits (a smaller
        --cache-size than last time), counting the journal as its rewrite will be;
        how many. Their files become orphans: one pass removes them all."""
        evicted_count = 0
        while self._entries and self._disk_use_bytes(header_bytes + self._live_record_bytes) > self.capacity_bytes:
            _, entry = self._entries.pop_victim()
            self._forget(entry)
            evicted_count += 1
        self.stats["disk_cache.evictions"] += evicted_count
        return evicted_count

    async def _remove_orphans(self, names: list) -> None:
        removed_count, _ = await trio.to_thread.run_sync(
            files.remove_orphans, self._data_fd, self._journal, names, limiter=self._delete_limiter
        )
        log.info("disk cache: removed %d files no entry names", removed_count)
        self._evict_to_capacity()  # (the journal grew by their delete records: it counts)

    def _start_read_ahead(self) -> None:
        """Ask the kernel to read the most recently used files into the page cache, up
        to a share of the memory available (after a reboot a cached epoch then reads
        on the event loop, not through threads)."""
        if self._data_fd is None:
            return
        budget_bytes = min(
            sum(e.stored_bytes for e in self._entries.values()),
            int((pagecache.available_memory_bytes() or 0) * READ_AHEAD_MEMORY_FRACTION),
        )
        names, total_bytes = [], 0
        for entry in self._entries.most_kept_first():
            if total_bytes >= budget_bytes:
                break
            if entry.stored_bytes != entry.object_bytes:
                continue  # (a sparse file: reading it whole would fill the page cache with its holes)
            names.append(journal.data_name(entry.eid))
            total_bytes += entry.stored_bytes
        self.stats["disk_cache.read_ahead_bytes"] = total_bytes
        if names:
            self.nursery.start_soon(files.read_ahead, self._data_fd, names, total_bytes)

    def _charge_index(self, force: bool = False) -> None:
        # In steps of a MiB: a store per file must not recompute the budget per file.
        if self._budget is not None and (
            force or abs(self.index_bytes - self._charged_index_bytes) >= INDEX_CHARGE_STEP_BYTES
        ):
            self._charged_index_bytes = self.index_bytes
            self._budget.charge_disk_index(self.index_bytes)

    # -- the rest of the Backend contract: the store's -----------------------------
    @property
    def receives_into(self) -> bool:
        """read_range_into receives into the caller's buffer where the store's does
        (a hit is read into it from disk either way)."""
        return self.inner.receives_into

    @property
    def requests(self):
        """The store's requests by type (a hit is none)."""
        return self.inner.requests

    @property
    def bytes_fetched(self) -> int:
        """The store's payload bytes (read from disk: disk_cache.read_bytes in the stats)."""
        return self.inner.bytes_fetched

    @property
    def get_paths(self):
        return self.inner.get_paths

    @property
    def fresh_pages(self):
        return self.inner.fresh_pages

    @property
    def redirects_count(self) -> int:
        return self.inner.redirects_count

    @property
    def fetch_workers(self) -> tuple:
        return self.inner.fetch_workers

    @property
    def fetch_ahead_workers(self) -> tuple:
        return self.inner.fetch_ahead_workers  # (none: a mount with a disk cache does not push)

    def start_pushing(self, kernel_fd: int, workers_count: int, transfers_count: int, keep_bytes: int = 0) -> bool:
        return False  # (fetch-ahead's files must reach the disk cache: into memory, then onto disk)

    @property
    def pushes(self) -> bool:
        return False

    async def push_whole(self, key: str, version: str, size_bytes: int, ino: int, request) -> tuple:
        return PUSH_REFUSED, None

    def push_soon(self, key: str, version: str, size_bytes: int, ino: int, request, on_end) -> bool:
        return False

    @property
    def caller(self):
        """The store's BlockingCaller (retries, slots, failures), which the stats read;
        None for a backend without one (not part of the contract)."""
        return getattr(self.inner, "caller", None)

    async def list_page(self, prefix: str, token: Optional[str] = None):
        return await self.inner.list_page(prefix, token)  # (listings are the namespace's to cache)

    async def list_flat_page(
        self, prefix: str, start_after: str = "", end: Optional[str] = None, keys_max: int = PAGE_KEYS_MAX
    ):
        return await self.inner.list_flat_page(prefix, start_after, end, keys_max)

    async def upload(self, key: str, data: bytes) -> None:
        await self.inner.upload(key, data)  # (index build's; a mount never writes)

    async def stat(self, key: str):
        return await self.inner.stat(key)

    async def check_bucket(self, prefix: str) -> bool:
        return await self.inner.check_bucket(prefix)

    async def confirm_past_end(self, key: str, version: str, start: int) -> bytes:
        return await self.inner.confirm_past_end(key, version, start)

    async def aclose(self) -> None:
        await self.inner.aclose()

    # -- reads -------------------------------------------------------------------
    def _span(self, start: int, end: int, object_bytes: Optional[int]):
        """The chunk-aligned span [lo, hi) around [start, end), clipped to the object."""
        cb = self.chunk_bytes
        hi = -(-end // cb) * cb
        return start // cb * cb, hi if object_bytes is None else min(hi, object_bytes)

    def _on_disk(self, eid: bytes, lo: int, hi: int) -> Optional[tuple]:
        entry = self._entries.get(eid)
        if entry is None:
            return None
        cb = self.chunk_bytes
        first, last = lo // cb, -(-hi // cb)
        if not entry.has(first, last):
            return None
        self._entries.read(eid, entry)
        return entry, entry.crcs[first:last]

    def holds(self, key: str, version: str, start: int, end: int) -> bool:
        """Bytes [start, end) of `key` at `version` are on disk (an object with no
        version never is). Asks only: no read counts for the replacement policy."""
        if not versions.persistent(version) or start >= end:
            return False
        eid = journal.entry_id(key, version)
        return self._holds(eid, start, end) or (self._apply_tail() and self._holds(eid, start, end))

    def _holds(self, eid: bytes, start: int, end: int) -> bool:
        entry = self._entries.get(eid)
        if entry is None:
            return False
        lo, hi = self._span(start, end, entry.object_bytes)
        return entry.has(lo // self.chunk_bytes, -(-hi // self.chunk_bytes))

    async def _read_disk(self, eid: bytes, start: int, end: int, object_bytes: Optional[int], into=None):
        """The bytes of [start, end) of the object version `eid` from disk (into `into`
        if given), or None."""
        if object_bytes is None or start >= min(end, object_bytes):
            return None
        end = min(end, object_bytes)
        lo, hi = self._span(start, end, object_bytes)
        found = self._on_disk(eid, lo, hi)
        if found is None and self._apply_tail():  # (another mount's, perhaps)
            found = self._on_disk(eid, lo, hi)
        if found is None:
            self.stats["disk_cache.misses"] += 1
            return None
        entry, crcs = found
        name = journal.data_name(entry.eid)
        try:
            data = _WOULD_BLOCK
            if self._loop_reads and hi - lo <= LOOP_READ_MAX_BYTES:
                data = _read_chunks(self._data_fd, name, lo, hi, crcs, self.chunk_bytes, start, end, into, on_loop=True)
                if data is not _WOULD_BLOCK:
                    self.stats["disk_cache.loop_reads"] += 1
            if data is _WOULD_BLOCK:
                data = await trio.to_thread.run_sync(
                    _read_chunks,
                    self._data_fd,
                    name,
                    lo,
                    hi,
                    crcs,
                    self.chunk_bytes,
                    start,
                    end,
                    into,
                    limiter=self._read_limiter,
                )
        except OSError as exc:
            log.warning("disk cache read of %s failed (%s); reading the store", self._path(entry), exc)
            data = None
        if data is None:
            if not entry.gone:  # (an entry evicted while we read it just lost its file)
                self.stats["disk_cache.bad_reads"] += 1
                self._evict(eid, entry)
            return None
        self.stats["disk_cache.hits"] += 1
        self.stats["disk_cache.read_bytes"] += end - start
        return data

    def _path(self, entry) -> str:
        """(for messages)"""
        return os.path.join(self.directory, journal.DATA_DIR_NAME, journal.data_name(entry.eid))

    async def read_range(
        self, key: str, start: int, end: int, version: str, object_bytes: Optional[int] = None
    ) -> bytes:
        if not versions.persistent(version):
            return await self.inner.read_range(key, start, end, version, object_bytes=object_bytes)
        eid = journal.entry_id(key, version)  # (once: a miss stores under it too)
        data = await self._read_disk(eid, start, end, object_bytes)
        if data is not None:
            return data
        data = await self.inner.read_range(key, start, end, version, object_bytes=object_bytes)
        # bytes never change: stored in the background, the reader does not wait for the disk
        if object_bytes is not None and self._write_failures < WRITE_FAILURES_MAX:
            # Held until written: memory the budget must know of (it is --max-memory's,
            # once the block cache lets go of these bytes). Lent only from what no
            # reader needs; the block cache gives way (priority 0): it holds these same bytes.
            budget = self._budget
            if self._pending_bytes + len(data) <= PENDING_WRITES_MAX_BYTES and (
                budget is None or budget.try_reserve(len(data), reclaim_priority=0, refused_stat=None)
            ):
                self._pending_bytes += len(data)
                self._in_background(self._store_pending, eid, key, version, start, data, object_bytes)
            else:
                self.stats["disk_cache.skipped_bytes"] += len(data)
                self.stats["disk_cache.skipped_stores"] += 1
        return data

    async def read_range_into(
        self, key: str, start: int, end: int, version: str, buffer, object_bytes: Optional[int] = None
    ) -> int:
        if not versions.persistent(version):
            return await self.inner.read_range_into(key, start, end, version, buffer, object_bytes=object_bytes)
        eid = journal.entry_id(key, version)
        got = await self._read_disk(eid, start, end, object_bytes, into=buffer)
        if got is not None:
            return got
        got = await self.inner.read_range_into(key, start, end, version, buffer, object_bytes=object_bytes)
        if object_bytes is not None:
            # The buffer is reused once we return: store it now (into the page cache: ~ms per part).
            # Shielded: a part dropped once its bytes are here (a warmed head let go, a
            # stream closed) still stores them; cancelled at the store's first checkpoint,
            # they were fetched and never written, and the next mount fetched them again.
            with trio.CancelScope(shield=True):
                await self._store(eid, key, version, start, memoryview(buffer)[:got], object_bytes)
        return got

    # -- writes ------------------------------------------------------------------
    async def _store_pending(
        self, eid: bytes, key: str, version: str, start: int, data: bytes, object_bytes: int
    ) -> None:
        try:
            await self._store(eid, key, version, start, memoryview(data), object_bytes)
        finally:
            self._pending_bytes -= len(data)
            if self._budget is not None:
                self._budget.release(len(data))
            if self.on_write_done is not None:
                self.on_write_done()

    def write_room_bytes(self) -> int:
        """What may still be queued for writing before half of PENDING_WRITES_MAX_BYTES:
        fetch-ahead keeps its GETs in flight within it (what it fetched past the limit
        would not be stored, and the next epoch would fetch it again: 36% of a cold
        32-thread W2 epoch, 2026-11-27)."""
        return PENDING_WRITES_MAX_BYTES // 2 - self._pending_bytes

    def _begin(self, count: int = 1) -> None:
        if self._idle.is_set():
            self._idle = trio.Event()
        self._background_count += count

    def _end(self, count: int = 1) -> None:
        self._background_count -= count
        if not self._background_count:
            self._idle.set()

    def _in_background(self, fn, *args) -> None:
        self._begin()
        self.nursery.start_soon(self._background, fn, args)

    async def _background(self, fn, args) -> None:
        try:
            await fn(*args)
        except Exception:  # noqa: BLE001 - a background write must never take the daemon down
            log.exception("disk cache: %s failed", fn.__name__)
        finally:
            self._end()

    async def wait_idle(self) -> None:
        """Until every background write and delete has finished."""
        # Again after each wake-up: the delete worker that set the event may have queued
        # more deletes (evictions the journal's growth caused) before this task ran.
        while self._background_count:
            await self._idle.wait()

    async def _store(self, eid: bytes, key: str, version: str, start: int, view, object_bytes: int) -> None:
        """Write the whole chunks inside `view` (bytes at `start` of the object version
        `eid`, that is entry_id(key, version))."""
        if self._write_failures >= WRITE_FAILURES_MAX:
            return
        if self._compacting:  # (a write would wait for the rewrite: this one is skipped)
            self.stats["disk_cache.skipped_bytes"] += len(view)
            self.stats["disk_cache.skipped_stores"] += 1
            return
        cb = self.chunk_bytes
        end = start + len(view)
        lo = -(-start // cb) * cb  # the first chunk boundary at or after start
        hi = end if end == object_bytes else end // cb * cb  # the last one, or the object's end
        if hi <= lo:
            return
        entry = self._entries.get(eid)
        if entry is None:
            if self._deleting(eid):  # (its delete would remove this file)
                self.stats["disk_cache.skipped_bytes"] += len(view)
                self.stats["disk_cache.skipped_stores"] += 1
                return
            entry = journal.Entry(eid, object_bytes, cb, journal.entry_payload(key, version, object_bytes))
            # (as it will take once stored whole: the policy admits it where that fits)
            self._entries.admit(eid, entry, self._disk_bytes_for(object_bytes))
            self.index_bytes += entry.index_bytes()
            self._live_record_bytes += entry.record_bytes()
            self._charge_index()
        # Two first writes at once both define the entry: harmless, the journal keeps one.
        definition = b"" if entry.recorded else entry.definition
        try:
            crcs = await trio.to_thread.run_sync(
                _write_chunks,
                self._data_fd,
                journal.data_name(eid),
                lo,
                view[lo - start : hi - start],
                cb,
                self._journal,
                eid,
                definition,
                limiter=self._write_limiter,
            )
        except OSError as exc:
            self._write_failures += 1
            self.stats["disk_cache.write_errors"] += 1
            log.warning(
                "disk cache write to %s failed (%s)%s",
                self._path(entry),
                exc,
                "; no more writes to the disk cache" if self._write_failures >= WRITE_FAILURES_MAX else "",
            )
            self._evict(eid, entry)
            return
        if crcs is None:  # (another mount's delete removed the file meanwhile: journaled as deleted)
            self._deletes_unread[eid] += 1
            if self._entries.get(eid) is entry:
                self._drop(eid)
                self._charge_index()
            self.stats["disk_cache.skipped_bytes"] += hi - lo
            self.stats["disk_cache.skipped_stores"] += 1
            return
        entry.recorded = True
        if entry.gone:  # evicted while we wrote: what we wrote must go too
            self._queue_delete(eid)
            return
        before_bytes = self._disk_bytes(entry)
        for i, crc in crcs.items():
            entry.add(i, crc, cb)
        grown_bytes = self._disk_bytes(entry) - before_bytes
        self._data_disk_bytes += grown_bytes
        self._entries.grew(eid, grown_bytes, hi - lo)
        self.stats["disk_cache.written_bytes"] += hi - lo
        self._evict_to_capacity()
        if not self._compacting and self._journal.needs_compacting(self._live_record_bytes, self._compact_min_bytes):
            self._compacting = True
            self._in_background(self._compact)

    async def _compact(self) -> None:
        """Rewrite the journal from the index, as it is once appends are held."""
        started_s, before_bytes = time.monotonic(), self._journal.size_bytes

        def snapshot():  # (in the rewriting thread, appends held: the index as of now, from the trio thread)
            return trio.from_thread.run_sync(self._caught_up_entries, False)

        try:
            if not await trio.to_thread.run_sync(self._journal.compact, snapshot):
                return  # (another mount rewrote it)
            self.stats["disk_cache.journal_rewrites"] += 1
            log.info(
                "disk cache journal rewritten: %.1f -> %.1f MiB in %.2f s",
                before_bytes / 2**20,
                self._journal.size_bytes / 2**20,
                time.monotonic() - started_s,
            )
        except OSError as exc:
            self._write_failures = WRITE_FAILURES_MAX  # a disk that cannot take the rewrite (full, failing)
            log.warning("disk cache journal rewrite failed (%s); no more writes to the disk cache", exc)
        finally:
            self._compacting = False

    def _evict_to_capacity(self) -> None:
        self._apply_tail()  # (the bound is for every mount's files together)
        self._measure_dirs()
        self._entries.set_room(self._room_bytes(self._journal.size_bytes))
        while self.stored_bytes > self.capacity_bytes:
            eid = self._entries.victim()  # (probation's least recently read first)
            if eid is None:
                break
            self._evict(eid)

    def _forget(self, entry: journal.Entry) -> None:
        """Take a dropped entry out of the totals."""
        entry.gone = True
        self._data_disk_bytes -= self._disk_bytes(entry)
        self.index_bytes -= entry.index_bytes()
        self._live_record_bytes -= entry.record_bytes()

    def _evict(self, eid: bytes, entry: Optional[journal.Entry] = None) -> None:
        """Delete the object's entry (only if it is still `entry`, when given)."""
        if entry is not None and self._entries.get(eid) is not entry:
            return
        entry = self._entries.pop(eid, None)
        if entry is None:
            return
        self._forget(entry)
        self._charge_index()
        self.stats["disk_cache.evictions"] += 1
        self._queue_delete(entry.eid)

    def _queue_delete(self, eid: bytes) -> None:
        # A queue, not a task per file: evicting 200,000 objects at once must not
        # start 200,000 tasks (~5 KB each).
        self._begin()
        self._deletes_queued[eid] += 1
        self._deletes_send.send_nowait(eid)

    async def _delete_worker(self) -> None:
        """Delete queued entries' files, a batch per thread call."""
        async for eid in self._deletes_receive:
            batch = [eid]
            while len(batch) < DELETE_BATCH_MAX:
                try:
                    batch.append(self._deletes_receive.receive_nowait())
                except trio.WouldBlock:
                    break
            journaled = False
            try:
                error, journaled = await trio.to_thread.run_sync(
                    _delete_files, self._data_fd, self._journal, batch, limiter=self._delete_limiter
                )
                if error is not None:
                    log.warning("disk cache: could not delete every file of %d evicted objects (%s)", len(batch), error)
            finally:
                for eid in batch:
                    _take_one(self._deletes_queued, eid)
                    if journaled:
                        self._deletes_unread[eid] += 1
                self._end(len(batch))
            self._evict_to_capacity()  # (the journal grew by their records: it counts)
