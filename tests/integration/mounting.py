"""Mount bucketfs for real, with the real CLI in a subprocess, and always clean up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

MOUNT_DEADLINE_S = 30.0


def bucketfs_cmd(*args) -> list:
    return [sys.executable, "-m", "bucketfs.cli", *args]


def wait_for(predicate, deadline_s: float, what: str, proc=None) -> None:
    """Poll `predicate` until true; fail after `deadline_s` or if `proc` exits first."""
    end = time.monotonic() + deadline_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {deadline_s} s")
        time.sleep(0.02)  # polling interval of a condition wait, not synchronisation


def force_unmount(mountpoint: str) -> None:
    if os.path.ismount(mountpoint) or _is_dead_mount(mountpoint):
        if subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True).returncode != 0:
            subprocess.run(["fusermount3", "-uz", mountpoint], capture_output=True)


def _is_dead_mount(mountpoint: str) -> bool:
    try:
        os.stat(mountpoint)
        return False
    except OSError:
        return True


class Mount:
    """A foreground `bucketfs mount` subprocess serving `url` on `mountpoint`."""

    def __init__(self, url: str, mountpoint: str, env: dict, args=()):
        self.url, self.mountpoint = url, str(mountpoint)
        self.proc = subprocess.Popen(
            bucketfs_cmd("mount", url, self.mountpoint, "--foreground", "--log-level", "INFO", *args),
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        try:
            wait_for(lambda: os.path.ismount(self.mountpoint), MOUNT_DEADLINE_S, f"mount of {url}", self.proc)
        except BaseException:
            self.close()
            raise

    def path(self, *parts) -> str:
        return os.path.join(self.mountpoint, *parts)

    def terminate(self, sig=signal.SIGTERM, timeout_s: float = 30) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)

    def close(self) -> None:
        force_unmount(self.mountpoint)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        if self.proc.stderr:
            self.stderr_text = self.proc.stderr.read()
            self.proc.stderr.close()
