"""Receiving an HTTP body: bounded in time, never decoded, only the range asked for.

Used by the S3 and GCS backends on their urllib3 and requests paths (s3_lean.py,
s3.py, gcs.py) and by the curl engine (curl.py) for its deadlines.

Invariants:
- A body must keep arriving: an attempt gets the read timeout plus its body at
  MIN_BODY_RATE_BYTES_PER_S (body_deadline_s), then it is cut (TimeoutError) and the
  caller retries it.
- Bytes are returned as stored (decode_content=False): the checks of an answer
  (checksums, Content-Range) see what the store sent. A body shorter than its
  Content-Length raises, as urllib3 does.
- A connection whose body was not read to its end is closed, never handed back to
  its pool half read.
- A server that ignores Range and sends the whole object costs memory for the range
  only: the bytes before it are dropped as they arrive, and reading stops at its end.
"""

from __future__ import annotations

import contextlib
import email.utils
import socket
import time
from typing import Any, Optional

import urllib3

# A body must keep arriving. The socket's read timeout bounds each wait for bytes, not
# a body that trickles in (a byte every few seconds held a reader for hours, past
# --read-timeout x --retries). An attempt gets the read timeout plus its body at this
# rate, then it is cut and retried: 8 MiB may take 2 min, far below any store's pace.
MIN_BODY_RATE_BYTES_PER_S = 64 * 1024
# read1's most per receive: a receive returns what the socket has, usually far less.
READ1_MAX_BYTES = 1 << 20
# receive_into wakes for this much at a time (SO_RCVLOWAT), not for every segment: a
# receiving thread then takes the GIL once per MiB rather than per ~200 KiB, and its
# CPU per MiB received fell by a third (0.29-0.34 against 0.43-0.45 ms: 8 threads
# receiving 64 MB objects through the bench's proxy, ad hoc).
RECEIVE_LOW_WATER_BYTES = 1 << 20
# What the socket's buffered reader may hold of a body (its buffer, 8 KiB in
# http.client), with margin: a receive waits for no more than the body's rest less
# this, since those bytes may never come through the socket again.
READER_HOLDS_BYTES_MAX = 64 * 1024


def body_deadline_s(read_timeout_s: float, body_bytes: int) -> float:
    """When (time.monotonic) an attempt receiving `body_bytes` is given up."""
    return time.monotonic() + read_timeout_s + body_bytes / MIN_BODY_RATE_BYTES_PER_S


def read_body(response, deadline_s: float, start: int = 0, end: Optional[int] = None) -> bytes:
    """The body's bytes `[start, end)` as stored (never decoded; by default all of it),
    received one socket read at a time; TimeoutError past `deadline_s` (the connection
    is closed, never handed back half read). A body shorter than its length raises as
    urllib3 does. With `end`, for a server that ignored Range and sends the whole
    object: what comes before `start` is dropped as it arrives, and reading stops at
    `end` and closes the connection, so a small read of a huge object holds only its
    range in memory."""
    chunks = []
    offset_bytes = 0
    try:
        while end is None or offset_bytes < end:
            chunk = response.read1(READ1_MAX_BYTES, decode_content=False)
            if not chunk:
                break
            # (The whole chunk, the common case, is the same object: no copy.)
            piece = chunk[max(start - offset_bytes, 0) : None if end is None else end - offset_bytes]
            if piece:
                chunks.append(piece)
            offset_bytes += len(chunk)
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"body still arriving at its deadline ({offset_bytes} bytes)")
    except BaseException:
        response.close()
        raise
    if end is not None:
        response.close()  # the rest of the body was not read: the connection is spent
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_range_body(response, read_timeout_s: float, start: int, end: int, whole_object: bool) -> bytes:
    """A ranged GET's body, `[start, end)`. `whole_object`: the server ignored Range (a
    200 without Content-Range) and sends the whole object, of which only the range is
    kept (read_body)."""
    if whole_object:
        return read_body(response, body_deadline_s(read_timeout_s, end), start, end)
    return read_body(response, body_deadline_s(read_timeout_s, end - start))


def receive_into(response, buffer: bytearray, deadline_s: float, read_timeout_s: float) -> int:
    """A urllib3 response's body received straight into `buffer`; its length.
    urllib3's own readinto reads into a temporary bytes object and copies it; the
    socket reader under http.client's response receives into the buffer itself, one
    receive at a time (readinto1) so that a body trickling in meets `deadline_s`
    (read_body). On a plain TCP socket each receive waits for up to
    RECEIVE_LOW_WATER_BYTES: never more than the body's rest less what the reader may
    already hold, nor more than half what the slowest body allowed delivers in
    `read_timeout_s` (a stall is still timed as one); the socket is set back before
    the connection serves another request."""
    raw: Any = getattr(response, "_fp", None)  # http.client's response
    stream: Any = getattr(raw, "fp", None)  # its socket's buffered reader
    length = getattr(response, "length_remaining", None)
    if length is None or length > len(buffer) or getattr(raw, "chunked", True) or not hasattr(stream, "readinto1"):
        data = read_body(response, deadline_s)
        if len(data) > len(buffer):
            raise urllib3.exceptions.ProtocolError(f"a {len(data)}-byte body for a {len(buffer)}-byte range")
        return copy_into(buffer, data)
    sock = getattr(getattr(stream, "raw", None), "_sock", None)
    if type(sock) is not socket.socket:  # TLS (its records decide each receive) or unknown: as it comes
        sock = None
    low_water_max = min(RECEIVE_LOW_WATER_BYTES, int(read_timeout_s * MIN_BODY_RATE_BYTES_PER_S / 2))
    low_water = 1  # the socket's default
    view = memoryview(buffer)
    got = 0
    try:
        while got < length:
            if sock is not None:
                wanted = min(length - got - READER_HOLDS_BYTES_MAX, low_water_max)
                wanted = wanted if wanted > READER_HOLDS_BYTES_MAX else 1
                if wanted != low_water:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
                    low_water = wanted
            n = stream.readinto1(view[got:length])
            if not n:
                raise urllib3.exceptions.IncompleteRead(got, length - got)
            got += n
            if got < length and time.monotonic() > deadline_s:
                raise TimeoutError(f"body still arriving at its deadline ({got} of {length} bytes)")
        if sock is not None and low_water != 1:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)  # the next answer's head comes as it comes
    except BaseException:
        with contextlib.suppress(OSError):
            response.close()  # never hand a half-read connection back to the pool
        raise
    raw.close()  # (what http.client does at a body's end: its connection may serve the next request)
    return got


def copy_into(buffer: bytearray, data: bytes) -> int:
    """`data` written at the start of `buffer`; its length (read_range_into's answer)."""
    buffer[: len(data)] = data
    return len(data)


def http_date_s(text: Optional[str]) -> Optional[int]:
    """Seconds since the epoch of an HTTP date (Last-Modified), or None."""
    if not text:
        return None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    return int(when.timestamp())
