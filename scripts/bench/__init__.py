"""The benchmark behind `python scripts/bench.py` (scripts/bench.py documents the
command, its setup and its workloads), as a package by concern:

- common: paths, units and limits, the digest, the log line
- datasets: the generated data set, its manifest, the verifier of every byte read
- stores: the emulated remote stores (S3 via rclone, GCS via its emulator) behind the
  latency proxy, and the direct SDK clients that are the baseline
- procs: processes and the machine: CPU, memory, the page cache, the mount table
- systems: the mounts under test: bucketfs and, with --alternatives, rclone mount and s3fs
- readers: reading primitives shared by the workloads (threads, streams, ranged GETs)
- runner: `Bench`: one measured run (costs, verification, watchdog), cold starts
- workloads: W1-W5
- copythenread: W2's copy-then-read alternative (s5cmd copies the prefix, then the epoch
  on the copy) and its comparison with bucketfs's cold epoch
- warmcopy: W2's timed `bucketfs warm` of the same prefix after each s5cmd copy, its
  check through a mount on the warmed cache, and warm / s5cmd
- epochs: W6, random-order epochs over a data set twice the cache (disk cache, memory
  budget), files cached per epoch with the cache's policy and with LRU
- s3torchconnector: s3torch: its client beside direct boto3 in W1, W2 and W5 (issue 37)
- threadcpu: bucketfs's CPU by role in each run: the daemon's threads (main, curl,
  workers, other) and its fetch worker processes (fetch workers, with --fetch-workers),
  per small file and per GB, and the throughput ceilings it implies (issue 37)
- fetchworkers: W2's cold epochs, W1 and W5 again on a mount with --fetch-workers N
  (--fetch-workers-variant) and their comparison with the default mount's runs
- issue37: issue 37's targets, evaluated on a run
- report: targets, the result and cost tables, what the emulation allows, the summary
- wds: the webdataset child process (its own process, so torch stays out of the bench)
- cli: options and main()

Other scripts import helpers from here (e.g. `from bench.procs import proc_status_kib`).
"""
