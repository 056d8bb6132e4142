"""One global memory budget (`--max-memory`) for what the daemon holds: the listing
cache, the disk cache's index, the block cache and every prefetch buffer.

Invariants:
- Listings and the disk cache's index are charged first (`charge_listings`,
  `charge_disk_index`): listings cannot be evicted, since the kernel holds their
  inode numbers, and the index is bounded by --cache-size instead. Buffers get the
  rest, `capacity_bytes`, which never falls below a quarter of the budget so reads
  keep working however much is listed (past that, RSS exceeds the budget by the
  excess: logged once).
- `used_bytes` counts every reserved buffer; it never exceeds `capacity_bytes`
  except by one demand request larger than the whole budget (let through alone so
  a reader is never deadlocked), or for a moment after listings grow while buffers
  are held that cannot be reclaimed (they are released as their reads finish).
- Prefetch (and the disk cache's queued writes) only take memory with `try_reserve`,
  which fails rather than wait, always leaves `demand_headroom_bytes` free for reads
  a caller is waiting on, and takes nothing while such a read waits.
- Demand (`reserve`) first reclaims evictable memory (the block cache, unclaimed
  warm shard heads, then prefetch parts nobody waits on), then waits for releases
  or for held memory to become reclaimable (`reclaimable_grew`),
  but never longer than `DEMAND_WAIT_MAX_S`: after that it takes the memory anyway
  (a bounded overshoot, logged) rather than leave a reader hanging.
- Waiting demands are served oldest first: a later one (waiting or new) takes memory
  only if what is left still fits the oldest's request. Woken together, they used to
  race for each freed part, and an unlucky READ lost for many seconds.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable

import trio

log = logging.getLogger(__name__)

# Longer than any healthy GET (the read timeout is 30 s by default); a reader is
# never made to wait on memory past this.
DEMAND_WAIT_MAX_S = 60.0
# Held memory can become reclaimable with no event to say so (a small file's pin
# lapses when its reader goes quiet: blockcache.PIN_FRESH_S): a waiting demand
# reclaims again this often.
RECLAIM_RETRY_S = 1.0
# Listings and the disk cache's index may take up to this share of the budget; the
# rest always stays for buffers.
LISTINGS_SHARE_MAX = 0.75


class _Waiter:
    """A demand waiting for memory. Compared by identity: `deque.remove` of an equal
    value (two waiters for the same size) would drop another reader's place."""

    __slots__ = ("n_bytes",)

    def __init__(self, n_bytes: int):
        self.n_bytes = n_bytes


