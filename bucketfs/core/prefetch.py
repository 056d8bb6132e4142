"""Sequential read-ahead per reader of a file, and warm heads of the next shard.

How a handle's reads are served (`HandleReader`, handlereader.py):
- Random reads go to the block cache: only the blocks they touch are fetched.
- Once a reader's reads look sequential (a shard read from offset 0, or reads in a
  row that continue each other within the kernel's small reordering), a
  `SequentialStream` takes over. It keeps `window_bytes` ahead of the reader as
  parallel ranged GETs ("parts" of at most `part_size_bytes`), so one reader uses
  several connections. The window starts small (wide for shards) and doubles, up to
  a cap, each time the reader consumes a part after having had to wait for one
  issued ahead of it: it grows while the reader keeps up with the fetches. A read
  outside every stream's window is another reader, or a seek (handlereader.py).
- Parts are not cached: once the reader is past them they are freed (the kernel
  page cache keeps the data for re-reads).

Memory: every part is reserved in the MemoryBudget. Read-ahead parts use
`try_reserve` and simply stop growing when the budget is short; a part a reader
is waiting on is reserved as demand. Under demand pressure, unclaimed warm heads
and then the furthest-ahead parts nobody waits on are given back.

Buffers: parts of 1 MiB or more are received into reused buffers (partbuffers.py).
"""

from __future__ import annotations

import collections
import logging
import mmap
from typing import Any, Optional

import trio

from bucketfs import errors
from bucketfs.backends.slots import mark_speculative
from bucketfs.core.partbuffers import POOLED_BUFFER_MIN_BYTES, BufferPool, new_part_buffer
from bucketfs.core.pieces import Pieces

log = logging.getLogger(__name__)

MiB = 1024 * 1024
# The kernel keeps up to its read-ahead batch (4 MiB, mount.KERNEL_READ_AHEAD_KB) of
# READs in flight for one file and they arrive out of order; twice that is "near".
REORDER_TOLERANCE_BYTES = 8 * MiB
# A part a reader is already waiting for is kept small: its first byte comes sooner.
DEMAND_PART_BYTES = 2 * MiB
# A warm head this recent is a live guess of which shard a loader opens next (see
# Prefetcher.warming_in); one epoch of a loader reads its next shard far sooner.
GUESS_FRESH_S = 30.0


def directory_of(key: str) -> str:
    """The key prefix of `key`'s directory, ending in / ("" at the bucket's root)."""
    return key[: key.rfind("/") + 1]


class PartCancelled(Exception):
    """A read-ahead part was dropped before it completed; the reader falls back."""


class Part:
    __slots__ = (
        "start",
        "end",
        "demanded",
        "data",
        "buffer",
        "error",
        "done",
        "reserved_bytes",
        "cancel_scope",
        "waiters",
        "consumed",
        "issued_s",
        "warmer_window_bytes",
    )

    def __init__(self, start: int, end: int, demanded: bool = False):
        self.start, self.end = start, end
        self.demanded = demanded  # a reader asked for these bytes when the part was issued
        self.data: Optional[Any] = None  # bytes-like: bytes, or the part's own buffer
        self.buffer: Optional[bytearray | mmap.mmap] = None  # a pooled buffer the data is received into
        self.error: Optional[BaseException] = None
        self.done = trio.Event()
        self.reserved_bytes = 0
        self.cancel_scope = trio.CancelScope()
        self.waiters = 0
        self.consumed = False
        self.issued_s = 0.0  # trio clock, when the prefetcher started it
        self.warmer_window_bytes = 0  # a warmed head's part: the window of the stream that warmed it

    @property
    def urgent(self) -> bool:
        """Its GET goes before read-ahead nobody waits on (backends/slots.py)."""
        return self.demanded or self.waiters > 0

    async def wait(self) -> bytes:
        self.waiters += 1
        try:
            await self.done.wait()
        finally:
            self.waiters -= 1
        if self.error is not None:
            raise self.error
        if self.data is None:
            raise PartCancelled()  # dropped by another read that moved the stream on
        return self.data


