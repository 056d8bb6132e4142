"""`bucketfs index build URL --out FILE-or-URL`: list a prefix as fast as the store
allows and write its listing index (bucketfs/core/listing_index.py), which
`bucketfs mount --index` then mounts with no LIST request.

How it lists (ParallelLister): the prefix's key space is cut into ranges, each listed
by its own task with flat LISTs (no delimiter) that start after a key (S3 StartAfter,
GCS startOffset: Backend.list_flat_page), at most `concurrency` LISTs in flight.
- Subdirectories are fanned out first: one delimited LIST of the prefix names its
  subdirectories, whose names cut the key space into one range each (a prefix with
  no subdirectory: that page is the flat listing's first page already).
- A range that proves large (a full page that did not reach its end) is split where
  it stands: what is left of it, from its last key to its end, is cut into as many
  ranges as there are idle request slots, at keys spaced as its last page says the
  keys lie, in a space where each position of a key holds the characters seen there
  (KeySpace, position_alphabets), so that cuts land among the keys. Cuts past the
  keys' end cost one empty LIST each; the ones in the keys go on splitting, so a flat
  prefix of N keys takes about log(N) + N / 1000 / concurrency round trips instead of
  N / 1000.
- S3 has no end key: a LIST answers a whole page, past its range's end too, which the
  store lists and sends for nothing (another range lists those keys). So a range's
  page asks for about the keys the same density puts between its start and the
  range's end (S3 max-keys, Density.keys_max), with a margin: too few costs one more
  small LIST.
Invariants:
- Exactly the keys of a sequential listing, each once: the ranges are disjoint and
  cover the key space (a range is the keys k with lo < k <= hi, hi None for no
  end); a page's keys past its range's end are left to the range that owns them.
  The keys are checked in order before the index is written; a store that does not
  honour the start key (its answer starts at or before it) is an error, not a
  silent index.
- At most `concurrency` LISTs in flight (the backend's connection pool is sized to
  it, as warm does); memory is the listing itself (ObjectInfo per key), then the index.
- `built_at` is when the listing started: the index names no object newer than that
  as the store's state, only possibly objects written while it ran.
- Output: a local file written whole under a temporary name, then renamed (a reader
  never sees half an index), or an object of the same store (Backend.upload).
- Progress on a terminal only (stderr); without one, nothing but errors, one line.
- Exit codes are mount's: 2 bad URL, option or --out, 3 no bucket, 4 denied, 5
  unreachable or a store answering out of order.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import gc
import itertools
import logging
import operator
import os
import statistics
import sys
import time
from typing import Optional

import trio

from bucketfs import __version__, errors
from bucketfs.backends import make_backend
from bucketfs.backends.base import ListPage
from bucketfs.config import MAX_CONNECTIONS_MAX, STORE, BucketURL, Config, Option, is_url, parse_object_url
from bucketfs.core.listing_index import encode_index

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 64
PROGRESS_INTERVAL_S = 0.25
# Digits beyond the longer bound's length: split points resolve finer than its keys.
_EXTRA_DIGITS = 3
PAGE_KEYS = 1000  # what a LIST page holds (S3's and GCS's most)
# A new range is cut to hold about this many pages, where the keys seen say how dense
# they are: more would leave slots idle at the end, fewer would list more keys twice
# (a LIST answers a whole page, past its range's end too).
PAGES_PER_RANGE = 6
SCALES_KEPT = 32  # ranges whose counts correct the next cuts
# A range's last page asks for the keys its end is estimated to be away (S3 max-keys),
# widened by this much and a few keys: a page past the end would make the store list
# and send keys another range lists too. Too short a page costs one more small LIST.
LAST_PAGE_MARGIN = 1.15
LAST_PAGE_SLACK_KEYS = 8

CONCURRENCY = Option(
    flag="--concurrency",
    kind="int",
    low=1,
    high=MAX_CONNECTIONS_MAX,
    group=STORE,
    help="LIST requests in flight, {range}; the connection pool is sized to it",
)


class Progress:
    """Counters of a build, and the line a terminal shows."""

    def __init__(self) -> None:
        self.objects = 0
        self.lists = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.started_s = time.monotonic()

    def line(self) -> str:
        elapsed_s = max(time.monotonic() - self.started_s, 1e-6)
        return (
            f"index: {self.objects:,} objects listed, {self.lists:,} LISTs ({self.in_flight} in flight), "
            f"{self.objects / elapsed_s:,.0f} objects/s"
        )


class KeySpace:
    """Keys read as numbers, to place split points between them. Each position of a
    key has its own alphabet (the sorted, distinct characters seen there; `alphabets`
    is one string for every position, or one per position with the union of them past
    its end), so that keys of a fixed shape ("obj-000123.bin") map onto evenly filled
    numbers and a point lands among keys, not in the spans no key can have (a letter
    where every key has a digit). A position's digit is 0 for "no more characters" and
    a character's rank + 1 in its alphabet; `length` digits in all. A character outside
    its position's alphabet reads as the one below it: only the spacing of points
    suffers, never their order (points() drops any outside its bounds)."""

    def __init__(self, alphabets, *keys: Optional[str]):
        known = [key for key in keys if key]
        self.length = max(len(key) for key in keys if key is not None) + _EXTRA_DIGITS
        if isinstance(alphabets, str):
            alphabets = [alphabets]
            rest = set(alphabets[0])
        else:
            rest = set().union(*alphabets)
        self.chars_at = [
            sorted(
                (set(alphabets[i]) if i < len(alphabets) else rest).union(key[i] for key in known if i < len(key))
                or rest.union(*known)
                or {"a"}
            )
            for i in range(self.length)
        ]
        self.bases = [len(chars) + 1 for chars in self.chars_at]
        self.end = 1
        for base in self.bases:
            self.end *= base  # above every key: "no upper end"

    def number(self, key: Optional[str]) -> int:
        if key is None:
            return self.end
        value = 0
        for i, (chars, base) in enumerate(zip(self.chars_at, self.bases)):
            value = value * base + (bisect.bisect_right(chars, key[i]) if i < len(key) else 0)
        return value

    def key(self, value: int) -> str:
        digits = []
        for base in reversed(self.bases):
            value, digit = divmod(value, base)
            digits.append(digit)
        out = []
        for chars, digit in zip(self.chars_at, reversed(digits)):
            if digit == 0:
                break
            out.append(chars[digit - 1])
        return "".join(out)

    def points(self, lo: str, hi: Optional[str], numbers) -> list:
        """The keys of `numbers` that lie strictly between `lo` and `hi`, in order, once each."""
        points: list = []
        for value in numbers:
            point = self.key(value)
            if point > lo and (hi is None or point < hi) and (not points or point > points[-1]):
                points.append(point)
        return points


_DIGIT_SET = frozenset("0123456789")


def position_alphabets(seen_at: list) -> list:
    """The characters each position of keys is taken to hold, from the sets seen there
    (`seen_at`, one per position). A field's leading characters change slowest: one
    page of hashed keys shows only "0"-"2" first where the later positions show
    0-9a-f. So a position is taken to hold what the positions after it showed, for as
    long as each of them showed at least its own characters (the field goes on), and
    any digit stands for all ten (a counter's high digits: "obj-000123")."""
    alphabets = []
    for i, seen in enumerate(seen_at):
        chars = set(seen)
        for later in itertools.islice(seen_at, i + 1, None):
            if not seen <= later:
                break
            chars |= later
        if chars & _DIGIT_SET:
            chars |= _DIGIT_SET
        alphabets.append("".join(sorted(chars)))
    return alphabets


def split_points(lo: str, hi: Optional[str], parts: int, alphabets) -> list:
    """Up to `parts - 1` keys strictly between `lo` and `hi` (None: no upper end), in
    order, evenly spaced in the KeySpace of `alphabets`."""
    space = KeySpace(alphabets, lo, hi)
    low, high = space.number(lo), space.number(hi)
    return space.points(lo, hi, (low + (high - low) * i // parts for i in range(1, parts)))


def extrapolated_points(
    first: str, last: str, keys_count: int, hi: Optional[str], parts: int, alphabets, scale: float = 1.0
) -> tuple:
    """(points, extrapolated): up to `parts - 1` keys after `last` (and before `hi`)
    that cut what follows it into ranges of about PAGES_PER_RANGE pages each, if the
    keys go on as densely as from `first` to `last` (`keys_count` keys), widened by
    `scale` (what earlier ranges showed of the estimate); where they would reach past
    `hi`, the rest of (last, hi) is cut evenly instead (extrapolated False)."""
    space = KeySpace(alphabets, first, last, hi)
    low, high = space.number(last), space.number(hi)
    per_key = max((low - space.number(first)) * scale / max(keys_count - 1, 1), 1.0)
    if hi is not None:
        # No part smaller than a page: the key space has gaps (digits are 10 of its
        # characters), and a range cut finer mostly lists nothing.
        parts = min(parts, max(int((high - low) / per_key / PAGE_KEYS), 1))
        if parts <= 1:
            return [], False
    width = max(int(per_key * PAGE_KEYS * PAGES_PER_RANGE), 1)
    if low + width * (parts - 1) >= high:
        return space.points(last, hi, (low + (high - low) * i // parts for i in range(1, parts))), False
    return space.points(last, hi, (low + width * i for i in range(1, parts))), True


class Density:
    """How densely keys lie, as a page just listed shows: `keys_count` keys from
    `first` to `last` (whole keys; `cut`: the prefix's length, left out of the
    KeySpace), in the KeySpace of `alphabets`."""

    def __init__(self, alphabets, cut: int, first: str, last: str, keys_count: int, hi: Optional[str]):
        self.cut = cut
        self.space = KeySpace(alphabets, first[cut:], last[cut:], None if hi is None else hi[cut:])
        span = self.space.number(last[cut:]) - self.space.number(first[cut:])
        self.per_key = span / (keys_count - 1) if keys_count > 1 and span > 0 else None

    def keys_max(self, lo: str, hi: Optional[str]) -> int:
        """What a page after `lo` of the range (lo, hi] should ask for: the keys up to
        `hi` if they lie this densely, with a margin; a whole page if more, or unknown."""
        if hi is None or self.per_key is None:
            return PAGE_KEYS
        span = self.space.number(hi[self.cut :]) - self.space.number(lo[self.cut :])
        estimate = span / self.per_key
        return max(min(int(estimate * LAST_PAGE_MARGIN) + LAST_PAGE_SLACK_KEYS, PAGE_KEYS), 1)


class ParallelLister:
    """Every object under `prefix`, listed in key ranges by concurrent tasks (see the
    module docstring). `run()` returns them in key order."""

    def __init__(self, backend, prefix: str, concurrency: int, progress: Optional[Progress] = None):
        self.backend = backend
        self.prefix = prefix
        self.concurrency = concurrency
        self.progress = progress or Progress()
        # Characters seen at each position of keys (relative to the prefix), sorted.
        self.alphabets: list = []
        self._chars_at: list = []
        self._chunks: list = []  # lists of ObjectInfo, each in key order, disjoint
        self._ranges = 0  # ranges listed or waiting to be
        # How much wider a range must be cut than the last page's density says, as the
        # ranges cut so far turned out: the median of their own (key spaces are not
        # uniform: digits use 10 of a key space's characters).
        self._scale = 1.0
        self._scales: collections.deque = collections.deque(maxlen=SCALES_KEPT)
        self._limiter = trio.CapacityLimiter(concurrency)
        self._nursery: Optional[trio.Nursery] = None

    async def run(self) -> list:
        # No cyclic collection while listing: nothing listed is in a cycle, and its
        # passes over each page's young tuples were ~0.3 ms of a page's ~1.5 ms of CPU
        # (its full passes over all objects listed, more). Memory is the listing's.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return await self._run()
        finally:
            if collecting:
                gc.enable()

    async def _run(self) -> list:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                first = await self._list(self.backend.list_page, self.prefix)
                if first.prefixes:
                    # Fan out: one range per subdirectory, cut at their names.
                    cuts = sorted(first.prefixes)
                    for lo, hi in zip(["", *cuts], [*cuts, None]):
                        self._start(lo, hi)
                else:
                    # No subdirectory among the first entries: they are the flat listing's
                    # first page (a key under a subdirectory would have shown as one).
                    self._take(first.objects)
                    if first.next_token is not None:
                        cursor, hi = first.objects[-1].key if first.objects else "", None
                        if first.objects:
                            # Split what is left at once, as this page's keys are spaced: a
                            # round trip less than listing the range's own first page first.
                            self._ranges += 1  # (the range from `cursor`, started below)
                            hi = self._split(first.objects[0].key, cursor, len(first.objects), None)
                            self._ranges -= 1
                        self._start(cursor, hi)
        except BaseExceptionGroup as group:  # (a range's error: the first one is the answer)
            found = _first_error(group, errors.BucketfsError)
            if found is None:
                raise
            raise found from None
        chunks: list = sorted(self._chunks, key=lambda chunk: chunk[0].key)
        objects = list(itertools.chain.from_iterable(chunks))
        keys = list(map(operator.itemgetter(0), objects))  # (ObjectInfo is a tuple: key first)
        if not all(map(operator.lt, keys, itertools.islice(keys, 1, None))):  # (C loops)
            before, after = next(pair for pair in zip(keys, keys[1:]) if not pair[0] < pair[1])
            raise errors.BackendError(f"the store listed {after!r} after {before!r}: not in key order, or twice")
        return objects

    async def _list(self, list_fn, *args):
        async with self._limiter:
            self.progress.in_flight += 1
            self.progress.most_in_flight = max(self.progress.most_in_flight, self.progress.in_flight)
            try:
                return await list_fn(*args)
            finally:
                self.progress.in_flight -= 1
                self.progress.lists += 1

    def _take(self, objects: list) -> None:
        if objects:
            self._chunks.append(objects)
            self.progress.objects += len(objects)
            cut = len(self.prefix)
            chars_at = self._chars_at
            seen_count = sum(map(len, chars_at))
            for info in (objects[0], objects[-1]) if chars_at else objects:
                name = info.key[cut:]
                if len(name) > len(chars_at):
                    chars_at.extend(set() for _ in range(len(name) - len(chars_at)))
                for chars, char in zip(chars_at, name):
                    chars.add(char)
            if sum(map(len, chars_at)) != seen_count:
                self.alphabets = position_alphabets(chars_at)

    def _start(self, lo: str, hi: Optional[str], scale: Optional[float] = None, keys_max: int = PAGE_KEYS) -> None:
        """A task for the range (lo, hi]; `scale`: it was cut to hold PAGES_PER_RANGE
        pages with that scale (its count then corrects the next cuts); `keys_max`: what
        its first page asks for."""
        assert self._nursery is not None
        self._ranges += 1
        self._nursery.start_soon(self._range, lo, hi, scale, keys_max)

    async def _range(self, lo: str, hi: Optional[str], scale: Optional[float], keys_max: int) -> None:
        """List the keys k with lo < k <= hi, splitting what is left while slots are idle."""
        try:
            cursor, listed = lo, 0
            while True:
                page = await self._list(self.backend.list_flat_page, self.prefix, cursor, hi, keys_max)
                objects = page.objects
                if objects and objects[0].key <= cursor:
                    raise errors.BackendError(
                        f"the store answered a listing after {cursor!r} with {objects[0].key!r}: it does not "
                        "honour the start key (S3 StartAfter, GCS startOffset), which index build needs"
                    )
                if hi is not None and objects and objects[-1].key > hi:
                    objects = objects[: bisect.bisect_right([info.key for info in objects], hi)]
                    page = ListPage(objects, [], None)
                self._take(objects)
                listed += len(objects)
                if page.next_token is None:
                    if scale is not None and listed:
                        # (An empty range lies past the keys' end: it says nothing of their density.)
                        self._scales.append(scale * PAGE_KEYS * PAGES_PER_RANGE / listed)
                        self._scale = min(max(statistics.median(self._scales), 1 / 64), 64.0)
                    return
                cursor = page.next_token
                new_hi = self._split(objects[0].key, cursor, len(objects), hi)
                if new_hi != hi:
                    hi, scale = new_hi, None  # (cut again: its count no longer answers its estimate)
                keys_max = self._density(objects[0].key, cursor, len(objects), hi).keys_max(cursor, hi)
        finally:
            self._ranges -= 1

    def _density(self, first: str, last: str, keys_count: int, hi: Optional[str]) -> "Density":
        cut = len(self.prefix)
        return Density(self.alphabets, cut, first, last, keys_count, hi)

    def _split(self, first: str, cursor: str, keys_count: int, hi: Optional[str]) -> Optional[str]:
        """Cut (cursor, hi] into this range and new ones for the idle slots, spaced as
        the page just listed (`first` to `cursor`, `keys_count` keys) says the keys are;
        this range's new end."""
        idle = self.concurrency - self._ranges
        if idle <= 0:
            return hi
        cut = len(self.prefix)
        points, extrapolated = extrapolated_points(
            first[cut:],
            cursor[cut:],
            keys_count,
            None if hi is None else hi[cut:],
            idle + 1,
            self.alphabets,
            self._scale,
        )
        points = [self.prefix + point for point in points]
        ends = [*points[1:], hi]
        density = self._density(first, cursor, keys_count, hi)
        for i, (lo, end) in enumerate(zip(points, ends)):
            # The last new range runs to the old end: no estimate holds for it.
            self._start(
                lo, end, self._scale if extrapolated and i < len(points) - 1 else None, density.keys_max(lo, end)
            )
        return points[0] if points else hi


def index_build_config(config: Config, concurrency: int) -> Config:
    """`config` with its connection pool sized for `concurrency` LISTs."""
    return dataclasses.replace(config, max_connections_count=concurrency)


def _setup_logging() -> None:
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("bucketfs: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.ERROR)


def check_out(out: str, config: Config) -> None:
    """Refuse an --out that cannot be written before listing anything (exit 2)."""
    if is_url(out):
        try:
            scheme, _bucket, _key = parse_object_url(out)
        except ValueError as exc:
            raise errors.UserError(f"--out {exc}", errors.EXIT_USAGE) from None
        if scheme != config.url.scheme:
            raise errors.UserError(
                f"--out {out} is on another store than {config.url} (write it to the same store, or a file)",
                errors.EXIT_USAGE,
            )
        return
    if os.path.isdir(out):
        raise errors.UserError(f"--out {out} is a directory (name the index file)", errors.EXIT_USAGE)
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise errors.UserError(f"--out {out}: no directory {parent}", errors.EXIT_USAGE)
    if not os.access(parent, os.W_OK):
        raise errors.UserError(f"--out {out}: cannot write in {parent}", errors.EXIT_USAGE)


def run_index_build(config: Config, out: str, concurrency: int) -> int:
    """List `config.url`, write its index to `out`; a summary on a terminal."""
    _setup_logging()
    # A command that ends once it has written one file: the cyclic collector's passes
    # over the objects listed (none in a cycle) are all it would do (ParallelLister
    # runs without it; the index's encoding would not).
    gc.disable()
    check_out(out, config)
    tty = sys.stderr.isatty()
    progress = Progress()
    try:
        written_bytes, objects_count = trio.run(_build, index_build_config(config, concurrency), out, progress, tty)
    except BaseExceptionGroup as group:
        user_error = _first_error(group, errors.UserError)
        if user_error is None:
            raise
        raise user_error from None
    finally:
        if tty:
            sys.stderr.write("\r\033[K")
    if objects_count == 0:
        print(f"bucketfs: warning: {config.url} lists no object: the index is empty", file=sys.stderr)
    if tty:
        elapsed_s = time.monotonic() - progress.started_s
        sys.stderr.write(
            f"index: {objects_count:,} objects listed in {elapsed_s:.1f} s ({progress.lists:,} LISTs, at most "
            f"{progress.most_in_flight} in flight); {written_bytes:,} bytes written to {out}\n"
        )
    return errors.EXIT_OK


async def _build(config: Config, out: str, progress: Progress, tty: bool) -> tuple:
    endpoint_given = bool(config.endpoint_url)
    try:
        backend = make_backend(config)
    except errors.BucketfsError as exc:
        raise errors.user_error_for(exc, str(config.url), endpoint_given) from None
    try:
        async with trio.open_nursery() as nursery:
            if tty:
                nursery.start_soon(_show_progress, progress)
            try:
                await backend.check_bucket(config.url.prefix)
                started_ns = time.time_ns()
                objects = await ParallelLister(backend, config.url.prefix, config.max_connections_count, progress).run()
            except errors.BucketfsError as exc:
                raise errors.user_error_for(exc, str(config.url), endpoint_given) from None
            nursery.cancel_scope.cancel()
        data = encode_index(
            str(config.url), objects, started_ns, created_by=f"bucketfs {__version__}", key_start=len(config.url.prefix)
        )
        objects_count = len(objects)
        del objects
        await _write(backend, config, out, data)
        return len(data), objects_count
    finally:
        with trio.CancelScope(shield=True):
            await backend.aclose()


async def _write(backend, config: Config, out: str, data: bytes) -> None:
    if not is_url(out):
        await trio.to_thread.run_sync(write_file, out, data)
        return
    scheme, bucket, key = parse_object_url(out)
    target = backend
    if bucket != config.url.bucket:
        try:
            target = make_backend(dataclasses.replace(config, url=BucketURL(scheme, bucket, "")))
        except errors.BucketfsError as exc:
            raise errors.user_error_for(exc, out) from None
    try:
        await target.upload(key, data)
    except errors.BucketfsError as exc:
        raise errors.user_error_for(exc, f"--out {out}", bool(config.endpoint_url)) from None
    finally:
        if target is not backend:
            with trio.CancelScope(shield=True):
                await target.aclose()


def write_file(path: str, data: bytes) -> None:
    """`data` as the file `path`, whole or not at all: written under a temporary name
    beside it, synced, then renamed over it."""
    temporary = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise errors.UserError(f"--out {path}: {exc.strerror}", errors.EXIT_USAGE) from None


async def _show_progress(progress: Progress) -> None:
    while True:
        sys.stderr.write("\r\033[K" + progress.line())
        sys.stderr.flush()
        await trio.sleep(PROGRESS_INTERVAL_S)


def _first_error(group: BaseExceptionGroup, kind: type):
    """The first exception of `kind` in `group`, however deeply nested, or None."""
    for exc in group.exceptions:
        if isinstance(exc, kind):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_error(exc, kind)
            if found is not None:
                return found
    return None