class MemoryBudget:
    def __init__(self, budget_bytes: int, stats, demand_headroom_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self.listings_bytes = 0
        self.disk_index_bytes = 0
        self._headroom_fixed = demand_headroom_bytes is not None
        self.demand_headroom_bytes: int = demand_headroom_bytes or 0  # (set from the capacity below when None)
        self._set_capacity(budget_bytes)
        self._listings_over_logged = False
        self.used_bytes = 0
        self.peak_bytes = 0
        self.stats = stats
        self._reclaimers: list = []  # (priority, fn(bytes_wanted) -> bytes_freed)
        self._freed = trio.Event()
        self._pressure_logged = False
        self._demands_pending = 0  # demands reclaiming or waiting right now
        self._waiting: collections.deque = collections.deque()  # a _Waiter per waiting demand, oldest first

    def _set_capacity(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes  # for buffers: the budget less the listings
        if not self._headroom_fixed:
            # Prefetch may fill all but this much; an eighth keeps demand reads from waiting
            # on prefetch in the common case without idling most of a small budget.
            self.demand_headroom_bytes = capacity_bytes // 8

    def charge_listings(self, listings_bytes: int) -> None:
        """The listing cache now holds `listings_bytes`: buffers get what is left,
        and evictable buffers beyond that are given back at once."""
        self.listings_bytes = listings_bytes
        self._recharge()

    def charge_disk_index(self, index_bytes: int) -> None:
        """The disk cache's index now holds `index_bytes` (as for listings)."""
        self.disk_index_bytes = index_bytes
        self._recharge()

    def _recharge(self) -> None:
        fixed_bytes = self.listings_bytes + self.disk_index_bytes
        fixed_cap_bytes = int(self.budget_bytes * LISTINGS_SHARE_MAX)
        self._set_capacity(self.budget_bytes - min(fixed_bytes, fixed_cap_bytes))
        over_bytes = self.used_bytes - self.capacity_bytes
        if over_bytes > 0:
            # Counted as a demand: what the reclaimers free must leave the budget, not
            # go back into the buffer pool (still reserved, so the budget stayed over).
            self._demands_pending += 1
            try:
                self._reclaim(over_bytes, max_priority=1 << 30)
            finally:
                self._demands_pending -= 1
        if fixed_bytes > fixed_cap_bytes and not self._listings_over_logged:
            self._listings_over_logged = True
            log.warning(
                "listings (%d MiB) and the disk cache index (%d MiB) hold more than %d%% of the %d MiB memory "
                "budget: the daemon will exceed --max-memory by the difference (raise it, mount a narrower "
                "prefix, or lower --cache-size)",
                self.listings_bytes >> 20,
                self.disk_index_bytes >> 20,
                LISTINGS_SHARE_MAX * 100,
                self.budget_bytes >> 20,
            )

    def add_reclaimer(self, priority: int, reclaim: Callable[[int], int]) -> None:
        """Register something that can free memory; lower priority is reclaimed first."""
        self._reclaimers.append((priority, reclaim))
        self._reclaimers.sort(key=lambda pr: pr[0])

    def _take(self, n_bytes: int) -> None:
        self.used_bytes += n_bytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def _reclaim(self, wanted_bytes: int, max_priority: int) -> None:
        for priority, reclaim in self._reclaimers:
            if wanted_bytes <= 0 or priority > max_priority:
                return
            wanted_bytes -= reclaim(wanted_bytes)

    def try_reserve(
        self, n_bytes: int, reclaim_priority: int = 0, refused_stat: str | None = "memory.prefetch_refused"
    ) -> bool:
        """Memory nobody waits on (read-ahead, the disk cache's queued writes): reserve
        now or fail, counting a refusal in `refused_stat` (None: the caller counts it); may evict reclaimers up to
        `reclaim_priority`."""
        limit_bytes = self.capacity_bytes - self.demand_headroom_bytes
        over_bytes = self.used_bytes + n_bytes - limit_bytes
        if self._waiting:  # what is freed goes to the reads waiting for it
            if refused_stat:
                self.stats[refused_stat] += 1
            return False
        if over_bytes > 0:
            self._reclaim(over_bytes, reclaim_priority)
            if self.used_bytes + n_bytes > limit_bytes:
                if refused_stat:
                    self.stats[refused_stat] += 1
                return False
        self._take(n_bytes)
        return True

    @property
    def prefetch_room_bytes(self) -> int:
        """What a try_reserve could take now without reclaiming anything."""
        if self._waiting:
            return 0
        return max(self.capacity_bytes - self.demand_headroom_bytes - self.used_bytes, 0)

    @property
    def demand_pending(self) -> bool:
        """A reader is reclaiming or waiting for memory (or the budget shrank under its
        use): what is freed now must be released, not kept for reuse."""
        return self._demands_pending > 0

    async def reserve(self, n_bytes: int) -> None:
        """Demand: reserve, reclaiming everything reclaimable, waiting if still short."""
        self._demands_pending += 1
        try:
            await self._reserve(n_bytes)
        finally:
            self._demands_pending -= 1

    async def _reserve(self, n_bytes: int) -> None:
        deadline_s = trio.current_time() + DEMAND_WAIT_MAX_S
        ticket = None
        try:
            while not self._may_take(n_bytes, ticket):
                if ticket is None:
                    ticket = _Waiter(n_bytes)
                    self._waiting.append(ticket)
                self.stats["memory.demand_waits"] += 1
                if not self._pressure_logged:
                    self._pressure_logged = True
                    log.warning(
                        "memory budget is full (%d MiB for buffers, %d MiB of listings and disk cache index); "
                        "reads wait for buffers to drain",
                        self.capacity_bytes >> 20,
                        (self.listings_bytes + self.disk_index_bytes) >> 20,
                    )
                with trio.move_on_at(min(deadline_s, trio.current_time() + RECLAIM_RETRY_S)):
                    await self._freed.wait()  # state re-check after: others may have taken the freed bytes
                if trio.current_time() >= deadline_s:
                    self.stats["memory.overcommits"] += 1
                    log.warning(
                        "a read waited %.0f s for memory; taking %d bytes over the budget", DEMAND_WAIT_MAX_S, n_bytes
                    )
                    break
            self._take(n_bytes)
            if not self._waiting or self._waiting[0] is ticket:
                self._pressure_logged = False
        finally:
            if ticket is not None:
                was_oldest = self._waiting[0] is ticket
                self._waiting.remove(ticket)
                if was_oldest and self._waiting:
                    self._wake()  # the next oldest may fit now; it alone may take what is left

    def _may_take(self, n_bytes: int, ticket) -> bool:
        """Whether a demand of `n_bytes` (waiting as `ticket`, or new if None) may take
        its memory now, reclaiming what it needs. Beside an older waiter it must leave
        that one's request free, so the oldest is served first and none starves."""
        oldest = self._waiting[0] if self._waiting else ticket
        ahead_bytes = 0 if oldest is ticket else oldest.n_bytes
        over_bytes = self.used_bytes + n_bytes + ahead_bytes - self.capacity_bytes
        if over_bytes > 0:
            self._reclaim(over_bytes, max_priority=1 << 30)
            over_bytes = self.used_bytes + n_bytes + ahead_bytes - self.capacity_bytes
        # One request larger than the whole budget goes through alone, so it never deadlocks.
        return over_bytes <= 0 or (self.used_bytes == 0 and not ahead_bytes)

    def reclaimable_grew(self) -> None:
        """Memory already reserved has become reclaimable (a fetch's bytes passed to the
        block cache, a part finished or was read): readers waiting for memory must
        reclaim again. Without this they slept on until a release that might never
        come, every byte held by what they could have evicted (64 readers on 16 MiB:
        each READ waited out DEMAND_WAIT_MAX_S)."""
        if self._demands_pending:
            self._wake()

    def _wake(self) -> None:
        self._freed.set()
        self._freed = trio.Event()

    def release(self, n_bytes: int) -> None:
        if n_bytes <= 0:
            # Nothing freed: waking every waiter would only have each reclaim (nothing)
            # and wake the others, around and around (a core at 100% while reads wait).
            return
        self.used_bytes -= n_bytes
        assert self.used_bytes >= 0, "released more memory than reserved"
        self._wake()
