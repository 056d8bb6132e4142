"""The FUSE adapter: with bucketfs/app/mount.py (which starts and ends the session),
the only code that imports pyfuse3.

- ops.py: `FuseOperations`, the one pyfuse3 `Operations` subclass: FUSE requests
  become calls of the core's `Filesystem`, every exception one errno (one table), and
  the stats file (`bucketfs stats`'s channel) is answered here.
- dircache.py, noopendir.py: the kernel's directory caching, set through pyfuse3's
  and libfuse's private layouts, each checked before any write and switched off
  when it does not match (docs/kernel.md).

It imports the core, never the other way round: the core runs, and is tested,
without pyfuse3.
"""
