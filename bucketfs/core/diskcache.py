"""Local disk cache (`--cache-dir`): object bytes kept on a local disk, so an epoch
after the kernel's page cache let go of them (a data set larger than RAM) reads the
disk, not the bucket.

It sits in front of the backend and speaks its read interface: a read whose chunks
are all on disk is answered from there; any other read goes to the store, and the
whole chunks it covers are written to disk after it.

Invariants:
- Chunks are keyed by (key, version): a changed object never reads an old chunk.
- Every stored chunk's CRC-32 is kept in memory and checked on every read from disk:
  a disk that hands back other bytes (a bad sector, a file changed behind our back,
  a crash that kept a chunk's record but not its bytes) costs a GET, never a wrong byte.
- Only whole chunks are stored (a chunk is the block-cache block, so random reads
  fill it too), plus an object's shorter last chunk when its size is known.
- Disk use (the bytes of stored chunks; files are sparse) stays within
  `capacity_bytes`: least recently used objects are deleted first.
- Kept across mounts: the journal (cachejournal.py) records each object's
  (key, version, size) and its chunks' CRCs, and is loaded at start. A later mount
  finds a chunk only under the version its listing names, so an object changed
  in between is fetched again. The directory is one mount's at a time (mount.py
  holds a lock on it).
- A hit whose file the kernel holds in its page cache is read on the event loop with
  reads that cannot wait for a disk (pagecache.py); any other goes to a disk thread.
  At start, the newest kept objects are read ahead into the page cache (after a
  reboot they are on disk only).
- Disk trouble (full, I/O errors) is never a read error: the read goes to the store,
  and the cache stops storing after `WRITE_FAILURES_MAX` failed writes.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import zlib
from typing import Optional

import trio

from bucketfs import errors
from bucketfs.core import cachejournal
from bucketfs.core import pagecache

log = logging.getLogger(__name__)

_PRIVATE_DIR_RE = re.compile(r"bucketfs-(\d+)-")

# Bytes handed to background writes and not on disk yet: past this a read's bytes are
# simply not stored (a slow disk must not hold the memory of a fast network).
PENDING_WRITES_MAX_BYTES = 64 * 1024 * 1024
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


def _write_chunks(path: str, offset: int, view, chunk_bytes: int, journal, entry_no: int, definition: bytes) -> dict:
    """Write `view` at `offset` (a chunk boundary), then journal the CRC-32 of each
    chunk in it (after `definition`, the entry's record, if not journaled yet); the CRCs."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    finally:
        os.close(fd)
    first = offset // chunk_bytes
    crcs = {first + n: zlib.crc32(view[at : at + chunk_bytes]) for n, at in enumerate(range(0, len(view), chunk_bytes))}
    journal.append(definition + cachejournal.chunks_record(entry_no, crcs.items()))
    return crcs


def _delete(path: str, journal, entry_no: int) -> None:
    try:
        os.unlink(path)
    finally:
        journal.append(cachejournal.delete_record(entry_no))


_WOULD_BLOCK = object()  # (a no-wait read that needs the disk)


def _read_chunks(path: str, lo: int, hi: int, crcs: list, chunk_bytes: int, start: int, end: int, into=None,
                 on_loop: bool = False):
    """Bytes [start, end) of the object, read as the chunks [lo, hi) around them and
    checked against `crcs`: as a bytes-like object, or into `into` (then their length).
    None if the file is gone, short or does not match. `on_loop` (on the event loop, no
    waiting): _WOULD_BLOCK if the file's name or bytes are not all in the kernel's caches."""
    try:
        fd = pagecache.open_cached(path) if on_loop else os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    if fd is None:
        return _WOULD_BLOCK
    direct = into is not None and (lo, hi) == (start, end)
    try:
        buf = into if direct else bytearray(hi - lo)
        view = memoryview(buf)[: hi - lo]
        if on_loop:
            if not pagecache.pread_cached(fd, view, lo):
                return _WOULD_BLOCK
        else:
            got = 0
            while got < hi - lo:
                n = os.preadv(fd, [view[got:]], lo + got)
                if n == 0:
                    return None
                got += n
    finally:
        os.close(fd)
    for n, at in enumerate(range(0, hi - lo, chunk_bytes)):
        if zlib.crc32(view[at : at + chunk_bytes]) != crcs[n]:
            return None
    if direct:
        return end - start
    if into is not None:
        into[: end - start] = view[start - lo : end - lo]
        return end - start
    if (lo, hi) == (start, end):
        return buf  # (a whole small file, the usual hit: no second copy of it)
    return bytes(view[start - lo : end - lo])


class DiskCache:
    """A backend in front of `inner` whose reads are kept in `directory`."""

    def __init__(self, inner, directory: str, capacity_bytes: int, chunk_bytes: int, stats, nursery: trio.Nursery, budget=None):
        """`budget`: the MemoryBudget the index is charged to, if any."""
        self.inner = inner
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.chunk_bytes = chunk_bytes
        self.stats = stats
        self.nursery = nursery
        self.receives_into = inner.receives_into
        self._entries: collections.OrderedDict = collections.OrderedDict()  # entry_id(key, version) -> Entry, LRU first
        self.stored_bytes = 0
        self._pending_bytes = 0
        self._background_count = 0  # writes and deletes in flight
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
        self._budget = budget
        self.index_bytes = 0  # memory the index takes (Entry objects and their CRCs)
        self._charged_index_bytes = 0
        self._journal = self._load()
        self._charge_index(force=True)
        self._evict_to_capacity()  # (a smaller --cache-size than last time)
        self._start_read_ahead()

    def _load(self):
        """The journal of `directory`, its entries (from earlier mounts) taken in, LRU
        first, and data files no entry names removed. Runs before the mount serves."""
        started_s = time.monotonic()
        try:
            journal = cachejournal.Journal(self.directory, self.chunk_bytes)
            orphans_count = cachejournal.remove_orphans(self.directory, journal.entries)
        except OSError as exc:
            raise _dir_error(self.directory, exc) from None
        for entry_no, entry in journal.entries.items():
            entry.recorded = True
            self._entries[journal.ids[entry_no]] = entry
            self.stored_bytes += entry.stored_bytes
            self.index_bytes += entry.index_bytes()
            self._live_record_bytes += entry.record_bytes()
        journal.entries.clear()  # (the index is _entries now)
        journal.ids.clear()
        self.stats["disk_cache.loaded_bytes"] = self.stored_bytes
        if self._entries or orphans_count:
            log.info("disk cache %s: %d objects, %.1f MiB kept from earlier mounts (%d stray files removed) in %.2f s",
                     self.directory, len(self._entries), self.stored_bytes / 2**20, orphans_count, time.monotonic() - started_s)
        return journal

    def _start_read_ahead(self) -> None:
        """Ask the kernel to read the most recently used files into the page cache, up
        to a share of the memory available (after a reboot a cached epoch then reads
        on the event loop, not through threads)."""
        budget_bytes = min(self.stored_bytes, int(pagecache.available_memory_bytes() * READ_AHEAD_MEMORY_FRACTION))
        paths, total_bytes = [], 0
        for entry in reversed(self._entries.values()):
            if total_bytes >= budget_bytes:
                break
            if entry.stored_bytes != entry.object_bytes:
                continue  # (a sparse file: reading it whole would fill the page cache with its holes)
            paths.append(cachejournal.data_path(self.directory, entry.entry_no))
            total_bytes += entry.stored_bytes
        self.stats["disk_cache.read_ahead_bytes"] = total_bytes
        if paths:
            self.nursery.start_soon(self._read_ahead, paths, total_bytes)

    async def _read_ahead(self, paths: list, total_bytes: int) -> None:
        stop = threading.Event()
        started_s = time.monotonic()
        try:
            await trio.to_thread.run_sync(pagecache.read_ahead, paths, stop, abandon_on_cancel=True)
            log.info("disk cache: asked the kernel to read %d files (%.1f MiB) ahead in %.2f s", len(paths),
                     total_bytes / 2**20, time.monotonic() - started_s)
        finally:
            stop.set()  # (an unmount does not wait for the rest)

    def _charge_index(self, force: bool = False) -> None:
        # In steps of a MiB: a store per file must not recompute the budget per file.
        if self._budget is not None and (force or abs(self.index_bytes - self._charged_index_bytes) >= INDEX_CHARGE_STEP_BYTES):
            self._charged_index_bytes = self.index_bytes
            self._budget.charge_disk_index(self.index_bytes)

    def __getattr__(self, name):
        # requests, bytes_fetched, caller, list_page, stat, check_bucket...: the store's.
        return getattr(self.inner, name)

    # -- reads -------------------------------------------------------------------
    def _span(self, start: int, end: int, object_bytes: Optional[int]):
        """The chunk-aligned span [lo, hi) around [start, end), clipped to the object."""
        cb = self.chunk_bytes
        return start // cb * cb, min(-(-end // cb) * cb, object_bytes)

    def _on_disk(self, eid: bytes, lo: int, hi: int) -> Optional[tuple]:
        entry = self._entries.get(eid)
        if entry is None:
            return None
        cb = self.chunk_bytes
        first, last = lo // cb, -(-hi // cb)
        if not entry.has(first, last):
            return None
        self._entries.move_to_end(eid)
        return entry, entry.crcs[first:last]

    async def _read_disk(self, eid: bytes, start: int, end: int, object_bytes: Optional[int], into=None):
        """The bytes of [start, end) of the object version `eid` from disk (into `into`
        if given), or None."""
        if object_bytes is None or start >= min(end, object_bytes):
            return None
        end = min(end, object_bytes)
        lo, hi = self._span(start, end, object_bytes)
        found = self._on_disk(eid, lo, hi)
        if found is None:
            self.stats["disk_cache.misses"] += 1
            return None
        entry, crcs = found
        path = cachejournal.data_path(self.directory, entry.entry_no)
        try:
            data = _WOULD_BLOCK
            if self._loop_reads and hi - lo <= LOOP_READ_MAX_BYTES:
                data = _read_chunks(path, lo, hi, crcs, self.chunk_bytes, start, end, into, on_loop=True)
                if data is not _WOULD_BLOCK:
                    self.stats["disk_cache.loop_reads"] += 1
            if data is _WOULD_BLOCK:
                data = await trio.to_thread.run_sync(_read_chunks, path, lo, hi, crcs, self.chunk_bytes, start, end, into,
                                                     limiter=self._read_limiter)
        except OSError as exc:
            log.warning("disk cache read of %s failed (%s); reading the store", path, exc)
            data = None
        if data is None:
            if not entry.gone:  # (an entry evicted while we read it just lost its file)
                self.stats["disk_cache.bad_reads"] += 1
                self._evict(eid, entry)
            return None
        self.stats["disk_cache.hits"] += 1
        self.stats["disk_cache.read_bytes"] += end - start
        return data

    async def read_range(self, key: str, start: int, end: int, version: str, object_bytes: Optional[int] = None) -> bytes:
        eid = cachejournal.entry_id(key, version)  # (once: a miss stores under it too)
        data = await self._read_disk(eid, start, end, object_bytes)
        if data is not None:
            return data
        data = await self.inner.read_range(key, start, end, version, object_bytes=object_bytes)
        # bytes never change: stored in the background, the reader does not wait for the disk
        if object_bytes is not None:
            if self._pending_bytes + len(data) <= PENDING_WRITES_MAX_BYTES:
                self._pending_bytes += len(data)
                self._in_background(self._store_pending, eid, key, version, start, data, object_bytes)
            else:
                self.stats["disk_cache.skipped_bytes"] += len(data)
        return data

    async def read_range_into(self, key: str, start: int, end: int, version: str, buffer, object_bytes: Optional[int] = None) -> int:
        eid = cachejournal.entry_id(key, version)
        got = await self._read_disk(eid, start, end, object_bytes, into=buffer)
        if got is not None:
            return got
        got = await self.inner.read_range_into(key, start, end, version, buffer, object_bytes=object_bytes)
        if object_bytes is not None:
            # The buffer is reused once we return: store it now (into the page cache: ~ms per part).
            await self._store(eid, key, version, start, memoryview(buffer)[:got], object_bytes)
        return got

    # -- writes ------------------------------------------------------------------
    async def _store_pending(self, eid: bytes, key: str, version: str, start: int, data: bytes, object_bytes: int) -> None:
        try:
            await self._store(eid, key, version, start, memoryview(data), object_bytes)
        finally:
            self._pending_bytes -= len(data)

    def _in_background(self, fn, *args) -> None:
        if self._idle.is_set():
            self._idle = trio.Event()
        self._background_count += 1
        self.nursery.start_soon(self._background, fn, args)

    async def _background(self, fn, args) -> None:
        try:
            await fn(*args)
        except Exception:  # noqa: BLE001 - a background write must never take the daemon down
            log.exception("disk cache: %s failed", fn.__name__)
        finally:
            self._background_count -= 1
            if not self._background_count:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Until every background write and delete has finished."""
        await self._idle.wait()

    async def _store(self, eid: bytes, key: str, version: str, start: int, view, object_bytes: int) -> None:
        """Write the whole chunks inside `view` (bytes at `start` of the object version
        `eid`, that is entry_id(key, version))."""
        if self._write_failures >= WRITE_FAILURES_MAX:
            return
        if self._compacting:  # (a write would wait for the rewrite: this one is skipped)
            self.stats["disk_cache.skipped_bytes"] += len(view)
            return
        cb = self.chunk_bytes
        end = start + len(view)
        lo = -(-start // cb) * cb  # the first chunk boundary at or after start
        hi = end if end == object_bytes else end // cb * cb  # the last one, or the object's end
        if hi <= lo:
            return
        entry = self._entries.get(eid)
        if entry is None:
            entry_no = self._journal.next_entry_no
            self._journal.next_entry_no += 1
            entry = self._entries[eid] = cachejournal.Entry(entry_no, object_bytes, cb,
                                                            cachejournal.entry_record(entry_no, key, version, object_bytes))
            self.index_bytes += entry.index_bytes()
            self._live_record_bytes += entry.record_bytes()
            self._charge_index()
        path = cachejournal.data_path(self.directory, entry.entry_no)
        # Two first writes at once both define the entry: harmless, the journal keeps one.
        definition = b"" if entry.recorded else entry.definition
        try:
            crcs = await trio.to_thread.run_sync(_write_chunks, path, lo, view[lo - start : hi - start], cb,
                                                 self._journal, entry.entry_no, definition, limiter=self._write_limiter)
        except OSError as exc:
            self._write_failures += 1
            self.stats["disk_cache.write_errors"] += 1
            log.warning("disk cache write to %s failed (%s)%s", path, exc,
                        "; no more writes to the disk cache" if self._write_failures >= WRITE_FAILURES_MAX else "")
            self._evict(eid, entry)
            return
        entry.recorded = True
        if entry.gone:  # evicted while we wrote: what we wrote must go too
            self._in_background(self._delete, entry)
            return
        for i, crc in crcs.items():
            self.stored_bytes += entry.add(i, crc, cb)
        self.stats["disk_cache.written_bytes"] += hi - lo
        self._evict_to_capacity()
        if not self._compacting and self._journal.needs_compacting(self._live_record_bytes):
            self._compacting = True
            self._in_background(self._compact)

    async def _compact(self) -> None:
        """Rewrite the journal from the index, as it is once appends are held."""
        started_s, before_bytes = time.monotonic(), self._journal.size_bytes

        def snapshot():  # (in the rewriting thread, appends held: the index as of now, from the trio thread)
            return trio.from_thread.run_sync(lambda: list(self._entries.values()))
        try:
            await trio.to_thread.run_sync(self._journal.compact, snapshot)
            self.stats["disk_cache.journal_rewrites"] += 1
            log.info("disk cache journal rewritten: %.1f -> %.1f MiB in %.2f s", before_bytes / 2**20,
                     self._journal.size_bytes / 2**20, time.monotonic() - started_s)
        except OSError as exc:
            self._write_failures = WRITE_FAILURES_MAX  # a disk that cannot take the rewrite (full, failing)
            log.warning("disk cache journal rewrite failed (%s); no more writes to the disk cache", exc)
        finally:
            self._compacting = False

    def _evict_to_capacity(self) -> None:
        while self.stored_bytes > self.capacity_bytes and self._entries:
            self._evict(next(iter(self._entries)))  # the least recently used

    def _evict(self, eid: bytes, entry: Optional[cachejournal.Entry] = None) -> None:
        """Delete the object's entry (only if it is still `entry`, when given)."""
        if entry is not None and self._entries.get(eid) is not entry:
            return
        entry = self._entries.pop(eid, None)
        if entry is None:
            return
        entry.gone = True
        self.stored_bytes -= entry.stored_bytes
        self.index_bytes -= entry.index_bytes()
        self._live_record_bytes -= entry.record_bytes()
        self._charge_index()
        self.stats["disk_cache.evictions"] += 1
        self._in_background(self._delete, entry)

    async def _delete(self, entry: cachejournal.Entry) -> None:
        """Delete the entry's file and journal it (a lost record only costs a bad read
        of the missing file at a later mount)."""
        path = cachejournal.data_path(self.directory, entry.entry_no)
        try:
            await trio.to_thread.run_sync(_delete, path, self._journal, entry.entry_no, limiter=self._write_limiter)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("disk cache: could not delete %s (%s)", path, exc)


# -- the directory -------------------------------------------------------------------
def check_cache_dir(path: str) -> None:
    """--cache-dir must be a directory this process can create files in (created if missing)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        probe = tempfile.TemporaryFile(dir=path)
        probe.close()
    except OSError as exc:
        raise _dir_error(path, exc) from None


def _dir_error(path: str, exc: OSError) -> errors.UserError:
    return errors.UserError(f"cache directory {path}: {exc.strerror or exc}", errors.EXIT_BAD_CACHE_DIR)


def claim_dir(path: str, identity: str, name_hint: str) -> tuple:
    """(directory, lock_fd): the cache directory under `path` of the mount `identity`
    (its bucket URL and endpoint), kept across mounts and locked while `lock_fd` is
    open (the lock goes with the process, however it ends). If another live mount
    holds it: (a private directory to remove at exit, None)."""
    digest = hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    directory = os.path.join(path, f"{re.sub(r'[^A-Za-z0-9._-]', '_', name_hint)[:64]}-{digest}")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        lock_fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise _dir_error(path, exc) from None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        private = make_private_dir(path)
        log.warning("disk cache %s is in use by another mount of %s; this one caches in %s, removed at exit",
                    directory, identity, private)
        return private, None
    return directory, lock_fd


def make_private_dir(path: str) -> str:
    """This mount's own directory under `path` (removed at exit). Directories that
    mounts which died without cleaning up left behind are removed first."""
    try:
        for name in os.listdir(path):
            match = _PRIVATE_DIR_RE.match(name)
            if match and not _alive(int(match.group(1))):
                log.info("removing %s, left by a mount that is gone", os.path.join(path, name))
                shutil.rmtree(os.path.join(path, name), ignore_errors=True)
        return tempfile.mkdtemp(prefix=f"bucketfs-{os.getpid()}-", dir=path)
    except OSError as exc:
        raise _dir_error(path, exc) from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True
