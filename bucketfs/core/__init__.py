"""The filesystem core: namespace, memory budget, block cache, prefetch, open handles.

`Filesystem` (filesystem.py) builds the disk cache (bucketfs.diskcache) in front of
the backend when --cache-dir asks for it.

Invariant: nothing here imports pyfuse3 or a cloud SDK. All state is owned by the
one trio thread that pyfuse3 runs request handlers on.
"""
