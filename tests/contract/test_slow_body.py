"""A store that sends its body slower than any store does (a byte now and then, never
silent for a whole read timeout) must not hold a reader past its bound: each attempt
is cut at its deadline (body.body_deadline_s) and retried, then the read fails.

The store here is a socket server on 127.0.0.1 that answers every request with a
206 and trickles the body: the socket read timeout alone never fires on it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import boto3
import pytest
import trio

from bucketfs import errors
from bucketfs.backends.gcs import GCSBackend
from bucketfs.backends.http import body
from bucketfs.backends.s3 import S3Backend
from bucketfs.config import BucketURL, Config
from bucketfs.testing.servers import sdk_only, without_curl

pytestmark = pytest.mark.timeout(60)

BODY_BYTES = 2000
TRICKLE_GAP_S = 0.05  # a byte every 50 ms: 100 s for the body, never a 1 s silence
READ_TIMEOUT_S = 1.0
ATTEMPTS_COUNT = 2
KINDS = ["s3-curl", "s3-lean", "s3-lean-into", "s3-sdk", "gcs-curl", "gcs-threads"]


def trickle_until_hung_up(conn, stop: threading.Event, hung_up: threading.Event) -> None:
    """Send a byte now and then (a body that never ends) until the client hangs up
    (then set `hung_up`) or the server stops."""
    while not stop.wait(0.05):
        try:
            conn.send(b"x")
        except OSError:
            hung_up.set()
            return


@contextlib.contextmanager
def socket_store(respond):
    """(endpoint URL, request lines answered) of a server on 127.0.0.1 that reads each
    request and calls `respond(conn, number of requests so far, stop event)`."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    answered = []

    def answer(conn):
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                request += chunk
            answered.append(request.split(b"\r\n", 1)[0])
            respond(conn, len(answered), stop)

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", answered
    finally:
        stop.set()
        listener.close()


def _headers(sent_bytes: int) -> bytes:
    return (
        "HTTP/1.1 206 Partial Content\r\n"
        f"Content-Length: {sent_bytes}\r\nContent-Range: bytes 0-{sent_bytes - 1}/{BODY_BYTES}\r\n"
        'ETag: "v1"\r\nx-goog-generation: 1\r\nContent-Type: application/octet-stream\r\n\r\n'
    ).encode()


def trickling_store():
    """A server that answers every request with a 206 and trickles the body."""

    def respond(conn, _count, stop):
        conn.sendall(_headers(BODY_BYTES))
        for _ in range(BODY_BYTES):
            if stop.wait(TRICKLE_GAP_S):
                return
            try:
                conn.sendall(b"x")
            except OSError:
                return  # the client gave up on this attempt

    return socket_store(respond)


def _config(scheme: str, endpoint: str) -> Config:
    return Config(
        url=BucketURL(scheme, "bucket", ""),
        mountpoint="/nonexistent",
        endpoint_url=endpoint,
        region="us-east-1" if scheme == "s3" else None,
        read_timeout_s=READ_TIMEOUT_S,
        connect_timeout_s=2.0,
        retry_attempts_count=ATTEMPTS_COUNT,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.05,
    )


def _backend(kind: str, endpoint: str):
    """s3-curl, gcs-curl: small GETs on the curl engine; s3-lean(-into): on urllib3 threads;
    s3-sdk: the boto3 client; gcs-threads: the library's session on threads."""
    if kind.startswith("gcs"):
        backend = GCSBackend(_config("gs", endpoint))
        return backend if kind == "gcs-curl" else without_curl(backend)
    session = boto3.session.Session(
        aws_access_key_id="AKIAEXAMPLEEXAMPLE12", aws_secret_access_key="s" * 40, region_name="us-east-1"
    )
    backend = S3Backend(_config("s3", endpoint), session=session)
    if kind == "s3-sdk":
        return sdk_only(backend)
    return backend if kind == "s3-curl" else without_curl(backend)


@pytest.mark.parametrize("kind", KINDS)
def test_a_trickling_body_ends_in_an_error_within_its_bound(kind, monkeypatch):
    # 2,000 bytes at 2,000 B/s: each attempt gets the read timeout + 1 s.
    monkeypatch.setattr(body, "MIN_BODY_RATE_BYTES_PER_S", 2000)
    bound_s = ATTEMPTS_COUNT * (READ_TIMEOUT_S + BODY_BYTES / 2000) + 1.0  # + backoff and slack
    with trickling_store() as (endpoint, answered):
        backend = _backend(kind, endpoint)
        version = "1" if kind.startswith("gcs") else "v1"

        async def read():
            with trio.fail_after(bound_s + 10):  # (the test's own guard: a hang fails here)
                if kind == "s3-lean-into":
                    await backend.read_range_into("k", 0, BODY_BYTES, version, bytearray(BODY_BYTES))
                else:
                    await backend.read_range("k", 0, BODY_BYTES, version)

        started_s = time.monotonic()
        try:
            with pytest.raises(errors.TransientError):
                trio.run(read)
        finally:
            trio.run(backend.aclose)
        elapsed_s = time.monotonic() - started_s
        assert elapsed_s < bound_s, f"{elapsed_s:.1f} s, bound {bound_s:.1f} s"
        assert len(answered) == ATTEMPTS_COUNT  # each attempt cut at its deadline, then retried


