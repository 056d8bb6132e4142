"""Fetch workers (`--fetch-workers N`, bucketfs/backends/http/workerengine.py and
fetchworker.py) on real mounts of rclone's S3 server.

The workers are the daemon's child processes (`python -m
bucketfs.backends.http.fetchworker ...`) that run the GETs of up to 2 MiB over libcurl;
larger GETs stay on the daemon's urllib3 threads. What is checked from outside:

- workers SIGKILLed while 16 readers read a mixed tree (empty, tiny, ~100 KB, ~1 MiB,
  ~3 MiB files, 8 MiB shards streamed, large files read by random preads) cost no
  reader an error or a wrong byte: their GETs fail and are retried on a live worker, and
  each dead worker is replaced (`backend.fetch_workers`, `backend.fetch_worker_restarts`);
- an unmount leaves no worker running, nor does a SIGKILL of the daemon (PR_SET_PDEATHSIG:
  a worker that is stopped, so cannot see its socket close, dies too);
- the workers change nothing in the caching: a second pass over the files fetched whole
  makes no GET.

Workers are found in /proc: the daemon's children whose command line names the module.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import random
import signal
import subprocess
import threading

import pytest

from bucketfs.testing.counting_proxy import counting_proxy
from bucketfs.testing.fault_proxy import fault_proxy
from bucketfs.testing.mounting import EXIT_DEADLINE_S, force_unmount, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

KB = 1000
KiB = 1024
MiB = 1024 * 1024
WORKERS = 2
READER_THREADS = 16
KILLS = 5
WORKER_MODULE = b"bucketfs.backends.http.fetchworker"
# A replacement is started at once (workerengine.py): Popen of a Python interpreter.
REPLACEMENT_DEADLINE_S = 20.0
# A worker ends within this of the daemon's end, or of an unmount.
WORKER_EXIT_DEADLINE_S = 20.0
# Every GET through the proxy waits this long first: GETs are in flight, in the
# workers, whenever a kill comes.
GET_DELAY_S = 0.02
# Readers wait at most this long for the killer to let the next part of their plan in.
GATE_DEADLINE_S = 150.0


# -- the tree ------------------------------------------------------------------------
def mixed_tree(seed: int = 37) -> dict:
    """{key: bytes}: ~310 files of every size class the read path tells apart."""
    rng = random.Random(seed)
    tree = {}
    for i in range(12):
        tree[f"train/empty/e{i:03d}.txt"] = b""
    for i in range(48):
        tree[f"train/tiny/t{i:03d}.txt"] = rng.randbytes(rng.randrange(1, 64))
    for c in range(4):  # ImageFolder-like: the curl path, fetched whole at open
        for i in range(50):
            tree[f"train/class{c}/img{i:03d}.jpg"] = rng.randbytes(rng.randrange(80 * KB, 120 * KB))
    for i in range(32):  # ~1 MiB: still one GET on the curl path (<= 2 MiB)
        tree[f"train/mid/m{i:03d}.bin"] = rng.randbytes(MiB + rng.randrange(-64 * KiB, 64 * KiB))
    for i in range(12):  # ~3 MiB: one GET of > 2 MiB, on the urllib3 threads
        tree[f"train/large/l{i:03d}.bin"] = rng.randbytes(3 * MiB + rng.randrange(-128 * KiB, 128 * KiB))
    for i in range(4):  # shards past --small-file-bytes (8M): streamed with read-ahead
        tree[f"shards/shard-{i:06d}.tar"] = rng.randbytes(8 * MiB + rng.randrange(1, 64 * KiB))
    for i in range(2):  # past --small-file-bytes, not shards: random preads go block by block
        tree[f"random/big{i}.bin"] = rng.randbytes(12 * MiB + rng.randrange(1, 64 * KiB))
    return tree


def read_plan(tree: dict, seed: int) -> list:
    """[(key, how)] in a shuffled order: shards streamed, the large files and one file in
    four of the rest read by preads at random offsets (every byte, in a shuffled order
    of random-sized pieces), the others read whole."""
    rng = random.Random(seed)
    plan = []
    for key in sorted(tree):
        if key.startswith("shards/"):
            how = "stream"
        elif key.startswith("random/") or rng.random() < 0.25:
            how = "preads"
        else:
            how = "whole"
        plan.append((key, how))
    rng.shuffle(plan)
    return plan


class Pass:
    """One pass of READER_THREADS threads over a read plan: every byte compared with the
    tree, failures and wrong bytes collected (not raised in the threads).

    With `segments` > 1 the plan is cut into that many consecutive parts of about equal
    bytes, and no file of part j > 0 is opened before `gates[j - 1]` is set: a killer
    opens them one by one, so the pass cannot end before its last kill."""

    def __init__(self, mount, tree: dict, plan: list, seed: int, segments: int = 1):
        self.mount, self.tree, self.plan = mount, tree, plan
        self.total_bytes = sum(len(tree[key]) for key, _ in plan)
        self.read_bytes = 0  # bytes read so far, by every reader (not only by files done)
        self.done_files = 0
        self.started_files = 0
        self.failures: list = []  # (key, how, errno name, repr)
        self.wrong: list = []  # (key, how, what)
        self._lock = threading.Lock()
        self._seed = seed
        self.segment_of: list = []  # plan index -> its part
        self.segment_start_bytes = [0] * segments  # bytes of the plan before each part
        self.segment_bytes = [0] * segments
        at_bytes = 0
        for key, _how in plan:
            segment = min(at_bytes * segments // max(self.total_bytes, 1), segments - 1)
            if segment and not self.segment_bytes[segment]:
                self.segment_start_bytes[segment] = at_bytes
            self.segment_of.append(segment)
            self.segment_bytes[segment] += len(tree[key])
            at_bytes += len(tree[key])
        self.gates = [threading.Event() for _ in range(segments - 1)]

    def open_gates(self) -> None:
        for gate in self.gates:
            gate.set()

    @property
    def in_progress(self) -> int:
        """Files opened and not yet read to their end."""
        with self._lock:
            return self.started_files - self.done_files

    @property
    def finished(self) -> bool:
        with self._lock:
            return self.done_files == len(self.plan)

    def run(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(READER_THREADS) as pool:
            list(pool.map(self._read_one, enumerate(self.plan)))

    def _read_one(self, item) -> None:
        index, (key, how) = item
        segment = self.segment_of[index]
        if segment and not self.gates[segment - 1].wait(GATE_DEADLINE_S):
            with self._lock:
                self.wrong.append((key, how, f"part {segment} of the plan was not let in"))
                self.done_files += 1
            return
        with self._lock:
            self.started_files += 1
        try:
            problem = getattr(self, f"_{how}")(key, random.Random(self._seed * 100_003 + index))
        except OSError as exc:
            with self._lock:
                self.failures.append((key, how, errno.errorcode.get(exc.errno, exc.errno), repr(exc)))
        else:
            if problem:
                with self._lock:
                    self.wrong.append((key, how, problem))
        finally:
            with self._lock:
                self.done_files += 1

    def _progress(self, count_bytes: int) -> None:
        with self._lock:
            self.read_bytes += count_bytes

    def _whole(self, key: str, _rng) -> str:
        with open(self.mount.path(key), "rb") as f:
            got = f.read()
        self._progress(len(got))
        data = self.tree[key]
        if got != data:
            return f"read {len(got)} bytes of {len(data)}, first difference at {_first_difference(got, data)}"
        return ""

    def _stream(self, key: str, _rng) -> str:
        """As a tar loader reads a shard: 1 MiB at a time, in order."""
        data, offset = self.tree[key], 0
        with open(self.mount.path(key), "rb") as f:
            while chunk := f.read(MiB):
                self._progress(len(chunk))
                if chunk != data[offset : offset + len(chunk)]:
                    return f"{len(chunk)} bytes at {offset} differ"
                offset += len(chunk)
        return "" if offset == len(data) else f"the stream ended at {offset} of {len(data)}"

    def _preads(self, key: str, rng: random.Random) -> str:
        """Every byte, by preads of 1 B..256 KiB pieces in a shuffled order."""
        data = self.tree[key]
        pieces, offset = [], 0
        while offset < len(data):
            length = rng.randrange(1, 256 * KiB + 1)
            pieces.append((offset, length))
            offset += length
        rng.shuffle(pieces)
        pieces.append((len(data), 4096))  # past the end: b""
        fd = os.open(self.mount.path(key), os.O_RDONLY)
        try:
            for offset, length in pieces:
                got = os.pread(fd, length, offset)
                self._progress(len(got))
                want = data[offset : offset + length]
                if got != want:
                    return f"pread({length}, {offset}) gave {len(got)} bytes, not the {len(want)} written"
        finally:
            os.close(fd)
        return ""

    def assert_every_byte_right(self) -> None:
        assert self.finished
        # A failed read would have to be EIO (the retries exhausted), never another error.
        assert all(name == "EIO" for _key, _how, name, _text in self.failures), self.failures[:10]
        assert not self.failures, f"{len(self.failures)} reads failed, e.g. {self.failures[:10]}"
        assert not self.wrong, f"{len(self.wrong)} files read wrong, e.g. {self.wrong[:10]}"


def _first_difference(a: bytes, b: bytes) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# -- the workers, from /proc -----------------------------------------------------------
def _status(pid: int):
    """(state, parent pid, command line) of `pid`, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0].decode(), int(fields[1]), cmdline


