#!/usr/bin/env python3
"""The listing index's benchmark (issue 38): `bucketfs index build` against
sequential ListObjectsV2 pages, and a mount from an index of 1,000,000 entries.

    python3 scripts/index_bench.py                          # both parts
    python3 scripts/index_bench.py --only build --objects 200000
    python3 scripts/index_bench.py --only mount --index-entries 1000000 --listed-sample 100000

The store: `rclone serve s3` over a local directory (created once under --data-dir,
200,000 files written straight to disk), behind scripts/latency_proxy.py (20 ms to
the first byte of every answer, as bench.py's stores). rclone reads its whole
directory for each LIST page (2-7 s a page with 200,000 files, ~465 s for the
listing), which no real store does: so LISTs are answered by a front in a process
of its own (ListFront, below) from a sorted snapshot of the served directory taken
at start (keys, sizes, modification times to the millisecond, MD5 ETags, as rclone
lists them), a page costing what a page costs; every other request (HEAD, GET) goes
on to rclone. The proxy counts requests by kind (LIST, GET, HEAD).

Part 1 ("build"), a flat prefix of --objects keys, all through the proxy:
- sequential: the S3 backend's flat LIST pages, one after the other, as a listing
  does today (in this process);
- ranges: bucketfs's ParallelLister (what index build runs), in this process, with
  --concurrency LISTs in flight, three times (the median is the figure);
- the command: `bucketfs index build URL --out FILE` in a subprocess, end to end
  (interpreter start, listing, encoding, writing);
and whether the entries (key, size, mtime, version) are the same in all three.

Part 2 ("mount"): an index of --index-entries entries (1000 directories; generated,
not listed: only the first directory's objects exist in the store, with the versions
the index names) is mounted with --index: the time from `bucketfs mount --foreground`
to READY=1, the LISTs it sent (proxy), then every entry walked and stat'ed through
the mount and the daemon's RSS growth per entry; beside it, a --listed-sample of real
objects mounted without an index (listed) and with one (built by index build), walked
the same way: RSS per entry of each.

Machine load matters (2 cores): the load average is printed before each part.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import hashlib
import json
import os
import pathlib
import resource
import subprocess
import sys
import time
import urllib.parse

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

BUCKET = "bench-index"
LATENCY_MS = 20.0
CONN_MBPS = 1000.0  # (listings are small: the first-byte latency is what counts)
RANGES_RUNS = 3


# -- the LIST front (a process of its own) -------------------------------------------


def _iso_ms(mtime_ns: int) -> str:
    seconds, rest_ns = divmod(mtime_ns, 10**9)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{rest_ns // 10**6:03d}Z"


def _encode(text: str) -> str:
    return urllib.parse.quote(text, safe="/-_.~")


class Snapshot:
    """The bucket's keys in order, each with its <Contents> element ready."""

    def __init__(self, bucket_dir: pathlib.Path):
        entries = []
        for root, _dirs, files in os.walk(bucket_dir):
            for name in files:
                path = os.path.join(root, name)
                st = os.stat(path)
                with open(path, "rb") as f:
                    etag = hashlib.md5(f.read()).hexdigest()
                key = os.path.relpath(path, bucket_dir)
                entries.append((key, st.st_size, st.st_mtime_ns, etag))
        entries.sort()
        self.keys = [key for key, *_ in entries]
        self.contents = [
            f"<Contents><Key>{_encode(key)}</Key><LastModified>{_iso_ms(mtime_ns)}</LastModified>"
            f"<ETag>&quot;{etag}&quot;</ETag><Size>{size}</Size><StorageClass>STANDARD</StorageClass></Contents>"
            for key, size, mtime_ns, etag in entries
        ]

    def page(self, query: dict) -> str:
        """A ListObjectsV2 answer (encoding-type=url) for `query`; the continuation
        token is the position where the next page starts."""
        prefix = query.get("prefix", [""])[0]
        delimiter = query.get("delimiter", [""])[0]
        max_keys = min(int(query.get("max-keys", ["1000"])[0]), 1000)
        keys, n = self.keys, len(self.keys)
        first = bisect.bisect_left(keys, prefix)
        token = query.get("continuation-token", [""])[0]
        start_after = query.get("start-after", [""])[0]
        if token:
            i = int(token)
        elif start_after:
            i = max(bisect.bisect_right(keys, start_after), first)
        else:
            i = first
        out, prefixes, count = [], [], 0
        while i < n and keys[i].startswith(prefix) and count < max_keys:
            key = keys[i]
            if delimiter:
                at = key.find(delimiter, len(prefix))
                if at >= 0:
                    common = key[: at + len(delimiter)]
                    prefixes.append(f"<CommonPrefixes><Prefix>{_encode(common)}</Prefix></CommonPrefixes>")
                    i = bisect.bisect_left(keys, common + "\U0010ffff")
                    count += 1
                    continue
            out.append(self.contents[i])
            i += 1
            count += 1
        truncated = i < n and keys[i].startswith(prefix)
        head = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{BUCKET}</Name><Prefix>{_encode(prefix)}</Prefix><KeyCount>{count}</KeyCount>"
            f"<MaxKeys>{max_keys}</MaxKeys><EncodingType>url</EncodingType>"
            f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"
            + (f"<NextContinuationToken>{i}</NextContinuationToken>" if truncated else "")
        )
        return head + "".join(out) + "".join(prefixes) + "</ListBucketResult>"


