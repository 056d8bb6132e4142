"""The memory block cache's replacement policy: which run goes when the budget wants
memory back.

Training reads its data set in passes, each in a new random order. Under LRU a data
set larger than the block cache evicts each file before the next pass comes back to
it: a pass finds only the files read late in the previous one and early in this one
(~15% of a data set twice the cache). The disk cache met the same problem first; its
policy (diskcache/policy.py, whose docstring gives the reasoning in full) keeps a
fixed **resident** set that new files never evict, admits new files into a small
**probation** segment once that set is full, promotes a probation file read again,
and turns the resident set over when it goes unread while ~3 rooms of new bytes are
admitted. A pass over a data set N times the room then finds ~1/N of it cached (at
2x: ~47%, tests/unit/test_block_cache_policy.py), and a one-time scan replaces
nothing resident. This module fits that `Residency` to the memory block cache:

- **An entry is a run**: the blocks of one fetch, evicted whole (they share one
  buffer; core/blockcache.py). "Time" is bytes admitted to the block cache (fetched,
  or a held run let go: below), so an idle or all-hit mount ages nothing.
- **A read is a re-read.** A run's first reader is the one it was fetched for: a
  small file's READs after the GET its open started, a random READ's neighbours in
  the run its miss fetched. Counted as reads, every new file would be promoted by its
  own reader and the resident set would be LRU again. So a run counts the bytes READs
  took of it (`unread_bytes`, as a pin counts a small file's), and a READ is a read
  for the policy only once they reach its size: for a small file, a later open's
  READs (bytes, not positions: a READ of the same bytes again before that is still
  the first reader's). The hits of `start_read` at open are no read either (the READs
  follow). Under LRU every READ is one, as before.
- **The room is what the budget leaves.** The block cache has no size of its own: it
  holds what the budget leaves after listings, read-ahead parts, fetch-ahead's held
  files and the fetches in flight, and gives it back when a reservation needs it
  (`evict`, the budget's first reclaimer). Each eviction tells the policy what the
  cache may hold now (`note_room`: the evictable runs less what is wanted), and the
  room is the smallest of those while the last one or two rooms of bytes were
  admitted. The smallest, because the room moves with every fetch in flight: a room
  that followed it would let the resident set grow each time it grew, and take
  resident runs back each time it shrank (LRU at the margin); what it moves by is
  probation's. A smaller room demotes nothing at once: the resident set stops
  growing, and evictions reach it only once probation is empty (demoted at once, the
  runs read longest ago went, however valuable: the working set read before a scan,
  when the scan's first evictions measured a room a little smaller than the first).
  A lasting change (read-ahead streams, fetch-ahead) is taken in within two such
  periods, a drop at once. Until the first eviction the room is a guess below what
  the cache gets (the budget's room for speculative memory), so that the first
  measures grow it.
- **Held and pinned runs** are the block cache's, not the policy's: a run fetched
  ahead (held until its reader opens it) enters the policy only when let go, so an
  eviction never looks at it; a pinned run is passed over while fresh
  (`victims()` moves it to its segment's most recently read end, so each eviction
  looks at it once), as LRU did.
- Limits (as for the disk cache): pinned files that outgrow probation (5% of the
  room) are made room for from the resident set's least recently read runs, which new
  runs then replace (LRU for that share); a new working set re-read only after more
  than probation holds moves in by turnover, a few passes later, where LRU took one.
"""

from __future__ import annotations

from typing import Iterator, Optional

from bucketfs.diskcache.policy import Residency


class Run:
    """The blocks first..first+count-1 of (key, version), one fetch's buffer: the
    policy's entry (`eid` = (key, version, first))."""

    __slots__ = ("eid", "count", "size", "read_at", "unread_bytes")

    def __init__(self, key: str, version: str, first: int, count: int, size_bytes: int):
        self.eid = (key, version, first)
        self.count = count
        self.size = size_bytes
        self.read_at = 0  # (the policy's clock at its last read)
        self.unread_bytes = size_bytes  # bytes not read since it landed: its first reader's


class RunResidency(Residency):
    """`Residency` over runs, with the room the budget leaves and an eviction order
    that passes over what cannot go now."""

    def __init__(self, room_bytes: int, lru: bool = False):
        super().__init__(lambda run: run.size, lru=lru)
        self.set_room(room_bytes)
        self._room_now: Optional[int] = None  # the least room noted in this period
        self._room_before: Optional[int] = None  # and in the previous one
        self._room_period_end = 0  # (the clock at which this period ends)

    @property
    def indexed_bytes(self) -> int:
        return self.resident_bytes + self.probation_bytes

    def add(self, run: Run) -> None:
        """A run the cache may evict from now on: admitted, and the clock advanced by it."""
        run.unread_bytes = run.size
        self.admit(run.eid, run, run.size)
        self.grew(run.eid, 0, run.size)

    def note_read(self, run: Run, read_bytes: int) -> None:
        """A READ took `read_bytes` of `run`: a read for the policy once the run was read through."""
        if run.unread_bytes > 0 and not self.lru:
            run.unread_bytes -= read_bytes  # its first reader's
        elif self.get(run.eid) is run:  # (not held, nor evicted while its reader waited)
            self.read(run.eid, run)

    def note_room(self, room_bytes: int) -> None:
        """The cache may hold `room_bytes` of runs now (an eviction's measure). The room is
        the least of these while the last one or two rooms' worth of bytes were admitted."""
        if self.lru:
            return
        if self.clock >= self._room_period_end:
            self._room_before, self._room_now = self._room_now, None
            self._room_period_end = self.clock + max(self.room_bytes, 1)
        if self._room_now is None or room_bytes < self._room_now:
            self._room_now = room_bytes
        # (Not set_room: a smaller room demotes nothing at once. The resident set stops
        # growing, probation takes the squeeze, and only once it is empty do evictions
        # reach the resident set's least recently read runs.)
        self.room_bytes = self._room_now if self._room_before is None else min(self._room_now, self._room_before)

    def victims(self) -> Iterator:
        """Each entry once, in eviction order: probation's least recently read first, then
        the resident set's. The caller pops the entry yielded, or leaves it (it cannot go
        now): it then moves to its segment's most recently read end, not read."""
        for segment in (self._probation, self._resident):
            for _ in range(len(segment)):
                if not segment:
                    break
                eid = next(iter(segment))
                yield eid
                if eid in segment:
                    segment.move_to_end(eid)
