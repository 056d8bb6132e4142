"""Small GETs on libcurl's multi interface (pycurl), all from one thread.

Why: an ImageFolder sample is one GET of ~100 KB, and on a machine whose cores are
busy (the store, the loader, the daemon) the daemon's CPU per GET is the files/s
ceiling. Through urllib3 and http.client on 32 worker threads a 100 KB GET cost
~0.68 ms of CPU, mostly Python under the GIL and thread hand-offs; on one curl multi
handle, ~0.12 ms (same objects, same server, measured side by side). Large read-ahead
parts stay on the urllib3 path, which receives them into their buffers with no copy.

Design:
- One thread owns the CurlMulti and every easy handle (libcurl handles are not
  thread safe). It sleeps in epoll on curl's sockets and on an eventfd that trio
  tasks write after queueing a transfer; the GIL is free while it sleeps.
- A body lands in the caller's buffer as it arrives: one copy, no join.
- Finished transfers go back to the trio thread a batch at a time (run_sync_soon).
- A task cancelled while waiting aborts its transfer in the thread and waits for
  that: no byte is written into a buffer after its owner let go of it.
- Retries, errors and the checks of an answer (ETag, Content-Range) stay with the
  caller (s3_lean, s3): this module only moves bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import select
import threading
import time
from typing import Any, Optional

import trio

from bucketfs.backends.http.body import body_deadline_s
from bucketfs.backends.http.checksums import body_hash_for

try:
    import pycurl
except ImportError:  # an optional speed-up: without it, every GET takes the urllib3 path
    pycurl = None

log = logging.getLogger(__name__)

# GETs up to this size go through this engine (small files, random-read blocks): their
# cost is per request. Read-ahead parts (8 MiB) stay on the urllib3 path, which
# receives them into their buffers without curl's one copy. (S3 and GCS alike.)
SMALL_GET_MAX_BYTES = 2 * 1024 * 1024
# Bytes per receive callback: a 100 KB body in one or two Python calls, not seven.
RECEIVE_BUFFER_BYTES = 512 * 1024
# An error answer's body (S3's XML) is kept this far: enough for its Code and Message.
ERROR_BODY_MAX_BYTES = 64 * 1024
# A whole answer of unknown length (BodyTransfer: a LIST page of 1,000 keys of up to
# 1,024 bytes each, escaped): a bound, not a size.
BODY_MAX_BYTES = 16 * 1024 * 1024
# curl's codes for a failure of the connection or the transfer: worth a new attempt.
_TIMEOUT_CODES = {28}  # OPERATION_TIMEDOUT
_CONNECTION_CODES = {5, 6, 7, 16, 18, 35, 52, 55, 56, 92}  # resolve, connect, HTTP/2, partial, TLS, empty, send, recv


@dataclasses.dataclass(eq=False)
class Transfer:
    """One GET into `buffer`. A server that ignored Range sends the whole object (a 200
    without Content-Range): its first `skip_bytes` are skipped, and the transfer ends
    once the buffer is full. Results are set by the engine's thread, read after `done`."""

    url: str
    header_lines: list  # "Name: value"
    buffer: bytearray
    skip_bytes: int
    timeout_s: float
    status: int = 0
    headers: dict = dataclasses.field(default_factory=dict)  # lower-case name -> value
    received_bytes: int = 0  # written into buffer
    error_body: bytearray = dataclasses.field(default_factory=bytearray)
    error: Optional[BaseException] = None
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    _body_seen_bytes: int = 0
    _ended_early: bool = False  # the buffer is full: the rest of a whole-object answer is not wanted
    _overflow: bool = False
    # The checksum of the bytes written into the buffer, for an answer that is a whole
    # object and states one (checksums.body_hash_for: S3's CRC, or an ETag that could be an
    # MD5): computed here, on the engine's thread as the body arrives (hashlib lets go of
    # the GIL), so the whole-object check costs the trio thread nothing (an MD5 took
    # ~0.15 ms per 100 KB there).
    body_hash: Optional[Any] = None  # a checksums.BodyHash, or what a fetch worker computed (workerengine._Digest)
    # For an engine that signs (a fetch worker): (region, access key, secret key, token,
    # host, headers) to sign with SigV4 and send; header_lines is then empty.
    signing: Optional[tuple] = None
    tid: int = 0  # a fetch worker's number for it (workerengine.py)

    @classmethod
    def ranged(
        cls,
        url: str,
        headers: dict,
        buffer: bytearray,
        start: int,
        read_timeout_s: float,
        signing: Optional[tuple] = None,
    ) -> "Transfer":
        """The GET of `len(buffer)` bytes from `start`, `headers` sent as they are (or
        `signing`'s, signed by the engine), with one deadline for the whole attempt
        (first byte, then the body at the slowest rate read_body accepts); connecting
        is bounded on its own as well."""
        timeout_s = body_deadline_s(read_timeout_s, len(buffer)) - time.monotonic()
        lines = [f"{name}: {value}" for name, value in headers.items()]
        return cls(url, lines, buffer, start, timeout_s, signing=signing)

    # -- callbacks, on the engine's thread ---------------------------------------
    def on_header(self, line: bytes) -> None:
        if line.startswith(b"HTTP/"):
            self.status = int(line.split(None, 2)[1])
            self.headers = {}  # (a later status line replaces an interim answer's)
            self.body_hash = None
            return
        raw_name, sep, raw_value = line.partition(b":")
        if sep:
            name, value = raw_name.strip().lower().decode("latin-1"), raw_value.strip().decode("latin-1")
            # A repeated header is one list, comma-joined (RFC 9110), as urllib3 reads it:
            # GCS sends x-goog-hash twice, crc32c= and md5=.
            self.headers[name] = f"{self.headers[name]}, {value}" if name in self.headers else value

    def on_body(self, data: bytes):
        if self.status not in (200, 206):
            room = ERROR_BODY_MAX_BYTES - len(self.error_body)
            self.error_body += data[: max(room, 0)]
            return None
        ranged = "content-range" in self.headers
        start = self._body_seen_bytes
        if start == 0:  # (every header is in)
            self.body_hash = body_hash_for(self.headers, self.skip_bytes)
        self._body_seen_bytes += len(data)
        # A 200 without Content-Range: the server ignored Range and sends the whole object.
        piece = data if ranged else data[max(self.skip_bytes - start, 0) :]
        at = self.received_bytes
        if len(piece) > len(self.buffer) - at:
            if not ranged:  # the range ends here, and so does the transfer
                piece = piece[: len(self.buffer) - at]
                self._ended_early = True
            else:
                self._overflow = True  # a ranged answer longer than its range: a broken server
                return 0  # (aborts the transfer)
        self.buffer[at : at + len(piece)] = piece
        self.received_bytes = at + len(piece)
        if self.body_hash is not None:
            self.body_hash.update(piece)
        return 0 if self._ended_early else None

    def finish(self, code: int, message: str) -> None:
        if self._overflow:
            self.error = ConnectionError(f"GET {self.url}: a body longer than its {len(self.buffer)}-byte range")
        elif code == 0 or (self._ended_early and code == pycurl.E_WRITE_ERROR):
            return
        elif code in _TIMEOUT_CODES:
            self.error = TimeoutError(f"curl: {message}")
        elif code in _CONNECTION_CODES:
            self.error = ConnectionError(f"curl error {code}: {message}")
        else:
            self.error = OSError(f"curl error {code}: {message}")


