"""Prometheus metrics and the `bucketfs stats` summary, both read from the core's counters.

The core's counters live on the trio thread; the HTTP server runs in its own thread
and takes each snapshot on the trio thread (trio.from_thread), so it never reads a
dict while the core changes it.
"""

from __future__ import annotations

import json
import logging

import trio
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)

# `bucketfs stats` reads the counters from this file at the mount's root. It is not
# listed, so no loader, find or rsync sees it (ImageFolder would take a listed
# directory for a class), and an object of that name in the bucket wins. A file, not
# an extended attribute: a file system without getxattr tells the kernel so once, and
# `ls -l` of 20,000 files made 40,000 getxattr round trips (3.4 s) when it had one.
STATS_FILE_NAME = ".bucketfs-stats"

# (snapshot key, metric name, help, kind); keys ending in a label go through _labelled().
_SIMPLE = [
    ("backend.bytes_fetched", "bucketfs_backend_fetched_bytes", "Payload bytes fetched from the store", "counter"),
    (
        "backend.redirects",
        "bucketfs_backend_redirects",
        "Redirects followed (an AIStore gateway sending a GET to the target that holds the object)",
        "counter",
    ),
    (
        "backend.fetch_workers",
        "bucketfs_fetch_workers",
        "Fetch worker processes running (--fetch-workers)",
        "gauge",
    ),
    (
        "backend.fetch_worker_restarts",
        "bucketfs_fetch_worker_restarts",
        "Fetch workers replaced after they ended (died, or killed when silent past a GET's deadline)",
        "counter",
    ),
    (
        "backend.corrupt_bodies",
        "bucketfs_backend_corrupt_bodies",
        "Whole-object GETs whose bytes did not match the store's checksum (fetched again)",
        "counter",
    ),
    (
        "backend.calls_queued",
        "bucketfs_backend_queued_requests",
        "Requests that waited for a free connection (--max-connections)",
        "counter",
    ),
    (
        "backend.urgent_overtakes",
        "bucketfs_backend_urgent_overtakes",
        "Free connections given to a request a reader waits on ahead of older read-ahead",
        "counter",
    ),
    ("cache.hits", "bucketfs_cache_hits", "Block cache hits", "counter"),
    (
        "cache.misses",
        "bucketfs_cache_misses",
        "Blocks not in the block cache and fetched (one GET per run of consecutive blocks)",
        "counter",
    ),
    (
        "cache.shared_misses",
        "bucketfs_cache_shared_misses",
        "Blocks not in the block cache that joined a GET already in flight (not in bucketfs_cache_misses)",
        "counter",
    ),
    ("cache.evictions", "bucketfs_cache_evictions", "Blocks evicted from the cache", "counter"),
    ("cache.bytes", "bucketfs_cache_bytes", "Bytes held by the block cache", "gauge"),
    ("prefetch.fetched_bytes", "bucketfs_prefetch_fetched_bytes", "Bytes fetched by sequential read-ahead", "counter"),
    ("prefetch.bytes_used", "bucketfs_prefetch_used_bytes", "Read-ahead bytes that readers consumed", "counter"),
    ("prefetch.bytes_wasted", "bucketfs_prefetch_wasted_bytes", "Read-ahead bytes dropped unread", "counter"),
    ("prefetch.heads_warmed", "bucketfs_prefetch_shard_heads_warmed", "Next-shard heads warmed", "counter"),
    ("prefetch.heads_used", "bucketfs_prefetch_shard_heads_used", "Warmed shard heads that an open used", "counter"),
    (
        "prefetch.warming_skipped",
        "bucketfs_prefetch_shard_warming_skipped",
        "Shards opened out of listing order (shuffled): nothing warmed after them",
        "counter",
    ),
    ("fetch_ahead.passes", "bucketfs_fetch_ahead_passes", "Shuffled passes over a tree fetched ahead", "counter"),
    ("fetch_ahead.files", "bucketfs_fetch_ahead_files", "Files fetched ahead of a shuffled pass", "counter"),
    ("fetch_ahead.bytes", "bucketfs_fetch_ahead_bytes", "Bytes fetched ahead of a shuffled pass", "counter"),
    ("fetch_ahead.used_files", "bucketfs_fetch_ahead_used_files", "Files fetched ahead that were opened", "counter"),
    ("fetch_ahead.used_bytes", "bucketfs_fetch_ahead_used_bytes", "Bytes fetched ahead that were opened", "counter"),
    (
        "fetch_ahead.unused_files",
        "bucketfs_fetch_ahead_unused_files",
        "Files fetched ahead and let go unopened (their pass ended): evictable from then on",
        "counter",
    ),
    (
        "fetch_ahead.unused_bytes",
        "bucketfs_fetch_ahead_unused_bytes",
        "Bytes fetched ahead and let go unopened (their pass ended)",
        "counter",
    ),
    ("fetch_ahead.failed", "bucketfs_fetch_ahead_failed", "Fetch-ahead GETs that failed after retries", "counter"),
    (
        "fetch_ahead.push_pushed",
        "bucketfs_fetch_ahead_pushed_files",
        "Files fetch-ahead workers wrote into the kernel's page cache (--fetch-ahead-workers)",
        "counter",
    ),
    (
        "backend.fetch_ahead_workers",
        "bucketfs_fetch_ahead_workers",
        "Fetch-ahead worker processes running (--fetch-ahead-workers; started at a pass's first push)",
        "gauge",
    ),
    (
        "backend.fetch_ahead_worker_restarts",
        "bucketfs_fetch_ahead_worker_restarts",
        "Fetch-ahead workers replaced after they ended",
        "counter",
    ),
    (
        "read.kernel_dropped_gets",
        "bucketfs_kernel_dropped_gets",
        "GETs of files the kernel had been given whole and dropped before they were read again",
        "counter",
    ),
    (
        "fetch_ahead.partial_passes_skipped",
        "bucketfs_fetch_ahead_partial_passes_skipped",
        "Shuffled passes not fetched ahead: their tree is read in part per epoch (one node's share)",
        "counter",
    ),
    (
        "fetch_ahead.disk_waits",
        "bucketfs_fetch_ahead_disk_waits",
        "Times fetch-ahead waited for the disk cache's queue of writes (--cache-dir)",
        "counter",
    ),
    (
        "fetch_ahead.dropped_read_bytes",
        "bucketfs_fetch_ahead_dropped_read_bytes",
        "Cached bytes of files a pass had read, dropped to make room for fetch-ahead",
        "counter",
    ),
    (
        "fetch_ahead.held_bytes",
        "bucketfs_fetch_ahead_held_bytes",
        "Bytes fetched ahead and held until their file is opened",
        "gauge",
    ),
    (
        "fetch_ahead.window_bytes",
        "bucketfs_fetch_ahead_window_bytes",
        "How far the latest pass may push ahead of its loader (--fetch-ahead-window)",
        "gauge",
    ),
    (
        "fetch_ahead.kept_bytes",
        "bucketfs_fetch_ahead_kept_bytes",
        "Bytes of pushed files the daemon keeps a copy of (the workers' shared memory), within the budget",
        "gauge",
    ),
    (
        "fetch_ahead.kept_read",
        "bucketfs_fetch_ahead_kept_read_files",
        "Files read from the daemon's copy of a pushed file (the kernel had dropped its pages)",
        "counter",
    ),
    ("read.calls", "bucketfs_reads", "FUSE READ requests served", "counter"),
    ("read.bytes", "bucketfs_read_bytes", "Bytes returned to readers", "counter"),
    (
        "read.wait_seconds",
        "bucketfs_read_wait_seconds",
        "Time readers spent waiting inside READ (network and queueing)",
        "counter",
    ),
    (
        "memory.used_bytes",
        "bucketfs_memory_used_bytes",
        "Bytes of cache and read-ahead buffers reserved in the memory budget",
        "gauge",
    ),
    (
        "memory.listings_bytes",
        "bucketfs_memory_listings_bytes",
        "Bytes of the memory budget charged to listings",
        "gauge",
    ),
    (
        "memory.disk_index_bytes",
        "bucketfs_memory_disk_index_bytes",
        "Bytes of the memory budget charged to the disk cache's index",
        "gauge",
    ),
    ("memory.budget_bytes", "bucketfs_memory_budget_bytes", "The memory budget (--max-memory)", "gauge"),
    ("memory.peak_bytes", "bucketfs_memory_peak_bytes", "Highest buffer reservation seen", "gauge"),
    (
        "disk_cache.hits",
        "bucketfs_disk_cache_hits",
        "Reads answered from the local disk cache (--cache-dir)",
        "counter",
    ),
    (
        "disk_cache.loop_reads",
        "bucketfs_disk_cache_loop_reads",
        "Disk cache hits read on the event loop (their file was in the page cache)",
        "counter",
    ),
    ("disk_cache.misses", "bucketfs_disk_cache_misses", "Reads the local disk cache could not answer", "counter"),
    ("disk_cache.read_bytes", "bucketfs_disk_cache_read_bytes", "Bytes read from the local disk cache", "counter"),
    (
        "disk_cache.written_bytes",
        "bucketfs_disk_cache_written_bytes",
        "Bytes written to the local disk cache",
        "counter",
    ),
    ("disk_cache.stored_bytes", "bucketfs_disk_cache_stored_bytes", "Bytes held by the local disk cache", "gauge"),
    (
        "disk_cache.loaded_bytes",
        "bucketfs_disk_cache_loaded_bytes",
        "Bytes of the local disk cache found at start, kept by earlier mounts",
        "gauge",
    ),
    (
        "disk_cache.read_ahead_bytes",
        "bucketfs_disk_cache_read_ahead_bytes",
        "Bytes of the local disk cache the kernel was asked at start to read into the page cache",
        "gauge",
    ),
    (
        "disk_cache.bad_reads",
        "bucketfs_disk_cache_bad_reads",
        "Disk cache reads that failed or did not match their checksum (read from the store instead)",
        "counter",
    ),
    ("disk_cache.write_errors", "bucketfs_disk_cache_write_errors", "Failed writes to the local disk cache", "counter"),
    (
        "disk_cache.skipped_bytes",
        "bucketfs_disk_cache_skipped_bytes",
        "Fetched bytes not stored: too many writes pending (a slow disk), no memory in the budget to hold them, or the journal being rewritten",
        "counter",
    ),
    (
        "disk_cache.skipped_stores",
        "bucketfs_disk_cache_skipped_stores",
        "Fetches not stored in the local disk cache (their bytes are in bucketfs_disk_cache_skipped_bytes)",
        "counter",
    ),
    ("disk_cache.evictions", "bucketfs_disk_cache_evictions", "Objects deleted from the local disk cache", "counter"),
    (
        "disk_cache.records_from_other_mounts",
        "bucketfs_disk_cache_records_from_other_mounts",
        "Journal records of the other mounts sharing the disk cache directory taken in (what they stored and evicted)",
        "counter",
    ),
    ("namespace.entries", "bucketfs_listing_cache_entries", "Inodes known from listings", "gauge"),
    (
        "namespace.nodes_dropped",
        "bucketfs_listing_entries_dropped",
        "Inodes dropped after their object left the listing (--metadata-ttl)",
        "counter",
    ),
    ("namespace.list_pages", "bucketfs_list_pages", "LIST pages fetched", "counter"),
    (
        "namespace.kernel_dir_cache_off",
        "bucketfs_kernel_dir_cache_off",
        "1 if the kernel does not keep directory listings in the immutable default (--kernel-dir-cache off, "
        "a pyfuse3 or libfuse version outside the tested ones, or pyfuse3's request layout not as expected)",
        "gauge",
    ),
    (
        "namespace.kernel_opens_dirs",
        "bucketfs_kernel_opens_dirs",
        "1 if the kernel opens directories itself (no OPENDIR or RELEASEDIR round trips; the immutable default)",
        "gauge",
    ),
    (
        "namespace.kernel_opens_files",
        "bucketfs_kernel_opens_files",
        "1 if the kernel opens files itself (no OPEN or RELEASE round trips, READs by inode; the immutable default)",
        "gauge",
    ),
    (
        "fuse.max_read_bytes",
        "bucketfs_fuse_max_read_bytes",
        "The largest READ the kernel sends this mount: 4 MiB where libfuse's session was found and "
        "fs.fuse.max_pages_limit allows it (absent: libfuse's 1 MiB)",
        "gauge",
    ),
    (
        "fuse_loop.active",
        "bucketfs_fuse_request_loop",
        "1 if bucketfs's request loop serves the mount (a request read as soon as the last is served; "
        "absent: pyfuse3's loop)",
        "gauge",
    ),
    (
        "fuse_loop.requests_read_at_once",
        "bucketfs_fuse_requests_read_at_once",
        "FUSE requests read with no wait before them (queued while the one before was served)",
        "counter",
    ),
    (
        "open.held",
        "bucketfs_opens_held",
        "Opens of small files whose first read waited in the daemon (Python's isatty() IOCTL held) while a "
        "fetch-ahead worker pushed the file into the page cache",
        "counter",
    ),
    (
        "open.pushed_pushed",
        "bucketfs_opens_pushed",
        "Files pushed into the page cache while their open was held (the rest are read through the daemon)",
        "counter",
    ),
    (
        "open.held_expired",
        "bucketfs_opens_held_expired",
        "Held opens let go after 5 s with their push still running (its READ then waits for it)",
        "counter",
    ),
    (
        "process.serving_thread_cpu_s",
        "bucketfs_serving_thread_cpu_seconds",
        "CPU seconds of the thread that serves every FUSE request: near 1 per second, the mount's ceiling",
        "counter",
    ),
    (
        "handles.open",
        "bucketfs_open_files",
        "Open file handles (with the kernel opening files: those read in part)",
        "gauge",
    ),
]


