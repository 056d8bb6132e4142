"""Fetch-ahead of a random-order pass over small files.

A DataLoader(shuffle=True) over an ImageFolder opens its files in random order, each
worker one file at a time, so a cold epoch has only as many GETs in flight as there
are workers (8 workers at 20 ms to first byte: at best 400 files/s). A parallel copier
keeps hundreds in flight. `FetchAhead` notices a shuffled pass and fetches the rest
of its tree ahead of the loader, the way a copier would, into memory the readers do
not need; the loader's opens then find their files cached.

Detection (`note_open`, told of every open of a small file):
- An open is in order when the entry before it in its directory's listing was
  opened among the last RECENT_OPENS_KEPT small-file opens (loader workers reading in
  listing order interleave, so "the previous open" is not enough), or it is the
  directory's first entry.
- When at least OUT_OF_ORDER_MIN of the last DETECT_WINDOW opens were out of order, a
  pass begins over the deepest directory holding all of those files (for an
  ImageFolder, the root above its class directories). A walk in listing order, a
  find or du (no opens), a reader of a few files and --metadata-ttl mounts never
  start one.

A pass (`_run_pass`):
- walks its tree in listing order, once, and fetches each small file not yet opened
  in this pass and not cached (block cache, disk cache, or the kernel's page cache)
  with one whole-object GET (BlockCache.fetch_ahead): each object at most once per
  pass. The kernel does not say which files it still holds: a file served whole
  before counts as held, unless most of the files served before that the last opens
  reached were read again from the daemon (`note_kernel_miss`: the kernel dropped
  them, a data set larger than the page cache or caches dropped);
- keeps at most --fetch-ahead-requests GETs in flight, in a connection pool of their
  own, so a reader's GET never queues behind them, and a fetch-ahead GET a reader
  waits on turns urgent (backends/slots.py). It gets there as TCP does: from
  RAMP_START_COUNT, one more per GET that succeeds (doubling each round trip), halved
  by a failure. Hundreds of new connections at once overflow the listen queue of a
  modest server or proxy: the handshakes it drops leave GETs (and the readers that
  wait on them) stalled until --read-timeout;
- holds what it fetched (never evicted) until the loader opens it; the held bytes
  stay under ROOM_SHARE of the buffer budget, and fetching waits for opens to free
  room: the loader's reads are what make room, so fetch-ahead never runs further
  ahead than that. Files pushed into the kernel's page cache (fetch-ahead workers)
  wait there, not in the daemon: they stay within the pass's window instead
  (--fetch-ahead-window; by default a share of the memory the kernel reports
  available, at least the room), since a loader in random order finds a file pushed
  with odds of about the window over what it has yet to read;
- with --cache-dir, runs no faster than the disk cache stores (it waits while half
  of the queue of writes is in use): what it fetched past that queue would not be
  stored, and the next epoch would fetch it again;
- takes free memory, or the memory of files this pass has read (dropped from the
  block cache, oldest read first: the pass will not read them again), never that of
  a cached file the pass has still to read (evicting those made a pass over a data
  set about the size of memory fetch 2.7x the files it lacked). On a data set larger
  than memory this spends the memory cache's hits for the next pass on requests in
  flight for this one; --cache-dir keeps them on disk;
- ends when a file of it is opened a second time (the next epoch: a new pass is
  detected afresh) or when no file of it is opened for PASS_IDLE_S. Held files
  not yet opened are released then (kept in the cache, evictable: counted unused).

Into the kernel's page cache (`start_pushing`: fetch-ahead workers, --fetch-ahead-workers):
a file of a pass is fetched, checked and written into its inode's page cache by a
worker process (backends push_whole), not held in the daemon's memory: the loader's
reads of it then never reach the daemon. One push in several (up to
TELL_OPEN_EVERY_MAX) ends its file's cached attributes too, so the loader's first
stat() or read past its end is a GETATTR, which tells the pass it was opened
(`note_getattr`); it stands for the pushes after it (pushed.py), in the room and in
the counts. The room, the ramp and the pass are the same; each push reserves its size
in the budget while it runs (the worker's buffer).
- only files of directories whose listing the kernel read to its end (READDIRPLUS hands
  it every entry's inode). A directory the loader never listed (it opens paths from a
  list) is listed through the mount first (`list_to_kernel`, on a thread); if that
  does not reach the kernel either, its files are fetched into memory as above. A
  push to an inode the kernel has dropped since is refused (ENOENT) and its GET
  wasted; once most of a pass's recent pushes are refused so, that pass fetches into
  memory;
- a push refused for its answer (not the pinned version, not whole, a wrong MD5) or
  failed is not retried: the loader's READ fetches the file, with every check and retry;
- a READ of a file whose push is in flight waits on the push, which then brings the
  body back to the daemon instead (PushRequest.ask_for_body): each file is fetched once.

A loader that reads only part of the tree in each epoch (a DistributedSampler share
on one of several nodes) looks the same while its epoch runs: its opens are spread
over the whole tree. It shows when the epoch ends (the next one opens a file again):
fewer than PARTIAL_SHARE of the tree's files were opened, or, when the walk stopped
at a room full of files nobody opened, more than PARTIAL_HELD_SHARE of the files
opened are still held. From then on that tree gets no pass on this mount (each node
would otherwise fetch the whole data set every epoch); the first epoch's waste is
bounded by the room.
"""

