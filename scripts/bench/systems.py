"""The mounts under test, each a foreground subprocess with a mount deadline, a clean
stop and its log's problems kept: bucketfs (`Mount`) and, with --alternatives, the
existing FUSE mounts it is compared with (rclone mount, s3fs-fuse)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from .common import MOUNT_DEADLINE_S, REPO
from .procs import drop_caches, is_mounted

# The first mount's disk-cache writes landing before a second mount reads what they stored
# (Mount.wait_disk_cache_writes): ~64 MiB queued at most, written in well under this.
DISK_WRITES_DEADLINE_S = 60.0


class _MountProcess:
    """A FUSE mount served by a foreground subprocess: start, wait for the mount with a
    deadline, stop (unmount, wait, terminate if needed, check nothing is left), keep
    the log of a run that logged problems. Subclasses give the command and details."""

    name = "mount"  # its system's name in the runs (--json)
    title = "mount"  # its column in the table
    unmount_cmds = (["fusermount3", "-u"], ["fusermount3", "-uz"])
    lazy_unmount_cmd = ["fusermount3", "-uz"]
    clean_exit_codes = (0,)

    def __init__(self, backend, bucket: str, mountpoint: str, work_dir: str):
        self.backend, self.bucket, self.mountpoint, self.work_dir = backend, bucket, mountpoint, work_dir
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = None
        self.count = 0
        self.label = ""  # the runs this process served, for its notes
        self.notes: list = []  # warnings/errors it logged

    @property
    def pid(self) -> int:
        return self.proc.pid

    def argv(self) -> list:
        raise NotImplementedError

    def env(self) -> Optional[dict]:
        return None

    @staticmethod
    def missing() -> Optional[str]:
        """Why this mount cannot run here (a note for the report), or None."""
        return None

    def is_problem_line(self, line: str) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        self.count += 1
        self.label = ""
        self.log_path = os.path.join(self.work_dir, f"{self.name}-{self.count}.log")
        argv = self.argv()
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(
                argv,
                cwd=self.work_dir,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + MOUNT_DEADLINE_S
        while not (is_mounted(self.mountpoint) and os.path.ismount(self.mountpoint)):
            if self.proc.poll() is not None:
                tail, self.proc = self._tail(), None
                raise RuntimeError(f"{self.name} exited before mounting: {tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not mount within {MOUNT_DEADLINE_S}s: {self._tail()}")
            time.sleep(0.02)  # polling interval, with a deadline

    def stop(self) -> None:
        """Unmount, wait for the process, and make sure nothing is left."""
        if self.proc is None:
            return
        if is_mounted(self.mountpoint):
            for cmd in self.unmount_cmds:
                if subprocess.run([*cmd, self.mountpoint], capture_output=True).returncode == 0:
                    break
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.notes.append(f"{self.name} {self.count}: still running 15 s after unmount; terminated")
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if is_mounted(self.mountpoint):
            subprocess.run([*self.lazy_unmount_cmd, self.mountpoint], capture_output=True)
        if self.proc.returncode not in self.clean_exit_codes:
            self.notes.append(
                f"{self.name} {self.count} ({self.label}): exited with {self.proc.returncode} after unmount"
            )
        self._collect_log_notes()
        self.proc = None

    def abort(self) -> None:
        """A hung run: kill our process so blocked readers get errors, then detach."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        subprocess.run([*self.lazy_unmount_cmd, self.mountpoint], capture_output=True)

    def _tail(self, chars: int = 1500) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return "(no log)"

    def _collect_log_notes(self) -> None:
        """Keep the log of a process that logged problems (the work dir is removed)."""
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [ln.rstrip() for ln in f if self.is_problem_line(ln)]
        except OSError:
            return
        if lines:
            kept = os.path.join(tempfile.gettempdir(), f"bucketfs-bench-{os.getpid()}-{self.name}{self.count}.log")
            shutil.copy(self.log_path, kept)
            distinct = list(dict.fromkeys(ln.strip(" |+")[:240] for ln in lines if "Traceback" not in ln))
            self.notes.append(
                f"{self.name} {self.count} ({self.label}): {len(lines)} warning/error line(s), log kept in {kept}; "
                + " | ".join(distinct[:3])
            )


