"""Shared by every module of the benchmark: the repository's paths (and sys.path for
bucketfs and scripts/), units, sizes and limits of the runs, the digest that verifies
every byte read, and the log line."""

from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _path in (str(REPO), str(REPO / "scripts")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
ENTRY = str(
    REPO / "scripts" / "bench.py"
)  # the command, run again for the child processes (--wds-child, --gcs-proxy-child)

MB = 1_000_000  # throughput unit (like the targets and --conn-mbps)
MiB = 1024 * 1024
PART_BYTES = 8 * MiB  # direct boto3: one ranged GET of a large object
PARALLEL_PARTS = 16  # direct boto3: ranged GETs in flight per large-object reader
READ_BYTES = 1 * MiB  # shard readers' read size
CACHED_PASSES = 5  # W3 cached rows: the median of this many passes (each ~0.1 s; see w3)
RUN_TIMEOUT_S = 300.0  # a run taking longer is a hang: the mount is aborted and the run FAILs
MOUNT_DEADLINE_S = 30.0
SYSTEMS = ("bucketfs", "direct", "local")
WDS_WORKERS = 2  # DataLoader worker processes of the webdataset runs
# GCS emulator: requests in flight, for the mount (--max-connections) and the direct client
# alike. The emulator (http.server) serves one request at a time with a listen backlog of 5:
# with more connections than that waiting, the kernel drops SYNs and each dropped connect
# costs a 1 s (then 3 s, 7 s) retransmit, which would measure the backlog, not the client.
# 4 stays under it and still hides the proxy's first-byte latency behind other requests.
GCS_MAX_CONNECTIONS = 4
GCS_SEED_THREADS = 4  # uploads in flight while seeding the emulator (same backlog limit)

try:
    import xxhash

    HASH_NAME = "xxh3_64"

    def new_hash():
        return xxhash.xxh3_64()

    def digest(data) -> int:
        return xxhash.xxh3_64_intdigest(data)
except ImportError:  # crc32 is 5x slower but always there
    HASH_NAME = "crc32"

    class _Crc:
        __slots__ = ("value",)

        def __init__(self):
            self.value = 0

        def update(self, data):
            self.value = zlib.crc32(data, self.value)

        def intdigest(self):
            return self.value

    def new_hash():
        return _Crc()

    def digest(data) -> int:
        return zlib.crc32(data)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fmt_num(x, digits: int = 1) -> str:
    """A table cell: `x` with thousands separators and `digits` decimals, "-" for None."""
    return "-" if x is None else f"{x:,.{digits}f}"


def text_table(header, lines) -> str:
    """`header` and `lines` (tuples of cells) as a plain-text table, columns padded."""
    widths = [max(len(str(x[i])) for x in [header, *lines]) for i in range(len(header))]
    out = [" | ".join(str(h).ljust(w) for h, w in zip(header, widths)), "-+-".join("-" * w for w in widths)]
    out += [" | ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out)
