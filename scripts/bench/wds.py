"""The webdataset child (`bench.py --wds-child SPEC`): its own process, so torch stays
out of the benchmark process and the DataLoader forks a process that has no other
threads. Reads the shards through a mount or directly (benchs3:// and benchgs:// URLs:
parallel ranged GETs) and checks every sample against the manifest."""

from __future__ import annotations

import importlib
import io
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import PARALLEL_PARTS, READ_BYTES, WDS_WORKERS, digest
from .procs import machine_cpu_s
from .readers import IterReader, iter_object_parallel
from .stores import GCSDirect, S3Direct

_direct_state: dict = {}


def _wds_open_direct(url, mode="rb", bufsize=8192, **_kw):
    """gopen handler for benchs3:// (benchgs://) bucket/key: 16 parallel 8 MiB ranged GETs, in order."""
    from urllib.parse import urlsplit

    pid = os.getpid()
    if _direct_state.get("pid") != pid:  # a DataLoader worker: its own client and threads
        gcs = _direct_state.get("gcs")
        client = (
            GCSDirect(gcs["endpoint_url"], PARALLEL_PARTS, gcs["max_connections"])
            if gcs
            else S3Direct.from_env(PARALLEL_PARTS)
        )
        _direct_state.update(pid=pid, client=client, executor=ThreadPoolExecutor(PARALLEL_PARTS))
    parts = urlsplit(url)
    key = parts.path.lstrip("/")
    size = _direct_state["sizes"][key]
    chunks = iter_object_parallel(_direct_state["client"], parts.netloc, key, size, _direct_state["executor"])
    return io.BufferedReader(IterReader(chunks), buffer_size=READ_BYTES)


def _wds_sample_digest(sample: dict) -> tuple:
    return sample["__key__"], os.path.basename(sample["__url__"]), digest(sample["jpg"]), sample["cls"].decode()


def wds_child(spec: dict) -> int:
    import warnings

    import torch.utils.data
    import webdataset as wds

    warnings.filterwarnings("ignore")
    manifest = json.loads(Path(spec["manifest"]).read_text())
    if spec["mode"] == "direct":
        _direct_state["sizes"] = spec["sizes"]
        _direct_state["gcs"] = spec.get("gcs")
        # `webdataset.gopen` is also the name of a function in the package namespace.
        schemes = importlib.import_module("webdataset.gopen").gopen_schemes
        schemes["benchs3"] = schemes["benchgs"] = _wds_open_direct
    dataset = wds.WebDataset(spec["urls"], shardshuffle=False, empty_check=False).map(_wds_sample_digest)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=WDS_WORKERS)
    # The machine's CPU over the loop alone: this child's imports run on one core and
    # would read as idle time if counted.
    cpu0 = machine_cpu_s()
    t0 = time.perf_counter()
    seen = list(loader)
    seconds = time.perf_counter() - t0
    busy_s, idle_s = (b - a for a, b in zip(cpu0, machine_cpu_s()))
    expected = {
        (f"shards/{shard.split('/')[-1]}", key): tuple(v)
        for shard, entries in manifest["samples"].items()
        for key, v in entries.items()
    }
    got = {(f"shards/{name}", key): (h, cls) for key, name, h, cls in seen}
    errors = []
    if len(got) != len(seen):
        errors.append(f"{len(seen) - len(got)} samples delivered twice")
    missing = expected.keys() - got.keys()
    if missing:
        errors.append(f"{len(missing)} samples missing, e.g. {sorted(missing)[0]}")
    wrong = [k for k in expected.keys() & got.keys() if expected[k] != got[k]]
    if wrong:
        errors.append(f"{len(wrong)} samples with wrong bytes, e.g. {sorted(wrong)[0]}")
    print(
        json.dumps(
            {"samples": len(seen), "seconds": seconds, "busy_cpu_s": busy_s, "idle_cpu_s": idle_s, "errors": errors}
        ),
        flush=True,
    )
    return 0