class Mount(_MountProcess):
    """One bucketfs daemon (`mount -f` as a subprocess); remount() gives a fresh one."""

    name = "bucketfs"

    def __init__(self, backend, bucket: str, mountpoint: str, max_memory: str, work_dir: str, extra_args=()):
        super().__init__(backend, bucket, mountpoint, work_dir)
        self.max_memory, self.extra_args = max_memory, list(extra_args)

    def argv(self) -> list:
        return [
            sys.executable,
            "-m",
            "bucketfs",
            "mount",
            *self.backend.mount_argv(self.bucket),
            self.mountpoint,
            "-f",
            "--max-memory",
            self.max_memory,
            *self.extra_args,
        ]

    def env(self) -> dict:
        env = dict(os.environ, **self.backend.env())
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def is_problem_line(self, line: str) -> bool:
        return bool(
            (
                " WARNING " in line
                or " ERROR " in line
                or "Traceback" in line
                or re.search(r"^[\s|+]*\w*(Error|Exception)\b.*:", line)
            )
            and not any(known in line for known in self.backend.expected_log_lines)
        )

    def remount(self, drop: bool = True) -> None:
        self.stop()
        if drop:
            drop_caches()
        self.start()

    def wait_disk_cache_writes(self, deadline_s: float = DISK_WRITES_DEADLINE_S) -> bool:
        """Until every byte this daemon fetched is in its disk cache (--cache-dir) or was
        let go unstored (its counters): its background writes landed, the mount still up
        (stop() would wait for them, but another mount is to read them beside this one).
        Exact where each GET covers whole chunks of its object, as W2's whole small files
        do (a part cut mid-chunk stores less, and the deadline ends the wait). False if
        the deadline passed first."""
        from bucketfs.testing.mounting import daemon_stats

        deadline = time.monotonic() + deadline_s
        while True:
            stats = daemon_stats(self.mountpoint)
            done_bytes = stats.get("disk_cache.written_bytes", 0) + stats.get("disk_cache.skipped_bytes", 0)
            if done_bytes >= stats.get("backend.bytes_fetched", 0):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)  # polling interval, with a deadline