def short_then_whole_store():
    """A server whose first answer is short but self-consistent (Content-Length and
    Content-Range of fewer bytes than asked, as a proxy's partial answer), and whose
    later answers are whole."""

    def respond(conn, count, _stop):
        sent_bytes = BODY_BYTES - 10 if count == 1 else BODY_BYTES
        conn.sendall(_headers(sent_bytes) + b"x" * sent_bytes)

    return socket_store(respond)


@pytest.mark.parametrize("kind", KINDS)
def test_a_short_answer_of_the_pinned_version_is_retried_not_stale(kind):
    """The object did not change: it was ObjectChanged (ESTALE to the reader) with no
    retry (found by the session-15 fault fuzzer: 271 ESTALEs in one run)."""
    with short_then_whole_store() as (endpoint, answered):
        backend = _backend(kind, endpoint)
        version = "1" if kind.startswith("gcs") else "v1"

        async def read():
            with trio.fail_after(20):
                if kind == "s3-lean-into":
                    buffer = bytearray(BODY_BYTES)
                    got = await backend.read_range_into("k", 0, BODY_BYTES, version, buffer, object_bytes=BODY_BYTES)
                    return bytes(buffer[:got])
                return bytes(await backend.read_range("k", 0, BODY_BYTES, version, object_bytes=BODY_BYTES))

        try:
            assert trio.run(read) == b"x" * BODY_BYTES
        finally:
            trio.run(backend.aclose)
        assert len(answered) == 2  # the short answer, then its retry


WHOLE_OBJECT_BYTES = 64 * 1024 * 1024


def whole_object_store(sent_bytes: list):
    """A server that ignores Range: every answer is a 200 with the whole object (no
    Content-Range), sent in 64 KiB pieces until the client stops reading; the bytes it
    got out go to `sent_bytes`."""
    piece = (bytes(range(251)) * (65536 // 251 + 1))[:65536]

    def respond(conn, _count, stop):
        conn.sendall(
            (
                "HTTP/1.1 200 OK\r\n"
                f"Content-Length: {WHOLE_OBJECT_BYTES}\r\n"
                'ETag: "v1"\r\nx-goog-generation: 1\r\nContent-Type: application/octet-stream\r\n\r\n'
            ).encode()
        )
        sent_bytes.append(0)
        for _ in range(WHOLE_OBJECT_BYTES // len(piece)):
            if stop.is_set():
                return
            try:
                conn.sendall(piece)
            except OSError:
                return  # the client has what it needs
            sent_bytes[-1] += len(piece)

    return socket_store(respond), piece


@pytest.mark.parametrize("kind", KINDS)
def test_a_small_range_of_a_huge_object_from_a_server_that_ignores_range_stays_small(kind):
    """Such a server sends all of the object for every read: the backend kept the whole
    body in memory and sliced it (a 64 KiB read of a 5 GiB object took 5 GiB). Now it
    keeps the range and stops reading past it."""
    sent_bytes: list = []
    store, piece = whole_object_store(sent_bytes)
    start, end = 70_000, 200_000  # (pieces of 65,536 bytes: the range spans three)
    expected = (piece * 4)[start:end]
    with store as (endpoint, answered):
        backend = _backend(kind, endpoint)
        version = "1" if kind.startswith("gcs") else "v1"

        async def read():
            with trio.fail_after(20):
                if kind == "s3-lean-into":
                    buffer = bytearray(end - start)
                    got = await backend.read_range_into("k", start, end, version, buffer)
                    return bytes(buffer[:got])
                return bytes(await backend.read_range("k", start, end, version))

        try:
            assert trio.run(read) == expected
        finally:
            trio.run(backend.aclose)
        # The server can only have sent what the client read plus the sockets' buffers
        # (a few MiB on loopback), whenever this is looked at.
        assert len(answered) == 1
        assert sent_bytes[0] < WHOLE_OBJECT_BYTES // 4, f"{sent_bytes[0]} of {WHOLE_OBJECT_BYTES} bytes read"
