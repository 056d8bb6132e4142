"""GCSBackend against a real GCS emulator (gcp-storage-emulator) on 127.0.0.1.

The `check_*` coroutines are backend-neutral contract bodies: they take a backend
and a `Store` (put/delete one object in the bucket under test) and assert only
what base.py promises, so they can move to tests/contract/ unchanged. The
`test_*` functions wire them to the emulator, in two modes where it matters:
the raw emulator (which ignores generation conditions, so the backend verifies
with a metadata GET) and the emulator behind `GCSLikeAdapter` (which answers
generation conditions and pages like GCS).
"""

from __future__ import annotations

import gzip
import random
import socket
import time
from typing import Callable, Optional, Protocol

import pytest
import requests
import requests.adapters
import trio

from bucketfs import errors
from bucketfs.backends import gcs
from bucketfs.backends.base import Backend
from bucketfs.backends.gcs import GCSBackend
from tests.gcs_server import GCSLikeAdapter, closed_port_url, fake_response, start_gcs_emulator

pytestmark = pytest.mark.timeout(60)

MiB = 1024 * 1024


class Store(Protocol):
    """Writes to the bucket under test, behind the backend's back."""

    def put(self, key: str, data: bytes) -> None: ...

    def delete(self, key: str) -> None: ...


# --------------------------------------------------------------------------
# Contract bodies (backend-neutral)
# --------------------------------------------------------------------------

async def list_all(backend: Backend, prefix: str) -> tuple:
    """Walk every page of `prefix`: (object infos, prefixes, pages)."""
    objects, prefixes, pages = [], [], []
    token = None
    while True:
        page = await backend.list_page(prefix, token)
        pages.append(page)
        objects += page.objects
        prefixes += page.prefixes
        token = page.next_token
        if token is None:
            return objects, prefixes, pages


async def check_delimited_listing(backend: Backend, store: Store) -> None:
    for key, data in {"a.txt": b"aaa", "dir/": b"", "dir/b": b"bb", "dir/sub/c": b"c", "e/f": b"f"}.items():
        store.put(key, data)
    objects, prefixes, _ = await list_all(backend, "")
    assert [o.key for o in objects] == ["a.txt"]
    assert prefixes == ["dir/", "e/"]  # the `dir/` marker object shows up as a prefix
    info = objects[0]
    assert info.size_bytes == 3 and info.version and info.mtime_ns > 1_600_000_000 * 10**9
    assert await backend.stat("a.txt") == info  # the listing alone answers getattr

    objects, prefixes, _ = await list_all(backend, "dir/")
    # Under its own prefix the marker is an object keyed by the prefix (as on S3).
    assert [(o.key, o.size_bytes) for o in objects] == [("dir/", 0), ("dir/b", 2)]
    assert prefixes == ["dir/sub/"]
    objects, prefixes, pages = await list_all(backend, "nothing-here/")
    assert (objects, prefixes, len(pages)) == ([], [], 1)


def expected_many() -> tuple:
    """2,500 keys plus common prefixes interleaved with them, crossing page boundaries."""
    keys = [f"many/k{i:05d}" for i in range(2500)]
    prefixes = [f"many/k{i:05d}.d/" for i in (0, 999, 1000, 2499)]
    return keys, prefixes


def seed_many(store: Store) -> None:
    keys, prefixes = expected_many()
    for key in keys:
        store.put(key, key.encode())
    for prefix in prefixes:
        store.put(prefix + "x", b"x")


async def check_listing_complete(backend: Backend, max_page_entries_count: Optional[int] = 1000) -> int:
    """Every key and prefix of `many/` exactly once, in order, in pages of <= 1000.

    Returns the number of pages. `max_page_entries_count=None` is for a test server
    that ignores the page size (the backend cannot split a page without a token).
    """
    keys, prefixes = expected_many()
    objects, listed_prefixes, pages = await list_all(backend, "many/")
    assert [o.key for o in objects] == keys
    assert listed_prefixes == prefixes
    assert all(o.size_bytes == len(o.key) for o in objects)
    previous_last = ""
    for page in pages:
        entries = [o.key for o in page.objects] + page.prefixes
        assert 0 < len(entries) <= (max_page_entries_count or len(entries))
        assert min(entries) > previous_last  # pages partition the name space in order
        previous_last = max(entries)
    return len(pages)


