"""Opens held while their file is pushed into the kernel's page cache (core/openpush.py),
on the in-memory backend's fake kernel: the request loop's part (holding the FUSE_IOCTL
and answering it at `resume()`) is tests/unit/test_request_loop.py's."""

import pytest
import trio
import trio.testing

from bucketfs.core import openpush
from tests.unit.helpers import read_all, resolve, run_fs
from tests.unit.test_fetch_ahead import image_folder, kernel_read, shuffled

pytestmark = pytest.mark.timeout(60)
PATH = "train/class01/img0003.jpg"


def mock_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def held_open_read(fs, backend, path: str, resumes: list) -> bytes:
    """A Python reader's open() then read(): its isatty() held, if the daemon holds it,
    until resume(); then the read, from the page cache or through the daemon."""
    node = await resolve(fs, path)
    let_go = trio.Event()

    def resume():
        resumes.append(path)
        let_go.set()

    if fs.open_pushes.hold(node.ino, resume):
        await let_go.wait()
    return await kernel_read(fs, backend, path)


def test_a_small_file_is_pushed_while_its_open_is_held_and_no_read_reaches_the_daemon():
    objects, backend = image_folder()

    async def body(fs):
        fs.start_pushing(-1)
        resumes: list = []
        data = await held_open_read(fs, backend, PATH, resumes)
        node = await resolve(fs, PATH)
        again = fs.open_pushes.hold(node.ino, lambda: resumes.append("again"))
        return data, resumes, again, node, fs.snapshot()

    data, resumes, again, node, stats = run_fs(backend, body, clock=mock_clock())
    assert data == objects[PATH] == backend.kernel_pages[node.ino]
    assert resumes == [PATH]  # let go once
    assert stats["open.held"] == 1 and stats["open.pushed_pushed"] == 1
    assert "read.calls" not in stats  # (the reader found the pages)
    assert backend.requests["get"] == 1
    assert node.served and not again  # (the kernel holds it: the next open is not held)


@pytest.mark.parametrize("outcome", ["refused", "failed"])
def test_an_open_whose_push_failed_is_let_go_and_its_read_fetches_the_file(outcome):
    objects, backend = image_folder()

    async def push_whole(key, version, size_bytes, ino, request):
        await trio.sleep(backend.delay_s)  # (a wrong MD5, or a reset: the worker gives up)
        return outcome, None

    backend.push_whole = push_whole

    async def body(fs):
        fs.start_pushing(-1)
        resumes: list = []
        data = await held_open_read(fs, backend, PATH, resumes)
        return data, resumes, fs.snapshot()

    data, resumes, stats = run_fs(backend, body, clock=mock_clock())
    assert data == objects[PATH]
    assert resumes == [PATH]
    assert stats[f"open.pushed_{outcome}"] == 1
    assert stats["read.calls"] >= 1  # (through the daemon, with every check and retry)


def test_opens_of_one_file_while_its_push_runs_are_let_go_together_after_one_get():
    objects, backend = image_folder()

    async def body(fs):
        fs.start_pushing(-1)
        resumes: list = []
        got: list = []

        async def reader():
            got.append(await held_open_read(fs, backend, PATH, resumes))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(reader)
        return got, resumes, fs.snapshot()

    got, resumes, stats = run_fs(backend, body, clock=mock_clock())
    assert got == [objects[PATH]] * 3
    assert resumes == [PATH] * 3
    assert stats["open.held"] == 3 and stats["open.pushed_pushed"] == 1
    assert backend.requests["get"] == 1


def test_an_open_held_past_its_time_is_let_go_and_its_read_waits_for_the_push(monkeypatch):
    """A slow store: the open is let go after HOLD_MAX_S, once; its READ waits for the
    push still running and takes its body (one GET)."""
    monkeypatch.setattr(openpush, "HOLD_MAX_S", 1.0)
    objects, backend = image_folder(delay_s=3.0)

    async def body(fs):
        fs.start_pushing(-1)
        await resolve(fs, PATH)  # (its directories listed: each request takes the store 3 s)
        resumes: list = []
        started_s = trio.current_time()
        data = await held_open_read(fs, backend, PATH, resumes)
        took_s = trio.current_time() - started_s  # (the READ returned with the push's end)
        return data, resumes, took_s, fs.snapshot()

    data, resumes, took_s, stats = run_fs(backend, body, clock=mock_clock())
    assert data == objects[PATH]
    assert resumes == [PATH]  # (once: not again at the push's end)
    assert stats["open.held_expired"] == 1
    assert stats["open.pushed_read"] == 1  # (the READ asked for the body)
    assert backend.requests["get"] == 1
    assert took_s < 3.0 + 1.0  # (no longer than the GET itself, and a little)


