"""Small files pushed into the kernel's page cache as they are opened, before their
first READ.

Every Python `open()` asks `isatty()` of the file it opened: an `ioctl(TCGETS)` that
the kernel forwards to the daemon (FUSE_IOCTL) before the reader's first `read()`.
For a small file that no push has reached (a file the loader opens before
fetch-ahead's pass got to it), the FUSE request loop holds that request
(fuse/requestloop.py) while a fetch-ahead worker pushes the file into the kernel's
page cache, and answers it once the push has ended, however it ended. The reader's
`read()` then finds the pages, and no READ comes: a READ fetched through a worker
costs the serving thread the READ, the body back through the worker's socket and the
reply's copy (~0.45 ms per 100 KB file), a push ~0.1 ms.

Invariants:
- Every held request is let go exactly once: when its push ends (pushed, refused,
  failed, taken by another reader's READ; the pass's push of it, where one already
  runs), or HOLD_MAX_S after it was held, whichever
  comes first. A push that failed or was refused leaves the READ to fetch the file,
  with every check and retry of the read path; one still running then is waited for
  by that READ, which asks for its body.
- Only small files the mount's namespace names now (the immutable mode: an open does
  not list again), not served whole before (the kernel may hold their pages), not
  cached, kept or in flight here, and only where fetch-ahead workers push and the
  daemon's own GETs run in it (no --fetch-workers). Anything else is answered at once.
  A file a pass's push is writing into the kernel now is held until that push ends
  (no second GET); one on its way into the daemon (a reader's) is not.
- A held open is an open: fetch-ahead hears of it (note_open) as it would of its READ.
- The push is a pass's (BlockCache.push_ahead): its memory made from the oldest kept
  copies, its own copy kept. Only files never served whole are held, so an epoch after
  the page cache was dropped (whose kept copies are the files its loader reads next)
  holds none.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import trio

from bucketfs import errors
from bucketfs.backends.base import PUSHED

log = logging.getLogger(__name__)

# The longest a reader's open is held for its push. Past it the READ comes, and waits
# for the push still running (and asks for its body): a slow store costs the reader no
# more than without the hold.
HOLD_MAX_S = 5.0
# How often held opens are checked against HOLD_MAX_S (while any is held).
HOLD_CHECK_S = 0.5


class OpenPushes:
    """Pushes started by opens (module doc). `hold(ino, resume)` is the request loop's."""

    def __init__(self, config, namespace, cache, prefetcher, fetch_ahead, backend, stats, nursery: trio.Nursery):
        self._config = config
        self._ns = namespace
        self._cache = cache
        self._prefetcher = prefetcher
        self._fetch_ahead = fetch_ahead
        self._backend = backend
        self._stats = stats
        self._nursery = nursery
        self._key_prefix = config.url.prefix
        self._held: dict = {}  # ino -> (held since, [resume, ...]) while its push runs
        self._watching = False

    def hold(self, ino: int, resume: Callable[[], None]) -> bool:
        """Whether the open of inode `ino` is held: then `resume()` is called once, when
        the file is in the kernel's page cache or will not be (module doc)."""
        held = self._held.get(ino)
        if held is not None:  # (a second reader of a file being pushed)
            held[1].append(resume)
            self._stats["open.held"] += 1
            return True
        if not self._config.immutable or self._config.fetch_workers_count or not self._backend.pushes:
            return False
        try:
            node = self._ns.node(ino)
        except errors.NotFound:
            return False
        if node.is_dir or node.served or not 0 < node.size_bytes <= self._config.small_file_bytes:
            return False
        key = self._key_prefix + node.path
        if not self._ns.is_current(node) or self._prefetcher.is_warming(key, node.version):
            return False
        # A pass's push: into the kernel, its copy kept. No held file was served, so the
        # oldest kept copies it makes room from are files pushed before and served.
        flight = self._cache.push_ahead(
            key, node.version, node.size_bytes, ino, False, functools.partial(self._pushed, node)
        )
        if flight is None:  # (cached, kept or on its way already; or no memory now)
            # A pass's push of it may run: its READ would wait for it and take its body.
            flight = self._cache.push_into_kernel(key, node.version)
            if flight is None:
                return False
            self._stats["open.held_for_pass"] += 1
        assert flight.on_end is not None  # (a push into the kernel)
        self._held[ino] = (trio.current_time(), [resume])
        flight.on_end.append(functools.partial(self._let_go, ino))
        self._stats["open.held"] += 1
        if not self._watching:
            self._watching = True
            self._nursery.start_soon(self._watch)
        try:
            self._fetch_ahead.note_open(node, key)
        except Exception:  # noqa: BLE001 - (the open is held: resume() must still come, once)
            log.exception("fetch-ahead's accounting of a held open failed")
        return True

    def _pushed(self, node, outcome: str) -> None:
        """The push of `node` a held open started ended with `outcome` (its flight's
        on_end lets the opens go next)."""
        if outcome == PUSHED:
            node.served = True  # (the kernel holds it whole, as if a reader had read it)
        self._stats[f"open.pushed_{outcome}"] += 1

    def _let_go(self, ino: int) -> None:
        _, resumes = self._held.pop(ino, (0.0, ()))
        for resume in resumes:
            try:
                resume()
            except Exception:  # noqa: BLE001 - (the others are still let go)
                log.exception("answering a held open failed")

    async def _watch(self) -> None:
        """Let go of opens held past HOLD_MAX_S, until none is held."""
        try:
            while self._held:
                await trio.sleep(HOLD_CHECK_S)
                expired_at_s = trio.current_time() - HOLD_MAX_S
                for ino in [ino for ino, (since_s, _) in self._held.items() if since_s <= expired_at_s]:
                    self._stats["open.held_expired"] += 1
                    self._let_go(ino)
        finally:
            self._watching = False