async def check_ranged_reads(backend: Backend, store: Store) -> None:
    big = random.Random(1).randbytes(3 * MiB + 17)
    for key, data in {"empty": b"", "ten": b"0123456789", "big": big}.items():
        store.put(key, data)
    infos = {o.key: o for o in (await list_all(backend, ""))[0]}
    ten = infos["ten"].version

    async def read(key, start, end):
        return await backend.read_range(key, start, end, infos[key].version)

    assert await read("ten", 0, 0) == b""
    assert await read("ten", 3, 3) == b""
    assert await read("ten", 0, 1) == b"0"
    assert await read("ten", 9, 10) == b"9"  # the last byte
    assert await read("ten", 0, 10) == b"0123456789"
    assert await read("ten", 5, 100) == b"56789"  # across the end: clipped
    assert await read("ten", 10, 20) == b""  # start == size
    assert await read("ten", 11, 20) == b""  # start > size
    assert await read("empty", 0, 1) == b""
    assert await read("empty", 0, 0) == b""
    assert await read("big", MiB - 5, 2 * MiB + 5) == big[MiB - 5: 2 * MiB + 5]
    assert await read("big", 0, len(big)) == big
    assert await backend.read_range("ten", 2, 4, ten) == b"23"


SPECIAL_KEYS = ["with space", "pct%25and%", "plus+sign", "hash#tag", "what?q", "eq=1&b=2",
                "ünïcödé/日本語.txt", "a b/c d", "tilde~;semi'quote", "emoji-🙂"]


async def check_special_names(backend: Backend, store: Store) -> None:
    for i, key in enumerate(SPECIAL_KEYS):
        store.put(key, f"{i}:{key}".encode())
    objects, prefixes, _ = await list_all(backend, "")
    assert sorted(o.key for o in objects) == sorted(k for k in SPECIAL_KEYS if "/" not in k)
    assert sorted(prefixes) == ["a b/", "ünïcödé/"]
    for i, key in enumerate(SPECIAL_KEYS):
        info = await backend.stat(key)
        assert info.key == key
        parent = key.rpartition("/")[0] + "/" if "/" in key else ""
        assert info in (await list_all(backend, parent))[0]
        assert await backend.read_range(key, 0, info.size_bytes, info.version) == f"{i}:{key}".encode()


async def check_version_pinning(backend: Backend, store: Store) -> None:
    store.put("obj", b"old-bytes")
    old = await backend.stat("obj")
    assert await backend.read_range("obj", 0, 9, old.version) == b"old-bytes"
    store.put("obj", b"NEW-BYTES")  # same size: only the version tells them apart
    new = await backend.stat("obj")
    assert new.version != old.version
    for start, end in ((0, 9), (0, 1), (4, 100)):
        with pytest.raises(errors.ObjectChanged):
            await backend.read_range("obj", start, end, old.version)
    assert await backend.read_range("obj", 0, 9, new.version) == b"NEW-BYTES"
    store.delete("obj")
    with pytest.raises(errors.NotFound):
        await backend.read_range("obj", 0, 9, new.version)


async def check_missing_key(backend: Backend, store: Store) -> None:
    store.put("present", b"x")
    with pytest.raises(errors.NotFound):
        await backend.stat("absent")
    with pytest.raises(errors.NotFound):
        await backend.stat("presen")  # a prefix of a key is not a key
    with pytest.raises(errors.NotFound):
        await backend.read_range("absent", 0, 10, (await backend.stat("present")).version)


# --------------------------------------------------------------------------
# GCS wiring
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def emulator():
    with start_gcs_emulator() as emu:
        yield emu


class EmulatorStore:
    def __init__(self, emulator, bucket: str):
        self.emulator, self.bucket = emulator, bucket

    def put(self, key: str, data: bytes) -> None:
        self.emulator.put(self.bucket, key, data)

    def delete(self, key: str) -> None:
        self.emulator.delete(self.bucket, key)


@pytest.fixture
def bucket(emulator) -> str:
    return emulator.new_bucket()


@pytest.fixture
def store(emulator, bucket) -> EmulatorStore:
    return EmulatorStore(emulator, bucket)


@pytest.fixture
def make_backend(emulator, bucket):
    """`make_backend(adapter=None, bucket=None, **config_overrides)`; closed after the test."""
    made = []

    def make(adapter: Optional[requests.adapters.HTTPAdapter] = None, bucket_name: Optional[str] = None,
             **overrides) -> GCSBackend:
        backend = GCSBackend(emulator.config(bucket_name or bucket, **overrides))
        if adapter is not None:
            backend.session().mount(overrides.get("endpoint_url", emulator.endpoint_url), adapter)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        trio.run(backend.aclose)