def serve_list_front(upstream_url: str, bucket_dir: str) -> int:
    """The front's process: print LISTENING URL, serve until stdin closes."""
    from bucketfs.testing.counting_proxy import CountingProxy

    snapshot = Snapshot(pathlib.Path(bucket_dir))

    class ListFront(CountingProxy):
        def answer(self, handler) -> None:
            split = urllib.parse.urlsplit(handler.path)
            query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
            if handler.command == "GET" and "list-type" in query and split.path.strip("/") == BUCKET:
                body = snapshot.page(query).encode()
                handler.request_body()
                handler.send_answer_head(200, "OK", [("Content-Type", "application/xml")], len(body))
                handler.wfile.write(body)
                return
            super().answer(handler)

        def _record(self, request) -> None:
            pass  # (nothing counted here: the latency proxy counts)

    front = ListFront(upstream_url)
    front.start()
    print(f"LISTENING {front.url} {len(snapshot.keys)}", flush=True)
    try:
        sys.stdin.read()
    finally:
        front.stop()
    return 0


@contextlib.contextmanager
def list_front(upstream_url: str, bucket_dir: pathlib.Path):
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-list-front", upstream_url, str(bucket_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("LISTENING "):
            raise RuntimeError(f"the LIST front did not start: {line!r}")
        _, url, keys_count = line.split()
        yield url, int(keys_count), proc.pid
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the store -----------------------------------------------------------------------


def make_flat(bucket_dir: pathlib.Path, objects: int) -> None:
    """`objects` files under flat/ (10 bytes each), kept across runs."""
    flat = bucket_dir / "flat"
    flat.mkdir(parents=True, exist_ok=True)
    have = len(os.listdir(flat))
    if have == objects:
        return
    for name in os.listdir(flat):
        os.unlink(flat / name)
    for i in range(objects):
        with open(flat / f"obj-{i:06d}.bin", "wb") as f:
            f.write(b"%010d" % i)


def make_listed(bucket_dir: pathlib.Path, objects: int) -> None:
    """`objects` files under listed/, 1000 to a directory (an ImageFolder's shape)."""
    top = bucket_dir / "listed"
    if top.is_dir() and sum(len(files) for _, _, files in os.walk(top)) == objects:
        return
    import shutil

    shutil.rmtree(top, ignore_errors=True)
    for i in range(objects):
        folder = top / f"c{i // 1000:04d}"
        if i % 1000 == 0:
            folder.mkdir(parents=True)
        with open(folder / f"img{i:07d}.jpg", "wb") as f:
            f.write(b"x" * 100)


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


@contextlib.contextmanager
def store(data_dir: pathlib.Path):
    """rclone over data_dir, the LIST front before it, the latency proxy before that:
    yields (server, proxy)."""
    from latency_proxy import ProxyProcess

    from bucketfs.testing.servers import rclone_s3_server

    with rclone_s3_server(data_dir) as server:
        started_s = time.monotonic()
        with list_front(server.endpoint_url, data_dir / BUCKET) as (front_url, keys_count, front_pid):
            print(
                f"store: rclone serve s3 (pid {server.pid}), LIST front over {keys_count:,} keys "
                f"(snapshot {time.monotonic() - started_s:.1f} s), latency proxy {LATENCY_MS:g} ms",
                flush=True,
            )
            with ProxyProcess(front_url, LATENCY_MS, CONN_MBPS) as proxy:
                proxy.front_pid = front_pid  # (for the CPU accounting of bench_build)
                yield server, proxy


def _lists(proxy) -> int:
    return proxy.stats()["requests"].get("LIST", 0)


