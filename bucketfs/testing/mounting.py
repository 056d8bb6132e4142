"""Mount bucketfs for real, with the real CLI in a subprocess, and always clean up.

Used by the integration and e2e tests and by scripts/demo.py. Readiness comes from
the daemon itself: the harness plays systemd's part (a datagram socket as
NOTIFY_SOCKET) and waits for READY=1, which bucketfs sends only once the mount
answers; a dead mount left on the same path would fool os.path.ismount. The
daemon logs to a file, so a chatty mount never blocks on a full pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import mmap
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from bucketfs.app.mountpoints import fusectl_dir
from bucketfs.metrics import STATS_FILE_NAME, decode_stats
from bucketfs.testing.servers import _die_with_parent

MOUNT_DEADLINE_S = 30.0  # a mount answers in well under a second; room for a loaded CI box
EXIT_DEADLINE_S = 15.0


class MountError(RuntimeError):
    pass


def bucketfs_cmd(*args) -> list:
    return [sys.executable, "-m", "bucketfs", *args]


def mount_cmd(url: str, mountpoint, *args, endpoint_url=None) -> list:
    """`bucketfs mount URL MOUNTPOINT [--endpoint-url ENDPOINT_URL] ARGS...`."""
    return bucketfs_cmd(
        "mount", url, str(mountpoint), *(("--endpoint-url", endpoint_url) if endpoint_url else ()), *args
    )


def server_env(server=None, **extra) -> dict:
    """This process's environment for a `bucketfs` subprocess, with `server`'s variables
    (S3Server.env(), GCSServer.env()) and `extra`; STORAGE_EMULATOR_HOST is left out,
    so that only --endpoint-url (or `extra`) says where a gs:// store is."""
    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    env.update(server.env() if server is not None else {}, **extra)
    return env


def run_cli(*args, env=None, timeout_s: float = 60, cwd=None) -> subprocess.CompletedProcess:
    """`bucketfs ARGS...` run to its end, stdout and stderr captured as text."""
    return subprocess.run(bucketfs_cmd(*args), env=env, capture_output=True, text=True, timeout=timeout_s, cwd=cwd)


def run_cli_on_a_terminal(*args, env=None, timeout_s: float = 120) -> tuple:
    """(exit code, bytes shown) of `bucketfs ARGS...` run to its end with its stderr on a
    pseudo-terminal (progress bars show only there); stdout is piped."""
    import pty
    import select

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(bucketfs_cmd(*args), env=env, stdout=subprocess.PIPE, stderr=follower, timeout=timeout_s)
        os.close(follower)
        shown = b""
        while select.select([leader], [], [], 0.5)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # (EIO once the terminal's other side is closed and drained)
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
    return proc.returncode, shown


