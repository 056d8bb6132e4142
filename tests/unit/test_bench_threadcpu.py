"""The benchmark's census of fetch worker CPU (scripts/bench/threadcpu.py): what the
daemon's fetch workers spent over a run, from two snapshots ((pid, start ticks) -> CPU
s) and the daemon's reaped children's CPU between them."""

import pytest

from scripts.bench.threadcpu import fetch_workers_delta_s

pytestmark = pytest.mark.timeout(30)


def test_a_worker_alive_throughout_counts_its_delta():
    assert fetch_workers_delta_s({(10, 5): 1.0}, {(10, 5): 3.5}, 0.0) == pytest.approx(2.5)


def test_a_worker_started_during_the_run_counts_from_zero():
    assert fetch_workers_delta_s({}, {(11, 9): 0.75}, 0.0) == pytest.approx(0.75)


def test_a_worker_reaped_during_the_run_counts_through_the_daemons_cutime_less_its_start():
    # Worker 10 had spent 1.0 s at the start and 1.75 s when the daemon reaped it.
    assert fetch_workers_delta_s({(10, 5): 1.0}, {}, 1.75) == pytest.approx(0.75)


def test_a_worker_started_and_reaped_during_the_run_counts_whole():
    assert fetch_workers_delta_s({(10, 5): 1.0}, {(10, 5): 1.5}, 0.25) == pytest.approx(0.75)


def test_a_reused_pid_is_a_new_worker():
    # Worker 10 (started at tick 5) was reaped having spent 2.0 s; a new worker got pid 10.
    assert fetch_workers_delta_s({(10, 5): 1.5}, {(10, 80): 0.25}, 2.0) == pytest.approx(0.75)


def test_the_serving_threads_exact_cpu_replaces_its_ticks_and_moves_the_total(monkeypatch):
    from scripts.bench import threadcpu

    # One daemon (pid 10): its main thread 0.20 s of ticks more over the run, trio's thread 0.30 s more.
    readings = iter(
        [{10: ("d", 1.0, 0.0), 11: ("Trio thread 0", 2.0, 0.0)}, {10: ("d", 1.2, 0.0), 11: ("Trio thread 0", 2.3, 0.0)}]
        * 2
    )
    totals = iter([3.0, 3.5] * 2)
    monkeypatch.setattr(threadcpu, "task_cpu", lambda pid: next(readings))
    monkeypatch.setattr(threadcpu, "proc_cpu_s", lambda pid: next(totals))
    monkeypatch.setattr(threadcpu, "fetch_workers_snapshot", lambda pid: ({}, 0.0))
    census = threadcpu.ThreadCensus()
    ticks = census.finish(census.start(10))
    exact = census.finish(census.start(10), 0.2345)
    assert (ticks["main"], ticks["total"], "main_ticks" in ticks) == (0.2, 0.5, False)
    assert (exact["main"], exact["main_ticks"], exact["total"]) == (0.2345, 0.2, 0.534)
    assert exact["workers"] == ticks["workers"] == 0.3
