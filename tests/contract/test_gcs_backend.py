"""GCS-only checks the shared contract (test_backend_contract.py, factories "gcs"
and "gcs-emulator") cannot express: which code path catches a changed object in
each server mode, HTTP status classification, gzip-encoded objects, timeouts and
the probe deadline, the connection pool, STORAGE_EMULATOR_HOST, credentials.

Server modes (a transport adapter mounted on the backend's HTTP session):
- "emulator": the raw gcp-storage-emulator, which ignores `generation=` and
  `ifGenerationMatch` and sends no `x-goog-generation`: the backend verifies each
  read with a metadata GET;
- "gcs-like": `GCSLikeAdapter()`, 404/412 for an old generation, reports the
  generation served;
- "truthful": serves the live object but reports which generation it served.
"""

from __future__ import annotations

import contextlib
import datetime
import gzip
import io
import logging
import random
import socket
import time
from typing import Callable, Optional

import pytest
import requests
import requests.adapters
import trio

from bucketfs import errors
from bucketfs.backends import gcs
from bucketfs.backends.gcs import GCSBackend
from bucketfs.testing.gcs_server import GCSLikeAdapter, fake_response
from bucketfs.testing.http_front import adapter_front
from bucketfs.testing.servers import without_curl

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def bucket(gcs_server) -> str:
    return gcs_server.new_bucket()


# The two ways a GET goes: the library's requests session on a worker thread, or
# the curl engine (backends/http/curl.py; small GETs, when pycurl is there).
GET_PATHS = ["threads", "curl"]


@pytest.fixture
def make_backend(gcs_server, bucket):
    """`make_backend(adapter=None, bucket_name=None, path="threads", **config_overrides)`;
    closed after the test. `path` "threads": every GET on the library's path, the
    adapter mounted on its session; "curl": small GETs on the curl engine, the adapter
    answering from a real HTTP front (bucketfs/testing/http_front.py) before the server."""
    made = []
    with contextlib.ExitStack() as fronts:

        def make(
            adapter: Optional[requests.adapters.HTTPAdapter] = None,
            bucket_name: Optional[str] = None,
            path: str = "threads",
            **overrides,
        ) -> GCSBackend:
            if path == "curl" and adapter is not None:
                upstream = overrides.get("endpoint_url", gcs_server.endpoint_url)
                overrides["endpoint_url"] = fronts.enter_context(adapter_front(adapter, upstream))
            backend = GCSBackend(gcs_server.config(bucket_name or bucket, **overrides))
            made.append(backend)
            if path == "threads":
                without_curl(backend)
                if adapter is not None:
                    backend.session().mount(overrides.get("endpoint_url", gcs_server.endpoint_url), adapter)
            else:
                assert backend.curl is not None, "pycurl is a runtime dependency"
            return backend

        yield make
        for backend in made:
            trio.run(backend.aclose)


MODES = {
    "emulator": lambda: None,
    "gcs-like": lambda: GCSLikeAdapter(),
    "truthful": lambda: GCSLikeAdapter(targeting=False),
}
# Requests one stale read costs in each mode: the GET, plus the metadata GET that
# tells a replaced object from a deleted one (gcs-like: 404) or finds the live
# generation (emulator: no header). A truthful server's header alone suffices.
STALE_READ_REQUESTS = {"emulator": {"get": 1, "head": 1}, "gcs-like": {"get": 1, "head": 1}, "truthful": {"get": 1}}


