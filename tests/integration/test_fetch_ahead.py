"""Fetch-ahead (bucketfs/core/fetchahead.py) on real mounts of rclone's S3 server.

An ImageFolder-like tree of small files is read once in a shuffled order by 8
threads (plain open/read): every byte must match the upload, a fetch-ahead pass must
have run, and no object may be fetched twice in one epoch. A walk in listing order
and `--fetch-ahead off` start no pass; a small `--max-memory` below the data set's
size never evicts a file fetched ahead before it is read; with `--cache-dir` what
was fetched ahead lands on disk, so the next mount reads it all without a GET.

GETs are counted twice: by a counting proxy between the mount and the server (per
key, from outside the daemon) and by the daemon's `backend.requests.get`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import random
import signal

import pytest

from bucketfs.testing.counting_proxy import CountingProxy, counting_proxy
from bucketfs.testing.mounting import drop_page_cache

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

KB = 1000
MiB = 1024 * 1024
CLASSES = 8
PER_CLASS = 60
FILES_COUNT = CLASSES * PER_CLASS
READER_THREADS = 8


def image_tree(low_bytes: int = 20 * KB, high_bytes: int = 120 * KB, seed: int = 0) -> dict:
    """{key: bytes}: train/classNN/imgNNNN.jpg, CLASSES x PER_CLASS files of random bytes."""
    rng = random.Random(seed)
    return {
        f"train/class{c:02d}/img{i:04d}.jpg": rng.randbytes(rng.randrange(low_bytes, high_bytes + 1))
        for c in range(CLASSES)
        for i in range(PER_CLASS)
    }


@pytest.fixture
def proxy(rclone_server):
    """A counting proxy in front of rclone: the mounts' --endpoint-url."""
    with counting_proxy(rclone_server.endpoint_url) as p:
        yield p


def seeded(rclone_server, bucket, tree: dict) -> dict:
    rclone_server.write_files(bucket, tree)
    return {key: hashlib.sha256(data).digest() for key, data in tree.items()}


def scan(mount) -> list:
    """The tree's files as ImageFolder's scan finds them (a walk: listings only)."""
    found = []
    for root, dirs, files in os.walk(mount.path("train")):
        dirs.sort()
        found.extend(os.path.relpath(os.path.join(root, name), mount.mountpoint) for name in sorted(files))
    return found


def read_digest(mount, key: str) -> tuple:
    with open(mount.path(key), "rb") as f:
        return key, hashlib.sha256(f.read()).digest()


def shuffled_epoch(mount, keys, seed: int, threads: int = READER_THREADS) -> dict:
    """Every file read whole once, in a shuffled order, by `threads` threads."""
    order = list(keys)
    random.Random(seed).shuffle(order)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return dict(pool.map(lambda key: read_digest(mount, key), order))


def assert_bytes_match(read: dict, digests: dict) -> None:
    assert set(read) == set(digests)
    wrong = sorted(key for key, digest in read.items() if digest != digests[key])
    assert not wrong, f"{len(wrong)} files differ from what was uploaded, e.g. {wrong[:5]}"


def gets_per_key(proxy: CountingProxy, bucket: str) -> collections.Counter:
    prefix = f"/{bucket}/"
    return collections.Counter(r.path[len(prefix) :] for r in proxy.object_gets() if r.path.startswith(prefix))


def assert_at_most_one_get_per_file(proxy: CountingProxy, bucket: str, stats: dict, files_count: int) -> None:
    """One GET per object, but for files the kernel was given whole and dropped before
    they were read (`read.kernel_dropped_gets`: each is fetched again). This VM's
    proactive reclaim (DAMON pageout of pages not accessed lately) drops a few pages
    pushed into the page cache, and some read once, within seconds."""
    per_key = gets_per_key(proxy, bucket)
    dropped = stats.get("read.kernel_dropped_gets", 0)
    twice = {key: n for key, n in per_key.items() if n > 1}
    assert sum(n - 1 for n in twice.values()) <= dropped, (
        f"{len(twice)} objects fetched more than once in one epoch, e.g. {list(twice.items())[:5]}; "
        f"{dropped} files dropped by the kernel; the GETs' paths and who read what: "
        f"{ {k: v for k, v in sorted(stats.items()) if k.startswith(('open.', 'backend.get_path', 'fetch_ahead.push', 'fetch_ahead.kept', 'read.', 'fuse.'))} }"
    )
    assert sum(per_key.values()) <= files_count + dropped
    assert stats.get("backend.requests.get", 0) <= files_count + dropped, fetch_ahead_counters(stats)


