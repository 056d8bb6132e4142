"""Block cache: fixed-size blocks keyed by (key, version, block index), single flight,
and a scan-resistant replacement policy (blockpolicy.py).

Serves random reads (fetching only the blocks a read touches, coalesced into one
ranged GET per run of missing blocks) and small files (one GET for the whole
object, started at open, split into blocks).

A run's GET is received straight into one buffer, and its blocks are views of it,
not copies: a READ inside one run is a slice of that buffer, so the bytes are copied
once, from the socket, before the kernel takes them. A run is therefore evicted as a
whole (its buffer is freed only with its last block), which keeps the budget exact.

Which run goes when the budget wants memory back (`evict`, its first reclaimer): not
the least recently used, which on random-order passes over a data set larger than
the cache evicts each file before the next pass comes back to it (~15% of a data set
twice the room found cached), but blockpolicy.py's: the disk cache's resident set and
probation (diskcache/policy.py) over runs, which keeps ~1/N of a data set N times the
room cached on every pass (~47% at 2x) and lets a one-time scan replace nothing
resident. `LRU_POLICY = True` is plain LRU, for comparisons.

Invariants:
- A block holds bytes of exactly one version: the version is part of its key and
  the backend refuses reads of a changed object, so no read mixes versions.
- Every cached byte is reserved in the MemoryBudget; eviction releases it.
- Two readers that miss the same block wait on one GET (a Flight); a failed
  flight hands its error to every waiter and caches nothing.
- A pushed file's copy kept by the daemon (`kept`, core/kept.py) is read from there,
  never fetched while it is kept.
- An object fetched ahead (`fetch_ahead`, for core/fetchahead.py) is held: never
  evicted until `release_hold` (its reader opened it, or the pass stopped), outside
  the policy's index until then, so evictions never look at it. Its GET
  is speculative, in fetch-ahead's own connection pool (backends/slots.py), until a
  reader waits on it.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
from typing import Callable, Optional

import trio

from bucketfs import errors
from bucketfs.backends.base import PUSH_FAILED, PUSH_READ, PUSHED, PushRequest
from bucketfs.backends.slots import mark_speculative
from bucketfs.core.blockpolicy import Run, RunResidency
from bucketfs.core.kept import KeptCopies
from bucketfs.core.pieces import Pieces

log = logging.getLogger(__name__)

# A pinned object's runs are not evicted while its reader is this recent (its open or
# its last READ): a reader that went quiet with the file open does not hold memory
# others wait for for longer than this.
PIN_FRESH_S = 2.0
# The replacement policy: blockpolicy.py's scan-resistant one; True: plain LRU (for
# comparisons: tests and benchmarks may set it before a cache is made).
LRU_POLICY = False
# A kept copy takes whole pages of shared memory (backends/http/arena.py): a push that
# may be kept reserves its size rounded up to them.
KEPT_PAGE_BYTES = mmap.PAGESIZE


class Flight:
    """One GET of a run of blocks. Also the ticket of its GET's connection slot
    (backends/slots.py): a fetch-ahead flight is speculative until someone waits on it."""

    __slots__ = ("done", "error", "blocks", "speculative", "waiters", "in_own_slot", "on_wait", "outcome", "on_end")

    def __init__(self, speculative: bool = False):
        self.done = trio.Event()
        self.error: Optional[BaseException] = None
        self.blocks: dict = {}  # block index -> Block, kept for the waiters even if evicted
        self.speculative = speculative
        self.waiters = 0
        self.in_own_slot = False  # (set by PrioritySlots)
        self.on_wait: Optional[Callable[[], None]] = None  # called when its first waiter comes
        self.outcome = ""  # a push's (push_ahead): Backend.push_whole's
        # A push into the kernel (push_ahead, not for a reader): called once it has ended.
        self.on_end: Optional[list] = None

    @property
    def urgent(self) -> bool:
        return not self.speculative or self.waiters > 0

    @property
    def own_slots(self) -> bool:
        return self.speculative


class Block:
    """Bytes [lo, hi) of `run`, the read-only buffer its fetch received (shared by the
    blocks of that fetch), whose policy entry is `entry`."""

    __slots__ = ("run", "lo", "hi", "entry")

    def __init__(self, run: memoryview, lo: int, hi: int, entry: Run):
        self.run, self.lo, self.hi, self.entry = run, lo, hi, entry

    def __len__(self) -> int:
        return self.hi - self.lo


class BlockCache:
    RECLAIM_PRIORITY = 0  # the cheapest memory to give back: re-fetchable, often in the page cache

    def __init__(self, backend, budget, stats, block_size_bytes: int, nursery: trio.Nursery):
        self.backend = backend
        self.nursery = nursery
        self.budget = budget
        self.stats = stats
        self.block_size_bytes = block_size_bytes
        self._blocks: dict = {}  # (key, version, idx) -> Block
        self._flights: dict = {}  # (key, version, idx) -> Flight
        # The runs that may be evicted, in the policy's order (blockpolicy.py); not held ones.
        # Its room, until evictions measure it: what speculative memory may fill, a guess
        # below what the cache gets, so that the first evictions grow it (from a guess
        # above, the resident set would fill past what the cache holds, and evictions
        # would take the runs it took in first).
        self._index = RunResidency(budget.capacity_bytes - budget.demand_headroom_bytes, lru=LRU_POLICY)
        self.cached_bytes = 0
        self._pins: dict = {}  # (key, version) -> [open handles reading it, trio time of their last open or READ]
        # (key, version) -> [bytes, its Run once landed], fetched ahead and not yet opened: never evicted
        self._held: dict = {}
        self.held_bytes = 0
        # Under a budget the pinned files fill, every waiting READ's reclaim would walk
        # all their runs to find nothing: the last such walk is remembered, until a
        # run lands, a pin goes or the first of them lapses.
        self._changes = 0
        self._fruitless: Optional[tuple] = None  # (_changes, trio time the first passed pin lapses)
        self.kept: Optional[KeptCopies] = None  # of pushed files, once pushes keep them
        budget.add_reclaimer(self.RECLAIM_PRIORITY, self.evict)

    # -- pins: a small file being read stays until its reader has read it ----------
    # Without them, readers whose files together outgrow the budget evicted each
    # other's files between two READs, and each READ fetched its file again (64
    # readers of 6 MiB files on 64 MiB: 207 GETs per GB read; 36 with pins).
    def pin(self, key: str, version: str) -> None:
        pin = self._pins.setdefault((key, version), [0, 0.0])
        pin[0] += 1
        pin[1] = trio.current_time()

    def touch(self, key: str, version: str) -> None:
        pin = self._pins.get((key, version))
        if pin is not None:
            pin[1] = trio.current_time()

    def unpin(self, key: str, version: str) -> None:
        pin = self._pins.get((key, version))
        if pin is None:
            return
        pin[0] -= 1
        if pin[0] <= 0:
            del self._pins[(key, version)]
            self._changes += 1
            self.budget.reclaimable_grew()

    def evict(self, wanted_bytes: int) -> int:
        """Runs in the policy's order (blockpolicy.py), each whole, passing over pinned
        ones; the bytes freed. Held runs are not in the index: never looked at."""
        index = self._index
        index.note_room(max(0, index.indexed_bytes - wanted_bytes))
        now_s = trio.current_time()
        fruitless = self._fruitless
        if fruitless is not None and fruitless[0] == self._changes and now_s < fruitless[1]:
            return 0
        freed_bytes = 0
        passed = 0  # pinned runs passed over: each is looked at once per call
        first_lapse_s = math.inf
        if wanted_bytes > 0:
            for eid in index.victims():
                key, version, _ = eid
                pin = self._pins.get((key, version)) if self._pins else None
                if pin is not None and now_s - pin[1] < PIN_FRESH_S:
                    self.stats["cache.pinned_passed"] += index.get(eid).count
                    passed += 1
                    first_lapse_s = min(first_lapse_s, pin[1] + PIN_FRESH_S)
                    continue
                freed_bytes += self._drop(index.pop(eid))
                if freed_bytes >= wanted_bytes:
                    break
        # (Held runs lapse never: only a release_hold, which counts as a change, frees them.)
        self._fruitless = (self._changes, first_lapse_s) if passed and not freed_bytes else None
        self.cached_bytes -= freed_bytes
        self.budget.release(freed_bytes)
        return freed_bytes

    def _drop(self, run: Run) -> int:
        """Forget the blocks of `run` (out of the index already); its bytes."""
        key, version, first = run.eid
        for i in range(first, first + run.count):
            block = self._blocks.get((key, version, i))
            if block is not None and block.entry is run:
                del self._blocks[(key, version, i)]
        self.stats["cache.evictions"] += run.count
        return run.size

    async def read(self, key: str, version: str, size_bytes: int, start: int, end: int):
        """Bytes [start, end) of the object (end clipped to its size): a bytes-like object,
        or Pieces where they lie in the buffers of several fetches."""
        end = min(end, size_bytes)
        if start >= end:
            return b""
        bs = self.block_size_bytes
        first, last = start // bs, (end - 1) // bs
        while True:
            if self.kept is not None and (key, version) in self.kept:
                data = self.kept.read(key, version, start, end)
                if data is not None:
                    return data
            pieces = await self._blocks_for(key, version, size_bytes, first, last)
            if pieces is not None:
                break  # (else a push this waited on left a kept copy)
        run = pieces[0].run
        if all(block.run is run for block in pieces):
            self._index.note_read(pieces[0].entry, end - start)
            # One fetch's blocks, consecutive in its buffer: a slice of it. pyfuse3 replies
            # from any buffer, so the reply is not a copy.
            lo = pieces[0].lo + start - first * bs
            return run[lo : lo + end - start]
        read_bytes: dict = {}  # Run -> bytes of this READ in it
        for i, block in zip(range(first, last + 1), pieces):
            n_bytes = min(end, i * bs + len(block)) - max(start, i * bs)
            read_bytes[block.entry] = read_bytes.get(block.entry, 0) + n_bytes
        for entry, n_bytes in read_bytes.items():
            self._index.note_read(entry, n_bytes)
        # Blocks of several fetches: a slice of each (joined by a caller that needs one buffer).
        return Pieces(
            block.run[block.lo + max(start - i * bs, 0) : block.lo + min(end - i * bs, len(block))]
            for i, block in zip(range(first, last + 1), pieces)
        )

    def holds(self, key: str, version: str, offset: int) -> bool:
        """The block at `offset` is cached or on its way (no fetch needed for it)."""
        ck = (key, version, offset // self.block_size_bytes)
        kept = self.kept
        return ck in self._blocks or ck in self._flights or (kept is not None and (key, version) in kept)

    def start_read(self, key: str, version: str, size_bytes: int, start: int, end: int) -> None:
        """Start fetching the missing blocks of [start, end) without waiting (small file at open)."""
        end = min(end, size_bytes)
        if start < end:
            self._plan(key, version, size_bytes, start // self.block_size_bytes, (end - 1) // self.block_size_bytes)

    async def _blocks_for(self, key, version, size_bytes, first, last) -> Optional[list]:
        """The blocks, cached or fetched; None if the object is kept (kept.py) instead."""
        found, waits = self._plan(key, version, size_bytes, first, last)
        if found is None:
            return None
        for i, flight in waits:
            if not flight.done.is_set():
                # (Only then: a READ over 16 blocks of one flight would otherwise pass 16
                # scheduler rounds, holding the flight's buffer all along, however soon
                # the budget evicted its blocks.)
                flight.waiters += 1  # a fetch-ahead GET someone waits on is urgent now
                if flight.on_wait is not None and flight.waiters == 1:
                    flight.on_wait()
                try:
                    await flight.done.wait()
                finally:
                    flight.waiters -= 1
            if flight.error is not None:
                raise flight.error
            block = flight.blocks.get(i)
            if block is None:
                # A push that gave its bytes to the kernel only (or was refused): they
                # are fetched here now, the flight gone.
                return await self._blocks_for(key, version, size_bytes, first, last)
            found[i] = block
        return [found[i] for i in range(first, last + 1)]

    def _plan(self, key, version, size_bytes, first, last):
        """Split blocks into cached, in flight and missing; start one fetch per missing run
        (found is None, nothing started, for a kept object).
        (A hit is a read for the policy in `read`, where the bytes read are known: the
        hits of a start_read at open are followed by the READs.)"""
        found: dict = {}
        waits: list = []
        missing_run: list = []
        if self.kept is not None and (key, version) in self.kept:
            return None, waits  # (read from there: nothing to fetch)
        for i in range(first, last + 1):
            ck = (key, version, i)
            data = self._blocks.get(ck)
            if data is not None:
                found[i] = data
                self.stats["cache.hits"] += 1
                continue
            flight = self._flights.get(ck)
            if flight is not None:
                waits.append((i, flight))
                self.stats["cache.shared_misses"] += 1
                continue
            self.stats["cache.misses"] += 1
            if missing_run and missing_run[-1] != i - 1:
                waits.extend(self._start_fetch(key, version, size_bytes, missing_run))
                missing_run = []
            missing_run.append(i)
        if missing_run:
            waits.extend(self._start_fetch(key, version, size_bytes, missing_run))
        return found, waits

    def _start_fetch(
        self, key, version, size_bytes, run: list, flight: Optional[Flight] = None, reserved_bytes=0
    ) -> list:
        """Register one flight for a run of consecutive missing blocks; return its waits.
        `reserved_bytes`: memory the caller already reserved for it."""
        flight = flight or Flight()
        for i in run:
            self._flights[(key, version, i)] = flight
        bs = self.block_size_bytes
        start, end = run[0] * bs, min((run[-1] + 1) * bs, size_bytes)
        # The fetch runs in its own task, so a reader that gives up (interrupt) does not
        # strand the other waiters of this flight.
        self.nursery.start_soon(self._fetch, key, version, size_bytes, start, end, run, flight, reserved_bytes)
        return [(i, flight) for i in run]

    async def _fetch(self, key, version, object_bytes, start, end, run, flight: Flight, reserved_bytes: int) -> None:
        # reserved_bytes: set once reserved (a reserve cancelled at unmount released nothing)
        if flight.speculative:
            mark_speculative(flight)
        try:
            if not reserved_bytes:
                await self.budget.reserve(end - start)
                reserved_bytes = end - start
            # The blocks are views of the answer, not copies (slicing it into blocks was a
            # second copy of every byte, and both were alive at once outside the budget).
            data = memoryview(
                await self.backend.read_range(key, start, end, version, object_bytes=object_bytes)
            ).toreadonly()
            if len(data) != end - start:
                raise errors.ObjectChanged(f"{key}: expected {end - start} bytes at {start}, got {len(data)}")
            self._land(key, version, run, flight, data)
            reserved_bytes = 0  # ownership moved to the cache; eviction releases it
        except errors.BucketfsError as exc:
            flight.error = exc
        except Exception as exc:  # noqa: BLE001 - a waiter must get an errno, never hang
            log.exception("unexpected error fetching %r [%d, %d)", key, start, end)
            flight.error = errors.BackendError(str(exc))
        finally:
            if reserved_bytes:
                self.budget.release(reserved_bytes)
            for i in run:
                self._flights.pop((key, version, i), None)
            if flight.error is not None:
                self.release_hold(key, version)  # nothing was cached to hold
            flight.done.set()

    def _land(self, key, version, run: list, flight: Flight, data: memoryview) -> None:
        """Cache `data`, the bytes of `run`'s blocks a flight fetched (their memory,
        reserved, is the cache's from now on)."""
        bs = self.block_size_bytes
        entry = Run(key, version, run[0], len(run), len(data))
        for n, i in enumerate(run):
            block = Block(data, n * bs, min((n + 1) * bs, len(data)), entry)
            flight.blocks[i] = block
            self._blocks[(key, version, i)] = block
        self.cached_bytes += len(data)
        held = self._held.get((key, version))
        if held is not None:
            held[1] = entry  # the policy takes it in when it is let go
        else:
            self._index.add(entry)
        self._changes += 1
        self.budget.reclaimable_grew()
        self.stats["cache.fetched_bytes"] += len(data)

    # -- fetched ahead of its reader (core/fetchahead.py) ---------------------------
    def push_ahead(
        self,
        key: str,
        version: str,
        size_bytes: int,
        ino: int,
        tell_open: bool,
        on_done: Callable[[str], None],
        for_reader: bool = False,
    ) -> Optional[Flight]:
        """fetch_ahead into the kernel's page cache (inode `ino`'s) by a fetch-ahead
        worker (Backend.push_whole): the bytes come here only if a READ waits for them
        (then cached, not held). Its memory is reserved while it runs (the worker's
        buffer). None as for fetch_ahead. The flight's `outcome` is push_whole's, which
        `on_done(outcome)` is called with once it ended, whatever happened (a call, not
        a task waiting for the flight: one task less per file). `tell_open`:
        PushRequest's. `for_reader`: a reader's READs are about to wait for it, so the
        body comes back from the start (it never goes into the kernel)."""
        last = (size_bytes - 1) // self.block_size_bytes
        run = list(range(last + 1))
        if (
            size_bytes <= 0
            or (self.kept is not None and (key, version) in self.kept)
            or any((key, version, i) in self._blocks or (key, version, i) in self._flights for i in run)
        ):
            return None
        reserved_bytes = size_bytes
        # A pass's push makes its room from the oldest kept copies; a reader's takes free
        # memory only, else its READ fetches as usual: after the page cache was dropped
        # the kept copies are the files the loader reads next (its body does not take
        # their arena extents either: workerengine._push_request).
        reclaim_priority = KeptCopies.RECLAIM_PRIORITY - 1 if for_reader else KeptCopies.RECLAIM_PRIORITY
        if self.kept is not None:
            reserved_bytes = -(-size_bytes // KEPT_PAGE_BYTES) * KEPT_PAGE_BYTES  # (kept: whole pages)
            if not for_reader:
                self.kept.make_room(reserved_bytes)
        if not self.budget.try_reserve(
            reserved_bytes,
            reclaim_priority=reclaim_priority,
            refused_stat="open.worker_memory_refused" if for_reader else "fetch_ahead.memory_refused",
        ):
            return None
        flight = Flight(speculative=True)
        request = PushRequest(tell_open)
        flight.on_wait = request.ask_for_body
        if for_reader:
            request.ask_for_body()
        else:
            flight.on_end = []
        for i in run:
            self._flights[(key, version, i)] = flight
        ended = functools.partial(self._pushed, key, version, size_bytes, run, flight, reserved_bytes, on_done)
        # Most pushes start here with no task of their own (push_soon); the first ones,
        # while the backend's workers start, wait in one.
        if not self.backend.push_soon(key, version, size_bytes, ino, request, ended):
            self.nursery.start_soon(self._push, key, version, size_bytes, ino, request, ended)
        return flight

    async def _push(self, key, version, size_bytes, ino, request, ended) -> None:
        outcome, body = PUSH_FAILED, None
        try:
            outcome, body = await self.backend.push_whole(key, version, size_bytes, ino, request)
        except Exception:  # noqa: BLE001 - its waiters fetch the file themselves, never hang
            log.exception("unexpected error pushing %r", key)
        finally:
            ended(outcome, body)

    def _pushed(
        self, key, version, size_bytes, run: list, flight: Flight, reserved_bytes, on_done, outcome: str, body
    ) -> None:
        """A push ended with `outcome` and `body` (push_whole's): land or keep what it
        brought, let go of its flight and memory, and tell `on_done(outcome)`."""
        flight.outcome = outcome
        try:
            if outcome == PUSH_READ and body is not None and len(body) == size_bytes:
                self._land(key, version, run, flight, memoryview(body).toreadonly())
                self.budget.release(reserved_bytes - size_bytes)
                reserved_bytes = 0
            elif outcome == PUSHED and body is not None:
                if self.kept is not None and body.length_bytes <= reserved_bytes:
                    self.kept.keep(key, version, body, reserved_bytes)
                    reserved_bytes = 0
                else:
                    body.discard(give_back=True)
        except Exception:  # noqa: BLE001 - its waiters fetch the file themselves, never hang
            log.exception("unexpected error ending the push of %r", key)
        finally:
            if reserved_bytes:
                self.budget.release(reserved_bytes)
            for i in run:
                self._flights.pop((key, version, i), None)
            flight.done.set()
            try:
                on_done(outcome)
            except Exception:  # noqa: BLE001 - (fetch-ahead's accounting; the flight is done)
                log.exception("accounting for the push of %r failed", key)
            for call in flight.on_end or ():
                try:
                    call()
                except Exception:  # noqa: BLE001 - (the others are still called)
                    log.exception("a call at the end of the push of %r failed", key)

    def push_into_kernel(self, key: str, version: str) -> Optional[Flight]:
        """The push of the object into the kernel's page cache running now, if any (its
        `on_end` takes calls for when it has ended)."""
        flight = self._flights.get((key, version, 0))
        return flight if flight is not None and flight.on_end is not None else None

    def fetch_ahead(self, key: str, version: str, size_bytes: int) -> Optional[Flight]:
        """Start one speculative GET of the whole object and hold it until `release_hold`;
        None when any of it is cached or in flight already, or the budget has no room
        for it now (it takes memory only as read-ahead does: try_reserve)."""
        bs = self.block_size_bytes
        last = (size_bytes - 1) // bs
        if size_bytes <= 0 or any(
            (key, version, i) in self._blocks or (key, version, i) in self._flights for i in range(last + 1)
        ):
            return None
        # Free memory only (no reclaim): what it may evict is chosen by fetch-ahead
        # (drop_read), never a cached file its pass has still to read.
        if not self.budget.try_reserve(size_bytes, reclaim_priority=-1, refused_stat="fetch_ahead.memory_refused"):
            return None
        self._held[(key, version)] = [size_bytes, None]
        self.held_bytes += size_bytes
        flight = Flight(speculative=True)
        self._start_fetch(key, version, size_bytes, list(range(last + 1)), flight, size_bytes)
        return flight

    def drop_read(self, key: str, version: str, size_bytes: int) -> Optional[int]:
        """Evict the object's cached runs now, for fetch-ahead's room: a file its pass
        has read, which that pass will not read again. The bytes freed; None while it
        cannot go yet (held, or pinned by a reader still reading it)."""
        if (key, version) in self._held:
            return None
        pin = self._pins.get((key, version)) if self._pins else None
        if pin is not None and trio.current_time() - pin[1] < PIN_FRESH_S:
            return None
        freed_bytes = 0
        for i in range(max(-(-size_bytes // self.block_size_bytes), 1)):
            block = self._blocks.get((key, version, i))
            if block is not None and self._index.pop(block.entry.eid) is not None:
                freed_bytes += self._drop(block.entry)
        if freed_bytes:
            self.stats["fetch_ahead.dropped_read_bytes"] += freed_bytes
            self.cached_bytes -= freed_bytes
            self._changes += 1
            self.budget.release(freed_bytes)
        return freed_bytes

    def release_hold(self, key: str, version: str) -> int:
        """The object may be evicted again (read, or no longer expected); its bytes held
        (0 if it was not held)."""
        held = self._held.pop((key, version), None)
        if held is None:
            return 0
        size_bytes, entry = held
        if entry is not None:
            self._index.add(entry)  # evictable from now on: admitted now, as if fetched now
        if size_bytes:
            self.held_bytes -= size_bytes
            self._changes += 1
            self.budget.reclaimable_grew()
        return size_bytes
