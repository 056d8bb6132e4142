"""Copies of pushed files the daemon keeps: a fetch-ahead worker received the file into
shared memory, wrote it into the kernel's page cache, and hands the same pages back
(a backend's KeptBody). Once the kernel has dropped its page cache (memory pressure,
a data set larger than it), the loader's READs of such a file are served from this
copy (BlockCache.read: each READ copies its bytes out) instead of a GET: an epoch after
the page cache was dropped reads from the daemon's memory, as with
--fetch-ahead-workers 0.

Invariants:
- Every kept copy's bytes are reserved in the memory budget, and it is the cheapest
  memory to give back (its file is most likely still in the page cache):
  RECLAIM_PRIORITY is below the block cache's, so any reservation that may reclaim
  (a push's too) takes kept copies first, oldest first, and their pages go back to
  the system then.
- A push makes its own room by dropping the oldest copies without giving their pages
  back (`make_room`): the worker receives the next file into them (the arena's ring
  reuses them), with no fresh pages to fault in.
- Copies go oldest first (the order the arena's ring takes them back in); a READ does
  not keep one longer (a shuffled epoch reads each file once).
"""

from __future__ import annotations

import collections
from typing import Optional


class KeptCopies:
    RECLAIM_PRIORITY = -1  # below BlockCache's 0: what a push's try_reserve(reclaim_priority=-1) may take

    def __init__(self, budget, stats):
        self._budget = budget
        self._stats = stats
        self._bodies: collections.OrderedDict = collections.OrderedDict()  # (key, version) -> [body, reserved bytes]
        self.kept_bytes = 0
        budget.add_reclaimer(self.RECLAIM_PRIORITY, self.reclaim)

    def __contains__(self, key_version: tuple) -> bool:
        return key_version in self._bodies

    def __len__(self) -> int:
        return len(self._bodies)

    def keep(self, key: str, version: str, body, reserved_bytes: int) -> None:
        """Keep `body` (a KeptBody of the object), whose `reserved_bytes` are now this store's."""
        self._budget.release(self._let_go(self._bodies.pop((key, version), None), give_back=False))
        entry = [body, reserved_bytes]
        body.on_dropped = lambda: self._dropped(key, version, entry)
        self._bodies[(key, version)] = entry
        self.kept_bytes += reserved_bytes
        self._stats["fetch_ahead.kept_files"] += 1

    def read(self, key: str, version: str, start: int, end: int) -> Optional[bytes]:
        """Bytes [start, end) of the kept copy of the object, or None if none is kept."""
        entry = self._bodies.get((key, version))
        if entry is None:
            return None
        data = entry[0].read(start, end)
        if data is None:  # (gone with the backend's arena: unmounting)
            self._budget.release(self._let_go(self._bodies.pop((key, version)), give_back=False))
            return None
        if start == 0:
            self._stats["fetch_ahead.kept_read"] += 1
        return data

    def reclaim(self, wanted_bytes: int) -> int:
        """The budget's reclaimer: oldest first, pages given back; the bytes freed."""
        freed_bytes = 0
        while freed_bytes < wanted_bytes and self._bodies:
            freed_bytes += self._let_go(self._bodies.popitem(last=False)[1], give_back=True)
        self._budget.release(freed_bytes)
        return freed_bytes

    def make_room(self, n_bytes: int) -> None:
        """Drop the oldest copies until `n_bytes` fit in the budget's free room, their
        pages kept for the push that needs the room. Not while a reader waits for
        memory: its own reclaim gives the pages back."""
        budget = self._budget
        if budget.demand_pending:
            return
        short_bytes = n_bytes - budget.prefetch_room_bytes
        freed_bytes = 0
        while freed_bytes < short_bytes and self._bodies:
            freed_bytes += self._let_go(self._bodies.popitem(last=False)[1], give_back=False)
        budget.release(freed_bytes)

    def _let_go(self, entry: Optional[list], give_back: bool) -> int:
        """Discard a popped entry's body; its reserved bytes (the caller releases them)."""
        if entry is None:
            return 0
        body, reserved_bytes = entry
        body.on_dropped = None
        body.discard(give_back)
        self.kept_bytes -= reserved_bytes
        self._stats["fetch_ahead.kept_dropped"] += 1
        return reserved_bytes

    def _dropped(self, key: str, version: str, entry: list) -> None:
        """The backend took `entry`'s body back (for room)."""
        if self._bodies.get((key, version)) is entry:
            del self._bodies[(key, version)]
            self.kept_bytes -= entry[1]
            self._stats["fetch_ahead.kept_dropped"] += 1
            self._budget.release(entry[1])
