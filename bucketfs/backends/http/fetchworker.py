"""A fetch worker: a process of its own that runs small GETs on a CurlLoop and streams
their bodies back to the daemon (workerengine.py), so their HTTP work (libcurl, its
Python callbacks, the MD5 of a whole object) runs on another core, under another GIL.

    python -m bucketfs.backends.http.fetchworker FD PARENT_PID MAX_TRANSFERS CONNECT_S READ_S [CA_BUNDLE [KERNEL_FD [ARENA_FD ARENA_BYTES]]]

FD is the worker's end of a Unix stream socket from the daemon; everything it does
goes through it:
- daemon -> worker: a u32 length, then a marshal tuple
    (GET, tid, kind, url, header_lines, length_bytes, skip_bytes, timeout_s, signing)
      kind: RANGED | BODY; signing: None, or what to sign the GET with (SigV4) here
    (ABORT, tid)
    (WANT, tid): the daemon waits for PUSH tid's body after all (a READ came first)
    (PUSH, tid, url, header_lines, length_bytes, timeout_s, signing, ino, checks,
     tell_open, arena_offset): a whole object into the kernel's page cache (KERNEL_FD,
      the mount's /dev/fuse), as "Pushing into the page cache" below says; checks: (the
      pinned ETag or None, the pinned Last-Modified or None, the MD5 the ETag states or
      None, the answer headers that say it is no MD5 after all:
      digests.S3_ETAG_NOT_MD5_HEADERS, the answer headers of the full-object CRCs
      checked instead where stated: checksums.S3_CHECKSUM_HEADERS); received at
      `arena_offset` of the shared
      memory ARENA_FD (arena.py), or into a buffer of its own when -1
- worker -> daemon: a FRAME header (type, tid, offset, body_length, meta_length),
  the meta, then the body: bytes at `offset` of the transfer's buffer (BODY: appended)
    DATA: body bytes of a GET still running (no meta)
    DONE: the GET's last bytes, and its meta: marshal (status, headers,
          received_bytes, error_body, error_kind, error_text, (checksum kind,
          checksum of the bytes received) or None: checksums.body_hash_for)
    RELEASED: (no body, no meta) the worker no longer touches the arena extent of
          PUSH tid, whose body it sent in a DONE (once WANTed): its write into the
          kernel, if one had begun, has returned

Invariants:
- The worker keeps no body: each piece goes to the daemon as it arrives, into a buffer
  the daemon reserved in its memory budget. Its own memory is libcurl's receive
  buffers, as for the in-process engine.
- Every GET ends with exactly one DONE (errors included); an ABORT of a GET still
  running ends it with an "aborted" DONE. A GET comes signed, or with what to sign it
  with (its HMACs are then this process's CPU, not the daemon's).
- A PUSH ends with a DONE and no body: its error kind "" (pushed), "refused" (the
  answer failed a check, or the kernel refused it: the text says which), or a
  transport error's; or, once WANTed, with the DONE of a GET: the checked body (then,
  for a PUSH into the arena, a RELEASED). Its DONE without a body, or its RELEASED, is
  the last use of its arena extent.
- It never outlives the daemon: it exits when the socket closes, and the kernel kills
  it when the daemon's thread that started it ends (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import marshal
import mmap
import os
import queue
import signal
import socket
import struct
import sys
import threading
import typing
from typing import Optional

from bucketfs.backends.http.body import http_date_s
from bucketfs.backends.http.checksums import stated_crc
from bucketfs.backends.http.curl import BodyTransfer, CurlLoop, Transfer
from bucketfs.backends.http.sigv4 import Signer

log = logging.getLogger("bucketfs.fetchworker")
_Credentials = collections.namedtuple("_Credentials", "access_key secret_key token")

GET, ABORT, PUSH, WANT = 1, 2, 3, 4  # requests
DATA, DONE, RELEASED = 1, 2, 3  # frames back
RANGED, BODY = 0, 1  # kinds of GET: into a buffer of known length, or a whole answer
REQUEST_LENGTH = struct.Struct("<I")
FRAME = struct.Struct("<BIQII")  # type, tid, offset, body length, meta length
# Pieces per sendmsg (it takes at most 1,024, IOV_MAX), and gathered before they are
# sent whatever the batch.
IOV_MAX_COUNT = 510
# Body bytes held before they are sent though their GETs have not ended: the worker's
# memory beyond libcurl's, whatever the GETs in flight.
HELD_MAX_BYTES = 1 << 20
# Requests are read this much at a time (one is ~1 KB: a URL and signed headers).
RECEIVE_BYTES = 1 << 20
_PR_SET_PDEATHSIG = 1
MADV_POPULATE_WRITE = 23  # (Linux 5.14; Python's mmap module may lack the name)

# Pushing into the page cache. FUSE's notifications are writes to the mount's /dev/fuse
# descriptor by any process holding it (include/uapi/linux/fuse.h): a fuse_out_header
# whose `error` is the notification's code and `unique` 0, then its arguments. STORE
# puts bytes into an inode's page cache (the kernel refuses with ENOENT an inode it
# does not hold); INVAL_INODE with offset -1 ends its cached attributes only, so the
# reader's next stat() or read past the end asks the daemon (a GETATTR): the daemon
# learns the file was opened, at the cost of one request, not its READs.
FUSE_NOTIFY_INVAL_INODE, FUSE_NOTIFY_STORE = 2, 4
FUSE_OUT_HEADER = struct.Struct("<IiQ")  # len, error (the notification's code), unique (0)
FUSE_NOTIFY_STORE_OUT = struct.Struct("<QQII")  # nodeid, offset, size, padding
FUSE_NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")  # ino, offset (-1: attributes only), length
REFUSED = "refused"  # a PUSH's error kind when an answer or the kernel refused it
NO_INODE = "the kernel holds no such inode"  # a PUSH's refusal when the kernel answers ENOENT
DAMAGED = "the body's MD5 is not the one its ETag states"  # a PUSH's refusal of a damaged body


class _Sink:
    """Stands in for a transfer's buffer: what Transfer.on_body writes into it goes to
    the daemon as DATA frames, so no body is kept here."""

    __slots__ = ("_out", "_tid", "_length")

    def __init__(self, out: "_Out", tid: int, length_bytes: int):
        self._out, self._tid, self._length = out, tid, length_bytes

    def __len__(self) -> int:
        return self._length

    def __setitem__(self, where: slice, data) -> None:  # a ranged body's piece
        self._out.data(self._tid, where.start, data)

    def __iadd__(self, data) -> "_Sink":  # a whole answer's next piece
        self._out.data(self._tid, self._length, data)
        self._length += len(data)
        return self


class _Out:
    """Frames to the daemon. A GET's body is held until the GET ends and goes with its
    DONE, one frame (the caller waits for the whole body anyway), so the daemon wakes
    and parses about once per GET, not once per piece curl hands over; past
    HELD_MAX_BYTES held, what is held goes as DATA frames. On the blocking socket: a
    daemon slow to read holds this worker back (and through it, its connections), it
    never makes it hold more."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._held: dict = {}  # tid -> [offset of its first piece, pieces]
        self._held_bytes = 0
        self._frames: list = []

    def data(self, tid: int, offset: int, data) -> None:
        held = self._held.get(tid)
        if held is None:
            self._held[tid] = [offset, [data]]
        else:
            held[1].append(data)
        self._held_bytes += len(data)
        if self._held_bytes >= HELD_MAX_BYTES:
            for held_tid, (held_offset, pieces) in self._held.items():
                body = b"".join(pieces)
                self._frames += (FRAME.pack(DATA, held_tid, held_offset, len(body), 0), body)
            self._held.clear()
            self._held_bytes = 0
            self.flush()

    def done(self, tid: int, transfer: Transfer, body=None) -> None:
        """The DONE of a GET, with what is held of its body (or `body`, a PUSH's)."""
        error = transfer.error
        kind = "" if error is None else _error_kind(error)
        meta = marshal.dumps(
            (
                transfer.status,
                transfer.headers,
                transfer.received_bytes,
                bytes(transfer.error_body),
                kind,
                "" if error is None else str(error),
                None if transfer.body_hash is None else (transfer.body_hash.name, transfer.body_hash.digest()),
            )
        )
        offset = 0
        if body is None:
            offset, pieces = self._held.pop(tid, (0, ()))
            body = b"".join(pieces)
            self._held_bytes -= len(body)
        if error is not None:
            body = b""  # (a failed GET's bytes are not used)
        self._frames += (FRAME.pack(DONE, tid, offset, len(body), len(meta)), meta, body)
        if len(self._frames) >= IOV_MAX_COUNT:
            self.flush()

    def pushed(self, tid: int, transfer: Transfer, refusal: str) -> None:
        """The DONE of a PUSH: no body, no headers; `refusal` "" if it was pushed."""
        error = transfer.error
        kind = "" if error is None else _error_kind(error)
        text = "" if error is None else str(error)
        if error is None and refusal:
            kind, text = REFUSED, refusal
        meta = marshal.dumps((transfer.status, {}, transfer.received_bytes, b"", kind, text, None))
        self._frames += (FRAME.pack(DONE, tid, 0, 0, len(meta)), meta)
        if len(self._frames) >= IOV_MAX_COUNT:
            self.flush()

    def released(self, tid: int) -> None:
        """PUSH `tid`'s arena extent is the daemon's again."""
        self._frames.append(FRAME.pack(RELEASED, tid, 0, 0, 0))
        if len(self._frames) >= IOV_MAX_COUNT:
            self.flush()

    def flush(self) -> None:
        """Send every frame gathered. A failure is the worker's end (os._exit): the
        pieces of other GETs went with it, and only the daemon's view of a dead worker
        (each of its GETs failed, then retried) keeps every body whole."""
        parts = [memoryview(part) for part in self._frames if part]
        self._frames = []
        try:
            while parts:
                batch = parts[:IOV_MAX_COUNT]
                sent = self._sock.sendmsg(batch)
                done_count = 0
                while done_count < len(batch) and sent >= len(batch[done_count]):
                    sent -= len(batch[done_count])
                    done_count += 1
                parts = parts[done_count:]
                if sent:
                    parts[0] = parts[0][sent:]
        except OSError as exc:
            if not isinstance(exc, (BrokenPipeError, ConnectionResetError)):
                log.error("sending to the daemon failed: %s", exc)
            os._exit(2)