class BodyTransfer(Transfer):
    """A GET of a whole answer of unknown length (a LIST page): its body grows in
    `buffer`; an answer longer than BODY_MAX_BYTES is an error, not a cut body."""

    def on_body(self, data: bytes):
        if self.status != 200:
            return super().on_body(data)
        if len(self.buffer) + len(data) > BODY_MAX_BYTES:
            self._overflow = True
            return 0  # (aborts the transfer)
        self.buffer += data
        self.received_bytes = len(self.buffer)
        return None


class CurlLoop:
    """One libcurl multi handle and its easy handles, driven by `run` on one thread
    (libcurl handles are not thread safe): the loop of the daemon's engine thread
    (CurlEngine) and of a fetch worker process (fetchworker.py). It sleeps in epoll on
    curl's sockets and on `wake_fd`, without the GIL."""

    def __init__(
        self, max_transfers_count: int, connect_timeout_s: float, read_timeout_s: float, ca_bundle_path: Optional[str]
    ):
        self.max_transfers_count = max_transfers_count
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.ca_bundle_path = ca_bundle_path
        self.active: dict = {}  # Transfer -> easy handle, and easy handle -> Transfer
        self._free_handles: list = []
        self._multi: Any = None  # (a pycurl.CurlMulti while run() runs)

    def run(self, wake_fd: int, on_wake, deliver, stopping, more_wakes: Optional[dict] = None) -> None:
        """Serve transfers until `stopping()`. `on_wake()` runs when `wake_fd` is
        readable (it reads it, and adds or aborts transfers); `deliver(finished)` gets
        each batch of finished transfers. However it ends (a bug in it raises after),
        every transfer still running is failed and delivered, and the handles closed.
        `more_wakes`: {fd: callback} run when that descriptor is readable."""
        more_wakes = more_wakes or {}
        epoll = select.epoll()
        epoll.register(wake_fd, select.EPOLLIN)
        for fd in more_wakes:
            epoll.register(fd, select.EPOLLIN)
        watched: dict = {}  # curl's socket fd -> epoll mask
        timer = [None]  # when curl wants SOCKET_TIMEOUT (time.monotonic), or None

        def on_socket(what, fd, _multi, _socketp):
            if what == pycurl.POLL_REMOVE:
                if watched.pop(fd, None) is not None:
                    try:
                        epoll.unregister(fd)
                    except OSError:
                        pass  # (closed already: epoll forgot it itself)
                return
            mask = (select.EPOLLIN if what & pycurl.POLL_IN else 0) | (select.EPOLLOUT if what & pycurl.POLL_OUT else 0)
            try:
                epoll.modify(fd, mask) if fd in watched else epoll.register(fd, mask)
            except FileExistsError:  # a new socket on the number of one closed unannounced
                epoll.modify(fd, mask)
            watched[fd] = mask

        def on_timer(timeout_ms):
            timer[0] = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000

        multi = self._multi = pycurl.CurlMulti()
        multi.setopt(pycurl.M_SOCKETFUNCTION, on_socket)
        multi.setopt(pycurl.M_TIMERFUNCTION, on_timer)
        multi.setopt(pycurl.M_MAXCONNECTS, self.max_transfers_count)
        failure: BaseException = ConnectionError("the HTTP engine is closed")
        try:
            while not stopping():
                timeout_s = -1 if timer[0] is None else max(timer[0] - time.monotonic(), 0)
                for fd, mask in epoll.poll(timeout_s):
                    if fd == wake_fd:
                        on_wake()
                    elif fd in more_wakes:
                        more_wakes[fd]()
                    else:
                        flags = (
                            (pycurl.CSELECT_IN if mask & select.EPOLLIN else 0)
                            | (pycurl.CSELECT_OUT if mask & select.EPOLLOUT else 0)
                            | (pycurl.CSELECT_ERR if mask & (select.EPOLLERR | select.EPOLLHUP) else 0)
                        )
                        multi.socket_action(fd, flags)
                if timer[0] is not None and time.monotonic() >= timer[0]:
                    timer[0] = None
                    multi.socket_action(pycurl.SOCKET_TIMEOUT, 0)
                deliver(self._collect())
        except BaseException as exc:  # a bug here must fail transfers, not hang readers
            failure = ConnectionError(f"the HTTP engine stopped: {exc}")
            raise
        finally:
            transfers = [transfer for transfer in self.active if isinstance(transfer, Transfer)]
            handles = [easy for easy in self.active if not isinstance(easy, Transfer)]
            for transfer in transfers:
                if transfer.error is None:
                    transfer.error = failure
            self.active.clear()
            deliver(transfers)
            for easy in handles + self._free_handles:
                easy.close()
            multi.close()
            epoll.close()

    def add(self, transfer: Transfer) -> None:
        easy = self._free_handles.pop() if self._free_handles else self._new_handle()
        easy.setopt(pycurl.URL, transfer.url)
        if transfer.header_lines:
            easy.setopt(pycurl.HTTPHEADER, transfer.header_lines)
        else:  # (an empty list leaves a reused handle's last headers in place: its Range, its If-Match)
            easy.unsetopt(pycurl.HTTPHEADER)
        easy.setopt(pycurl.TIMEOUT_MS, max(int(transfer.timeout_s * 1000), 1))
        easy.setopt(pycurl.HEADERFUNCTION, transfer.on_header)
        easy.setopt(pycurl.WRITEFUNCTION, transfer.on_body)
        self.active[transfer] = easy
        self.active[easy] = transfer
        self._multi.add_handle(easy)

    def abort(self, transfer: Transfer) -> bool:
        """Take a running transfer off the wire (its error: "aborted"); False if it is
        not running (a finished one is on its way back)."""
        easy = self.active.pop(transfer, None)
        if easy is None:
            return False
        del self.active[easy]
        self._multi.remove_handle(easy)
        self._free_handles.append(easy)
        transfer.error = ConnectionError("aborted")
        return True

    def _collect(self) -> list:
        finished = []
        multi = self._multi
        while True:
            queued, ok, failed = multi.info_read()
            for easy, code, message in [(easy, 0, "") for easy in ok] + list(failed):
                transfer = self.active.pop(easy)
                del self.active[transfer]
                multi.remove_handle(easy)
                self._free_handles.append(easy)
                transfer.finish(code, message)
                finished.append(transfer)
            if not queued:
                break
        return finished

    def _new_handle(self):
        easy = pycurl.Curl()
        easy.setopt(pycurl.NOSIGNAL, 1)  # (no SIGALRM for timeouts: this may not be the main thread)
        easy.setopt(pycurl.CONNECTTIMEOUT_MS, int(self.connect_timeout_s * 1000))
        # The socket read timeout of the other paths: a store silent this long (whole
        # seconds, curl's unit) fails the attempt, before the transfer's own deadline.
        easy.setopt(pycurl.LOW_SPEED_LIMIT, 1)
        easy.setopt(pycurl.LOW_SPEED_TIME, max(math.ceil(self.read_timeout_s), 1))
        easy.setopt(pycurl.PROXY, "")  # the SDK path serves endpoints behind a proxy (s3_lean)
        easy.setopt(pycurl.PATH_AS_IS, 1)  # a key's "../" or "//" is part of its name, not a path to tidy
        easy.setopt(pycurl.BUFFERSIZE, RECEIVE_BUFFER_BYTES)
        easy.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_1_1)
        if self.ca_bundle_path:
            easy.setopt(pycurl.CAINFO, self.ca_bundle_path)
        return easy