def fetch_ahead_counters(stats: dict) -> dict:
    """What a failed assertion shows: fetch-ahead's, the GETs' and the budget's counters."""
    return {
        k: v
        for k, v in sorted(stats.items())
        if k.startswith(("fetch_ahead.", "backend.", "memory.", "disk_cache.", "cache.", "read.kernel"))
    }


def test_a_shuffled_epoch_is_fetched_ahead_once_and_a_second_costs_no_get(
    rclone_server, s3_bucket, mount_factory, proxy
):
    digests = seeded(rclone_server, s3_bucket, image_tree())
    m = mount_factory(rclone_server, s3_bucket, "", endpoint_url=proxy.url)
    assert scan(m) == sorted(digests)

    assert_bytes_match(shuffled_epoch(m, digests, seed=1), digests)
    stats = m.stats()
    assert stats.get("fetch_ahead.passes", 0) >= 1, fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.files", 0) > 0, fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.failed", 0) == 0, fetch_ahead_counters(stats)
    assert stats.get("backend.retries", 0) == 0, fetch_ahead_counters(stats)  # the burst of GETs: none timed out
    # Every file fetched ahead was then opened: none was fetched for nothing.
    assert stats.get("fetch_ahead.used_files", 0) == stats["fetch_ahead.files"], fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.held_bytes", 0) == 0, fetch_ahead_counters(stats)
    assert_at_most_one_get_per_file(proxy, s3_bucket, stats, FILES_COUNT)
    epoch1_gets = len(proxy.object_gets())

    # Epoch 2, another order, the page cache kept: not one object GET (but for the
    # files the kernel dropped since: see assert_at_most_one_get_per_file).
    assert_bytes_match(shuffled_epoch(m, digests, seed=2), digests)
    after = m.stats()
    new_gets = proxy.object_gets()[epoch1_gets:]
    dropped = after.get("read.kernel_dropped_gets", 0) - stats.get("read.kernel_dropped_gets", 0)
    assert len(new_gets) <= dropped, (
        f"epoch 2 made {len(new_gets)} object GETs, e.g. {new_gets[:5]}; {fetch_ahead_counters(after)}"
    )
    assert after.get("backend.requests.get", 0) == stats.get("backend.requests.get", 0) + len(new_gets)
    # Epoch 2 reopened epoch 1's files, which ended its pass: nothing held was left unread.
    assert after.get("fetch_ahead.unused_files", 0) == 0, fetch_ahead_counters(after)


def _sorted_walk(m, keys) -> dict:
    """ImageFolder's order with shuffle=False: the listing order, one reader."""
    return dict(read_digest(m, key) for key in scan(m))