class StoreCpu:
    """CPU seconds the store side (the LIST front and the latency proxy) and the lister
    (this process, or the command's) spent over a run: with two cores shared by all of
    them, the run cannot be shorter than the lister's CPU (one Python thread does the
    parsing) nor than everyone's CPU over the cores. That floor, against the
    sequential pages' time, is the most any lister could gain here."""

    def __init__(self, proxy):
        from bench.procs import proc_cpu_s

        self._cpu_of = proc_cpu_s
        self._pids = (proxy.front_pid, proxy.pid)
        self._store_s = sum(map(proc_cpu_s, self._pids))
        self._self_s = time.process_time()
        self._children = resource.getrusage(resource.RUSAGE_CHILDREN)

    def split(self) -> tuple:
        """(lister CPU s, store-side CPU s) since construction."""
        store_s = sum(map(self._cpu_of, self._pids)) - self._store_s
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        lister_s = (
            time.process_time()
            - self._self_s
            + (children.ru_utime - self._children.ru_utime)
            + (children.ru_stime - self._children.ru_stime)
        )
        return lister_s, store_s

    def report(self, sequential_s: float, run_s: float) -> dict:
        lister_s, store_s = self.split()
        cores = os.cpu_count() or 1
        floor_s = max(lister_s, (lister_s + store_s) / cores)
        print(
            f"    CPU: lister {lister_s:.2f} s, LIST front + proxy {store_s:.2f} s; on {cores} cores the run "
            f"takes >= {floor_s:.2f} s (wall {run_s:.2f} s): at most {sequential_s / floor_s:.1f}x the "
            "sequential pages on this machine",
            flush=True,
        )
        return {"lister_cpu_s": lister_s, "store_cpu_s": store_s, "floor_s": floor_s}


# -- part 1: build -------------------------------------------------------------------


def _quiet_collector() -> None:
    """Before a timed listing: what earlier runs left (hundreds of thousands of
    ObjectInfos, kept to compare) out of the cyclic collector's sight. Else one full
    collection over them lands in every third run or so, ~0.1 s of this process's CPU
    that is not the lister's (ParallelLister lists with the collector off, and
    `bucketfs index build` runs without it)."""
    gc.collect()
    gc.freeze()


def bench_build(server, proxy, objects: int, concurrency: int, work_dir: pathlib.Path) -> dict:
    import trio

    from bucketfs.app.indexbuild import ParallelLister
    from bucketfs.backends.s3 import S3Backend
    from bucketfs.core.listing_index import decode_index

    prefix = "flat/"
    config = server.config(BUCKET, endpoint_url=proxy.url, max_connections_count=concurrency)

    def entries_of(objects_list) -> list:
        return [(o.key[len(prefix) :], o.size_bytes, o.mtime_ns, o.version) for o in objects_list]

    async def sequential():
        backend = S3Backend(config, session=server.session())
        try:
            out, start_after = [], ""
            while True:
                page = await backend.list_flat_page(prefix, start_after)
                out += page.objects
                if page.next_token is None:
                    return out
                start_after = page.next_token
        finally:
            await backend.aclose()

    async def ranges():
        backend = S3Backend(config, session=server.session())
        try:
            lister = ParallelLister(backend, prefix, concurrency)
            return await lister.run(), lister.progress.most_in_flight
        finally:
            await backend.aclose()

    print(f"build: load average {load_average()}", flush=True)
    lists_before = _lists(proxy)
    _quiet_collector()
    started_s = time.monotonic()
    seq = trio.run(sequential)
    sequential_s = time.monotonic() - started_s
    sequential_lists = _lists(proxy) - lists_before
    print(f"  sequential pages: {len(seq):,} objects in {sequential_s:.2f} s, {sequential_lists} LISTs", flush=True)

    # The ranges run RANGES_RUNS times (a second or so each): the figure is their median,
    # each run printed (on 2 cores shared with the store, one run swings by 20%).
    runs = []
    for _ in range(RANGES_RUNS):
        par = None  # (the last run's objects freed before the next starts, not during it)
        _quiet_collector()
        lists_before = _lists(proxy)
        cpu = StoreCpu(proxy)
        started_s = time.monotonic()
        par, most_in_flight = trio.run(ranges)
        run_s = time.monotonic() - started_s
        run_lists = _lists(proxy) - lists_before
        print(
            f"  ranges (ParallelLister, --concurrency {concurrency}): {len(par):,} objects in {run_s:.2f} s, "
            f"{run_lists} LISTs, at most {most_in_flight} in flight: {sequential_s / run_s:.1f}x",
            flush=True,
        )
        runs.append((run_s, run_lists, cpu.report(sequential_s, run_s)))
    ranges_s, ranges_lists, ranges_cpu = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
    print(f"  ranges, the median of {len(runs)} runs: {ranges_s:.2f} s, {sequential_s / ranges_s:.1f}x", flush=True)

    out = work_dir / "flat.idx"
    env = dict(os.environ, **server.env())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    lists_before = _lists(proxy)
    cpu = StoreCpu(proxy)
    started_s = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bucketfs",
            "index",
            "build",
            f"s3://{BUCKET}/{prefix}",
            "--out",
            str(out),
            "--endpoint-url",
            proxy.url,
            "--concurrency",
            str(concurrency),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    command_s = time.monotonic() - started_s
    command_lists = _lists(proxy) - lists_before
    if proc.returncode != 0:
        raise RuntimeError(f"index build failed ({proc.returncode}): {proc.stderr}")
    index = decode_index(out.read_bytes(), expected_url=f"s3://{BUCKET}/{prefix}")
    from_index = sorted(index.entries())
    same = entries_of(seq) == entries_of(par) == from_index
    print(
        f"  bucketfs index build (the command, end to end): {index.objects_count:,} objects in {command_s:.2f} s, "
        f"{command_lists} LISTs, {out.stat().st_size:,} bytes: {sequential_s / command_s:.1f}x",
        flush=True,
    )
    command_cpu = cpu.report(sequential_s, command_s)
    print(f"  entries equal (key, size, mtime, version) in all three: {same}", flush=True)
    return {
        "objects": len(seq),
        "sequential_s": sequential_s,
        "sequential_lists": sequential_lists,
        "ranges_s": ranges_s,
        "ranges_lists": ranges_lists,
        "ranges_ratio": sequential_s / ranges_s,
        "command_s": command_s,
        "command_lists": command_lists,
        "command_ratio": sequential_s / command_s,
        "ranges_cpu": ranges_cpu,
        "command_cpu": command_cpu,
        "index_bytes": out.stat().st_size,
        "entries_equal": same,
        "load_average": load_average(),
    }