def serve(sock: socket.socket, loop: CurlLoop, kernel_fd: Optional[int] = None, arena_map=None) -> None:
    """Run GETs (and PUSHes, with `kernel_fd`) for the daemon until it closes the socket;
    `arena_map`: the mapping of the shared memory PUSHes may be received into."""
    out = _Out(sock)
    arena = None if arena_map is None else memoryview(arena_map)
    running: dict = {}  # tid -> Transfer, and Transfer -> tid
    pusher = _Pusher(out, kernel_fd)
    signers: dict = {}  # region -> Signer (each keeps its day's signing key)
    inbox = bytearray()
    closed = [False]

    def on_wake() -> None:
        data = sock.recv(RECEIVE_BYTES)
        if not data:
            closed[0] = True
            return
        inbox.extend(data)
        aborted = []
        while len(inbox) >= REQUEST_LENGTH.size:
            (length,) = REQUEST_LENGTH.unpack_from(inbox)
            if len(inbox) < REQUEST_LENGTH.size + length:
                break
            request = marshal.loads(inbox[REQUEST_LENGTH.size : REQUEST_LENGTH.size + length])
            del inbox[: REQUEST_LENGTH.size + length]
            if request[0] == GET:
                _, tid, kind, url, header_lines, length_bytes, skip_bytes, timeout_s, signing = request
                if signing is not None:
                    header_lines = signed_lines(signers, url, signing)
                cls = BodyTransfer if kind == BODY else Transfer
                sink = typing.cast(bytearray, _Sink(out, tid, length_bytes))  # (the part of bytearray Transfer uses)
                transfer = cls(url, header_lines, sink, skip_bytes, timeout_s)
                running[tid], running[transfer] = transfer, tid
                loop.add(transfer)
            elif request[0] == PUSH:
                _, tid, url, header_lines, length_bytes, timeout_s, signing, ino, checks, tell_open, at = request
                if signing is not None:
                    header_lines = signed_lines(signers, url, signing)
                in_arena = at >= 0 and arena is not None
                buffer: typing.Any
                if at >= 0 and arena is not None:
                    _populate(arena_map, at, length_bytes)
                    buffer = arena[at : at + length_bytes]
                else:
                    buffer = bytearray(length_bytes)
                transfer = Transfer(url, header_lines, typing.cast(bytearray, buffer), 0, timeout_s)
                running[tid], running[transfer] = transfer, tid
                pusher.add(transfer, ino, checks, tell_open, tid if in_arena else None)
                loop.add(transfer)
            elif request[0] == WANT:
                pusher.want(request[1], request[1] in running)
            elif (to_abort := running.get(request[1])) is not None and loop.abort(to_abort):
                aborted.append(to_abort)
        deliver(aborted)
        out.flush()  # (a WANT's body)

    def deliver(finished: list) -> None:  # (after every batch of events, finished or not)
        for transfer in finished:
            tid = running.pop(transfer)
            del running[tid]
            if not pusher.finished(tid, transfer):
                out.done(tid, transfer)
        if finished:
            out.flush()

    loop.run(sock.fileno(), on_wake, deliver, lambda: closed[0], {pusher.wake_fd: pusher.on_written})


