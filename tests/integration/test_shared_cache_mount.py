"""One --cache-dir shared by every mount (and `bucketfs warm`) of a URL on a host, end to
end: real mounts over real HTTP (rclone's S3 server behind a GET-counting front).

- What one running mount stored is a hit for another mount of the same URL running
  beside it (it reads the other's journal records on a miss): not one object GET,
  every byte right, and one cache directory for the URL (no private one).
- The other way round too; a mount SIGKILLed (perhaps mid-append) leaves the others
  serving right bytes, and a mount started after it finds what both stored.
- `bucketfs warm` of the URL beside a running mount of it shares the mount's directory
  (exit 0, where it once failed with exit 9), and the mount then reads what warm
  fetched with no GET.

Stores land in the background: a test waits for them on the mount's own counters
(every fetched byte written to disk or counted as skipped), never on a sleep.
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from bucketfs.config import parse_bucket_url
from bucketfs.diskcache.directory import mount_identity, shared_dir_path
from bucketfs.testing.mounting import EXIT_DEADLINE_S, run_cli, server_env, wait_for
from bucketfs.testing.s3_fronts import RewritingFront, started

pytestmark = pytest.mark.integration
MiB = 1024 * 1024
STORES_DEADLINE_S = 60  # stores of a few tens of MiB land in well under a second


def _file_set(prefix: str, seed: int, files_count: int = 100, big_bytes: int = 12 * MiB + 5) -> dict:
    """{key: bytes}: `files_count` files of 1-100 KB in two directories under `prefix`,
    and one of several MiB (past --small-file-bytes: streamed in ranged GETs)."""
    rng = random.Random(seed)
    files = {
        f"{prefix}/{'ab'[i % 2]}/f{i:03d}.bin": rng.randbytes(rng.randrange(1000, 100_000)) for i in range(files_count)
    }
    files[f"{prefix}/big.bin"] = rng.randbytes(big_bytes)
    return files


def _read_all(mount, files: dict) -> None:
    """Read every file whole through `mount`: each byte must be the bucket's. The
    kernel's copy is dropped after, so a later read reaches the daemon again."""
    for key, data in files.items():
        with open(mount.path(key), "rb") as f:
            got = f.read()
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        assert len(got) == len(data) and got == data, f"{key} read wrong through {mount.mountpoint}"


def _read_all_with_no_get(mount, files: dict, front) -> None:
    """`_read_all`, and not one object GET reached the store meanwhile (the disk cache
    answered every read)."""
    gets_before = len(front.object_gets())
    gets_of_mount_before = mount.stats().get("backend.requests.get", 0)
    _read_all(mount, files)
    new_gets = front.object_gets()[gets_before:]
    stats = mount.stats()
    assert not new_gets, (
        f"{len(new_gets)} object GETs through {mount.mountpoint}, e.g. {new_gets[:5]}; its disk cache: "
        f"{_disk_counters(stats)}"
    )
    assert stats.get("backend.requests.get", 0) == gets_of_mount_before, _disk_counters(stats)
    assert stats.get("disk_cache.hits", 0) > 0, _disk_counters(stats)
    assert stats.get("disk_cache.bad_reads", 0) == 0, _disk_counters(stats)


def _disk_counters(stats: dict) -> dict:
    return {k: v for k, v in sorted(stats.items()) if k.startswith(("disk_cache.", "backend."))}


def _wait_for_stores(mount) -> None:
    """Until every byte `mount` fetched is on disk with its journal record appended
    (`disk_cache.written_bytes` counts a store once its record is appended), and none
    was skipped (a skipped store would cost the next mount a GET)."""

    def landed() -> bool:
        stats = mount.stats()
        return stats.get("disk_cache.written_bytes", 0) + stats.get("disk_cache.skipped_bytes", 0) >= stats.get(
            "backend.bytes_fetched", 0
        )

    try:
        wait_for(landed, STORES_DEADLINE_S, f"the disk cache stores of {mount.mountpoint}", mount.proc)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {_disk_counters(mount.stats())}") from None
    stats = mount.stats()
    assert stats.get("disk_cache.skipped_bytes", 0) == 0, _disk_counters(stats)
    assert stats.get("disk_cache.write_errors", 0) == 0, _disk_counters(stats)


def _cache_dir_name(bucket: str, prefix: str, endpoint_url: str) -> str:
    """The name of the one directory under --cache-dir of mounts of this URL and endpoint."""
    identity = mount_identity(parse_bucket_url(f"s3://{bucket}/{prefix}"), endpoint_url)
    return os.path.basename(shared_dir_path("/", *identity))


