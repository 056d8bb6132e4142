"""Counters shared by the core and exported by the metrics endpoint and `bucketfs stats`.

A plain Counter keyed by dotted names (`cache.hits`, `prefetch.bytes_used`); the
core only increments, readers take snapshots. Kept free of prometheus so the core
stays importable without it.
"""

import collections


class Stats(collections.Counter):
    def snapshot(self) -> dict:
        return dict(sorted(self.items()))
