"""`bucketfs warm URL [PATH...]` end to end against rclone's S3 server: a warmed cache
serves a later mount with no object GET, a second warm makes none (resume), progress
is quiet without a terminal, and bad inputs are one line with mount's exit codes."""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import socket

import pytest

from bucketfs import errors
from bucketfs.config import parse_bucket_url
from bucketfs.diskcache.directory import mount_identity, shared_dir_path
from bucketfs.testing.mounting import assert_one_line_error, run_cli, run_cli_on_a_terminal, server_env
from bucketfs.testing.s3_fronts import RewritingFront, started

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
MiB = 1024 * 1024
FAKE_KEYS = dict(AWS_ACCESS_KEY_ID="AKIAEXAMPLEEXAMPLE12", AWS_SECRET_ACCESS_KEY="x" * 40)


def _tree() -> dict:
    """Mixed files: empty, tiny, a page, small, over a part (1 MiB), over --small-file-bytes
    (8 MiB), in nested directories."""
    rng = random.Random(36)
    sizes = [0, 1, 4095, 100_000, 3 * MiB + 5, 9 * MiB + 3]
    tree = {f"data/f{i:02d}-{size}.bin": rng.randbytes(size) for i, size in enumerate(sizes)}
    for c in range(3):
        for i in range(20):
            tree[f"data/class{c}/img{i:03d}.jpg"] = rng.randbytes(rng.randrange(1000, 60_000))
    tree["other/skip.bin"] = rng.randbytes(5000)
    return tree


def _warm(server, endpoint_url: str, url: str, cache_dir, *args, timeout_s: float = 120):
    return run_cli(
        "warm",
        url,
        *args,
        "--endpoint-url",
        endpoint_url,
        "--cache-dir",
        str(cache_dir),
        env=server_env(server),
        timeout_s=timeout_s,
    )


def _read_all(mount, tree: dict, prefix: str) -> None:
    for key, data in tree.items():
        if key.startswith(prefix):
            with open(mount.path(key[len(prefix) :]), "rb") as f:
                assert hashlib.sha256(f.read()).digest() == hashlib.sha256(data).digest(), key


def test_a_warmed_cache_serves_a_mount_and_a_second_warm_with_no_get(rclone_server, mount_factory, tmp_path):
    tree = _tree()
    bucket = rclone_server.new_bucket()
    rclone_server.write_files(bucket, tree)
    cache_dir = tmp_path / "cache"
    url = f"s3://{bucket}/data/"
    with started(RewritingFront(rclone_server.endpoint_url)) as front:
        proc = _warm(rclone_server, front.url, url, cache_dir)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == "" and proc.stdout == ""  # stderr is no terminal: quiet
        warm_gets = front.object_gets()
        keys = {key for key, data in tree.items() if key.startswith("data/") and data}
        assert {g.path.split("/", 2)[2] for g in warm_gets} == keys  # every non-empty file, nothing else
        assert len(warm_gets) >= len(keys)

        # Resume: everything is held, so a second warm fetches nothing.
        again = _warm(rclone_server, front.url, url, cache_dir)
        assert again.returncode == 0, again.stderr
        assert again.stderr == ""
        assert len(front.object_gets()) == len(warm_gets)

        # A mount of the same URL and endpoint reads it all from the cache.
        mount = mount_factory(rclone_server, bucket, "data/", "--cache-dir", str(cache_dir), endpoint_url=front.url)
        _read_all(mount, tree, "data/")
        assert len(front.object_gets()) == len(warm_gets)


def test_warm_of_paths_fetches_only_them(rclone_server, tmp_path):
    tree = _tree()
    bucket = rclone_server.new_bucket()
    rclone_server.write_files(bucket, tree)
    with started(RewritingFront(rclone_server.endpoint_url)) as front:
        proc = _warm(rclone_server, front.url, f"s3://{bucket}/data", tmp_path / "cache", "class1", "/f03-100000.bin")
        assert proc.returncode == 0, proc.stderr
        fetched = {g.path.split("/", 2)[2] for g in front.object_gets()}
    assert fetched == {k for k in tree if k.startswith("data/class1/")} | {"data/f03-100000.bin"}


def test_a_path_that_names_nothing_is_one_line(rclone_server, s3_bucket, tmp_path):
    rclone_server.write_files(s3_bucket, {"a/b.bin": b"x"})
    proc = _warm(rclone_server, rclone_server.endpoint_url, f"s3://{s3_bucket}/a", tmp_path / "c", "nope")
    assert_one_line_error(proc, errors.EXIT_USAGE, "no such file or directory")


def test_a_cache_dir_held_by_another_process_is_one_line(rclone_server, s3_bucket, tmp_path):
    rclone_server.write_files(s3_bucket, {"a/b.bin": b"x"})
    url = f"s3://{s3_bucket}/a/"
    cache_dir = tmp_path / "cache"
    held = shared_dir_path(str(cache_dir), *mount_identity(parse_bucket_url(url), rclone_server.endpoint_url))
    os.makedirs(held)
    fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a running mount of an earlier bucketfs holds it
        proc = _warm(rclone_server, rclone_server.endpoint_url, url, cache_dir)
    finally:
        os.close(fd)
    assert_one_line_error(proc, errors.EXIT_BAD_CACHE_DIR, "held exclusively")