class Prefetcher:
    """Shared by all handles: spawns part fetches, holds warm shard heads, sheds memory."""

    HEADS_PRIORITY = 1
    PARTS_PRIORITY = 2
    # Bookkeeping bound (memory is the budget's): a few per shard reader, as a window
    # may reach through several short shards.
    MAX_WARM_HEADS = 32

    def __init__(self, backend, budget, stats, nursery: trio.Nursery, part_size_bytes: int):
        self.backend = backend
        self.budget = budget
        self.stats = stats
        self.nursery = nursery
        self.streams: set = set()
        self._heads: collections.OrderedDict = collections.OrderedDict()  # (key, version) -> Part
        self.part_size_bytes = part_size_bytes  # one ranged GET (a warmed head grows by these)
        self.pool = BufferPool(budget, stats, part_size_bytes)
        budget.add_reclaimer(self.HEADS_PRIORITY, self._shed_heads)
        budget.add_reclaimer(self.PARTS_PRIORITY, self._shed_parts)

    def fetch(self, key: str, version: str, object_bytes: int, start: int, end: int, demanded: bool) -> Optional[Part]:
        """Start fetching [start, end) of an object of `object_bytes`; None if read-ahead
        memory is not available."""
        part = Part(start, end, demanded)
        part.issued_s = trio.current_time()
        if self._receives(end - start):
            part.buffer = self.pool.take(end - start)  # None if no free buffer fits
        if part.buffer is not None:
            part.reserved_bytes = len(part.buffer)
        if not part.reserved_bytes and not demanded:
            held_bytes = self._held_bytes(end - start)
            if not self.budget.try_reserve(held_bytes, reclaim_priority=0):
                return None
            part.reserved_bytes = held_bytes
        self.nursery.start_soon(self._run, key, version, object_bytes, part)
        return part

    def _receives(self, size_bytes: int) -> bool:
        """A part this size is received into a buffer (pooled or fresh), not returned as bytes."""
        return self.backend.receives_into and size_bytes >= POOLED_BUFFER_MIN_BYTES

    def _held_bytes(self, size_bytes: int) -> int:
        """The memory a part of this size holds (and reserves) until it is freed."""
        return self.pool.held_bytes(size_bytes) if self._receives(size_bytes) else size_bytes

    async def _run(self, key: str, version: str, object_bytes: int, part: Part) -> None:
        mark_speculative(part)  # this task's GET waits behind urgent ones until part.urgent
        try:
            with part.cancel_scope:
                size_bytes = part.end - part.start
                if not part.reserved_bytes:
                    held_bytes = self._held_bytes(size_bytes)
                    await self.budget.reserve(held_bytes)
                    part.reserved_bytes = held_bytes
                if part.buffer is None and self._receives(size_bytes):
                    # Its whole reservation: a pooled size, so the pool can take it back.
                    part.buffer = new_part_buffer(part.reserved_bytes)
                if part.buffer is not None:
                    got_bytes = await self.backend.read_range_into(
                        key, part.start, part.end, version, part.buffer, object_bytes=object_bytes
                    )
                    data = part.buffer
                else:
                    data = await self.backend.read_range(key, part.start, part.end, version, object_bytes=object_bytes)
                    got_bytes = len(data)
                if got_bytes != size_bytes:
                    raise errors.ObjectChanged(f"{key}: expected {size_bytes} bytes at {part.start}, got {got_bytes}")
                part.data = data
                self.stats["prefetch.fetched_bytes"] += got_bytes
            if part.cancel_scope.cancel_called:
                # Dropped while its GET ran. A GET thread is not abandoned on cancel, so
                # trio hands back its result without raising Cancelled: the part must
                # still let go of its memory here, as nobody will take its bytes.
                part.data = None
            if part.data is None and part.error is None:
                part.error = PartCancelled()
        except errors.BucketfsError as exc:
            part.error = exc
        except Exception as exc:  # noqa: BLE001 - a waiter must get an errno, never hang
            log.exception("unexpected error fetching %r [%d, %d)", key, part.start, part.end)
            part.error = errors.BackendError(str(exc))
        finally:
            if part.data is None:
                self.release(part)
            else:
                self.budget.reclaimable_grew()  # (sheddable once nobody waits on it)
            part.done.set()

    def release(self, part: Part) -> int:
        """Free a part's memory: its buffer to the pool if the pool takes it, else its
        reservation back to the budget. Returns the bytes given back to the budget (a
        pooled buffer stays reserved: a reclaimer must not count it as freed)."""
        buf, part.buffer, part.data = part.buffer, None, None
        released_bytes, part.reserved_bytes = part.reserved_bytes, 0
        if released_bytes and buf is not None and self.pool.give(buf):
            return 0
        if released_bytes:
            self.budget.release(released_bytes)
        return released_bytes

    def drop(self, part: Part) -> int:
        """Free a part now if complete, else cancel it (its task frees it when the GET
        returns). Returns the bytes given back to the budget now."""
        if part.done.is_set():
            return self.release(part)
        part.cancel_scope.cancel()
        return 0

    # -- warm heads of the next shard ------------------------------------------
    def is_warming(self, key: str, version: str) -> bool:
        return (key, version) in self._heads

    def warming_in(self, directory: str) -> bool:
        """Whether a live guess is out in `directory` (a key prefix ending in /): the
        head of one of its objects, warmed or extended in the last GUESS_FRESH_S. An
        older one (a loader that stopped midway, or shards it skips, such as a
        validation split listed after the training shards) says nothing about the
        loader's order any more."""
        now_s = trio.current_time()
        return any(
            directory_of(key) == directory and now_s - parts[-1].issued_s < GUESS_FRESH_S
            for (key, _), parts in self._heads.items()
        )

    def warm_head(self, key: str, version: str, size_bytes: int, head_end: int, warmer_window_bytes: int) -> None:
        """Have [0, head_end) of a shard in flight before it is opened, as parallel
        whole parts (the last one may end at the shard's end); called again with a
        larger `head_end`, it extends the head. `warmer_window_bytes`: the window of
        the stream warming it, which the stream that reads it starts from."""
        parts = self._heads.get((key, version), [])  # a warmed head is extended in place
        start = parts[-1].end if parts else 0
        while start < size_bytes:
            part_end = min(start + self.part_size_bytes, size_bytes)
            if part_end > head_end and part_end < size_bytes:
                break  # never a sliver: the head grows by whole parts
            part = self.fetch(key, version, size_bytes, start, part_end, demanded=False)
            if part is None:
                break
            part.warmer_window_bytes = warmer_window_bytes
            parts.append(part)
            start = part_end
        if not parts or (key, version) in self._heads:
            return
        self._heads[(key, version)] = parts
        self.stats["prefetch.heads_warmed"] += 1
        while len(self._heads) > self.MAX_WARM_HEADS:
            _, old = self._heads.popitem(last=False)
            for part in old:
                self._waste(part)

    def take_head(self, key: str, version: str) -> list:
        parts = self._heads.pop((key, version), [])
        if parts:
            self.stats["prefetch.heads_used"] += 1
        return parts

    def _waste(self, part: Part) -> int:
        self.stats["prefetch.bytes_wasted"] += part.end - part.start
        return self.drop(part)

    def _shed_heads(self, wanted_bytes: int) -> int:
        freed_bytes = 0
        while self._heads and freed_bytes < wanted_bytes:
            _, parts = self._heads.popitem(last=False)
            for part in parts:
                freed_bytes += self._waste(part)
        return freed_bytes

    def _shed_parts(self, wanted_bytes: int) -> int:
        freed_bytes = 0
        for stream in list(self.streams):
            if freed_bytes >= wanted_bytes:
                break
            freed_bytes += stream.shed(wanted_bytes - freed_bytes)
        if freed_bytes:
            self.stats["prefetch.shed_bytes"] += freed_bytes
        return freed_bytes


