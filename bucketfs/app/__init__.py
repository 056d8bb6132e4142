"""The application around the core: the `bucketfs` command (cli.py), the
`mount.fuse.bucketfs` fstab helper (fstab.py), daemonising and logging (daemon.py),
the mount lifecycle (mount.py: builds the backend and the `Filesystem`, mounts,
answers signals, unmounts) and the checks of the mountpoint and the host's FUSE
before mounting (mountpoints.py).

The top layer of the runtime: it may import every other part of bucketfs except
`bucketfs.testing`. Only mount.py imports pyfuse3, and the command imports mount.py
only to mount: `--help`, `stats`, `unmount` and the fstab helper's parsing run
without it.
"""
