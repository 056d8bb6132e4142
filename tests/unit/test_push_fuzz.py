"""Randomized test of fetch-ahead into the kernel's page cache (fetch-ahead workers),
on the in-memory backend's fake kernel: many seeded scenarios, each a random tree of
small files, a random memory budget, and shuffled epochs (whole or in part) read by
concurrent readers the way the kernel serves them: from the page cache when a push
put the file there (a GETATTR first if the push ended its attributes), else through
the daemon's READs. Some scenarios also fail a share of GETs, have the kernel lack a
share of the inodes (a push refused with ENOENT), or drop pushed pages before they
are read (memory pressure, a host's proactive reclaim).

Every file a reader gets must be the object's bytes. Once the passes are over (idle)
and every fetch done: each file fetched ahead is counted once, opened or unused or
failed; no memory is left reserved; and no object was fetched more than once per
epoch but for pages the kernel dropped.

`pytest tests/unit/test_push_fuzz.py -k seed_7` re-runs one scenario; more seeds with
BUCKETFS_PUSH_FUZZ_SEEDS.
"""

import dataclasses
import os
import random

import pytest
import trio
import trio.testing

from bucketfs import errors
from bucketfs.core import fetchahead
from tests.unit.helpers import read_all, resolve, run_fs
from tests.unit.test_read_fuzz import Problems, Store, deterministic_scheduling, leaked_bytes

KiB, MiB = 1024, 1024 * 1024
SEEDS = range(int(os.environ.get("BUCKETFS_PUSH_FUZZ_SEEDS", "24")))


@dataclasses.dataclass
class Scenario:
    seed: int
    files: dict
    max_memory_bytes: int
    get_fail_rate: float
    no_inode_share: float  # of the files' inodes the kernel does not hold
    drop_rate: float  # pushed files whose pages the kernel drops before they are read
    epochs: list  # the share of the files each epoch reads
    readers: int

    def describe(self) -> str:
        drawn = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("seed", "files")}
        return f"seed {self.seed}: {len(self.files)} files, {drawn}"


def make_scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    directories = rng.randint(1, 5)
    files = {
        f"train/c{rng.randrange(directories)}/img{i:04d}.jpg": rng.randbytes(rng.randrange(1, 96 * KiB))
        for i in range(rng.randint(60, 240))
    }
    return Scenario(
        seed,
        files,
        max_memory_bytes=rng.choice([16, 32, 64]) * MiB,
        get_fail_rate=rng.choice([0.0, 0.0, 0.05, 0.2]),
        no_inode_share=rng.choice([0.0, 0.0, 0.1, 0.7]),
        drop_rate=rng.choice([0.0, 0.0, 0.05, 0.3]),
        epochs=[rng.choice([1.0, 1.0, 0.5, 0.2]) for _ in range(rng.randint(1, 3))],
        readers=rng.randint(1, 12),
    )


async def kernel_read(fs, store, path: str, rng: random.Random, scenario: Scenario, problems: Problems) -> None:
    """One loader's read of `path`, as the kernel serves it."""
    allowed = (errors.TransientError,) if scenario.get_fail_rate else ()
    try:
        node = await resolve(fs, path)
        if node.ino in store.kernel_pages and rng.random() < scenario.drop_rate:
            del store.kernel_pages[node.ino]  # (reclaimed before it was read)
            store.dropped += 1
        pages = store.kernel_pages.get(node.ino)
        if pages is not None:
            if node.ino in store.attributes_ended:
                store.attributes_ended.discard(node.ino)
                await fs.getattr(node.ino)  # (stat() asks)
            got = bytes(pages)
        else:
            got = await read_all(fs, path, rng.choice([4 * KiB, 128 * KiB]))
    except allowed:
        return
    except Exception as exc:  # anything else would reach the reader as EIO: a bug
        problems.append(f"{path}: raised {exc!r}")
        return
    problems.check(path, got, scenario.files[path])


def run_scenario(scenario: Scenario) -> tuple:
    rng = random.Random(scenario.seed * 7919 + 1)
    store = Store(scenario.files, rng, scenario.get_fail_rate)
    store.dropped = 0
    problems = Problems()

    async def body(fs):
        fs.start_pushing(-1)
        inodes = {}
        for path in scenario.files:
            inodes[path] = (await resolve(fs, path)).ino
        store.kernel_inodes = {ino for ino in inodes.values() if rng.random() >= scenario.no_inode_share}
        for directory in sorted({path.rsplit("/", 1)[0] for path in scenario.files}):
            fs.note_listed_to_kernel(await resolve(fs, directory))
        for share in scenario.epochs:
            order = sorted(scenario.files)
            rng.shuffle(order)
            queue = iter(order[: max(1, int(share * len(order)))])

            async def reader(reader_rng, queue):
                for path in queue:
                    await kernel_read(fs, store, path, reader_rng, scenario, problems)

            async with trio.open_nursery() as nursery:
                for _ in range(scenario.readers):
                    nursery.start_soon(reader, random.Random(rng.random()), queue)
        # The loader stopped: its pass goes idle and lets go; every fetch ends.
        await trio.sleep(fetchahead.PASS_IDLE_S + 1)
        await trio.testing.wait_all_tasks_blocked()
        return fs.snapshot(), leaked_bytes(fs), fs.fetch_ahead._pass

    stats, leaked, still_running = run_fs(
        store, body, clock=trio.testing.MockClock(autojump_threshold=0), max_memory_bytes=scenario.max_memory_bytes
    )
    return problems, stats, leaked, still_running, store


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed_{s}" for s in SEEDS])
def test_pushed_epochs_return_the_right_bytes_and_count_every_file_once(seed, monkeypatch):
    monkeypatch.setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", False)  # restored after the test
    monkeypatch.setattr(trio._core._run, "_r", trio._core._run._r)
    monkeypatch.setattr(fetchahead, "PASS_IDLE_S", 5.0)  # (the run has 30 s of trio time)
    deterministic_scheduling(seed)
    scenario = make_scenario(seed)
    problems, stats, leaked, still_running, store = run_scenario(scenario)
    where = scenario.describe() + "\n" + str({k: v for k, v in sorted(stats.items()) if k.startswith("fetch_ahead")})
    assert not problems, where + "\n" + "\n".join(problems[:20])
    assert still_running is None, where
    files = stats.get("fetch_ahead.files", 0)
    counted = sum(stats.get(f"fetch_ahead.{name}", 0) for name in ("used_files", "unused_files", "failed"))
    assert counted == files, where
    assert leaked == 0, where + f"\n{leaked} bytes of memory reserved that nothing gives back"
    # Each object at most once an epoch (a pushed file's push and its READ share one
    # GET), but for files the kernel dropped or lacked the inode of and GETs that failed.
    bound = len(scenario.files) * len(scenario.epochs) + store.injected + store.dropped
    assert store.requests["get"] <= bound + stats.get("fetch_ahead.push_no_inode", 0), where