from __future__ import annotations

import bisect
import collections
import functools
import logging
from typing import Callable, Optional

import trio

from bucketfs import errors
from bucketfs.backends.base import PUSH_FAILED, PUSH_NO_INODE, PUSH_READ, PUSHED
from bucketfs.core.namespace import Node
from bucketfs.core.pushed import PushedFiles
from bucketfs.diskcache.pagecache import available_memory_bytes

log = logging.getLogger(__name__)

# Opens remembered to tell an in-order reader: several workers' interleaved streams
# (a worker's previous file is a few opens back). Few: on a small data set, a long
# memory would hold every file and call any order "in order".
RECENT_OPENS_KEPT = 64
# Of the last DETECT_WINDOW small-file opens, this many out of order start a pass. A
# shuffled order has nearly all out of order; loader workers reading in listing order
# have a few (a batch's first file, its predecessor not opened yet).
DETECT_WINDOW = 32
OUT_OF_ORDER_MIN = 24
# Fetched-ahead files held unread may take this share of the memory for buffers; the
# rest stays for readers, read-ahead and the disk cache's queued writes.
ROOM_SHARE = 0.5
# Pushed files not yet opened (the kernel's page cache) may take this share of the
# memory the kernel reports available when a pass starts (--fetch-ahead-window 0), and
# never less than the room: the rest stays for everything else on the machine.
WINDOW_SHARE_OF_AVAILABLE = 0.25
# A pass none of whose files is opened for this long is over (the loader stopped, or
# moved on): what it holds is let go.
PASS_IDLE_S = 30.0
# GETs in flight when fetch-ahead starts, and the least it falls back to on failures.
RAMP_START_COUNT = 16
# A pass ended by a repeated open after fewer than this share of its tree's files
# were opened: the loader reads a part of the tree per epoch (one node's share).
PARTIAL_SHARE = 0.75
# ... or still holding more than this share of the files it opened (at least
# PARTIAL_HELD_MIN): a loader reading the whole tree has opened nearly everything the
# pass fetched when its next epoch begins.
PARTIAL_HELD_SHARE = 0.25
PARTIAL_HELD_MIN = 16
# When the budget refuses memory with room left (held by readers or read-ahead), the
# walk tries again this often; opens and landed fetches wake it sooner.
RETRY_S = 0.25
# Of a pass's last PUSH_OUTCOMES_KEPT pushes, more than this many to inodes the kernel
# no longer held: the pass stops pushing (its files go to memory instead).
PUSH_OUTCOMES_KEPT = 32
PUSH_NO_INODE_MAX = 16
# A pushed file's READ this soon after the GETATTR that said it was opened belongs to
# that open (the kernel dropped some of its pages); later, it is another open.
SAME_OPEN_S = 1.0
# One push in up to this many ends its inode's cached attributes (a "told" push): the
# pass hears of those files' opens, a GETATTR each, and counts the others by them
# (pushed.py). A GETATTR per file cost the serving thread 0.04 ms (15% of its CPU per
# cold file). Fewer are untold when the room holds few files: what the kernel holds
# unread is told by about TOLD_IN_ROOM_MIN told files (within about 1/8).
TELL_OPEN_EVERY_MAX = 16
TOLD_IN_ROOM_MIN = 64
# A push that ended well frees one request's slot; the walk, waiting for slots, is woken
# once this many are free (at most; one in 16 of those allowed), not for each: a wake
# per file costs the serving thread a task switch and a timeout's set-up each.
WAKE_FREE_SLOTS_MAX = 8


