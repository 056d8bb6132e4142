"""A fetch worker: a process of its own that runs small GETs on a CurlLoop and streams
their bodies back to the daemon (workerengine.py), so their HTTP work (libcurl, its
Python callbacks, the MD5 of a whole object) runs on another core, under another GIL.

    python -m bucketfs.backends.http.fetchworker FD PARENT_PID MAX_TRANSFERS CONNECT_S READ_S [CA_BUNDLE]

FD is the worker's end of a Unix stream socket from the daemon; everything it does
goes through it:
- daemon -> worker: a u32 length, then a marshal tuple
    (GET, tid, kind, url, header_lines, length_bytes, skip_bytes, timeout_s, signing)
      kind: RANGED | BODY; signing: None, or what to sign the GET with (SigV4) here
    (ABORT, tid)
- worker -> daemon: a FRAME header (type, tid, offset, body_length, meta_length),
  the meta, then the body: bytes at `offset` of the transfer's buffer (BODY: appended)
    DATA: body bytes of a GET still running (no meta)
    DONE: the GET's last bytes, and its meta: marshal (status, headers,
          received_bytes, error_body, error_kind, error_text, md5 or None)

Invariants:
- The worker keeps no body: each piece goes to the daemon as it arrives, into a buffer
  the daemon reserved in its memory budget. Its own memory is libcurl's receive
  buffers, as for the in-process engine.
- Every GET ends with exactly one DONE (errors included); an ABORT of a GET still
  running ends it with an "aborted" DONE. A GET comes signed, or with what to sign it
  with (its HMACs are then this process's CPU, not the daemon's).
- It never outlives the daemon: it exits when the socket closes, and the kernel kills
  it when the daemon's thread that started it ends (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import marshal
import os
import signal
import socket
import struct
import sys
import typing
from typing import Optional

from bucketfs.backends.http.curl import BodyTransfer, CurlLoop, Transfer
from bucketfs.backends.http.sigv4 import Signer

log = logging.getLogger("bucketfs.fetchworker")
_Credentials = collections.namedtuple("_Credentials", "access_key secret_key token")

GET, ABORT = 1, 2  # requests
DATA, DONE = 1, 2  # frames back
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

    def done(self, tid: int, transfer: Transfer) -> None:
        error, kind = transfer.error, ""
        if error is not None:
            kind = (
                "timeout"
                if isinstance(error, TimeoutError)
                else "connection"
                if isinstance(error, ConnectionError)
                else "os"
            )
        meta = marshal.dumps(
            (
                transfer.status,
                transfer.headers,
                transfer.received_bytes,
                bytes(transfer.error_body),
                kind,
                "" if error is None else str(error),
                None if transfer.md5 is None else transfer.md5.digest(),
            )
        )
        offset, pieces = self._held.pop(tid, (0, ()))
        body = b"".join(pieces)
        self._held_bytes -= len(body)
        if error is not None:
            body = b""  # (a failed GET's bytes are not used)
        self._frames += (FRAME.pack(DONE, tid, offset, len(body), len(meta)), meta, body)
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


def serve(sock: socket.socket, loop: CurlLoop) -> None:
    """Run GETs for the daemon until it closes the socket."""
    out = _Out(sock)
    running: dict = {}  # tid -> Transfer, and Transfer -> tid
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
            elif (to_abort := running.get(request[1])) is not None and loop.abort(to_abort):
                aborted.append(to_abort)
        deliver(aborted)

    def deliver(finished: list) -> None:  # (after every batch of events, finished or not)
        for transfer in finished:
            tid = running.pop(transfer)
            del running[tid]
            out.done(tid, transfer)
        if finished:
            out.flush()

    loop.run(sock.fileno(), on_wake, deliver, lambda: closed[0])


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
    _die_with_parent(parent_pid)
    # Ctrl-C on a foreground mount reaches the whole process group: the daemon decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="bucketfs fetch worker %(process)d: %(message)s")
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    try:
        serve(sock, CurlLoop(max_transfers, connect_timeout_s, read_timeout_s, ca_bundle_path))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the daemon went away mid-frame: nobody to tell
    except Exception:  # noqa: BLE001 - a bug: the daemon sees the socket close, fails and restarts
        log.exception("stopped")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