def assert_one_line_error(proc, code: int, *fragments) -> None:
    """`proc` failed with exit `code` and one line `bucketfs: ...` holding every fragment."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("bucketfs: ")
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def wait_for(predicate, deadline_s: float, what: str, proc=None) -> None:
    """Poll `predicate` until true; fail after `deadline_s` or if `proc` exits first."""
    end = time.monotonic() + deadline_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {deadline_s} s")
        time.sleep(0.02)  # polling interval of a condition wait, not synchronisation


def fuse_requests_waiting(path_in_mount: str):
    """Requests the kernel has sent to this mount's daemon and not had answered
    (fusectl's `waiting`); None where fusectl cannot be read (not root, not mounted)."""
    path = os.path.join(fusectl_dir(os.stat(path_in_mount).st_dev), "waiting")
    try:
        with open(path) as f:
            return int(f.read())
    except OSError:
        return None


def daemon_stats(path_in_mount: str) -> dict:
    """The daemon's counters (`bucketfs stats --json`), read through the mount's root."""
    while not os.path.ismount(path_in_mount):
        path_in_mount = os.path.dirname(path_in_mount)
    with open(os.path.join(path_in_mount, STATS_FILE_NAME), "rb") as f:
        return decode_stats(f.read())


def _is_dead_mount(mountpoint: str) -> bool:
    try:
        os.listdir(mountpoint)
        return False
    except OSError:
        return os.path.exists(os.path.dirname(mountpoint))


def force_unmount(mountpoint: str) -> None:
    """Detach `mountpoint` if it is mounted (or a dead mount): -u, then -uz."""
    for flags in (["-u"], ["-uz"]):
        if not (os.path.ismount(mountpoint) or _is_dead_mount(mountpoint)):
            return
        subprocess.run(["fusermount3", *flags, mountpoint], capture_output=True, timeout=30)


class Mount:
    """A foreground `bucketfs mount` subprocess serving `url` on `mountpoint`."""

    def __init__(
        self,
        url: str,
        mountpoint: str,
        env: dict,
        args=(),
        log_path: str | None = None,
        new_session: bool = False,
        endpoint_url: str | None = None,
    ):
        self.url, self.mountpoint = url, str(mountpoint)
        self._tmp_dir = tempfile.mkdtemp(prefix="bucketfs-mount-")
        self.log_path = log_path or os.path.join(self._tmp_dir, "bucketfs.log")
        sock_path = os.path.join(self._tmp_dir, "notify")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(sock_path)
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(
                mount_cmd(
                    url, self.mountpoint, "--foreground", "--log-level", "INFO", *args, endpoint_url=endpoint_url
                ),
                env=dict(env, NOTIFY_SOCKET=sock_path),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                # new_session: a Ctrl-C at the terminal reaches the caller, which unmounts
                # after its readers stopped, rather than the daemon mid-read.
                start_new_session=new_session,
                preexec_fn=_die_with_parent,
            )
        try:
            self.wait_notify("READY=1", MOUNT_DEADLINE_S)
        except BaseException:
            self.close()
            raise

    @property
    def stderr_text(self) -> str:
        if hasattr(self, "_saved_log"):
            return self._saved_log
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return "(no log)"

    def wait_notify(self, message: str, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        while True:
            remaining_s = end - time.monotonic()
            if remaining_s <= 0:
                raise MountError(
                    f"no {message} from the mount of {self.url} within {deadline_s} s:\n{self.stderr_text[-3000:]}"
                )
            self._sock.settimeout(min(remaining_s, 0.5))
            try:
                if message in self._sock.recv(4096).decode().split("\n"):
                    return
            except socket.timeout:
                if self.proc.poll() is not None:
                    raise MountError(
                        f"mount of {self.url} exited with {self.proc.returncode}:\n{self.stderr_text[-3000:]}"
                    ) from None

    def path(self, *parts) -> str:
        return os.path.join(self.mountpoint, *parts)

    def stats(self) -> dict:
        return daemon_stats(self.mountpoint)

    def terminate(self, sig=signal.SIGTERM, timeout_s: float = 30) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)

    def close(self) -> None:
        force_unmount(self.mountpoint)
        try:
            self.proc.wait(timeout=EXIT_DEADLINE_S)  # after an unmount the FUSE loop ends by itself
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=EXIT_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=EXIT_DEADLINE_S)
        self._sock.close()
        if self.log_path.startswith(self._tmp_dir):
            self._saved_log = self.stderr_text
        shutil.rmtree(self._tmp_dir, ignore_errors=True)


@contextlib.contextmanager
def bucketfs_mount(url: str, mountpoint: str, log_path: str, *, endpoint_url=None, env=None, extra_args=()):
    """`with bucketfs_mount(...) as mount:` a Mount that is always torn down."""
    mount = Mount(
        url,
        mountpoint,
        env if env is not None else dict(os.environ),
        extra_args,
        log_path=log_path,
        new_session=True,
        endpoint_url=endpoint_url,
    )
    try:
        yield mount
    finally:
        mount.close()