def _quarters(m, keys) -> dict:
    """4 threads, each reading a contiguous quarter of the listing order."""
    ordered = scan(m)
    size = -(-len(ordered) // 4)
    chunks = [ordered[i : i + size] for i in range(0, len(ordered), size)]
    with concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool:
        parts = pool.map(lambda chunk: [read_digest(m, key) for key in chunk], chunks)
        return dict(pair for part in parts for pair in part)


@pytest.mark.parametrize("read_in_order", [_sorted_walk, _quarters], ids=["sorted-walk", "4-threads-quarters"])
def test_reads_in_listing_order_start_no_pass(rclone_server, s3_bucket, mount_factory, proxy, read_in_order):
    digests = seeded(rclone_server, s3_bucket, image_tree())
    m = mount_factory(rclone_server, s3_bucket, "", endpoint_url=proxy.url)

    assert_bytes_match(read_in_order(m, digests), digests)
    stats = m.stats()
    assert stats.get("fetch_ahead.passes", 0) == 0, fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.files", 0) == 0, fetch_ahead_counters(stats)
    assert_at_most_one_get_per_file(proxy, s3_bucket, stats, FILES_COUNT)


def test_fetch_ahead_off_fetches_nothing_ahead(rclone_server, s3_bucket, mount_factory, proxy):
    digests = seeded(rclone_server, s3_bucket, image_tree())
    m = mount_factory(rclone_server, s3_bucket, "", "--fetch-ahead", "off", endpoint_url=proxy.url)
    assert scan(m) == sorted(digests)

    assert_bytes_match(shuffled_epoch(m, digests, seed=3), digests)
    stats = m.stats()
    assert stats.get("fetch_ahead.passes", 0) == 0, fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.files", 0) == 0, fetch_ahead_counters(stats)
    assert_at_most_one_get_per_file(proxy, s3_bucket, stats, FILES_COUNT)


@pytest.mark.parametrize("workers", ["0", "1"], ids=["into-memory", "into-the-page-cache"])
def test_a_budget_smaller_than_the_data_never_evicts_a_file_fetched_ahead(
    rclone_server, s3_bucket, mount_factory, proxy, workers
):
    tree = image_tree(low_bytes=20 * KB, high_bytes=150 * KB, seed=4)
    total_bytes = sum(map(len, tree.values()))
    assert total_bytes >= 38 * MiB  # well over --max-memory
    digests = seeded(rclone_server, s3_bucket, tree)
    m = mount_factory(
        rclone_server, s3_bucket, "", "--max-memory", "24M", "--fetch-ahead-workers", workers, endpoint_url=proxy.url
    )
    assert scan(m) == sorted(digests)

    assert_bytes_match(shuffled_epoch(m, digests, seed=5), digests)
    stats = m.stats()
    assert stats.get("fetch_ahead.passes", 0) >= 1, fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.files", 0) > 0, fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.failed", 0) == 0, fetch_ahead_counters(stats)
    if workers == "0":
        assert stats.get("cache.evictions", 0) > 0, fetch_ahead_counters(stats)  # the budget did not hold it all
    else:
        # The files went to the kernel's page cache, not into the 24 MiB.
        assert stats.get("fetch_ahead.push_pushed", 0) > 0, fetch_ahead_counters(stats)
    # A held file is never evicted before its reader opens it: no object twice.
    assert_at_most_one_get_per_file(proxy, s3_bucket, stats, FILES_COUNT)
    assert stats.get("fetch_ahead.used_files", 0) == stats["fetch_ahead.files"], fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.held_bytes", 0) == 0, fetch_ahead_counters(stats)
    # Fetch-ahead's GETs and what it holds stay inside the budget: RSS <= --max-memory + 150 MiB.
    with open(f"/proc/{m.proc.pid}/status") as f:
        peak_bytes = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    assert peak_bytes <= (24 + 150) * MiB, f"peak RSS {peak_bytes >> 20} MiB"

    # Reopening a file of the pass ends it: anything still held would count as unused.
    read_digest(m, sorted(digests)[0])
    end = m.stats()
    assert end.get("fetch_ahead.unused_files", 0) == 0, fetch_ahead_counters(end)
    assert end.get("fetch_ahead.unused_bytes", 0) == 0, fetch_ahead_counters(end)


def test_files_fetched_ahead_land_in_the_disk_cache_for_the_next_mount(
    rclone_server, s3_bucket, mount_factory, proxy, tmp_path
):
    digests = seeded(rclone_server, s3_bucket, image_tree(seed=6))
    cache_dir = str(tmp_path / "cache")
    m = mount_factory(rclone_server, s3_bucket, "", "--cache-dir", cache_dir, endpoint_url=proxy.url)
    assert scan(m) == sorted(digests)

    assert_bytes_match(shuffled_epoch(m, digests, seed=7), digests)
    first = m.stats()
    assert first.get("fetch_ahead.passes", 0) >= 1, fetch_ahead_counters(first)
    assert first.get("fetch_ahead.files", 0) > 0, fetch_ahead_counters(first)
    assert_at_most_one_get_per_file(proxy, s3_bucket, first, FILES_COUNT)
    m.close()  # unmounted: stores still queued land now
    first_gets = len(proxy.object_gets())

    later = mount_factory(rclone_server, s3_bucket, "", "--cache-dir", cache_dir, endpoint_url=proxy.url)
    assert_bytes_match(shuffled_epoch(later, digests, seed=8), digests)
    second = later.stats()
    new_gets = proxy.object_gets()[first_gets:]
    assert not new_gets, (
        f"the mount after made {len(new_gets)} object GETs, e.g. {new_gets[:5]}; "
        f"first mount: {fetch_ahead_counters(first)}; this mount: {fetch_ahead_counters(second)}"
    )
    assert second.get("backend.requests.get", 0) == 0, fetch_ahead_counters(second)


def fetch_ahead_workers(daemon_pid: int) -> set:
    """The daemon's live children running the fetch-ahead worker's module."""
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                parent_pid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent_pid == daemon_pid and b"bucketfs.backends.http.pushworker" in command:
            found.add(int(name))
    return found


