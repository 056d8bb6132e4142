"""Real mounts of a real S3 server (rclone serve s3 on 127.0.0.1): reads, names, EROFS, versions."""

import concurrent.futures
import errno
import hashlib
import mmap
import os
import random
import subprocess

import pytest

from bucketfs.diskcache import pagecache
from bucketfs.testing.mounting import (
    SPECIAL_NAMES,
    assert_complete_listing,
    assert_every_write_is_erofs,
    assert_overwrite_mid_read_is_stale,
    assert_special_names_read_back,
    assert_tree_copies_out,
    mount_cmd,
    server_env,
    special_name_objects,
    wait_for,
)
from bucketfs.testing.servers import rclone_s3_server

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


def rnd(n_bytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n_bytes)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_mixed_tree_copies_out_byte_identical(rclone_server, s3_bucket, mount_factory, tmp_path):
    sizes = [0, 1, 100, 4095, 4096, 65536, 100_000, 1 * MiB, 8 * MiB, 8 * MiB + 1, 13 * MiB + 7, 40 * MiB + 3]
    objects = {}
    for i, size in enumerate(sizes):
        depth = "/".join(f"d{j}" for j in range(i % 4))
        objects[f"ds/{depth}/f{i}.bin".replace("//", "/")] = rnd(size, i)
    objects["ds/shards/train-000.tar"] = rnd(20 * MiB, 99)
    rclone_server.write_files(s3_bucket, objects)
    m = mount_factory(rclone_server, s3_bucket, "ds")
    assert_tree_copies_out(m, {k[len("ds/") :]: v for k, v in objects.items()}, tmp_path / "copy")


def test_shards_read_in_order_fetch_each_byte_once(rclone_server, s3_bucket, mount_factory):
    """Through a real mount, a reader going through shards in order finds each next
    shard's head warmed by the window running past the previous shard's end, uses it,
    and the bucket serves every byte exactly once (nothing warmed is wasted)."""
    shards = {f"wds/shard-{i:06d}.tar": rnd(24 * MiB + i * 4096, 200 + i) for i in range(3)}
    rclone_server.write_files(s3_bucket, shards)
    m = mount_factory(rclone_server, s3_bucket, "wds")
    for key, data in shards.items():
        digest = hashlib.sha256()
        with open(m.path(key[len("wds/") :]), "rb") as f:
            while chunk := f.read(1 * MiB):
                digest.update(chunk)
        assert digest.hexdigest() == sha(data), key
    stats = m.stats()
    assert stats["prefetch.heads_warmed"] == 2  # shards 1 and 2; none after the last
    assert stats["prefetch.heads_used"] == 2
    assert stats.get("prefetch.bytes_wasted", 0) == 0
    assert stats["backend.bytes_fetched"] == sum(len(d) for d in shards.values())
    # Each buffer new to the daemon was faulted in before its GET, and counted; the
    # pool's buffers, reused for the later shards, were not.
    assert 1 <= stats["backend.fresh_buffers"] < stats["backend.get_path.threads"]
    assert stats["backend.fresh_bytes"] >= stats["backend.fresh_buffers"] * 2 * MiB
    assert stats["backend.fresh_fault_cpu_s"] > 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the kernel's per-mount limits are root's to raise")
def test_kernel_read_limits_are_raised_for_the_mount(rclone_server, s3_bucket, mount_factory):
    """The kernel's defaults would cap a mount at 128 KiB of read-ahead and 12 READs in
    flight (32 loader threads would wait on 12); the daemon raises both."""
    rclone_server.write_files(s3_bucket, {"k/a.bin": b"a"})
    m = mount_factory(rclone_server, s3_bucket, "k")
    dev = os.stat(m.mountpoint).st_dev
    with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
        assert int(f.read()) == 4096
    conn_dir = f"/sys/fs/fuse/connections/{(os.major(dev) << 20) | os.minor(dev)}"
    with open(f"{conn_dir}/max_background") as f:
        assert int(f.read()) >= 64
    with open(f"{conn_dir}/congestion_threshold") as f:
        assert int(f.read()) >= 48


