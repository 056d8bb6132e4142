"""The READ reply thread (bucketfs/fuse/replies.py) with a stand-in for libfuse: each
reply is written once with its request's bytes, whatever buffer holds them; stop()
writes what is queued first; a reply it cannot write is answered with EIO and the
thread goes on."""

from __future__ import annotations

import collections
import ctypes
import errno
import gc
import mmap
import sys
import threading

import pytest

from bucketfs.core.pieces import Pieces
from bucketfs.fuse.replies import ReplyThread

pytestmark = pytest.mark.timeout(30)


class FakeCall:
    """A libfuse function: records its calls; `argtypes`/`restype` as ctypes sets them."""

    def __init__(self, record) -> None:
        self.record = record
        self.argtypes = self.restype = None

    def __call__(self, *args):
        return self.record(*args)


class FakeLibfuse:
    def __init__(self, block: threading.Event | None = None) -> None:
        self.replies: list = []
        self.errors: list = []
        self.threads: set = set()
        self.block = block
        self.fuse_reply_buf = FakeCall(self._reply_buf)
        self.fuse_reply_iov = FakeCall(self._reply_iov)
        self.fuse_reply_err = FakeCall(lambda req, code: self.errors.append((req, code)) or 0)

    def _reply_buf(self, req, pointer, size):
        if self.block is not None:
            self.block.wait(10)
        if req == 666:
            raise ctypes.ArgumentError("a buffer ctypes cannot pass")
        data = pointer if isinstance(pointer, bytes) else bytes(pointer)
        self.replies.append((req, data[:size]))
        self.threads.add(threading.current_thread().name)
        return 0

    def _reply_iov(self, req, vectors, count):
        data = b"".join(ctypes.string_at(vector.iov_base, vector.iov_len) for vector in vectors[:count])
        self.replies.append((req, data))
        self.threads.add(threading.current_thread().name)
        return 0


def test_every_reply_is_written_once_with_its_bytes_from_the_thread():
    lib = FakeLibfuse()
    stats: collections.Counter = collections.Counter()
    replies = ReplyThread(stats, lib)
    block = bytearray(b"0123456789" * 1000)
    sent = {
        1: b"bytes as they are",
        2: block,  # a cached block
        3: memoryview(block)[10:5000],  # a slice of one
        4: memoryview(b"read-only bytes")[5:],  # (copied: ctypes cannot point into it)
        5: b"",
    }
    for req, data in sent.items():
        replies.submit(req, data)
    replies.error(6, errno.ESTALE)
    replies.stop()
    assert dict(lib.replies) == {req: bytes(data) for req, data in sent.items()}
    assert len(lib.replies) == len(sent)
    assert lib.threads == {"bucketfs-replies"}
    assert lib.errors == [(6, errno.ESTALE)]
    assert stats["fuse.replies_from_thread"] == len(sent)
    replies.stop()  # (idempotent)


def test_stop_writes_what_is_queued_and_a_failed_reply_gets_eio():
    release = threading.Event()
    lib = FakeLibfuse(block=release)
    replies = ReplyThread(collections.Counter(), lib)
    for req in range(10, 20):
        replies.submit(req, bytes([req]) * 3)
    replies.submit(666, b"x")
    replies.submit(21, b"after")
    stopper = threading.Thread(target=replies.stop)
    stopper.start()
    release.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert [req for req, _ in lib.replies] == [*range(10, 20), 21]
    assert lib.errors == [(666, errno.EIO)]


def test_a_reply_in_pieces_is_one_write_of_their_bytes_that_lets_go_of_their_buffers():
    """A READ over two read-ahead parts: one reply (fuse_reply_iov) of both parts' bytes,
    and once written nothing refers to the parts' buffers any more, without waiting for
    the garbage collector: the pool reuses a buffer only when nothing does
    (partbuffers.py), so a reference cycle would leave every such part's buffer unused."""
    lib = FakeLibfuse()
    replies = ReplyThread(collections.Counter(), lib)
    part_a = bytearray(b"a" * 4096)
    part_b = mmap.mmap(-1, 8192)
    part_b[:] = b"b" * 8192
    baseline = sys.getrefcount(part_a), sys.getrefcount(part_b)
    gc.disable()
    try:
        replies.submit(7, Pieces((memoryview(part_a)[96:], memoryview(part_b)[:5000], memoryview(b"read-only")[5:])))
        replies.stop()
        assert (sys.getrefcount(part_a), sys.getrefcount(part_b)) == baseline
    finally:
        gc.enable()
    assert lib.replies == [(7, b"a" * 4000 + b"b" * 5000 + b"only")]
    assert lib.threads == {"bucketfs-replies"}