def assert_every_write_is_erofs(mount: Mount, dirname: str, filename: str, subdir: str) -> None:
    """Every write operation on `dirname/filename` (and `dirname/subdir`) fails with EROFS."""
    f, d, w = mount.path(dirname, filename), mount.path(dirname, subdir), lambda name: mount.path(dirname, name)
    ops = {
        "create": lambda: open(w("new.txt"), "x"),
        "open-write": lambda: open(f, "w"),
        "open-append": lambda: open(f, "a"),
        "open-rw": lambda: open(f, "r+"),
        "truncate": lambda: os.truncate(f, 0),
        "mkdir": lambda: os.mkdir(w("nd")),
        "unlink": lambda: os.unlink(f),
        "rmdir": lambda: os.rmdir(d),
        "rename": lambda: os.rename(f, w("h.txt")),
        "chmod": lambda: os.chmod(f, 0o777),
        "chown": lambda: os.chown(f, 1234, 1234),
        "utime": lambda: os.utime(f, (0, 0)),
        "symlink": lambda: os.symlink(filename, w("ln")),
        "link": lambda: os.link(f, w("hard")),
        "setxattr": lambda: os.setxattr(f, "user.k", b"v"),
        "removexattr": lambda: os.removexattr(f, "user.k"),
        "mknod": lambda: os.mkfifo(w("fifo")),
    }
    for name, op in ops.items():
        try:
            op()
        except OSError as exc:
            assert exc.errno == errno.EROFS, f"{name}: {exc}"
        else:
            raise AssertionError(f"{name} succeeded on a read-only mount")


def assert_tree_copies_out(mount: Mount, files: dict, copy_dir) -> None:
    """Copying the mount out gives exactly `files` ({relative path: bytes}), and every
    stat size (from the listing) is right."""
    shutil.copytree(mount.mountpoint, copy_dir)
    sha = lambda data: hashlib.sha256(data).hexdigest()  # noqa: E731
    copied = {str(p.relative_to(copy_dir)): sha(p.read_bytes()) for p in copy_dir.rglob("*") if p.is_file()}
    assert copied == {path: sha(data) for path, data in files.items()}
    for path, data in files.items():
        assert os.stat(mount.path(path)).st_size == len(data)


def assert_complete_listing(mount: Mount, dirname: str, names: list) -> None:
    """`dirname` lists exactly `names`, in store order, the same way twice."""
    first = os.listdir(mount.path(dirname))
    assert first == names  # store order, every entry exactly once
    assert os.listdir(mount.path(dirname)) == first
    with os.scandir(mount.path(dirname)) as it:
        assert sum(1 for e in it if e.is_file()) == len(names)


# Names that URL-encoding, shells and XML all treat specially; every store must carry them.
SPECIAL_NAMES = [
    "with space.txt",
    "per%25cent%",
    "plus+sign",
    "hash#tag",
    "quest?ion",
    "eq=ual",
    "amp&ersand",
    "ünïcødé.txt",
    "日本語.bin",
    "emoji-🚀",
    "semi;colon",
    "quote'd",
]


def special_name_objects(dirname: str, names: list) -> dict:
    """{key: bytes} of one object per name under `dirname`: the name three times."""
    return {f"{dirname}/{n}": n.encode() * 3 for n in names}


def assert_special_names_read_back(mount: Mount, dirname: str, names: list, extra_entries=()) -> None:
    assert sorted(os.listdir(mount.path(dirname))) == sorted([*names, *extra_entries])
    for n in names:
        with open(mount.path(dirname, n), "rb") as f:
            assert f.read() == n.encode() * 3, n