def _covers_exactly(parts: list, off: int, end: int) -> bool:
    """`parts` (in order) hold every byte of [off, end), with no gap."""
    if not parts or parts[0].start > off or parts[-1].end < end:
        return False
    return all(a.end == b.start for a, b in zip(parts, parts[1:]))


class SequentialStream:
    def __init__(
        self,
        prefetcher: Prefetcher,
        key,
        version,
        size_bytes,
        start,
        window_bytes,
        max_window_bytes,
        handed_parts=(),
        limit_end=None,
    ):
        """`handed_parts`: parts from `start` on that another stream handed over (a
        second reader started inside its window: handlereader.py); else a warmed head
        of the file is taken. `limit_end`: where another reader's stream begins."""
        self.pf = prefetcher
        self.key, self.version, self.size_bytes = key, version, size_bytes
        self.window_bytes = window_bytes
        self.max_window_bytes = max_window_bytes
        self.part_size_bytes = prefetcher.part_size_bytes
        self.parts: collections.deque = collections.deque()
        self.fetch_end = start
        self.read_end = start
        # Waits on parts before this offset say nothing about the window: they were
        # issued when the stream began (set after its first read), no time ahead...
        self.ramp_end: Optional[int] = None
        self.starved = False  # a read waited on a part issued ahead of it since the window last grew
        # Read-ahead goes no further: another reader's stream fetches from here on.
        self.limit_end = size_bytes if limit_end is None else limit_end
        if handed_parts and handed_parts[0].start > start:
            # The bytes up to the first part handed over (the reader starts inside a
            # part the other stream keeps): fetched for the READ waiting on them.
            if not self._issue(start, handed_parts[0].start, demand_end=handed_parts[0].start):
                self.parts.clear()  # (no memory: the READ goes to the block cache)
                self.fetch_end = self.read_end = handed_parts[0].start
        for part in handed_parts:
            self.parts.append(part)
            self.fetch_end = part.end
        for part in () if handed_parts else prefetcher.take_head(key, version):
            if part.start <= self.fetch_end < part.end and part.error is None:
                self.parts.append(part)  # a warmed head: the reader starts on ready bytes
                self.fetch_end = part.end
                # The reader goes on from the stream that warmed this head: its window,
                # so that a reader of consecutive shards keeps what it has grown to.
                self.window_bytes = min(max(self.window_bytes, part.warmer_window_bytes), max_window_bytes)
            else:
                prefetcher._waste(part)
        # ... except parts of a warmed head: issued by the previous shard's stream, a
        # window ahead. A wait on one is a window too short (with shards no longer than
        # the window, every part of a stream was in its ramp: windows never grew).
        self.head_end = self.fetch_end
        prefetcher.streams.add(self)

    def first_offset(self) -> int:
        """The first byte the stream still holds or will fetch."""
        return self.parts[0].start if self.parts else self.fetch_end

    def covers(self, off: int) -> bool:
        """The stream can serve a read at `off` (what it holds, or just ahead of it)."""
        return self.first_offset() <= off <= self.fetch_end + REORDER_TOLERANCE_BYTES and off < self.limit_end

    def hand_over_from(self, off: int) -> list:
        """The parts from `off` on, for another reader's stream starting there; this
        one fetches no further than where they begin (nor past `off`). The part
        holding `off` goes with them where `off` is in its first half and this
        stream's reader has not reached it, else it stays: whichever reader lacks its
        side of `off` fetches that side again, at most half a part."""
        handed = [
            p
            for p in self.parts
            if p.start >= off or (p.end > off and p.start >= self.read_end and off - p.start < p.end - off)
        ]
        if handed:
            for part in handed:
                self.parts.remove(part)
            self.limit_end = self.fetch_end = handed[0].start
        else:  # (`off` inside its last part, or just past it)
            self.limit_end = max(self.fetch_end, off)
        return handed

    def near(self, off: int) -> bool:
        """A read just behind the stream: the kernel reordered it; not a seek."""
        first = self.first_offset()
        return first - REORDER_TOLERANCE_BYTES <= off < first

    async def read(self, off: int, end: int):
        if end > self.limit_end < self.size_bytes:
            # Into where another reader's stream begins (a READ across the two): the
            # block cache serves it rather than this stream fetching that stream's bytes.
            raise PartCancelled()
        if end > self.fetch_end:
            # The reader caught up: fetch what it needs now, as demand, in a small part.
            if self.ramp_end is not None:
                self.starved = True  # (past its start: the window ran short)
            self._issue(
                self.fetch_end, max(end, min(self.fetch_end + DEMAND_PART_BYTES, self.limit_end)), demand_end=end
            )
        self.read_end = max(self.read_end, end)
        self._drop_behind()  # (first: the parts it issues then take the buffers of those passed)
        self._top_up()
        if self.ramp_end is None:
            self.ramp_end = self.fetch_end
        wanted = [p for p in self.parts if p.end > off and p.start < end]
        if not _covers_exactly(wanted, off, end):
            raise PartCancelled()  # a part inside was shed under memory pressure: the block cache reads it
        pieces = []
        for part in wanted:
            if not part.done.is_set() and (part.start >= self.ramp_end or part.end <= self.head_end):
                self.starved = True
            data = await part.wait()  # state re-check after: the stream may have moved on
            # A memoryview slice: pyfuse3 replies from any buffer, so no copy is made.
            pieces.append(memoryview(data)[max(off - part.start, 0) : min(end, part.end) - part.start])
            if not part.consumed and self.read_end >= part.end:
                part.consumed = True
                self._grow_if_starved()
        self._drop_behind()
        self.pf.budget.reclaimable_grew()  # the parts just read are sheddable now
        self._top_up()
        self.pf.stats["prefetch.bytes_used"] += end - off
        return pieces[0] if len(pieces) == 1 else Pieces(pieces)

    def _grow_if_starved(self) -> None:
        """Double the window, up to its cap, if a read had to wait for a part issued
        ahead of it: the window is shorter than the reader's pace times a part's
        round trip. A reader that finds its parts ready keeps the window it has: a
        larger one would only hold more memory (four CPU-bound shard readers doubling
        anyway held 470 MB, nearly all of 8 shards, in fresh buffers whose page zeroing
        was 40% of the daemon's CPU)."""
        if self.starved:
            self.starved = False
            self.window_bytes = min(self.window_bytes * 2, self.max_window_bytes)

    def _issue(self, start: int, end: int, demand_end: int = 0) -> bool:
        """Parts for [start, end): those starting before `demand_end` are demand (a READ
        waits on them, so they wait for memory); the rest are read-ahead, issued only
        while memory is free. A part past the READ reserved as demand would hold memory
        nobody waits on while READs wait for it (64 readers on 16 MiB: every READ
        stalled until the overcommit deadline)."""
        while start < end:
            part_end = min(end, start + self.part_size_bytes)
            part = self.pf.fetch(self.key, self.version, self.size_bytes, start, part_end, start < demand_end)
            if part is None:
                return False
            self.parts.append(part)
            self.fetch_end = start = part_end
        return True

    def _top_up(self) -> None:
        """Keep `window_bytes` in flight ahead of the reader, in parts of the window's size."""
        while self.fetch_end < self.limit_end and self.fetch_end - self.read_end < self.window_bytes:
            size = min(self.part_size_bytes, self.window_bytes)
            if not self._issue(self.fetch_end, min(self.fetch_end + size, self.limit_end)):
                return

    def _drop_behind(self) -> None:
        while (
            self.parts and self.parts[0].end + REORDER_TOLERANCE_BYTES <= self.read_end and self.parts[0].done.is_set()
        ):
            self.pf.drop(self.parts.popleft())

    def shed(self, wanted_bytes: int) -> int:
        """Give back memory under demand pressure: first the complete parts the reader
        has passed (kept only for reordered READs), wherever they are in the window,
        then the furthest-ahead parts nobody waits on (or is fetching for a READ).
        The kernel's READs of one file finish out of order, so passed parts sit behind
        one still being fetched; kept, streams each holding them while waiting for
        memory for the next could fill the budget and wait on each other. A READ that
        then finds a part gone reads through the block cache."""
        freed_bytes = 0
        for part in [p for p in self.parts if p.done.is_set() and not p.waiters and p.end <= self.read_end]:
            if freed_bytes >= wanted_bytes:
                break
            self.parts.remove(part)
            freed_bytes += self.pf.drop(part)
        while self.parts and freed_bytes < wanted_bytes:
            part = self.parts[-1]
            # (a part the reader is partway through, complete and not waited on, goes
            # too: its next READ may be queued in the kernel behind READs waiting here)
            if part.waiters or (part.start < self.read_end and not part.done.is_set()):
                break
            self.parts.pop()
            self.fetch_end = part.start
            freed_bytes += self.pf._waste(part)
            self.window_bytes = max(self.window_bytes // 2, self.part_size_bytes // 8)
        return freed_bytes

    def close(self) -> None:
        self.pf.streams.discard(self)
        while self.parts:
            part = self.parts.pop()
            if not part.consumed and part.end > self.read_end:
                self.pf._waste(part)
            else:
                self.pf.drop(part)
