"""One contract suite, run against every backend (see bucketfs/backends/base.py).

Each backend is a factory in FACTORIES: `factory(request, stack) -> ContractTarget`.
To add a backend (e.g. "gcs"), write one factory that seeds through the real store
and add it to the table; the optional capabilities (`denied_backend`,
`inject_transient`, ...) are None when a backend cannot provide them, and the
tests that need them skip.

The GCS factories run on the emulator (the session fixture `gcs_server`), which
neither pages listings nor honours generation conditions, so a `GCSLikeAdapter`
makes it page like GCS: "gcs" also answers generation-targeted GETs like GCS
(404/412, `x-goog-generation`), "gcs-emulator" leaves reads to the raw emulator (the
backend then checks the generation with a metadata GET). The adapter answers from a
real HTTP front before the emulator (bucketfs/testing/http_front.py), so small GETs take the
backend's curl path; "gcs-threads" mounts it on the backend's requests session
instead, with every GET on the library's path. The emulator has no authentication:
access cannot be denied.

Async code runs with trio.run inside each test (no pytest-trio).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import uuid
from typing import Callable, Optional

import pytest
import trio

from bucketfs import errors
from bucketfs.backends.base import Backend
from bucketfs.backends.memory import MemoryBackend


@dataclasses.dataclass
class ContractTarget:
    name: str
    backend: Backend
    put: Callable[[str, bytes], None]  # seeds one object through the store itself
    prefix: str  # unique per test, ends with '/'
    # Seeds many objects fast; None when that is too slow to be worth it.
    put_many: Optional[Callable[[dict], None]] = None
    # Variants of the backend (each closed at teardown); None: not testable here.
    denied_backend: Optional[Callable[[], Backend]] = None  # valid bucket, wrong credentials
    missing_bucket_backend: Optional[Callable[[], Backend]] = None
    unreachable_backend: Optional[Callable[[], Backend]] = None  # endpoint with nothing listening
    # inject_transient(op, times_count, kind): the next `times_count` requests of op
    # ("get" | "list" | "head") fail transiently; kind is "throttle" or "reset".
    inject_transient: Optional[Callable[[str, int, str], None]] = None
    retries_count: Optional[Callable[[], int]] = None
    secrets: tuple = ()  # strings that must never appear in an error message
    # What the store states of a version (bucketfs/backends/versions.py): "etag" (any
    # ETag or generation), "lastmod" (no ETag: Last-Modified, to the second).
    versions: str = "etag"


def _closing(stack: contextlib.ExitStack, backend: Backend) -> Backend:
    stack.callback(trio.run, backend.aclose)
    return backend


def _unique_prefix() -> str:
    return f"contract-{uuid.uuid4().hex[:8]}/"


# -- factories ------------------------------------------------------------------


def memory_target(request, stack: contextlib.ExitStack, versions: str = "counter") -> ContractTarget:
    backend = _closing(stack, MemoryBackend(versions=versions))

    def put_many(objects: dict) -> None:
        for key, data in objects.items():
            backend.put(key, data)

    def put(key: str, data: bytes) -> None:
        backend.put(key, data)

    name = "memory" if versions == "counter" else f"memory-{versions}"
    return ContractTarget(
        name, backend, put, _unique_prefix(), put_many=put_many, versions="lastmod" if versions == "none" else "etag"
    )


def _s3_target(
    name: str,
    server,
    bucket: str,
    stack: contextlib.ExitStack,
    put_many,
    authenticates: bool,
    curl: bool = True,
    put=None,
    versions: str = "etag",
    config_overrides: Optional[dict] = None,
) -> ContractTarget:
    """`curl`: small GETs on the curl engine (else all of them on urllib3 worker threads).
    `config_overrides`: Config fields of every backend of the target (its variants too)."""
    from bucketfs.backends.s3 import S3Backend
    from bucketfs.testing.servers import closed_port_url, inject_s3_failures, without_curl

    def make(bucket_name: str = bucket, secret_key: Optional[str] = None, **overrides) -> Backend:
        config = server.config(bucket_name, **{**(config_overrides or {}), **overrides})
        backend = S3Backend(config, session=server.session(secret_key=secret_key))
        return _closing(stack, backend if curl else without_curl(backend))

    backend = make()
    wrong_secret = "wrong-secret-key-0123456789abcdefghijklmn"
    return ContractTarget(
        name,
        backend,
        put or (lambda key, data: server.put(bucket, key, data)),
        _unique_prefix(),
        put_many=put_many,
        versions=versions,
        denied_backend=(lambda: make(secret_key=wrong_secret)) if authenticates else None,
        missing_bucket_backend=lambda: make(f"missing-{uuid.uuid4().hex[:12]}"),
        unreachable_backend=lambda: make(endpoint_url=closed_port_url()),
        inject_transient=lambda op, times_count, kind: inject_s3_failures(backend, op, times_count, kind),
        retries_count=lambda: backend.caller.retries_count,
        secrets=(server.secret_key, wrong_secret),
    )


def rclone_target(
    request, stack: contextlib.ExitStack, curl: bool = True, fetch_workers_count: int = 0
) -> ContractTarget:
    """`fetch_workers_count`: small GETs (and flat LIST pages) in that many fetch worker
    processes (--fetch-workers), signed there."""
    server = request.getfixturevalue("rclone_server")
    bucket = request.getfixturevalue("s3_bucket")
    name = "s3-rclone-workers" if fetch_workers_count else "s3-rclone" if curl else "s3-rclone-threads"
    return _s3_target(
        name,
        server,
        bucket,
        stack,
        lambda objects: server.write_files(bucket, objects),
        authenticates=True,
        curl=curl,
        config_overrides={"fetch_workers_count": fetch_workers_count} if fetch_workers_count else None,
    )


def rclone_other_etags_target(request, stack: contextlib.ExitStack, etags: str) -> ContractTarget:
    """rclone with ETags that are no MD5s ("xxh3") or none at all ("none"). Without
    ETags, versions are told apart by Last-Modified: each object is written as a file
    dated a second after the one before (a real store's later write is later)."""
    server = request.getfixturevalue("rclone_server_no_etag" if etags == "none" else "rclone_server_xxh3")
    bucket = server.new_bucket()
    stack.callback(server.delete_bucket, bucket)
    clock_s = itertools.count(int(time.time()) - 100_000)

    def put(key: str, data: bytes) -> None:
        server.write_files(bucket, {key: data}, mtime_s=next(clock_s))

    def put_many(objects: dict) -> None:
        server.write_files(bucket, objects, mtime_s=next(clock_s))

    return _s3_target(
        f"s3-rclone-{etags}",
        server,
        bucket,
        stack,
        put_many,
        authenticates=True,
        put=put,
        versions="lastmod" if etags == "none" else "etag",
    )


def moto_target(request, stack: contextlib.ExitStack) -> ContractTarget:
    server = request.getfixturevalue("moto_server")
    bucket = server.new_bucket()
    stack.callback(server.delete_bucket, bucket)
    # Seeding 2,500 objects over moto's HTTP takes ~12 s; rclone covers pagination.
    # moto does not check signatures, so it cannot deny access.
    return _s3_target("s3-moto", server, bucket, stack, None, authenticates=False)


def _gcs_target(
    name: str, request, stack: contextlib.ExitStack, generations: bool, curl: bool = True
) -> ContractTarget:
    """`curl`: small GETs on the curl engine, the adapter answering from a real HTTP front
    before the emulator (bucketfs/testing/http_front.py); else every request on the library's
    session, the adapter mounted on it."""
    import requests

    from bucketfs.backends.gcs import GCSBackend
    from bucketfs.testing.gcs_server import GCSLikeAdapter, closed_port_url, fake_response
    from bucketfs.testing.http_front import adapter_front
    from bucketfs.testing.servers import without_curl

    class FaultyGCSLikeAdapter(GCSLikeAdapter):
        """GCS-like pages (and generations), and transient faults on demand."""

        def __init__(self):
            super().__init__(paging=True, generations=generations)
            self.faults: dict = {}  # op -> [remaining_count, kind]

        def send(self, request_, **kwargs):
            path = request_.path_url.partition("?")[0]
            op = "get" if path.startswith("/download/") else "list" if path.endswith("/o") else "head"
            fault = self.faults.get(op)
            if request_.method == "GET" and fault and fault[0] > 0:
                fault[0] -= 1
                if fault[1] == "reset":
                    raise requests.ConnectionError("injected: connection reset by peer")
                return fake_response(request_, 429)  # GCS throttles with 429 rateLimitExceeded
            return super().send(request_, **kwargs)

    server = request.getfixturevalue("gcs_server")
    bucket = server.new_bucket()
    adapter = FaultyGCSLikeAdapter()
    front_url = stack.enter_context(adapter_front(adapter, server.endpoint_url)) if curl else None

    def make(bucket_name: str = bucket, **overrides) -> Backend:
        if front_url:
            overrides.setdefault("endpoint_url", front_url)
        made = _closing(stack, GCSBackend(server.config(bucket_name, **overrides)))
        return made if curl else without_curl(made)

    backend = make()
    if not curl:
        backend.session().mount(server.endpoint_url, adapter)
    return ContractTarget(
        name,
        backend,
        lambda key, data: server.put(bucket, key, data),
        _unique_prefix(),
        put_many=lambda objects: server.put_many(bucket, objects),
        denied_backend=None,  # the emulator has no authentication: it cannot deny access
        missing_bucket_backend=lambda: make(f"missing-{uuid.uuid4().hex[:12]}"),
        unreachable_backend=lambda: make(endpoint_url=closed_port_url()),
        inject_transient=lambda op, times_count, kind: adapter.faults.__setitem__(op, [times_count, kind]),
        retries_count=lambda: backend.caller.retries_count,
    )


def gcs_target(request, stack: contextlib.ExitStack) -> ContractTarget:
    return _gcs_target("gcs", request, stack, generations=True)


def gcs_threads_target(request, stack: contextlib.ExitStack) -> ContractTarget:
    return _gcs_target("gcs-threads", request, stack, generations=True, curl=False)


def gcs_emulator_target(request, stack: contextlib.ExitStack) -> ContractTarget:
    return _gcs_target("gcs-emulator", request, stack, generations=False)


FACTORIES = {
    "memory": memory_target,
    "memory-hash": lambda request, stack: memory_target(request, stack, versions="hash"),
    "memory-none": lambda request, stack: memory_target(request, stack, versions="none"),
    "s3-rclone-xxh3": lambda request, stack: rclone_other_etags_target(request, stack, "xxh3"),
    "s3-rclone-no-etag": lambda request, stack: rclone_other_etags_target(request, stack, "none"),
    "s3-rclone": rclone_target,
    "s3-rclone-threads": lambda request, stack: rclone_target(request, stack, curl=False),
    "s3-rclone-workers": lambda request, stack: rclone_target(request, stack, fetch_workers_count=2),
    "s3-moto": moto_target,
    "gcs": gcs_target,
    "gcs-threads": gcs_threads_target,
    "gcs-emulator": gcs_emulator_target,
}


@pytest.fixture(params=list(FACTORIES))
def contract_backend(request):
    with contextlib.ExitStack() as stack:
        yield FACTORIES[request.param](request, stack)


# -- helpers --------------------------------------------------------------------


async def _list_all(backend: Backend, prefix: str):
    """Every page of the listing of `prefix`."""
    pages, token = [], None
    while True:
        page = await backend.list_page(prefix, token)
        pages.append(page)
        token = page.next_token
        if token is None:
            return pages


def _children(page, prefix: str) -> list:
    # A `prefix` marker object listed inside its own directory is the directory, not a
    # child: S3Backend drops it, MemoryBackend still returns it; accept either here.
    return sorted(info.key for info in page.objects if info.key != prefix)


# -- the contract -----------------------------------------------------------------


@pytest.mark.timeout(30)
def test_check_bucket_accepts_an_existing_bucket_and_says_if_the_prefix_lists_anything(contract_backend):
    t, p = contract_backend, contract_backend.prefix
    assert trio.run(t.backend.check_bucket, p + "nothing-here/") is False
    t.put(p + "folder/a.jpg", b"x")
    t.put(p + "file", b"y")
    assert trio.run(t.backend.check_bucket, p) is True  # a folder and a file
    assert trio.run(t.backend.check_bucket, p + "folder/") is True
    assert trio.run(t.backend.check_bucket, p + "file/") is False  # an object, not a folder
    assert trio.run(t.backend.check_bucket, "") is True


@pytest.mark.timeout(30)
def test_delimited_listing_shows_files_and_common_prefixes(contract_backend):
    t, p = contract_backend, contract_backend.prefix
    t.put(p + "a.txt", b"alpha")
    t.put(p + "b.bin", b"\x00" * 300)
    t.put(p + "empty", b"")
    t.put(p + "sub/c", b"c")
    t.put(p + "sub/deeper/d", b"d")
    t.put(p + "marker/", b"")  # directory marker only, nothing under it
    t.put(p + "both/", b"")  # marker and a child
    t.put(p + "both/e", b"eee")
    t.put("outside-" + p.rstrip("/"), b"not under the prefix")

    async def body():
        pages = await _list_all(t.backend, p)
        assert len(pages) == 1 and t.backend.requests["list"] == 1
        page = pages[0]
        assert sorted(info.key for info in page.objects) == [p + "a.txt", p + "b.bin", p + "empty"]
        assert sorted(page.prefixes) == [p + "both/", p + "marker/", p + "sub/"]
        sizes = {info.key: info.size_bytes for info in page.objects}
        assert sizes == {p + "a.txt": 5, p + "b.bin": 300, p + "empty": 0}
        for info in page.objects:
            assert isinstance(info.mtime_ns, int) and info.mtime_ns > 0
            assert info.version and '"' not in info.version
            # LIST and HEAD agree on the version (rclone quotes ETags only in HEAD/GET).
            assert (await t.backend.stat(info.key)).version == info.version
        assert t.backend.requests["head"] == 3

        both = await t.backend.list_page(p + "both/")
        assert _children(both, p + "both/") == [p + "both/e"] and both.prefixes == []
        marker = await t.backend.list_page(p + "marker/")
        assert _children(marker, p + "marker/") == [] and marker.prefixes == []
        sub = await t.backend.list_page(p + "sub/")
        assert _children(sub, p + "sub/") == [p + "sub/c"] and sub.prefixes == [p + "sub/deeper/"]
        nothing = await t.backend.list_page(p + "no-such-dir/")
        assert nothing.objects == [] and nothing.prefixes == [] and nothing.next_token is None

    trio.run(body)


@pytest.mark.timeout(60)
def test_pagination_returns_every_entry_once_in_order(contract_backend):
    t, p = contract_backend, contract_backend.prefix
    if t.put_many is None:
        pytest.skip(f"{t.name}: no fast bulk seeding")
    objects, expected = {}, []
    for i in range(2500):
        if i % 250 == 7:  # some common prefixes among the objects, across page boundaries
            objects[f"{p}{i:05d}/inner"] = b"x"
            expected.append(f"{p}{i:05d}/")
        else:
            objects[f"{p}{i:05d}"] = i.to_bytes(2, "big")
            expected.append(f"{p}{i:05d}")
    t.put_many(objects)

    async def body():
        pages = await _list_all(t.backend, p)
        assert t.backend.requests["list"] == len(pages) >= 3
        seen = []
        for page in pages[:-1]:
            assert len(page.objects) + len(page.prefixes) == 1000
        for page in pages:
            seen.extend(sorted([info.key for info in page.objects] + page.prefixes))
        assert seen == sorted(expected)
        sizes = {info.key: info.size_bytes for page in pages for info in page.objects}
        assert set(sizes.values()) == {2}

    trio.run(body)


async def _read_into(backend: Backend, key: str, start: int, end: int, version: str) -> bytes:
    """read_range_into, checked to write only the bytes it reports (the rest of the
    buffer keeps its filler)."""
    spare_bytes = 7
    buffer = bytearray(b"\xaa" * (max(end - start, 0) + spare_bytes))
    n = await backend.read_range_into(key, start, end, version, buffer)
    assert buffer[n:] == b"\xaa" * (len(buffer) - n)
    return bytes(buffer[:n])


@pytest.mark.timeout(30)
def test_ranged_reads_at_every_boundary(contract_backend):
    t, p = contract_backend, contract_backend.prefix
    data = bytes(range(256)) * 4 + b"tail"
    size = len(data)
    t.put(p + "obj", data)
    t.put(p + "zero", b"")

    async def body():
        info = await t.backend.stat(p + "obj")
        assert info.size_bytes == size
        v = info.version
        gets_before = t.backend.requests["get"]
        fetched_before = t.backend.bytes_fetched
        nonempty = [(0, 1), (size - 1, size), (size - 10, size + 100), (0, size), (0, 2 * size), (300, 700)]
        for start, end in nonempty:
            assert await t.backend.read_range(p + "obj", start, end, v) == data[start:end], (start, end)
            # Received into a caller's buffer (read-ahead parts): the same bytes.
            assert await _read_into(t.backend, p + "obj", start, end, v) == data[start:end], (start, end)
        # Counters: one GET per non-empty range, payload bytes counted exactly.
        assert t.backend.requests["get"] - gets_before == 2 * len(nonempty)
        assert t.backend.bytes_fetched - fetched_before == 2 * sum(len(data[s:e]) for s, e in nonempty)

        for start, end in [(0, 0), (5, 5), (10, 3), (size, size + 10), (size + 5, size + 10), (size, size)]:
            assert await t.backend.read_range(p + "obj", start, end, v) == b"", (start, end)
            assert await _read_into(t.backend, p + "obj", start, end, v) == b"", (start, end)

        zero = await t.backend.stat(p + "zero")
        assert zero.size_bytes == 0
        assert await t.backend.read_range(p + "zero", 0, 0, zero.version) == b""
        assert await t.backend.read_range(p + "zero", 0, 4096, zero.version) == b""

    trio.run(body)


SPECIAL_NAMES = [
    "a b.txt",
    "100%.txt",
    "%41%2F",
    "c++.txt",
    "x+y",
    "hash#tag",
    "what?",
    "k=v&x=y",
    "ünïcödé.txt",
    "日本語.txt",
    "emoji-😀",
    "semi;colon",
    "tilde~",
    "sq'uote",
    'dq"uote',
    "dir with space/inner file",
    "plus+dir/a+b",
]


@pytest.mark.timeout(30)
def test_special_character_keys_round_trip(contract_backend):
    t, p = contract_backend, contract_backend.prefix
    for name in SPECIAL_NAMES:
        t.put(p + name, name.encode())

    async def body():
        page = await t.backend.list_page(p)
        top = {name for name in SPECIAL_NAMES if "/" not in name}
        assert sorted(info.key for info in page.objects) == sorted(p + name for name in top)
        assert sorted(page.prefixes) == [p + "dir with space/", p + "plus+dir/"]
        for name in SPECIAL_NAMES:
            info = await t.backend.stat(p + name)
            assert info.key == p + name and info.size_bytes == len(name.encode())
            assert await t.backend.read_range(p + name, 0, info.size_bytes, info.version) == name.encode()
        nested = await t.backend.list_page(p + "plus+dir/")
        assert [info.key for info in nested.objects] == [p + "plus+dir/a+b"]

    trio.run(body)


@pytest.mark.timeout(30)
def test_read_pinned_to_an_overwritten_version_raises_object_changed(contract_backend):
    t, p = contract_backend, contract_backend.prefix
    key = p + "shard-000.tar"
    old_data, new_data = b"old content, version one" * 10, b"new"
    t.put(key, old_data)

    async def body():
        old = (await t.backend.list_page(p)).objects[0]
        assert await t.backend.read_range(key, 0, 10, old.version) == old_data[:10]
        t.put(key, new_data)
        new = await t.backend.stat(key)
        assert new.version != old.version
        with pytest.raises(errors.ObjectChanged):
            await t.backend.read_range(key, 0, 10, old.version)
        with pytest.raises(errors.ObjectChanged):
            await _read_into(t.backend, key, 0, 10, old.version)
        # Past the end of the new (shorter) object: still not a silent EOF.
        with pytest.raises(errors.ObjectChanged):
            await t.backend.read_range(key, 100, 200, old.version)
        assert await t.backend.read_range(key, 0, 100, new.version) == new_data

    trio.run(body)


@pytest.mark.timeout(30)
def test_missing_key_is_not_found_and_a_read_of_it_is_stale(contract_backend):
    t, p = contract_backend, contract_backend.prefix
    t.put(p + "present", b"x")

    async def body():
        with pytest.raises(errors.NotFound):
            await t.backend.stat(p + "absent")
        # A version of the backend's own shape (an ETag, a generation), as a handle would hold.
        version = (await t.backend.stat(p + "present")).version
        # A read names an object a listing showed: gone since, it is stale (ESTALE), not
        # "no such file" for a name `ls` still shows.
        with pytest.raises(errors.ObjectChanged, match="gone since it was listed"):
            await t.backend.read_range(p + "absent", 0, 10, version)
        with pytest.raises(errors.ObjectChanged, match="gone since it was listed"):
            await _read_into(t.backend, p + "absent", 0, 10, version)
        # (No `stat(p + "present/")` here: rclone strips the slash and finds the file.)

    trio.run(body)


@pytest.mark.timeout(30)
def test_wrong_credentials_are_access_denied(contract_backend):
    t = contract_backend
    if t.denied_backend is None:
        pytest.skip(f"{t.name}: cannot deny access")
    t.put(t.prefix + "x", b"x")
    denied = t.denied_backend()

    async def body():
        for call in (
            lambda: denied.check_bucket(t.prefix),
            lambda: denied.list_page(t.prefix),
            lambda: denied.stat(t.prefix + "x"),
            lambda: denied.read_range(t.prefix + "x", 0, 1, "v"),
        ):
            with pytest.raises(errors.AccessDenied) as caught:
                await call()
            for secret in t.secrets:
                assert secret not in str(caught.value)

    trio.run(body)


@pytest.mark.timeout(30)
def test_missing_bucket_is_bucket_not_found(contract_backend):
    t = contract_backend
    if t.missing_bucket_backend is None:
        pytest.skip(f"{t.name}: has no bucket to miss")
    with pytest.raises(errors.BucketNotFound):
        trio.run(t.missing_bucket_backend().check_bucket, "")


@pytest.mark.timeout(30)
def test_unreachable_endpoint_fails_fast(contract_backend):
    t = contract_backend
    if t.unreachable_backend is None:
        pytest.skip(f"{t.name}: has no endpoint")
    backend = t.unreachable_backend()
    started_s = time.monotonic()
    with pytest.raises(errors.EndpointUnreachable) as caught:
        trio.run(backend.check_bucket, t.prefix)
    assert time.monotonic() - started_s < 10
    for secret in t.secrets:
        assert secret not in str(caught.value)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["throttle", "reset"])