MODES = {
    "emulator": lambda: None,  # generation conditions ignored: verified by a metadata GET
    "gcs-like": lambda: GCSLikeAdapter(),  # 404/412 for old generations, x-goog-generation
    "truthful": lambda: GCSLikeAdapter(targeting=False),  # serves the live object, says which
}


@pytest.fixture(params=sorted(MODES))
def mode_backend(request, make_backend):
    return make_backend(MODES[request.param]())


def test_delimited_listing(mode_backend, store):
    trio.run(check_delimited_listing, mode_backend, store)


@pytest.fixture(scope="module")
def many_bucket(emulator):
    name = emulator.new_bucket()
    seed_many(EmulatorStore(emulator, name))
    return name


@pytest.mark.timeout(120)
def test_pagination_over_2500_keys(make_backend, many_bucket):
    # The raw emulator answers in one page (it ignores maxResults/pageToken) ...
    backend = make_backend(bucket_name=many_bucket)
    assert trio.run(check_listing_complete, backend, None) == 1
    # ... so drive the backend's token handling through GCS-like pages of <= 1000.
    paged = GCSLikeAdapter()
    backend = make_backend(paged, bucket_name=many_bucket)
    assert trio.run(check_listing_complete, backend) == 3
    assert paged.pages_served_count == 3 and backend.requests["list"] == 3


def test_ranged_reads(mode_backend, store):
    trio.run(check_ranged_reads, mode_backend, store)


def test_special_names(mode_backend, store):
    trio.run(check_special_names, mode_backend, store)


def test_version_pinning(mode_backend, store):
    trio.run(check_version_pinning, mode_backend, store)


def test_missing_key(mode_backend, store):
    trio.run(check_missing_key, mode_backend, store)


def test_read_costs_one_get_when_the_server_reports_the_generation(make_backend, store):
    store.put("k", b"abc")

    async def one_read(backend):
        info = await backend.stat("k")
        backend.requests.clear()
        assert await backend.read_range("k", 0, 3, info.version) == b"abc"
        return dict(backend.requests), backend.bytes_fetched

    assert trio.run(one_read, make_backend(GCSLikeAdapter())) == ({"get": 1}, 3)
    # The emulator sends no x-goog-generation: the backend checks with a metadata GET.
    assert trio.run(one_read, make_backend()) == ({"get": 1, "head": 1}, 3)


class _GzipHeaderAdapter(requests.adapters.HTTPAdapter):
    """Adds `Content-Encoding: gzip` to media responses, as GCS does for such objects."""

    def send(self, request, **kwargs):
        response = super().send(request, **kwargs)
        if "/download/" in request.url:
            response.headers["Content-Encoding"] = "gzip"
            response.raw.headers["Content-Encoding"] = "gzip"
        return response


@pytest.mark.parametrize("adapter", [None, _GzipHeaderAdapter], ids=["emulator", "gzip-header"])
def test_gzip_encoded_object_is_served_as_stored(emulator, bucket, make_backend, adapter):
    plain = b"hello gzip " * 1000
    stored = gzip.compress(plain)
    emulator.put(bucket, "data.json.gz", stored, content_encoding="gzip")
    backend = make_backend(adapter() if adapter else None)

    async def main():
        (info,) = (await list_all(backend, ""))[0]
        assert info.size_bytes == len(stored)  # the listing reports the stored size
        assert await backend.read_range(info.key, 0, info.size_bytes, info.version) == stored
        assert await backend.read_range(info.key, 10, 20, info.version) == stored[10:20]

    trio.run(main)


def test_missing_bucket_and_present_bucket(make_backend, store):
    store.put("p/x", b"x")

    async def main():
        await make_backend().check_bucket("p/")
        await make_backend().check_bucket("")
        with pytest.raises(errors.BucketNotFound):
            await make_backend(bucket_name="no-such-bucket-here").check_bucket("")

    trio.run(main)


def test_unreachable_endpoint_is_reported_quickly(make_backend):
    backend = make_backend(endpoint_url=closed_port_url(), retry_base_delay_s=0.1, retry_max_delay_s=5.0)
    started_s = time.monotonic()
    with pytest.raises(errors.EndpointUnreachable):
        trio.run(backend.check_bucket, "")
    assert time.monotonic() - started_s < 10  # 5 refused attempts, < 3.1 s of backoff


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
    """Fails the first `failures_count` requests whose URL contains `match`."""

    def __init__(self, match: str, failures_count: int, fail: Callable[[requests.PreparedRequest], requests.Response]):
        super().__init__(max_retries=0)
        self.match, self.failures_left, self.fail = match, failures_count, fail
        self.failed_count = 0

    def send(self, request, **kwargs):
        if self.match in request.url and self.failures_left > 0:
            self.failures_left -= 1
            self.failed_count += 1
            return self.fail(request)
        return super().send(request, **kwargs)


