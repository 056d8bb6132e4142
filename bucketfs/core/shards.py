"""Shard warming: which shards' heads a shard reader's read-ahead window warms.

`ShardWarming` is the policy; the `Prefetcher` does the fetching (`warm_head`) and
`Filesystem` tells the policy about every open and release.

Invariants:
- Once a shard reader's read-ahead window reaches past the shard's end, the window
  continues into the heads of the next shards in listing order not yet opened in
  this pass (never a shard another open handle is warming; if another reader opens
  one first, the next free one; a head whose warming handle was closed, such as the
  reader's previous shard's, is taken over). Bytes in flight stay one window per
  reader, across boundaries, so the reader does not stall there.
- How far it goes is decided at open from what the loader has shown
  (`_shard_warming`): a shard opened on a warmed head continues at once, through up
  to SHARD_WARM_TARGETS_MAX shards; one opened cold starts a pass with one shard,
  once `SHARD_WARM_FRACTION` is read; one opened cold while other heads here are
  warming (shuffled shards) warms nothing.
- A key with an open handle is never warmed: its reader reads it.
- No wrap-around past a directory's last shard, and warming never fails the READ
  that runs it (a shard dropped from the namespace since is passed over).
"""

from __future__ import annotations

import bisect
import fnmatch
import itertools

from bucketfs import errors
from bucketfs.core.namespace import Namespace, Node
from bucketfs.core.prefetch import Prefetcher, directory_of

# A shard opened cold warms the next one only once this much of it is read: a
# reader that far in is reading the shard through (a tar is read to its end), while
# one that looks at a shard's first samples costs no second shard. A shard opened on
# a warmed head does not wait: with shards under two windows long, waiting here left
# the connections idle at every boundary (one reader: 448-456 -> 476-507 MB/s, ad hoc).
SHARD_WARM_FRACTION = 0.25
# Shards shorter than the window: it continues through several of them (a 128 MiB
# window over 64 MB shards reaches into the second next one). Bounded per handle.
SHARD_WARM_TARGETS_MAX = 4