@pytest.mark.parametrize("op", ["get", "list", "head"])
def test_transient_errors_are_retried(contract_backend, op, kind):
    t, p = contract_backend, contract_backend.prefix
    if t.inject_transient is None:
        pytest.skip(f"{t.name}: no retry layer to test")
    t.put(p + "obj", b"0123456789")

    async def body():
        info = await t.backend.stat(p + "obj")
        t.inject_transient(op, 2, kind)
        requests_before = dict(t.backend.requests)
        if op == "get":
            assert await t.backend.read_range(p + "obj", 2, 5, info.version) == b"234"
        elif op == "list":
            assert [o.key for o in (await t.backend.list_page(p)).objects] == [p + "obj"]
        else:
            assert (await t.backend.stat(p + "obj")).version == info.version
        assert t.retries_count() == 2
        # Retries are not separate requests of the core: one call, one count.
        assert t.backend.requests[op] == requests_before.get(op, 0) + 1

    trio.run(body)


@pytest.mark.timeout(30)
def test_transient_errors_give_up_after_the_attempt_budget(contract_backend):
    t, p = contract_backend, contract_backend.prefix
    if t.inject_transient is None:
        pytest.skip(f"{t.name}: no retry layer to test")
    t.put(p + "obj", b"0123456789")
    t.inject_transient("head", 1000, "throttle")
    with pytest.raises(errors.TransientError):
        trio.run(t.backend.stat, p + "obj")
    assert t.retries_count() == 4  # Config.retry_attempts_count (5) attempts in all


