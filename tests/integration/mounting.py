"""Mount bucketfs for real, with the real CLI in a subprocess, and always clean up."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
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
        # Play systemd's part: bucketfs sends READY=1 to NOTIFY_SOCKET once the mount
        # answers, which is the one reliable signal (a dead mount left on the same path
        # already looks like a mount to os.path.ismount).
        self._sock_dir = tempfile.mkdtemp(prefix="bucketfs-notify-")
        sock_path = os.path.join(self._sock_dir, "notify")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(sock_path)
        self.proc = subprocess.Popen(
            bucketfs_cmd("mount", url, self.mountpoint, "--foreground", "--log-level", "INFO", *args),
            env=dict(env, NOTIFY_SOCKET=sock_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        try:
            self.wait_notify("READY=1", MOUNT_DEADLINE_S)
        except BaseException:
            self.close()
            raise

    def wait_notify(self, message: str, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        while True:
            remaining_s = end - time.monotonic()
            if remaining_s <= 0:
                raise AssertionError(f"no {message} from the mount of {self.url} within {deadline_s} s")
            self._sock.settimeout(min(remaining_s, 0.5))
            try:
                if message in self._sock.recv(4096).decode().split("\n"):
                    return
            except socket.timeout:
                if self.proc.poll() is not None:
                    raise AssertionError(f"mount of {self.url} exited with {self.proc.returncode}: {self.proc.stderr.read()}") from None

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
        self._sock.close()
        shutil.rmtree(self._sock_dir, ignore_errors=True)
