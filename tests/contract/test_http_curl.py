"""The curl engine (backends/http/curl.py), the path of S3's small GETs, where the
shared contract cannot reach: cancellation mid-body, a broken server's answers, and
the engine's end. Against socket servers on 127.0.0.1 that answer as real stores do
when they misbehave."""

from __future__ import annotations

import threading

import boto3
import pytest
import trio

from bucketfs import errors
from bucketfs.backends.http.curl import CurlLoop
from bucketfs.backends.s3 import S3Backend
from bucketfs.config import BucketURL, Config
from bucketfs.testing.servers import without_curl
from tests.contract.test_slow_body import socket_store, trickle_until_hung_up

pytestmark = pytest.mark.timeout(60)

BODY_BYTES = 2000


def socket_backend(
    endpoint: str, read_timeout_s: float = 5.0, attempts_count: int = 2, workers_count: int = 0
) -> S3Backend:
    """An S3Backend (fake keys, fast retries) on a socket_store, its small GETs on the curl
    engine's thread (`workers_count` 0) or on fetch workers (test_fetch_workers.py)."""
    config = Config(
        url=BucketURL("s3", "bucket", ""),
        mountpoint="/nonexistent",
        endpoint_url=endpoint,
        region="us-east-1",
        read_timeout_s=read_timeout_s,
        connect_timeout_s=2.0,
        retry_attempts_count=attempts_count,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.05,
        fetch_workers_count=workers_count,
    )
    session = boto3.session.Session(
        aws_access_key_id="AKIAEXAMPLEEXAMPLE12", aws_secret_access_key="s" * 40, region_name="us-east-1"
    )
    backend = S3Backend(config, session=session)
    assert backend.curl is not None, "pycurl is a dependency: its engine must be there"
    return backend


def _backend(endpoint: str, curl: bool = True, read_timeout_s: float = 5.0) -> S3Backend:
    backend = socket_backend(endpoint, read_timeout_s)
    return backend if curl else without_curl(backend)


def _headers(sent_bytes: int, content_range: str) -> bytes:
    return (
        "HTTP/1.1 206 Partial Content\r\n"
        f"Content-Length: {sent_bytes}\r\nContent-Range: {content_range}\r\n"
        'ETag: "v1"\r\nContent-Type: application/octet-stream\r\n\r\n'
    ).encode()


def test_a_cancelled_read_takes_its_transfer_back_before_it_returns():
    """A read-ahead dropped mid-body: its buffer goes back to the pool, so the transfer
    must be gone (its connection closed) before the cancelled call returns, and the
    engine must serve the next read."""
    first_bytes_sent = threading.Event()
    client_went_away = threading.Event()

    def respond(conn, count, stop):
        if count > 1:  # the read after the cancelled one: answered whole
            conn.sendall(_headers(10, "bytes 0-9/10") + b"0123456789")
            return
        conn.sendall(_headers(BODY_BYTES, f"bytes 0-{BODY_BYTES - 1}/{BODY_BYTES}") + b"x" * 10)
        first_bytes_sent.set()
        trickle_until_hung_up(conn, stop, client_went_away)  # (the rest never comes)

    with socket_store(respond) as (endpoint, answered):
        backend = _backend(endpoint, read_timeout_s=40)  # (no attempt ends on its own during the test)

        async def body():
            buffer = bytearray(BODY_BYTES)
            with trio.move_on_after(30) as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(backend.read_range_into, "k", 0, BODY_BYTES, "v1", buffer)
                    await trio.to_thread.run_sync(first_bytes_sent.wait, 10)
                    nursery.cancel_scope.cancel()
            assert not scope.cancelled_caught
            # The transfer was aborted before the call returned: the server sees the close.
            assert await trio.to_thread.run_sync(client_went_away.wait, 10)
            assert bytes(await backend.read_range("k", 0, 10, "v1")) == b"0123456789"

        try:
            trio.run(body)
        finally:
            trio.run(backend.aclose)
        assert len(answered) == 2


@pytest.mark.parametrize("curl", [True, False], ids=["curl", "threads"])
def test_a_ranged_answer_longer_than_its_range_is_never_served(curl):
    """A broken server (or proxy) answering 206 for the range asked but sending more
    bytes: the extra bytes must not land past the range (a bytearray grows when a
    longer slice is assigned), nor the read succeed."""

    def respond(conn, _count, _stop):
        conn.sendall(_headers(20, "bytes 0-9/10") + b"0123456789ABCDEFGHIJ")

    with socket_store(respond) as (endpoint, answered):
        backend = _backend(endpoint, curl)
        buffer = bytearray(10)

        async def body():
            with pytest.raises(errors.TransientError):
                await backend.read_range_into("k", 0, 10, "v1", buffer)

        try:
            trio.run(body)
        finally:
            trio.run(backend.aclose)
        assert len(answered) == 2  # retried once, then given up
        assert len(buffer) == 10


def test_closing_the_engine_ends_a_transfer_in_flight_with_an_error():
    """At unmount the engine closes: a read still waiting gets an error (EIO for its
    reader), not a hang."""

    headers_sent = threading.Event()

    def respond(conn, _count, stop):
        conn.sendall(_headers(BODY_BYTES, f"bytes 0-{BODY_BYTES - 1}/{BODY_BYTES}"))
        headers_sent.set()
        stop.wait(30)

    with socket_store(respond) as (endpoint, _answered):
        backend = _backend(endpoint)

        async def body():
            async with trio.open_nursery() as nursery:

                async def close_inside_the_transfer():
                    await trio.to_thread.run_sync(headers_sent.wait, 10)
                    backend.curl.close()

                nursery.start_soon(close_inside_the_transfer)
                with trio.fail_after(20), pytest.raises(errors.TransientError):
                    await backend.read_range("k", 0, BODY_BYTES, "v1")

        try:
            trio.run(body)
        finally:
            trio.run(backend.aclose)


def test_an_engine_whose_thread_died_fails_reads_at_once(monkeypatch):
    """A bug in the engine's thread must cost its readers an error, never a hang: the
    transfers it held end, and later reads fail without queueing for a thread that is gone."""

    def respond(conn, _count, _stop):
        conn.sendall(_headers(10, "bytes 0-9/10") + b"0123456789")

    def broken_collect(*_args):
        raise RuntimeError("a bug in the engine's loop")

    monkeypatch.setattr(CurlLoop, "_collect", broken_collect)
    with socket_store(respond) as (endpoint, _answered):
        backend = _backend(endpoint)

        async def body():
            for _ in range(2):
                with trio.fail_after(20), pytest.raises(errors.TransientError):
                    await backend.read_range("k", 0, 10, "v1")

        try:
            trio.run(body)
        finally:
            trio.run(backend.aclose)
