"""`bucketfs index build URL --out FILE-or-URL` and `bucketfs index show` end to end,
through the CLI, against rclone's S3 server and the GCS emulator: the index holds
exactly what a sequential listing shows, goes to a file or into the bucket, progress
only on a terminal, and bad inputs are one line with their exit codes."""

from __future__ import annotations

import os

import pytest
import trio

from bucketfs import errors
from bucketfs.backends.s3 import S3Backend
from bucketfs.core.listing_index import FORMAT_VERSION, decode_index, encode_index
from bucketfs.testing.mounting import assert_one_line_error, run_cli, run_cli_on_a_terminal, server_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
FAKE_KEYS = dict(AWS_ACCESS_KEY_ID="AKIAEXAMPLEEXAMPLE12", AWS_SECRET_ACCESS_KEY="x" * 40)


def _tree() -> dict:
    tree = {f"data/flat/obj-{i:05d}.bin": i.to_bytes(3, "big") for i in range(2600)}
    for c in range(12):
        for i in range(30):
            tree[f"data/train/class{c:02d}/img{i:03d}.jpg"] = bytes([c, i]) * (i + 1)
    for name in ("a b.txt", "ünï.txt", "日本/語", "plus+sign", "semi;colon"):
        tree[f"data/special/{name}"] = name.encode()
    tree["data/top.bin"] = b"top"
    tree["other/not-in-the-index"] = b"x"
    return tree


async def _sequential(server, bucket: str, prefix: str) -> list:
    """(key relative to `prefix`, size, mtime_ns, version) of a sequential flat listing."""
    backend = S3Backend(server.config(bucket), session=server.session())
    entries, start_after = [], ""
    try:
        while True:
            page = await backend.list_flat_page(prefix, start_after)
            entries += [
                (info.key[len(prefix) :], info.size_bytes, info.mtime_ns, info.version) for info in page.objects
            ]
            if page.next_token is None:
                return entries
            start_after = page.next_token
    finally:
        await backend.aclose()


def _build(server, url: str, out: str, *args, endpoint_url=None, env=None):
    return run_cli(
        "index",
        "build",
        url,
        "--out",
        out,
        "--endpoint-url",
        endpoint_url or server.endpoint_url,
        *args,
        env=env or server_env(server),
        timeout_s=150,
    )