class CurlEngine:
    """Small GETs for trio tasks, on a CurlLoop in a thread of this process."""

    def __init__(
        self, max_transfers_count: int, connect_timeout_s: float, read_timeout_s: float, ca_bundle_path: Optional[str]
    ):
        self._loop_args = (max_transfers_count, connect_timeout_s, read_timeout_s, ca_bundle_path)
        self._token: Optional[trio.lowlevel.TrioToken] = None
        self._thread: Optional[threading.Thread] = None
        self._queue: collections.deque = collections.deque()  # ("add" | "abort", Transfer), from trio
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # `_open` turns false, under `_lock`, when the thread ends (closed, or a bug): from
        # then on nothing is queued, so no transfer waits for a thread that is gone.
        self._lock = threading.Lock()
        self._open = True
        self._stopping = False

    @staticmethod
    def available() -> bool:
        return pycurl is not None

    async def get(self, transfer: Transfer) -> Transfer:
        """Run `transfer`; its results are set when this returns (error included)."""
        if self._thread is None and self._open:
            self._token = trio.lowlevel.current_trio_token()
            self._thread = threading.Thread(target=self._run, name="bucketfs-curl", daemon=True)
            self._thread.start()
        self._submit("add", transfer)
        try:
            await transfer.done.wait()
        except BaseException:
            # Cancelled: take the transfer back before its buffer is given up.
            self._submit("abort", transfer)
            with trio.CancelScope(shield=True):
                await transfer.done.wait()
            raise
        return transfer

    def close(self) -> None:
        """Stop the thread; transfers still running end with ConnectionError. Idempotent.
        (On the trio thread, as get(): the two never race for the eventfd.)"""
        self._stopping = True
        if self._thread is not None:
            os.eventfd_write(self._wake_fd, 1)
            self._thread.join()
            self._thread = None
        with self._lock:
            self._open = False
        if self._wake_fd >= 0:
            os.close(self._wake_fd)
            self._wake_fd = -1

    def _submit(self, what: str, transfer: Transfer) -> None:
        with self._lock:
            if not self._open:
                if what == "add":
                    raise ConnectionError("the HTTP engine is closed")
                return  # an abort after the end: every transfer has been handed back
            self._queue.append((what, transfer))
        os.eventfd_write(self._wake_fd, 1)

    # -- the engine's thread -------------------------------------------------------
    def _run(self) -> None:
        loop = CurlLoop(*self._loop_args)

        def take_queue() -> None:
            os.eventfd_read(self._wake_fd)
            aborted = []
            while self._queue:
                what, transfer = self._queue.popleft()
                if what == "add":
                    loop.add(transfer)
                elif loop.abort(transfer):
                    aborted.append(transfer)  # (its waiter is being cancelled: the error is never seen)
            self._deliver(aborted)

        try:
            loop.run(self._wake_fd, take_queue, self._deliver, lambda: self._stopping)
        except BaseException:  # noqa: BLE001 - the loop failed its transfers; say why, then fail the queue's
            log.exception("the curl thread stopped")
        finally:
            with self._lock:
                self._open = False
            while self._queue:
                what, transfer = self._queue.popleft()
                if what == "add":
                    transfer.error = ConnectionError("the HTTP engine is closed")
                    self._deliver([transfer])

    def _deliver(self, finished: list) -> None:
        if not finished:
            return
        assert self._token is not None  # (set before the thread that delivers starts)
        try:
            self._token.run_sync_soon(_set_done, finished)
        except trio.RunFinishedError:
            pass  # the daemon's trio loop is gone: nobody waits


def _set_done(transfers: list) -> None:
    for transfer in transfers:
        transfer.done.set()
