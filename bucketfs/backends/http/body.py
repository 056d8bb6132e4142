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

import email.utils
import time
from typing import Optional

# A body must keep arriving. The socket's read timeout bounds each wait for bytes, not
# a body that trickles in (a byte every few seconds held a reader for hours, past
# --read-timeout x --retries). An attempt gets the read timeout plus its body at this
# rate, then it is cut and retried: 8 MiB may take 2 min, far below any store's pace.
MIN_BODY_RATE_BYTES_PER_S = 64 * 1024
# read1's most per receive: a receive returns what the socket has, usually far less.
READ1_MAX_BYTES = 1 << 20


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