def test_an_index_holds_exactly_what_a_sequential_listing_shows(rclone_server, s3_bucket, tmp_path):
    rclone_server.write_files(s3_bucket, _tree())
    out = tmp_path / "data.idx"
    proc = _build(rclone_server, f"s3://{s3_bucket}/data", str(out), "--concurrency", "16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""  # no terminal: quiet
    index = decode_index(out.read_bytes(), expected_url=f"s3://{s3_bucket}/data/")
    entries = sorted(index.entries())
    assert entries == trio.run(_sequential, rclone_server, s3_bucket, "data/")
    assert len(entries) == 2600 + 12 * 30 + 5 + 1
    assert {key for key, *_ in entries} == {key[len("data/") :] for key in _tree() if key.startswith("data/")}
    assert index.header["created_by"].startswith("bucketfs ")
    assert not [name for name in os.listdir(tmp_path) if name != "data.idx"]  # no temporary left

    shown = run_cli("index", "show", str(out))
    assert shown.returncode == 0, shown.stderr
    assert f"url: s3://{s3_bucket}/data/" in shown.stdout
    assert f"objects: {len(entries):,} in " in shown.stdout


def test_an_index_written_into_the_bucket_and_shown_from_there(rclone_server, s3_bucket, tmp_path):
    rclone_server.write_files(s3_bucket, _tree())
    url, out = f"s3://{s3_bucket}/data/", f"s3://{s3_bucket}/indexes/data.idx"
    proc = _build(rclone_server, url, out)
    assert proc.returncode == 0, proc.stderr
    stored = (rclone_server.root_dir / s3_bucket / "indexes" / "data.idx").read_bytes()
    assert decode_index(stored, expected_url=url).objects_count == 2600 + 12 * 30 + 6
    shown = run_cli("index", "show", out, "--endpoint-url", rclone_server.endpoint_url, env=server_env(rclone_server))
    assert shown.returncode == 0, shown.stderr
    assert f"url: {url}" in shown.stdout and "objects: 2,966 in " in shown.stdout
    # Another bucket of the same store takes it too.
    other = rclone_server.new_bucket()
    try:
        proc = _build(rclone_server, url, f"s3://{other}/x/data.idx")
        assert proc.returncode == 0, proc.stderr
        assert (rclone_server.root_dir / other / "x" / "data.idx").read_bytes()[:8] == stored[:8]
    finally:
        rclone_server.delete_bucket(other)


def test_gcs_through_a_gcs_like_front(gcs_server, tmp_path):
    from bucketfs.testing.gcs_server import GCSLikeAdapter
    from bucketfs.testing.http_front import adapter_front

    bucket = gcs_server.new_bucket()
    objects = {f"d/{i:04d}": i.to_bytes(2, "big") for i in range(2300)} | {"d/sub/x": b"x", "e/y": b"y"}
    gcs_server.put_many(bucket, objects)
    with adapter_front(GCSLikeAdapter(), gcs_server.endpoint_url) as front:
        out = f"gs://{bucket}/indexes/d.idx"
        proc = _build(gcs_server, f"gs://{bucket}/d/", out, "--concurrency", "8", endpoint_url=front)
        assert proc.returncode == 0, proc.stderr
        shown = run_cli("index", "show", out, "--endpoint-url", front, env=server_env(gcs_server))
    assert shown.returncode == 0, shown.stderr
    assert f"url: gs://{bucket}/d/" in shown.stdout and "objects: 2,301 in 2 directories" in shown.stdout


def test_progress_shows_on_a_terminal(rclone_server, s3_bucket, tmp_path):
    rclone_server.write_files(s3_bucket, _tree())
    returncode, shown = run_cli_on_a_terminal(
        "index",
        "build",
        f"s3://{s3_bucket}/data/",
        "--out",
        str(tmp_path / "i.idx"),
        "--endpoint-url",
        rclone_server.endpoint_url,
        env=server_env(rclone_server),
    )
    assert returncode == 0, shown
    last = shown.decode().replace("\r\n", "\n").split("\r")[-1]
    assert last.startswith("\x1b[Kindex: 2,966 objects listed in "), last
    assert f"bytes written to {tmp_path / 'i.idx'}" in last


@pytest.mark.parametrize(
    "args, code, fragment",
    [
        (["s3:/nope", "--out", "x.idx"], errors.EXIT_USAGE, "is not a bucket URL"),
        (["s3://bucket/p/", "--out", "gs://bucket/x.idx"], errors.EXIT_USAGE, "on another store"),
        (["s3://bucket/p/", "--out", "s3://bucket/dir/"], errors.EXIT_USAGE, "names no object"),
        (["s3://bucket/p/", "--out", "/no/such/dir/x.idx"], errors.EXIT_USAGE, "no directory /no/such/dir"),
        (["s3://bucket/p/", "--out", "/"], errors.EXIT_USAGE, "is a directory"),
        (["s3://bucket/p/", "--out", "x.idx", "--concurrency", "0"], errors.EXIT_USAGE, "outside 1..1024"),
        (["s3://bucket/p/"], errors.EXIT_USAGE, "--out"),
    ],
)
def test_bad_usage_is_exit_2(args, code, fragment):
    proc = run_cli("index", "build", *args, env=dict(os.environ, **FAKE_KEYS))
    assert_one_line_error(proc, code, fragment)


def test_a_missing_bucket_is_exit_3_and_denied_exit_4(rclone_server, tmp_path):
    proc = _build(rclone_server, "s3://no-such-bucket-here/p/", str(tmp_path / "x.idx"))
    assert_one_line_error(proc, errors.EXIT_BUCKET_NOT_FOUND, "bucket does not exist")
    bucket = rclone_server.new_bucket()
    try:
        env = dict(server_env(rclone_server), AWS_SECRET_ACCESS_KEY="wrong-secret-key-0123456789abcdefghijklmn")
        proc = _build(rclone_server, f"s3://{bucket}/", str(tmp_path / "x.idx"), env=env)
        assert_one_line_error(proc, errors.EXIT_ACCESS_DENIED, "access denied")
    finally:
        rclone_server.delete_bucket(bucket)
    assert not (tmp_path / "x.idx").exists()


def test_an_unreachable_endpoint_is_exit_5(tmp_path):
    from bucketfs.testing.servers import closed_port_url

    proc = run_cli(
        "index",
        "build",
        "s3://bucket/p/",
        "--out",
        str(tmp_path / "x.idx"),
        "--endpoint-url",
        closed_port_url(),
        "--retries",
        "1",
        env=dict(os.environ, **FAKE_KEYS),
    )
    assert_one_line_error(proc, errors.EXIT_ENDPOINT_UNREACHABLE, "endpoint unreachable")


def test_show_refuses_bad_indexes_with_their_codes(tmp_path):
    good = encode_index("s3://bucket/p/", [("k", 1, 1, "v")], 1)
    cases = {
        "missing.idx": (None, errors.EXIT_BAD_INDEX, "no such file"),
        "text.idx": (b"not an index\n", errors.EXIT_BAD_INDEX, "is not a bucketfs index"),
        "cut.idx": (good[:-3], errors.EXIT_BAD_INDEX, "damaged"),
        "future.idx": (
            good[:8] + (FORMAT_VERSION + 1).to_bytes(2, "big") + good[10:],
            errors.EXIT_INDEX_VERSION,
            f"version {FORMAT_VERSION + 1}",
        ),
    }
    for name, (data, code, fragment) in cases.items():
        if data is not None:
            (tmp_path / name).write_bytes(data)
        assert_one_line_error(run_cli("index", "show", str(tmp_path / name)), code, fragment)
    assert_one_line_error(run_cli("index", "show", str(tmp_path)), errors.EXIT_BAD_INDEX, "Is a directory")
