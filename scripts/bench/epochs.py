"""W6 (issue 36): random-order epochs over a data set twice the cache. The data set is a
fixed sample of W2's ImageFolder files (FILES of them, ~100 KB each); each epoch reads
all of it in a new random order (a different seed per epoch, the same orders for every
variant), READERS threads, every byte verified, the page cache dropped before each
epoch so that every file goes to the daemon. One mount serves the EPOCHS epochs of a
variant. Per epoch, the files that cost no GET (the proxy's GET count: a file of this
size is one GET when it is not cached) are the "files cached" figure; issue 36 wants
>= 45% in epochs 2 and 3 (a cache of half the data set can serve at most ~1/2).

Variants, each on a fresh mount with the store primed as for cold runs:
- disk cache: `--cache-dir` (emptied) with `--cache-size` half the data set (as du
  counts it) and a small `--max-memory` (DISK_MAX_MEMORY), so that the memory block
  cache in front of it holds only a few percent of the files; the daemon's
  `disk_cache.hits` counts those read from disk. Once with the disk cache's
  scan-resistant policy (diskcache/policy.py), once with plain LRU: the same daemon
  started with `bucketfs.diskcache.cache.LRU_POLICY = True` (systems.ModuleSetMount;
  no product option).
- memory budget: no `--cache-dir`, `--max-memory` such that the block cache's room is
  about half the data set (half of it plus the listings the disk variant measured,
  plus MEMORY_SLACK_BYTES for reads in flight; the room the block cache reached after
  epoch 1 is reported). With `bucketfs.core.blockcache.LRU_POLICY` present, once with
  the default policy and once with LRU, as for the disk; without it, once, labelled
  "current policy".
With `--fetch-ahead` in `bucketfs mount --help`, every W6 mount gets `--fetch-ahead off`:
fetching ahead of the readers would fill the cache with everything and hide the policy.
`--mount-args` are not passed to W6's mounts (they set their own cache options)."""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import shutil
import subprocess
import sys

from .common import MB, REPO, MiB, log, text_table
from .procs import drop_caches
from .systems import ModuleSetMount, serving

FILES = 3000  # the data set: a sample of W2's ImageFolder files (~300 MB)
EPOCHS = 4
READERS = 32
TARGET_PCT = 45.0  # issue 36: epochs 2 and 3 find at least this share of files cached
TARGET_EPOCHS = (2, 3)
# The disk variants' --max-memory, the least a mount takes: the block cache in front of the
# disk cache holds ~3% of the data set (at 48M, ~12%: with a scan-resistant block cache
# that added ~11 points of memory hits to the disk cache's 46%).
DISK_MAX_MEMORY = "16M"
MEMORY_SLACK_BYTES = 4 * MiB  # the memory variant: room for the reads in flight (32 x ~100 KB)
LISTINGS_GUESS_BYTES = 560 * 10_300  # if no disk variant measured them: W2's tree, 560 B an entry
SEED = 600  # epoch e reads in random.Random(SEED + e)'s order
DISK_LRU = ("bucketfs.diskcache.cache", "LRU_POLICY")
MEMORY_LRU = ("bucketfs.core.blockcache", "LRU_POLICY")


@dataclasses.dataclass
class Variant:
    kind: str  # "disk" | "memory"
    policy: str  # "policy" (the module's default) | "lru" | "current" (memory, no LRU_POLICY constant)
    max_memory: str
    args: list
    constants: tuple = ()  # ((module, attribute, value), ...) set before main()

    @property
    def key(self) -> str:
        return f"W6.{self.kind}.{self.policy}"

    @property
    def title(self) -> str:
        where = "disk cache" if self.kind == "disk" else "memory budget"
        how = {"policy": "scan-resistant", "lru": "LRU", "current": "current policy"}[self.policy]
        return f"{where}, {how}"


@functools.lru_cache(maxsize=1)
def mount_help() -> str:
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
    )
    out = subprocess.run(
        [sys.executable, "-m", "bucketfs", "mount", "--help"], capture_output=True, text=True, env=env, timeout=60
    )
    return out.stdout


