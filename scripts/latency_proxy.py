#!/usr/bin/env python3
"""A TCP-level HTTP proxy that makes a local S3 server look remote (for scripts/bench.py).

For every client connection it opens one connection to the upstream server and
forwards bytes both ways, with two effects on the upstream -> client direction:

- Time to first byte: once the client has sent a request, the first response chunk
  that comes back is held for `latency_s` before it is forwarded. Keep-alive
  connections (boto3 reuses them) pay it once per request, not once per connection:
  any client bytes mark the connection "awaiting first byte" again. (HTTP/1.1
  clients here do not pipeline, so a response never overlaps the next request.)
- Bandwidth: a token bucket paces each connection to `conn_bytes_per_s`, one S3
  connection's order of magnitude (~50-100 MB/s), with a burst of one chunk.

It also counts, per request, what the client asked for (the request line is parsed
from the client stream: GET of a key = GET, GET of a bucket = LIST, HEAD = HEAD)
and the bytes that came back (headers and bodies apart, and response statuses), so
a benchmark can report the requests and bytes a run cost, as the server saw them.

Efficiency (it shares a 2-core machine with what it measures): one thread per
direction per connection, blocking sockets, and the response bodies move with
splice(2) through a pipe, never through Python buffers; only the first chunk of each
response (its headers) is read into user space. The request direction is small.

Run it as its own process (`python scripts/latency_proxy.py --upstream URL`): it
prints `LISTENING http://127.0.0.1:PORT`, then answers `stats` on stdin with one JSON
line (and `mark TEXT` by writing TEXT into the --log request log), and exits on `quit` or when stdin closes (its parent died). `ProxyProcess` does
all that for a Python caller.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import Optional

CHUNK_BYTES = 256 * 1024  # bytes moved per syscall: big enough that per-chunk Python work is noise
PIPE_BYTES = 1024 * 1024  # the splice pipe: holds a whole chunk (default pipe capacity is 64 KiB)
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux; named in the fcntl module from Python 3.10
MAX_HEADER_BYTES = 64 * 1024  # a request head longer than this is not HTTP we understand: stop parsing


def classify_request(head: bytes) -> tuple:
    """(kind, content_length, range) of one request head (request line + headers, no blank line)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    method = parts[0].decode("latin-1", "replace").upper() or "?"
    target = parts[1].decode("latin-1", "replace") if len(parts) > 1 else ""
    content_length, byte_range = 0, ""
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                content_length = int(value.strip())
        elif name == b"range":
            byte_range = value.strip().decode("latin-1", "replace")
    kind = _kind(method, target)
    return kind, content_length, byte_range


def _kind(method: str, target: str) -> str:
    if method != "GET":
        return method
    split = urllib.parse.urlsplit(target)
    path, query = split.path, split.query
    segments = [s for s in path.split("/") if s]
    if not segments:
        return "LIST_BUCKETS"
    if len(segments) == 1:  # path-style: GET /bucket?... is a bucket operation
        params = urllib.parse.parse_qs(query, keep_blank_values=True)
        if not params or "list-type" in params or "prefix" in params or "delimiter" in params:
            return "LIST"
        return "GET_BUCKET_" + sorted(params)[0].upper()
    return "GET"


