"""A tiny HTTP proxy that counts requests on their way to a local S3 server.

The mount talks to the proxy (`--endpoint-url proxy.url`); the proxy forwards every
request unchanged (the Host header too, so SigV4 signatures still verify) and records
`(method, path, query)`. That lets a test count what the mount really asked the
store for, from outside the mount, e.g. "the second epoch made no GETs".

Responses are read whole and re-sent with a Content-Length: fine for test datasets of
a few MB, not a general-purpose proxy. A subclass may answer otherwise (`answer`:
bucketfs/testing/fault_proxy.py breaks some answers).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import sys
import threading
import urllib.parse
from typing import Iterator, List, NamedTuple, Optional

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


class Request(NamedTuple):
    method: str
    path: str  # URL path, percent-decoded: /bucket/key
    query: str

    @property
    def is_object_get(self) -> bool:
        """A GET of one object (not a LIST, which is a GET on the bucket with a query)."""
        return self.method == "GET" and self.path.count("/") >= 2 and not self.path.endswith("/")


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    # socketserver listens with a backlog of 5: a burst of new connections (a
    # fetch-ahead pass opens hundreds) had most handshakes dropped, and a GET sent on
    # such a connection waited out --read-timeout: the proxy's artefact, not a store's.
    request_queue_size = 1024

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # the client hung up (a cancelled read): nothing to report
        super().handle_error(request, client_address)


class CountingProxy:
    def __init__(self, upstream_url: str):
        parsed = urllib.parse.urlsplit(upstream_url)
        self.upstream = (parsed.hostname, parsed.port)
        self._lock = threading.Lock()
        self._requests: List[Request] = []
        self._server = _Server(("127.0.0.1", 0), self._handler_class())
        self._thread: Optional[threading.Thread] = None
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def requests(self) -> List[Request]:
        with self._lock:
            return list(self._requests)

    def object_gets(self) -> List[Request]:
        return [r for r in self.requests if r.is_object_get]

    def _record(self, request: Request) -> None:
        with self._lock:
            self._requests.append(request)

    def _handler_class(self):
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like a real S3 endpoint

            def log_message(self, *args):  # no access log on stderr
                pass

            def _forward(self):
                split = urllib.parse.urlsplit(self.path)
                proxy._record(Request(self.command, urllib.parse.unquote(split.path), split.query))
                proxy.answer(self)

            def request_body(self):
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else None

            def forwarded_headers(self) -> dict:
                return {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}

            def relay(self) -> tuple:
                """(response, body) of this request, asked of the upstream server."""
                body, headers = self.request_body(), self.forwarded_headers()
                upstream: Optional[http.client.HTTPConnection] = getattr(self, "_upstream", None)
                if upstream is None:
                    host, port = proxy.upstream
                    upstream = self._upstream = http.client.HTTPConnection(host, port, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    return response, response.read()
                except (OSError, http.client.HTTPException):
                    upstream.close()
                    del self._upstream
                    raise

            def send_head(self, response, data: bytes, headers=None) -> None:
                """The upstream's status and headers (or `headers`), with the Content-Length of `data`."""
                # HEAD: the object's length as the server gave it; else the body we relay.
                self.send_answer_head(
                    response.status,
                    response.reason,
                    response.getheaders() if headers is None else headers,
                    response.getheader("Content-Length", "0") if self.command == "HEAD" else len(data),
                )

            def send_answer_head(self, status: int, reason: str, headers, content_length) -> None:
                """A status line and `headers` (pairs; hop-by-hop ones and any length left
                out), with this Content-Length."""
                self.send_response_only(status, reason)
                for key, value in headers:
                    if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(content_length))
                self.end_headers()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

            def finish(self):
                super().finish()
                upstream = getattr(self, "_upstream", None)
                if upstream is not None:
                    upstream.close()

        return Handler

    def answer(self, handler) -> None:
        """Answer one request (a subclass may answer otherwise): relayed, as `relayed` has it."""
        response, data = handler.relay()
        headers, data = self.relayed(handler, response, data)
        handler.send_head(response, data, headers)
        if handler.command != "HEAD":
            handler.wfile.write(data)

    def relayed(self, handler, response, data: bytes) -> tuple:
        """(headers, body) relayed for the upstream's answer: unchanged (a subclass may
        change them)."""
        return response.getheaders(), data

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, name="counting-proxy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)


@contextlib.contextmanager
def counting_proxy(upstream_url: str) -> Iterator[CountingProxy]:
    proxy = CountingProxy(upstream_url)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
