"""`bucketfs warm URL [PATH...]`: fill the local disk cache (--cache-dir) with a prefix,
or the given sub-paths of it, before training, with many GETs in flight (or, given a
MOUNTPOINT, read a running mount's files through it).

It reuses what a mount reads through: the store's backend (make_backend, the same
URL, credential and endpoint options, the same pre-flight checks and exit codes as
`bucketfs mount`) and the DiskCache in front of it, in the kept directory a mount of
the same URL and endpoint uses (directory.claim_shared_dir). There is no second cache:
a later mount with the same --cache-dir and --block-size reads what warm stored.

Invariants:
- The cache directory is shared as a mount shares it: warm may run beside mounts and
  other warms of the same URL, each seeing what the others stored (directory.py,
  journal.py).
- Resumable: a part the cache holds at the listed version costs no GET. Objects with
  no version (versions.UNPINNED) are never stored, so never fetched; empty objects
  need no GET.
- Bounded memory: the listing is walked as it is fetched (one page and the directories
  still to list are held, never the whole prefix), objects are handed to
  `concurrency` workers through a bounded channel, and each worker holds at most one
  part (PART_BYTES, whole chunks) in flight: bytes in flight <= concurrency x PART_BYTES.
- GETs in flight <= concurrency: the backend's connection pool is sized to it
  (--concurrency is warm's --max-connections).
- A part is stored before its worker takes the next (read_range_into stores inline),
  so a slow disk slows the GETs instead of dropping bytes.
- `bucketfs warm MOUNTPOINT [PATH...]` (run_warm_mount) reads a running mount's files
  through it instead, with `concurrency` threads of one READ_BYTES buffer each and a
  bounded queue of paths: the mount's own caches fill as for a reader, and it opens
  no backend and claims no cache directory.
- Progress (files, bytes, rate, time left) goes to stderr only when it is a terminal;
  without one warm prints nothing but errors, each one line.
"""

from __future__ import annotations

import logging
import math
import os
import stat as stat_mod
import sys
import time
from typing import Optional

import trio

from bucketfs import errors
from bucketfs.backends import make_backend, versions
from bucketfs.config import MAX_CONNECTIONS_MAX, STORE, Config, Option
from bucketfs.core.stats import Stats
from bucketfs.diskcache.cache import DiskCache
from bucketfs.diskcache.directory import check_cache_dir, claim_shared_dir, mount_identity

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 256
# One GET of a large object; rounded up to whole chunks (--block-size) so every part
# is stored whole. 256 workers x 1 MiB: at most 256 MiB in flight.
PART_BYTES = 1024 * 1024
PROGRESS_INTERVAL_S = 0.5

CONCURRENCY = Option(
    flag="--concurrency",
    kind="int",
    low=1,
    high=MAX_CONNECTIONS_MAX,
    group=STORE,
    help="GETs in flight, {range}; the connection pool is sized to it (warm's --max-connections); "
    f"memory in flight is at most N x {PART_BYTES // 1024 // 1024} MiB; with a MOUNTPOINT: reader threads",
)


class Progress:
    """Counters of a warm, and the line a terminal shows."""

    def __init__(self) -> None:
        self.listed_files = 0
        self.listed_bytes = 0
        self.listing_done = False
        self.done_files = 0
        self.done_bytes = 0  # fetched or found cached
        self.fetched_bytes = 0
        self.skipped_files = 0  # held by the cache already
        self.unversioned_files = 0
        self.failed: list = []  # (key, message)
        self.started_s = time.monotonic()

    def line(self) -> str:
        elapsed_s = max(time.monotonic() - self.started_s, 1e-6)
        rate = self.fetched_bytes / elapsed_s
        total_files = f"{self.listed_files}" + ("" if self.listing_done else "+")
        text = (
            f"warm: {self.done_files}/{total_files} files, {_bytes(self.done_bytes)}/{_bytes(self.listed_bytes)}, "
            f"{_bytes(rate)}/s"
        )
        if self.listing_done and rate > 0:
            left_s = max(self.listed_bytes - self.done_bytes, 0) / rate
            text += f", {_duration(left_s)} left"
        return text

    def summary(self, through_mount: bool = False) -> str:
        elapsed_s = time.monotonic() - self.started_s
        if through_mount:
            return f"warm: {self.done_files} files, {_bytes(self.done_bytes)} read through the mount in {_duration(elapsed_s)}"
        return (
            f"warm: {self.done_files} files, {_bytes(self.done_bytes)} in the cache "
            f"({_bytes(self.fetched_bytes)} fetched, {self.skipped_files} files already cached) "
            f"in {_duration(elapsed_s)}"
        )


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def warm_config(config: Config, concurrency: int) -> Config:
    """`config` with its connection pool sized for `concurrency` GETs."""
    import dataclasses

    return dataclasses.replace(config, max_connections_count=concurrency)