class Counters:
    """Totals over all connections; every update under one lock (a few per chunk at most)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = collections.Counter()
        self.statuses = collections.Counter()
        self.bytes_down = 0  # upstream -> client, headers included
        self.header_bytes_down = 0
        self.bytes_up = 0  # client -> upstream
        self.responses = 0
        self.connections_opened = 0
        self.connections_open = 0
        self.delayed_s = 0.0  # sum of first-byte delays
        self.paced_s = 0.0  # sum of bandwidth-cap sleeps

    def snapshot(self) -> dict:
        with self.lock:
            times = os.times()
            return {
                "requests": dict(self.requests),
                "statuses": dict(self.statuses),
                "bytes_down": self.bytes_down,
                "header_bytes_down": self.header_bytes_down,
                "body_bytes_down": self.bytes_down - self.header_bytes_down,
                "bytes_up": self.bytes_up,
                "responses": self.responses,
                "connections_opened": self.connections_opened,
                "connections_open": self.connections_open,
                "delayed_s": self.delayed_s,
                "paced_s": self.paced_s,
                "cpu_s": times.user + times.system,
            }


class Connection:
    def __init__(self, proxy: "Proxy", client: socket.socket):
        self.proxy = proxy
        self.client = client
        self.upstream = socket.create_connection(proxy.upstream_addr, timeout=10.0)
        self.upstream.settimeout(None)
        for sock in (self.client, self.upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Set (by the request thread, before it forwards a request) when the next
        # upstream bytes are the first of a response; cleared by the response thread.
        self.awaiting_first_byte = False
        self.conn_id = next(proxy.conn_ids)
        self.vtime_s = 0.0  # token bucket as virtual time: when the bytes sent so far are "paid"
        self._open_threads = 2
        self._lock = threading.Lock()

    def start(self) -> None:
        c = self.proxy.counters
        with c.lock:
            c.connections_opened += 1
            c.connections_open += 1
        threading.Thread(target=self._run, args=(self._requests,), daemon=True, name="proxy-up").start()
        threading.Thread(target=self._run, args=(self._responses,), daemon=True, name="proxy-down").start()

    def _run(self, pump) -> None:
        try:
            pump()
        except OSError:
            self.abort()  # a reset on one side: end both, so the other thread wakes up
        finally:
            with self._lock:
                self._open_threads -= 1
                last = self._open_threads == 0
            if last:
                self._close()

    def abort(self) -> None:
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _close(self) -> None:
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.close()
        c = self.proxy.counters
        with c.lock:
            c.connections_open -= 1
        self.proxy.forget(self)

    # -- client -> upstream: requests ------------------------------------------------
    def _requests(self) -> None:
        counters = self.proxy.counters
        parser = RequestParser(self.proxy.log_request, self.conn_id)
        while True:
            data = self.client.recv(CHUNK_BYTES)
            if not data:
                with contextlib.suppress(OSError):
                    self.upstream.shutdown(socket.SHUT_WR)
                return
            kinds = parser.feed(data)
            with counters.lock:
                counters.bytes_up += len(data)
                for kind in kinds:
                    counters.requests[kind] += 1
            self.awaiting_first_byte = True  # before forwarding: no response can precede it
            self.upstream.sendall(data)

    # -- upstream -> client: responses -----------------------------------------------
    def _responses(self) -> None:
        counters = self.proxy.counters
        latency_s = self.proxy.latency_s
        rate = self.proxy.conn_bytes_per_s
        up_fd, client_fd = self.upstream.fileno(), self.client.fileno()
        pipe_r, pipe_w = os.pipe()
        try:
            with contextlib.suppress(OSError):
                fcntl.fcntl(pipe_w, F_SETPIPE_SZ, PIPE_BYTES)
            while True:
                n = os.splice(up_fd, pipe_w, CHUNK_BYTES)  # blocks until upstream sends
                if n == 0:
                    with contextlib.suppress(OSError):
                        self.client.shutdown(socket.SHUT_WR)
                    return
                if self.awaiting_first_byte:
                    # The first bytes of a response: hold them for the latency, and read them
                    # (into user space, this once) to count the status and the header bytes.
                    self.awaiting_first_byte = False
                    data = _read_exactly(pipe_r, n)
                    if latency_s > 0:
                        time.sleep(latency_s)
                    end = data.find(b"\r\n\r\n")
                    header_bytes = end + 4 if end >= 0 else len(data)
                    status = data[9:12].decode("latin-1", "replace") if data.startswith(b"HTTP/") else "?"
                    with counters.lock:
                        counters.responses += 1
                        counters.statuses[status] += 1
                        counters.header_bytes_down += header_bytes
                        counters.bytes_down += n
                        counters.delayed_s += latency_s
                    self._pace(n, rate, counters)
                    self.client.sendall(data)
                else:
                    with counters.lock:
                        counters.bytes_down += n
                    self._pace(n, rate, counters)
                    while n:
                        n -= os.splice(pipe_r, client_fd, n)
        finally:
            os.close(pipe_r)
            os.close(pipe_w)

    def _pace(self, n: int, rate: Optional[float], counters: Counters) -> None:
        """Token bucket: sleep until `n` more bytes fit under `rate`, one chunk of burst."""
        if not rate:
            return
        now = time.monotonic()
        self.vtime_s = max(self.vtime_s, now - CHUNK_BYTES / rate) + n / rate
        wait_s = self.vtime_s - now
        if wait_s > 0:
            time.sleep(wait_s)
            with counters.lock:
                counters.paced_s += wait_s


def _read_exactly(fd: int, n: int) -> bytes:
    data = os.read(fd, n)
    if len(data) == n:
        return data
    pieces = [data]
    n -= len(data)
    while n:
        piece = os.read(fd, n)
        pieces.append(piece)
        n -= len(piece)
    return b"".join(pieces)


class RequestParser:
    """Finds request heads in a client byte stream (skipping Content-Length bodies)."""

    def __init__(self, log=None, conn_id: int = 0):
        self.head = bytearray()
        self.body_left = 0
        self.parsing = True
        self.log, self.conn_id = log, conn_id  # log(line): one line per request, if given

    def feed(self, data: bytes) -> list:
        kinds = []
        view, i = memoryview(data), 0
        while self.parsing and i < len(data):
            if self.body_left:
                taken = min(self.body_left, len(data) - i)
                self.body_left -= taken
                i += taken
                continue
            start = max(len(self.head) - 3, 0)
            self.head += view[i:]
            i = len(data)
            end = self.head.find(b"\r\n\r\n", start)
            if end < 0:
                if len(self.head) > MAX_HEADER_BYTES:
                    self.parsing = False  # not HTTP we understand: forward, stop counting
                    kinds.append("UNPARSED")
                break
            head = bytes(self.head[:end])
            kind, self.body_left, byte_range = classify_request(head)
            kinds.append(kind)
            if self.log is not None:
                self.log(
                    f"{time.monotonic():.6f} {self.conn_id} {kind} {head.split(b' ', 2)[1].decode('latin-1', 'replace')} {byte_range or '-'}"
                )
            rest = bytes(self.head[end + 4 :])
            self.head = bytearray()
            view, i, data = memoryview(rest), 0, rest
        return kinds


class Proxy:
    """Listens on `host:port` (0: a free port) and proxies to `upstream_url`."""

    def __init__(
        self,
        upstream_url: str,
        latency_s: float,
        conn_bytes_per_s: Optional[float],
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: Optional[str] = None,
    ):
        parsed = urllib.parse.urlsplit(upstream_url)
        self.upstream_addr = (parsed.hostname, parsed.port or 80)
        self.latency_s = latency_s
        self.conn_bytes_per_s = conn_bytes_per_s or None
        self.counters = Counters()
        self.listener = socket.create_server((host, port), backlog=256)
        self.host, self.port = self.listener.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._connections: set = set()
        self._lock = threading.Lock()
        self._closed = False
        self.conn_ids = itertools.count(1)
        self._log_file = open(log_path, "a", buffering=1) if log_path else None
        self.log_request = self._log if self._log_file else None

    def _log(self, line: str) -> None:
        with self._lock:
            self._log_file.write(line + "\n")

    def serve_in_thread(self) -> None:
        threading.Thread(target=self._accept_loop, daemon=True, name="proxy-accept").start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # the listener was closed
            try:
                conn = Connection(self, client)
            except OSError:
                client.close()  # upstream refused: the client sees a reset, as it would
                continue
            with self._lock:
                self._connections.add(conn)
            conn.start()

    def forget(self, conn: Connection) -> None:
        with self._lock:
            self._connections.discard(conn)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            conn.abort()
        if self._log_file is not None:
            with self._lock:
                self._log_file.close()
                self._log_file = None
                self.log_request = None


class ProxyProcess:
    """Runs this module as a child process and talks to it over its stdin/stdout."""

    def __init__(
        self,
        upstream_url: str,
        latency_ms: float,
        conn_mbps: float,
        start_deadline_s: float = 10.0,
        log_path: Optional[str] = None,
    ):
        argv = [
            sys.executable,
            os.path.abspath(__file__),
            "--upstream",
            upstream_url,
            "--latency-ms",
            str(latency_ms),
            "--conn-mbps",
            str(conn_mbps),
        ]
        if log_path:
            argv += ["--log", log_path]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent
        )
        self.pid = self.proc.pid
        self._lock = threading.Lock()
        line = _readline_with_deadline(self.proc, start_deadline_s)
        if not line.startswith("LISTENING "):
            self.close()
            raise RuntimeError(f"latency proxy did not start: {line!r}")
        self.url = line.split(" ", 1)[1].strip()

    def stats(self) -> dict:
        with self._lock:
            self.proc.stdin.write("stats\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())

    def mark(self, text: str) -> None:
        """Write `text` into the request log (if any), between requests of different runs."""
        with self._lock:
            self.proc.stdin.write("mark " + text.replace("\n", " ") + "\n")
            self.proc.stdin.flush()
            self.proc.stdout.readline()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                stream.close()

    def __enter__(self) -> "ProxyProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _readline_with_deadline(proc: subprocess.Popen, deadline_s: float) -> str:
    result: list = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(deadline_s)
    return result[0] if result else ""


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux), so no proxy outlives it."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="http://HOST:PORT of the real server")
    parser.add_argument(
        "--latency-ms", type=float, default=20.0, help="delay of each response's first byte (default 20)"
    )
    parser.add_argument(
        "--conn-mbps", type=float, default=100.0, help="per-connection cap in MB/s (10^6 bytes); 0 = none (default 100)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 (default): a free port")
    parser.add_argument("--log", help="append one line per request: monotonic time, connection, kind, target, range")
    args = parser.parse_args(argv)
    proxy = Proxy(args.upstream, args.latency_ms / 1000.0, args.conn_mbps * 1e6, args.host, args.port, args.log)
    proxy.serve_in_thread()
    print(f"LISTENING {proxy.url}", flush=True)
    try:
        for line in sys.stdin:
            command = line.strip()
            if command == "stats":
                print(json.dumps(proxy.counters.snapshot()), flush=True)
            elif command.startswith("mark "):  # a line in the request log, e.g. where a run starts
                if proxy.log_request is not None:
                    proxy.log_request(f"{time.monotonic():.6f} # {command[5:]}")
                print("ok", flush=True)
            elif command == "quit":
                break
    except KeyboardInterrupt:
        pass
    finally:
        proxy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
