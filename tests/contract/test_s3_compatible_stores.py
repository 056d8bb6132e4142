"""The S3-compatible stores users run, as the S3 backend meets them: stores that send
no ETag or an empty one, ETags that are no MD5s, listed times that are no
modification times (AIStore), and redirects (AIStore's gateways). Real servers on
127.0.0.1 (rclone, moto), with the fronts of bucketfs/testing/s3_fronts.py where no server
behaves so by itself. Every GET path is covered: the curl engine, urllib3 on worker
threads, and the SDK client's ("sdk": the lean path off, as behind a proxy)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time

import botocore.exceptions
import pytest
import trio
import urllib3

from bucketfs import errors
from bucketfs.backends import versions
from bucketfs.backends.s3 import S3Backend
from bucketfs.backends.s3_lean import REDIRECT_HOPS_MAX
from bucketfs.testing.counting_proxy import CountingProxy
from bucketfs.testing.s3_fronts import RedirectFront, RewritingFront, started
from bucketfs.testing.servers import closed_port_url, sdk_only, without_curl

pytestmark = pytest.mark.timeout(60)
ALL_GET_PATHS = ["curl", "urllib3", "sdk"]
# Sizes across the paths: empty, tiny, an ImageFolder sample, past curl's small-GET limit.
SIZES = [0, 1, 100_000, 3 * 1024 * 1024 + 17]
# The GETs _read_tree sends: three reads of each object, but the two empty ranges of
# the empty one (the backend answers those itself).
TREE_GETS_COUNT = 3 * len(SIZES) - 2


def _tree() -> dict:
    return {
        f"d/f{size}.bin": hashlib.sha256(str(size).encode()).digest() * (size // 32) + b"x" * (size % 32)
        for size in SIZES
    }


@contextlib.contextmanager
def _backend(server, bucket: str, path: str, endpoint_url=None):
    config = server.config(bucket, **({"endpoint_url": endpoint_url} if endpoint_url else {}))
    backend = S3Backend(config, session=server.session())
    if path == "urllib3":
        backend = without_curl(backend)
    if path == "sdk":
        backend = sdk_only(backend)
    assert backend.transport.name == path
    try:
        yield backend
    finally:
        trio.run(backend.aclose)


async def _read_tree(backend: S3Backend, tree: dict) -> dict:
    """{key: version} of the listing, having read every object whole and in ranges."""
    page = await backend.list_page("d/")
    listed = {info.key: info for info in page.objects}
    assert set(listed) == set(tree)
    for key, data in tree.items():
        info = listed[key]
        assert info.size_bytes == len(data)
        assert await backend.read_range(key, 0, len(data), info.version, object_bytes=len(data)) == data
        middle = len(data) // 2
        assert (
            await backend.read_range(key, middle, middle + 4096, info.version, object_bytes=len(data))
            == data[middle : middle + 4096]
        )
        buffer = bytearray(len(data))
        got = await backend.read_range_into(key, 0, len(data), info.version, buffer, object_bytes=len(data))
        assert bytes(buffer[:got]) == data
    return {key: info.version for key, info in listed.items()}


@pytest.mark.parametrize("path", ALL_GET_PATHS)
def test_a_store_with_empty_etags_reads_pinned_to_last_modified(rclone_server_no_etag, path, caplog):
    server, tree = rclone_server_no_etag, _tree()
    bucket = server.new_bucket()
    server.write_files(bucket, tree, mtime_s=int(time.time()) - 1000)
    caplog.set_level(logging.INFO, logger="bucketfs.backends.versions")
    with _backend(server, bucket, path) as backend:
        listed = trio.run(_read_tree, backend, tree)
        assert all(version.startswith(versions.LASTMOD_PREFIX) for version in listed.values())
        assert backend.caller.retries_count == 0 and not backend.caller.failures
    assert [r.message for r in caplog.records].count(f"s3://{bucket}: {versions.PINNING_LOG[versions.LASTMOD]}") == 1


@pytest.mark.parametrize("path", ALL_GET_PATHS)
def test_a_store_that_sends_no_etag_at_all_reads_pinned_to_last_modified(rclone_server, path):
    server, tree = rclone_server, _tree()
    bucket = server.new_bucket()
    server.write_files(bucket, tree)
    with (
        started(RewritingFront(server.endpoint_url, strip_etags=True)) as front,
        _backend(server, bucket, path, endpoint_url=front.url) as backend,
    ):
        listed = trio.run(_read_tree, backend, tree)
        assert all(version.startswith(versions.LASTMOD_PREFIX) for version in listed.values())
        assert backend.caller.retries_count == 0


@pytest.mark.parametrize("path", ALL_GET_PATHS)
def test_a_rewrite_is_caught_by_last_modified_where_the_store_ignores_the_condition(rclone_server_no_etag, path):
    """rclone ignores If-Unmodified-Since: the answer's Last-Modified gives it away,
    even at the same size."""
    server = rclone_server_no_etag
    bucket = server.new_bucket()
    server.write_files(bucket, {"k": b"version one"}, mtime_s=int(time.time()) - 1000)

    async def body(backend):
        old = (await backend.list_page("")).objects[0]
        server.write_files(bucket, {"k": b"version two"}, mtime_s=int(time.time()) - 500)  # the same size
        with pytest.raises(errors.ObjectChanged, match="last modified"):
            await backend.read_range("k", 0, 11, old.version, object_bytes=11)
        new = (await backend.list_page("")).objects[0]
        assert await backend.read_range("k", 0, 11, new.version, object_bytes=11) == b"version two"

    with _backend(server, bucket, path) as backend:
        trio.run(body, backend)


@pytest.mark.parametrize("path", ALL_GET_PATHS)
def test_moto_refuses_a_read_pinned_to_an_older_last_modified_with_412(moto_server, path):
    """moto honours If-Unmodified-Since: the store itself refuses (its 412 is the cause);
    an unchanged object listed at a sub-second time is not refused."""
    server = moto_server
    bucket = server.new_bucket()
    server.put(bucket, "k", b"0123456789")

    async def body(backend):
        info = await backend.stat("k")
        pinned_s = info.mtime_ns // versions.NS_PER_S
        assert (
            await backend.read_range("k", 0, 10, f"{versions.LASTMOD_PREFIX}{pinned_s}", object_bytes=10)
            == b"0123456789"
        )
        with pytest.raises(errors.ObjectChanged) as caught:
            await backend.read_range("k", 0, 10, f"{versions.LASTMOD_PREFIX}{pinned_s - 100}", object_bytes=10)
        cause = caught.value.__cause__
        assert isinstance(cause, botocore.exceptions.ClientError)
        assert cause.response["ResponseMetadata"]["HTTPStatusCode"] == 412

    try:
        with _backend(server, bucket, path) as backend:
            trio.run(body, backend)
    finally:
        server.delete_bucket(bucket)


@pytest.mark.parametrize("path", ALL_GET_PATHS)
def test_a_store_that_states_neither_etag_nor_time_is_read_checked_by_size(rclone_server, path, caplog):
    server, tree = rclone_server, _tree()
    bucket = server.new_bucket()
    server.write_files(bucket, tree)
    caplog.set_level(logging.INFO, logger="bucketfs.backends.versions")

    async def body(backend):
        listed = await _read_tree(backend, tree)
        assert set(listed.values()) == {versions.UNPINNED}
        info = (await backend.list_page("d/")).objects[-1]
        server.write_files(bucket, {info.key: b"shorter"})
        with pytest.raises(errors.ObjectChanged):
            await backend.read_range(info.key, 0, 100, info.version, object_bytes=info.size_bytes)

    with (
        started(RewritingFront(server.endpoint_url, strip_etags=True, epoch_times=True)) as front,
        _backend(server, bucket, path, endpoint_url=front.url) as backend,
    ):
        trio.run(body, backend)
    assert f"s3://{bucket}: {versions.PINNING_LOG[versions.SIZE_ONLY]}" in [r.message for r in caplog.records]


@pytest.mark.parametrize("path", ALL_GET_PATHS)
def test_listed_times_at_the_epoch_keep_etag_pinning(rclone_server, path):
    """AIStore lists access times, the epoch for objects never read: the ETag is still
    the version, and the time is a plain 0 (stat shows 1970), never an error."""
    server, tree = rclone_server, _tree()
    bucket = server.new_bucket()
    server.write_files(bucket, tree)
    with (
        started(RewritingFront(server.endpoint_url, epoch_times=True)) as front,
        _backend(server, bucket, path, endpoint_url=front.url) as backend,
    ):

        async def body():
            listed = await _read_tree(backend, tree)
            assert all(versions.kind(version) == versions.ETAG for version in listed.values())
            assert all(info.mtime_ns == 0 for info in (await backend.list_page("d/")).objects)

        trio.run(body)


@pytest.mark.parametrize("path", ALL_GET_PATHS)
def test_etags_that_are_no_md5s_are_versions_and_cost_no_extra_get(rclone_server_xxh3, path):
    server, tree = rclone_server_xxh3, _tree()
    bucket = server.new_bucket()
    server.write_files(bucket, tree)
    with _backend(server, bucket, path) as backend:
        listed = trio.run(_read_tree, backend, tree)
        assert all(len(version) == 16 for version in listed.values())
        assert backend.caller.retries_count == 0 and backend.caller.corrupt_bodies_count == 0
        assert backend.requests["get"] == TREE_GETS_COUNT  # one per read, none again


@pytest.mark.parametrize("path", ALL_GET_PATHS)
def test_redirected_gets_are_followed_and_signed_again_for_their_host(rclone_server, path):
    server, tree = rclone_server, _tree()
    bucket = server.new_bucket()
    server.write_files(bucket, tree)
    with (
        started(RedirectFront(server.endpoint_url)) as front,
        _backend(server, bucket, path, endpoint_url=front.url) as backend,
    ):
        trio.run(_read_tree, backend, tree)
        assert front.redirects_sent == TREE_GETS_COUNT
        assert backend.redirects_count == front.redirects_sent
        assert backend.caller.retries_count == 0
        assert backend.transport.name == path  # redirects do not switch the lean path off


def test_a_redirect_followed_with_the_first_signature_is_refused_by_the_store(rclone_server):
    """What the test above proves: the target checks the signature against its own
    host, so a client that follows without signing again is refused."""
    server = rclone_server
    bucket = server.new_bucket()
    server.put(bucket, "k", b"0123456789")
    with (
        started(RedirectFront(server.endpoint_url)) as front,
        _backend(server, bucket, "urllib3", endpoint_url=front.url) as backend,
    ):
        lean = backend.lean
        assert lean._resolve()
        url = lean.base_url + "k"
        signed = lean._headers(url, {"Range": "bytes=0-9"})
        pool = urllib3.PoolManager()
        redirect = pool.request("GET", url, headers=signed, redirect=False)
        assert redirect.status == 307
        followed = pool.request("GET", redirect.headers["Location"], headers=signed, redirect=False)
        assert followed.status in (400, 403), followed.status
        location = redirect.headers["Location"]
        again = pool.request("GET", location, headers=lean.signed_for(location, {"Range": "bytes=0-9"}), redirect=False)
        assert again.status in (200, 206) and again.data == b"0123456789"


@pytest.mark.parametrize("path", ALL_GET_PATHS)
def test_a_redirect_loop_is_an_error_not_a_hang(rclone_server, path):
    server = rclone_server
    bucket = server.new_bucket()
    server.put(bucket, "k", b"0123456789")

    async def body(backend):
        version = (await backend.list_page("")).objects[0].version
        with trio.fail_after(20):
            with pytest.raises(errors.BackendError, match="redirected"):
                await backend.read_range("k", 0, 10, version)

    with (
        started(RedirectFront(server.endpoint_url, loop=True)) as front,
        _backend(server, bucket, path, endpoint_url=front.url) as backend,
    ):
        trio.run(body, backend)
        assert backend.redirects_count == REDIRECT_HOPS_MAX
        assert backend.caller.retries_count == 0  # a loop is not worth repeating


@pytest.mark.parametrize("path", ALL_GET_PATHS)
def test_a_redirect_to_an_unreachable_host_fails_within_the_retry_budget(rclone_server, path):
    server = rclone_server
    bucket = server.new_bucket()
    server.put(bucket, "k", b"0123456789")

    async def body(backend):
        version = (await backend.list_page("")).objects[0].version
        with trio.fail_after(30):
            with pytest.raises(errors.TransientError):
                await backend.read_range("k", 0, 10, version)

    with (
        started(RedirectFront(server.endpoint_url, target_url=closed_port_url())) as front,
        _backend(server, bucket, path, endpoint_url=front.url) as backend,
    ):
        trio.run(body, backend)
        assert backend.caller.retries_count == backend.caller.policy.attempts_count - 1


class _LeanRefusingFront(CountingProxy):
    """Answers every request the SDK client did not send (no botocore User-Agent) with
    400 AuthorizationHeaderMalformed, as S3 answers a request signed for the wrong
    region; relays the SDK's."""

    def __init__(self, upstream_url: str):
        super().__init__(upstream_url)
        self.refused_count = 0

    def answer(self, handler) -> None:
        if "botocore" in handler.headers.get("User-Agent", "").lower():
            super().answer(handler)
            return
        self.refused_count += 1
        handler.request_body()
        body = (
            b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AuthorizationHeaderMalformed</Code>"
            b"<Message>the region is wrong</Message></Error>"
        )
        handler.send_answer_head(400, "Bad Request", [("Content-Type", "application/xml")], len(body))
        handler.wfile.write(body)


