"""S3-only checks the shared contract cannot express: which code path catches a
changed object on each server, error classification, credentials handling."""

from __future__ import annotations

import datetime
import http.client
import logging
import pathlib

import boto3
import botocore.credentials
import botocore.exceptions
import botocore.session
import pytest
import trio
import urllib3.exceptions

from bucketfs import errors
from bucketfs.backends.s3 import S3Backend, classify
from bucketfs.backends.s3_lean import LeanS3
from bucketfs.backends.s3_transport import mtime_ns as _mtime_ns
from bucketfs.backends.s3_transport import normalise_etag
from bucketfs.testing.servers import inject_s3_failures, sdk_only, without_curl

pytestmark = pytest.mark.timeout(30)
GET_PATHS = ["curl", "urllib3"]  # a small GET's two lean paths: the curl engine, or urllib3 on a worker thread


def _backend(server, bucket: str, path: str, **config) -> S3Backend:
    backend = S3Backend(server.config(bucket, **config), session=server.session())
    return backend if path == "curl" else without_curl(backend)


def _client_error(code: str, status: int, operation: str = "GetObject") -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, operation
    )


@pytest.mark.parametrize(
    "exc, expected",
    [
        (_client_error("NoSuchKey", 404), errors.NotFound),
        (_client_error("404", 404, "HeadObject"), errors.NotFound),
        (_client_error("NoSuchBucket", 404, "ListObjectsV2"), errors.BucketNotFound),
        (_client_error("AccessDenied", 403), errors.AccessDenied),
        (_client_error("403", 403, "HeadObject"), errors.AccessDenied),
        (_client_error("InvalidAccessKeyId", 403), errors.AccessDenied),
        (_client_error("SignatureDoesNotMatch", 403), errors.AccessDenied),
        (botocore.exceptions.NoCredentialsError(), errors.AccessDenied),
        (
            botocore.exceptions.PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"),
            errors.AccessDenied,
        ),
        (_client_error("PreconditionFailed", 412), errors.ObjectChanged),
        (_client_error("SlowDown", 503), errors.TransientError),
        (_client_error("503", 503, "HeadObject"), errors.TransientError),
        (_client_error("InternalError", 500), errors.TransientError),
        (_client_error("BadGateway", 502), errors.TransientError),
        (_client_error("GatewayTimeout", 504), errors.TransientError),
        (_client_error("RequestTimeout", 400), errors.TransientError),
        (_client_error("Throttling", 400), errors.TransientError),
        (botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"), errors.TransientError),
        (botocore.exceptions.ConnectTimeoutError(endpoint_url="http://x"), errors.TransientError),
        (botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), errors.TransientError),
        (botocore.exceptions.ResponseStreamingError(error="reset"), errors.TransientError),
        (botocore.exceptions.IncompleteReadError(actual_bytes=1, expected_bytes=2), errors.TransientError),
        (urllib3.exceptions.ProtocolError("Connection broken"), errors.TransientError),
        (http.client.IncompleteRead(b"x", 3), errors.TransientError),
        (ConnectionResetError(), errors.TransientError),
        (_client_error("RequestTimeTooSkewed", 403), errors.TransientError),  # the clock, not the credentials
        (botocore.exceptions.CredentialRetrievalError(provider="sso", error_msg="timed out"), errors.TransientError),
        (_client_error("InvalidArgument", 400), errors.BackendError),
        (ValueError("weird"), errors.BackendError),
    ],
)
def test_classify(exc, expected):
    assert type(classify(exc)) is expected


def test_classify_scrubs_userinfo_from_urls():
    err = classify(botocore.exceptions.EndpointConnectionError(endpoint_url="http://AKIA:s3cr3t@host:9000/b"))
    assert "s3cr3t" not in str(err)


def test_etag_and_mtime_normalisation():
    assert normalise_etag('"abc"') == normalise_etag("abc") == "abc"
    when = datetime.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=datetime.timezone.utc)
    assert _mtime_ns(when) == 1714979289_123456000  # exact: no float rounding


async def _read_stale(backend: S3Backend, server, bucket: str):
    server.put(bucket, "k", b"version one")
    old = await backend.stat("k")
    server.put(bucket, "k", b"version two!")
    with pytest.raises(errors.ObjectChanged) as caught:
        await backend.read_range("k", 0, 5, old.version)
    return caught.value


