"""READ replies written by a thread of their own, outside the GIL.

A READ's reply is one writev of its bytes to /dev/fuse, in which the kernel copies
them into the reader's pages. pyfuse3 writes it on the trio thread with the GIL held:
streaming shards, that copy was 42% of the serving thread's CPU (perf, 4 readers), and
~9% for 100 KB files. Once the kernel opens files itself (noopen.py), its READ handler
has already read the request's inode and handle, so it serves the READ here instead of
through pyfuse3's handler: a task of the daemon's nursery reads (FuseOperations.read,
the same errors), and this thread calls libfuse's `fuse_reply_buf` through ctypes,
which lets go of the GIL for the call. The trio thread only queues the reply.

Invariants:
- Every request gets exactly one reply: its bytes, or its errno (fuse_reply_err, on
  the trio thread), or EINTR when the task is cancelled (unmount). libfuse frees a
  request in its reply, so none is touched after.
- The reply's bytes stay referenced until the call returns: a reused part buffer
  (partbuffers.py) is not reused while a reference is held.
- stop() writes every queued reply, then ends the thread; the mount calls it after
  the tasks that queue replies have ended and before the FUSE session is destroyed.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import queue
import threading
from typing import Optional

from bucketfs.core.filesystem import Pieces

log = logging.getLogger(__name__)

# READs this large or larger are replied from the thread. The kernel asks for up to 4 MiB
# at a time when streaming a file (requestsize.py; 1 MiB where that is not in force), and for about the
# whole file when a loader reads a small one in one call (100 KB files: 90-110 KB). A
# reply from the thread costs a task and a hand-off of the GIL to the thread and back,
# more than the copy of a small file's bytes (W2, 100 KB files: 15% fewer files/s).
REPLY_THREAD_MIN_BYTES = 256 * 1024


def _loaded_libfuse() -> Optional[ctypes.CDLL]:
    """The libfuse3 this process has loaded (pyfuse3's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libfuse3.so" in line}
        if len(paths) != 1:
            return None
        return ctypes.CDLL(paths.pop())  # (the loaded library again: CDLL calls release the GIL)
    except OSError:
        return None


class ReplyThread:
    """Writes READ replies (fuse_reply_buf) on a thread of its own."""

    def __init__(self, stats, lib: Optional[ctypes.CDLL] = None) -> None:
        self.stats = stats
        lib = lib if lib is not None else _loaded_libfuse()
        self.available = lib is not None
        if lib is not None:
            self._reply_buf = lib.fuse_reply_buf
            self._reply_buf.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
            self._reply_buf.restype = ctypes.c_int
            self._reply_iov = lib.fuse_reply_iov
            self._reply_iov.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
            self._reply_iov.restype = ctypes.c_int
            self._reply_err = lib.fuse_reply_err
            self._reply_err.argtypes = (ctypes.c_void_p, ctypes.c_int)
            self._reply_err.restype = ctypes.c_int
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def submit(self, req: int, data) -> None:
        """Reply to `req` with `data` (any contiguous buffer, or Pieces) from the thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="bucketfs-replies", daemon=True)
            self._thread.start()
        self._queue.put((req, data))
        self.stats["fuse.replies_from_thread"] += 1

    def error(self, req: int, code: int) -> None:
        """Reply to `req` with errno `code`, now (a short write: not worth the thread)."""
        self._reply_err(req, code)

    def stop(self) -> None:
        """Write what is queued, then end the thread. Idempotent."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        get, get_nowait, reply_buf = self._queue.get, self._queue.get_nowait, self._reply_buf
        item = get()
        while item is not None:
            req, data = item
            try:
                if isinstance(data, bytes):
                    ret = reply_buf(req, data, len(data))
                elif isinstance(data, Pieces):
                    ret = self._reply_pieces(req, data)
                else:
                    view = memoryview(data)
                    pointer = _addressable(view)
                    ret = reply_buf(req, pointer, view.nbytes)
                    del pointer, view
                if ret != 0:  # (the connection is gone: an unmount)
                    self.stats["fuse.reply_failures"] += 1
            except Exception:  # noqa: BLE001 - a reply this thread cannot write must not end it
                log.exception("writing a READ reply failed")
                self._reply_err(req, errno.EIO)
            del data, item
            try:  # (what queued while this one was written: no wait, no GIL hand-off)
                item = get_nowait()
            except queue.Empty:
                item = get()

    def _reply_pieces(self, req: int, pieces: Pieces) -> int:
        """One reply of every piece's bytes in order (one writev): no copy to join them."""
        vectors = (_IoVec * len(pieces))()
        # The pieces' buffers, referenced until the call returns. (Not through
        # ctypes.cast: its result and its argument refer to each other, so a part's
        # buffer would stay viewed, never reused, until the garbage collector ran.)
        arrays = []
        for vector, piece in zip(vectors, pieces):
            view = memoryview(piece)
            array = _addressable(view)
            arrays.append(array)
            vector.iov_base = ctypes.addressof(array)
            vector.iov_len = view.nbytes
            del view
        ret = self._reply_iov(req, vectors, len(pieces))
        del arrays
        return ret


class _IoVec(ctypes.Structure):
    _fields_ = (("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t))


def _addressable(view: memoryview) -> ctypes.Array:
    """A ctypes array over `view`'s bytes: the buffer itself, or for a read-only one
    (ctypes cannot point into it) a copy."""
    try:
        return (ctypes.c_char * view.nbytes).from_buffer(view)
    except TypeError:
        return (ctypes.c_char * view.nbytes).from_buffer_copy(view)
