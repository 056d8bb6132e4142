"""The filesystem core: namespace, memory budget, block cache, prefetch, open handles.

Invariant: nothing here imports pyfuse3 or a cloud SDK. All state is owned by the
one trio thread that pyfuse3 runs request handlers on.
"""
