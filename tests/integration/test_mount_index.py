"""`bucketfs mount --index FILE-or-URL` on real mounts of rclone's S3 server: the
namespace comes from the index (zero LIST requests, counted at a proxy in front of
the store and in the daemon's counters), every byte reads right, a changed object
gives ESTALE, an index in the bucket itself works, --metadata-ttl lists again once
the index is older than the TTL, and every bad index is one line with its code."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest

from bucketfs import errors
from bucketfs.core.listing_index import FORMAT_VERSION, encode_index
from bucketfs.testing.counting_proxy import counting_proxy
from bucketfs.testing.mounting import assert_one_line_error, run_cli, server_env, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _tree() -> dict:
    tree = {f"data/train/c{c:02d}/img{i:03d}.jpg": os.urandom(1000 + 97 * i) for c in range(8) for i in range(25)}
    tree.update({f"data/flat/{i:05d}.bin": i.to_bytes(4, "big") * 10 for i in range(1200)})
    tree["data/big.tar"] = os.urandom(9 * 1024 * 1024 + 7)
    tree["data/ünï code/日本.txt"] = "日本".encode() * 100
    tree["other/outside"] = b"not mounted"
    return tree


def _lists(front) -> int:
    return sum(1 for request in front.requests if request.method == "GET" and "list-type=2" in request.query)


def _build(server, endpoint_url: str, url: str, out: str) -> None:
    proc = run_cli("index", "build", url, "--out", out, "--endpoint-url", endpoint_url, env=server_env(server))
    assert proc.returncode == 0, proc.stderr


def _read_tree(mount, tree: dict, prefix: str = "data/", skip=()) -> None:
    """Every file under the mount reads as `tree` holds it (`skip`: listed, not read)."""
    seen = set()
    for root, _dirs, files in os.walk(mount.mountpoint):
        for name in files:
            path = os.path.join(root, name)
            key = prefix + os.path.relpath(path, mount.mountpoint)
            seen.add(key)
            if key in skip:
                continue
            with open(path, "rb") as f:
                assert hashlib.sha256(f.read()).digest() == hashlib.sha256(tree[key]).digest(), key
    assert seen == {key for key in tree if key.startswith(prefix)}


def test_a_mount_from_an_index_lists_nothing_and_reads_every_byte(rclone_server, s3_bucket, mount_factory, tmp_path):
    tree = _tree()
    rclone_server.write_files(s3_bucket, tree)
    index_path = str(tmp_path / "data.idx")
    with counting_proxy(rclone_server.endpoint_url) as front:
        _build(rclone_server, front.url, f"s3://{s3_bucket}/data/", index_path)
        built_lists = _lists(front)
        assert built_lists > 0
        mount = mount_factory(rclone_server, s3_bucket, "data/", "--index", index_path, endpoint_url=front.url)
        # Rewritten after the index was built (and before anything read it).
        changed = "data/train/c07/img024.jpg"
        rclone_server.write_files(s3_bucket, {changed: b"rewritten after the index"})
        _read_tree(mount, tree, skip={changed})
        assert sorted(os.listdir(mount.path("flat")))[:2] == ["00000.bin", "00001.bin"]
        assert os.stat(mount.path("big.tar")).st_size == len(tree["data/big.tar"])
        assert _lists(front) == built_lists  # the mount: zero LIST requests
        stats = mount.stats()
        assert stats.get("backend.requests.list", 0) == 0
        assert stats["namespace.index_listings"] >= 11
        # Pinned to the versions the index names: the rewritten object gives ESTALE.
        with pytest.raises(OSError) as caught:
            with open(mount.path("train", "c07", "img024.jpg"), "rb") as f:
                f.read()
        assert caught.value.errno == errno.ESTALE
    assert "listings from the index" in mount.stderr_text


def test_an_index_in_the_bucket_itself(rclone_server, s3_bucket, mount_factory):
    tree = {key: data for key, data in _tree().items() if not key.startswith("data/flat/")}
    rclone_server.write_files(s3_bucket, tree)
    index_url = f"s3://{s3_bucket}/indexes/data.idx"
    with counting_proxy(rclone_server.endpoint_url) as front:
        _build(rclone_server, front.url, f"s3://{s3_bucket}/data/", index_url)
        before = len(front.requests)
        mount = mount_factory(rclone_server, s3_bucket, "data/", "--index", index_url, endpoint_url=front.url)
        at_mount = front.requests[before:]
        # One HEAD and one GET of the index, and nothing else, to be ready.
        assert sorted(request.method for request in at_mount) == ["GET", "HEAD"], at_mount
        assert all(request.path.endswith("/indexes/data.idx") for request in at_mount)
        _read_tree(mount, tree)
        assert _lists(front) == sum(1 for r in front.requests[:before] if "list-type=2" in r.query)


def test_with_a_ttl_the_index_is_listed_again_once_older(rclone_server, s3_bucket, mount_factory, tmp_path):
    rclone_server.write_files(s3_bucket, {"data/a": b"a", "data/sub/b": b"b"})
    index_path = str(tmp_path / "data.idx")
    _build(rclone_server, rclone_server.endpoint_url, f"s3://{s3_bucket}/data/", index_path)
    rclone_server.write_files(s3_bucket, {"data/new": b"written after the index"})
    with counting_proxy(rclone_server.endpoint_url) as front:
        mount = mount_factory(
            rclone_server, s3_bucket, "data/", "--index", index_path, "--metadata-ttl", "2", endpoint_url=front.url
        )
        assert sorted(os.listdir(mount.mountpoint)) == ["a", "sub"]  # the index's, as of the start
        assert _lists(front) == 0
        wait_for(lambda: "new" in os.listdir(mount.mountpoint), 30, "a listing once the index is older than the TTL")
        assert _lists(front) >= 1


@pytest.fixture
def bad_indexes(tmp_path, s3_bucket):
    url = f"s3://{s3_bucket}/data/"
    good = encode_index(url, [("a", 1, 1, "v")], 1)
    paths = {}
    for name, data in {
        "other-url.idx": encode_index(f"s3://{s3_bucket}/elsewhere/", [("a", 1, 1, "v")], 1),
        "damaged.idx": good[:-40] + bytes([good[-40] ^ 0xFF]) + good[-39:],
        "text.idx": b"just some text\n",
        "future.idx": good[:8] + (FORMAT_VERSION + 1).to_bytes(2, "big") + good[10:],
    }.items():
        (tmp_path / name).write_bytes(data)
        paths[name] = str(tmp_path / name)
    paths["missing.idx"] = str(tmp_path / "missing.idx")
    return paths


@pytest.mark.parametrize(
    "name, code, fragment",
    [
        ("other-url.idx", errors.EXIT_INDEX_OTHER_URL, "/elsewhere/, not of s3://"),
        ("damaged.idx", errors.EXIT_BAD_INDEX, "checksum does not match"),
        ("text.idx", errors.EXIT_BAD_INDEX, "is not a bucketfs index"),
        ("future.idx", errors.EXIT_INDEX_VERSION, f"format version {FORMAT_VERSION + 1}"),
        ("missing.idx", errors.EXIT_BAD_INDEX, "no such file"),
    ],
)
def test_a_bad_index_is_one_line_and_its_exit_code(
    rclone_server, s3_bucket, bad_indexes, empty_dir, name, code, fragment
):
    rclone_server.write_files(s3_bucket, {"data/a": b"a"})
    url = f"s3://{s3_bucket}/data/"
    # Daemonised, as a user runs it: the daemon's one line comes back through the pipe.
    proc = run_cli(
        "mount",
        url,
        empty_dir,
        "--index",
        bad_indexes[name],
        "--endpoint-url",
        rclone_server.endpoint_url,
        env=server_env(rclone_server),
    )
    assert_one_line_error(proc, code, fragment)
    assert not os.path.ismount(empty_dir)
    # --check reads an index file too.
    check = run_cli("mount", url, empty_dir, "--check", "--index", bad_indexes[name], env=server_env(rclone_server))
    assert_one_line_error(check, code, fragment)


def test_an_index_url_that_names_nothing_or_another_store(rclone_server, s3_bucket, empty_dir):
    url = f"s3://{s3_bucket}/data/"
    env = server_env(rclone_server)
    missing = run_cli(
        "mount",
        url,
        empty_dir,
        "--index",
        f"s3://{s3_bucket}/no/such.idx",
        "--endpoint-url",
        rclone_server.endpoint_url,
        env=env,
    )
    assert_one_line_error(missing, errors.EXIT_BAD_INDEX, "no such object")
    for index, fragment in (
        (f"gs://{s3_bucket}/x.idx", "on another store"),
        (f"s3://{s3_bucket}/dir/", "names no object"),
    ):
        assert_one_line_error(run_cli("mount", url, empty_dir, "--index", index, env=env), errors.EXIT_USAGE, fragment)


def test_gcs_a_mount_from_an_index_in_the_bucket_lists_nothing(gcs_server, mount_factory):
    from bucketfs.testing.gcs_server import GCSLikeAdapter
    from bucketfs.testing.http_front import AdapterFront

    bucket = gcs_server.new_bucket()
    tree = {f"ds/c{c}/{i:03d}.jpg": os.urandom(500 + i) for c in range(3) for i in range(40)}
    tree["ds/top.bin"] = os.urandom(3000)
    gcs_server.put_many(bucket, tree)
    front = AdapterFront(GCSLikeAdapter(), gcs_server.endpoint_url)
    front.start()
    try:
        index_url = f"gs://{bucket}/indexes/ds.idx"
        _build(gcs_server, front.url, f"gs://{bucket}/ds/", index_url)
        before = len(front.requests)
        mount = mount_factory(gcs_server, bucket, "ds/", "--index", index_url, endpoint_url=front.url)
        _read_tree(mount, tree, prefix="ds/")
        gcs_lists = [r for r in front.requests[before:] if r.method == "GET" and r.path.endswith("/o")]
        assert gcs_lists == []
        assert mount.stats().get("backend.requests.list", 0) == 0
    finally:
        front.stop()
        front.session.close()


def test_a_local_index_probes_with_one_head_missing_bucket_3_denied_4(rclone_server, s3_bucket, empty_dir, tmp_path):
    rclone_server.write_files(s3_bucket, {"data/a": b"a"})
    for bucket, env_change, code, fragment in (
        ("no-such-bucket-for-index", {}, errors.EXIT_BUCKET_NOT_FOUND, "bucket does not exist"),
        (
            s3_bucket,
            {"AWS_SECRET_ACCESS_KEY": "wrong-secret-key-0123456789abcdefghijklmn"},
            errors.EXIT_ACCESS_DENIED,
            "access denied",
        ),
    ):
        path = tmp_path / f"{bucket}.idx"
        path.write_bytes(encode_index(f"s3://{bucket}/data/", [("a", 1, 1, "v")], 1))
        proc = run_cli(
            "mount",
            f"s3://{bucket}/data/",
            empty_dir,
            "--index",
            str(path),
            "--endpoint-url",
            rclone_server.endpoint_url,
            env=dict(server_env(rclone_server), **env_change),
        )
        assert_one_line_error(proc, code, fragment)
