"""The disk cache's index and its replacement policy: which object goes when the cache is full.

Training reads a data set in repeated passes, each in a new random order. Under LRU a
data set larger than the cache evicts each file before the next pass comes back to
it: a pass finds only files read late in the previous one and early in this one
(~15% of a data set twice the cache, ~1% at 8x: tests/unit/test_cache_policy.py). The best any
policy can do on such passes is to keep one fixed part of the data set and hit on it
every pass: a cache 1/N of the data set then serves ~1/N of each pass. This one does
that, and still follows a workload that changes:

- Two segments, each least recently read first. The **resident** set holds at most
  `1 - PROBATION_FRACTION` of the room (the cache size less the directories and the
  journal at the most it grows to before a rewrite); new bytes never evict from it.
  **Probation** is the rest.
- A new object joins the resident set if it fits there whole (so the first pass fills
  it), else probation; a resident object that grows past the room (more chunks of it
  stored) goes to probation itself. Eviction takes probation's least recently read object first, the
  resident set's only when probation is empty. So once the cache is full, new objects
  only replace each other, in probation, and the resident set is hit on every pass.
- A probation object read again is promoted to the resident set (the resident set's
  least recently read object is demoted to probation if that makes room): a working
  set that changes to one re-read soon is taken in at once.
- **Turnover.** A resident object is demoted once it went unread while more bytes
  were admitted than the larger of `IDLE_MIN_ROOMS` times the room and
  `IDLE_GAP_FACTOR` times the longest gap seen lately between two reads of a resident
  object (gaps counted in bytes admitted; "lately": this period and the one before, a
  period being one such limit). On random-order passes the longest gap is about two
  passes' admissions (read first in one pass, last in the next), so the resident set
  is kept however long the passes are (the limit learns it: a 8x data set keeps its
  1/8); when the workload changes, the old objects go after about three of its
  passes' worth of new bytes (at least three rooms), and new objects fill the room.
- A one-time scan (a `find -exec cat`, another data set read once) is admitted into
  probation only and replaces nothing resident, as long as the working set is read at
  least once per such period.
- Limits: an object larger than probation's room, arriving when the resident set is
  full, is written and then evicted (as LRU does with objects larger than the cache);
  a new working set re-read only after more than probation holds moves in by
  turnover, a few passes later, where LRU took one.

"Time" is bytes admitted (written to the cache), not seconds or reads: the resident
set is only at risk while new bytes arrive, and an idle or all-hit mount ages nothing.

Across mounts, the journal keeps the index's order (probation first, then resident,
each least recently read first); a new mount makes the most recently written objects
resident up to the resident room, and starts its clock and gaps afresh.

`Residency(lru=True)` is plain LRU (one segment, no promotion or turnover), for tests
and comparisons.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterator, Optional

# The share of the room where new objects are admitted once the resident set is full.
# Every share of it is a share of hits lost on passes over a data set larger than the
# cache (the resident set is what they hit); a small one still takes a one-time scan
# (scan resistance does not depend on its size: a scan never enters the resident set).
PROBATION_FRACTION = 0.05
# A resident object is demoted once it was not read while max(IDLE_MIN_ROOMS x the
# room, IDLE_GAP_FACTOR x the longest read gap seen lately) bytes were admitted.
# 3 rooms: the first pass over a data set twice the cache admits it all, so the objects
# it made resident are next read up to ~3 rooms later, before any gap was seen (2 lost
# ~2% of the second pass); and a working set survives a one-time scan of 3x the cache
# that does not read it. 1.5: a margin over the longest gap seen (2 gave the same hits
# on passes, and took a changed workload in 1-2 passes later in the model of
# tests/unit/test_cache_policy.py).
IDLE_MIN_ROOMS = 3
IDLE_GAP_FACTOR = 1.5


class Residency:
    """entry id -> entry, in a resident segment and a probation segment (each an
    OrderedDict, least recently read first). Entries carry `read_at` (the admission
    clock at their last read) and are sized by `size_of(entry)`, whose changes the
    owner reports with `grew`."""

    def __init__(self, size_of: Callable, lru: bool = False):
        self._size_of = size_of
        self.lru = lru
        self._resident: collections.OrderedDict = collections.OrderedDict()
        self._probation: collections.OrderedDict = collections.OrderedDict()
        self.resident_bytes = 0
        self.probation_bytes = 0
        self.room_bytes = 0  # what the entries may take in all (set_room)
        self.clock = 0  # bytes admitted since this index was made
        self._gap_now = 0  # the longest read gap of a resident entry in this period
        self._gap_before = 0  # and in the previous one
        self._period_end = 0  # (the clock at which this period ends)
        self.demotions = 0  # resident entries demoted, by turnover or to make room
        self.promotions = 0

    # -- the mapping a cache needs ------------------------------------------------
    def __len__(self) -> int:
        return len(self._resident) + len(self._probation)

    def __contains__(self, eid) -> bool:
        return eid in self._resident or eid in self._probation

    def __iter__(self) -> Iterator:
        return iter(list(self._probation) + list(self._resident))

    def get(self, eid):
        entry = self._resident.get(eid)
        return entry if entry is not None else self._probation.get(eid)

    def is_resident(self, eid) -> bool:
        return eid in self._resident

    def values(self) -> list:
        """Least kept first: probation, then the resident set, each least recently read
        first (the journal's order, so that a later mount keeps the same ones)."""
        return [*self._probation.values(), *self._resident.values()]

    def most_kept_first(self) -> Iterator:
        """The entries most likely to be read again first: the resident set, then
        probation, each most recently read first."""
        yield from reversed(self._resident.values())
        yield from reversed(self._probation.values())

    def clear(self) -> None:
        self._resident.clear()
        self._probation.clear()
        self.resident_bytes = self.probation_bytes = 0

    # -- loading ------------------------------------------------------------------
    def load(self, eid, entry) -> None:
        """An entry from the journal, least recently written first (call `settle` after
        the last)."""
        entry.read_at = 0
        self._probation[eid] = entry
        self.probation_bytes += self._size_of(entry)

    def settle(self, room_bytes: int) -> None:
        """After loading: the most recently written entries become the resident set, up
        to its room."""
        self.room_bytes = room_bytes
        if self.lru:
            return
        limit = self._resident_limit()
        taken = []
        for eid, entry in reversed(self._probation.items()):
            size = self._size_of(entry)
            if self.resident_bytes + size > limit:
                break
            taken.append(eid)
            self.resident_bytes += size
            self.probation_bytes -= size
        for eid in reversed(taken):
            self._resident[eid] = self._probation.pop(eid)

    # -- the policy ---------------------------------------------------------------
    def _resident_limit(self) -> int:
        return int(self.room_bytes * (1 - PROBATION_FRACTION))

    def set_room(self, room_bytes: int) -> None:
        """What the entries may take now (the cache size less its journal and
        directories); the resident set is kept within its share of it."""
        self.room_bytes = room_bytes
        self._fit_resident()

    def admit(self, eid, entry, expected_bytes: int) -> None:
        """A new entry (sized 0 or more, `expected_bytes` once stored): into the resident
        set if that leaves it within its room, else into probation."""
        entry.read_at = self.clock
        if not self.lru and self.resident_bytes + max(expected_bytes, self._size_of(entry)) <= self._resident_limit():
            self._resident[eid] = entry
            self.resident_bytes += self._size_of(entry)
        else:
            self._probation[eid] = entry
            self.probation_bytes += self._size_of(entry)

    def grew(self, eid, delta_bytes: int, admitted_bytes: int) -> None:
        """The entry `eid` takes `delta_bytes` more, after `admitted_bytes` were written.
        New bytes never evict resident ones: a resident entry that grows past the
        resident room goes to probation itself."""
        if eid in self._resident:
            self.resident_bytes += delta_bytes
            if self.resident_bytes > self._resident_limit() and not self.lru:
                self._demote(eid)
        elif eid in self._probation:
            self.probation_bytes += delta_bytes
        self.clock += admitted_bytes
        if not self.lru:
            self._age()

    def read(self, eid, entry) -> None:
        """A hit on `entry` (held under `eid`)."""
        if eid in self._resident:
            gap = self.clock - entry.read_at
            if gap > self._gap_now:
                self._gap_now = gap
            self._resident.move_to_end(eid)
        elif self.lru:
            self._probation.move_to_end(eid)
        else:  # a probation entry read again: promoted
            del self._probation[eid]
            size = self._size_of(entry)
            self.probation_bytes -= size
            self._resident[eid] = entry
            self.resident_bytes += size
            self.promotions += 1
            self._fit_resident(keep=eid)
        entry.read_at = self.clock

    def victim(self) -> Optional[Any]:
        """The entry to evict first: probation's least recently read, else the resident
        set's; None when empty."""
        for segment in (self._probation, self._resident):
            if segment:
                return next(iter(segment))
        return None

    def pop(self, eid, default=None):
        """Take `eid` out (evicted)."""
        entry = self._probation.pop(eid, None)
        if entry is not None:
            self.probation_bytes -= self._size_of(entry)
            return entry
        entry = self._resident.pop(eid, None)
        if entry is not None:
            self.resident_bytes -= self._size_of(entry)
            return entry
        return default

    def pop_victim(self) -> tuple:
        eid = self.victim()
        return eid, self.pop(eid)

    def _demote(self, eid) -> None:
        entry = self._resident.pop(eid)
        size = self._size_of(entry)
        self.resident_bytes -= size
        self._probation[eid] = entry  # (most recently read end: a last chance there)
        self.probation_bytes += size
        self.demotions += 1

    def _fit_resident(self, keep=None) -> None:
        """Demote the least recently read resident entries while the set is over its
        share (never `keep`, nor the last one)."""
        limit = self._resident_limit()
        while self.resident_bytes > limit and len(self._resident) > 1:
            eid = next(iter(self._resident))
            if eid == keep:
                break
            self._demote(eid)

    def idle_limit_bytes(self) -> int:
        """Bytes admitted past a resident entry's last read that demote it."""
        return int(max(IDLE_MIN_ROOMS * self.room_bytes, IDLE_GAP_FACTOR * max(self._gap_now, self._gap_before)))

    def _age(self) -> None:
        """Turnover: demote resident entries unread for longer than the idle limit."""
        if self.clock >= self._period_end:  # (gaps older than two periods are forgotten)
            self._gap_before, self._gap_now = self._gap_now, 0
            self._period_end = self.clock + self.idle_limit_bytes()
        oldest = self.clock - self.idle_limit_bytes()
        resident = self._resident
        while resident:
            eid, entry = next(iter(resident.items()))
            if entry.read_at >= oldest:
                break
            self._demote(eid)