def test_https_store_behind_a_private_ca(tmp_path_factory, mount_factory, empty_dir):
    """A store with its own CA (MinIO, Ceph, AIStore), trusted through AWS_CA_BUNDLE as
    boto3 users do: the daemon's own requests (LIST, whole small files, read-ahead
    parts) trust it too, not only the boto3 client that checks the bucket."""
    objects = {"d/small.jpg": rnd(100_000, 1), "d/big.tar": rnd(20 * MiB + 3, 2)}
    with rclone_s3_server(tmp_path_factory.mktemp("tls-root"), tls=True) as server:
        assert server.endpoint_url.startswith("https://") and server.ca_bundle
        server.write_files("tls-bucket", objects)
        m = mount_factory(server, "tls-bucket", "d")
        assert sorted(os.listdir(m.mountpoint)) == ["big.tar", "small.jpg"]
        # The CA not given: one line and exit 5 at mount time, not a mount that fails every read.
        env = server_env(server)
        del env["AWS_CA_BUNDLE"]
        refused = subprocess.run(
            mount_cmd("s3://tls-bucket/d", empty_dir, "-f", "--connect-timeout", "3", endpoint_url=server.endpoint_url),
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
            stdin=subprocess.DEVNULL,
        )
        assert refused.returncode == 5, refused.stderr
        assert "AWS_CA_BUNDLE" in refused.stderr.strip().splitlines()[-1]
        assert "Traceback" not in refused.stderr
        for key, data in objects.items():
            with open(m.path(key[len("d/") :]), "rb") as f:
                assert sha(f.read()) == sha(data), key


def test_listing_of_20000_entries_is_complete_and_stable(rclone_server, s3_bucket, mount_factory):
    names = [f"item-{i:05d}.bin" for i in range(20_000)]
    rclone_server.write_files(s3_bucket, {f"many/{n}": b"" for n in names})
    assert_complete_listing(mount_factory(rclone_server, s3_bucket), "many", names)


def test_directories_list_dot_and_dotdot_first_with_their_inodes(rclone_server, s3_bucket, mount_factory):
    """`ls -a` shows . and .. as on a local file system; `ls -U -i` prints readdir's own
    order and inode numbers, which must be the directory's and its parent's."""
    rclone_server.write_files(s3_bucket, {"d/b": b"y", "d/sub/a": b"x"})
    m = mount_factory(rclone_server, s3_bucket)
    out = subprocess.run(["ls", "-1aUi", m.path("d")], capture_output=True, text=True, timeout=30, check=True).stdout
    entries = [(name, int(ino)) for ino, name in (line.split() for line in out.splitlines())]
    assert [name for name, _ in entries] == [".", "..", "b", "sub"]
    assert dict(entries)["."] == os.stat(m.path("d")).st_ino
    assert dict(entries)[".."] == os.stat(m.mountpoint).st_ino
    assert dict(entries)["sub"] == os.stat(m.path("d", "sub")).st_ino
    assert os.listdir(m.path("d")) == ["b", "sub"]


def walk_listing(top: str) -> list:
    """Every directory's readdir as a program sees it: names in readdir order, inode
    numbers and types (`ls -1aUi` prints d_ino), under `top`."""
    seen = []
    for dirpath, _dirnames, _filenames in os.walk(top):
        with os.scandir(dirpath) as it:
            seen.append((dirpath, [(e.name, e.inode(), e.is_dir(follow_symlinks=False)) for e in it]))
        out = subprocess.run(["ls", "-1aUi", dirpath], capture_output=True, text=True, timeout=30, check=True).stdout
        seen.append((dirpath, out))
    return seen