@pytest.mark.parametrize(
    "updated, expected_ns",
    [
        ("2024-05-06T07:08:09.123Z", 1714979289_123000000),
        ("2024-05-06T07:08:09Z", 1714979289_000000000),
        ("2024-05-06T07:08:09.123456789Z", 1714979289_123456000),  # past microseconds: dropped, as the library does
    ],
)
def test_listed_times_and_generations_are_read_from_the_json_as_the_library_reads_them(updated, expected_ns):
    """Listings skip the library's Blob objects and its strptime (two thirds of their CPU)."""
    from google.cloud._helpers import _rfc3339_nanos_to_datetime

    info = gcs._info({"name": "a/b.jpg", "size": "123", "updated": updated, "generation": "1714979289123456"})
    assert (info.key, info.size_bytes, info.mtime_ns, info.version) == ("a/b.jpg", 123, expected_ns, "1714979289123456")
    library_dt = _rfc3339_nanos_to_datetime(updated)
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    assert info.mtime_ns == (library_dt - epoch) // datetime.timedelta(microseconds=1) * 1000


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("path", GET_PATHS)
def test_version_pinning_in_every_server_mode(path, make_backend, gcs_server, bucket, mode):
    backend = make_backend(MODES[mode](), path=path)

    async def main():
        gcs_server.put(bucket, "obj", b"old-bytes")
        old = await backend.stat("obj")
        assert await backend.read_range("obj", 0, 9, old.version) == b"old-bytes"
        gcs_server.put(bucket, "obj", b"NEW-BYTES")  # same size: only the generation tells them apart
        new = await backend.stat("obj")
        assert int(new.version) > int(old.version)
        backend.requests.clear()
        with pytest.raises(errors.ObjectChanged):
            await backend.read_range("obj", 0, 9, old.version)
        assert dict(backend.requests) == STALE_READ_REQUESTS[mode]
        for start, end in ((0, 1), (4, 100), (9, 20)):  # (9, 20): at the end, still not a silent EOF
            with pytest.raises(errors.ObjectChanged):
                await backend.read_range("obj", start, end, old.version)
        assert await backend.read_range("obj", 0, 9, new.version) == b"NEW-BYTES"
        gcs_server.delete(bucket, "obj")
        with pytest.raises(errors.ObjectChanged, match="gone since it was listed"):
            await backend.read_range("obj", 0, 9, new.version)

    trio.run(main)


class _RangeNotSatisfiableAdapter(requests.adapters.HTTPAdapter):
    """Serves the live object whatever generation is asked for (like the emulator),
    but answers 416 to a range at or past its end (like GCS and S3), with no
    generation header: the emulator's 206-with-an-empty-body becomes a 416."""

    def send(self, request, **kwargs):
        response = super().send(request, **kwargs)
        if "/download/" in request.url and response.status_code == 206 and not response.content:
            return fake_response(request, 416)
        return response


@pytest.mark.parametrize("path", GET_PATHS)
def test_range_past_the_end_of_a_shorter_replacement_is_not_a_silent_eof(path, make_backend, gcs_server, bucket):
    backend = make_backend(_RangeNotSatisfiableAdapter(), path=path)

    async def main():
        gcs_server.put(bucket, "obj", b"0123456789" * 2)
        old = await backend.stat("obj")
        assert await backend.read_range("obj", 20, 30, old.version) == b""  # 416 on the pinned version: EOF
        gcs_server.put(bucket, "obj", b"short")
        with pytest.raises(errors.ObjectChanged):
            await backend.read_range("obj", 10, 20, old.version)

    trio.run(main)


@pytest.mark.parametrize("path", GET_PATHS)
def test_read_costs_one_get_when_the_server_reports_the_generation(path, make_backend, gcs_server, bucket):
    gcs_server.put(bucket, "k", b"abc")

    async def one_read(backend):
        info = await backend.stat("k")
        backend.requests.clear()
        assert await backend.read_range("k", 0, 3, info.version) == b"abc"
        assert dict(backend.get_paths) == {path: 1}  # the path the test names, not a fall-back
        return dict(backend.requests), backend.bytes_fetched

    assert trio.run(one_read, make_backend(GCSLikeAdapter(), path=path)) == ({"get": 1}, 3)
    # The emulator sends no x-goog-generation: the backend checks with a metadata GET.
    assert trio.run(one_read, make_backend(path=path)) == ({"get": 1, "head": 1}, 3)


class _Raw(io.BytesIO):
    """A transport's raw body stream, as read_body reads it."""

    def read1(self, size=-1, decode_content=False):
        return super().read1(size)


