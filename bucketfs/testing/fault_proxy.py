"""An HTTP proxy in front of a local store (S3, or the GCS emulator) that breaks some answers.

While `faulty` is set, each GET (object reads and LISTs alike) is, with probability
`fault_rate` (a seeded draw), answered by one of the ways a real store or network
path fails (`FAULT_KINDS`), taken in turn, so any six faults include every kind:

- `slowdown`: 503 SlowDown, the throttling answer S3 gives under load;
- `internal`: 500 InternalError;
- `reset-mid-body`: the real status and headers (Content-Length included), part of
  the body, then a TCP reset;
- `cut-mid-body`: the same, then an orderly close (FIN): a body shorter than its
  Content-Length, which a client that does not check lengths takes for the whole;
- `reset-before-answer`: the request is read, then a reset, no answer at all;
- `stall`: nothing for `stall_s` (longer than the mount's --read-timeout), then a close.

Asked for by name only (`kinds`), not among FAULT_KINDS:
- `flip`: an object GET's answer relayed whole, with one bit of its body flipped (the
  right length, wrong bytes: only a checksum catches it). A proxy given this kind
  breaks object GETs only (those with a Range header): listings are left alone.

`goog_hash` adds to whole-object answers the `x-goog-hash` header GCS sends (CRC32C and
MD5 of the bytes, computed before any damage), which the GCS emulator leaves out.
`delay_s` holds every GET that long first (a slow store, faults or not).
Everything else is relayed unchanged, and every request is counted, by
bucketfs/testing/counting_proxy.py.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import hashlib
import random
import socket
import struct
import threading
import time
from typing import Iterator

import google_crc32c

from bucketfs.testing.counting_proxy import CountingProxy

FAULT_KINDS = ("slowdown", "internal", "reset-mid-body", "cut-mid-body", "reset-before-answer", "stall")
_ERROR_ANSWERS = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "internal": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
}


class FaultProxy(CountingProxy):
    def __init__(
        self,
        upstream_url: str,
        fault_rate: float,
        seed: int,
        stall_s: float,
        delay_s: float = 0.0,
        kinds: tuple = FAULT_KINDS,
        goog_hash: bool = False,
    ):
        super().__init__(upstream_url)
        self.fault_rate, self.stall_s, self.delay_s = fault_rate, stall_s, delay_s
        self.kinds, self.goog_hash = kinds, goog_hash
        self.faulty = threading.Event()  # set: break answers; clear: relay everything
        self.injected: collections.Counter = collections.Counter()  # fault kind -> times injected
        self._rng = random.Random(seed)
        self._draw_lock = threading.Lock()

    def _draw(self) -> tuple:
        """(fault kind or None, where a body is cut as a fraction of it), under a lock so
        the draws depend on the seed and the order of requests only."""
        with self._draw_lock:
            kind = None
            if self.faulty.is_set() and self._rng.random() < self.fault_rate:
                kind = self.kinds[sum(self.injected.values()) % len(self.kinds)]
                self.injected[kind] += 1
            return kind, self._rng.random()

    def answer(self, handler) -> None:
        breakable = handler.command == "GET" and ("flip" not in self.kinds or "Range" in handler.headers)
        kind, handler.cut_fraction = self._draw() if breakable else (None, 0.0)
        handler.flip = kind == "flip"
        if self.delay_s and handler.command == "GET":
            time.sleep(self.delay_s)  # a slow store: requests stay in flight for a while
        if kind is None or kind == "flip":
            super().answer(handler)  # (relayed, through `relayed`)
        elif kind == "stall":
            time.sleep(self.stall_s)  # the fault itself: a server that says nothing
            handler.close_connection = True
        elif kind == "reset-before-answer":
            _reset(handler)
        elif kind in _ERROR_ANSWERS:
            _error_answer(handler, *_ERROR_ANSWERS[kind])
        else:  # a body cut short
            response, data = handler.relay()
            handler.send_head(response, data)
            handler.wfile.write(data[: int(len(data) * handler.cut_fraction)])
            if kind == "reset-mid-body":
                _reset(handler)
            handler.close_connection = True

    def relayed(self, handler, response, data: bytes) -> tuple:
        """With `goog_hash`, GCS's x-goog-hash of a whole object's bytes; for a `flip`,
        one bit of the body flipped after that."""
        headers = response.getheaders()
        if (
            self.goog_hash
            and handler.command == "GET"
            and "Range" in handler.headers
            and response.status in (200, 206)
            and _is_whole(response, data)
        ):
            headers += [
                ("x-goog-hash", f"crc32c={_b64(_crc32c(data))}"),
                ("x-goog-hash", f"md5={_b64(hashlib.md5(data).digest())}"),
            ]
        if handler.flip and data:
            at = int(len(data) * handler.cut_fraction)
            data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]
        return headers, data


def _is_whole(response, data: bytes) -> bool:
    """The answer's body is the whole object (a 200, or a range that covers it all)."""
    content_range = response.getheader("Content-Range")
    return not content_range or content_range.rpartition("/")[2] == str(len(data))


def _crc32c(data: bytes) -> bytes:
    return google_crc32c.value(data).to_bytes(4, "big")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _reset(handler) -> None:
    """End the connection with a TCP reset (SO_LINGER 0) rather than a FIN."""
    handler.wfile.flush()
    handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    handler.close_connection = True


def _error_answer(handler, status: int, reason: str, code: str, message: str) -> None:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>'
    ).encode()
    handler.send_answer_head(status, reason, [("Content-Type", "application/xml")], len(body))
    handler.wfile.write(body)


@contextlib.contextmanager
def fault_proxy(
    upstream_url: str,
    fault_rate: float = 0.0,
    seed: int = 0,
    stall_s: float = 0.0,
    delay_s: float = 0.0,
    kinds: tuple = FAULT_KINDS,
    goog_hash: bool = False,
) -> Iterator[FaultProxy]:
    """A running FaultProxy (faults off until `proxy.faulty.set()`); always stopped."""
    proxy = FaultProxy(upstream_url, fault_rate, seed, stall_s, delay_s, kinds, goog_hash)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