@pytest.mark.parametrize("url, fragment", [("not-a-url", "not a bucket URL"), ("ftp://b/x", "unknown scheme")])
def test_a_bad_url_is_exit_2(url, fragment, tmp_path):
    proc = run_cli("warm", url, "--cache-dir", str(tmp_path / "c"))
    assert_one_line_error(proc, errors.EXIT_USAGE, fragment)


def test_no_cache_dir_is_exit_2():
    assert_one_line_error(run_cli("warm", "s3://some-bucket/x"), errors.EXIT_USAGE, "--cache-dir")


def test_a_missing_bucket_is_exit_3(rclone_server, tmp_path):
    cache_dir = tmp_path / "cache"
    proc = _warm(rclone_server, rclone_server.endpoint_url, "s3://no-such-bucket-here/x", cache_dir)
    assert_one_line_error(proc, errors.EXIT_BUCKET_NOT_FOUND, "bucket does not exist")
    assert list(cache_dir.iterdir()) == []


def test_access_denied_is_exit_4(rclone_server, s3_bucket, tmp_path):
    proc = run_cli(
        "warm",
        f"s3://{s3_bucket}/",
        "--endpoint-url",
        rclone_server.endpoint_url,
        "--cache-dir",
        str(tmp_path / "c"),
        env=server_env(rclone_server, AWS_SECRET_ACCESS_KEY="wrong-secret-key-0000000000000000"),
    )
    assert_one_line_error(proc, errors.EXIT_ACCESS_DENIED, "access denied")


def test_an_unreachable_endpoint_is_exit_5(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        proc = run_cli(
            "warm",
            "s3://some-bucket/",
            "--endpoint-url",
            f"http://127.0.0.1:{port}",
            "--cache-dir",
            str(tmp_path / "c"),
            env=server_env(**FAKE_KEYS),
            timeout_s=45,
        )
    assert_one_line_error(proc, errors.EXIT_ENDPOINT_UNREACHABLE, "unreachable")


def test_a_cache_dir_that_cannot_be_made_is_exit_9(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    proc = run_cli("warm", "s3://some-bucket/", "--cache-dir", str(blocker / "cache"), env=server_env(**FAKE_KEYS))
    assert_one_line_error(proc, errors.EXIT_BAD_CACHE_DIR, "cache")


def test_progress_shows_on_a_terminal(rclone_server, s3_bucket, tmp_path):
    tree = _tree()
    rclone_server.write_files(s3_bucket, tree)
    returncode, shown = run_cli_on_a_terminal(
        "warm",
        f"s3://{s3_bucket}/data/",
        "--endpoint-url",
        rclone_server.endpoint_url,
        "--cache-dir",
        str(tmp_path / "cache"),
        env=server_env(rclone_server),
    )
    assert returncode == 0, shown
    last = shown.decode().replace("\r\n", "\n").split("\r")[-1]
    files = sum(1 for key in tree if key.startswith("data/"))
    assert f"warm: {files} files" in last and "fetched" in last, shown


def test_warm_through_a_mountpoint_fills_its_disk_cache(rclone_server, mount_factory, tmp_path):
    """The MOUNTPOINT form reads the tree through a running mount: its disk cache holds
    it all after, so a later mount with the same --cache-dir makes no object GET."""
    tree = _tree()
    bucket = rclone_server.new_bucket()
    rclone_server.write_files(bucket, tree)
    cache_dir = tmp_path / "cache"
    with started(RewritingFront(rclone_server.endpoint_url)) as front:
        mount = mount_factory(rclone_server, bucket, "data/", "--cache-dir", str(cache_dir), endpoint_url=front.url)
        proc = run_cli("warm", str(mount.mountpoint), timeout_s=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""
        gets = len(front.object_gets())
        assert gets > 0
        # PATHs under it, and a path inside the mount, are read through it too (cached: no GET).
        again = run_cli("warm", mount.path("class1"), timeout_s=120)
        assert again.returncode == 0, again.stderr
        sub = run_cli("warm", str(mount.mountpoint), "class2", "f03-100000.bin", timeout_s=120)
        assert sub.returncode == 0, sub.stderr
        assert len(front.object_gets()) == gets
        mount.close()
        later = mount_factory(rclone_server, bucket, "data/", "--cache-dir", str(cache_dir), endpoint_url=front.url)
        _read_all(later, tree, "data/")
        assert len(front.object_gets()) == gets


def test_a_directory_that_is_no_mount_is_exit_6(tmp_path):
    assert_one_line_error(run_cli("warm", str(tmp_path)), errors.EXIT_BAD_MOUNTPOINT, "nor a bucketfs mount")


def test_store_options_with_a_mountpoint_are_exit_2(tmp_path):
    proc = run_cli("warm", str(tmp_path), "--cache-dir", str(tmp_path / "c"))
    assert_one_line_error(proc, errors.EXIT_USAGE, "--cache-dir")
