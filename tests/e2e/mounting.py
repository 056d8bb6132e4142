"""Mount a bucket with the real CLI in a subprocess, and always take it down again.

`bucketfs_mount()` runs `python -m bucketfs.cli mount URL MOUNTPOINT -f ...`, waits for
the mount with a deadline (polling `os.path.ismount`, no fixed sleeps), yields the
process, and on exit - normal, exception or Ctrl-C - unmounts (`fusermount3 -u`, then
`-uz` if that fails), then ends the process it started (SIGTERM, SIGKILL after a
timeout). Used by tests/e2e and scripts/demo.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator, Optional, Sequence

from tests.servers import _die_with_parent

MOUNT_DEADLINE_S = 30.0  # a mount answers in well under a second; allow for a loaded CI box
EXIT_DEADLINE_S = 10.0
POLL_INTERVAL_S = 0.02


class MountError(RuntimeError):
    pass


def log_tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return "(no log)"


def unmount(mountpoint: str) -> None:
    """Detach `mountpoint` if mounted: a normal unmount, else a lazy one."""
    for flags in (["-u"], ["-uz"]):
        if not os.path.ismount(mountpoint):
            return
        subprocess.run(["fusermount3", *flags, mountpoint], capture_output=True, timeout=30)


def _end(proc: subprocess.Popen) -> None:
    try:
        proc.wait(EXIT_DEADLINE_S)  # after an unmount the daemon's FUSE loop ends by itself
        return
    except subprocess.TimeoutExpired:
        pass
    proc.terminate()
    try:
        proc.wait(EXIT_DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(EXIT_DEADLINE_S)


@contextlib.contextmanager
def bucketfs_mount(url: str, mountpoint: str, log_path: str, *, endpoint_url: Optional[str] = None,
                   env: Optional[dict] = None, extra_args: Sequence[str] = (),
                   deadline_s: float = MOUNT_DEADLINE_S) -> Iterator[subprocess.Popen]:
    """Mount `url` on `mountpoint` (foreground subprocess, log to `log_path`)."""
    argv = [sys.executable, "-m", "bucketfs.cli", "mount", url, mountpoint, "--foreground", *extra_args]
    if endpoint_url:
        argv += ["--endpoint-url", endpoint_url]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                env=env if env is not None else os.environ.copy(),
                                # Its own session: a Ctrl-C reaches us, not the mount, so the
                                # mount stays up until we unmount it after readers have stopped.
                                start_new_session=True,
                                preexec_fn=_die_with_parent)  # no orphaned mount if we are killed
    try:
        deadline = time.monotonic() + deadline_s
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None:
                raise MountError(f"bucketfs mount exited with {proc.returncode} before mounting:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                raise MountError(f"{mountpoint} not mounted after {deadline_s:.0f} s:\n{log_tail(log_path)}")
            time.sleep(POLL_INTERVAL_S)  # polling interval with a deadline, not synchronisation
        yield proc
    finally:
        try:
            unmount(mountpoint)
        finally:
            _end(proc)