@pytest.mark.timeout(30)
def test_moto_refuses_a_stale_version_with_412(moto_server):
    bucket = moto_server.new_bucket()
    backend = S3Backend(moto_server.config(bucket), session=moto_server.session())
    try:
        err = trio.run(_read_stale, backend, moto_server, bucket)
        cause = err.__cause__
        assert isinstance(cause, botocore.exceptions.ClientError)
        assert cause.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    finally:
        trio.run(backend.aclose)
        moto_server.delete_bucket(bucket)


@pytest.mark.timeout(30)
def test_rclone_ignores_if_match_so_the_etag_check_catches_it(rclone_server, s3_bucket):
    backend = S3Backend(rclone_server.config(s3_bucket), session=rclone_server.session())
    try:
        err = trio.run(_read_stale, backend, rclone_server, s3_bucket)
        assert err.__cause__ is None  # raised by our ETag comparison, not by the server
    finally:
        trio.run(backend.aclose)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", GET_PATHS)
def test_an_answer_without_an_etag_from_a_store_that_sends_them_is_not_served(rclone_server, s3_bucket, path):
    """rclone, for an object being rewritten, answers a GET without an ETag and ignores
    If-Match: served as is, a new version's bytes came back cut at the old size. Once
    the store has shown that its answers name ETags, such an answer is ObjectChanged
    (ESTALE). (A store that never sends one on GET is read by If-Match and size:
    tests/contract/test_s3_compatible_stores.py.)"""
    rclone_server.put(s3_bucket, "k", b"0123456789")
    backend = _backend(rclone_server, s3_bucket, path)
    name = "answer_of" if path == "curl" else "get"  # (the curl path's answer, or urllib3's)
    real_get = getattr(backend.lean, name)

    def get_without_etag(*args, **kwargs):
        status, _etag, content_range, body, digest, last_modified = real_get(*args, **kwargs)
        return status, "", content_range, body, digest, last_modified

    async def body():
        version = (await backend.stat("k")).version
        assert await backend.read_range("k", 0, 10, version) == b"0123456789"
        setattr(backend.lean, name, get_without_etag)
        with pytest.raises(errors.ObjectChanged):
            await backend.read_range("k", 0, 10, version)  # the answer names no version
        setattr(backend.lean, name, real_get)
        assert await backend.read_range("k", 0, 10, version) == b"0123456789"
        # The size is a second witness: an answer for an object of another size than
        # the pinned version's (Content-Range: bytes 0-4/10) is not served.
        with pytest.raises(errors.ObjectChanged):
            await backend.read_range("k", 0, 5, version, object_bytes=9)
        assert await backend.read_range("k", 0, 5, version, object_bytes=10) == b"01234"

    try:
        trio.run(body)
    finally:
        trio.run(backend.aclose)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", GET_PATHS)
def test_a_store_that_never_sends_an_etag_on_get_is_read_by_if_match_and_size(rclone_server, s3_bucket, path, caplog):
    rclone_server.put(s3_bucket, "k", b"0123456789")
    backend = _backend(rclone_server, s3_bucket, path)
    name = "answer_of" if path == "curl" else "get"
    real_get = getattr(backend.lean, name)

    def get_without_etag(*args, **kwargs):
        status, _etag, content_range, body, digest, last_modified = real_get(*args, **kwargs)
        return status, "", content_range, body, digest, last_modified

    setattr(backend.lean, name, get_without_etag)

    async def body():
        version = (await backend.stat("k")).version
        assert await backend.read_range("k", 0, 10, version) == b"0123456789"
        assert await backend.read_range("k", 2, 4, version) == b"23"
        with pytest.raises(errors.ObjectChanged):
            await backend.read_range("k", 0, 5, version, object_bytes=9)

    try:
        trio.run(body)
    finally:
        trio.run(backend.aclose)
    assert sum("answers GETs without one" in r.message for r in caplog.records) == 1


@pytest.mark.timeout(30)
def test_a_body_that_breaks_mid_stream_is_fetched_again(rclone_server, s3_bucket):
    rclone_server.put(s3_bucket, "k", b"0123456789")
    backend = S3Backend(rclone_server.config(s3_bucket), session=rclone_server.session())

    async def body():
        info = await backend.stat("k")
        inject_s3_failures(backend, "get", 1, "broken-body")
        assert await backend.read_range("k", 0, 10, info.version) == b"0123456789"
        assert backend.caller.retries_count == 1
        assert backend.bytes_fetched == 10

    try:
        trio.run(body)
    finally:
        trio.run(backend.aclose)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "sdk"])
