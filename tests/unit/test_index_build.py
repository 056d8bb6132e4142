"""`bucketfs index build`'s lister (bucketfs/app/indexbuild.py) on the in-memory
backend: exactly the keys of a sequential listing whatever their shape, at most
`concurrency` LISTs in flight, and (in trio's virtual time, 20 ms a LIST) a flat
prefix listed in a fraction of the sequential time."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from bucketfs import errors
from bucketfs.app.indexbuild import KeySpace, ParallelLister, split_points
from bucketfs.backends.base import ListPage
from bucketfs.backends.memory import MemoryBackend

pytestmark = pytest.mark.timeout(120)


def _backend(keys, page_size_count: int = 1000, delay_s: float = 0.0) -> MemoryBackend:
    backend = MemoryBackend(page_size_count=page_size_count, delay_s=delay_s)
    for key in sorted(keys):
        backend.put(key, key.encode()[:7])
    return backend


async def _sequential(backend, prefix: str) -> list:
    objects, start_after = [], ""
    while True:
        page = await backend.list_flat_page(prefix, start_after)
        objects += page.objects
        if page.next_token is None:
            return objects
        start_after = page.next_token


def _run(backend, prefix: str, concurrency: int):
    async def main():
        lister = ParallelLister(backend, prefix, concurrency)
        return await lister.run(), lister.progress, await _sequential(backend, prefix)

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _shapes() -> dict:
    rng = random.Random(38)
    return {
        "flat-numbered": [f"p/obj-{i:05d}.bin" for i in range(3000)],
        "hashed": [f"p/{rng.getrandbits(64):016x}" for i in range(2000)],
        "tree": [f"p/c{d:03d}/img{i:04d}.jpg" for d in range(40) for i in range(rng.randrange(0, 90))],
        "mixed": (
            [f"p/{rng.choice('abcXYZ_-.')}{i:06d}" for i in range(1500)]
            + [f"p/dir{d}/" for d in range(5)]  # markers
            + [f"p/dir{d}/x{i}" for d in range(5) for i in range(40)]
            + ["p/", "p/a", "p/a/", "p/a/b", "p/a//b", "p/ünï", "p/日本/語", "p/😀" * 3, "p/\U0010ffff"]
        ),
        # Late keys in characters no early page showed: split points never see them.
        "late-unicode": [f"p/a{i:04d}" for i in range(2000)] + [f"p/ž{i:04d}" for i in range(700)] + ["p/😀end"],
        "one": ["p/only"],
        "none": [],
    }


@pytest.mark.parametrize("shape", list(_shapes()))
@pytest.mark.parametrize("page_size_count, concurrency", [(1000, 64), (7, 64), (13, 3), (50, 1), (1, 8)])
def test_the_parallel_listing_is_exactly_the_sequential_one(shape, page_size_count, concurrency):
    keys = _shapes()[shape] + ["other/p-not-under-it", "o", "q"]
    if page_size_count == 1:
        keys = keys[:300]
    backend = _backend(keys, page_size_count)
    objects, progress, sequential = _run(backend, "p/", concurrency)
    assert [info.key for info in objects] == [info.key for info in sequential]
    assert objects == sequential  # sizes, mtimes, versions too
    assert progress.objects == len(objects)
    assert progress.most_in_flight <= concurrency


def test_the_bucket_root_is_listed_whole():
    keys = [f"{c}/{i:03d}" for c in "abcdefgh" for i in range(300)] + ["top", "zz"]
    objects, _progress, sequential = _run(_backend(keys, 100), "", 16)
    assert [info.key for info in objects] == sorted(keys) == [info.key for info in sequential]


def test_a_flat_prefix_is_listed_in_a_fraction_of_the_sequential_time():
    """200,000 keys, 20 ms a LIST (virtual time): sequential pages take 4 s; the ranges
    at least 8x less, with no more than twice the LISTs."""
    backend = _backend([f"flat/obj-{i:06d}.bin" for i in range(200_000)], delay_s=0.02)

    async def main():
        started = trio.current_time()
        sequential = await _sequential(backend, "flat/")
        sequential_s = trio.current_time() - started
        lists_before = backend.requests["list"]
        started = trio.current_time()
        lister = ParallelLister(backend, "flat/", 64)
        objects = await lister.run()
        return sequential_s, trio.current_time() - started, objects, sequential, backend.requests["list"] - lists_before

    sequential_s, parallel_s, objects, sequential, lists = trio.run(
        main, clock=trio.testing.MockClock(autojump_threshold=0)
    )
    assert objects == sequential and len(objects) == 200_000
    assert sequential_s == pytest.approx(4.0)
    assert parallel_s * 8 <= sequential_s, (parallel_s, lists)
    assert lists <= 2 * 200, lists


@pytest.mark.parametrize(
    "keys, past_end_most",
    [
        ([f"flat/obj-{i:06d}.bin" for i in range(200_000)], 0.1),
        (
            [
                f"flat/{random.Random(7).getrandbits(64) ^ i * 0x9E3779B97F4A7C15 & (2**64 - 1):016x}"
                for i in range(100_000)
            ],
            0.1,
        ),
        # (Unpadded numbers: "_10.JPEG" sorts before "_2.JPEG", keys lie unevenly.)
        ([f"flat/train/n{c:08d}_{i}.JPEG" for c in range(80) for i in range(1300)], 0.35),
    ],
    ids=["numbered", "hashed", "imagenet-names"],
)
def test_ranges_spare_the_store_most_keys_past_their_ends(keys, past_end_most):
    """S3 has no end key: a LIST answers a whole page past its range's end. Split
    points land among the keys (each position's own characters) and a range's pages
    ask for about the keys left to its end, so the store sends few keys twice. (The
    previous cuts, on one alphabet for every position and whole pages, sent 0.29,
    0.50 and 1.98 keys past an end per key listed.)"""
    backend = _backend(keys, delay_s=0.02)
    real = backend.list_flat_page
    sent = {"keys": 0, "past_end": 0, "lists": 0}

    async def whole_pages(prefix, start_after="", end=None, keys_max=1000):
        page = await real(prefix, start_after, None, keys_max)  # (as S3 answers: no end)
        sent["lists"] += 1
        sent["keys"] += len(page.objects)
        sent["past_end"] += sum(1 for info in page.objects if end is not None and info.key > end)
        return page

    backend.list_flat_page = whole_pages

    async def main():
        return await ParallelLister(backend, "flat/", 64).run()

    objects = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [info.key for info in objects] == sorted(keys)
    pages = len(keys) / 1000
    assert sent["past_end"] <= past_end_most * len(keys), sent
    assert sent["lists"] <= 1.5 * pages + 64, sent


def test_a_store_that_ignores_the_start_key_is_an_error_not_a_wrong_index():
    backend = _backend([f"p/{i:04d}" for i in range(50)], page_size_count=10)
    real = backend.list_flat_page

    async def ignoring(prefix, start_after="", end=None, keys_max=1000):
        return await real(prefix, "", end, keys_max)

    backend.list_flat_page = ignoring
    with pytest.raises(errors.BackendError, match="does not honour the start key"):
        _run(backend, "p/", 4)


def test_a_store_answering_out_of_order_is_an_error():
    backend = _backend([f"p/{i:04d}" for i in range(20)], page_size_count=5)
    real = backend.list_flat_page

    async def shuffled(prefix, start_after="", end=None, keys_max=1000):
        page = await real(prefix, start_after, end, keys_max)
        objects = page.objects[:]
        if len(objects) == 5:
            objects[3], objects[4] = objects[4], objects[3]
        return ListPage(objects, [], page.next_token)

    backend.list_flat_page = shuffled
    with pytest.raises(errors.BackendError, match="not in key order"):
        trio.run(ParallelLister(backend, "p/", 4).run)


def test_split_points_lie_strictly_between_their_bounds_in_order():
    rng = random.Random(5)
    alphabet = "".join(sorted(set("obj-0123456789.bin")))
    for _ in range(500):
        lo = "".join(rng.choice(alphabet + "zé") for _ in range(rng.randrange(0, 12)))
        hi = (
            None if rng.random() < 0.3 else lo + "".join(rng.choice(alphabet + "~") for _ in range(rng.randrange(1, 6)))
        )
        if hi is not None and hi <= lo:
            continue
        points = split_points(lo, hi, rng.randrange(2, 70), alphabet)
        assert points == sorted(set(points))
        assert all(point > lo and (hi is None or point < hi) for point in points)
    # Evenly spaced over what the alphabet can spell: 9 parts of (a, z) start with 8 letters.
    points = split_points("a", "z", 9, "abcdefghijklmnopqrstuvwxyz")
    assert len(points) == 8 and len({point[0] for point in points}) == 8
    space = KeySpace("ab", "ab")
    assert space.key(space.number("ab")) == "ab" and space.number(None) > space.number("bbbbb")
