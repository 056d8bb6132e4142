"""Connection slots handed out by urgency: a call someone waits on goes before read-ahead.

Why: read-ahead windows, warm shard heads and listings ahead of a walk can take
every connection for bytes nobody needs yet. With a first-come limiter, a reader
that is waiting (a DataLoader worker opening a small file, a stream that caught up
with its window, a cache miss) queues behind all of them.

Here, when a slot frees, the first waiting call that is urgent takes it; only
when none is urgent does the oldest speculative call go. A speculative call turns
urgent the moment a reader waits on its result, so it is never starved while
needed.

The core marks a task's calls as speculative with `mark_speculative(ticket)`, a
context variable, so the backend methods keep their signatures. `ticket.urgent`
is read again each time a slot frees.

Fetch-ahead (core/fetchahead.py) keeps hundreds of GETs in flight, far more than
--max-connections. Its tickets say `own_slots`: they take slots of a second pool
(`fetch_ahead_count`, on top of the shared one), so a reader's call never queues
behind them; only when that pool is empty does one wait in the shared pool, as any
speculative call. A backend gives the second pool only where its GETs do not block a
thread each (the curl engine): `fetch_ahead_count` is 0 otherwise.
"""

from __future__ import annotations

import contextvars
import itertools

import trio

_SPECULATIVE: contextvars.ContextVar = contextvars.ContextVar("bucketfs_speculative", default=None)


def mark_speculative(ticket) -> None:
    """This task's later backend calls fetch for `ticket` (an object with a bool
    `urgent`): they wait behind urgent calls while `ticket.urgent` is false.
    Call it inside the task: trio gives every task its own copy of the context."""
    _SPECULATIVE.set(ticket)


def fetch_ahead_slots(config) -> int:
    """The second pool's size for a mount of `config` whose GETs run on the curl engine:
    --fetch-ahead-requests where fetch-ahead can run (on, in the immutable default)."""
    return config.fetch_ahead_requests_count if config.fetch_ahead != "off" and config.immutable else 0


class PrioritySlots:
    """At most `capacity` calls at once; urgent waiters first, then oldest first."""

    def __init__(self, capacity_count: int, fetch_ahead_count: int = 0):
        self.capacity_count = capacity_count
        self.busy_count = 0
        self.fetch_ahead_count = fetch_ahead_count
        self.fetch_ahead_busy_count = 0
        self._waiting: dict = {}  # sequence number -> (ticket or None, trio.Event), oldest first
        self._sequence = itertools.count()
        self.queued_count = 0  # calls that found every slot busy
        self.overtakes_count = 0  # slots given to an urgent call ahead of older speculative ones

    async def __aenter__(self) -> None:
        ticket = _SPECULATIVE.get()
        if ticket is not None and getattr(ticket, "own_slots", False):
            if self.fetch_ahead_busy_count < self.fetch_ahead_count:
                self.fetch_ahead_busy_count += 1
                ticket.in_own_slot = True
                return
        if self.busy_count < self.capacity_count:
            self.busy_count += 1
            return
        seq = next(self._sequence)
        event = trio.Event()
        self._waiting[seq] = (ticket, event)
        self.queued_count += 1
        try:
            await event.wait()
        except BaseException:
            if self._waiting.pop(seq, None) is None:
                # Already handed the slot (trio cancels a wait only before the wake-up,
                # but a KeyboardInterrupt can land after it): pass it on, never leak it.
                self._release()
            raise

    async def __aexit__(self, *exc_info) -> None:
        ticket = _SPECULATIVE.get()
        if ticket is not None and getattr(ticket, "in_own_slot", False):
            ticket.in_own_slot = False
            self.fetch_ahead_busy_count -= 1
            return
        self._release()

    def _release(self) -> None:
        if not self._waiting:
            self.busy_count -= 1
            return
        oldest = next(iter(self._waiting))
        chosen = next((seq for seq, (ticket, _) in self._waiting.items() if ticket is None or ticket.urgent), oldest)
        if chosen != oldest:
            self.overtakes_count += 1
        _, event = self._waiting.pop(chosen)
        event.set()  # the slot passes straight to it: busy_count is unchanged