@pytest.mark.parametrize(
    "case", ["no-fetch-ahead-workers", "fetch-workers", "metadata-ttl", "large", "directory", "unknown", "cached"]
)
def test_an_open_is_not_held_where_no_push_would_help(case):
    objects, backend = image_folder()
    objects["train/big.bin"] = b"x" * (9 << 20)  # (past --small-file-bytes, 8 MiB)
    backend.put("train/big.bin", objects["train/big.bin"])

    async def body(fs):
        if case != "no-fetch-ahead-workers":
            fs.start_pushing(-1)
        path = {"large": "train/big.bin", "directory": "train/class01"}.get(case, PATH)
        node = await resolve(fs, path)
        if case == "cached":  # (in the daemon's memory: its READ is answered from there)
            await read_all(fs, PATH)
            node.served = False
        return fs.open_pushes.hold(10**6 if case == "unknown" else node.ino, lambda: None)

    overrides = {"fetch_workers_count": 2} if case == "fetch-workers" else {}
    if case == "metadata-ttl":
        overrides = {"metadata_ttl_s": 60.0}
    assert run_fs(backend, body, clock=mock_clock(), **overrides) is False


def test_a_shuffled_epoch_of_held_opens_reads_every_byte_each_file_fetched_once():
    """The files the loader reaches before the pass are pushed as they are opened; the
    rest by the pass. Every file once, every byte right, few READs."""
    objects, backend = image_folder()

    async def body(fs):
        fs.start_pushing(-1)
        for directory in sorted({path.rsplit("/", 1)[0] for path in objects}):
            fs.note_listed_to_kernel(await resolve(fs, directory))
        out, resumes = {}, []
        queue = iter(shuffled(objects, 5))

        async def worker():
            for path in queue:
                out[path] = await held_open_read(fs, backend, path, resumes)

        async with trio.open_nursery() as nursery:
            for _ in range(16):
                nursery.start_soon(worker)
        return out, resumes, fs.snapshot()

    got, resumes, stats = run_fs(backend, body, clock=mock_clock())
    assert got == objects
    assert stats["open.held"] == len(resumes) > 0
    assert stats["fetch_ahead.files"] > 0  # (the pass pushed the others)
    assert backend.requests["get"] == len(objects)
    # (READs: files opened while the pass's push of them ran, and whose pages it had not
    # written yet; 80 of the 240 with no open held, 5-26 in runs of this test.)
    assert stats.get("read.calls", 0) <= len(objects) // 5 < stats["open.held"]


@pytest.mark.parametrize("running", ["a-pass-push", "a-readers-push"])
def test_an_open_of_a_file_a_pass_is_pushing_waits_for_that_push(running):
    """A pass's push of the file runs: the open is held until it ends (one GET, no
    READ). A reader's push (its body on its way into the daemon) holds no open."""
    objects, backend = image_folder()

    async def body(fs):
        fs.start_pushing(-1)
        node = await resolve(fs, PATH)
        key = fs.key_prefix + node.path
        ended = []
        flight = fs.cache.push_ahead(
            key, node.version, node.size_bytes, node.ino, False, ended.append, for_reader=running == "a-readers-push"
        )
        assert flight is not None
        resumes: list = []
        data = await held_open_read(fs, backend, PATH, resumes)
        return data, resumes, ended, fs.snapshot()

    data, resumes, ended, stats = run_fs(backend, body, clock=mock_clock())
    assert data == objects[PATH]
    assert backend.requests["get"] == 1
    if running == "a-pass-push":
        assert resumes == [PATH] and ended == ["pushed"]
        assert stats["open.held_for_pass"] == 1 and "read.calls" not in stats
    else:
        assert resumes == [] and stats["read.calls"] >= 1