def test_a_416_for_a_range_inside_the_pinned_object_is_an_error_not_eof(rclone_server, s3_bucket, lean):
    """Only a server in error answers so; it was taken for an EOF, which the core then
    reported as a changed object (ESTALE), though nothing changed."""
    rclone_server.put(s3_bucket, "k", b"0123456789" * 10)
    backend = S3Backend(rclone_server.config(s3_bucket), session=rclone_server.session())
    if not lean:
        sdk_only(backend)

    async def body():
        info = await backend.stat("k")
        inject_s3_failures(backend if lean else backend.client, "get", 2, "416")
        with pytest.raises(errors.BackendError, match="416 for bytes from 10, inside its 100 bytes"):
            await backend.read_range("k", 10, 20, info.version)
        assert await backend.read_range("k", 100, 110, info.version) == b""  # past the end: EOF

    try:
        trio.run(body)
    finally:
        trio.run(backend.aclose)


@pytest.mark.timeout(30)
def test_no_credentials_is_access_denied(rclone_server, s3_bucket):
    no_credentials = botocore.session.Session()
    no_credentials.register_component("credential_provider", botocore.credentials.CredentialResolver(providers=[]))
    session = boto3.session.Session(botocore_session=no_credentials, region_name="us-east-1")
    backend = S3Backend(rclone_server.config(s3_bucket), session=session)
    try:
        with pytest.raises(errors.AccessDenied, match="no-sign-request"):
            trio.run(backend.check_bucket, "")
    finally:
        trio.run(backend.aclose)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", GET_PATHS)
def test_no_sign_request_sends_anonymous_requests(moto_server, path):
    # (rclone answers an unsigned request 400 UnsupportedAlgorithm, not 403: moto
    # serves anonymous requests, so it shows the requests really go unsigned.)
    bucket = moto_server.new_bucket()
    moto_server.client.put_object(Bucket=bucket, Key="k", Body=b"public", ACL="public-read")
    backend = _backend(moto_server, bucket, path, no_sign_request=True)
    sent_headers = []
    backend.client.meta.events.register("before-send.s3", lambda request, **_: sent_headers.append(request.headers))
    lean_request = backend.lean._request  # GETs take the lean path (urllib3, no botocore events)

    def recording_request(url, headers):
        sent_headers.append(headers)
        return lean_request(url, headers)

    backend.lean._request = recording_request
    lean_transfer = backend.lean.transfer  # (the curl path's headers)

    def recording_transfer(*args):
        transfer = lean_transfer(*args)
        sent_headers.append(dict(line.split(": ", 1) for line in transfer.header_lines))
        return transfer

    backend.lean.transfer = recording_transfer

    async def body():
        info = (await backend.list_page("")).objects[0]
        assert await backend.read_range("k", 0, 6, info.version) == b"public"

    try:
        trio.run(body)
        assert len(sent_headers) == 2 and not any("Authorization" in headers for headers in sent_headers)
    finally:
        trio.run(backend.aclose)
        moto_server.delete_bucket(bucket)


@pytest.mark.timeout(30)
def test_check_bucket_gives_up_on_throttling_as_a_transient_error(rclone_server, s3_bucket):
    # Throttled (reachable) is not "unreachable": the caller sees the transient error.
    backend = S3Backend(rclone_server.config(s3_bucket), session=rclone_server.session())
    try:
        original = backend._make_client

        def make_client(*args):
            client = original(*args)
            inject_s3_failures(client, "list", 100, "throttle")
            return client

        backend._make_client = make_client
        with pytest.raises(errors.TransientError) as caught:
            trio.run(backend.check_bucket, "")
        assert not isinstance(caught.value, errors.EndpointUnreachable)
        assert backend.caller.retries_count == 2  # PROBE_ATTEMPTS_COUNT (3) attempts
    finally:
        trio.run(backend.aclose)