class ShardWarming:
    """The shard-warming policy of one mount. `Filesystem` calls `handle_opened` and
    `handle_released` for every file handle, and `shard_opened` for a shard read
    through a `HandleReader`, whose read-ahead window calls the `on_progress` it
    returns."""

    def __init__(self, config, namespace: Namespace, prefetcher: Prefetcher, stats) -> None:
        self.config = config
        self.key_prefix = config.url.prefix
        self._ns = namespace
        self._prefetcher = prefetcher
        self._stats = stats
        self._open_keys: dict = {}  # key -> number of open handles
        self._shard_pass: dict = {}  # parent ino -> set of shard names opened in this pass
        self._warmers: dict = {}  # shard key -> fh of the handle whose window warms its head

    def is_shard(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.config.shard_globs)

    # -- what Filesystem tells it -------------------------------------------------
    def shard_opened(self, node: Node, key: str, fh: int):
        """A shard opened as handle `fh` (before its reader takes a warmed head): its
        reader's on_progress(read_end, window_bytes), or None if it warms nothing."""
        self._note_shard_open(node)
        on_progress = self._shard_warming(node, key, fh)
        self._warmers.pop(key, None)  # its head, if warmed, is this handle's now
        return on_progress

    def handle_opened(self, key: str) -> None:
        """Any file handle opened on `key` (shard or not): while open, it is not warmed."""
        self._open_keys[key] = self._open_keys.get(key, 0) + 1

    def handle_released(self, key: str, fh: int, warmed: bool) -> None:
        """Handle `fh` on `key` closed; `warmed`: it had a reader, whose window may
        have warmed heads (they are orphaned: the next reader's window takes them over)."""
        if warmed:
            for warmed_key in [warmed_key for warmed_key, owner in self._warmers.items() if owner == fh]:
                del self._warmers[warmed_key]
        left = self._open_keys.get(key, 1) - 1
        if left:
            self._open_keys[key] = left
        else:
            self._open_keys.pop(key, None)

    # -- the policy ---------------------------------------------------------------
    def _note_shard_open(self, node: Node) -> None:
        opened = self._shard_pass.setdefault(node.parent_ino, set())
        if node.name in opened:
            opened.clear()  # a shard opened twice: a new pass (epoch) begins
        opened.add(node.name)

    def _shard_warming(self, node: Node, key: str, fh: int):
        """How this handle warms the shards after it (its on_progress), decided at open,
        before its reader takes a warmed head:
        - opened on a warmed head: the loader goes through the shards in listing order
          (this one was predicted), so the window runs on at once, through several;
        - opened cold while heads of other shards here are warming (a live guess:
          Prefetcher.warming_in): it does not (shards shuffled, say), so this handle
          warms nothing: the guesses already out are used when their shards come, and
          more would only hold memory;
        - opened cold with nothing warming (a pass begins): one shard, once this one is
          a quarter read.
        """
        if self._prefetcher.is_warming(key, node.version):
            return self._shard_progress(node, fh, 0, SHARD_WARM_TARGETS_MAX)
        if self._prefetcher.warming_in(directory_of(key)):
            self._stats["prefetch.warming_skipped"] += 1
            return None
        return self._shard_progress(node, fh, int(node.size_bytes * SHARD_WARM_FRACTION), 1)

    def _shard_progress(self, node: Node, fh: int, threshold_bytes: int, targets_max: int):
        later = self.shards_after(node)  # scanned only as far as the window reaches
        seen: list = []  # (key, node) of the shards after this one found so far, in listing order

        def on_progress(read_end: int, window_bytes: int) -> None:
            beyond_bytes = read_end + window_bytes - node.size_bytes
            if read_end < threshold_bytes or beyond_bytes <= 0:
                return
            # A shard opened in this pass (by another reader: its stream reads on from
            # this head, or has read it already) is not warmed again: the window
            # continues into the next free shard instead.
            opened = self._shard_pass.get(node.parent_ino, ())
            while seen and seen[0][1].name in opened:
                del seen[0]
            targets_count = i = 0
            while beyond_bytes > 0 and targets_count < targets_max:
                if i == len(seen):
                    found = next(later, None)
                    if found is None:
                        return
                    seen.append(found)
                key, shard = seen[i]
                i += 1
                if shard.name in opened or key in self._open_keys or self._warmed_by_another(key, shard.version, fh):
                    continue
                self._warmers[key] = fh
                self._prefetcher.warm_head(key, shard.version, shard.size_bytes, beyond_bytes, window_bytes)
                beyond_bytes -= shard.size_bytes
                targets_count += 1

        return on_progress

    def _warmed_by_another(self, key: str, version: str, fh: int) -> bool:
        """Another open handle's window warms this shard: each reader warms its own.
        A head whose warmer was closed is taken over (counted in this window), not
        skipped: a reader going through shards in order finds the next one warmed
        by its previous handle, and skipping it would put two windows in flight."""
        owner = self._warmers.get(key, fh)
        return owner != fh and self._prefetcher.is_warming(key, version)

    def shards_after(self, node: Node):
        """(key, node) of the shards after `node` in listing order, generated lazily; none
        past the last (no wrap-around: the next epoch's order is the loader's, often
        shuffled)."""
        listing = node.parent.listing
        if listing is None:
            return
        names = listing.names_sorted
        # From this shard's place on (names are sorted): a shard opening in a 20,000-entry
        # directory does not match every name against the globs.
        for name in itertools.islice(names, bisect.bisect_right(names, node.name), None):
            if self.is_shard(name):
                try:
                    nxt = self._ns.node(listing.children[name])
                except errors.NotFound:
                    # With --metadata-ttl, a shard of this (older) listing that was replaced
                    # or deleted since, and dropped: nothing to warm, and warming must
                    # never fail the READ that runs it (it did: ENOENT).
                    continue
                if not nxt.is_dir:
                    yield self.key_prefix + nxt.path, nxt