@pytest.mark.timeout(240)
def test_what_one_mount_stored_is_read_by_another_running_beside_it_with_no_get(
    rclone_server, s3_bucket, mount_factory, tmp_path
):
    files = _file_set("set1", seed=1)
    rclone_server.write_files(s3_bucket, files)
    cache_dir = tmp_path / "cache"
    with started(RewritingFront(rclone_server.endpoint_url)) as front:
        a = mount_factory(rclone_server, s3_bucket, "", "--cache-dir", str(cache_dir), endpoint_url=front.url)
        b = mount_factory(rclone_server, s3_bucket, "", "--cache-dir", str(cache_dir), endpoint_url=front.url)
        assert os.listdir(cache_dir) == [_cache_dir_name(s3_bucket, "", front.url)]  # no private directory

        _read_all(a, files)
        assert len(front.object_gets()) >= len(files)
        _wait_for_stores(a)
        assert a.stats()["disk_cache.written_bytes"] >= sum(map(len, files.values()))

        # B started before A stored anything: it finds A's stores in the journal's tail.
        _read_all_with_no_get(b, files, front)
        assert b.stats().get("disk_cache.loaded_bytes", 0) == 0
        assert os.listdir(cache_dir) == [_cache_dir_name(s3_bucket, "", front.url)]
        assert a.proc.poll() is None and b.proc.poll() is None


@pytest.mark.timeout(300)
def test_a_mount_killed_beside_others_leaves_them_serving_and_its_stores_to_the_next(
    rclone_server, s3_bucket, mount_factory, tmp_path
):
    first, second, last = _file_set("set1", seed=2), _file_set("set2", seed=3), _file_set("set3", seed=4)
    rclone_server.write_files(s3_bucket, {**first, **second, **last})
    cache_dir = tmp_path / "cache"
    with started(RewritingFront(rclone_server.endpoint_url)) as front:
        a = mount_factory(rclone_server, s3_bucket, "", "--cache-dir", str(cache_dir), endpoint_url=front.url)
        b = mount_factory(rclone_server, s3_bucket, "", "--cache-dir", str(cache_dir), endpoint_url=front.url)
        _read_all(a, first)
        _wait_for_stores(a)
        # The reverse direction: B stores, A reads it (and B what A stored) with no GET.
        _read_all(b, second)
        _wait_for_stores(b)
        _read_all_with_no_get(a, second, front)
        _read_all_with_no_get(b, first, front)

        # A reads a third set and is killed at once, its stores perhaps mid-write or
        # mid-append to the journal (a torn record the others must step over).
        _read_all(a, last)
        assert a.terminate(signal.SIGKILL, timeout_s=EXIT_DEADLINE_S) == -signal.SIGKILL

        # B keeps serving, every byte right: the first two sets from the disk cache.
        _read_all_with_no_get(b, first, front)
        _read_all_with_no_get(b, second, front)
        _read_all(b, last)  # (whatever A did not store costs B a GET, never a wrong byte)
        _wait_for_stores(b)
        assert b.proc.poll() is None

        # A mount started after A died (beside B) finds what A and B stored.
        c = mount_factory(rclone_server, s3_bucket, "", "--cache-dir", str(cache_dir), endpoint_url=front.url)
        _read_all_with_no_get(c, first, front)
        _read_all_with_no_get(c, second, front)
        _read_all_with_no_get(c, last, front)  # (B stored what A left out)
        assert os.listdir(cache_dir) == [_cache_dir_name(s3_bucket, "", front.url)]
        assert b.proc.poll() is None and c.proc.poll() is None


@pytest.mark.timeout(240)
def test_warm_beside_a_running_mount_of_the_url_fills_the_cache_it_reads(
    rclone_server, s3_bucket, mount_factory, tmp_path
):
    files = _file_set("data", seed=5)
    rclone_server.write_files(s3_bucket, files)
    cache_dir = tmp_path / "cache"
    with started(RewritingFront(rclone_server.endpoint_url)) as front:
        a = mount_factory(rclone_server, s3_bucket, "data/", "--cache-dir", str(cache_dir), endpoint_url=front.url)
        proc = run_cli(
            "warm",
            f"s3://{s3_bucket}/data/",
            "--endpoint-url",
            front.url,
            "--cache-dir",
            str(cache_dir),
            env=server_env(rclone_server),
            timeout_s=120,
        )
        assert proc.returncode == 0, proc.stderr  # (exit 9 while the cache was one mount's)
        assert proc.stderr == "" and proc.stdout == ""
        warm_gets = front.object_gets()
        assert {g.path.split("/", 2)[2] for g in warm_gets} == set(files)  # warm fetched every file
        assert os.listdir(cache_dir) == [_cache_dir_name(s3_bucket, "data/", front.url)]

        # Warm has exited: its stores and their records are on disk. A reads them all.
        _read_all_with_no_get(a, {key[len("data/") :]: data for key, data in files.items()}, front)
        assert a.proc.poll() is None
