"""Retries of backend calls, and the one door through which blocking SDK calls leave
the trio thread.

`BlockingCaller.call` runs a blocking call (an SDK request, a urllib3 GET) on a worker
thread; `run` runs a call that does not block (a curl engine transfer) on the trio
thread. Both:
- wait for a connection slot, handed out by urgency (slots.py): a call a reader waits
  on goes before read-ahead;
- bound the worker threads (`max_threads_count`), abandoned ones included: a
  cancelled read-ahead leaves its thread to finish alone, still holding its limiter
  token, so the pool stays bounded;
- classify every SDK exception into a bucketfs error (`classify`), and retry
  TransientError with full-jitter exponential backoff (RetryPolicy) up to
  `attempts_count` attempts; errors the backend already raised as bucketfs errors
  pass through at once, never retried here;
- count retries, bodies that failed their checksum and failures by type, on the trio
  thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
from typing import Awaitable, Callable, TypeVar

import trio

from bucketfs import errors
from bucketfs.backends.digests import CorruptBody
from bucketfs.backends.slots import PrioritySlots

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """The Config's retry_attempts_count, retry_base_delay_s and retry_max_delay_s."""

    attempts_count: int
    base_delay_s: float
    max_delay_s: float

    def delay_s(self, attempt: int) -> float:
        # "Full jitter" backoff: spreads retries of many readers hitting one throttled prefix.
        return random.uniform(0, min(self.max_delay_s, self.base_delay_s * (2**attempt)))


class BlockingCaller:
    """Runs blocking SDK calls off the trio thread (or non-blocking ones: run), bounded, with retries.

    `classify(exc)` maps an SDK exception to a bucketfs error; TransientError is
    retried with jittered exponential backoff up to `policy.attempts_count` attempts.
    """

    def __init__(
        self,
        max_threads_count: int,
        policy: RetryPolicy,
        classify: Callable[[BaseException], errors.BucketfsError],
        fetch_ahead_slots_count: int = 0,
    ):
        # Who goes next: urgent calls first; fetch-ahead in a pool of its own (slots.py).
        self.slots = PrioritySlots(max_threads_count, fetch_ahead_slots_count)
        self.limiter = trio.CapacityLimiter(max_threads_count)  # threads, abandoned ones included
        self.policy = policy
        self.classify = classify
        self.retries_count = 0
        self.corrupt_bodies_count = 0  # answers whose bytes did not match the store's checksum
        self.failures: collections.Counter = collections.Counter()  # error type name -> count

    async def call(self, what: str, fn: Callable[..., T], *args, abandon_on_cancel: bool = False) -> T:
        # abandon_on_cancel: a cancelled prefetch leaves its thread to finish alone;
        # the limiter slot is still held until then, which keeps the pool bounded.
        return await self.run(
            what, trio.to_thread.run_sync, fn, *args, limiter=self.limiter, abandon_on_cancel=abandon_on_cancel
        )

    async def run(self, what: str, attempt_fn: Callable[..., Awaitable[T]], *args, **kwargs) -> T:
        """`await attempt_fn(*args, **kwargs)` in a slot, with call()'s retries and
        classification: for calls that do not block (http/curl.py's transfers)."""
        attempt = 0
        while True:
            try:
                async with self.slots:
                    return await attempt_fn(*args, **kwargs)
            except errors.BucketfsError:
                raise
            except Exception as exc:  # noqa: BLE001 - every SDK failure is classified here
                if isinstance(exc, CorruptBody):
                    self.corrupt_bodies_count += 1
                err = self.classify(exc)
                attempt += 1
                if isinstance(err, errors.TransientError) and attempt < self.policy.attempts_count:
                    self.retries_count += 1
                    delay_s = self.policy.delay_s(attempt)
                    log.warning(
                        "%s failed (%s); retry %d/%d in %.2fs",
                        what,
                        err,
                        attempt,
                        self.policy.attempts_count - 1,
                        delay_s,
                    )
                    await trio.sleep(delay_s)
                    continue
                self.failures[type(err).__name__] += 1
                raise err from exc