class _EmulatorFaultAdapter(requests.adapters.HTTPAdapter):
    """The emulator as it is (no x-goog-generation), with one fault on its first media
    answer: "cut" sends half the body, self-consistent (Content-Length and Content-Range
    of the half, as a proxy's partial answer); "delete" deletes the object once the
    body is sent, before the backend's metadata GET; "416" answers every media GET
    with 416 (a range inside the object: a server in error)."""

    def __init__(self, fault: str, on_delete: Callable[[], None] = lambda: None):
        super().__init__(max_retries=0)
        self.fault, self.on_delete, self.faults_count = fault, on_delete, 0

    def send(self, request, **kwargs):
        if "/download/" not in request.url:
            return super().send(request, **kwargs)
        if self.fault == "416":
            self.faults_count += 1
            return fake_response(request, 416)
        response = super().send(request, **kwargs)
        if self.faults_count:
            return response
        self.faults_count += 1
        if self.fault == "delete":
            response.raw = _Raw(response.content)  # the whole body, then the object goes
            self.on_delete()
            return response
        body = response.content
        first = int(response.headers["Content-Range"].split()[1].split("-")[0])
        total = response.headers["Content-Range"].split("/")[1]
        cut = body[: len(body) // 2]
        response.raw = _Raw(cut)
        response.headers["Content-Length"] = str(len(cut))
        response.headers["Content-Range"] = f"bytes {first}-{first + len(cut) - 1}/{total}"
        return response


@pytest.mark.parametrize("path", GET_PATHS)
def test_without_a_generation_header_a_short_body_of_the_pinned_generation_is_retried(
    path, make_backend, gcs_server, bucket
):
    """Found by the GCS fault fuzzer (session 18): on an endpoint that names no
    generation, the answer was checked only after the retries, so a cut body of an
    unchanged object was ESTALE to the reader instead of fetched again."""
    data = random.Random(3).randbytes(100_000)
    gcs_server.put(bucket, "k", data)
    adapter = _EmulatorFaultAdapter("cut")
    backend = make_backend(adapter, path=path)

    async def main():
        info = await backend.stat("k")
        backend.requests.clear()
        got = await backend.read_range("k", 1000, 81_000, info.version, object_bytes=len(data))
        return got, dict(backend.requests), backend.caller.retries_count

    got, requests_made, retries_count = trio.run(main)
    assert adapter.faults_count == 1 and got == data[1000:81_000]
    assert requests_made == {"get": 1, "head": 1} and retries_count == 1


@pytest.mark.parametrize("path", GET_PATHS)
def test_without_a_generation_header_an_object_deleted_after_its_download_is_stale(
    path, make_backend, gcs_server, bucket
):
    """The metadata GET that checks the generation finds nothing: ObjectChanged
    (ESTALE), as for any read of a listed object that is gone; it was NotFound, which
    a reader of an open file saw as ENOENT."""
    gcs_server.put(bucket, "k", b"abc" * 1000)
    adapter = _EmulatorFaultAdapter("delete", on_delete=lambda: gcs_server.delete(bucket, "k"))
    backend = make_backend(adapter, path=path)

    async def main():
        info = await backend.stat("k")
        with pytest.raises(errors.ObjectChanged, match="gone since it was listed"):
            await backend.read_range("k", 0, 3000, info.version)

    trio.run(main)
    assert adapter.faults_count == 1


@pytest.mark.parametrize("path", GET_PATHS)
def test_a_416_for_a_range_inside_the_pinned_object_is_an_error_not_eof(path, make_backend, gcs_server, bucket):
    """Only a server in error answers so; it was taken for an EOF, which the core then
    reported as a changed object (ESTALE), though nothing changed."""
    gcs_server.put(bucket, "k", b"0123456789" * 10)
    backend = make_backend(_EmulatorFaultAdapter("416"), path=path)

    async def main():
        info = await backend.stat("k")
        with pytest.raises(errors.BackendError, match="416 for bytes from 10, inside its 100 bytes"):
            await backend.read_range("k", 10, 20, info.version)
        assert await backend.read_range("k", 100, 110, info.version) == b""  # past the end: EOF

    trio.run(main)


class _GzipHeaderAdapter(requests.adapters.HTTPAdapter):
    """Adds `Content-Encoding: gzip` to media responses, as GCS does for such objects."""

    def send(self, request, **kwargs):
        response = super().send(request, **kwargs)
        if "/download/" in request.url:
            response.headers["Content-Encoding"] = "gzip"
            response.raw.headers["Content-Encoding"] = "gzip"
        return response


@pytest.mark.parametrize("adapter", [None, _GzipHeaderAdapter], ids=["emulator", "gzip-header"])
@pytest.mark.parametrize("path", GET_PATHS)
def test_gzip_encoded_object_is_served_as_stored(path, gcs_server, bucket, make_backend, adapter):
    plain = b"hello gzip " * 1000
    stored = gzip.compress(plain)
    gcs_server.put(bucket, "data.json.gz", stored, content_encoding="gzip")
    backend = make_backend(adapter() if adapter else None, path=path)

    async def main():
        (info,) = (await backend.list_page("")).objects
        assert info.size_bytes == len(stored)  # the listing reports the stored size
        assert await backend.read_range(info.key, 0, info.size_bytes, info.version) == stored
        assert await backend.read_range(info.key, 10, 20, info.version) == stored[10:20]

    trio.run(main)


@pytest.fixture
def silent_port():
    """A port that accepts TCP connections (kernel backlog) but never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_silent_endpoint_times_out_into_unreachable(make_backend, silent_port):
    backend = make_backend(endpoint_url=silent_port, read_timeout_s=0.2, retry_attempts_count=3)
    with pytest.raises(errors.EndpointUnreachable, match="Timeout"):
        trio.run(backend.check_bucket, "")


def test_probe_has_an_overall_deadline(make_backend, silent_port, monkeypatch):
    monkeypatch.setattr(gcs, "_PROBE_DEADLINE_S", 0.5)
    backend = make_backend(endpoint_url=silent_port, read_timeout_s=30.0)
    started_s = time.monotonic()
    with pytest.raises(errors.EndpointUnreachable, match="no answer"):
        trio.run(backend.check_bucket, "")
    assert time.monotonic() - started_s < 5


class FaultAdapter(requests.adapters.HTTPAdapter):
    """Fails the first `failures_count` requests."""

    def __init__(self, failures_count: int, fail: Callable[[requests.PreparedRequest], requests.Response]):
        super().__init__(max_retries=0)
        self.failures_left, self.fail = failures_count, fail
        self.failed_count = 0

    def send(self, request, **kwargs):
        if self.failures_left > 0:
            self.failures_left -= 1
            self.failed_count += 1
            return self.fail(request)
        return super().send(request, **kwargs)


@pytest.mark.parametrize(
    "code, error",
    [
        (408, errors.TransientError),
        (429, errors.TransientError),
        (500, errors.TransientError),
        (502, errors.TransientError),
        (503, errors.TransientError),
        (504, errors.TransientError),
        (401, errors.AccessDenied),
        (403, errors.AccessDenied),
        (412, errors.ObjectChanged),
        (400, errors.BackendError),
    ],
)
@pytest.mark.parametrize("path", GET_PATHS)
def test_http_status_classification(path, make_backend, gcs_server, bucket, code, error):
    gcs_server.put(bucket, "k", b"payload")
    faults = FaultAdapter(0, lambda request: fake_response(request, code))
    backend = make_backend(faults, retry_attempts_count=3, path=path)

    async def main():
        info = await backend.stat("k")
        faults.failures_left = 100
        with pytest.raises(error):
            await backend.read_range("k", 0, 7, info.version)
        retried = error is errors.TransientError
        assert faults.failed_count == (3 if retried else 1)
        assert backend.caller.retries_count == (2 if retried else 0)
        assert backend.requests["get"] == 1 and backend.bytes_fetched == 0

    trio.run(main)


@pytest.mark.parametrize("path", GET_PATHS)
def test_concurrent_reads(path, make_backend, gcs_server, bucket):
    payloads = {f"f{i}": random.Random(i).randbytes(100_000) for i in range(8)}
    for key, data in payloads.items():
        gcs_server.put(bucket, key, data)
    backend = make_backend(GCSLikeAdapter(), max_connections_count=4, path=path)
    results = {}

    async def main():
        infos = {o.key: o for o in (await backend.list_page("")).objects}

        async def read(key, start):
            results[key, start] = await backend.read_range(key, start, start + 30_000, infos[key].version)

        async with trio.open_nursery() as nursery:
            for key in payloads:
                for start in (0, 30_000, 60_000, 90_000):
                    nursery.start_soon(read, key, start)

    trio.run(main)
    assert len(results) == 32
    for (key, start), data in results.items():
        assert data == payloads[key][start : start + 30_000]
    assert backend.requests["get"] == 32


def test_connection_pool_matches_thread_limit(make_backend):
    backend = make_backend(max_connections_count=7)
    assert backend.session().get_adapter("https://storage.googleapis.com/")._pool_maxsize == 7
    assert backend.caller.limiter.total_tokens == 7


def test_emulator_host_env_var_is_honoured(gcs_server, bucket, monkeypatch):
    gcs_server.put(bucket, "k", b"v")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint_url.removeprefix("http://"))
    backend = GCSBackend(gcs_server.config(bucket, endpoint_url=None))
    try:
        assert trio.run(backend.stat, "k").size_bytes == 1
    finally:
        trio.run(backend.aclose)


def test_credentials(gcs_server, tmp_path, monkeypatch):
    async def probe(**overrides):
        backend = GCSBackend(gcs_server.config("some-bucket", **overrides))
        try:
            await backend.check_bucket("")
        finally:
            await backend.aclose()

    tls_endpoint = "https://127.0.0.1:9"  # (a key file is loaded before any request)
    with pytest.raises(errors.AccessDenied, match="key file"):
        trio.run(lambda: probe(key_file=str(tmp_path / "missing.json"), endpoint_url=tls_endpoint))
    (tmp_path / "bad.json").write_text('{"type": "service_account"}')
    with pytest.raises(errors.AccessDenied, match="key file"):
        trio.run(lambda: probe(key_file=str(tmp_path / "bad.json"), endpoint_url=tls_endpoint))
    # A key file's tokens never travel in clear text: refused before anything is sent.
    with pytest.raises(errors.InvalidOption, match="unencrypted"):
        trio.run(lambda: probe(key_file=str(tmp_path / "bad.json")))
    # No endpoint and no Application Default Credentials: denied, without a request.
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-adc.json"))
    with pytest.raises(errors.AccessDenied, match="DefaultCredentialsError"):
        trio.run(lambda: probe(endpoint_url=None))
    # --no-sign-request works without any credentials (BucketNotFound proves it got an answer).
    with pytest.raises(errors.BucketNotFound):
        trio.run(lambda: probe(no_sign_request=True))


def test_a_token_refresh_that_got_no_answer_is_retried_and_a_refused_one_is_denied():
    import google.auth.exceptions as auth_exc

    unanswered = auth_exc.RefreshError("metadata server unavailable", retryable=True)
    assert type(gcs.classify(unanswered)) is errors.TransientError
    wrapped = auth_exc.RefreshError("token endpoint")
    wrapped.__cause__ = auth_exc.TransportError("connection refused")
    assert type(gcs.classify(wrapped)) is errors.TransientError
    assert type(gcs.classify(auth_exc.RefreshError("invalid_grant: account disabled"))) is errors.AccessDenied


def test_a_web_server_404_at_the_endpoint_is_no_missing_bucket(make_backend):
    """A page of a web server or a wrong path is not GCS saying "no such bucket" (exit 3,
    permanent): the CLI reports it as an endpoint that is not GCS (exit 5)."""

    class WebServer(requests.adapters.HTTPAdapter):
        def send(self, request, **kwargs):
            response = fake_response(request, 404)
            response._content = b"<html><body>Not Found</body></html>"
            response.raw = io.BytesIO(response._content)
            response.headers["Content-Type"] = "text/html"
            return response

    backend = make_backend(WebServer())
    with pytest.raises(errors.BackendError) as raised:
        trio.run(backend.check_bucket, "")
    assert type(raised.value) is errors.BackendError
    assert errors.user_error_for(raised.value, "gs://b/").exit_code == errors.EXIT_ENDPOINT_UNREACHABLE


@pytest.mark.parametrize("key", ["plain/k.tar", "a b/c+d%e.jpg", "ü/x?y#z", "~tilde/&=;", "dir//double/../dot"])
def test_curl_path_asks_for_the_same_url_as_the_library(make_backend, key):
    """The curl path builds download URLs itself (once per bucket, then the key): the
    same as the library's for any name (a mismatch reads another object, or none)."""
    from google.cloud import storage

    backend = make_backend(path="curl")
    assert trio.run(backend.transport_ready).name == "curl"
    library_url = storage.Blob(key, backend._bucket, generation=7)._get_download_url(
        backend._client, if_generation_match=7
    )
    assert backend._downloads.url(key, 7) == library_url


class _TokenCredentials:
    """Stands in for real credentials on the curl path: each refresh (counted) issues
    the next token, valid until `expire()`."""

    def __init__(self):
        self.refreshes_count, self.valid = 0, False

    def refresh(self, _request):
        self.refreshes_count += 1
        self.valid = True

    @property
    def token(self) -> str:
        return f"token-{self.refreshes_count}"

    def apply(self, headers):
        headers["authorization"] = f"Bearer {self.token}"


class _BearerAdapter(requests.adapters.HTTPAdapter):
    """Media GETs need `Bearer <accepted>`; others answer 401, as GCS does for a
    revoked or expired token."""

    def __init__(self):
        super().__init__(max_retries=0)
        self.accepted, self.seen = None, []

    def send(self, request, **kwargs):
        if "/download/" in request.url:
            self.seen.append(request.headers.get("Authorization"))
            if request.headers.get("Authorization") != f"Bearer {self.accepted}":
                return fake_response(request, 401)
        return super().send(request, **kwargs)


def test_curl_path_sends_a_fresh_token_and_renews_it_once_after_a_401(make_backend, gcs_server, bucket):
    """Credentials with no valid token are refreshed once for many concurrent GETs (on
    a worker thread, not per GET); a 401 (a token revoked early) gets one new token
    and the GET again, as the library's authorized session does; a second 401 is
    access denied."""
    data = random.Random(5).randbytes(50_000)
    gcs_server.put(bucket, "k", data)
    adapter = _BearerAdapter()
    backend = make_backend(adapter, path="curl")
    credentials = _TokenCredentials()

    async def main():
        info = await backend.stat("k")
        assert (await backend.transport_ready()).name == "curl"
        backend._downloads.credentials, backend._downloads.anonymous = credentials, False
        adapter.accepted = "token-1"
        got = {}

        async def read(i):
            got[i] = await backend.read_range("k", i * 1000, i * 1000 + 1000, info.version)

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(read, i)
        assert credentials.refreshes_count == 1 and all(got[i] == data[i * 1000 : i * 1000 + 1000] for i in got)
        adapter.accepted = "token-2"  # token-1 revoked
        assert await backend.read_range("k", 0, 10, info.version) == data[:10]
        assert credentials.refreshes_count == 2 and adapter.seen[-2:] == ["Bearer token-1", "Bearer token-2"]
        adapter.accepted = "never"
        with pytest.raises(errors.AccessDenied):
            await backend.read_range("k", 0, 10, info.version)
        assert backend.get_paths["curl"] == 10 and not backend.get_paths["threads"]

    trio.run(main)


def test_the_transport_is_chosen_once_the_client_is_built_and_logged(make_backend, monkeypatch, caplog):
    """Small GETs on libcurl where the session allows it; behind a proxy for the
    endpoint (requests would route through it), every GET on the library's session."""
    caplog.set_level(logging.INFO, logger="bucketfs.backends.gcs")
    backend = make_backend(path="curl")
    assert backend.transport is None  # (the client is built at the first request: ADC may block)
    backend.session()
    assert backend.transport.name == "curl"
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    proxied = make_backend(path="curl")
    proxied.session()
    assert proxied.transport.name == "library"
    lines = [r.message for r in caplog.records if "GETs:" in r.message]
    assert len(lines) == 2
    assert lines[0].endswith(
        "GETs: libcurl for <= 2 MiB, the library's requests session (worker threads) for "
        "larger; LISTs: google-cloud-storage (worker threads)"
    )
    assert (
        "GETs: the library's requests session (worker threads); LISTs: google-cloud-storage (worker threads) "
        "(a proxy is set for 127.0.0.1:" in lines[1]
    )