def epoch_signalling_workers(m, digests: dict, seed: int, at: tuple, sig: int, signalled: list) -> dict:
    """A shuffled epoch (key -> what was read) that sends `sig` to every fetch-ahead
    worker as it reaches each read index in `at` (the pass is running by then: it
    started within the first 32 opens). The pids go into `signalled` as they are sent,
    for the caller's checks and cleanup even if the epoch fails."""
    order = list(digests)
    random.Random(seed).shuffle(order)

    def read_and_signal(i_key):
        i, key = i_key
        if i in at:
            for pid in fetch_ahead_workers(m.proc.pid):
                os.kill(pid, sig)
                signalled.append(pid)
        return read_digest(m, key)

    with concurrent.futures.ThreadPoolExecutor(READER_THREADS) as pool:
        return dict(pool.map(read_and_signal, enumerate(order)))


def test_pushed_files_are_read_from_the_page_cache_without_a_read_reaching_the_daemon(
    rclone_server, s3_bucket, mount_factory, proxy
):
    digests = seeded(rclone_server, s3_bucket, image_tree(seed=8))
    m = mount_factory(rclone_server, s3_bucket, "", endpoint_url=proxy.url)
    assert scan(m) == sorted(digests)  # (READDIRPLUS: the kernel holds every file's inode)
    # (The mount root's GETATTR, when the kernel asks for it as the mount comes up, is
    # not the epoch's.)
    getattrs_before = m.stats().get("fuse.getattr", 0)

    assert_bytes_match(shuffled_epoch(m, digests, seed=9), digests)
    stats = m.stats()
    pushed = stats.get("fetch_ahead.push_pushed", 0)
    assert pushed >= FILES_COUNT // 2, fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.failed", 0) == 0, fetch_ahead_counters(stats)
    assert stats["backend.fetch_ahead_workers"] == 1
    # Each file the daemon served itself costs it a READ or two; a pushed one none.
    reads = stats.get("fuse.read", 0)
    assert reads <= 2 * (FILES_COUNT - pushed), (reads, fetch_ahead_counters(stats))
    # ... and, for one in several (a told push), a GETATTR: how the pass hears of opens.
    told = stats.get("fetch_ahead.push_told", 0)
    assert 0 < told <= pushed // 4, fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.push_told_opened", 0) == told, fetch_ahead_counters(stats)
    assert stats.get("fuse.getattr", 0) - getattrs_before <= told, fetch_ahead_counters(stats)
    assert_at_most_one_get_per_file(proxy, s3_bucket, stats, FILES_COUNT)


def test_a_file_opened_before_any_push_reached_it_is_pushed_while_its_open_waits(
    rclone_server, s3_bucket, mount_factory, proxy
):
    """Python's open() asks isatty() (a FUSE_IOCTL) before the first read(): the daemon
    holds it while a worker pushes the file, so the read finds the page cache and no
    READ reaches the daemon (core/openpush.py)."""
    digests = seeded(rclone_server, s3_bucket, image_tree(seed=17))
    m = mount_factory(rclone_server, s3_bucket, "", endpoint_url=proxy.url)
    assert scan(m) == sorted(digests)
    # The first opens are OPENs, until the kernel opens files itself (kernel.md): their
    # READs come.
    first = sorted(digests)[1:4]
    assert_bytes_match(dict(read_digest(m, key) for key in first), {key: digests[key] for key in first})
    before = m.stats()
    assert before.get("fuse.open", 0) > 0 and before.get("fuse.read", 0) > 0
    keys = sorted(digests)[5::37]  # (a few, one at a time: no pass has pushed them)
    assert_bytes_match(dict(read_digest(m, key) for key in keys), {key: digests[key] for key in keys})
    stats = m.stats()
    counts = {k: v - before.get(k, 0) for k, v in stats.items() if k.startswith(("open.", "fuse", "read.kernel"))}
    assert counts.get("open.held", 0) == counts.get("open.pushed_pushed", 0) == len(keys), counts
    assert counts.get("fuse_loop.ioctls_held", 0) == len(keys), counts
    assert counts.get("fuse.open", 0) == 0 and counts.get("fuse.read", 0) <= counts.get("read.kernel_dropped_gets", 0)
    assert_at_most_one_get_per_file(proxy, s3_bucket, stats, len(first) + len(keys))


def test_files_opened_by_paths_never_listed_are_pushed_once_the_daemon_lists_their_directories(
    rclone_server, s3_bucket, mount_factory, proxy
):
    """A loader with a list of paths (a manifest, brace expansion) never lists: the
    daemon lists each directory of the pass through the mount itself, so that the
    kernel holds the inodes the pushes go to."""
    digests = seeded(rclone_server, s3_bucket, image_tree(seed=12))
    m = mount_factory(rclone_server, s3_bucket, "", endpoint_url=proxy.url)

    assert_bytes_match(shuffled_epoch(m, digests, seed=13), digests)
    stats = m.stats()
    assert stats.get("fetch_ahead.dirs_listed_to_kernel", 0) >= CLASSES - 1, fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.push_pushed", 0) >= FILES_COUNT // 2, fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.push_no_inode", 0) == 0, fetch_ahead_counters(stats)
    assert stats.get("fetch_ahead.failed", 0) == 0, fetch_ahead_counters(stats)
    assert_at_most_one_get_per_file(proxy, s3_bucket, stats, FILES_COUNT)