class _Collector:
    def __init__(self, snapshot):
        self._snapshot = snapshot

    def collect(self):
        snap = self._snapshot()
        for key, name, help_text, kind in _SIMPLE:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_text, value=snap.get(key, 0))
        # Every request sent, by type; those that failed after their retries are in
        # bucketfs_backend_failures (a result label here could only ever say "ok").
        yield _by_label(
            snap, "backend.requests.", "bucketfs_backend_requests", "Requests sent to the store by type", "type"
        )
        yield _by_label(
            snap,
            "backend.get_path.",
            "bucketfs_backend_gets",
            "GETs by the way they went (curl for small ones, threads for read-ahead parts)",
            "path",
        )
        yield _by_label(
            snap,
            "backend.failures.",
            "bucketfs_backend_failures",
            "Failed store requests (after retries) by error",
            "error",
        )
        yield CounterMetricFamily(
            "bucketfs_backend_retries",
            "Retried store requests (throttling, 5xx, resets)",
            value=snap.get("backend.retries", 0),
        )
        yield _by_label(snap, "fuse.", "bucketfs_fuse_requests", "Requests from the kernel by FUSE operation", "op")
        yield _by_label(snap, "errors.", "bucketfs_errors", "Errors returned to the kernel by errno", "errno")


def _by_label(snap: dict, prefix: str, name: str, help_text: str, label: str) -> CounterMetricFamily:
    """One counter family from the snapshot's keys `prefix` + label value."""
    family = CounterMetricFamily(name, help_text, labels=[label])
    for label_value, value in _under(snap, prefix).items():
        family.add_metric([label_value], value)
    return family


