"""A real HTTP server whose answers come from a requests transport adapter.

The GCS tests shape the emulator's answers with adapters (GCSLikeAdapter: pages and
generations as GCS serves them; fault adapters). Mounted on the backend's requests
session they reach only the library's path; the backend's small GETs go through
backends/http/curl.py, which speaks HTTP itself. Served by this front, the same
adapters answer both paths, over a real socket.

An adapter's ConnectionError becomes a connection closed without an answer (what a
reset looks like to a client); a body shorter than the Content-Length an adapter set
is sent as it is, and the connection closed. The server is bucketfs/testing/counting_proxy.py's,
with its answer taken from the adapter instead of relayed.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import requests

from bucketfs.testing.counting_proxy import CountingProxy


def _raw_body(response: requests.Response) -> bytes:
    """The body as the adapter's raw stream holds it (never decoded: a gzip-encoded
    object is served as stored)."""
    if response._content is not False:  # an adapter read it and set its own (a cut listing page)
        return response._content or b""
    raw = response.raw
    try:
        return raw.read(decode_content=False)
    except TypeError:  # an io.BytesIO standing in for a transport's stream
        return raw.read()


class AdapterFront(CountingProxy):
    """Answers every request as `adapter` answers it, sent on to `upstream_url`."""

    def __init__(self, adapter: requests.adapters.BaseAdapter, upstream_url: str):
        super().__init__(upstream_url)
        self.upstream_url = upstream_url.rstrip("/")
        self.session = requests.Session()
        self.session.trust_env = False  # (no proxy from the environment between the front and the server)
        self.session.mount(self.upstream_url, adapter)

    def answer(self, handler) -> None:
        # Host: requests sets the upstream's own.
        headers = {k: v for k, v in handler.forwarded_headers().items() if k.lower() != "host"}
        try:
            response = self.session.request(
                handler.command,
                self.upstream_url + handler.path,
                headers=headers,
                data=handler.request_body(),
                stream=True,
                timeout=30,
                allow_redirects=False,
            )
        except requests.ConnectionError:
            handler.close_connection = True
            return
        payload = _raw_body(response)
        declared = int(response.headers.get("Content-Length", len(payload)))
        handler.send_answer_head(response.status_code, response.reason, response.headers.items(), declared)
        if handler.command != "HEAD":
            handler.wfile.write(payload[:declared])
        if len(payload) < declared:
            handler.close_connection = True


@contextlib.contextmanager
def adapter_front(adapter: requests.adapters.BaseAdapter, upstream_url: str) -> Iterator[str]:
    """`with adapter_front(adapter, upstream) as url:` an http:// URL on 127.0.0.1 that
    answers every request as `adapter` answers it, sent on to `upstream`."""
    front = AdapterFront(adapter, upstream_url)
    front.start()
    try:
        yield front.url
    finally:
        front.stop()
        front.session.close()