# -- part 2: mount -------------------------------------------------------------------


def _rss_bytes(pid: int) -> int:
    from bench.procs import proc_status_kib

    return proc_status_kib(pid, "VmRSS") * 1024


def _walk_stat(root: str) -> int:
    seen = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            os.stat(os.path.join(dirpath, name))
            seen += 1
    return seen


def synthetic_index(path: pathlib.Path, bucket_dir: pathlib.Path, entries: int) -> None:
    """An index of s3://BUCKET/imagenet/ with `entries` entries in 1000 directories;
    the first directory's objects are written to the store, at the versions named."""
    from bucketfs.core.listing_index import encode_index

    per_dir = entries // 1000
    first_dir = bucket_dir / "imagenet" / "train" / "n00000000"
    first_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    mtime_ns = 1_795_000_000 * 10**9
    for d in range(1000):
        for i in range(per_dir):
            name = f"train/n{d:08d}/n{d:08d}_{i:05d}.JPEG"
            if d == 0:
                data = hashlib.sha256(name.encode()).digest() * 4
                (first_dir / os.path.basename(name)).write_bytes(data)
                st = (first_dir / os.path.basename(name)).stat()
                rows.append((name, len(data), st.st_mtime_ns // 10**6 * 10**6, hashlib.md5(data).hexdigest()))
            else:
                rows.append((name, 100_000 + i, mtime_ns + i, hashlib.md5(name.encode()).hexdigest()))
    path.write_bytes(encode_index(f"s3://{BUCKET}/imagenet/", rows, time.time_ns(), created_by="index_bench"))


def _mount(server, proxy, url: str, mountpoint: pathlib.Path, work_dir: pathlib.Path, *args):
    from bucketfs.testing.mounting import Mount, server_env

    env = server_env(server)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    mountpoint.mkdir(parents=True, exist_ok=True)
    started_s = time.monotonic()
    mount = Mount(url, str(mountpoint), env, ("--max-memory", "4G", *args), endpoint_url=proxy.url)
    return mount, time.monotonic() - started_s


def _rss_per_entry(mount) -> tuple:
    pid = mount.proc.pid
    os.listdir(mount.mountpoint)
    before = _rss_bytes(pid)
    started_s = time.monotonic()
    seen = _walk_stat(mount.mountpoint)
    walk_s = time.monotonic() - started_s
    grown = _rss_bytes(pid) - before
    return seen, grown / max(seen, 1), walk_s, mount.stats().get("memory.listings_bytes", 0)


def bench_mount(server, proxy, entries: int, listed_sample: int, work_dir: pathlib.Path) -> dict:
    index_path = work_dir / "imagenet.idx"
    print(
        f"mount: an index of {entries:,} entries, {index_path.stat().st_size:,} bytes; load average {load_average()}",
        flush=True,
    )
    results: dict = {"entries": entries, "index_bytes": index_path.stat().st_size}
    lists_before = _lists(proxy)
    mount, ready_s = _mount(
        server, proxy, f"s3://{BUCKET}/imagenet/", work_dir / "mnt-index", work_dir, "--index", str(index_path)
    )
    try:
        ready_lists = _lists(proxy) - lists_before
        print(f"  ready in {ready_s:.2f} s (bucketfs mount --foreground to READY=1), {ready_lists} LISTs", flush=True)
        seen, per_entry, walk_s, charged = _rss_per_entry(mount)
        first = os.path.join(mount.mountpoint, "train", "n00000000")
        for name in sorted(os.listdir(first))[:50]:
            with open(os.path.join(first, name), "rb") as f:
                expected = hashlib.sha256(f"train/n00000000/{name}".encode()).digest() * 4
                assert f.read() == expected, name
        walk_lists = _lists(proxy) - lists_before
        print(
            f"  walk + stat of {seen:,} entries: {walk_s:.1f} s, daemon RSS +{per_entry:.0f} B per entry "
            f"(charged to the budget: {charged / max(seen, 1):.0f} B); 50 files read right; LISTs in all: "
            f"{walk_lists}",
            flush=True,
        )
        results.update(
            ready_s=ready_s,
            ready_lists=ready_lists,
            walk_lists=walk_lists,
            index_rss_per_entry=per_entry,
            walked=seen,
            walk_s=walk_s,
        )
    finally:
        mount.close()

    sample_index = work_dir / "listed.idx"
    env = dict(os.environ, **server.env())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bucketfs",
            "index",
            "build",
            f"s3://{BUCKET}/listed/",
            "--out",
            str(sample_index),
            "--endpoint-url",
            proxy.url,
        ],
        env=env,
        check=True,
        timeout=600,
    )
    for label, args in (("listed (no index)", ()), ("from its index", ("--index", str(sample_index)))):
        lists_before = _lists(proxy)
        mount, ready_s = _mount(server, proxy, f"s3://{BUCKET}/listed/", work_dir / f"mnt-{len(args)}", work_dir, *args)
        try:
            seen, per_entry, walk_s, charged = _rss_per_entry(mount)
        finally:
            mount.close()
        lists = _lists(proxy) - lists_before
        print(
            f"  {listed_sample:,} real objects, {label}: ready {ready_s:.2f} s, walk + stat {walk_s:.1f} s, "
            f"daemon RSS +{per_entry:.0f} B per entry, {lists} LISTs",
            flush=True,
        )
        results["sample_" + ("listed" if not args else "index")] = {
            "ready_s": ready_s,
            "walk_s": walk_s,
            "rss_per_entry": per_entry,
            "lists": lists,
            "walked": seen,
        }
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("build", "mount"), help="one part only")
    parser.add_argument("--objects", type=int, default=200_000, help="keys of the flat prefix (default 200,000)")
    parser.add_argument("--concurrency", type=int, default=64, help="index build's LISTs in flight (default 64)")
    parser.add_argument("--index-entries", type=int, default=1_000_000, help="entries of the mounted index")
    parser.add_argument("--listed-sample", type=int, default=100_000, help="real objects mounted both ways")
    parser.add_argument("--data-dir", default=str(REPO_ROOT / ".bench-data" / "index"), help="the store's directory")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--serve-list-front", nargs=2, metavar=("UPSTREAM", "BUCKET_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_list_front:
        return serve_list_front(*args.serve_list_front)

    import tempfile

    data_dir = pathlib.Path(args.data_dir)
    bucket_dir = data_dir / BUCKET
    bucket_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bucketfs-index-bench-") as work:
        # Everything on disk before the store starts: the LIST front lists a snapshot.
        started_s = time.monotonic()
        if args.only != "mount":
            make_flat(bucket_dir, args.objects)
        if args.only != "build":
            make_listed(bucket_dir, args.listed_sample)
            synthetic_index(pathlib.Path(work) / "imagenet.idx", bucket_dir, args.index_entries)
        print(f"data: {data_dir} ready in {time.monotonic() - started_s:.1f} s", flush=True)
        with store(data_dir) as (server, proxy):
            if args.only != "mount":
                results["build"] = bench_build(server, proxy, args.objects, args.concurrency, pathlib.Path(work))
            if args.only != "build":
                results["mount"] = bench_mount(
                    server, proxy, args.index_entries, args.listed_sample, pathlib.Path(work)
                )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
