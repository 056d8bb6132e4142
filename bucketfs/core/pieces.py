"""A read's bytes in several buffers, handed on as they are.

A READ that spans two read-ahead parts (or two cached runs) has its bytes in two
buffers. Joining them is a copy on the serving thread: with 4 MiB READs over 8 MiB
parts, 2 READs in 5 spanned two, and the joins were over half of that thread's CPU
(ad hoc, streaming 516 MB of shards: 0.19 s, 0.08 s without them). The
reply thread sends several buffers in one write (fuse_reply_iov), so a reader that
replies from there asks for `Pieces` (Filesystem.read's `pieces`); every other caller
gets one buffer.
"""

from __future__ import annotations


class Pieces(tuple):
    """Buffers (bytes-like, at least two), whose bytes in order are the read's."""

    __slots__ = ()

    @property
    def nbytes(self) -> int:
        return sum(memoryview(piece).nbytes for piece in self)

    def joined(self) -> bytes:
        return b"".join(self)


def nbytes_of(data) -> int:
    """The bytes of a read's result, one buffer or Pieces."""
    return data.nbytes if isinstance(data, Pieces) else len(data)


def one_buffer(data):
    """A read's result as one buffer (a copy only if it was in Pieces)."""
    return data.joined() if isinstance(data, Pieces) else data