def test_a_second_walk_is_listed_by_the_kernel_with_the_same_entries(rclone_server, s3_bucket, mount_factory):
    """In the immutable default the kernel opens directories itself and keeps their
    entries: a second walk sends no OPENDIR, READDIR or RELEASEDIR to the daemon (the
    first sends one OPENDIR, answered ENOSYS), and lists the same names, inodes and
    types in the same order. With --metadata-ttl every opendir and readdir reaches the
    daemon (listings change)."""
    objects = {f"t/c{c}/f{i:03d}.jpg": b"j" * (i + 1) for c in range(3) for i in range(150)}
    objects.update({"t/c0/deeper/x.bin": b"x", "t/top.txt": b"t"})
    rclone_server.write_files(s3_bucket, objects)
    m = mount_factory(rclone_server, s3_bucket, "t")
    first = walk_listing(m.mountpoint)
    assert sorted(name for name, _ino, _d in first[0][1]) == ["c0", "c1", "c2", "top.txt"]
    expected = {os.path.dirname(k[len("t/") :]) for k in objects} | {"c0/deeper"}
    for rel in expected:  # every directory lists exactly its objects, after a cold walk through no handles
        names = {
            os.path.relpath(k, "t/" + rel if rel else "t").split("/")[0]
            for k in objects
            if k.startswith(f"t/{rel}/" if rel else "t/")
        }
        assert sorted(os.listdir(m.path(rel) if rel else m.mountpoint)) == sorted(names), rel
    before = m.stats()
    assert before["fuse.opendir"] == 1 and "fuse.releasedir" not in before and "errors.ENOSYS" not in before
    assert before["namespace.kernel_opens_dirs"] == 1
    assert walk_listing(m.mountpoint) == first
    after = m.stats()
    for op in ("fuse.readdir", "fuse.opendir", "fuse.releasedir"):
        assert after.get(op, 0) == before.get(op, 0), op
    assert "namespace.kernel_dir_cache_off" not in after

    ttl = mount_factory(rclone_server, s3_bucket, "t", "--metadata-ttl", "3600")
    walk_listing(ttl.mountpoint)
    before = ttl.stats()
    walk_listing(ttl.mountpoint)
    after = ttl.stats()
    assert after["fuse.readdir"] > before["fuse.readdir"]
    assert after["fuse.opendir"] > before["fuse.opendir"] and after["fuse.releasedir"] > before["fuse.releasedir"]
    assert "namespace.kernel_opens_dirs" not in after

    # --kernel-dir-cache off: immutable, but nothing written into pyfuse3's or libfuse's
    # memory; the same listing, every opendir and readdir answered by the daemon.
    off = mount_factory(rclone_server, s3_bucket, "t", "--kernel-dir-cache", "off")

    def relative(listing, top):
        return [(os.path.relpath(path, top), entries) for path, entries in listing]

    assert relative(walk_listing(off.mountpoint), off.mountpoint) == relative(first, m.mountpoint)
    before = off.stats()
    assert relative(walk_listing(off.mountpoint), off.mountpoint) == relative(first, m.mountpoint)
    after = off.stats()
    assert after["fuse.readdir"] > before["fuse.readdir"] and after["fuse.releasedir"] > before["fuse.releasedir"]
    assert after["namespace.kernel_dir_cache_off"] == 1 and "namespace.kernel_opens_dirs" not in after


def test_directories_listed_at_once_by_many_threads_each_list_their_own_entries(
    rclone_server, s3_bucket, mount_factory
):
    """With no OPENDIR, each READDIRPLUS is told its directory by the inode noted for
    its request: 32 threads listing 60 cold directories at once (and the list-ahead
    LISTs running beside them) must each get their own directory's entries."""
    objects = {f"p/d{d:02d}/f{d:02d}-{i:03d}": b"" for d in range(60) for i in range(d + 1)}
    rclone_server.write_files(s3_bucket, objects)
    m = mount_factory(rclone_server, s3_bucket, "p")

    def listing(d):
        with os.scandir(m.path(f"d{d:02d}")) as it:
            return sorted(e.name for e in it)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        listed = list(pool.map(listing, range(60)))
    assert listed == [[f"f{d:02d}-{i:03d}" for i in range(d + 1)] for d in range(60)]
    stats = m.stats()
    # OPENDIRs sent before the kernel took the first ENOSYS get ENOSYS too: none has a
    # handle, so none is released.
    assert stats["namespace.kernel_opens_dirs"] == 1 and "fuse.releasedir" not in stats


def test_special_names_round_trip(rclone_server, s3_bucket, mount_factory):
    rclone_server.write_files(s3_bucket, special_name_objects("s", SPECIAL_NAMES))
    assert_special_names_read_back(mount_factory(rclone_server, s3_bucket), "s", SPECIAL_NAMES)