@pytest.mark.parametrize("path", ["curl", "urllib3"])
def test_a_region_error_swaps_the_lean_transport_to_the_sdk_for_good(rclone_server, path, caplog):
    """The one switch at run time: the lean path refused with a region error. The GET
    (or LIST) that met it is served through the SDK client, and so is every later one;
    said once in the log."""
    server = rclone_server
    bucket = server.new_bucket()
    server.write_files(bucket, {"d/a.bin": b"a" * 1000, "d/b.bin": b"b" * 3000})
    caplog.set_level(logging.INFO, logger="bucketfs.backends.s3")

    async def body(backend):
        info = await backend.stat("d/a.bin")  # (HEADs always go through the client)
        assert backend.transport.name == path
        assert await backend.read_range("d/a.bin", 0, 1000, info.version, object_bytes=1000) == b"a" * 1000
        assert backend.transport.name == "sdk" and not backend.lean.usable
        page = await backend.list_page("d/")
        assert [listed.key for listed in page.objects] == ["d/a.bin", "d/b.bin"]
        b = page.objects[1]
        assert await backend.read_range(b.key, 100, 200, b.version, object_bytes=3000) == b"b" * 100

    with (
        started(_LeanRefusingFront(server.endpoint_url)) as front,
        _backend(server, bucket, path, endpoint_url=front.url) as backend,
    ):
        trio.run(body, backend)
        assert front.refused_count == 1  # only the first lean request: none after the swap
        assert backend.caller.retries_count == 0
        assert dict(backend.get_paths) == ({"curl": 1, "threads": 1} if path == "curl" else {"threads": 2})
    swaps = [r.message for r in caplog.records if "from now on" in r.message]
    assert swaps == [
        f"s3://{bucket}: the lean path was refused with 400 AuthorizationHeaderMalformed; "
        "GETs and LISTs go through the SDK client from now on"
    ]
