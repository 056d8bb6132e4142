"""A real HTTP server whose answers come from a requests transport adapter.

The GCS tests shape the emulator's answers with adapters (GCSLikeAdapter: pages and
generations as GCS serves them; fault adapters). Mounted on the backend's requests
session they reach only the library's path; the backend's small GETs go through
curl_engine, which speaks HTTP itself. Served by this front, the same adapters answer
both paths, over a real socket.

An adapter's ConnectionError becomes a connection closed without an answer (what a
reset looks like to a client); a body shorter than the Content-Length an adapter set
is sent as it is, and the connection closed.
"""

from __future__ import annotations

import contextlib
import http.server
import threading
from typing import Iterator

import requests

# Hop-by-hop or recomputed: the rest of an adapter's headers are sent as they are.
_NOT_FORWARDED = frozenset({"connection", "transfer-encoding", "content-length", "keep-alive", "host"})


def _raw_body(response: requests.Response) -> bytes:
    """The body as the adapter's raw stream holds it (never decoded: a gzip-encoded
    object is served as stored)."""
    if response._content is not False:  # an adapter read it and set its own (a cut listing page)
        return response._content
    raw = response.raw
    try:
        return raw.read(decode_content=False)
    except TypeError:  # an io.BytesIO standing in for a transport's stream
        return raw.read()


@contextlib.contextmanager
def adapter_front(adapter: requests.adapters.BaseAdapter, upstream_url: str) -> Iterator[str]:
    """`with adapter_front(adapter, upstream) as url:` an http:// URL on 127.0.0.1 that
    answers every request as `adapter` answers it, sent on to `upstream`."""
    upstream_url = upstream_url.rstrip("/")
    session = requests.Session()
    session.trust_env = False  # (no proxy from the environment between the front and the server)
    session.mount(upstream_url, adapter)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args) -> None:
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {name: value for name, value in self.headers.items() if name.lower() not in _NOT_FORWARDED}
            try:
                response = session.request(self.command, upstream_url + self.path, headers=headers, data=body,
                                           stream=True, timeout=30, allow_redirects=False)
            except requests.ConnectionError:
                self.close_connection = True
                return
            payload = _raw_body(response)
            declared = int(response.headers.get("Content-Length", len(payload)))
            self.send_response(response.status_code, response.reason)
            for name, value in response.headers.items():
                if name.lower() not in _NOT_FORWARDED:
                    self.send_header(name, value)
            self.send_header("Content-Length", str(declared))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload[:declared])
            if len(payload) < declared:
                self.close_connection = True

        do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="http-front", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
        session.close()