def _under(snap: dict, prefix: str) -> dict:
    """{rest of the key: value} of the snapshot's keys that start with `prefix`."""
    return {key[len(prefix) :]: value for key, value in snap.items() if key.startswith(prefix)}


def start_metrics_server(address: str, port: int, snapshot_on_trio_thread) -> None:
    """Serve /metrics on `address`:`port` from a daemon thread."""
    token = trio.lowlevel.current_trio_token()

    def snapshot():
        return trio.from_thread.run_sync(snapshot_on_trio_thread, trio_token=token)

    registry = CollectorRegistry()
    registry.register(_Collector(snapshot))
    start_http_server(port, addr=address, registry=registry)
    log.info("metrics on http://%s:%d/metrics", f"[{address}]" if ":" in address else address, port)


def encode_stats(snapshot: dict) -> bytes:
    return (json.dumps(snapshot, sort_keys=True) + "\n").encode()


def decode_stats(raw: bytes) -> dict:
    """The counters a read of the stats file gave (one JSON object); ValueError if it
    is not one."""
    snapshot = json.loads(raw)
    if not isinstance(snapshot, dict):
        raise ValueError("not a stats snapshot")
    return snapshot


def format_stats(snapshot: dict) -> str:
    """A human summary for `bucketfs stats`."""
    mib = 1024 * 1024
    get = snapshot.get
    reqs, failures = _under(snapshot, "backend.requests."), _under(snapshot, "backend.failures.")
    get_paths = _under(snapshot, "backend.get_path.")
    # Counted in blocks, not requests: one GET fetches a run of missing blocks. Misses
    # are bucketfs_cache_misses; blocks that waited on a GET already started are apart.
    hits, misses, joined = get("cache.hits", 0), get("cache.misses", 0), get("cache.shared_misses", 0)
    lookups = hits + misses + joined
    used, wasted = get("prefetch.bytes_used", 0), get("prefetch.bytes_wasted", 0)
    lines = [
        f"requests      {', '.join(f'{k} {v}' for k, v in sorted(reqs.items())) or 'none'}"
        + (f" (GETs on {', '.join(f'{k} {v}' for k, v in sorted(get_paths.items()))})" if get_paths else "")
        + (f"; {redirects} redirects followed" if (redirects := get("backend.redirects", 0)) else "")
        + (
            f"; {workers} fetch workers ({get('backend.fetch_worker_restarts', 0)} replaced)"
            if (workers := get("backend.fetch_workers", 0)) or get("backend.fetch_worker_restarts", 0)
            else ""
        ),
        f"store         retries {get('backend.retries', 0)}"
        + (
            f" ({corrupt} for bytes not matching the store's checksum)"
            if (corrupt := get("backend.corrupt_bodies", 0))
            else ""
        )
        + "; failed after retries: "
        f"{', '.join(f'{k} {v}' for k, v in sorted(failures.items())) or 'none'}",
        f"fetched       {get('backend.bytes_fetched', 0) / mib:.1f} MiB; served to readers {get('read.bytes', 0) / mib:.1f} MiB in {get('read.calls', 0)} reads",
        f"block cache   {get('cache.bytes', 0) / mib:.1f} MiB; blocks: {hits} hits, {misses} misses (fetched, one GET "
        f"per run of them), {joined} joined a fetch in flight"
        + (f" ({100 * hits / lookups:.0f}% hit)" if lookups else "")
        + f"; evictions {get('cache.evictions', 0)}",
        f"read-ahead    {get('prefetch.fetched_bytes', 0) / mib:.1f} MiB fetched, {used / mib:.1f} MiB used, {wasted / mib:.1f} MiB wasted; "
        f"shard heads warmed {get('prefetch.heads_warmed', 0)}, used {get('prefetch.heads_used', 0)}; "
        f"{get('prefetch.warming_skipped', 0)} shards opened out of order",
        f"fetch-ahead   {get('fetch_ahead.passes', 0)} shuffled passes; {get('fetch_ahead.files', 0)} files "
        f"({get('fetch_ahead.bytes', 0) / mib:.1f} MiB) fetched ahead, {get('fetch_ahead.used_files', 0)} opened, "
        f"{get('fetch_ahead.unused_files', 0)} let go unopened, {get('fetch_ahead.failed', 0)} failed; "
        f"{get('fetch_ahead.held_bytes', 0) / mib:.1f} MiB held; pushes within "
        f"{get('fetch_ahead.window_bytes', 0) / mib:.1f} MiB ahead; copies of pushed files kept "
        f"{get('fetch_ahead.kept_bytes', 0) / mib:.1f} MiB, read {get('fetch_ahead.kept_read', 0)}",
        f"connections   {get('backend.calls_queued', 0)} requests waited for a free one; {get('backend.urgent_overtakes', 0)} went ahead of read-ahead",
        f"memory        {get('memory.used_bytes', 0) / mib:.1f} MiB of buffers (peak {get('memory.peak_bytes', 0) / mib:.1f} MiB) "
        f"and {get('memory.listings_bytes', 0) / mib:.1f} MiB of listings"
        + (
            f", {get('memory.disk_index_bytes', 0) / mib:.1f} MiB of disk cache index"
            if get("memory.disk_index_bytes")
            else ""
        )
        + f", of a {get('memory.budget_bytes', 0) / mib:.0f} MiB budget",
        f"waiting       {get('read.wait_seconds', 0):.2f} s inside READ",
        *(
            [
                f"disk cache    {get('disk_cache.stored_bytes', 0) / mib:.1f} MiB of {get('disk_cache.capacity_bytes', 0) / mib:.0f} MiB "
                f"({get('disk_cache.loaded_bytes', 0) / mib:.1f} MiB found at start); "
                f"hits {get('disk_cache.hits', 0)} ({get('disk_cache.read_bytes', 0) / mib:.1f} MiB; "
                f"{get('disk_cache.loop_reads', 0)} from the page cache), misses {get('disk_cache.misses', 0)}, "
                f"bad reads {get('disk_cache.bad_reads', 0)}, write errors {get('disk_cache.write_errors', 0)}, "
                f"not stored (disk or memory busy) {get('disk_cache.skipped_bytes', 0) / mib:.1f} MiB "
                f"in {get('disk_cache.skipped_stores', 0)} fetches; "
                f"{get('disk_cache.records_from_other_mounts', 0)} records from other mounts sharing it"
            ]
            if "disk_cache.capacity_bytes" in snapshot
            else []
        ),
        f"namespace     {get('namespace.entries', 0)} entries, {get('namespace.list_pages', 0)} LIST pages; open files {get('handles.open', 0)}"
        + ("; the kernel does not keep listings (see the log)" if get("namespace.kernel_dir_cache_off") else "")
        + ("; the kernel opens directories itself (no OPENDIR)" if get("namespace.kernel_opens_dirs") else "")
        + ("; the kernel opens files itself (no OPEN)" if get("namespace.kernel_opens_files") else ""),
    ]
    ops = {k.split(".", 1)[1]: v for k, v in snapshot.items() if k.startswith("fuse.")}
    lines.append(f"kernel asked  {', '.join(f'{k} {v}' for k, v in sorted(ops.items())) or 'nothing'}")
    errs = {k.split(".", 1)[1]: v for k, v in snapshot.items() if k.startswith("errors.")}
    lines.append(f"errors        {', '.join(f'{k} {v}' for k, v in sorted(errs.items())) or 'none'}")
    return "\n".join(lines)
