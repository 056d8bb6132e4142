"""A whole mount, FUSE included, on the in-memory backend: `mount.serve` with a
backend factory, in a subprocess of its own, and no store at all. What the kernel
reads through the mount must be the backend's bytes, exactly; the mount must then
unmount cleanly (fusermount3 -u ends the daemon with exit 0)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from bucketfs.testing.mounting import EXIT_DEADLINE_S, MOUNT_DEADLINE_S, daemon_stats, force_unmount, wait_for
from bucketfs.testing.servers import _die_with_parent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1024 * 1024


def _files() -> dict:
    """{key: bytes}: empty, tiny, an ImageFolder-sized sample, and one past the small-file
    limit (read ahead in parts), in nested directories."""
    rng = random.Random(35)
    return {
        "a.txt": b"hello, memory\n",
        "empty": b"",
        "d/b.jpg": rng.randbytes(300_000),
        "d/e/c.bin": rng.randbytes(5 * MiB + 17),
        "d/e/f.txt": b"f" * 4096,
    }


def _serve(mountpoint: str, ready_path: str) -> int:
    """The child: serve `_files()` from a MemoryBackend on `mountpoint`, in the
    foreground, until unmounted; READY in `ready_path` once the mount answers."""
    from bucketfs.app import daemon
    from bucketfs.backends.memory import MemoryBackend
    from bucketfs.config import Config, parse_bucket_url

    config = Config(url=parse_bucket_url("s3://in-memory/"), mountpoint=mountpoint, foreground=True, log_level="INFO")
    daemon.setup_logging(config, daemon=False)
    built = []

    def memory_backend(given: Config) -> MemoryBackend:
        assert given is config
        built.append(MemoryBackend(_files()))
        return built[0]

    def on_ready() -> None:
        with open(ready_path, "w") as f:
            f.write("READY")

    code = daemon.serve_here(config, on_ready, backend_factory=memory_backend)
    assert len(built) == 1
    return code


@pytest.fixture
def memory_mount(tmp_path):
    """(mountpoint, process) of a mount served by `_serve`; unmounted (-u, then -uz)
    and its process ended after the test, whatever happened."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    ready_path, log_path = tmp_path / "ready", tmp_path / "daemon.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.test_memory_mount", str(mountpoint), str(ready_path)],
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    try:
        wait_for(ready_path.exists, MOUNT_DEADLINE_S, "the in-memory mount answers", proc)
        yield str(mountpoint), proc
    finally:
        force_unmount(str(mountpoint))
        try:
            proc.wait(timeout=EXIT_DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=EXIT_DEADLINE_S)
        print(f"--- daemon log (tail) ---\n{log_path.read_text(errors='replace')[-6000:]}")  # (shown on failure)


def test_a_whole_mount_runs_on_the_in_memory_backend(memory_mount):
    mountpoint, proc = memory_mount
    files = _files()
    assert os.path.ismount(mountpoint)
    assert sorted(os.listdir(mountpoint)) == ["a.txt", "d", "empty"]
    assert sorted(os.listdir(os.path.join(mountpoint, "d", "e"))) == ["c.bin", "f.txt"]
    for key, data in files.items():
        path = os.path.join(mountpoint, *key.split("/"))
        assert os.stat(path).st_size == len(data), key
        with open(path, "rb") as f:
            assert f.read() == data, key  # through the kernel, byte-identical
    big = files["d/e/c.bin"]
    fd = os.open(os.path.join(mountpoint, "d", "e", "c.bin"), os.O_RDONLY)
    try:
        for offset in random.Random(1).sample(range(len(big)), 20):
            assert os.pread(fd, 70_000, offset) == big[offset : offset + 70_000]
    finally:
        os.close(fd)
    stats = daemon_stats(mountpoint)
    assert stats["backend.requests.get"] >= len([data for data in files.values() if data])  # the memory backend's
    assert not any(name.startswith("backend.get_path.") for name in stats)  # (no store's transport)
    # A clean unmount ends the FUSE loop, and the daemon with it.
    result = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert proc.wait(timeout=EXIT_DEADLINE_S) == 0
    assert not os.path.ismount(mountpoint)


if __name__ == "__main__":
    sys.exit(_serve(*sys.argv[1:]))