def worker_alive(pid: int) -> bool:
    """`pid` runs a fetch worker (whoever its parent is now): not gone, not a zombie."""
    status = _status(pid)
    return status is not None and status[0] not in ("Z", "X") and WORKER_MODULE in status[2]


def fetch_workers(daemon_pid: int) -> set:
    """The pids of the fetch workers `daemon_pid` runs: its live children running the module."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            status = _status(int(name))
            if status is not None and status[1] == daemon_pid and worker_alive(int(name)):
                found.add(int(name))
    return found


def wait_for_workers(daemon_pid: int, count: int, without=(), what: str = "", proc=None) -> set:
    """The daemon's workers once there are `count` of them, none of them in `without`."""
    seen: list = []

    def ready() -> bool:
        workers = fetch_workers(daemon_pid)
        seen[:] = [workers]
        return len(workers) == count and not workers & set(without)

    wait_for(ready, REPLACEMENT_DEADLINE_S, what or f"{count} fetch workers", proc=proc)
    return seen[0]


def wait_until_gone(pids, what: str) -> None:
    """Every worker of `pids` ends within WORKER_EXIT_DEADLINE_S (gone or a zombie)."""
    try:
        wait_for(lambda: not any(worker_alive(pid) for pid in pids), WORKER_EXIT_DEADLINE_S, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still running: {sorted(pid for pid in pids if worker_alive(pid))}") from None


def kill_leftovers(pids) -> None:
    """What a failed test leaves: these workers, SIGKILLed by pid (only ours)."""
    for pid in pids:
        if worker_alive(pid):
            os.kill(pid, signal.SIGKILL)


class Killer(threading.Thread):
    """SIGKILLs a random fetch worker KILLS times while a Pass of KILLS + 1 parts reads:
    the k-th kill once half of part k - 1 is read (the rest of it still being read),
    each once the previous one's replacement is running; the k-th kill lets part k in."""

    def __init__(self, daemon_proc, reading: Pass, seed: int):
        super().__init__(name="fetch worker killer", daemon=True)
        self.daemon_proc, self.reading = daemon_proc, reading
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.killed: list = []  # (pid, bytes read, files being read), at each kill
        self.seen: set = set()  # every worker pid seen
        self.error = None

    def run(self) -> None:
        reading = self.reading
        try:
            pid = self.daemon_proc.pid
            workers = wait_for_workers(pid, WORKERS, what="the fetch workers started", proc=self.daemon_proc)
            self.seen |= workers
            for k in range(1, KILLS + 1):
                target_bytes = reading.segment_start_bytes[k - 1] + reading.segment_bytes[k - 1] // 2
                wait_for(
                    lambda target=target_bytes: reading.read_bytes >= target or self.stop.is_set(),
                    120,
                    f"{target_bytes} bytes read (kill {k})",
                )
                if self.stop.is_set():
                    return
                victim = self.rng.choice(sorted(workers))
                os.kill(victim, signal.SIGKILL)
                self.killed.append((victim, reading.read_bytes, reading.in_progress))
                reading.gates[k - 1].set()
                workers = wait_for_workers(
                    pid, WORKERS, without=[victim], what=f"a replacement of worker {victim}", proc=self.daemon_proc
                )
                self.seen |= workers
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            self.error = exc
        finally:
            reading.open_gates()  # (the readers never wait for a killer that stopped)


def worker_counters(stats: dict) -> dict:
    """What a failed assertion shows: the backend's and the errors' counters."""
    return {k: v for k, v in sorted(stats.items()) if k.startswith(("backend.", "errors.", "fetch_ahead.failed"))}


# -- the tests ---------------------------------------------------------------------------
def test_workers_killed_under_load_cost_no_reader_an_error(rclone_server, s3_bucket, mount_factory):
    tree = mixed_tree()
    rclone_server.write_files(s3_bucket, tree)
    with fault_proxy(rclone_server.endpoint_url, delay_s=GET_DELAY_S) as proxy:
        m = mount_factory(rclone_server, s3_bucket, "", "--fetch-workers", str(WORKERS), endpoint_url=proxy.url)
        reading = Pass(m, tree, read_plan(tree, seed=1), seed=1, segments=KILLS + 1)
        killer = Killer(m.proc, reading, seed=2)
        killer.start()
        try:
            reading.run()
        finally:
            killer.stop.set()
            killer.join(timeout=60)
        try:
            assert not killer.is_alive()
            assert killer.error is None, f"the killer: {killer.error!r}"
            assert len(killer.killed) == KILLS, killer.killed
            # Every kill came while files were being read.
            assert all(in_progress for _pid, _read, in_progress in killer.killed), killer.killed
            reading.assert_every_byte_right()

            wait_for(lambda: m.stats()["backend.fetch_workers"] == WORKERS, REPLACEMENT_DEADLINE_S, "2 workers")
            stats = m.stats()
            assert stats["backend.fetch_worker_restarts"] >= KILLS, worker_counters(stats)
            final = wait_for_workers(m.proc.pid, WORKERS, proc=m.proc)
            assert not final & {pid for pid, *_ in killer.killed}
            # Both paths of a GET were taken: the workers' (<= 2 MiB) and urllib3's.
            assert stats.get("backend.get_path.curl", 0) >= len(tree) // 2, worker_counters(stats)
            assert stats.get("backend.get_path.threads", 0) > 0, worker_counters(stats)
            # The kills failed GETs in flight (retried), and no retry ran out.
            assert stats.get("backend.retries", 0) >= 1, (worker_counters(stats), killer.killed)
            assert "failed (ConnectionError: fetch worker" in m.stderr_text
            assert not any(k.startswith("backend.failures.") for k in stats), worker_counters(stats)
            assert not any(k.startswith("errors.") for k in stats), worker_counters(stats)
            assert stats.get("fetch_ahead.failed", 0) == 0, worker_counters(stats)
            assert len(proxy.object_gets()) >= stats["backend.requests.get"]
            log = m.stderr_text
            for pid, *_ in killer.killed:
                assert f"fetch worker {pid} ended" in log, pid
            assert "Traceback" not in log and "unexpected error" not in log
            assert m.proc.poll() is None, "the daemon died"
        finally:
            m.close()
            kill_leftovers(killer.seen)


def test_an_unmount_leaves_no_worker_running(rclone_server, s3_bucket, mount_factory):
    tree = {key: data for key, data in mixed_tree(seed=3).items() if key.startswith(("train/class0/", "train/mid/"))}
    rclone_server.write_files(s3_bucket, tree)
    m = mount_factory(rclone_server, s3_bucket, "", "--fetch-workers", str(WORKERS))
    seen: set = set()
    try:
        first = Pass(m, tree, read_plan(tree, seed=4), seed=4)
        first.run()
        first.assert_every_byte_right()
        workers = wait_for_workers(m.proc.pid, WORKERS, proc=m.proc)
        seen |= workers
        victim = min(workers)  # one replaced: a pid that is not one of the first two
        os.kill(victim, signal.SIGKILL)
        seen |= wait_for_workers(m.proc.pid, WORKERS, without=[victim], proc=m.proc)
        second = Pass(m, tree, read_plan(tree, seed=5), seed=5)
        second.run()
        second.assert_every_byte_right()
        seen |= fetch_workers(m.proc.pid)
        assert len(seen) >= WORKERS + 1

        unmount = subprocess.run(["fusermount3", "-u", m.mountpoint], capture_output=True, text=True, timeout=30)
        assert unmount.returncode == 0, unmount.stderr
        assert m.proc.wait(timeout=EXIT_DEADLINE_S) == 0, m.stderr_text[-3000:]
        wait_until_gone(seen, f"the fetch workers seen ({sorted(seen)}) ended after the unmount")
    finally:
        m.close()
        kill_leftovers(seen)


def test_a_sigkilled_daemon_leaves_no_worker_running(rclone_server, s3_bucket, mount_factory):
    tree = {"train/img0.jpg": random.Random(6).randbytes(100 * KB)}
    rclone_server.write_files(s3_bucket, tree)
    m = mount_factory(rclone_server, s3_bucket, "", "--fetch-workers", str(WORKERS))
    workers: set = set()
    try:
        with open(m.path("train/img0.jpg"), "rb") as f:
            assert f.read() == tree["train/img0.jpg"]
        workers = wait_for_workers(m.proc.pid, WORKERS, proc=m.proc)
        # A stopped worker cannot see its socket close: only PR_SET_PDEATHSIG ends it.
        stopped = min(workers)
        os.kill(stopped, signal.SIGSTOP)
        wait_for(lambda: (_status(stopped) or ("gone",))[0] == "T", 10, f"worker {stopped} stopped")

        m.proc.send_signal(signal.SIGKILL)
        assert m.proc.wait(timeout=EXIT_DEADLINE_S) == -signal.SIGKILL
        wait_until_gone(
            workers, f"the fetch workers {sorted(workers)} (worker {stopped} stopped) ended with the daemon"
        )
    finally:
        kill_leftovers(workers)
        force_unmount(m.mountpoint)  # the dead mount
    assert not os.path.ismount(m.mountpoint)
    assert os.listdir(m.mountpoint) == []


def test_a_second_pass_makes_no_get_with_workers(rclone_server, s3_bucket, mount_factory):
    # Only the files fetched whole at open (<= --small-file-bytes, 8M), which the daemon's
    # block cache keeps: the second pass makes no GET even if the kernel dropped a page.
    # Streamed files (shards, larger files) are not kept by the daemon, so there a page
    # missing from the page cache is a GET again; on a loaded machine a few pages of such
    # files were sometimes missing right after they were read whole, with
    # --fetch-workers 0 as with 2 (not the workers' doing, not what this test checks).
    tree = {key: data for key, data in mixed_tree(seed=7).items() if len(data) <= 8 * MiB}
    rclone_server.write_files(s3_bucket, tree)
    with counting_proxy(rclone_server.endpoint_url) as proxy:
        m = mount_factory(rclone_server, s3_bucket, "", "--fetch-workers", str(WORKERS), endpoint_url=proxy.url)
        first = Pass(m, tree, read_plan(tree, seed=8), seed=8)
        first.run()
        first.assert_every_byte_right()
        before = m.stats()
        gets_before = len(proxy.object_gets())
        assert before.get("backend.get_path.curl", 0) > 0, worker_counters(before)
        assert before["backend.fetch_workers"] == WORKERS, worker_counters(before)
        assert gets_before > 0

        second = Pass(m, tree, read_plan(tree, seed=9), seed=9)  # another order
        second.run()
        second.assert_every_byte_right()
        after = m.stats()
        new_gets = proxy.object_gets()[gets_before:]
        assert not new_gets, f"the second pass made {len(new_gets)} object GETs, e.g. {new_gets[:5]}"
        for key in ("backend.requests.get", "backend.get_path.curl", "backend.get_path.threads"):
            assert after.get(key, 0) == before.get(key, 0), (key, worker_counters(before), worker_counters(after))
        assert after["backend.fetch_worker_restarts"] == 0, worker_counters(after)