# -- flat listings from a start key (bucketfs index build) and upload -------------------


async def _list_flat_all(backend: Backend, prefix: str, start_after: str = "") -> list:
    """Every page of the flat listing of `prefix` after `start_after`, each page checked:
    in order, strictly after where it started, `next_token` its last key."""
    pages = []
    while True:
        page = await backend.list_flat_page(prefix, start_after)
        keys = [info.key for info in page.objects]
        assert page.prefixes == []
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        assert all(key > start_after and key.startswith(prefix) for key in keys), (start_after, keys[:3])
        pages.append(page)
        if page.next_token is None:
            return pages
        assert page.next_token == keys[-1]
        start_after = page.next_token


@pytest.mark.timeout(60)
def test_a_flat_listing_starts_after_any_key_and_holds_every_key_below_the_prefix(contract_backend):
    t, p = contract_backend, contract_backend.prefix
    names = ["a.txt", "b/c.bin", "b/d/e", "b-dash", "b0", "dir with space/x", "plus+dir/a+b", "ünï.txt", "日本/語"]
    for i, name in enumerate(names):
        t.put(p + name, name.encode() * (i + 1))
    t.put("outside-" + p.rstrip("/"), b"not under the prefix")
    keys = sorted(p + name for name in names)

    async def body():
        pages = await _list_flat_all(t.backend, p)
        assert [info.key for page in pages for info in page.objects] == keys
        assert t.backend.requests["list"] == len(pages) == 1
        flat = {info.key: info for info in pages[0].objects}
        # The same sizes and versions as the delimited listing of each directory.
        for directory in (p, p + "b/", p + "b/d/"):
            for info in (await t.backend.list_page(directory)).objects:
                assert (flat[info.key].size_bytes, flat[info.key].version) == (info.size_bytes, info.version)
                assert flat[info.key].mtime_ns == info.mtime_ns
        # From any key, and from between keys: exactly what lies after it.
        for start_after in [*keys, p + "b/", p + "b/c.bin\x00", p + "a", p + "zzz", p + "\U0010ffff"]:
            after = [info.key for page in await _list_flat_all(t.backend, p, start_after) for info in page.objects]
            assert after == [key for key in keys if key > start_after], start_after
        # With an end: none past it (a page cut there ends the listing), the same entries.
        for start_after, end in [("", keys[3]), (keys[0], keys[-2]), (keys[2], p + "b/d"), ("", p + "a")]:
            page = await t.backend.list_flat_page(p, start_after, end)
            within = [info for info in page.objects if info.key <= end]
            assert [info.key for info in within] == [key for key in keys if start_after < key <= end]
            assert all(info == flat[info.key] for info in within)
        # A shorter page when asked for one (S3 max-keys): at most that many keys, and the
        # listing goes on from its last.
        for keys_max in (1, 4):
            start_after, listed = "", []
            while True:
                page = await t.backend.list_flat_page(p, start_after, None, keys_max)
                assert len(page.objects) <= keys_max and (page.objects or page.next_token is None)
                listed += [info.key for info in page.objects]
                if page.next_token is None:
                    break
                start_after = page.next_token
            assert listed == keys, keys_max
        # A start key below the prefix lists the prefix from its first key.
        below = await _list_flat_all(t.backend, p, p[:-1])
        assert [info.key for page in below for info in page.objects] == keys

    trio.run(body)