def has_module_constant(module: str, attribute: str) -> bool:
    """Whether the bucketfs the daemon will run defines `module.attribute` (asked in a
    child: this process may have imported an older version of the module)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    code = f"import importlib, sys; sys.exit(0 if hasattr(importlib.import_module({module!r}), {attribute!r}) else 1)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60).returncode == 0


class CacheEpochs:
    """W6, mixed into `Bench` (runner.py); its results in self.cache_epoch_results."""

    def w6(self) -> None:
        ds = self.ds
        count = min(FILES, len(ds.images))
        files = sorted(random.Random(6).sample(ds.images, count))
        data_bytes = ds.bytes_of(files)
        fetch_ahead = ["--fetch-ahead", "off"] if "--fetch-ahead" in mount_help() else []
        memory_lru = has_module_constant(*MEMORY_LRU)
        log(
            f"  W6: {count} ImageFolder files ({data_bytes / MB:.0f} MB), {EPOCHS} epochs, {READERS} readers; "
            f"{'--fetch-ahead off' if fetch_ahead else 'no --fetch-ahead option in this bucketfs'}; "
            f"memory block cache LRU_POLICY {'present: both policies' if memory_lru else 'absent: the current policy once'}"
        )
        cache_dir = os.path.join(self.work_dir, "w6-cache")
        disk_args = [*fetch_ahead, "--cache-dir", cache_dir, "--cache-size", str(data_bytes // 2)]
        variants = [
            Variant("disk", "policy", DISK_MAX_MEMORY, disk_args),
            Variant("disk", "lru", DISK_MAX_MEMORY, disk_args, ((*DISK_LRU, True),)),
        ]
        self.cache_epoch_note = None if fetch_ahead else "bucketfs mount has no --fetch-ahead option: not passed"
        self.row_w6(variants[0])
        self.row_w6(variants[1])
        memory_policies = (("policy", ()), ("lru", ((*MEMORY_LRU, True),))) if memory_lru else (("current", ()),)
        for policy, _ in memory_policies:
            self.row_w6(Variant("memory", policy, "", []))
        listings_bytes = None
        for variant in variants:
            shutil.rmtree(cache_dir, ignore_errors=True)
            os.makedirs(cache_dir)
            result = self._w6_variant(variant, files, data_bytes)
            listings_bytes = listings_bytes or result.get("listings_bytes")
        shutil.rmtree(cache_dir, ignore_errors=True)
        # The memory variant: the block cache's room (the budget less the listings) half the data set.
        listings_bytes = listings_bytes or LISTINGS_GUESS_BYTES
        max_memory = str(data_bytes // 2 + listings_bytes + MEMORY_SLACK_BYTES)
        for policy, constants in memory_policies:
            self._w6_variant(Variant("memory", policy, max_memory, list(fetch_ahead), constants), files, data_bytes)

    def row_w6(self, variant: Variant) -> None:
        target = f">= {TARGET_PCT:g}%" if variant.policy != "lru" else "- (comparison)"
        self.row(variant.key, f"W6 2x {variant.title}, epochs 2-3 cached (lower)", "% files", True, target)

    def _w6_variant(self, variant: Variant, files: list, data_bytes: int) -> dict:
        from bucketfs.testing.mounting import daemon_stats

        result = {
            "kind": variant.kind,
            "policy": variant.policy,
            "title": variant.title,
            "files": len(files),
            "data_bytes": data_bytes,
            "max_memory": variant.max_memory,
            "mount_args": variant.args,
            "constants": [list(c) for c in variant.constants],
            "epochs": [],
        }
        self.cache_epoch_results.append(result)
        self.cold("W6")  # every mount stopped, the store primed, the page cache dropped
        mount = ModuleSetMount(
            self.backend,
            self.ds.bucket,
            self.mountpoint,
            variant.max_memory,
            self.work_dir,
            [*self.backend.mount_extra_args, *variant.args],
            name=f"bucketfs-w6-{variant.kind}-{variant.policy}",
            constants=variant.constants,
        )
        log(f"  W6 {variant.title}: --max-memory {variant.max_memory} {' '.join(variant.args)}")
        try:
            with serving(self, mount):
                # The listing first, untimed: the epochs measure reads.
                for top in sorted({os.path.dirname(rel) for rel in files}):
                    os.listdir(os.path.join(self.mountpoint, top))
                before = daemon_stats(self.mountpoint)
                result["listings_bytes"] = before.get("memory.listings_bytes")
                for epoch in range(1, EPOCHS + 1):
                    order = list(files)
                    random.Random(SEED + epoch).shuffle(order)
                    self.dropped_ok = drop_caches() and self.dropped_ok

                    def read(rel):
                        with open(os.path.join(self.mountpoint, rel), "rb") as f:
                            return f.read()

                    run = self.measure(
                        f"W6 {variant.title} epoch {epoch}",
                        "bucketfs",
                        lambda v: self._epoch(v, order, READERS, read),
                    )
                    after = run.get("daemon_stats") or {}
                    result["epochs"].append(self._w6_epoch(epoch, len(files), run, before, after))
                    if epoch == 1:
                        result["block_cache_bytes"] = after.get("cache.bytes")
                        result["disk_capacity_bytes"] = after.get("disk_cache.capacity_bytes")
                    before = after
                    if run.get("error_count"):
                        break
        except Exception as exc:  # noqa: BLE001 - the variant is reported as failed, the bench goes on
            self.failures.append(f"W6 {variant.title}: {type(exc).__name__}: {exc}")
            log(f"  W6 {variant.title}: FAILED: {type(exc).__name__}: {exc}")
            result["error"] = f"{type(exc).__name__}: {exc}"
        epochs = {e["epoch"]: e for e in result["epochs"]}
        figures = [epochs[e]["cached_pct"] for e in TARGET_EPOCHS if e in epochs and not epochs[e]["failed"]]
        if len(figures) == len(TARGET_EPOCHS):
            self.record(variant.key, "bucketfs", min(figures))
        room = result.get("disk_capacity_bytes") if variant.kind == "disk" else result.get("block_cache_bytes")
        result["room_over_data"] = round(room / data_bytes, 3) if room else None
        log(
            f"  W6 {variant.title}: files cached by epoch "
            + ", ".join(f"{e['epoch']}: {e['cached_pct']:.1f}%" for e in result["epochs"])
            + (f"; room {result['room_over_data']:.2f}x the data" if result["room_over_data"] else "")
        )
        return result

    @staticmethod
    def _w6_epoch(epoch: int, files: int, run: dict, before: dict, after: dict) -> dict:
        def delta(name):
            return after.get(name, 0) - before.get(name, 0) if after else None

        gets = run.get("requests", {}).get("GET", 0)
        cached = max(files - gets, 0)
        disk_hits = delta("disk_cache.hits")
        return {
            "epoch": epoch,
            "files/s": run.get("files/s"),
            "wall_s": run.get("wall_s"),
            "gets": gets,
            "daemon_gets": delta("backend.requests.get"),
            "cached_files": cached,
            "cached_pct": round(100 * cached / files, 2),
            "from_disk_files": disk_hits,
            "from_disk_pct": None if disk_hits is None else round(100 * disk_hits / files, 2),
            "block_cache_hits": delta("cache.hits"),
            "disk_evictions": delta("disk_cache.evictions"),
            "disk_skipped_stores": delta("disk_cache.skipped_stores"),
            "memory_demand_waits": delta("memory.demand_waits"),
            "daemon_cpu_s": run.get("daemon_cpu_s"),
            "failed": bool(run.get("error_count")),
        }

    # -- report -----------------------------------------------------------------------
    def cache_epochs_checks(self) -> dict:
        """report.evaluate's checks of the W6 rows: the policies (not LRU) against the target."""
        checks = {}
        for result in self.cache_epoch_results:
            if result["policy"] == "lru":
                continue
            key = f"W6.{result['kind']}.{result['policy']}"
            value = self.rows[key].values.get("bucketfs") if key in self.rows else None
            checks[key] = lambda value=value: None if value is None else value >= TARGET_PCT
        return checks

    def cache_epochs_table(self) -> str:
        def cells(values, digits=1):
            return " / ".join("-" if x is None else f"{x:,.{digits}f}" for x in values)

        header = (
            "W6 variant (2x the cache)",
            "room / data",
            "--max-memory",
            "files cached %, epochs 2 / 3 / 4",
            "of them from disk %",
            "GETs, epochs 1-4",
            "files/s, epochs 1-4",
            "bucketfs CPU s, epochs 1-4",
            "target",
            "met",
        )
        lines = []
        for r in self.cache_epoch_results:
            epochs = r["epochs"]
            later = [e for e in epochs if e["epoch"] > 1]
            row = self.rows.get(f"W6.{r['kind']}.{r['policy']}")
            lines.append(
                (
                    r["title"],
                    "-" if r.get("room_over_data") is None else f"{r['room_over_data']:.2f}",
                    f"{int(r['max_memory']) / MiB:.0f}M" if r["max_memory"].isdigit() else r["max_memory"],
                    cells([e["cached_pct"] for e in later]) if later else r.get("error", "-"),
                    cells([e["from_disk_pct"] for e in later]) if r["kind"] == "disk" and later else "-",
                    cells([e["gets"] for e in epochs], 0),
                    cells([e["files/s"] for e in epochs], 0),
                    cells([e["daemon_cpu_s"] for e in epochs], 2),
                    row.target if row else "-",
                    {True: "yes", False: "NO", None: "-"}[row.met if row else None],
                )
            )
        if not lines:
            return ""
        table = text_table(header, lines)
        return f"{table}\n({self.cache_epoch_note})" if self.cache_epoch_note else table
