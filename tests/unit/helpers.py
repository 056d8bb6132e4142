"""Drive the core on the in-memory backend: no FUSE, no network."""

import dataclasses

import trio

from bucketfs.backends.memory import MemoryBackend
from bucketfs.config import Config, parse_bucket_url
from bucketfs.core.filesystem import Filesystem


def make_config(prefix: str = "", **overrides) -> Config:
    config = Config(url=parse_bucket_url(f"s3://test-bucket/{prefix}"), mountpoint="/nonexistent")
    return dataclasses.replace(config, **overrides)


def run_fs(backend: MemoryBackend, body, prefix: str = "", clock=None, **overrides):
    """Run `await body(fs)` against a Filesystem on `backend`; return its result.
    `clock`: e.g. trio.testing.MockClock(autojump_threshold=0) for tests about time."""
    config = make_config(prefix, **overrides)

    async def main():
        async with trio.open_nursery() as nursery:
            fs = Filesystem(backend, config, nursery)
            with trio.fail_after(30):
                result = await body(fs)
            nursery.cancel_scope.cancel()
        return result

    return trio.run(main, clock=clock)


async def resolve(fs, path: str):
    """Walk `path` from the root with lookups, as the kernel does."""
    node = await fs.getattr(1)
    for part in [p for p in path.split("/") if p]:
        node = await fs.lookup(node.ino, part)
    return node


async def read_all(fs, path: str, chunk_bytes: int = 128 * 1024) -> bytes:
    node = await resolve(fs, path)
    fh = await fs.open(node.ino, 0)
    try:
        out, off = bytearray(), 0
        while True:
            data = await fs.read(fh, off, chunk_bytes)
            if not data:
                return bytes(out)
            out += data
            off += len(data)
    finally:
        fs.release(fh)