def status(code: int):
    return lambda request: fake_response(request, code)


def refuse(request):
    raise requests.ConnectionError("injected connection reset")


@pytest.mark.parametrize("fail", [status(503), status(429), status(500), refuse], ids=["503", "429", "500", "reset"])
def test_transient_errors_are_retried(make_backend, store, fail):
    store.put("k", b"payload")
    faults = FaultAdapter("", 0, fail)
    backend = make_backend(faults, retry_attempts_count=5)

    async def main():
        faults.failures_left = 2
        objects, _, _ = await list_all(backend, "")
        assert backend.requests["list"] == 3
        faults.failures_left = 1
        assert await backend.read_range("k", 0, 7, objects[0].version) == b"payload"
        # 2 GET attempts, then the emulator-only metadata GET that checks the generation.
        assert (backend.requests["get"], backend.requests["head"]) == (2, 1)
        assert backend.bytes_fetched == 7  # the failed attempt delivered nothing
        assert backend.caller.retries_count == 3
        faults.failures_left = 100  # a persistent failure gives up after the attempts
        with pytest.raises(errors.TransientError):
            await backend.stat("k")
        assert backend.requests["head"] == 1 + 5

    trio.run(main)


@pytest.mark.parametrize("code, error", [(403, errors.AccessDenied), (401, errors.AccessDenied),
                                         (412, errors.ObjectChanged), (400, errors.BackendError)])
def test_permanent_errors_are_not_retried(make_backend, store, code, error):
    store.put("k", b"payload")
    faults = FaultAdapter("", 0, status(code))
    backend = make_backend(faults)

    async def main():
        info = await backend.stat("k")
        faults.failures_left = 100
        with pytest.raises(error):
            await backend.read_range("k", 0, 7, info.version)
        assert faults.failed_count == 1 and backend.caller.retries_count == 0

    trio.run(main)


def test_concurrent_reads(make_backend, store):
    payloads = {f"f{i}": random.Random(i).randbytes(100_000) for i in range(8)}
    for key, data in payloads.items():
        store.put(key, data)
    backend = make_backend(GCSLikeAdapter(), max_connections_count=4)
    results = {}

    async def main():
        infos = {o.key: o for o in (await list_all(backend, ""))[0]}

        async def read(key, start):
            results[key, start] = await backend.read_range(key, start, start + 30_000, infos[key].version)

        async with trio.open_nursery() as nursery:
            for key in payloads:
                for start in (0, 30_000, 60_000, 90_000):
                    nursery.start_soon(read, key, start)

    trio.run(main)
    for (key, start), data in results.items():
        assert data == payloads[key][start:start + 30_000]
    assert backend.requests["get"] == 32


def test_connection_pool_matches_thread_limit(make_backend):
    backend = make_backend(max_connections_count=7)
    assert backend.session().get_adapter("https://storage.googleapis.com/")._pool_maxsize == 7
    assert backend.caller.limiter.total_tokens == 7


def test_emulator_host_env_var_is_honoured(emulator, store, monkeypatch):
    store.put("k", b"v")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.endpoint_url.removeprefix("http://"))
    backend = GCSBackend(emulator.config(store.bucket, endpoint_url=None))
    try:
        assert trio.run(backend.stat, "k").size_bytes == 1
    finally:
        trio.run(backend.aclose)


def test_credentials(emulator, tmp_path, monkeypatch):
    async def probe(**overrides):
        backend = GCSBackend(emulator.config("some-bucket", **overrides))
        try:
            await backend.check_bucket("")
        finally:
            await backend.aclose()

    with pytest.raises(errors.AccessDenied, match="key file"):
        trio.run(lambda: probe(key_file=str(tmp_path / "missing.json")))
    (tmp_path / "bad.json").write_text('{"type": "service_account"}')
    with pytest.raises(errors.AccessDenied, match="key file"):
        trio.run(lambda: probe(key_file=str(tmp_path / "bad.json")))
    # No endpoint and no Application Default Credentials: denied, without a request.
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-adc.json"))
    with pytest.raises(errors.AccessDenied, match="DefaultCredentialsError"):
        trio.run(lambda: probe(endpoint_url=None))
    # --no-sign-request works without any credentials (BucketNotFound proves it got an answer).
    with pytest.raises(errors.BucketNotFound):
        trio.run(lambda: probe(no_sign_request=True))