def test_skipped_keys_do_not_break_the_listing(moto_server, mount_factory):
    bucket = moto_server.new_bucket()
    good = {"k/a.txt": b"a", "k/z.txt": b"z", "k/dir/x": b"x"}
    bad = ["k/b//c", "k/./d", "k/../e", "k/" + "n" * 300]
    for key, data in good.items():
        moto_server.put(bucket, key, data)
    for key in bad:
        moto_server.put(bucket, key, b"bad")
    moto_server.put(bucket, "k/dir", b"file and prefix")  # the directory wins
    m = mount_factory(moto_server, bucket, "k")
    listing = sorted(os.listdir(m.mountpoint))
    assert listing == ["a.txt", "b", "dir", "z.txt"]  # `b` is a real prefix; its `//` child is skipped
    assert os.listdir(m.path("b")) == []
    assert os.path.isdir(m.path("dir")) and os.listdir(m.path("dir")) == ["x"]
    assert open(m.path("z.txt"), "rb").read() == b"z"
    # No key escaped the mountpoint: `k/../e` left nothing beside it, and no name in the
    # whole tree is `.`, `..` or carries the skipped keys' bytes.
    assert os.listdir(os.path.dirname(m.mountpoint)) == [os.path.basename(m.mountpoint)]
    seen = [name for _, dirs, files in os.walk(m.mountpoint) for name in dirs + files]
    assert sorted(seen) == ["a.txt", "b", "dir", "x", "z.txt"]