class ModuleSetMount(Mount):
    """A bucketfs daemon started with some of its module constants set first (e.g.
    `bucketfs.diskcache.cache.LRU_POLICY = True`): `python3 -c "...; main()" mount ...`,
    the CLI's own main() after the assignments, so no product option is needed for a
    comparison only benchmarks make. `name` names its log and its notes."""

    def __init__(self, *args, name: str = "bucketfs", constants: tuple = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.name = name
        self.constants = tuple(constants)  # ((module, attribute, value), ...)

    def argv(self) -> list:
        argv = super().argv()
        if not self.constants:
            return argv
        lines = ["import importlib, sys"]
        for module, attribute, value in self.constants:
            lines.append(f"setattr(importlib.import_module({module!r}), {attribute!r}, {value!r})")
        lines += ["from bucketfs.app.cli import main", "sys.exit(main())"]
        assert argv[1:3] == ["-m", "bucketfs"]
        return [argv[0], "-c", "; ".join(lines), *argv[3:]]


@contextlib.contextmanager
def serving(bench, mount: Mount):
    """Within the block, `bench`'s runs of system "bucketfs" measure `mount` (a daemon with
    other options than bench.mount's, on the same mountpoint): the daemon's CPU and
    counters, the watchdog's abort. bench.mount is stopped first; `mount` is started,
    stopped after, and its log notes join bench.mount's (the report prints those)."""
    bench.mount.stop()
    saved, bench.mount = bench.mount, mount
    try:
        mount.start()
        yield mount
    finally:
        mount.stop()
        bench.mount = saved
        saved.notes.extend(mount.notes)


@contextlib.contextmanager
def beside(bench, name: str):
    """A second bucketfs daemon with bench.mount's options (its --cache-dir too) at a
    mountpoint of its own, while bench.mount stays up. Within the block, bench's runs of
    system "bucketfs" measure the second (bench.mount and bench.mountpoint are its: the
    daemon's CPU and counters, the watchdog's abort, root()); it is stopped after, as
    every mount is, failure or not, and its log notes join the first's."""
    first = bench.mount
    mountpoint = os.path.join(bench.work_dir, f"{name}-mnt")
    os.makedirs(mountpoint, exist_ok=True)
    second = Mount(first.backend, first.bucket, mountpoint, first.max_memory, first.work_dir, first.extra_args)
    second.name = name  # (its log's and notes' name)
    saved = bench.mount, bench.mountpoint
    bench.mount, bench.mountpoint = second, mountpoint
    try:
        second.start()
        yield second
    finally:
        second.stop()
        bench.mount, bench.mountpoint = saved
        first.notes.extend(second.notes)


class RcloneMount(_MountProcess):
    """--alternatives: `rclone mount :s3:BUCKET` as a foreground subprocess, through the proxy."""

    name = "rclone-mount"
    title = "rclone mount"
    unmount_cmds = (["fusermount", "-u"], ["fusermount3", "-u"], ["fusermount", "-uz"], ["fusermount3", "-uz"])
    lazy_unmount_cmd = ["fusermount", "-uz"]
    clean_exit_codes = (0, -signal.SIGTERM)

    def argv(self) -> list:
        from bucketfs.testing.servers import rclone_binary

        config = os.path.join(self.work_dir, "rclone.conf")  # empty: the remote is all on the command line
        open(config, "a").close()
        server = self.backend.server
        return [
            rclone_binary(),
            "mount",
            f":s3:{self.bucket}",
            self.mountpoint,
            "--read-only",
            "--s3-provider",
            "Other",
            "--s3-endpoint",
            self.backend.proxy.url,
            "--s3-access-key-id",
            server.access_key,
            "--s3-secret-access-key",
            server.secret_key,
            "--s3-region",
            server.region,
            "--s3-force-path-style",
            "--vfs-cache-mode",
            "off",
            "--dir-cache-time",
            "1h",
            "--attr-timeout",
            "1h",
            "--daemon-wait",
            "0",
            # Without it rclone HEADs every file it stats or opens (for the mtime in its metadata):
            # W3's 20,000 stats one after another would take ~8 min, past RUN_TIMEOUT_S.
            "--use-server-modtime",
            "--config",
            config,
        ]

    def is_problem_line(self, line: str) -> bool:
        return "ERROR" in line or "panic" in line


class S3fsMount(_MountProcess):
    """--alternatives: s3fs-fuse (`apt-get install s3fs`) in the foreground, through the
    proxy. Its caches set for data that does not change, as bucketfs's immutable default:
    stats cached for an hour (and misses), no local disk cache (`use_cache` unset: reads
    go to the store, as bucketfs without --cache-dir), 16 parallel ranged GETs."""

    name = title = "s3fs"
    clean_exit_codes = (0, -signal.SIGTERM)

    @staticmethod
    def missing() -> Optional[str]:
        return None if shutil.which("s3fs") else "s3fs not installed (apt-get install s3fs): its column is left out"

    def argv(self) -> list:
        server = self.backend.server
        passwd = os.path.join(self.work_dir, "s3fs.passwd")
        with open(os.open(passwd, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(f"{server.access_key}:{server.secret_key}\n")
        options = [
            f"url={self.backend.proxy.url}",
            "use_path_request_style",
            f"endpoint={server.region}",
            f"passwd_file={passwd}",
            "ro",
            "stat_cache_expire=3600",
            "enable_noobj_cache",
            "max_stat_cache_size=200000",
            "parallel_count=16",
            "multireq_max=32",
        ]
        return ["s3fs", self.bucket, self.mountpoint, "-f", "-o", ",".join(options)]

    def is_problem_line(self, line: str) -> bool:
        return "[ERR]" in line or "[CRT]" in line


# --alternatives: existing FUSE mounts run as further systems, in this order.
ALTERNATIVE_MOUNTS = (RcloneMount, S3fsMount)


def _option_value(argv: list, option: str) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def _empty_disk_cache(cache_dir: str) -> None:
    """Delete what bucketfs cached in `cache_dir` (its own directories only: the ones
    with a journal, or a mount's private one)."""
    if not os.path.isdir(cache_dir):
        return
    for entry in os.scandir(cache_dir):
        if entry.is_dir() and (
            os.path.exists(os.path.join(entry.path, "journal")) or re.match(r"bucketfs-\d+-", entry.name)
        ):
            shutil.rmtree(entry.path, ignore_errors=True)
