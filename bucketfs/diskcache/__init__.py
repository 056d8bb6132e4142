"""The persistent disk cache (`--cache-dir`): object bytes kept on a local disk,
across mounts, so that an epoch the page cache cannot hold reads the disk, not the
bucket.

- cache.py: `DiskCache`, a backend wrapper in front of the store (the core builds
  it); its docstring states the invariants (chunks keyed by version, every chunk's
  CRC checked on every read: never a wrong byte; bounded by --cache-size).
- journal.py: what is on disk and its checksums, one append-only file.
- files.py: the data files: chunk writes, checked reads, deletes, read-ahead.
- directory.py: which directory under --cache-dir a mount uses, and its lock.
- pagecache.py: reads that never wait for a disk, and read-ahead into the kernel's
  page cache.

Below the core and above the backends: nothing here imports the core, pyfuse3 or a
cloud SDK.
"""