def normalise_path(path: str) -> str:
    """A PATH under the URL's prefix: 'a/b' (no leading or trailing '/'); '' for all."""
    parts = [part for part in path.strip("/").split("/") if part not in ("", ".")]
    if ".." in parts:
        raise errors.UserError(f"PATH {path!r} has a '..' component", errors.EXIT_USAGE)
    return "/".join(parts)


def _setup_logging() -> None:
    """Errors only, one line each: retries and the cache's notes are a mount's log
    material, and warm keeps stderr for its progress and its one-line errors."""
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("bucketfs: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.ERROR)


def run_warm(config: Config, paths: list, concurrency: int) -> int:
    """Check the cache dir and the bucket, warm, print the summary on a terminal."""
    _setup_logging()
    assert config.cache_dir is not None  # (cli.warm_config_from_args requires it)
    check_cache_dir(config.cache_dir)
    subpaths = [normalise_path(p) for p in paths] or [""]
    tty = sys.stderr.isatty()
    progress = Progress()
    try:
        trio.run(_warm, warm_config(config, concurrency), subpaths, concurrency, progress, tty)
    except BaseExceptionGroup as group:  # (a worker's error, wrapped by its nursery)
        user_error = _first_user_error(group)
        if user_error is None:
            raise
        if tty:
            sys.stderr.write("\r\033[K")
        raise user_error from None
    if tty:
        sys.stderr.write("\r\033[K" + progress.summary() + "\n")
    stats_failed = len(progress.failed)
    if stats_failed:
        key, message = progress.failed[0]
        raise errors.UserError(
            f"{stats_failed} of {progress.listed_files} files were not warmed (first: {key}: {message}); "
            "run warm again to fetch what is missing",
            errors.EXIT_ENDPOINT_UNREACHABLE,
        )
    return errors.EXIT_OK


async def _warm(config: Config, subpaths: list, concurrency: int, progress: Progress, tty: bool) -> None:
    endpoint_given = bool(config.endpoint_url)
    try:
        backend = make_backend(config)
    except errors.BucketfsError as exc:
        raise errors.user_error_for(exc, str(config.url), endpoint_given) from None
    try:
        try:
            await backend.check_bucket(config.url.prefix)
            roots = [await _resolve(backend, config, sub) for sub in subpaths]
        except errors.UserError:
            raise
        except errors.BucketfsError as exc:
            raise errors.user_error_for(exc, str(config.url), endpoint_given) from None
        assert config.cache_dir is not None
        cache_dir = claim_shared_dir(config.cache_dir, *mount_identity(config.url, config.endpoint_url))
        try:
            await _fill(backend, config, cache_dir, roots, concurrency, progress, tty)
        finally:
            cache_dir.close()
    finally:
        with trio.CancelScope(shield=True):
            await backend.aclose()


async def _resolve(backend, config: Config, sub: str):
    """('dir', prefix) or ('object', ObjectInfo) for a PATH; UserError if it names nothing."""
    prefix = config.url.prefix + sub + "/" if sub else config.url.prefix
    if not sub:
        return ("dir", prefix)
    page = await backend.list_page(prefix)
    if page.objects or page.prefixes:
        return ("dir", prefix)
    try:
        return ("object", await backend.stat(config.url.prefix + sub))
    except errors.NotFound:
        raise errors.UserError(f"{config.url}{sub}: no such file or directory", errors.EXIT_USAGE) from None


async def _fill(backend, config: Config, cache_dir, roots: list, concurrency: int, progress: Progress, tty: bool):
    stats = Stats()
    async with trio.open_nursery() as nursery:
        cache = DiskCache(
            backend,
            cache_dir.path,
            config.cache_size_bytes,
            config.block_size_bytes,
            stats,
            nursery,
            dir_fd=cache_dir.fd,
            alone=cache_dir.alone,
        )
        chunk = config.block_size_bytes
        part_bytes = -(-PART_BYTES // chunk) * chunk
        send, receive = trio.open_memory_channel(concurrency)
        if tty:
            nursery.start_soon(_show_progress, progress)
        async with trio.open_nursery() as workers:
            workers.start_soon(_walk, backend, roots, send, progress)
            for _ in range(concurrency):
                workers.start_soon(_worker, cache, receive.clone(), part_bytes, progress)
            await receive.aclose()
        await cache.wait_idle()
        if stats["disk_cache.write_errors"]:
            progress.failed.append(("(disk cache)", f"{stats['disk_cache.write_errors']} writes to the disk failed"))
        nursery.cancel_scope.cancel()


async def _walk(backend, roots: list, send, progress: Progress) -> None:
    """List every object under the roots, depth first, into `send`."""
    async with send:
        for kind, root in roots:
            if kind == "object":
                await _offer(root, send, progress)
                continue
            pending = [root]
            while pending:
                prefix = pending.pop()
                token: Optional[str] = None
                while True:
                    page = await backend.list_page(prefix, token)
                    for info in page.objects:
                        if not info.key.endswith("/"):  # (directory markers)
                            await _offer(info, send, progress)
                    pending.extend(reversed(page.prefixes))
                    token = page.next_token
                    if not token:
                        break
        progress.listing_done = True


async def _offer(info, send, progress: Progress) -> None:
    progress.listed_files += 1
    progress.listed_bytes += info.size_bytes
    await send.send(info)


async def _worker(cache: DiskCache, receive, part_bytes: int, progress: Progress) -> None:
    async with receive:
        async for info in receive:
            await _warm_object(cache, info, part_bytes, progress)
            progress.done_files += 1


async def _warm_object(cache: DiskCache, info, part_bytes: int, progress: Progress) -> None:
    size = info.size_bytes
    if size == 0:
        return
    if not versions.persistent(info.version):
        progress.unversioned_files += 1
        progress.done_bytes += size
        return
    fetched = False
    for start in range(0, size, part_bytes):
        end = min(start + part_bytes, size)
        if cache.holds(info.key, info.version, start, end):
            progress.done_bytes += end - start
            continue
        buffer = bytearray(end - start)
        try:
            got = await cache.read_range_into(info.key, start, end, info.version, buffer, object_bytes=size)
        except (errors.ObjectChanged, errors.NotFound, errors.TransientError, errors.BackendError) as exc:
            progress.failed.append((info.key, str(exc)))
            return
        except errors.AccessDenied as exc:
            raise errors.user_error_for(exc, info.key) from None
        fetched = True
        progress.fetched_bytes += got
        progress.done_bytes += end - start
    if not fetched:
        progress.skipped_files += 1


async def _show_progress(progress: Progress) -> None:
    while True:
        sys.stderr.write("\r\033[K" + progress.line())
        sys.stderr.flush()
        await trio.sleep(PROGRESS_INTERVAL_S)


# -- the MOUNTPOINT form -----------------------------------------------------------
READ_BYTES = 1024 * 1024  # one read() through the mount


def run_warm_mount(root: str, paths: list, concurrency: int) -> int:
    """Read every file under `root` (a running bucketfs mount), or under its PATHs,
    with `concurrency` threads: the mount's own caches (page cache, disk cache) fill as
    they would for a reader, and what they hold costs no GET. Memory: each thread holds
    one READ_BYTES buffer; the walk is streamed into a bounded queue."""
    import queue
    import threading

    _setup_logging()
    subpaths = [normalise_path(p) for p in paths] or [""]
    starts = []
    for sub in subpaths:
        path = os.path.join(root, sub) if sub else root
        if not os.path.lexists(path):
            raise errors.UserError(f"{path}: no such file or directory", errors.EXIT_USAGE)
        starts.append(path)
    tty = sys.stderr.isatty()
    progress = Progress()
    lock = threading.Lock()
    todo: queue.Queue = queue.Queue(maxsize=concurrency * 4)
    done = object()

    def walk() -> None:
        try:
            for start in starts:
                for path, size in _files_under(start):
                    with lock:
                        progress.listed_files += 1
                        progress.listed_bytes += size
                    todo.put(path)
        finally:
            progress.listing_done = True
            for _ in range(concurrency):
                todo.put(done)

    def read_files() -> None:
        buffer = bytearray(READ_BYTES)
        while (path := todo.get()) is not done:
            read_bytes = 0
            try:
                with open(path, "rb", buffering=0) as f:
                    while got := f.readinto(buffer):
                        read_bytes += got
                        with lock:
                            progress.done_bytes += got
                            progress.fetched_bytes += got
            except OSError as exc:
                with lock:
                    progress.failed.append((path, exc.strerror or str(exc)))
            with lock:
                progress.done_files += 1

    threads = [threading.Thread(target=walk, daemon=True)]
    threads += [threading.Thread(target=read_files, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(PROGRESS_INTERVAL_S)
            if tty:
                with lock:
                    line = progress.line()
                sys.stderr.write("\r\033[K" + line)
                sys.stderr.flush()
    if tty:
        sys.stderr.write("\r\033[K" + progress.summary(through_mount=True) + "\n")
    if progress.failed:
        path, message = progress.failed[0]
        raise errors.UserError(
            f"{len(progress.failed)} of {progress.listed_files} files could not be read (first: {path}: {message})",
            errors.EXIT_ENDPOINT_UNREACHABLE,
        )
    return errors.EXIT_OK


def _files_under(path: str):
    """(path, size) of every regular file at or under `path`, depth first, streamed."""
    st = os.stat(path)
    if not stat_mod.S_ISDIR(st.st_mode):
        if stat_mod.S_ISREG(st.st_mode):
            yield path, st.st_size
        return
    pending = [path]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        yield entry.path, entry.stat(follow_symlinks=False).st_size
        except OSError as exc:
            log.error("%s: %s", directory, exc.strerror or exc)


def _first_user_error(group: BaseExceptionGroup) -> Optional[errors.UserError]:
    for exc in group.exceptions:
        if isinstance(exc, errors.UserError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_user_error(exc)
            if found is not None:
                return found
    return None
