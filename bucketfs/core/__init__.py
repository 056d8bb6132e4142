"""The filesystem core: namespace, memory budget, block cache, prefetch, open handles.

`Filesystem` (filesystem.py) orchestrates handles and reads; `build_components`
(components.py) builds every component it uses, in one place, including the disk
cache (bucketfs.diskcache) in front of the backend when --cache-dir asks for it.
The shard-warming policy is shards.py.

Invariant: nothing here imports pyfuse3 or a cloud SDK. All state is owned by the
one trio thread that pyfuse3 runs request handlers on.
"""
