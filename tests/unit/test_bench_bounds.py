"""The benchmark's CPU bounds for issue 37's 1.2x targets (scripts/bench/issue37.py):
from the CPU a run cost the store and the client side, the most this machine allows
each system, and whether 1.2x s3torchconnector's rate is within bucketfs's bound."""

import pytest

from scripts.bench.issue37 import cpu_bounds_lines

pytestmark = pytest.mark.timeout(30)


def run(system, files_s, wall_s, store_s, client_s):
    """A W2 32-thread cold epoch run: `store_s` of server CPU, `client_s` of the client's."""
    return {
        "run": "W2 epoch cold 32t",
        "system": system,
        "files/s": files_s,
        "wall_s": wall_s,
        "server_cpu_s": store_s,
        "proxy_cpu_s": 0.0,
        "client_cpu_s": client_s,
    }


def test_sharing_the_cores_the_bound_is_cpus_over_store_plus_client_cpu_per_file():
    # 1,000 files each: bucketfs 1 ms of store and 1 ms of client CPU per file; 2 CPUs allow 1,000 files/s.
    runs = [run("bucketfs", 500, 2.0, 1.0, 1.0), run("s3torchconnector", 500, 2.0, 1.0, 0.5)]
    (line,) = cpu_bounds_lines(runs, 2, 0)
    assert "at most 1,000 files/s for bucketfs, 1,333 for s3torchconnector" in line
    # 1.2 x 500 = 600 files/s: within bucketfs's bound of 1,000.
    assert line.endswith("600 files/s: within bucketfs's bound")


def test_sharing_the_cores_a_target_beyond_the_bound_says_what_client_cpu_it_needs():
    runs = [run("bucketfs", 800, 1.25, 1.0, 1.0), run("s3torchconnector", 1000, 1.0, 1.0, 0.5)]
    (line,) = cpu_bounds_lines(runs, 2, 0)
    # 1,200 files/s on 2 CPUs leaves 1.67 ms per file, 1 of it the store's: 0.67 ms for the client side.
    assert line.endswith("needs <= 0.67 ms per file of client-side CPU here (bucketfs: 1.00)")


def test_with_the_store_on_its_own_cpu_a_target_beyond_the_stores_rate_is_beyond_any_client():
    # The store spends 1 ms per file on its one CPU: 1,000 files/s at most; 1.2 x 900 = 1,080.
    runs = [run("bucketfs", 700, 1.0, 0.7, 0.5), run("s3torchconnector", 900, 1.0, 0.9, 0.3)]
    (line,) = cpu_bounds_lines(runs, 2, 1)
    assert "the store on 1 CPU(s), the client on 1" in line
    assert line.endswith("beyond what the store's 1 CPU(s) serve (1,000) whatever the client")


def test_without_both_runs_there_is_no_line():
    assert cpu_bounds_lines([run("bucketfs", 500, 2.0, 1.0, 1.0)], 2, 0) == []


def test_a_w1_runs_fresh_part_buffers_are_counted_from_the_daemon_and_taken_out_of_its_bound():
    from scripts.bench.report import fresh_buffer_line

    def w1(label, system, stats=None, **figures):
        return {"run": label, "system": system, "daemon_stats": stats or {}, **figures}

    cold = {"backend.fresh_buffers": 30, "backend.fresh_bytes": 240 * 2**20, "backend.fresh_fault_cpu_s": 0.48}
    # The next epoch's counters go on from the cold run's (the same mount).
    again = {"backend.fresh_buffers": 34, "backend.fresh_bytes": 272 * 2**20, "backend.fresh_fault_cpu_s": 0.5}
    figures = {"MB/s": 500.0, "wall_s": 1.0, "daemon_cpu_s": 1.3}
    by = {
        (r["run"], r["system"]): r
        for r in (
            w1("W1 4 reader(s)", "bucketfs", cold, **figures),
            w1("W1 4 reader(s), next epoch", "bucketfs", again, **figures),
            w1("W2 epoch cold 8t", "bucketfs", cold),
        )
    }
    # 500 MB read on a reader side of 2 ms per MB (1 CPU s): 0.48 s of it faults leaves 1.04 ms per MB;
    # with the store's 1 ms per MB, 2 CPUs allow 2 / 2.04 ms = 980 MB/s.
    (line,) = fresh_buffer_line(by, "W1 4 reader(s)", 2, 0.001, 0.002)
    assert "30 fresh part buffers (240 MiB) at 2.00 ms of CPU per MiB: 0.48 CPU s of the daemon's 1.30" in line
    assert line.endswith("reader side 1.04 ms per MB, and store + reader side would allow 980 MB/s")
    (line,) = fresh_buffer_line(by, "W1 4 reader(s), next epoch", 2, 0.001, 0.002)
    assert "4 fresh part buffers (32 MiB) at 0.63 ms of CPU per MiB: 0.02 CPU s" in line
    assert (
        fresh_buffer_line(
            {("W1 4 reader(s)", "bucketfs"): w1("W1 4 reader(s)", "bucketfs")}, "W1 4 reader(s)", 2, 0.001, 0.002
        )
        == []
    )
