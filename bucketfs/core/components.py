"""Building the core: the one place where a mount's components are made and wired.

`build_components` makes, from `Config`, everything `Filesystem` orchestrates: the
counters, the memory budget, the disk cache in front of the backend (with
--cache-dir), the namespace, the block cache, the prefetcher, the shard-warming
policy and fetch-ahead. `Filesystem.__init__` calls it, so the mount
(bucketfs/app/mount.py) and the unit tests build a filesystem the same way.

Invariants:
- Nothing else in bucketfs constructs these components for a mount.
- One `Stats` and one `MemoryBudget` are shared by every component: the budget
  covers all the memory that grows with the data (docs/design.md).
- With a disk cache, it wraps the backend before any other component is given the
  backend: every read goes through it.
- The namespace's background work (list-ahead) is started here, in `nursery`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import trio

from bucketfs.core.blockcache import BlockCache
from bucketfs.core.fetchahead import FetchAhead
from bucketfs.core.memory import MemoryBudget
from bucketfs.core.namespace import Namespace
from bucketfs.core.prefetch import Prefetcher
from bucketfs.core.shards import ShardWarming
from bucketfs.core.stats import Stats
from bucketfs.diskcache.cache import DiskCache


@dataclasses.dataclass(frozen=True)
class Components:
    """What a `Filesystem` is made of. `backend` is what the components read
    through: `disk_cache` when there is one, else the backend given."""

    stats: Stats
    budget: MemoryBudget
    backend: Any  # a Backend, or the DiskCache that forwards to one
    disk_cache: Optional[DiskCache]
    namespace: Namespace
    cache: BlockCache
    prefetcher: Prefetcher
    shards: ShardWarming
    fetch_ahead: FetchAhead


def build_components(
    backend,
    config,
    nursery: trio.Nursery,
    disk_cache_dir: Optional[str] = None,
    disk_cache_dir_fd: Optional[int] = None,
    listing_index=None,
    disk_cache_alone: bool = True,
) -> Components:
    """The components of a filesystem on `backend`, sized by `config`, their background
    tasks in `nursery`. `disk_cache_dir`: a directory of this mount's own for the local
    disk cache, if any; `disk_cache_dir_fd`: the locked descriptor of it the mount holds
    (without one, the cache opens the path itself), and `disk_cache_alone` whether no
    other mount shared it when it was claimed; `listing_index`: the listing index
    (core/listing_index.py) the namespace's listings come from (--index)."""
    stats = Stats()
    budget = MemoryBudget(config.max_memory_bytes, stats)
    disk_cache = None
    if disk_cache_dir is not None:
        backend = disk_cache = DiskCache(
            backend,
            disk_cache_dir,
            config.cache_size_bytes,
            config.block_size_bytes,
            stats,
            nursery,
            budget,
            dir_fd=disk_cache_dir_fd,
            alone=disk_cache_alone,
        )
    namespace = Namespace(
        backend,
        config.url.prefix,
        stats,
        config.metadata_ttl_s,
        config.list_ahead_count,
        time.time_ns(),
        budget,
        config.negative_ttl_s,
        listing_index,
    )
    namespace.start_background(nursery)
    cache = BlockCache(backend, budget, stats, config.block_size_bytes, nursery)
    prefetcher = Prefetcher(backend, budget, stats, nursery, config.part_size_bytes)
    shards = ShardWarming(config, namespace, prefetcher, stats)
    fetch_ahead = FetchAhead(config, namespace, cache, disk_cache, budget, stats, nursery)
    return Components(stats, budget, backend, disk_cache, namespace, cache, prefetcher, shards, fetch_ahead)