class _Pusher:
    """A worker's PUSHes. A checked body is written into the kernel by a thread of its
    own: the write waits while a READ of those pages is in flight, and the daemon
    answers that READ with this body (it asks with WANT), so this process's loop must
    go on meanwhile. A body the daemon WANTs goes back to it (a DONE with the body, as
    a GET's) instead of into the kernel, or as well when its write had begun; its
    later outcome is then not sent (one DONE per request)."""

    def __init__(self, out: "_Out", kernel_fd: Optional[int]):
        self._out = out
        self._kernel_fd = kernel_fd
        self._pushes: dict = {}  # Transfer -> (ino, checks, tell_open), while its GET runs
        self._wanted: set = set()  # tids whose GET runs and whose body the daemon wants
        self._in_arena: set = set()  # tids received into the arena whose extent this still uses
        self._writing: dict = {}  # tid -> Transfer being written into the kernel
        self._todo: queue.SimpleQueue = queue.SimpleQueue()  # (tid, ino, body) for the thread
        self._written: queue.SimpleQueue = queue.SimpleQueue()  # (tid, refusal) from the thread
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread: Optional[threading.Thread] = None

    def add(self, transfer: Transfer, ino: int, checks: tuple, tell_open: bool, arena_tid: Optional[int]) -> None:
        self._pushes[transfer] = (ino, checks, tell_open)
        if arena_tid is not None:
            self._in_arena.add(arena_tid)

    def want(self, tid: int, running: bool) -> None:
        """The daemon waits for the body of PUSH `tid` (a reader's READ came first)."""
        transfer = self._writing.pop(tid, None)
        if transfer is not None:
            # (Its write waits for the READ this answers; the extent is released after it.)
            self._out.done(tid, transfer, transfer.buffer)
        elif running:
            self._wanted.add(tid)

    def finished(self, tid: int, transfer: Transfer) -> bool:
        """Handle a finished transfer if it is a PUSH's (True)."""
        push = self._pushes.pop(transfer, None)
        if push is None:
            return False
        ino, checks, tell_open = push
        wanted = tid in self._wanted
        self._wanted.discard(tid)
        refusal = "" if transfer.error is not None else answer_refusal(transfer, checks)
        if transfer.error is not None or refusal:
            self._in_arena.discard(tid)
            self._out.pushed(tid, transfer, refusal)
        elif wanted:
            self._out.done(tid, transfer, transfer.buffer)
            if tid in self._in_arena:
                self._in_arena.discard(tid)
                self._out.released(tid)
        elif self._kernel_fd is None:
            self._in_arena.discard(tid)
            self._out.pushed(tid, transfer, "no kernel descriptor")
        else:
            self._writing[tid] = transfer
            if self._thread is None:
                self._thread = threading.Thread(target=self._write, name="kernel writes", daemon=True)
                self._thread.start()
            self._todo.put((tid, ino, transfer.buffer, tell_open))
        return True

    def _write(self) -> None:
        assert self._kernel_fd is not None
        while True:
            tid, ino, body, tell_open = self._todo.get()
            self._written.put((tid, write_to_kernel(self._kernel_fd, ino, body, tell_open)))
            os.eventfd_write(self.wake_fd, 1)

    def on_written(self) -> None:
        """(The loop's thread) send the outcomes of the writes done."""
        try:
            os.eventfd_read(self.wake_fd)
        except BlockingIOError:
            return
        while True:
            try:
                tid, refusal = self._written.get_nowait()
            except queue.Empty:
                break
            transfer = self._writing.pop(tid, None)
            in_arena = tid in self._in_arena
            self._in_arena.discard(tid)
            if transfer is not None:
                self._out.pushed(tid, transfer, refusal)
            elif in_arena:  # (WANT had its body sent: the extent is the daemon's from now on)
                self._out.released(tid)
        self._out.flush()