def assert_overwrite_mid_read_is_stale(mount_at, put_many) -> None:
    """An object overwritten while a handle reads it gives ESTALE (or EIO), never bytes
    of the new version; a small file listed before the overwrite is read whole in its
    new version once the ESTALE has listed the directory again; the mount keeps
    serving. `put_many({key: bytes})` writes to the bucket; `mount_at(*args)` mounts
    its root with extra options."""
    mib = 1024 * 1024
    old, new = random.Random(1).randbytes(24 * mib), random.Random(2).randbytes(24 * mib)
    put_many({"v/big.bin": old, "v/small.jpg": old[:100_000]})
    # Small read-ahead so the rest of the object is not fetched before the overwrite.
    m = mount_at("--readahead-max", "1M", "--part-size", "1M", "--small-file-bytes", "1M")
    os.stat(m.path("v", "small.jpg"))  # listed (and pinned) before the overwrite
    fd = os.open(m.path("v", "big.bin"), os.O_RDONLY)
    try:
        head = os.pread(fd, 128 * 1024, 0)
        assert head == old[: len(head)]
        put_many({"v/big.bin": new, "v/small.jpg": new[:100_000]})
        with pytest.raises(OSError) as info:
            for off in range(20 * mib, 24 * mib, 1 * mib):
                data = os.pread(fd, 64 * 1024, off)
                assert data == old[off : off + len(data)], "bytes of the new version leaked"
        assert info.value.errno in (errno.ESTALE, errno.EIO)
    finally:
        os.close(fd)
    # The ESTALE lists the directory again: an open of a name then reads its new version
    # (before that listing is in, ESTALE), never a mix and never the old one.

    def reads_new_small() -> bool:
        try:
            with open(m.path("v", "small.jpg"), "rb") as f:
                data = f.read()
        except OSError as exc:
            assert exc.errno in (errno.ESTALE, errno.EIO)
            return False
        assert data == new[:100_000], "an open after the overwrite read bytes of no single version"
        return True

    wait_for(reads_new_small, 30, "an open after the overwrite reads the new version")
    assert os.listdir(m.path("v")) == ["big.bin", "small.jpg"]  # the mount keeps serving


def stop_twice_while_a_read_waits_on_a_frozen_store(mount: "Mount", server, path: str) -> None:
    """The store frozen (SIGSTOP), a thread reads `path` through `mount` until its READ
    reaches the daemon, then SIGTERM, the lazy unmount, and SIGTERM again: the daemon
    must exit 0 within its stop deadline and the blocked reader get an OSError, not wait
    for ever. The store runs again however this ends."""
    import queue
    import threading

    from bucketfs.app.mount import STOP_DEADLINE_S

    result: queue.Queue = queue.Queue()

    def read():
        try:
            with open(path, "rb") as f:
                result.put(f.read())
        except OSError as exc:
            result.put(exc)

    os.kill(server.pid, signal.SIGSTOP)
    try:
        before = mount.stats().get("fuse.read", 0)
        threading.Thread(target=read, daemon=True).start()
        wait_for(lambda: mount.stats().get("fuse.read", 0) > before, MOUNT_DEADLINE_S, "a READ in flight", mount.proc)
        mount.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not os.path.ismount(mount.mountpoint), MOUNT_DEADLINE_S, "lazy unmount", mount.proc)
        mount.proc.send_signal(signal.SIGTERM)
        assert mount.proc.wait(timeout=STOP_DEADLINE_S + 10) == 0
        assert isinstance(result.get(timeout=10), OSError)  # the blocked reader got an error
    finally:
        os.kill(server.pid, signal.SIGCONT)


@contextlib.contextmanager
def pinned_in_page_cache(paths):
    """Every byte of `paths` in the page cache, and kept there (mmap + mlock) for the
    block: pages read once sit on the kernel's inactive list, and under page-cache
    pressure (a fresh CI machine that just installed torch) reclaim may drop one
    between two epochs; that is the kernel's memory policy, not bucketfs's. Pages
    not cached are read in here, through the mount, before the caller counts."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mlock.argtypes = libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    mapped = []
    try:
        for path in paths:
            size = os.path.getsize(path)
            if not size:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            finally:
                os.close(fd)  # (the mapping holds the file)
            assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
            mapped.append((addr, size))
            assert libc.mlock(addr, size) == 0, os.strerror(ctypes.get_errno())
        yield
    finally:
        for addr, size in mapped:
            libc.munmap(addr, size)  # (munmap unlocks)


def drop_page_cache() -> bool:
    """Drop the kernel's page, dentry and inode caches (a later read reaches the
    daemon); False where not allowed (not root: a pass may then be served from them)."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False