class _PassOver(Exception):
    """The pass went idle while its walk waited."""


class _Pass:
    __slots__ = (
        "root",
        "opened",
        "read",
        "held",
        "last_open_s",
        "cancel_scope",
        "fetched_count",
        "kernel_keeps_served",
        "tree_files_count",
        "walked",
        "pushed",
        "pushed_opened",
        "push_no_inode",
        "pushing",
        "window_bytes",
    )

    def __init__(self, root: Node, now_s: float, kernel_keeps_served: bool, pushing: bool, window_bytes: int):
        self.root = root
        self.kernel_keeps_served = kernel_keeps_served  # files served whole before are skipped
        self.opened: set = set()  # inos of files opened in this pass
        self.read: collections.deque = collections.deque()  # (key, version, bytes) opened, oldest first
        self.tree_files_count = 0  # small files the walk has seen
        self.walked = False
        self.held: dict = {}  # key -> (version, bytes) fetched ahead, not yet opened
        self.last_open_s = now_s
        self.cancel_scope = trio.CancelScope()
        self.fetched_count = 0
        self.pushing = pushing
        self.window_bytes = window_bytes  # what its pushed files not yet opened may take
        self.pushed = PushedFiles()  # pushed (or being pushed), not yet opened
        self.pushed_opened: dict = {}  # told ino -> when it was opened after it was pushed (a GETATTR told)
        self.push_no_inode: collections.deque = collections.deque(maxlen=PUSH_OUTCOMES_KEPT)  # refused: no inode


def is_under(node: Node, directory: Node) -> bool:
    parent = node.parent
    while True:
        if parent is directory:
            return True
        if parent.parent is parent:  # the root
            return False
        parent = parent.parent


def common_directory(nodes) -> Node:
    """The deepest directory holding every node of `nodes` (not empty)."""
    nodes = iter(nodes)
    directory = next(nodes).parent
    for node in nodes:
        while not is_under(node, directory) and directory.parent is not directory:
            directory = directory.parent
    return directory


