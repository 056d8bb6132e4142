"""Namespace: inodes, directory listings from LIST pages, and the listing cache.

Invariants:
- A path component comes from a key split on '/'. Components that cannot be a
  file name ('' from `a//b`, '.', '..', over 255 bytes, NUL, not UTF-8) are left
  out with one warning per key; they never break the listing around them, and no
  key can make a path escape the mountpoint.
- A name that is both an object and a prefix (`a` and `a/b`) is a directory: the
  object is hidden, with one warning. Directories win because they hold more data
  and because a later object under the prefix would otherwise flip the type.
- Size, mtime and version come from the listing: lookup and getattr of a listed
  entry cost no request. Listings are cached for `metadata_ttl_s` (forever in the
  immutable default), so a name absent from a fresh listing is a cached negative.
- An inode is one version of an object: a file node's size, mtime and version
  never change. A re-listing that shows another version (or size) of a name gives
  it a new node and inode number, so the kernel never holds attributes of one
  version for a handle reading another (it once cut a new version at the old
  size), and its page cache for an inode is always that version's bytes. An open
  of a node that is no longer listed is ESTALE, which makes the kernel look the
  path up again and open the current one. Directories keep their inode.
- Inode numbers are never reused: the kernel may hold one at any time. With a TTL,
  a node that left the listing is dropped once the kernel holds no reference to
  it (its lookup count, which entry replies raise and FORGET lowers, is zero), so
  memory follows what is listed, not every object ever seen. Every entry of a live
  directory's current listing is a live node.
- Concurrent misses on one directory share one listing (single flight), even at a
  TTL of 0: a waiter takes the listing it waited for.
- With a TTL, a name missing from a listing older than `negative_ttl_s` is looked
  for in a new listing, so a short negative TTL works inside a longer metadata TTL.
- A directory dropped while its listing is in flight gets no listing (NotFound):
  children attached to an unreachable node could never be dropped.
- In the immutable default a directory is listed once, except after a read found
  one of its objects changed (ESTALE: replaced while mounted): then it is listed
  again in the background (relist_after_stale), at most once per
  STALE_RELIST_MIN_INTERVAL_S, so later opens find the new version. The replaced
  node stays (the kernel and open handles may hold it) but is no longer listed, and
  names whose node changed are reported through `on_vanished` as with a TTL.
- With a listing index (`bucketfs mount --index`), a directory's first listing comes
  from it (`_from_index`), never from a LIST, and counts as loaded when the namespace
  was made (the mount's start): forever in the immutable default, until the TTL with
  one. The index gives each directory once and forgets it; what it still holds is
  charged to the budget with the listings. A directory listed again (a TTL, a changed
  object) is listed from the store, as without an index.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import trio

from bucketfs import errors
from bucketfs.backends.base import ObjectInfo
from bucketfs.backends.slots import mark_speculative

log = logging.getLogger(__name__)

ROOT_INO = 1
# A parent with at least this many subdirectories, which are most of its entries,
# is a class tree: its walk is listed ahead from the first subdirectory on.
LIST_AHEAD_EAGER_DIRS = 8
NAME_MAX_BYTES = 255
# What one listed entry costs the daemon, as charged to the memory budget: its node,
# name, ETag, size, mtime and table slots (~413 B of Python objects, a unit test keeps
# it under 450) plus the allocator's share; measured as RSS growth per listed object
# through a real mount (scripts/listing_memory.py).
LISTED_ENTRY_BYTES = 560
# A directory re-listed because a read found one of its objects changed is not
# re-listed for that reason again within this time: a store that keeps answering
# "changed" (or an object rewritten non-stop) costs a LIST per second, not per read.
STALE_RELIST_MIN_INTERVAL_S = 1.0


class Node:
    # One per listed entry for the mount's lifetime, so every byte here is paid per
    # object (an ImageNet is 1.28M of them): files keep no path string of their own.
    __slots__ = (
        "ino",
        "name",
        "parent",
        "dir_path",
        "is_dir",
        "size_bytes",
        "mtime_ns",
        "version",
        "listing",
        "served",
        "lookups",
    )

    def __init__(self, ino, name, parent, is_dir, size_bytes=0, mtime_ns=0, version=""):
        self.ino = ino
        self.name = name
        self.parent = parent if parent is not None else self  # the root is its own parent
        self.is_dir = is_dir
        # Directories keep their key prefix (few, and every listing needs it).
        self.dir_path = (self.parent.dir_path + name + "/" if name else "") if is_dir else None
        self.size_bytes = size_bytes
        self.mtime_ns = mtime_ns
        self.version = version
        self.listing: Optional[Listing] = None
        # Its last byte was handed to the kernel: with keep_cache its pages are likely
        # still in the page cache, so an open need not fetch eagerly.
        self.served = False
        self.lookups = 0  # the kernel's references (counted with a TTL only): Namespace.forget

    @property
    def path(self) -> str:
        """Key relative to the mount prefix; directories end with '/'."""
        return self.dir_path if self.is_dir else self.parent.dir_path + self.name

    @property
    def parent_ino(self) -> int:
        return self.parent.ino

    def __repr__(self):
        return f"Node({self.ino}, {self.path!r}, dir={self.is_dir}, size={self.size_bytes}, v={self.version})"


class Listing:
    """The cached children of one directory."""

    __slots__ = (
        "children",
        "names_sorted",
        "loaded_at_s",
        "ahead_scheduled",
        "children_walked",
        "walk_counted",
        "dirs_count",
    )

    def __init__(self, children: dict, loaded_at_s: float, dirs_count: int = 0):
        self.children = children  # name -> ino
        self.dirs_count = dirs_count
        self.names_sorted = sorted(children)  # code point order == UTF-8 byte order == S3 order
        self.loaded_at_s = loaded_at_s
        self.ahead_scheduled = False
        self.children_walked = 0  # subdirectories a reader has listed (see _note_walk)
        self.walk_counted = False  # this directory was counted in its parent's children_walked


class _Loading:
    """A listing in flight: its waiters share `done`; `urgent` once a reader waits on it."""

    __slots__ = ("done", "urgent", "listing")

    def __init__(self, urgent: bool):
        self.done = trio.Event()
        self.urgent = urgent
        self.listing: Optional[Listing] = None  # the result, for waiters (it may already be stale at TTL 0)


def valid_component(name: str) -> bool:
    if name in ("", ".", "..") or "\x00" in name:
        return False
    try:
        return len(name.encode("utf-8")) <= NAME_MAX_BYTES
    except UnicodeEncodeError:  # lone surrogates: the key was not valid UTF-8
        return False


class Namespace:
    def __init__(
        self,
        backend,
        key_prefix: str,
        stats,
        metadata_ttl_s: float,
        list_ahead_count: int,
        mount_time_ns: int,
        budget,
        negative_ttl_s: float,
        listing_index=None,
    ):
        """The TTLs and `list_ahead_count` are the Config's (no defaults of its own).
        `listing_index`: a listing index (core/listing_index.py) the listings come from."""
        self.backend = backend
        self.budget = budget  # the MemoryBudget that listings are charged to, if any
        self.key_prefix = key_prefix
        self.stats = stats
        self.metadata_ttl_s = metadata_ttl_s
        # Only with a TTL: the immutable default never lists a directory twice.
        self.negative_ttl_s = negative_ttl_s if negative_ttl_s < metadata_ttl_s < math.inf else math.inf
        self.mount_time_ns = mount_time_ns
        # Indexed by inode number (dense from 1): a list costs 8 bytes per entry, a dict ~50.
        self._nodes: list = [None, Node(ROOT_INO, "", None, True, mtime_ns=mount_time_ns)]
        self._live_count = 1
        self._live_file_bytes = 0  # sizes of the live file nodes: what statfs (df) reports as used
        # With a TTL objects come and go, so nodes are dropped when both the listing and
        # the kernel have let go of them. In the immutable default nothing ever leaves a
        # listing: no counting on the hot paths.
        self.tracks_lookups = not math.isinf(metadata_ttl_s)
        # Called with (parent ino, name) for a vanished name the kernel still holds, so
        # the FUSE layer can ask the kernel to let go now, not at memory pressure.
        self.on_vanished = None
        self._loading: dict = {}  # ino -> _Loading: the listing in flight
        self._load_errors: dict = {}  # ino -> exception of the last failed listing (for its waiters)
        self._warned_keys: set = set()
        self._stale_relists_s: dict = {}  # directory ino -> when it was last re-listed after a changed object
        self._ahead_limiter = trio.CapacityLimiter(max(1, list_ahead_count))
        self.list_ahead_count = list_ahead_count
        self._nursery: Optional[trio.Nursery] = None
        # Listings from the index count as loaded now, when the mount starts.
        self._index = listing_index
        self._index_loaded_at_s = trio.current_time()
        if listing_index is not None:
            self._charge_listings()  # (what it holds, from the start)

    def start_background(self, nursery: trio.Nursery) -> None:
        """Give the namespace a nursery for listings started ahead of a walk."""
        self._nursery = nursery

    # -- lookups -------------------------------------------------------------
    def node(self, ino: int) -> Node:
        if 0 < ino < len(self._nodes):
            node = self._nodes[ino]
            if node is not None:
                return node
        raise errors.NotFound(f"inode {ino}")

    def is_live(self, node: Node) -> bool:
        return self._nodes[node.ino] is node

    @property
    def entries_count(self) -> int:
        return self._live_count

    @property
    def listed_file_bytes(self) -> int:
        return self._live_file_bytes

    async def lookup(self, parent_ino: int, name: str) -> Node:
        listing = await self.listing(parent_ino)
        ino = listing.children.get(name)
        if ino is None and self._older_than(listing, self.negative_ttl_s):
            listing = await self.listing(parent_ino, self.negative_ttl_s)  # the name may exist by now
            ino = listing.children.get(name)
        if ino is None:
            self.stats["namespace.negative_lookups"] += 1
            raise errors.NotFound(name)
        return self._nodes[ino]

    async def list_dir(self, ino: int) -> list:
        """Children of directory `ino` in stable (S3 key) order."""
        listing = await self.listing(ino)
        return [self._nodes[listing.children[n]] for n in listing.names_sorted]

    async def refresh_file(self, node: Node) -> Node:
        """In TTL mode, re-list the parent if stale, so an open pins the current version:
        a node that is no longer listed (changed or gone) is ESTALE, and the kernel
        then looks the path up again (LOOKUP_REVAL) and opens what is there now."""
        await self.listing(node.parent_ino)
        if not self._listed(node):
            raise errors.ObjectChanged(f"{node.path}: changed or gone since it was looked up")
        return node

    def is_current(self, node: Node) -> bool:
        """Whether `node` is what its directory's listing names now (not replaced by a
        re-listing since it was looked up)."""
        return node.ino == ROOT_INO or self._listed(node)

    def relist_after_stale(self, node: Node) -> None:
        """A read of `node` found its object changed: list its directory again in the
        background, so that the next open of the name pins the version there now (the
        open of the replaced node is ESTALE, and the kernel then looks the name up
        again). With a TTL, opens re-list stale directories anyway."""
        parent, now_s = node.parent, trio.current_time()
        if (
            self._nursery is None
            or not self.is_current(node)
            or parent.listing is None
            or parent.ino in self._loading
            or now_s - self._stale_relists_s.get(parent.ino, -math.inf) < STALE_RELIST_MIN_INTERVAL_S
        ):
            return
        self._stale_relists_s[parent.ino] = now_s
        self.stats["namespace.stale_relists"] += 1
        self._nursery.start_soon(self._relist, parent)

    async def _relist(self, node: Node) -> None:
        if node.ino in self._loading or not self.is_live(node):
            return  # state re-check: a listing started (or the directory went) while this task was queued
        try:
            await self._load(node, demanded=False)
        except errors.BucketfsError as exc:
            log.warning("listing %r again after a changed object failed: %s", node.path, exc)

    async def listing(self, ino: int, max_age_s: Optional[float] = None) -> Listing:
        """The directory's listing, loaded again if older than the metadata TTL (or `max_age_s`)."""
        node = self.node(ino)
        if not node.is_dir:
            raise errors.BucketfsError(f"{node.path} is not a directory")
        max_age_s = self.metadata_ttl_s if max_age_s is None else max_age_s
        while True:
            listing = node.listing
            if listing is not None and not self._older_than(listing, max_age_s):
                self.stats["namespace.listing_hits"] += 1
                self._note_walk(node, listing)
                return listing
            loading = self._loading.get(ino)
            if loading is None:
                return await self._load(node)
            loading.urgent = True  # a listing ahead of the walk that a reader now needs
            await loading.done.wait()  # another task lists this directory: share its result
            # state re-check: the shared listing may have failed or been replaced
            if ino in self._load_errors:
                raise self._load_errors[ino]
            shared = loading.listing
            if shared is not None and node.listing is loading.listing:
                return shared  # fresh when this call began waiting, whatever the TTL

    @staticmethod
    def _older_than(listing: Listing, max_age_s: float) -> bool:
        return not math.isinf(max_age_s) and trio.current_time() - listing.loaded_at_s > max_age_s

    # -- loading -------------------------------------------------------------
    async def _load(self, node: Node, demanded: bool = True) -> Listing:
        """List `node` (all pages) and publish the result; `demanded` if a reader waits.
        A directory the index holds (still fresh) is taken from it instead: no LIST."""
        listing = self._from_index(node)
        if listing is not None:
            if demanded:
                self._note_walk(node, listing)
            return listing
        loading = self._loading[node.ino] = _Loading(demanded)
        if not demanded:
            mark_speculative(loading)  # this task's LISTs wait behind reads until a reader needs them
        self._load_errors.pop(node.ino, None)
        try:
            objects, prefixes = await self._fetch_all_pages(self.key_prefix + node.path)
            # state re-check: a re-listing of the parent may have dropped this directory
            if not self.is_live(node):
                raise errors.NotFound(f"{node.path}: gone while it was listed")
            listing = self._build(node, objects, prefixes)
            node.listing = listing
            loading.listing = listing
            self._charge_listings()
            if demanded:
                self._note_walk(node, listing)
            return listing
        except BaseException as exc:
            self._load_errors[node.ino] = (
                exc if isinstance(exc, errors.BucketfsError) else errors.BackendError(str(exc))
            )
            raise
        finally:
            del self._loading[node.ino]
            loading.done.set()

    def _from_index(self, node: Node) -> Optional[Listing]:
        """`node`'s listing from the index, published, if the index holds it and (with a
        TTL) it is not older than the TTL; the index forgets it either way. No await:
        no other task sees the directory half built."""
        index = self._index
        if index is None or not index.has(node.path):
            return None
        taken = index.take(node.path)
        if taken is None or self._older_than_index():
            self._charge_listings()  # (what the index held for it is freed)
            return None
        objects, subdirectories = taken
        prefix = self.key_prefix + node.path
        listing = self._build(
            node,
            [ObjectInfo(prefix + name, size, mtime_ns, version) for name, size, mtime_ns, version in objects],
            [prefix + name + "/" for name in subdirectories],
        )
        listing.loaded_at_s = self._index_loaded_at_s
        node.listing = listing
        self.stats["namespace.index_listings"] += 1
        self._charge_listings()
        return listing

    def _older_than_index(self) -> bool:
        """The index's listings are older than the metadata TTL (never in the immutable default)."""
        return not math.isinf(self.metadata_ttl_s) and (
            trio.current_time() - self._index_loaded_at_s > self.metadata_ttl_s
        )

    async def _fetch_all_pages(self, prefix: str):
        objects, prefixes, token = [], [], None
        while True:
            page = await self.backend.list_page(prefix, token)
            self.stats["namespace.list_pages"] += 1
            objects.extend(page.objects)
            prefixes.extend(page.prefixes)
            token = page.next_token
            if not token:
                return objects, prefixes

    def _warn_once(self, key: str, why: str) -> None:
        if key not in self._warned_keys:
            self._warned_keys.add(key)
            self.stats["namespace.skipped_keys"] += 1
            log.warning("skipping key %r: %s", key, why)

    def _build(self, node: Node, objects, prefixes) -> Listing:
        prefix = self.key_prefix + node.path
        old = node.listing.children if node.listing is not None else {}
        children: dict = {}
        for common in prefixes:
            name = common[len(prefix) : -1]
            if not valid_component(name):
                self._warn_once(common, "not a valid directory name")
                continue
            if name in children:
                continue  # repeated on a later page by some servers: a second node would be unreachable
            children[name] = self._child(node, old.get(name), name, True, None)
        for info in objects:
            name = info.key[len(prefix) :]
            if name == "":  # the directory's own marker object (`dir/`)
                if info.size_bytes:
                    self._warn_once(info.key, f"a directory marker holding {info.size_bytes} bytes: not shown")
                continue
            if not valid_component(name):
                self._warn_once(info.key, "not a valid file name")
                continue
            if name in children:
                if children[name].is_dir:
                    self._warn_once(info.key, "a prefix of the same name exists; the directory wins")
                continue  # (a key repeated across pages: the first is kept)
            children[name] = self._child(node, old.get(name), name, False, info)
        if self.tracks_lookups and old:
            self._drop_vanished(node, old, children)
        elif old and self.on_vanished is not None:  # the immutable default, re-listed after a changed object
            for name, ino in old.items():
                kept = children.get(name)
                if kept is None or kept.ino != ino:
                    self.on_vanished(node.ino, name)
        dirs_count = sum(1 for child in children.values() if child.is_dir)
        return Listing({name: child.ino for name, child in children.items()}, trio.current_time(), dirs_count)

    def _child(self, parent: Node, old_ino: Optional[int], name: str, is_dir: bool, info) -> Node:
        """The node for a listed entry (`info`: the object's ObjectInfo; None for a directory)."""
        if old_ino is not None:
            existing = self._nodes[old_ino]
            if (
                existing is not None
                and existing.is_dir == is_dir
                and (is_dir or (existing.version, existing.size_bytes) == (info.version, info.size_bytes))
            ):
                return existing  # the same directory, or the same version: keep the inode the kernel knows
        ino = len(self._nodes)
        if is_dir:
            child = Node(ino, name, parent, True, mtime_ns=self.mount_time_ns)
        else:
            child = Node(ino, name, parent, False, info.size_bytes, info.mtime_ns, info.version)
            self._live_file_bytes += info.size_bytes
        self._nodes.append(child)
        self._live_count += 1
        return child

    # -- the kernel's references (with a TTL) ----------------------------------
    def note_lookup(self, node: Node) -> None:
        """The kernel was handed `node` in an entry reply (lookup, or an entry of
        READDIRPLUS): it holds one more reference until a FORGET returns it."""
        node.lookups += 1

    def forget(self, ino: int, count: int) -> None:
        """The kernel dropped `count` references to `ino`. A node left with none, and
        no longer in its directory's listing, is gone for good: drop it."""
        if not 0 < ino < len(self._nodes) or ino == ROOT_INO:
            return
        node = self._nodes[ino]
        if node is None:
            return
        node.lookups = max(0, node.lookups - count)  # never below zero, whatever the kernel sends
        if node.lookups == 0 and not self._listed(node):
            self._drop(node)

    def current(self, node: Node) -> Optional[Node]:
        """The node now listed under `node`'s name (itself, a newer version, or None if
        the name is gone): what a directory handle's snapshot entry stands for now."""
        listing = node.parent.listing  # None once the parent was dropped
        if listing is None:
            return None
        ino = listing.children.get(node.name)
        return None if ino is None else self._nodes[ino]

    def _listed(self, node: Node) -> bool:
        return self.current(node) is node

    def _drop_vanished(self, parent: Node, old: dict, children: dict) -> None:
        """After a re-listing: drop the nodes that left it and that the kernel holds no
        reference to (no FORGET will come for them). The others wait for theirs."""
        for name, ino in old.items():
            kept = children.get(name)
            gone = self._nodes[ino]
            if (kept is not None and kept.ino == ino) or gone is None:
                continue
            if gone.lookups == 0:
                self._drop(gone)
            elif self.on_vanished is not None:
                self.on_vanished(parent.ino, name)

    def _drop(self, node: Node) -> None:
        """Free `node`'s inode slot; a directory takes with it every entry of its listing
        the kernel holds no reference to (the rest follow at their FORGET)."""
        stack = [node]
        while stack:
            node = stack.pop()
            self._nodes[node.ino] = None  # the number is not reused: 8 bytes stay
            self._live_count -= 1
            if not node.is_dir:
                self._live_file_bytes -= node.size_bytes
            self.stats["namespace.nodes_dropped"] += 1
            listing, node.listing = node.listing, None
            if listing is not None:
                for ino in listing.children.values():
                    child = self._nodes[ino]
                    if child is not None and child.parent is node and child.lookups == 0:
                        stack.append(child)
        self._charge_listings()

    def _charge_listings(self) -> None:
        if self.budget is not None:
            held_bytes = self._index.held_bytes if self._index is not None else 0  # (directories not listed yet)
            self.budget.charge_listings(self._live_count * LISTED_ENTRY_BYTES + held_bytes)

    # -- listing ahead of a walk ---------------------------------------------
    def _note_walk(self, node: Node, listing: Listing) -> None:
        """A reader listed `node`: once it has listed two subdirectories of one parent,
        it is walking them (ImageFolder lists every class right after the root), so
        list the rest of that parent's subdirectories ahead of it. A parent made mostly
        of many subdirectories (classes) starts at the first one: one round trip sooner.

        Waiting for the second sibling elsewhere keeps a reader that only opens
        `shards/` from pre-listing its few neighbours (a 20,000-entry directory costs
        20 LIST pages).
        """
        if node.ino == ROOT_INO or listing.walk_counted:
            return
        listing.walk_counted = True  # count each directory once, however often it is walked
        parent = node.parent.listing
        if parent is None:
            return
        parent.children_walked += 1
        class_like = parent.dirs_count >= LIST_AHEAD_EAGER_DIRS and 2 * parent.dirs_count >= len(parent.children)
        if parent.children_walked >= 2 or class_like:
            self._schedule_ahead(node.parent, parent)

    def _schedule_ahead(self, node: Node, listing: Listing) -> None:
        """List the subdirectories of `node` concurrently, one level ahead of the walker."""
        if listing.ahead_scheduled or self._nursery is None or self.list_ahead_count <= 0:
            return
        listing.ahead_scheduled = True
        for name in listing.names_sorted:
            child = self._nodes[listing.children[name]]
            if child.is_dir and child.listing is None and child.ino not in self._loading:
                self._nursery.start_soon(self._list_ahead, child)

    async def _list_ahead(self, node: Node) -> None:
        async with self._ahead_limiter:
            if node.listing is not None or node.ino in self._loading:
                return  # state re-check: a reader got there while we queued
            try:
                await self._load(node, demanded=False)
                self.stats["namespace.listed_ahead"] += 1
            except errors.BucketfsError as exc:
                log.debug("listing ahead of %r failed: %s", node.path, exc)