@pytest.mark.timeout(60)
def test_flat_pages_continue_from_their_last_key_through_thousands_of_keys(contract_backend):
    t, p = contract_backend, contract_backend.prefix
    if t.put_many is None:
        pytest.skip(f"{t.name}: no fast bulk seeding")
    objects = {f"{p}d{i % 7}/{i:05d}": i.to_bytes(3, "big") for i in range(2500)}
    t.put_many(objects)
    keys = sorted(objects)

    async def body():
        pages = await _list_flat_all(t.backend, p)
        # (GCS's startOffset includes the key itself, which is dropped: a page of 999.)
        assert len(pages) == 3 and all(len(page.objects) <= 1000 for page in pages) and len(pages[0].objects) == 1000
        assert [info.key for page in pages for info in page.objects] == keys
        assert {info.size_bytes for page in pages for info in page.objects} == {3}
        middle = await _list_flat_all(t.backend, p, keys[1234])
        assert [info.key for page in middle for info in page.objects] == keys[1235:]

    trio.run(body)


@pytest.mark.timeout(30)
def test_upload_stores_an_object_a_read_then_returns(contract_backend):
    t, p = contract_backend, contract_backend.prefix
    data = bytes(range(256)) * 40 + b"index"

    async def body():
        await t.backend.upload(p + "indexes/x.idx", data)
        info = await t.backend.stat(p + "indexes/x.idx")
        assert info.size_bytes == len(data)
        assert await t.backend.read_range(p + "indexes/x.idx", 0, len(data), info.version) == data
        await t.backend.upload(p + "indexes/x.idx", data[:100])  # replaced
        again = await t.backend.stat(p + "indexes/x.idx")
        assert again.size_bytes == 100
        if t.versions == "etag":  # (a Last-Modified in the same second names no new version)
            assert again.version != info.version
        assert await t.backend.read_range(p + "indexes/x.idx", 0, 100, again.version) == data[:100]
        assert t.backend.requests["put"] == 2

    trio.run(body)