def test_every_write_operation_is_erofs_and_bucket_unchanged(rclone_server, s3_bucket, mount_factory):
    rclone_server.write_files(s3_bucket, {"w/f.txt": b"data", "w/d/g.txt": b"g"})
    before = sorted((o["Key"], o["ETag"]) for o in rclone_server.client.list_objects_v2(Bucket=s3_bucket)["Contents"])
    m = mount_factory(rclone_server, s3_bucket)
    assert_every_write_is_erofs(m, "w", "f.txt", "d")
    f = m.path("w", "f.txt")
    after = sorted((o["Key"], o["ETag"]) for o in rclone_server.client.list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert after == before
    assert open(f, "rb").read() == b"data"
    fd = os.open(f, os.O_RDONLY | os.O_APPEND)  # a read-only open that names O_APPEND reads, as on any ro file system
    try:
        assert os.read(fd, 10) == b"data"
    finally:
        os.close(fd)


def test_reads_past_eof_zero_bytes_and_mmap(rclone_server, s3_bucket, mount_factory):
    data = rnd(3 * MiB + 5, 7)
    rclone_server.write_files(s3_bucket, {"z/empty": b"", "z/blob": data})
    m = mount_factory(rclone_server, s3_bucket)
    assert open(m.path("z", "empty"), "rb").read() == b""
    fd = os.open(m.path("z", "blob"), os.O_RDONLY)
    try:
        assert os.pread(fd, 100, len(data) - 10) == data[-10:]
        assert os.pread(fd, 100, len(data)) == b""
        assert os.pread(fd, 100, len(data) + 12345) == b""
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mm:
            assert mm[:100] == data[:100]
            assert mm[2 * MiB : 2 * MiB + 4096] == data[2 * MiB : 2 * MiB + 4096]
            assert sha(mm[:]) == sha(data)
    finally:
        os.close(fd)


def test_object_over_5_gib_reads_at_any_offset(rclone_server, s3_bucket, mount_factory):
    size = 5 * 1024 * MiB + 12345
    marks = {0: b"head", 4 * 1024 * MiB: b"four-gib", size - 9: b"tail-mark"}
    path = rclone_server.root_dir / s3_bucket / "huge" / "big.bin"
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:  # sparse: only the marks take disk space
        f.truncate(size)
        for off, mark in marks.items():
            f.seek(off)
            f.write(mark)
    rclone_server.rclone_rc("vfs/forget")
    m = mount_factory(rclone_server, s3_bucket, "", "--read-timeout", "120")
    assert os.stat(m.path("huge", "big.bin")).st_size == size
    fd = os.open(m.path("huge", "big.bin"), os.O_RDONLY)
    try:
        for off, mark in marks.items():
            assert os.pread(fd, len(mark), off) == mark
        assert os.pread(fd, 10, 5 * 1024 * MiB) == b"\0" * 10
    finally:
        os.close(fd)


def test_an_empty_prefix_mounts_with_a_warning_that_names_the_cause(moto_server, mount_factory):
    """A mistyped prefix, or an object's key given as the prefix, mounts an empty
    directory (the store cannot tell a typo from a folder yet to be filled), and says
    so at once, rather than as a loader's "Found 0 files" later."""
    bucket = moto_server.new_bucket()
    moto_server.put(bucket, "data/a.jpg", b"x")
    moto_server.put(bucket, "data.tar", b"not a folder")
    typo = mount_factory(moto_server, bucket, "dat")
    assert os.listdir(typo.mountpoint) == []
    assert f"s3://{bucket}/dat/ is empty: nothing is stored under it" in typo.stderr_text
    an_object = mount_factory(moto_server, bucket, "data.tar")
    assert f"s3://{bucket}/data.tar is an object, not a folder" in an_object.stderr_text
    good = mount_factory(moto_server, bucket, "data")
    assert os.listdir(good.mountpoint) == ["a.jpg"]
    assert "is empty" not in good.stderr_text


@pytest.mark.parametrize("server_name", ["rclone_server", "moto_server"])
def test_overwrite_mid_read_gives_estale_never_mixed_bytes(request, server_name, mount_factory):
    server = request.getfixturevalue(server_name)
    bucket = server.new_bucket()

    def put_many(objects):
        for key, data in objects.items():
            server.put(bucket, key, data)

    assert_overwrite_mid_read_is_stale(lambda *args: mount_factory(server, bucket, "", *args), put_many)


def test_ttl_mount_drops_vanished_objects_under_churn(rclone_server, s3_bucket, mount_factory):
    """With --metadata-ttl, objects that come and go do not pile up in the daemon: a
    re-listing that no longer shows a name the kernel holds invalidates it in the
    kernel, the kernel FORGETs the inode, and the daemon drops the node. Live entries
    follow the listing, not every object ever seen; the names that stay keep serving
    the right bytes, and the vanished ones are ENOENT."""
    m = mount_factory(rclone_server, s3_bucket, "", "--metadata-ttl", "0")
    client = rclone_server.client
    files_count, rounds, previous = 40, 3, []

    for round_ in range(rounds):
        names = [f"r{round_}-{i:03d}.bin" for i in range(files_count)]
        for i, name in enumerate(names):
            client.put_object(Bucket=s3_bucket, Key=f"churn/{name}", Body=rnd(1000 + i, round_ * 1000 + i))
        for name in previous:
            client.delete_object(Bucket=s3_bucket, Key=f"churn/{name}")
        assert sorted(os.listdir(m.path("churn"))) == names  # READDIRPLUS hands the kernel every entry
        for i, name in enumerate(names):
            assert os.stat(m.path("churn", name)).st_size == 1000 + i  # and so does each lookup
        previous = names
    # Nobody touched the vanished names again: the invalidations alone let them go.
    # Left: the root, churn/ and the last round.
    wait_for(lambda: m.stats()["namespace.entries"] == 2 + files_count, 20, "vanished nodes dropped")
    after = m.stats()
    assert after["namespace.nodes_dropped"] == (rounds - 1) * files_count
    assert after["namespace.invalidations"] == (rounds - 1) * files_count
    with pytest.raises(FileNotFoundError):
        os.stat(m.path("churn", "r0-007.bin"))
    with open(m.path("churn", previous[7]), "rb") as f:
        assert f.read() == rnd(1007, (rounds - 1) * 1000 + 7)


def test_ttl_mount_a_rewritten_object_is_a_new_file(rclone_server, s3_bucket, mount_factory):
    """With --metadata-ttl, an object rewritten with another size is a new inode: a file
    opened before keeps the old version's size and reads its bytes (or ESTALE), a new
    open reads the whole new version. Never one version's bytes at the other's size
    (the kernel used to cut a new version at the old size)."""
    client = rclone_server.client
    old, new = rnd(550, 1), rnd(600, 2)
    client.put_object(Bucket=s3_bucket, Key="v/f", Body=old)
    m = mount_factory(rclone_server, s3_bucket, "", "--metadata-ttl", "0")
    path = m.path("v", "f")
    fd = os.open(path, os.O_RDONLY)
    try:
        before = os.fstat(fd)
        assert before.st_size == len(old)
        client.put_object(Bucket=s3_bucket, Key="v/f", Body=new)
        after = os.stat(path)
        assert (after.st_size, after.st_ino != before.st_ino) == (len(new), True)
        assert os.fstat(fd).st_size == len(old)  # the open file is still the old version
        with open(path, "rb") as f:
            assert f.read() == new
        try:
            assert os.pread(fd, 4096, 0) == old  # fetched whole at open (a small file)
        except OSError as exc:
            assert exc.errno == errno.ESTALE
    finally:
        os.close(fd)


def test_disk_cache_serves_an_epoch_that_memory_cannot_hold(rclone_server, s3_bucket, mount_factory, tmp_path):
    """With --cache-dir, a second epoch over more data than --max-memory, with the
    kernel's copy of each file dropped, reads the local disk: not one GET. So does
    the next mount of the same bucket, but not for an object changed in between."""
    files = {f"dc/img/{i:03d}.jpg": rnd(300_000 + i, 500 + i) for i in range(60)}  # 18 MB of small files
    files["dc/shard-0.tar"] = rnd(24 * MiB + 5, 600)  # read-ahead parts
    rclone_server.write_files(s3_bucket, files)
    cache_dir = tmp_path / "cache"
    m = mount_factory(rclone_server, s3_bucket, "dc", "--cache-dir", str(cache_dir), "--max-memory", "16M")

    def epoch():
        for key, data in files.items():
            with open(m.path(key[len("dc/") :]), "rb") as f:
                assert f.read() == data, key
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the next read reaches the daemon

    epoch()
    total_bytes = sum(map(len, files.values()))

    def stored_or_skipped_bytes():  # (a store the budget cannot lend memory to is skipped: logged in stats)
        stats = m.stats()
        return stats.get("disk_cache.written_bytes", 0) + stats.get("disk_cache.skipped_bytes", 0)

    wait_for(lambda: stored_or_skipped_bytes() >= total_bytes, 30, "disk cache writes")
    assert len(list(cache_dir.iterdir())) == 1  # the bucket's directory
    before = m.stats()
    skipped_stores = before.get("disk_cache.skipped_stores", 0)
    # Under load a busy 16 MiB budget may skip a few stores (a shard's last bytes while
    # its read-ahead parts fill it); each costs at most one GET below, and they are rare.
    assert before.get("disk_cache.skipped_bytes", 0) <= total_bytes // 100
    epoch()
    after = m.stats()
    assert after["backend.requests.get"] - before["backend.requests.get"] <= skipped_stores
    assert after["disk_cache.hits"] >= len(files) // 2  # the rest were still in memory
    # What the next mount cannot find on disk: at most what a store skipped, in either
    # epoch (a chunk skipped twice counts twice). Stores still queued land at unmount.
    never_stored_bytes = after.get("disk_cache.skipped_bytes", 0)
    never_stored_count = after.get("disk_cache.skipped_stores", 0)
    m.close()
    assert len(list(cache_dir.iterdir())) == 1  # kept for the next mount

    files["dc/img/007.jpg"] = rnd(300_007, 1007)  # changed while nothing was mounted: same size, new bytes
    rclone_server.write_files(s3_bucket, {"dc/img/007.jpg": files["dc/img/007.jpg"]})
    m = mount_factory(rclone_server, s3_bucket, "dc", "--cache-dir", str(cache_dir), "--max-memory", "16M")
    epoch()  # byte-identical to the bucket as it is now, or it fails here
    after = m.stats()
    assert 1 <= after["backend.requests.get"] <= 1 + never_stored_count  # the changed object (and what was skipped)
    assert after["disk_cache.loaded_bytes"] >= total_bytes - never_stored_bytes
    # All of it is read ahead (42 MB: within half the free memory), but for an object a
    # skipped store left with holes (the shard's last part, say): reading it whole would
    # read its holes too, so it is not.
    sparse_bytes = len(files["dc/shard-0.tar"]) if never_stored_count else 0
    assert (
        after["disk_cache.loaded_bytes"] - sparse_bytes
        <= after["disk_cache.read_ahead_bytes"]
        <= after["disk_cache.loaded_bytes"]
    )
    assert after.get("disk_cache.bad_reads", 0) == 0
    if pagecache.no_wait_reads():  # files the last mount wrote are in the page cache: read on the event loop
        assert after.get("disk_cache.loop_reads", 0) >= len(files) // 2