def test_a_fetch_ahead_worker_killed_mid_pass_costs_no_reader_a_wrong_byte(rclone_server, s3_bucket, mount_factory):
    digests = seeded(rclone_server, s3_bucket, image_tree(seed=10))
    with counting_proxy(rclone_server.endpoint_url) as slow:
        m = mount_factory(rclone_server, s3_bucket, "", endpoint_url=slow.url)
        assert scan(m) == sorted(digests)
        killed: list = []
        read = epoch_signalling_workers(m, digests, 11, (FILES_COUNT // 8, FILES_COUNT // 3), signal.SIGKILL, killed)
        assert_bytes_match(read, digests)
        assert killed, "no fetch-ahead worker was running"
        stats = m.stats()
        assert stats["backend.fetch_ahead_worker_restarts"] >= 1, fetch_ahead_counters(stats)
        assert not any(k.startswith("errors.") for k in stats), fetch_ahead_counters(stats)
        assert f"fetch-ahead worker {killed[0]} ended" in m.stderr_text
        assert "Traceback" not in m.stderr_text and "unexpected error" not in m.stderr_text
        assert m.proc.poll() is None, "the daemon died"


def test_after_the_page_cache_is_dropped_pushed_files_are_read_from_the_daemons_kept_copies(
    rclone_server, s3_bucket, mount_factory, proxy
):
    """The workers receive pushed files into shared memory the daemon keeps (within
    --max-memory): once the kernel dropped its page cache, the next epoch reads them
    from there, with no GET; a worker killed mid-pass spoils no kept byte."""
    if os.geteuid() != 0:
        pytest.skip("dropping the page cache needs root")
    digests = seeded(rclone_server, s3_bucket, image_tree(seed=14))
    m = mount_factory(rclone_server, s3_bucket, "", endpoint_url=proxy.url)
    assert scan(m) == sorted(digests)
    killed: list = []
    assert_bytes_match(epoch_signalling_workers(m, digests, 15, (FILES_COUNT // 3,), signal.SIGKILL, killed), digests)
    first = m.stats()
    assert killed, "no fetch-ahead worker was running"
    assert first.get("fetch_ahead.kept_files", 0) >= FILES_COUNT // 3, fetch_ahead_counters(first)
    assert drop_page_cache()
    gets_before = first.get("backend.requests.get", 0)

    assert_bytes_match(shuffled_epoch(m, digests, seed=16), digests)
    second = m.stats()
    kept_read = second.get("fetch_ahead.kept_read", 0)
    assert kept_read >= FILES_COUNT // 3, fetch_ahead_counters(second)
    # The rest was read through the daemon in the first epoch: in its block cache.
    assert second.get("backend.requests.get", 0) - gets_before <= FILES_COUNT - kept_read, fetch_ahead_counters(second)
    assert "Traceback" not in m.stderr_text and "unexpected error" not in m.stderr_text


@pytest.mark.timeout(240)
def test_a_stopped_fetch_ahead_worker_holds_no_reader_forever(rclone_server, s3_bucket, mount_factory):
    """SIGSTOP: a worker that neither answers nor dies. The READs that wait on its pushes
    get their files once the watchdog kills it (--read-timeout plus 5 s past a GET's
    deadline); every byte right, the daemon serving throughout."""
    digests = seeded(rclone_server, s3_bucket, image_tree(seed=12))
    with counting_proxy(rclone_server.endpoint_url) as proxy:
        m = mount_factory(rclone_server, s3_bucket, "", "--read-timeout", "2", endpoint_url=proxy.url)
        assert scan(m) == sorted(digests)
        stopped: list = []
        try:
            read = epoch_signalling_workers(m, digests, 13, (FILES_COUNT // 8,), signal.SIGSTOP, stopped)
            assert_bytes_match(read, digests)
            assert stopped, "no fetch-ahead worker was running"
            stats = m.stats()
            assert stats["backend.fetch_ahead_worker_restarts"] >= 1, fetch_ahead_counters(stats)
            assert "silent past a GET's deadline" in m.stderr_text
            assert not any(k.startswith("errors.") for k in stats), fetch_ahead_counters(stats)
            assert m.proc.poll() is None, "the daemon died"
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
