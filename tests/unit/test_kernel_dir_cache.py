"""--kernel-dir-cache off, or a pyfuse3 outside the tested releases, writes nothing into
pyfuse3's or libfuse's private memory: every access that could write there (ctypes in
fuse/dircache.py, fuse/noopendir.py and fuse/requestsize.py, the wrapper of pyfuse3's OPENDIR handler) is
made to fail the test, and a whole directory walk through the FUSE adapter still works."""

import logging
import pathlib
import re
import tomllib

import pyfuse3
import pytest
import trio

from bucketfs.app import cli, fstab
from bucketfs.backends.memory import MemoryBackend
from bucketfs.fuse import dircache, noopendir, requestsize
from bucketfs.fuse.ops import FuseOperations
from tests.unit.helpers import resolve, run_fs

pytestmark = pytest.mark.timeout(30)

REPO = pathlib.Path(__file__).resolve().parents[2]
FILES = {"d/a": b"1", "d/b": b"22", "d/e/c": b"333"}


class Forbidden:
    """Stands in for the ctypes module of the private-layout code: any use is recorded and fails."""

    def __init__(self):
        self.used = []

    def __getattr__(self, name):
        self.used.append(name)
        raise AssertionError(f"ctypes.{name} used: private memory would be read or written")


@pytest.fixture
def guarded(monkeypatch):
    """ctypes unusable in the private-layout modules; pyfuse3's OPENDIR handler and
    its readdir_reply restored after the test (readdir_reply records the entries)."""
    forbidden = Forbidden()
    monkeypatch.setattr(dircache, "ctypes", forbidden)
    monkeypatch.setattr(noopendir, "ctypes", forbidden)
    monkeypatch.setattr(requestsize, "ctypes", forbidden)
    monkeypatch.setattr(pyfuse3, "fuse_opendir_async", pyfuse3.fuse_opendir_async)  # (restored if replaced)
    replies = []
    monkeypatch.setattr(pyfuse3, "readdir_reply", lambda token, name, attrs, next_id: replies.append(name) or True)
    return forbidden, replies


def walk(**overrides):
    """Start the FUSE adapter on an immutable mount and list d/ through OPENDIR, READDIRPLUS
    and RELEASEDIR, as the kernel does; (ops, the handle OPENDIR gave, its stats)."""
    original_opendir = pyfuse3.fuse_opendir_async

    async def body(fs):
        ops = FuseOperations(fs, fs.config)
        async with trio.open_nursery() as nursery:
            ops.start(nursery)
            d = await resolve(fs, "d")
            fh = await ops.opendir(d.ino, None)  # answered with a handle, not ENOSYS
            await ops.readdir(fh, 0, pyfuse3.ReaddirToken())
            await ops.releasedir(fh)
            nursery.cancel_scope.cancel()
        wrapped = pyfuse3.fuse_opendir_async is not original_opendir
        return ops, fh, dict(fs.stats), wrapped

    return run_fs(MemoryBackend(FILES), body, **overrides)


def test_off_writes_nothing_into_private_memory(guarded):
    forbidden, replies = guarded
    ops, fh, stats, wrapped = walk(kernel_dir_cache="off")
    assert forbidden.used == [] and not wrapped  # no ctypes at all, pyfuse3's handler not wrapped
    assert ops._dir_cache is None and ops._kernel_opens_dirs is None
    assert fh > 0 and replies == [b".", b"..", b"a", b"b", b"e"]
    assert stats.get("namespace.kernel_dir_cache_off") == 1 and "namespace.kernel_opens_dirs" not in stats


def test_the_guard_would_catch_a_write(guarded):
    """The same walk with auto does reach ctypes (so the test above proves something)."""
    forbidden, _replies = guarded
    with pytest.raises((AssertionError, ExceptionGroup)):  # (raised inside the test's nursery)
        walk(kernel_dir_cache="auto")
    assert forbidden.used


@pytest.mark.parametrize("version", ["3.6.0", "4.0.1", "3.2.3", "unknown"])
def test_a_pyfuse3_outside_the_tested_range_switches_the_feature_off_with_one_warning(
    guarded, monkeypatch, caplog, version
):
    forbidden, replies = guarded
    monkeypatch.setattr(pyfuse3, "__version__", version)
    with caplog.at_level(logging.INFO, logger="bucketfs.fuse.dircache"):
        ops, fh, stats, wrapped = walk()  # (auto, the default)
    assert forbidden.used == [] and not wrapped
    assert ops._dir_cache is None and ops._kernel_opens_dirs is None
    assert fh > 0 and b"e" in replies
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"pyfuse3 {version} is not one" in warnings[0], warnings
    assert stats.get("namespace.kernel_dir_cache_off") == 1


def test_the_tested_pyfuse3_uses_the_feature_and_the_pin_is_the_tested_range():
    low, below = dircache.PYFUSE3_TESTED
    installed = dircache.pyfuse3_version()
    assert installed is not None and low <= installed < below  # the suite runs the feature
    assert dircache.private_layouts_allowed("auto", {}) is True
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [dep for dep in deps if re.match(r"pyfuse3\b", dep)]
    assert pin.replace(" ", "") == f"pyfuse3>={'.'.join(map(str, low))},<{'.'.join(map(str, below))}"


def test_a_ttl_mount_never_asks():
    async def body(fs):
        return FuseOperations(fs, fs.config)._dir_cache

    assert run_fs(MemoryBackend(FILES), body, metadata_ttl_s=60) is None


def test_the_switch_on_the_command_line_and_in_fstab():
    args = cli.build_parser().parse_args(["mount", "s3://bkt/x", "/mnt", "--kernel-dir-cache", "off"])
    assert cli.config_from_args(args).kernel_dir_cache == "off"
    assert fstab.options_to_argv("ro,kernel_dir_cache=off") == ["--kernel-dir-cache", "off"]
    defaults = cli.config_from_args(cli.build_parser().parse_args(["mount", "s3://bkt/x", "/mnt"]))
    assert defaults.kernel_dir_cache == "auto"
