"""The workloads, as methods of `Bench` (runner.py): W1 shard streaming (threads and a
webdataset DataLoader), W2 ImageFolder (listing, cold, warm, evicted and remounted
epochs, one through a second mount sharing the first's disk cache; then copy-then-read,
copythenread.py), W3 metadata (listdir, walk+stat, ls -l), W4 random preads, W5 small
files and shards at once. Each registers its rows and records every system's value. W1 (threads),
W2 and W5 also run s3torchconnector where it is installed (s3torch.py)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from .common import CACHED_PASSES, ENTRY, MB, PARALLEL_PARTS, READ_BYTES, RUN_TIMEOUT_S, digest, log
from .datasets import Verifier
from .procs import RssSampler, drop_caches, proc_status_kib
from .readers import file_reader, median_run, pull_loop, read_file_streaming, read_object_direct, run_threads
from .s3torch import SYSTEM as S3TORCH
from .stores import S3Direct
from .systems import beside

W5_SMALL_READERS = 32  # W5's threads reading the ImageFolder files...
W5_SHARD_READERS = 4  # ... while these stream the shards


class Workloads:
    """W1-W5, mixed into `Bench` (runner.py)."""

    # -- W1 shards --------------------------------------------------------------
    def w1(self) -> None:
        ds = self.ds
        total = ds.bytes_of(ds.shards)
        for readers, target in ((1, 570), (4, 800)):
            key = f"W1.{readers}"
            self.row(key, f"W1 shards, {readers} reader{'s' if readers > 1 else ''}", "MB/s", True, f">= {target} MB/s")
            if readers == 4:
                self.row("W1.4next", "W1 shards, 4 readers, next epoch (page cache dropped)", "MB/s", True, "-")
            groups = [ds.shards[r::readers] for r in range(readers)]
            for system in (*self.systems, *self.s3torch_systems()):
                self.cold(system)
                if system == S3TORCH:
                    client = self.s3torch_client()

                    def fn(v, client=client):
                        def reader(group):
                            buf = self.s3torch_read_buffer()
                            for rel in group:
                                v.check(rel, *self.s3torch_stream(client, rel, buf))

                        wall = run_threads(reader, [(g,) for g in groups], v)
                        return {"MB/s": round(total / wall / MB, 1)}
                elif system == "direct":
                    client = self.backend.direct(readers * PARALLEL_PARTS)
                    executors = [ThreadPoolExecutor(PARALLEL_PARTS) for _ in groups]

                    def fn(v, client=client, executors=executors):
                        def reader(group, ex):
                            for rel in group:
                                v.check(rel, *read_object_direct(client, ds.bucket, rel, ds.size(rel), ex))

                        wall = run_threads(reader, list(zip(groups, executors)), v)
                        return {"MB/s": round(total / wall / MB, 1)}
                else:
                    fn = self.w1_fs_run(self.root(system), readers)

                run = self.measure(f"W1 {readers} reader(s)", system, fn)
                self.record(key, system, run.get("MB/s"))
                if readers == 4 and system != S3TORCH:
                    # The next epoch of shards larger than RAM: the same mount, its page
                    # cache dropped (direct ranged GETs keep nothing: theirs is a second run).
                    if system != "direct":
                        self.dropped_ok = drop_caches() and self.dropped_ok
                    run = self.measure(f"W1 {readers} reader(s), next epoch", system, fn)
                    self.record("W1.4next", system, run.get("MB/s"))
                if system == "direct":
                    for ex in executors:
                        ex.shutdown()
                    client.close()
                client = None  # (s3torchconnector's: its native client goes with it)
        self.w1_webdataset()

    def w1_fs_run(self, root: str, readers: int) -> Callable[[Verifier], dict]:
        """W1's run on a file system at `root`: `readers` threads, each streaming its
        share of the shards with 1 MiB reads."""
        total = self.ds.bytes_of(self.ds.shards)
        groups = [self.ds.shards[r::readers] for r in range(readers)]

        def fn(v):
            def reader(group):
                buf = bytearray(READ_BYTES)
                for rel in group:
                    v.check(rel, *read_file_streaming(os.path.join(root, rel), buf))

            wall = run_threads(reader, [(g,) for g in groups], v)
            return {"MB/s": round(total / wall / MB, 1)}

        return fn

    def w1_webdataset(self) -> None:
        ds = self.ds
        row = self.row("W1.wds", "W1 webdataset DataLoader(2)", "samples/s", True, ">= 0.9x local")
        probe = subprocess.run([sys.executable, "-c", "import webdataset, torch"], capture_output=True)
        if probe.returncode != 0:
            row.target += " (skipped: pip install webdataset torch)"
            log("  W1 webdataset: skipped: pip install webdataset torch")
            return
        brace = f"shards/shard-{{000000..{ds.spec.shard_count - 1:06d}}}.tar"
        for system in self.systems:
            self.cold(system)
            if system == "direct":
                spec = {
                    "urls": f"{self.backend.wds_scheme}://{ds.bucket}/{brace}",
                    "mode": "direct",
                    "sizes": {r: ds.size(r) for r in ds.shards},
                    **self.backend.wds_direct_spec(),
                }
                env = dict(os.environ, **self.backend.env())
            else:
                spec = {"urls": os.path.join(self.root(system), brace), "mode": "fs"}
                env = dict(os.environ)
            spec["manifest"] = str(self.args.data_dir / f"{ds.bucket}.manifest.json")

            def fn(v, spec=spec, env=env):
                proc = subprocess.run(
                    [sys.executable, ENTRY, "--wds-child", json.dumps(spec)],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=RUN_TIMEOUT_S,
                )
                lines = proc.stdout.strip().splitlines()
                if proc.returncode != 0 or not lines:
                    v.fail(f"webdataset child failed ({proc.returncode}): {proc.stderr[-1500:]}")
                    return {}
                out = json.loads(lines[-1])
                for e in out["errors"]:
                    v.fail(e)
                # Loop-only machine CPU: every process's, the server's and proxy's included.
                return {
                    "samples/s": round(out["samples"] / out["seconds"], 1),
                    "samples": out["samples"],
                    "loop_busy_cpu_s": round(out["busy_cpu_s"], 2),
                    "loop_idle_cpu_s": round(out["idle_cpu_s"], 2),
                }

            run = self.measure("W1 webdataset", system, fn)
            self.record("W1.wds", system, run.get("samples/s"))

    # -- W2 ImageFolder -----------------------------------------------------------
    def w2(self) -> None:
        ds = self.ds
        self.row("W2.list", "W2 ImageFolder listing, cold", "s", False, "<= 0.5 s")
        for threads in (8, 32):
            self.row(f"W2.cold{threads}", f"W2 epoch cold, {threads} threads", "files/s", True, ">= 1.0x direct")
        for threads in (8, 32):
            self.row(f"W2.warm{threads}", f"W2 epoch warm, {threads} threads", "files/s", True, ">= 6000 files/s")
        # A data set larger than RAM: the next epoch finds no page cache (try --mount-args "--cache-dir DIR").
        self.row("W2.evicted32", "W2 epoch, page cache dropped, 32t", "files/s", True, "-")
        limit_mb = self.max_memory_bytes() / MB + 150
        # Fetch-ahead holds up to half the budget while a cold epoch runs (issue 36).
        self.row("W2.hwm", "W2 daemon peak RSS (VmHWM), 32t mount", "MB", False, f"<= {limit_mb:.0f} MB")
        if self.cache_dir:  # the disk cache outlives the mount: the next one starts from it
            # after a reboot (its files on disk only), and in a new job (its files still in the page cache)
            self.row("W2.remount32", "W2 epoch, new mount, disk cache kept, 32t", "files/s", True, "-")
            self.row("W2.rejob32", "W2 epoch, new mount, disk cache in page cache, 32t", "files/s", True, "-")
            # Shared by every mount of the bucket on the host: a second one, the first still up, reads
            # what the first stored (issue 38).
            self.row(
                "W2.shared32",
                "W2 epoch, a second mount beside the first, shared disk cache, 32t",
                "files/s",
                True,
                "0 GETs",
            )
            self.row("W2.shared32.gets", "W2 object GETs of that epoch (second mount)", "GETs", False, "0")
        for system in (*self.systems, *self.s3torch_systems()):
            for threads in (8, 32):
                self.cold(system)
                if system == S3TORCH:  # its map-style dataset: listed, then read by index
                    dataset = {}
                    run = self.measure("W2 listing", system, lambda v: self._w2_list_s3torch(v, dataset))
                elif system == "direct":
                    client = self.backend.direct(threads)
                    run = self.measure("W2 listing", system, lambda v: self._w2_list_direct(v, client))
                else:
                    run = self.measure("W2 listing", system, lambda v: self._w2_list_fs(v, self.root(system)))
                if threads == 8:  # the 32-thread pass lists again only to load the fresh mount
                    self.record("W2.list", system, run.get("s"))
                order = self.w2_order(threads)
                passes = ("cold", "warm") if system not in ("direct", S3TORCH) else ("cold",)
                if system not in ("direct", S3TORCH) and threads == 32:
                    passes += ("evicted",)
                    if system == "bucketfs" and self.cache_dir:
                        passes += ("shared", "remount", "rejob")
                for temp in passes:
                    if temp == "evicted":
                        drop_caches()  # the same mount: its block cache and --cache-dir stay
                    elif temp == "remount":
                        self.mount.remount()  # a new daemon; --cache-dir is kept, the page cache dropped
                    elif temp == "rejob":
                        self.mount.remount(drop=False)  # the last epoch left the cache's files in the page cache
                    elif temp == "shared":  # through a second mount, this one (its cold epoch's writer) staying up
                        self.w2_shared(order, threads)
                        continue
                    if system == S3TORCH:
                        run = self.measure(
                            f"W2 epoch {temp} {threads}t",
                            system,
                            lambda v: self._epoch(
                                v, order, threads, lambda rel: dataset["dataset"][dataset["index"][rel]].read()
                            ),
                        )
                    elif system == "direct":
                        run = self.measure(
                            f"W2 epoch {temp} {threads}t",
                            system,
                            lambda v: self._epoch(v, order, threads, lambda rel: client.get(ds.bucket, rel)),
                        )
                    else:
                        read = file_reader(self.root(system))
                        run = self.measure(
                            f"W2 epoch {temp} {threads}t", system, lambda v: self._epoch(v, order, threads, read)
                        )
                    self.record(f"W2.{temp}{threads}", system, run.get("files/s"))
                if system == "bucketfs" and threads == 32:
                    self.record("W2.hwm", system, round(proc_status_kib(self.mount.pid, "VmHWM") * 1024 / MB, 1))
                if system == "direct":
                    client.close()
                dataset = None
        self.w2_copy_then_read()  # copy-then-read (s5cmd), after the other systems (copythenread.py)

    def w2_shared(self, order: list, threads: int) -> None:
        """W2's epoch on a second mount of the bucket with the same --cache-dir, beside
        self.mount once its writes of the cold epoch landed: every file a hit in what the
        first stored, so 0 GETs (issue 38). The page cache is dropped first, as for the
        remount pass: the cache's files on disk only, the two rows compare."""
        if not self.mount.wait_disk_cache_writes():
            log("  W2 shared: the first mount's disk-cache writes had not all landed by the deadline")
        drop_caches()
        with beside(self, "bucketfs-shared"):
            read = file_reader(self.root("bucketfs"))  # the second mount's
            run = self.measure(
                f"W2 epoch shared {threads}t", "bucketfs", lambda v: self._epoch(v, order, threads, read)
            )
        self.record(f"W2.shared{threads}", "bucketfs", run.get("files/s"))
        self.record(f"W2.shared{threads}.gets", "bucketfs", run.get("requests", {}).get("GET", 0))

    def w2_order(self, threads: int) -> list:
        """The ImageFolder files in the order W2's epochs with `threads` threads read them
        (the same for every system and mount)."""
        order = list(self.ds.images)
        random.Random(threads).shuffle(order)
        return order

    def _w2_list_fs(self, v: Verifier, root: str) -> dict:
        t0 = time.perf_counter()
        top = os.path.join(root, "imagefolder")
        classes = sorted(e.name for e in os.scandir(top) if e.is_dir())
        found = []
        for cls in classes:
            for dirpath, _dirs, names in sorted(os.walk(os.path.join(top, cls), followlinks=True)):
                for name in sorted(names):
                    found.append(os.path.join(dirpath, name))
        seconds = time.perf_counter() - t0
        rels = sorted(os.path.relpath(p, root) for p in found)
        if rels != self.ds.images:
            v.fail(f"ImageFolder listing found {len(rels)} files, expected {len(self.ds.images)}")
        return {"s": round(seconds, 4), "files": len(found), "classes": len(classes)}

    def _w2_list_s3torch(self, v: Verifier, holder: dict) -> dict:
        """s3torchconnector: S3MapDataset.from_prefix, listed by its len() (timed); then
        each key's index (not timed) for reading in the epoch's order."""
        t0 = time.perf_counter()
        dataset = self.s3torch_dataset("imagefolder/")
        count = len(dataset)
        seconds = time.perf_counter() - t0
        index = {dataset[i].key: i for i in range(count)}  # an S3Reader sends nothing until read
        if sorted(index) != self.ds.images:
            v.fail(f"S3MapDataset listed {len(index)} objects, expected {len(self.ds.images)}")
        holder.update(dataset=dataset, index=index)
        return {"s": round(seconds, 4), "files": count}

    def _w2_list_direct(self, v: Verifier, client: S3Direct) -> dict:
        t0 = time.perf_counter()
        _objs, class_prefixes = client.list_all(self.ds.bucket, "imagefolder/")
        found = []
        for prefix in sorted(class_prefixes):
            objs, _ = client.list_all(self.ds.bucket, prefix)
            found += [k for k, _size in objs]
        seconds = time.perf_counter() - t0
        if sorted(found) != self.ds.images:
            v.fail(f"listing found {len(found)} objects, expected {len(self.ds.images)}")
        return {"s": round(seconds, 4), "files": len(found), "classes": len(class_prefixes)}

    def _epoch(self, v: Verifier, order: list, threads: int, read: Callable[[str], bytes]) -> dict:
        def one(_i, rel):
            data = read(rel)
            v.check(rel, len(data), digest(data))

        wall = run_threads(pull_loop(order, one), [()] * threads, v)
        return {"files/s": round(len(order) / wall, 1), "MB/s": round(self.ds.bytes_of(order) / wall / MB, 1)}

    # -- W3 metadata ----------------------------------------------------------------
    def w3(self) -> None:
        ds = self.ds
        self.row("W3.flat.cold", f"W3 listdir {len(ds.flat)}, cold", "s", False, "<= direct LISTs, 0 HEAD")
        self.row("W3.flat.cached", f"W3 listdir {len(ds.flat)}, cached", "s", False, "<= 0.1 s")
        # ls -l: a stat of each entry (from the listing's attributes) and the ACL and
        # label lookups ls makes on every file (no target: what a user at a shell sees).
        self.row("W3.flat.ls", f"W3 ls -l {len(ds.flat)}, cached", "s", False)
        self.row("W3.tree.cold", f"W3 walk+stat {len(ds.tree)}, cold", "s", False, "<= direct LISTs, 0 HEAD")
        self.row("W3.tree.cached", f"W3 walk+stat {len(ds.tree)}, cached", "s", False, "<= 0.1 s")
        self.w3_heads = {}
        for what in ("flat", "tree"):
            for system in self.systems:
                self.cold(system)
                temps = ("cold",) if system == "direct" else ("cold", "cached", *(("ls",) if what == "flat" else ()))
                for temp in temps:
                    if system == "direct":
                        client = self.backend.direct(4)
                        fn = lambda v: self._w3_direct(v, client, what)
                    else:
                        # A cached pass takes ~0.1 s, where one stall of this shared VM moves
                        # it by a third: the median of CACHED_PASSES (local disk the same).
                        passes = 1 if temp == "cold" else CACHED_PASSES
                        fn = lambda v: median_run(
                            passes, lambda: self._w3_fs(v, self.root(system), what, long_listing=temp == "ls")
                        )
                    run = self.measure(f"W3 {what} {temp}", system, fn)
                    if system == "direct":
                        client.close()
                    self.record(f"W3.{what}.{temp}", system, run.get("s"))
                    if system == "bucketfs" and temp == "cold":
                        self.w3_heads[what] = run.get("requests", {}).get("HEAD", 0)

    def _w3_fs(self, v: Verifier, root: str, what: str, long_listing: bool = False) -> dict:
        expected = self.ds.flat if what == "flat" else self.ds.tree
        t0 = time.perf_counter()
        if long_listing:
            out = subprocess.run(
                ["ls", "-l", os.path.join(root, "flat")],
                stdout=subprocess.PIPE,
                check=True,
                env=dict(os.environ, LC_ALL="C"),
            ).stdout.decode()
            seconds = time.perf_counter() - t0
            names = [line.split()[-1] for line in out.splitlines()[1:]]  # (after the "total" line)
            if sorted("flat/" + n for n in names) != expected:
                v.fail(f"ls -l listed {len(names)} names, expected {len(expected)}")
            return {"s": round(seconds, 4), "entries": len(names)}
        if what == "flat":
            names = os.listdir(os.path.join(root, "flat"))
            seconds = time.perf_counter() - t0
            if sorted("flat/" + n for n in names) != expected:
                v.fail(f"listdir found {len(names)} names, expected {len(expected)}")
            return {"s": round(seconds, 4), "entries": len(names)}
        found = []  # (path, size); the verification's bookkeeping (relpath) is not timed
        for dirpath, _dirs, names in os.walk(os.path.join(root, "tree")):
            for name in names:
                path = os.path.join(dirpath, name)
                found.append((path, os.stat(path).st_size))
        seconds = time.perf_counter() - t0
        sizes = {os.path.relpath(path, root): size for path, size in found}
        if sizes != {rel: self.ds.size(rel) for rel in expected}:
            v.fail(f"walk+stat found {len(sizes)} files (or wrong sizes), expected {len(expected)}")
        return {"s": round(seconds, 4), "entries": len(sizes)}

    def _w3_direct(self, v: Verifier, client: S3Direct, what: str) -> dict:
        """The LISTs a mount needs, one after another: the bucket root (path lookup), then
        the directory's pages (flat) or the tree's folders one by one (tree)."""
        expected = self.ds.flat if what == "flat" else self.ds.tree
        t0 = time.perf_counter()
        client.list_all(self.ds.bucket, "")
        objs, prefixes = client.list_all(self.ds.bucket, f"{what}/")
        for prefix in prefixes:
            objs += client.list_all(self.ds.bucket, prefix)[0]
        seconds = time.perf_counter() - t0
        if dict(objs) != {rel: self.ds.size(rel) for rel in expected}:
            v.fail(f"listing found {len(objs)} objects (or wrong sizes), expected {len(expected)}")
        return {"s": round(seconds, 4), "entries": len(objs)}

    # -- W4 random preads -------------------------------------------------------------
    def w4(self) -> None:
        ds = self.ds
        self.row("W4.ops", "W4 random 4-64K preads, 4 thr", "ops/s", True, ">= 2000 ops/s")
        self.row("W4.amp", "W4 bytes fetched / bytes read", "x", False, "<= 4x")
        # The same preads again on the same mount: what a reader that revisits its
        # samples (a second epoch) gets from the page cache and the block cache.
        self.row("W4.again", "W4 the same preads again", "ops/s", True, ">= 2000 ops/s")
        count = max(200, round(2000 * ds.spec.scale))
        rnd = random.Random(4)
        ops = []
        for _ in range(count):
            s = rnd.randrange(len(ds.shards))
            length = rnd.randint(4 * 1024, 64 * 1024)
            ops.append((s, rnd.randrange(0, ds.size(ds.shards[s]) - length), length))
        read_bytes = sum(op[2] for op in ops)
        # Expected digests from the local files (read outside any timing).
        expected = []
        local_fds = [os.open(os.path.join(self.local_root, rel), os.O_RDONLY) for rel in ds.shards]
        try:
            for s, off, length in ops:
                expected.append(digest(os.pread(local_fds[s], length, off)))
        finally:
            for fd in local_fds:
                os.close(fd)
        for system in self.systems:
            self.cold(system)
            got = [None] * len(ops)
            if system == "direct":
                client = self.backend.direct(4)

                def read_op(i, op, client=client):
                    s, off, length = op
                    got[i] = digest(client.get(ds.bucket, ds.shards[s], off, off + length))

                fds = []
            else:
                fds = [os.open(os.path.join(self.root(system), rel), os.O_RDONLY) for rel in ds.shards]

                def read_op(i, op, fds=fds):
                    s, off, length = op
                    got[i] = digest(os.pread(fds[s], length, off))

            def fn(v):
                wall = run_threads(pull_loop(ops, read_op), [()] * 4, v)
                bad = [i for i in range(len(ops)) if got[i] != expected[i]]
                if bad:
                    s, off, length = ops[bad[0]]
                    v.fail(f"{len(bad)} preads returned wrong bytes, first {ds.shards[s]} [{off}, {off + length})")
                return {"ops/s": round(len(ops) / wall, 1), "ops": len(ops), "read_MB": round(read_bytes / MB, 2)}

            run = self.measure("W4 random preads", system, fn)
            if system != "direct":
                again = self.measure("W4 random preads again", system, fn)
                self.record("W4.again", system, again.get("ops/s"))
            for fd in fds:
                os.close(fd)
            if system == "direct":
                client.close()
            self.record("W4.ops", system, run.get("ops/s"))
            if system != "local":
                amp = run["fetched_bytes"] / read_bytes
                run["fetched_over_read"] = round(amp, 3)
                self.record("W4.amp", system, round(amp, 3))
                log(
                    f"  W4 {system}: fetched {run['fetched_bytes'] / MB:.1f} MB through the proxy for {read_bytes / MB:.1f} MB read = {amp:.2f}x"
                )

    # -- W5 mixed -------------------------------------------------------------------
    def w5(self) -> None:
        ds = self.ds
        self.row(
            "W5.mbps", f"W5 {W5_SMALL_READERS} small + {W5_SHARD_READERS} shard readers", "MB/s", True, ">= direct"
        )
        limit_mb = self.max_memory_bytes() / MB + 150
        self.row("W5.rss", "W5 daemon peak RSS (sampled)", "MB", False, f"<= {limit_mb:.0f} MB")
        self.row("W5.hwm", "W5 daemon VmHWM", "MB", False, f"<= {limit_mb:.0f} MB")
        self.row("W5.mem", "W5 daemon + workers peak memory (PSS, arena)", "MB", False, f"<= {limit_mb:.0f} MB")
        # How long a small-file reader (a DataLoader worker) waits while shards stream.
        self.row("W5.p50", "W5 small file p50 latency", "ms", False, "-")
        self.row("W5.p99", "W5 small file p99 latency", "ms", False, "-")
        for system in (*self.systems, *self.s3torch_systems()):
            self.cold(system)
            if system == S3TORCH:  # one client for both parts
                client = self.s3torch_client()

                def small(_i, rel, client=client):
                    data = self.s3torch_get(client, rel)
                    return rel, len(data), digest(data)

                def stream(group, _ex, client=client):
                    buf = self.s3torch_read_buffer()
                    return [(rel, *self.s3torch_stream(client, rel, buf)) for rel in group]

                executors = [None] * W5_SHARD_READERS
            elif system == "direct":
                client = self.backend.direct(W5_SMALL_READERS + W5_SHARD_READERS * PARALLEL_PARTS)
                executors = [ThreadPoolExecutor(PARALLEL_PARTS) for _ in range(W5_SHARD_READERS)]

                def small(_i, rel, client=client):
                    data = client.get(ds.bucket, rel)
                    return rel, len(data), digest(data)

                def stream(group, ex, client=client):
                    return [(rel, *read_object_direct(client, ds.bucket, rel, ds.size(rel), ex)) for rel in group]
            else:
                small, stream = fs_mixed_readers(self.root(system))
                executors = [None] * W5_SHARD_READERS

            fn = self.w5_run(system, small, stream, executors)
            run = self.measure("W5 mixed", system, fn)
            if system == "direct":
                for ex in executors:
                    ex.shutdown()
                client.close()
            client = None
            self.record("W5.mbps", system, run.get("MB/s"))
            self.record("W5.p50", system, run.get("p50_ms"))
            self.record("W5.p99", system, run.get("p99_ms"))
            if system == "bucketfs":
                self.record("W5.rss", system, run.get("peak_rss_MB"))
                self.record("W5.hwm", system, run.get("vm_hwm_MB"))
                self.record("W5.mem", system, run.get("tree_peak_MB"))

    def w5_run(self, system: str, small: Callable, stream: Callable, executors: list) -> Callable[[Verifier], dict]:
        """W5's run: W5_SMALL_READERS threads read the ImageFolder files (small(i, rel) ->
        (rel, size, digest)) while W5_SHARD_READERS stream the shards (stream(group,
        executor) -> [(rel, size, digest)]); a bucketfs run samples the daemon's RSS."""
        ds = self.ds
        total = ds.bytes_of(ds.images) + ds.bytes_of(ds.shards)
        order = list(ds.images)
        random.Random(5).shuffle(order)
        groups = [ds.shards[r::W5_SHARD_READERS] for r in range(W5_SHARD_READERS)]

        def fn(v):
            sampler = RssSampler(self.mount.pid) if system == "bucketfs" else contextlib.nullcontext()
            latencies_s = []

            def timed_small(i, rel):
                started_s = time.monotonic()
                result = small(i, rel)
                latencies_s.append(time.monotonic() - started_s)
                v.check(*result)

            with sampler:
                body_small = pull_loop(order, timed_small)

                def body_stream(group, ex):
                    for rel, n, h in stream(group, ex):
                        v.check(rel, n, h)

                args = [(body_small, None)] * W5_SMALL_READERS
                args += [(body_stream, (g, ex)) for g, ex in zip(groups, executors)]
                wall = run_threads(lambda f, a: f(*a) if a else f(), args, v)
            out = {"MB/s": round(total / wall / MB, 1)}
            if len(latencies_s) >= 2:
                percentiles_s = statistics.quantiles(latencies_s, n=100)
                out["p50_ms"] = round(percentiles_s[49] * 1000, 1)
                out["p99_ms"] = round(percentiles_s[98] * 1000, 1)
            if system == "bucketfs":
                out["peak_rss_MB"] = round(sampler.peak_bytes / MB, 1)
                out["tree_peak_MB"] = round(sampler.tree_peak_bytes / MB, 1)
                out["vm_hwm_MB"] = round(proc_status_kib(self.mount.pid, "VmHWM") * 1024 / MB, 1)
            return out

        return fn


def fs_mixed_readers(root: str) -> tuple:
    """W5's (small, stream) on a file system at `root` (see Workloads.w5_run)."""

    def small(_i, rel):
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        return rel, len(data), digest(data)

    def stream(group, _ex):
        buf = bytearray(READ_BYTES)
        return [(rel, *read_file_streaming(os.path.join(root, rel), buf)) for rel in group]

    return small, stream