@pytest.mark.timeout(60)
def test_requests_go_through_the_http_proxy_botocore_uses(rclone_server, s3_bucket, monkeypatch):
    """Behind HTTP_PROXY (a network that only allows the proxy), every request goes
    through it, as boto3's do: the lean path must not connect directly."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
    from latency_proxy import ProxyProcess  # a byte-forwarding proxy that counts requests; rclone takes absolute URIs

    rclone_server.write_files(s3_bucket, {"px/a.bin": b"x" * 3000, "px/b.bin": b"y" * (2 << 20)})
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    with ProxyProcess(rclone_server.endpoint_url, 0, 0) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        backend = S3Backend(rclone_server.config(s3_bucket), session=rclone_server.session())

        async def body():
            objects = {info.key: info for info in (await backend.list_page("px/")).objects}
            small, large = objects["px/a.bin"], objects["px/b.bin"]
            assert await backend.read_range(small.key, 0, small.size_bytes, small.version) == b"x" * 3000
            buffer = bytearray(large.size_bytes)
            assert await backend.read_range_into(large.key, 0, large.size_bytes, large.version, buffer) == len(buffer)
            assert buffer == b"y" * (2 << 20)

        try:
            trio.run(body)
        finally:
            trio.run(backend.aclose)
        assert proxy.stats()["requests"] == {"LIST": 1, "GET": 2}


@pytest.mark.timeout(60)
def test_a_part_received_a_mib_at_a_time_leaves_its_connection_as_it_found_it(rclone_server, s3_bucket):
    """A part's receives wait for up to 1 MiB each (SO_RCVLOWAT); the connection then
    goes back to the pool waking for every byte again, or the next answer on it (a
    small file's, a listing's) would wait for a MiB that never comes, until the read
    timeout. Every byte lands where it belongs, the short last stretch included. A
    receive never waits for more than can still come through the socket: the body's
    first bytes arrive with its head, in the socket reader's own buffer (a 100 KiB
    body, read again and again on kept connections, waited out the read timeout)."""
    import socket

    data = bytes(range(256)) * ((5 << 20) // 256 + 1000)  # 5 MiB and an odd tail: not whole low-water marks
    mid = bytes(range(256)) * 400  # 100 KiB
    rclone_server.write_files(s3_bucket, {"lw/big.bin": data, "lw/mid.bin": mid, "lw/small.bin": b"s" * 100})
    backend = without_curl(
        S3Backend(rclone_server.config(s3_bucket, read_timeout_s=5.0), session=rclone_server.session())
    )

    async def body():
        objects = {info.key: info for info in (await backend.list_page("lw/")).objects}
        big, small, middle = objects["lw/big.bin"], objects["lw/small.bin"], objects["lw/mid.bin"]
        with trio.fail_after(3):
            for _ in range(6):
                buffer = bytearray(len(mid))
                assert await backend.read_range_into(middle.key, 0, len(mid), middle.version, buffer) == len(mid)
                assert buffer == mid
        for start, end in ((0, big.size_bytes), (1000, big.size_bytes - 3)):
            buffer = bytearray(end - start)
            assert await backend.read_range_into(
                big.key, start, end, big.version, buffer, object_bytes=big.size_bytes
            ) == len(buffer)
            assert buffer == data[start:end]
        pooled = [
            conn for conn in list(backend.lean._host_pool.pool.queue) if conn is not None and conn.sock is not None
        ]
        assert pooled and all(conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1 for conn in pooled)
        with trio.fail_after(3):  # well inside the 5 s read timeout a stuck low-water mark would cost
            for _ in range(4):
                assert await backend.read_range(small.key, 0, 100, small.version, object_bytes=100) == b"s" * 100

    try:
        trio.run(body)
    finally:
        trio.run(backend.aclose)


@pytest.mark.timeout(60)
def test_an_object_stored_gzip_encoded_reads_as_its_stored_bytes(moto_server):
    """Listed size, ranges and ETag are those of the stored bytes; urllib3 decoding the
    body by default made every read of such an object ESTALE or EIO."""
    import gzip

    stored = gzip.compress(b"hello world " * 1000)
    bucket = moto_server.new_bucket()
    moto_server.client.put_object(Bucket=bucket, Key="data.json.gz", Body=stored, ContentEncoding="gzip")
    backend = S3Backend(moto_server.config(bucket), session=moto_server.session())

    async def body():
        info = (await backend.list_page("")).objects[0]
        assert info.size_bytes == len(stored)
        assert await backend.read_range(info.key, 0, len(stored), info.version, object_bytes=len(stored)) == stored
        assert await backend.read_range(info.key, 20, 50, info.version, object_bytes=len(stored)) == stored[20:50]
        buffer = bytearray(len(stored))
        got = await backend.read_range_into(info.key, 0, len(stored), info.version, buffer, object_bytes=len(stored))
        assert bytes(buffer[:got]) == stored

    try:
        trio.run(body)
    finally:
        trio.run(backend.aclose)
        moto_server.delete_bucket(bucket)


def test_the_lean_path_is_resolved_before_it_says_so(moto_server):
    """Where it could not be resolved when the backend was built, worker threads resolve
    it at once on first use: one that sees base_url set must find the connection pool
    set too (6 of 320 first GETs raised AttributeError)."""
    bucket = moto_server.new_bucket()
    backend = S3Backend(moto_server.config(bucket), session=moto_server.session())
    assert backend.lean.base_url is not None  # (resolved when built: the transport is chosen from it)
    lean = LeanS3(backend.client, backend._session, bucket, 4, 1.0, 1.0, False)  # one not resolved yet
    real_pool_for = lean.pool.connection_from_url
    seen = []

    def pool_for(url):
        seen.append(lean.base_url)  # what another thread would see at this moment
        return real_pool_for(url)

    lean.pool.connection_from_url = pool_for
    try:
        assert lean._resolve()
        assert seen == [None] and lean.base_url is not None
    finally:
        lean.close()
        trio.run(backend.aclose)
        moto_server.delete_bucket(bucket)


class _Window:
    """Bytes [offset, offset + len(chunk)) of a body, indexed as in the whole body: a
    damage function sees the body as it arrives, one chunk at a time (indices outside
    the chunk read 0 and ignore writes)."""

    def __init__(self, chunk: bytearray, offset: int):
        self.chunk, self.offset = chunk, offset

    def __getitem__(self, i: int) -> int:
        return self.chunk[i - self.offset] if 0 <= i - self.offset < len(self.chunk) else 0

    def __setitem__(self, i: int, value: int) -> None:
        if 0 <= i - self.offset < len(self.chunk):
            self.chunk[i - self.offset] = value


def _damaging_on_the_wire(backend: S3Backend, damage):
    """The curl path: its bytes pass through `damage` as they arrive, before the engine
    sees them (it computes the MD5 as they arrive)."""
    real = backend.lean.transfer
    attempts = [0]

    def transfer(*args, **kwargs):
        t = real(*args, **kwargs)
        if t is None:
            return t
        attempts[0] += 1
        attempt, seen, on_body = attempts[0], [0], t.on_body

        def damaged_body(data):
            chunk = bytearray(data)
            damage(_Window(chunk, seen[0]), attempt)
            seen[0] += len(chunk)
            return on_body(bytes(chunk))

        t.on_body = damaged_body
        return t

    backend.lean.transfer = transfer
    return attempts


def _damaging(backend: S3Backend, path: str, damage):
    """Make the lean path's answers pass through `damage(body: bytearray, attempt)`,
    which may change their bytes in place (the curl path's on the wire; urllib3's, with
    a buffer, in that buffer, else in `body`)."""
    if path == "curl":
        return _damaging_on_the_wire(backend, damage)
    name = "get"
    real = getattr(backend.lean, name)
    attempts = [0]

    def damaged(*args, **kwargs):
        status, etag, content_range, body, digest, last_modified = real(*args, **kwargs)
        attempts[0] += 1
        if len(args) > 4 and args[4] is not None:
            damage(args[4], attempts[0])
        else:
            body = bytearray(body)
            damage(body, attempts[0])
            body = bytes(body)
        return status, etag, content_range, body, digest, last_modified

    setattr(backend.lean, name, damaged)
    return attempts


def _flip(byte_index_of):
    def damage(buffer, attempt):
        at = byte_index_of(attempt)
        if at is not None:
            buffer[at] ^= 0x01

    return damage


@pytest.mark.parametrize("path", GET_PATHS)
def test_a_whole_object_that_does_not_match_its_etag_is_fetched_again_never_served(rclone_server, s3_bucket, path):
    """rclone's ETags are the MD5 of the bytes, as AWS's for single-part uploads: a
    small file's GET (the whole object) with one bit flipped on the way is retried, and
    one damaged on every attempt is EIO, not served."""
    data = bytes(range(256)) * 400
    rclone_server.put(s3_bucket, "k", data)
    backend = _backend(rclone_server, s3_bucket, path)

    async def body():
        info = await backend.stat("k")
        attempts = _damaging(backend, path, _flip(lambda attempt: 777 if attempt == 1 else None))
        assert await backend.read_range("k", 0, len(data), info.version, object_bytes=len(data)) == data
        assert (attempts[0], backend.caller.corrupt_bodies_count) == (2, 1)
        attempts = _damaging(backend, path, _flip(lambda attempt: attempt * 1000))  # other bytes each time
        with pytest.raises(errors.TransientError, match="md5"):
            await backend.read_range("k", 0, len(data), info.version, object_bytes=len(data))
        assert backend.caller.corrupt_bodies_count == 1 + backend.caller.policy.attempts_count

    try:
        trio.run(body)
    finally:
        trio.run(backend.aclose)


@pytest.mark.parametrize("path", GET_PATHS)
def test_a_store_whose_etags_are_not_md5s_is_read_after_one_more_get(rclone_server, s3_bucket, path):
    """Some S3-compatible stores send 32-hex ETags that are not MD5s of the bytes (they
    encrypt or compress). Two GETs bringing the same bytes show it: the bytes are
    served, and ETags are not checked again on this mount."""
    rclone_server.put(s3_bucket, "k", b"0123456789")
    backend = _backend(rclone_server, s3_bucket, path)
    name = "answer_of" if path == "curl" else "get"
    real = getattr(backend.lean, name)

    def other_etag(*args, **kwargs):
        status, etag, content_range, body, digest, last_modified = real(*args, **kwargs)
        return status, etag, content_range, body, digest._replace(expected=bytes(16)), last_modified

    async def body():
        info = await backend.stat("k")
        setattr(backend.lean, name, other_etag)
        assert await backend.read_range("k", 0, 10, info.version, object_bytes=10) == b"0123456789"
        assert (backend.caller.retries_count, backend.etag_checks.enabled) == (1, False)
        assert await backend.read_range("k", 0, 10, info.version, object_bytes=10) == b"0123456789"
        assert backend.caller.retries_count == 1  # no longer checked

    try:
        trio.run(body)
    finally:
        trio.run(backend.aclose)


def test_the_transport_is_chosen_when_the_backend_is_built_and_logged(rclone_server, s3_bucket, monkeypatch, caplog):
    """From what the host and the endpoint allow, with no request: libcurl and urllib3
    where pycurl is there, urllib3 alone without it, the SDK client behind a proxy."""
    caplog.set_level(logging.INFO, logger="bucketfs.backends.s3")
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    backend = S3Backend(rclone_server.config(s3_bucket), session=rclone_server.session())
    assert backend.transport.name == "curl"
    assert without_curl(backend).transport.name == "urllib3"
    trio.run(backend.aclose)
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    proxied = S3Backend(rclone_server.config(s3_bucket), session=rclone_server.session())
    assert proxied.transport.name == "sdk" and proxied.curl is None
    trio.run(proxied.aclose)
    host = rclone_server.endpoint_url.split("/")[2]
    assert [r.message for r in caplog.records if "GETs:" in r.message] == [
        f"s3://{s3_bucket}: GETs: libcurl for <= 2 MiB, urllib3 (worker threads) for larger; LISTs: urllib3",
        f"s3://{s3_bucket}: GETs: the SDK client (boto3, worker threads); LISTs: the SDK client "
        f"(a proxy is set for {host})",
    ]


@pytest.mark.parametrize("transport", ["curl", "urllib3", "sdk"])
def test_a_flat_listing_from_a_start_key_on_every_transport(rclone_server, s3_bucket, transport):
    """StartAfter, no delimiter, on each way a LIST can go (the lean paths and the SDK
    client, which a lean path refused swaps to): the same keys, sizes and versions."""
    keys = [f"t/{d}/{i:04d}" for d in ("a", "b") for i in range(1200)] + ["t/top"]
    rclone_server.write_files(s3_bucket, {key: key.encode() for key in keys})
    backend = _backend(rclone_server, s3_bucket, "curl" if transport == "curl" else "urllib3")
    if transport == "sdk":
        sdk_only(backend)

    async def body():
        seen, start_after = [], "t/a/0999"
        while True:
            page = await backend.list_flat_page("t/", start_after)
            seen += [(info.key, info.size_bytes, info.version) for info in page.objects]
            if page.next_token is None:
                break
            start_after = page.next_token
        expected = sorted(key for key in keys if key > "t/a/0999")
        assert [key for key, _, _ in seen] == expected
        assert all(size == len(key) and version for key, size, version in seen)
        assert backend.requests["list"] == 2
        await backend.aclose()

    trio.run(body)
