"""The disk cache's replacement policy (diskcache/policy.py) on a model cache: objects of
one size, a room of ROOM of them. Random-order passes over a data set larger than the
cache keep ~1/N of it cached (LRU: a few %), a one-time scan does not flush a working
set, and a workload that changes turns the resident set over.

The figures: `python3 -m pytest -q -s tests/unit/test_cache_policy.py` prints them."""

import random

import pytest

from bucketfs.diskcache import policy
from bucketfs.diskcache.policy import Residency

ROOM = 1000  # objects of size 1


class Obj:
    __slots__ = ("size", "read_at")

    def __init__(self):
        self.size = 0


def simulate(passes, lru: bool, room: int = ROOM, checks=None) -> list:
    """Read each pass's keys through a model cache of `room` objects: each pass's share
    of hits. A miss stores the object (admitted at size 0, then grown, as the disk
    cache's writes do) and evicts the policy's victims down to the room."""
    index = Residency(lambda obj: obj.size, lru=lru)
    index.settle(room)
    shares = []
    for keys in passes:
        hits = 0
        for key in keys:
            obj = index.get(key)
            if obj is not None:
                index.read(key, obj)
                hits += 1
                continue
            obj = Obj()
            index.admit(key, obj, 1)
            obj.size = 1
            index.grew(key, 1, 1)
            while index.resident_bytes + index.probation_bytes > room:
                index.pop(index.victim())
            assert index.resident_bytes <= room * (1 - policy.PROBATION_FRACTION) or lru
            assert len(index) <= room
            if checks is not None:
                checks(index)
        shares.append(hits / len(keys))
    return shares


def random_passes(data_set: int, count: int, seed: int = 1) -> list:
    rng = random.Random(seed)
    return [rng.sample(range(data_set), data_set) for _ in range(count)]


@pytest.mark.parametrize("times", [2, 3, 4, 8])
def test_random_passes_over_n_times_the_cache_keep_one_nth_cached(times):
    passes = random_passes(times * ROOM, 4)
    shares = simulate(passes, lru=False)
    lru_shares = simulate(passes, lru=True)
    print(
        f"\n{times}x the cache, random-order passes 2-4: "
        f"hits {', '.join(f'{s:.1%}' for s in shares[1:])} (LRU: {', '.join(f'{s:.1%}' for s in lru_shares[1:])})"
    )
    for share in shares[1:]:
        assert share >= (1 - policy.PROBATION_FRACTION) / times - 0.005
    if times == 2:
        assert min(shares[1:]) >= 0.45  # the target
    assert max(lru_shares[1:]) < min(shares[1:]) / 2


def test_a_one_time_scan_does_not_flush_the_working_set():
    hot = list(range(400))
    scan = list(range(10_000, 10_000 + 5 * ROOM // 2))  # read once, 2.5x the cache
    shares = simulate([hot, scan, hot], lru=False)
    lru_shares = simulate([hot, scan, hot], lru=True)
    assert shares[2] == 1.0
    assert lru_shares[2] == 0.0


def test_a_working_set_read_during_a_long_scan_stays():
    rng = random.Random(3)
    hot = list(range(400))
    scan: list = []
    for i in range(20 * ROOM):  # 20x the cache, read once, the working set read all along
        scan.append(100_000 + i)
        if i % 50 == 0:
            scan.extend(rng.sample(hot, 8))
    shares = simulate([hot, scan, hot], lru=False)
    assert shares[2] == 1.0


def test_a_changed_working_set_turns_the_resident_set_over():
    old, new = list(range(900)), list(range(50_000, 50_900))  # each 0.9x the cache
    rng = random.Random(5)
    passes = [rng.sample(old, len(old)) for _ in range(3)] + [rng.sample(new, len(new)) for _ in range(7)]
    shares = simulate(passes, lru=False)
    assert shares[1] == shares[2] == 1.0
    # The old set goes once it was unread while 3 rooms (IDLE_MIN_ROOMS) or 1.5x its
    # longest gap were admitted (~3.3 passes of the new one), then the new set fills the room.
    assert shares[3:6] < [0.1, 0.1, 0.1] and shares[-2:] == [1.0, 1.0]


def test_a_changed_data_set_larger_than_the_cache_turns_over_too():
    rng = random.Random(6)
    old, new = range(2 * ROOM), range(50_000, 50_000 + 2 * ROOM)
    passes = [rng.sample(old, len(old)) for _ in range(3)] + [rng.sample(new, len(new)) for _ in range(6)]
    shares = simulate(passes, lru=False)
    assert min(shares[-3:]) >= 0.45
    assert sum(shares[3:]) < 6 * 0.45  # (it takes a few passes: the old set might have come back)


def test_an_object_read_again_soon_is_promoted():
    index = Residency(lambda obj: obj.size)
    index.settle(10)
    for key in range(9):  # the resident set full (9.5 of 10)
        obj = Obj()
        index.admit(key, obj, 1)
        obj.size = 1
        index.grew(key, 1, 1)
    new = Obj()
    index.admit("new", new, 1)
    new.size = 1
    index.grew("new", 1, 1)
    assert not index.is_resident("new")
    index.read("new", new)
    assert index.is_resident("new") and index.promotions == 1
    assert index.resident_bytes <= 9.5 and index.demotions == 1  # the least recently read went to probation
    assert not index.is_resident(0) and index.victim() == 0


def test_the_journal_order_keeps_the_resident_set_across_mounts():
    """A later mount loads the entries in the order `values()` gave the journal: the
    same ones become resident."""
    index = Residency(lambda obj: obj.size)
    index.settle(ROOM)
    for key in range(2 * ROOM):
        obj = index.get(key) or Obj()
        index.admit(key, obj, 1)
        obj.size = 1
        index.grew(key, 1, 1)
        while index.resident_bytes + index.probation_bytes > ROOM:
            index.pop(index.victim())
    resident = {key for key in index if index.is_resident(key)}
    later = Residency(lambda obj: obj.size)
    for obj in index.values():
        key = next(k for k in index if index.get(k) is obj)
        later.load(key, obj)
    later.settle(ROOM)
    assert {key for key in later if later.is_resident(key)} == resident