def _populate(arena_map: mmap.mmap, at: int, length_bytes: int) -> None:
    """Fault in an extent's pages with one call before the body lands in them: a fresh
    shared page costs ~3.3 us when a write faults it in, ~2.4 us this way (a 100 KB body:
    82 against 61 us, ad hoc); pages the ring reuses are already in."""
    span_bytes = -(-length_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        arena_map.madvise(MADV_POPULATE_WRITE, at, span_bytes)
    except (OSError, ValueError):  # (before Linux 5.14: the writes fault them in)
        pass


def _error_kind(error: BaseException) -> str:
    return (
        "timeout" if isinstance(error, TimeoutError) else "connection" if isinstance(error, ConnectionError) else "os"
    )


def answer_refusal(transfer: Transfer, checks: tuple) -> str:
    """Why the finished GET `transfer` of a whole object (its buffer's length) must not
    be pushed, or "" if it may: it is that object, whole, of the pinned version, with
    the stated MD5. Stricter than the daemon's checks (s3.py, base.check_answer): a
    doubt is a refusal, and the reader's own READ then fetches the file, through
    those checks and their retries."""
    etag, last_modified_max_s, md5, not_md5_headers, checksum_headers = checks
    headers, size_bytes = transfer.headers, len(transfer.buffer)
    if transfer.status == 206:
        if headers.get("content-range", "").strip() != f"bytes 0-{size_bytes - 1}/{size_bytes}":
            return f"Content-Range {headers.get('content-range')!r} for {size_bytes} bytes"
    elif transfer.status != 200 or headers.get("content-length", "").strip() != str(size_bytes):
        return f"status {transfer.status}, Content-Length {headers.get('content-length')!r}"
    if transfer.received_bytes != size_bytes:
        return f"{transfer.received_bytes} bytes of {size_bytes}"
    if etag is not None and headers.get("etag", "").strip('"') != etag:
        return f"ETag {headers.get('etag')!r}, pinned {etag!r}"
    if last_modified_max_s is not None:
        answered_s = http_date_s(headers.get("last-modified"))
        if answered_s is None or answered_s > last_modified_max_s:
            return f"Last-Modified {headers.get('last-modified')!r}"
    body_hash = transfer.body_hash
    stated = stated_crc(headers, checksum_headers)
    if stated is not None:  # (checked instead of the ETag's MD5: cheaper, and as sure)
        if body_hash is None or body_hash.name != stated[0] or body_hash.digest() != stated[1]:
            return DAMAGED
    elif md5 is not None and not any(
        (value := headers.get(name, "").lower()) and value.startswith(start) for name, start in not_md5_headers
    ):
        if body_hash is None or body_hash.name != "md5" or body_hash.digest() != md5:
            return DAMAGED
    return ""


def write_to_kernel(kernel_fd: int, ino: int, body, tell_open: bool) -> str:
    """With `tell_open`, end inode `ino`'s cached attributes; then put `body` (a whole
    file) into its page cache; "" if done, else why not. In this order: a reader that
    opens the file between the two asks for its attributes (the daemon hears of the
    open) or READs it; the other way round, one that opened it just before could read it
    all from the page cache before its attributes ended, and the daemon would never
    hear of it."""
    store = FUSE_NOTIFY_STORE_OUT.pack(ino, 0, len(body), 0)
    inval = FUSE_NOTIFY_INVAL_INODE_OUT.pack(ino, -1, 0)
    try:
        if tell_open:
            os.writev(
                kernel_fd, [FUSE_OUT_HEADER.pack(FUSE_OUT_HEADER.size + len(inval), FUSE_NOTIFY_INVAL_INODE, 0), inval]
            )
        os.writev(
            kernel_fd,
            [FUSE_OUT_HEADER.pack(FUSE_OUT_HEADER.size + len(store) + len(body), FUSE_NOTIFY_STORE, 0), store, body],
        )
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return NO_INODE
        return f"the kernel refused it: {os.strerror(exc.errno) if exc.errno else exc}"
    return ""


def signed_lines(signers: dict, url: str, signing: tuple) -> list:
    """The header lines of a GET of `url` signed with SigV4 as `signing` says:
    (region, access key, secret key, token, host, headers)."""
    region, access_key, secret_key, token, host, headers = signing
    signer = signers.get(region) or signers.setdefault(region, Signer(region))
    signed = signer.sign_get(_Credentials(access_key, secret_key, token), url, host, headers)
    return [f"{name}: {value}" for name, value in signed.items()]


def _die_with_parent(parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the daemon ended before the line above ran
        os._exit(0)


def main(argv: Optional[list] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    fd, parent_pid, max_transfers = int(args[0]), int(args[1]), int(args[2])
    connect_timeout_s, read_timeout_s = float(args[3]), float(args[4])
    ca_bundle_path = args[5] if len(args) > 5 and args[5] else None
    kernel_fd = int(args[6]) if len(args) > 6 and args[6] else None
    arena_map = None
    if len(args) > 8 and args[7]:
        arena_map = mmap.mmap(int(args[7]), int(args[8]))  # (shared, read and write)
    _die_with_parent(parent_pid)
    # Ctrl-C on a foreground mount reaches the whole process group: the daemon decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="bucketfs fetch worker %(process)d: %(message)s")
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    try:
        serve(sock, CurlLoop(max_transfers, connect_timeout_s, read_timeout_s, ca_bundle_path), kernel_fd, arena_map)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the daemon went away mid-frame: nobody to tell
    except Exception:  # noqa: BLE001 - a bug: the daemon sees the socket close, fails and restarts
        log.exception("stopped")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
