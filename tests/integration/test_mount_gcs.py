"""Real mounts of the GCS emulator (gcp-storage-emulator on 127.0.0.1) through
`bucketfs mount gs://BUCKET/PREFIX MP --endpoint-url http://127.0.0.1:PORT`:
the guarantees test_mount_s3.py checks for S3.

What the emulator cannot show (covered against GCSLikeAdapter in
tests/contract/): it answers every listing in one page, ignores generation
conditions (so every read here also costs the backend a metadata GET to check
the generation), and serves gzip-encoded objects without a Content-Encoding
header, i.e. never transcodes. It serves one request at a time.
"""

import gzip
import hashlib
import os
import random

import pytest

from bucketfs import errors
from bucketfs.testing.gcs_server import closed_port_url
from bucketfs.testing.mounting import (
    SPECIAL_NAMES,
    assert_complete_listing,
    assert_every_write_is_erofs,
    assert_one_line_error,
    assert_overwrite_mid_read_is_stale,
    assert_special_names_read_back,
    assert_tree_copies_out,
    run_cli,
    server_env,
    special_name_objects,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

MiB = 1024 * 1024


def rnd(n_bytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n_bytes)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def gcs_bucket(gcs_server) -> str:
    return gcs_server.new_bucket()


def test_mixed_tree_copies_out_byte_identical(gcs_server, gcs_bucket, mount_factory, tmp_path):
    sizes = [0, 1, 100, 4095, 4096, 65536, 100_000, 1 * MiB, 8 * MiB, 8 * MiB + 1, 13 * MiB + 7]
    objects = {}
    for i, size in enumerate(sizes):
        depth = "/".join(f"d{j}" for j in range(i % 4))
        objects[f"ds/{depth}/f{i}.bin".replace("//", "/")] = rnd(size, i)
    objects["ds/shards/train-000.tar"] = rnd(20 * MiB, 99)
    objects["ds/marker-only/"] = b""  # a directory marker with nothing under it
    gcs_server.put_many(gcs_bucket, objects)
    m = mount_factory(gcs_server, gcs_bucket, "ds")
    out = tmp_path / "copy"
    files = {k[len("ds/") :]: v for k, v in objects.items() if not k.endswith("/")}
    assert_tree_copies_out(m, files, out)
    assert (out / "marker-only").is_dir() and os.listdir(out / "marker-only") == []
    stats = m.stats()
    # Small files and read-ahead parts up to 2 MiB on libcurl's engine, larger parts on threads.
    assert stats["backend.get_path.curl"] >= 8 and stats["backend.get_path.threads"] >= 1


def test_listing_of_3000_entries_is_complete_and_in_order(gcs_server, gcs_bucket, mount_factory):
    # 3,000 rather than S3's 20,000: seeding costs ~1 ms per object (one HTTP/1.0
    # request each), and the emulator answers in one page however many there are,
    # so more entries would not exercise more of bucketfs (paging over 2,500 keys
    # is in the contract suite, through GCSLikeAdapter).
    names = [f"item-{i:05d}.bin" for i in range(3000)]
    gcs_server.put_many(gcs_bucket, {f"many/{n}": b"" for n in names})
    assert_complete_listing(mount_factory(gcs_server, gcs_bucket), "many", names)


def test_special_names_round_trip(gcs_server, gcs_bucket, mount_factory):
    special = SPECIAL_NAMES + ['dq"uote', "tilde~"]
    gcs_server.put_many(gcs_bucket, special_name_objects("s", special))
    gcs_server.put_many(gcs_bucket, {"s/dir with space/in+ner#1": b"nested"})
    m = mount_factory(gcs_server, gcs_bucket)
    assert_special_names_read_back(m, "s", special, extra_entries=["dir with space"])
    assert open(m.path("s", "dir with space", "in+ner#1"), "rb").read() == b"nested"


def _bucket_state(gcs_server, bucket) -> list:
    return sorted((b.name, b.generation, b.size) for b in gcs_server.client.list_blobs(bucket))


def test_every_write_operation_is_erofs_and_bucket_unchanged(gcs_server, gcs_bucket, mount_factory):
    gcs_server.put_many(gcs_bucket, {"w/f.txt": b"data", "w/d/g.txt": b"g"})
    before = _bucket_state(gcs_server, gcs_bucket)
    m = mount_factory(gcs_server, gcs_bucket)
    assert_every_write_is_erofs(m, "w", "f.txt", "d")
    f = m.path("w", "f.txt")
    assert _bucket_state(gcs_server, gcs_bucket) == before
    assert open(f, "rb").read() == b"data"


def test_gzip_encoded_object_reads_as_stored_bytes(gcs_server, gcs_bucket, mount_factory):
    plain = b'{"label": 3, "caption": "a cat"}\n' * 5000
    stored = gzip.compress(plain)
    gcs_server.put(gcs_bucket, "gz/records.jsonl.gz", stored, content_encoding="gzip")
    assert gcs_server.client.bucket(gcs_bucket).get_blob("gz/records.jsonl.gz").content_encoding == "gzip"
    m = mount_factory(gcs_server, gcs_bucket)
    path = m.path("gz", "records.jsonl.gz")
    assert os.stat(path).st_size == len(stored) < len(plain)
    with open(path, "rb") as f:
        data = f.read()
    assert data == stored  # the stored bytes: offsets agree with the size stat reports
    assert gzip.decompress(data) == plain
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 100, len(stored) - 50) == stored[-50:]
    finally:
        os.close(fd)


def test_overwrite_mid_read_gives_estale_never_mixed_bytes(gcs_server, gcs_bucket, mount_factory):
    assert_overwrite_mid_read_is_stale(
        lambda *args: mount_factory(gcs_server, gcs_bucket, "", *args),
        lambda objects: gcs_server.put_many(gcs_bucket, objects),
    )


def test_storage_emulator_host_replaces_endpoint_url(gcs_server, gcs_bucket, mount_factory):
    gcs_server.put_many(gcs_bucket, {"e/x.txt": b"via STORAGE_EMULATOR_HOST"})
    host_port = gcs_server.endpoint_url.removeprefix("http://")  # the usual form: host:port
    m = mount_factory(gcs_server, gcs_bucket, "e", endpoint_url=None, extra_env={"STORAGE_EMULATOR_HOST": host_port})
    assert open(m.path("x.txt"), "rb").read() == b"via STORAGE_EMULATOR_HOST"


# -- bad inputs: one line, a distinct exit code, nothing mounted --------------------


def test_missing_bucket_exits_3(gcs_server, empty_dir):
    proc = run_cli(
        "mount",
        "gs://no-such-bucket-here/x",
        empty_dir,
        "--endpoint-url",
        gcs_server.endpoint_url,
        env=server_env(gcs_server),
        timeout_s=45,
    )
    assert_one_line_error(proc, errors.EXIT_BUCKET_NOT_FOUND, "bucket does not exist")
    assert not os.path.ismount(empty_dir)


def test_unreachable_endpoint_exits_5(empty_dir):
    proc = run_cli(
        "mount", "gs://some-bucket/", empty_dir, "--endpoint-url", closed_port_url(), env=server_env(), timeout_s=45
    )
    assert_one_line_error(proc, errors.EXIT_ENDPOINT_UNREACHABLE, "unreachable")
    assert not os.path.ismount(empty_dir)
