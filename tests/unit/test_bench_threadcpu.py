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