class FetchAhead:
    """One mount's fetch-ahead. `Filesystem.open` calls `note_open` for every small file."""

    def __init__(self, config, namespace, cache, disk_cache, budget, stats, nursery: trio.Nursery):
        self.enabled = config.fetch_ahead != "off" and config.immutable
        self.key_prefix = config.url.prefix
        self.small_file_bytes = config.small_file_bytes
        self.requests_max_count = config.fetch_ahead_requests_count
        self.window_option_bytes = config.fetch_ahead_window_bytes  # (0: _window_bytes decides)
        self._ns = namespace
        self._cache = cache
        self._disk_cache = disk_cache
        self._budget = budget
        self._stats = stats
        self._nursery = nursery
        self._recent: collections.deque = collections.deque()  # inos of the last small-file opens
        self._recent_set: collections.Counter = collections.Counter()
        self._window: collections.deque = collections.deque(maxlen=DETECT_WINDOW)  # (node, out of order)
        # Of the last opens of files served whole before: their inos, and those of them
        # the kernel no longer held (their READs reached the daemon).
        self._served_opens: collections.deque = collections.deque(maxlen=DETECT_WINDOW)
        self._kernel_misses: set = set()
        self._pass: Optional[_Pass] = None
        self._partial_roots: set = set()  # inos of trees read in part per epoch: no pass
        self._in_flight_count = 0
        self._in_flight_bytes = 0
        if disk_cache is not None:
            disk_cache.on_write_done = self._wake
        self._allowed_count = min(RAMP_START_COUNT, self.requests_max_count)  # grows per success, halves per failure
        self._changed = trio.Event()  # room freed, a fetch landed, or the pass ended
        self._pushes = False  # start_pushing's
        self._list_to_kernel: Optional[Callable[[Node], None]] = None  # start_pushing's
        # Directories whose entries' inodes the kernel was handed (READDIRPLUS): only
        # their files are pushed (a push to an inode the kernel lacks is refused).
        self._listed_to_kernel: set = set()

    def start_pushing(self, list_to_kernel: Optional[Callable[[Node], None]] = None) -> None:
        """From now on, passes push their files into the kernel's page cache
        (BlockCache.push_ahead: the backend's workers write them there).
        `list_to_kernel(directory)` (blocking: run on a thread) lists a directory
        through the mount, so that the kernel holds its entries' inodes."""
        self._pushes = True
        self._list_to_kernel = list_to_kernel

    @property
    def room_bytes(self) -> int:
        return int(self._budget.capacity_bytes * ROOM_SHARE)

    def _window_bytes(self) -> int:
        """How much a pass may push ahead of its loader (--fetch-ahead-window)."""
        if self.window_option_bytes:
            return self.window_option_bytes
        available_bytes = available_memory_bytes()
        if available_bytes is None:
            return self.room_bytes
        return max(self.room_bytes, int(available_bytes * WINDOW_SHARE_OF_AVAILABLE))

    # -- what Filesystem tells it ---------------------------------------------------
    def note_open(self, node: Node, key: str) -> None:
        """`node` (a small file, as `key`) is being opened for reading."""
        if not self.enabled:
            return
        now_s = trio.current_time()
        held_bytes = self._cache.release_hold(key, node.version)
        current = self._pass
        if current is not None:
            told = current.pushed.is_told(node.ino)
            pushed_files, pushed_bytes = current.pushed.opened(node.ino)
            opened_s = current.pushed_opened.pop(node.ino, None)
            if told:
                current.pushed_opened[node.ino] = now_s
                self._stats["fetch_ahead.push_told_opened"] += 1
            if pushed_files:
                self._stats["fetch_ahead.used_files"] += pushed_files
                self._stats["fetch_ahead.used_bytes"] += pushed_bytes
                self._wake()
            elif opened_s is not None and now_s - opened_s < SAME_OPEN_S:
                # Read from the daemon right after its GETATTR said it was opened: the
                # same open, whose pages the kernel dropped; not the next epoch (which,
                # later, ends the pass as any second open does).
                self._note_order(node)
                return
            if held_bytes:
                current.held.pop(key, None)
                self._stats["fetch_ahead.used_files"] += 1
                self._stats["fetch_ahead.used_bytes"] += held_bytes
                self._wake()
            if is_under(node, current.root):
                current.last_open_s = now_s
                if node.ino in current.opened:
                    self._note_share(current)
                    self._end_pass("its files are being opened again")  # the next epoch
                else:
                    current.opened.add(node.ino)
                    current.read.append((key, node.version, node.size_bytes))
        self._note_order(node)

    def note_getattr(self, node: Node) -> None:
        """The kernel asked for `node`'s attributes: for a file pushed into its page
        cache (whose cached attributes the push ended), the loader opened it."""
        current = self._pass
        if current is not None and current.pushed.is_told(node.ino):
            self.note_open(node, self.key_prefix + node.path)

    def note_listed_to_kernel(self, directory: Node) -> None:
        """The kernel was handed the inodes of every entry of `directory` (a READDIRPLUS
        read to its end): its files may be pushed."""
        if self._pushes:
            self._listed_to_kernel.add(directory.ino)

    def note_kernel_miss(self, node: Node) -> None:
        """A READ of `node`, served whole before, reached the daemon: the kernel had
        dropped its pages."""
        if self.enabled and node.ino in self._served_opens:
            self._kernel_misses.add(node.ino)

    def _kernel_keeps_served(self) -> bool:
        """Whether files served whole before are likely still in the page cache: unless
        most of those among the last opens were read from the daemon again."""
        opened = set(self._served_opens)
        missed = len(self._kernel_misses & opened)
        return len(opened) < 8 or missed * 2 < len(opened)

    def _note_order(self, node: Node) -> None:
        if node.served:
            if len(self._served_opens) == self._served_opens.maxlen:
                self._kernel_misses.discard(self._served_opens[0])
            self._served_opens.append(node.ino)
        self._window.append((node, not self._in_order(node)))
        self._recent.append(node.ino)
        self._recent_set[node.ino] += 1
        if len(self._recent) > RECENT_OPENS_KEPT:
            old = self._recent.popleft()
            self._recent_set[old] -= 1
            if not self._recent_set[old]:
                del self._recent_set[old]
        if self._pass is not None or len(self._window) < DETECT_WINDOW:
            return
        if sum(out_of_order for _, out_of_order in self._window) >= OUT_OF_ORDER_MIN:
            root = common_directory(node for node, _ in self._window)
            if root.ino in self._partial_roots:
                self._window.clear()
                self._stats["fetch_ahead.partial_passes_skipped"] += 1
                return
            self._start_pass(root)

    def _in_order(self, node: Node) -> bool:
        listing = node.parent.listing
        if listing is None:
            return True
        names = listing.names_sorted
        i = bisect.bisect_left(names, node.name)
        if i == 0:
            return True
        return listing.children.get(names[i - 1]) in self._recent_set

    # -- a pass -----------------------------------------------------------------------
    def _start_pass(self, root: Node) -> None:
        current = self._pass = _Pass(
            root, trio.current_time(), self._kernel_keeps_served(), self._pushes, self._window_bytes()
        )
        self._window.clear()
        self._stats["fetch_ahead.passes"] += 1
        self._stats["fetch_ahead.window_bytes"] = current.window_bytes if current.pushing else 0
        # The opens that revealed the pass count as opened in it.
        current.opened.update(ino for ino in self._recent_set)
        log.info("fetch-ahead: files under /%s are opened in random order; fetching the rest ahead", root.path)
        self._nursery.start_soon(self._run_pass, current)

    def _note_share(self, current: _Pass) -> None:
        """The pass's epoch is over (a repeated open): did its loader read the tree?"""
        opened_count = len(current.opened) + current.pushed.credited_untold_count
        held_count = len(current.held)
        few_opened = current.walked and opened_count < PARTIAL_SHARE * current.tree_files_count
        if few_opened or held_count > max(PARTIAL_HELD_MIN, PARTIAL_HELD_SHARE * opened_count):
            self._partial_roots.add(current.root.ino)
            log.info(
                "fetch-ahead: an epoch opened %d files under /%s (%d seen there, %d fetched ahead and not "
                "opened): its loader reads a part of the tree (one node's share?); no more fetch-ahead there "
                "on this mount",
                opened_count,
                current.root.path,
                current.tree_files_count,
                held_count,
            )

    def _end_pass(self, why: str) -> None:
        current, self._pass = self._pass, None
        if current is None:
            return
        current.cancel_scope.cancel()
        for key, (version, _) in current.held.items():
            held_bytes = self._cache.release_hold(key, version)
            if held_bytes:
                self._stats["fetch_ahead.unused_files"] += 1
                self._stats["fetch_ahead.unused_bytes"] += held_bytes
        current.held.clear()
        unused_files, unused_bytes = current.pushed.end()
        self._stats["fetch_ahead.unused_files"] += unused_files
        self._stats["fetch_ahead.unused_bytes"] += unused_bytes
        self._window.clear()
        self._recent.clear()  # the next epoch's order owes nothing to this one's
        self._recent_set.clear()
        log.info(
            "fetch-ahead: pass over /%s ended (%s); %d files fetched", current.root.path, why, current.fetched_count
        )
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _run_pass(self, current: _Pass) -> None:
        with current.cancel_scope:
            try:
                await self._walk(current)
                while True:  # walked: what it holds waits for the loader
                    await self._wait(current)
            except _PassOver:
                if self._pass is current:
                    self._end_pass(f"no file opened for {PASS_IDLE_S:.0f} s")
            except errors.BucketfsError as exc:
                # A listing failed (the store is down): the loader's own opens go on
                # without fetch-ahead; a later shuffled stretch starts a new pass.
                log.warning("fetch-ahead: walking /%s failed: %s", current.root.path, exc)
                if self._pass is current:
                    self._end_pass("a listing failed")

    async def _wait(self, current: _Pass) -> None:
        """Until something changes (or RETRY_S); _PassOver once the pass is idle."""
        now_s = trio.current_time()
        idle_at_s = current.last_open_s + PASS_IDLE_S
        if now_s >= idle_at_s:
            raise _PassOver()
        with trio.move_on_at(min(idle_at_s, now_s + RETRY_S)):
            await self._changed.wait()

    async def _walk(self, current: _Pass) -> None:
        stack = [current.root]
        while stack:
            directory = stack.pop()
            subdirectories = []
            children = await self._ns.list_dir(directory.ino)
            if current.pushing and directory.ino not in self._listed_to_kernel:
                await self._list_through_kernel(directory, children)
            for child in children:
                if child.is_dir:
                    subdirectories.append(child)
                    continue
                if 0 < child.size_bytes <= self.small_file_bytes:
                    current.tree_files_count += 1
                if self._wanted(current, child):
                    await self._fetch(current, child)
            stack.extend(reversed(subdirectories))
        current.walked = True

    async def _list_through_kernel(self, directory: Node, children: list) -> None:
        """Have the kernel list `directory` (READDIRPLUS hands it every entry's inode),
        if it holds files to push: a loader that opens paths it never listed (a list of
        files, brace expansion) gets them pushed too."""
        if self._list_to_kernel is None or not any(0 < c.size_bytes <= self.small_file_bytes for c in children):
            return
        try:
            await trio.to_thread.run_sync(self._list_to_kernel, directory, abandon_on_cancel=True)
        except OSError as exc:
            log.debug("fetch-ahead: listing /%s through the mount: %s", directory.path, exc)
            return
        self._stats["fetch_ahead.dirs_listed_to_kernel"] += 1

    def _wanted(self, current: _Pass, node: Node) -> bool:
        if not 0 < node.size_bytes <= self.small_file_bytes or node.ino in current.opened:
            return False
        if node.served and current.kernel_keeps_served:
            return False
        key = self.key_prefix + node.path
        if self._cache.holds(key, node.version, 0):
            return False
        if self._disk_cache is not None and self._disk_cache.holds(key, node.version, 0, node.size_bytes):
            return False
        return True

    async def _fetch(self, current: _Pass, node: Node) -> None:
        key = self.key_prefix + node.path
        while True:
            # Once the pass has ended no fetch may start (nothing would count it or let go
            # of its hold), though a fetch that fits starts with no checkpoint, and a wait
            # woken as the pass ended returns as if it had not.
            await trio.lowlevel.checkpoint_if_cancelled()
            if node.ino in current.opened or self._cache.holds(key, node.version, 0):
                return  # opened while this waited for room: its reader fetched it
            # Pushed files wait in the kernel's page cache (the window); files fetched
            # into the daemon's memory, in its budget (the room).
            pushing = current.pushing and node.parent.ino in self._listed_to_kernel and self._cache.backend.pushes
            if pushing:
                fits = current.pushed.held_bytes + node.size_bytes <= current.window_bytes or not current.pushed
            else:
                fits = self._cache.held_bytes + node.size_bytes <= self.room_bytes or not current.held
            if fits and not self._disk_keeps_up(node.size_bytes):
                # No faster than the disk cache stores: past its queue a file is not
                # stored, and the next epoch would fetch it again.
                self._stats["fetch_ahead.disk_waits"] += 1
                fits = False
            if fits and self._in_flight_count < self._allowed_count:
                if pushing:
                    told = current.pushed.next_is_told()
                    flight = self._cache.push_ahead(
                        key,
                        node.version,
                        node.size_bytes,
                        node.ino,
                        told,
                        functools.partial(self._pushed, current, node),
                    )
                else:
                    self._make_room(current, node.size_bytes)
                    flight = self._cache.fetch_ahead(key, node.version, node.size_bytes)
                if flight is not None:
                    break
            await self._wait(current)
        current.fetched_count += 1
        self._in_flight_count += 1
        self._in_flight_bytes += node.size_bytes
        self._stats["fetch_ahead.files"] += 1
        self._stats["fetch_ahead.bytes"] += node.size_bytes
        if pushing:
            every = max(
                1, min(TELL_OPEN_EVERY_MAX, current.window_bytes // max(node.size_bytes, 1) // TOLD_IN_ROOM_MIN)
            )
            current.pushed.add(node.ino, node.size_bytes, told, every)
            if told:
                self._stats["fetch_ahead.push_told"] += 1
            return  # (its outcome: _pushed)
        current.held[key] = (node.version, node.size_bytes)
        self._nursery.start_soon(self._landed, current, key, node.size_bytes, flight)

    def _pushed(self, current: _Pass, node: Node, outcome: str) -> None:
        """`node`'s push (BlockCache.push_ahead) ended with `outcome`: account for it."""
        size_bytes = node.size_bytes
        self._in_flight_count -= 1
        self._in_flight_bytes -= size_bytes
        self._stats[f"fetch_ahead.push_{outcome}"] += 1
        if outcome in (PUSHED, PUSH_READ):
            if outcome == PUSHED:
                node.served = True  # (the kernel holds it whole, as if a reader had read it)
            self._allowed_count = min(self._allowed_count + 1, self.requests_max_count)
        else:
            ours, (counted_files, counted_bytes) = current.pushed.failed(node.ino)
            if ours:
                self._stats["fetch_ahead.failed"] += 1
                self._stats["fetch_ahead.used_files"] -= counted_files
                self._stats["fetch_ahead.used_bytes"] -= counted_bytes
            if outcome == PUSH_FAILED:
                self._allowed_count = max(self._allowed_count // 2, min(RAMP_START_COUNT, self.requests_max_count))
        current.push_no_inode.append(outcome == PUSH_NO_INODE)
        if current.pushing and sum(current.push_no_inode) > PUSH_NO_INODE_MAX:
            current.pushing = False
            log.info(
                "fetch-ahead: the kernel no longer holds the inodes of most files under /%s; fetching them "
                "into memory instead",
                current.root.path,
            )
        free_slots_count = self._allowed_count - self._in_flight_count
        if (
            outcome not in (PUSHED, PUSH_READ)
            or not self._in_flight_count
            or free_slots_count >= min(WAKE_FREE_SLOTS_MAX, max(1, self._allowed_count // 16))
        ):
            self._wake()

    def _disk_keeps_up(self, size_bytes: int) -> bool:
        """With --cache-dir: this fetch and those in flight fit the disk cache's queue of
        writes (at least one in flight whatever its size)."""
        if self._disk_cache is None:
            return True
        room_bytes = self._disk_cache.write_room_bytes()
        return room_bytes > 0 if not self._in_flight_count else self._in_flight_bytes + size_bytes <= room_bytes

    def _make_room(self, current: _Pass, size_bytes: int) -> None:
        """Drop files this pass has read from the block cache until `size_bytes` fit in
        free memory (or none is left to drop)."""
        busy: list = []  # still being read: tried again later
        while self._budget.prefetch_room_bytes < size_bytes and current.read:
            key, version, object_bytes = item = current.read.popleft()
            if self._cache.drop_read(key, version, object_bytes) is None:
                busy.append(item)
        current.read.extend(busy)

    async def _landed(self, current: _Pass, key: str, size_bytes: int, flight) -> None:
        try:
            await flight.done.wait()
        finally:
            self._in_flight_count -= 1
            self._in_flight_bytes -= size_bytes
            if flight.error is not None:
                if current.held.pop(key, None) is not None:  # (BlockCache let go of its hold)
                    self._stats["fetch_ahead.failed"] += 1  # (else opened meanwhile: counted used)
                self._allowed_count = max(self._allowed_count // 2, min(RAMP_START_COUNT, self.requests_max_count))
            else:
                self._allowed_count = min(self._allowed_count + 1, self.requests_max_count)
            self._wake()
