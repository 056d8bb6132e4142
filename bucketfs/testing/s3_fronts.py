"""HTTP fronts before a local S3 server that answer as other S3-compatible stores do.

Each is a CountingProxy (bucketfs/testing/counting_proxy.py): it relays requests to the real
server (rclone or moto) with their Host header unchanged, so signatures verify, and
changes the answers:
- RewritingFront: no ETag at all, in listings (`<ETag>` elements) or answers (ETag
  headers), as stores that do not state one; and/or every listed LastModified the
  epoch (AIStore lists the access time, zero for objects never read).
- RedirectFront: object GETs are answered 307 with a Location on the server itself
  (as AIStore's gateways send a read to the target that holds the object); a client
  must sign again for that host, or the server refuses it. `loop=True` sends every
  GET back to the front, forever; `target_url` sends them elsewhere (a closed port).
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator, Optional

from bucketfs.testing.counting_proxy import CountingProxy

_ETAG_ELEMENT_RE = re.compile(rb"<ETag>[^<]*</ETag>")
_LAST_MODIFIED_RE = re.compile(rb"<LastModified>[^<]*</LastModified>")
EPOCH_LISTED = b"<LastModified>1970-01-01T00:00:00.000Z</LastModified>"


class RewritingFront(CountingProxy):
    """`strip_etags`: no ETag headers or elements; `epoch_times`: every listed
    LastModified is the epoch."""

    def __init__(self, upstream_url: str, strip_etags: bool = False, epoch_times: bool = False):
        super().__init__(upstream_url)
        self.strip_etags, self.epoch_times = strip_etags, epoch_times

    def relayed(self, handler, response, data: bytes) -> tuple:
        headers = response.getheaders()
        if self.strip_etags:
            headers = [(name, value) for name, value in headers if name.lower() != "etag"]
            data = _ETAG_ELEMENT_RE.sub(b"", data) if b"<ListBucketResult" in data[:400] else data
        if self.epoch_times and b"<ListBucketResult" in data[:400]:
            data = _LAST_MODIFIED_RE.sub(EPOCH_LISTED, data)
        return headers, data


class RedirectFront(CountingProxy):
    """Object GETs: 307 to the same path (and a query of its own, as AIStore adds) on
    `target_url` (default: the server behind); everything else is relayed."""

    def __init__(self, upstream_url: str, target_url: Optional[str] = None, loop: bool = False):
        super().__init__(upstream_url)
        self.target_url = (target_url or upstream_url).rstrip("/")
        self.loop = loop
        self.redirects_sent = 0

    def answer(self, handler) -> None:
        path = handler.path.partition("?")[0]
        if handler.command != "GET" or path.count("/") < 2 or path.endswith("/"):  # not an object GET
            super().answer(handler)
            return
        self.redirects_sent += 1
        target = self.url if self.loop else self.target_url
        # (A query the server ignores, signed like any other: AIStore's redirects carry one.)
        location = f"{target}{path}?bucketfs-hop=gateway%2F1"
        handler.request_body()
        handler.send_answer_head(307, "Temporary Redirect", [("Location", location)], 0)


@contextlib.contextmanager
def started(front: CountingProxy) -> Iterator[CountingProxy]:
    """`front` serving until the block ends."""
    front.start()
    try:
        yield front
    finally:
        front.stop()
