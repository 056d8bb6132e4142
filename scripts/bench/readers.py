"""Reading primitives shared by the workloads: threads that pull from a shared list,
whole files with 1 MiB reads (file systems), large objects as parallel ranged GETs
(direct clients), and the median of repeated passes."""

from __future__ import annotations

import collections
import io
import itertools
import os
import threading
import time
from typing import Callable, Iterator

from .common import PARALLEL_PARTS, PART_BYTES, new_hash
from .datasets import Verifier
from .stores import S3Direct


def median_run(passes: int, fn: Callable[[], dict]) -> dict:
    """fn()'s result of median "s" over `passes` runs, every pass's seconds beside it."""
    results = sorted((fn() for _ in range(passes)), key=lambda r: r.get("s", 0.0))
    middle = dict(results[len(results) // 2])
    if passes > 1:
        middle["passes_s"] = [r.get("s") for r in results]
    return middle


def run_threads(target: Callable, args_list: list, verifier: Verifier) -> float:
    """Run target(*args) in one thread each; return the wall time. Exceptions become FAILs."""

    def wrapped(*args):
        try:
            target(*args)
        except Exception as exc:  # noqa: BLE001 - a reader error is a failed run, reported
            verifier.fail(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=wrapped, args=args, daemon=True) for args in args_list]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def pull_loop(items: list, worker_fn: Callable) -> Callable:
    """A thread body that takes the next item from a shared list until none are left."""
    counter = itertools.count()

    def body():
        n = len(items)
        while True:
            i = next(counter)  # atomic under the GIL
            if i >= n:
                return
            worker_fn(i, items[i])

    return body


def file_reader(root: str) -> Callable[[str], bytes]:
    """read(rel) -> the whole file `rel` below `root`, in one read (an epoch's reader)."""

    def read(rel: str) -> bytes:
        with open(os.path.join(root, rel), "rb") as f:
            return f.read()

    return read


def read_file_streaming(path: str, buf: bytearray) -> tuple:
    """Whole file with 1 MiB reads: (size, digest)."""
    h, n, view = new_hash(), 0, memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                return n, h.intdigest()
            h.update(view[:k])
            n += k


def iter_object_parallel(client: S3Direct, bucket: str, key: str, size: int, executor) -> Iterator[bytes]:
    """A large object as 8 MiB ranged GETs, 16 in flight, yielded in order."""
    starts = iter(range(0, size, PART_BYTES))
    futures = collections.deque()
    for start in itertools.islice(starts, PARALLEL_PARTS):
        futures.append(executor.submit(client.get, bucket, key, start, min(start + PART_BYTES, size)))
    while futures:
        data = futures.popleft().result()
        start = next(starts, None)
        if start is not None:
            futures.append(executor.submit(client.get, bucket, key, start, min(start + PART_BYTES, size)))
        yield data


def read_object_direct(client, bucket, key, size, executor) -> tuple:
    h, n = new_hash(), 0
    for data in iter_object_parallel(client, bucket, key, size, executor):
        h.update(data)
        n += len(data)
    return n, h.intdigest()


class IterReader(io.RawIOBase):
    """A readable raw stream over an iterator of bytes chunks (direct objects for webdataset)."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks, self._current, self._pos = chunks, b"", 0

    def readable(self):
        return True

    def readinto(self, b) -> int:
        while self._pos >= len(self._current):
            self._current = next(self._chunks, None)
            self._pos = 0
            if self._current is None:
                self._current = b""
                return 0
        n = min(len(b), len(self._current) - self._pos)
        b[:n] = self._current[self._pos : self._pos + n]
        self._pos += n
        return n
