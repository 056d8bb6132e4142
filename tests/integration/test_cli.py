"""The CLI's contract: one clear line and a distinct exit code for each bad input,
nothing left mounted; daemon mode returns once mounted; signals unmount cleanly."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from bucketfs import errors
from bucketfs.testing.mounting import (
    MOUNT_DEADLINE_S,
    assert_one_line_error,
    mount_cmd,
    run_cli,
    server_env,
    stop_twice_while_a_read_waits_on_a_frozen_store,
    wait_for,
)
from bucketfs.testing.servers import _answers_http, _die_with_parent, free_port, rclone_s3_server

pytestmark = pytest.mark.integration
FAKE_KEYS = dict(AWS_ACCESS_KEY_ID="AKIAEXAMPLEEXAMPLE12", AWS_SECRET_ACCESS_KEY="x" * 40)


def run_mount(server, url: str, mountpoint, *args, cwd=None, **extra_env):
    """`bucketfs mount URL MOUNTPOINT --endpoint-url <server's> ARGS...` with the server's
    credentials (and `extra_env`), run to its end."""
    return run_cli(
        "mount",
        url,
        str(mountpoint),
        "--endpoint-url",
        server.endpoint_url,
        *args,
        env=server_env(server, **extra_env),
        cwd=cwd,
    )


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("not-a-url", "not a bucket URL"),
        ("ftp://bucket/x", "unknown scheme"),
        ("s3://", "not a valid bucket name"),
        ("s3://Bad_Bucket/x", "not a valid bucket name"),
    ],
)
def test_malformed_url(url, fragment, empty_dir):
    assert_one_line_error(run_cli("mount", url, empty_dir), errors.EXIT_USAGE, fragment)
    assert not os.path.ismount(empty_dir)


def test_missing_bucket(rclone_server, empty_dir, tmp_path):
    cache_dir = tmp_path / "cache"
    proc = run_mount(rclone_server, "s3://no-such-bucket-here/x", empty_dir, "--cache-dir", str(cache_dir))
    assert_one_line_error(proc, errors.EXIT_BUCKET_NOT_FOUND, "bucket does not exist")
    assert not os.path.ismount(empty_dir)
    assert list(cache_dir.iterdir()) == []  # the mount's own cache directory went with it


def test_access_denied(rclone_server, s3_bucket, empty_dir):
    proc = run_mount(
        rclone_server, f"s3://{s3_bucket}/", empty_dir, AWS_SECRET_ACCESS_KEY="wrong-secret-key-0000000000000000"
    )
    assert_one_line_error(proc, errors.EXIT_ACCESS_DENIED, "access denied")
    assert "wrong-secret" not in proc.stderr
    assert not os.path.ismount(empty_dir)


def test_no_credentials(rclone_server, s3_bucket, empty_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    proc = run_cli("mount", f"s3://{s3_bucket}/", empty_dir, "--endpoint-url", rclone_server.endpoint_url, env=env)
    assert_one_line_error(proc, errors.EXIT_ACCESS_DENIED)
    assert not os.path.ismount(empty_dir)


def test_unreachable_endpoint_answers_quickly(empty_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        proc = run_cli(
            "mount",
            "s3://some-bucket/",
            empty_dir,
            "--endpoint-url",
            f"http://127.0.0.1:{port}",
            env=server_env(**FAKE_KEYS),
            timeout_s=45,
        )
    assert_one_line_error(proc, errors.EXIT_ENDPOINT_UNREACHABLE, "unreachable")


def test_bad_mountpoints(rclone_server, s3_bucket, tmp_path, mount_factory):
    url = f"s3://{s3_bucket}/"
    assert_one_line_error(
        run_mount(rclone_server, url, tmp_path / "missing"), errors.EXIT_BAD_MOUNTPOINT, "does not exist"
    )
    (tmp_path / "file").write_text("x")
    assert_one_line_error(
        run_mount(rclone_server, url, tmp_path / "file"), errors.EXIT_BAD_MOUNTPOINT, "not a directory"
    )
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert_one_line_error(run_mount(rclone_server, url, tmp_path / "full"), errors.EXIT_BAD_MOUNTPOINT, "not empty")
    (tmp_path / "busy").mkdir()
    mount_factory(rclone_server, s3_bucket, mountpoint=tmp_path / "busy")
    assert_one_line_error(
        run_mount(rclone_server, url, tmp_path / "busy"), errors.EXIT_BAD_MOUNTPOINT, "already a mount"
    )


def test_unusable_cache_dir(rclone_server, s3_bucket, empty_dir, tmp_path):
    (tmp_path / "file").write_text("x")
    proc = run_mount(rclone_server, f"s3://{s3_bucket}/", empty_dir, "--cache-dir", str(tmp_path / "file" / "cache"))
    assert_one_line_error(proc, errors.EXIT_BAD_CACHE_DIR, "cache directory")


def test_unreadable_disk_cache_journal(rclone_server, s3_bucket, empty_dir, tmp_path, mount_factory):
    """A cache directory an earlier mount left, whose journal cannot be read: one line,
    exit 9, nothing mounted (not a traceback from inside the running daemon)."""
    cache_dir = tmp_path / "cache"
    mount_factory(rclone_server, s3_bucket, "", "--cache-dir", str(cache_dir), mountpoint=empty_dir).close()
    (kept,) = cache_dir.iterdir()
    (kept / "journal").unlink()
    (kept / "journal").mkdir()  # open() of it fails: IsADirectoryError
    proc = run_mount(rclone_server, f"s3://{s3_bucket}/", empty_dir, "--cache-dir", str(cache_dir))
    assert_one_line_error(proc, errors.EXIT_BAD_CACHE_DIR, "cache directory")
    assert not os.path.ismount(empty_dir)


def test_no_fuse(rclone_server, s3_bucket, empty_dir):
    proc = run_mount(rclone_server, f"s3://{s3_bucket}/", empty_dir, BUCKETFS_FUSE_DEVICE="/nonexistent/fuse")
    assert_one_line_error(proc, errors.EXIT_NO_FUSE, "FUSE is not available")


def test_bad_option_value():
    proc = run_cli("mount", "s3://b/x", "/tmp", "--max-memory", "lots")
    assert proc.returncode == errors.EXIT_USAGE
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_detaches_lets_open_readers_finish_and_exits_zero(
    rclone_server, s3_bucket, empty_dir, mount_factory, sig
):
    data = os.urandom(3 * 1024 * 1024)
    rclone_server.write_files(s3_bucket, {"f.bin": data})
    m = mount_factory(rclone_server, s3_bucket, mountpoint=empty_dir)
    with open(m.path("f.bin"), "rb", buffering=0) as f:  # a reader mid-file when the signal arrives
        head = f.read(1000)
        m.proc.send_signal(sig)
        wait_for(lambda: not os.path.ismount(empty_dir), MOUNT_DEADLINE_S, "lazy unmount", m.proc)
        assert os.listdir(empty_dir) == []  # detached at once: no new opens
        assert head + f.read() == data  # the open reader still finishes
    assert m.proc.wait(timeout=30) == 0  # the last close ends the daemon


def test_second_signal_stops_at_once(rclone_server, s3_bucket, empty_dir, mount_factory):
    rclone_server.write_files(s3_bucket, {"f.bin": b"x" * 100})
    m = mount_factory(rclone_server, s3_bucket, mountpoint=empty_dir)
    f = open(m.path("f.bin"), "rb")
    m.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: not os.path.ismount(empty_dir), MOUNT_DEADLINE_S, "lazy unmount", m.proc)
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=30) == 0
    with pytest.raises(OSError):
        f.close()  # the daemon is gone: the kernel answers ENOTCONN


def mount_daemonised(server, url: str, mountpoint, log_file, cwd=None):
    """`bucketfs mount` without --foreground (it returns once mounted), logging to `log_file`."""
    return run_mount(server, url, mountpoint, "--log-file", str(log_file), cwd=cwd)


def test_a_daemonised_mount_prints_the_warnings_logged_before_it_answered(
    rclone_server, s3_bucket, empty_dir, tmp_path
):
    """An empty prefix (a typo) is said where the user looks: the terminal, not only
    the daemon's log."""
    rclone_server.write_files(s3_bucket, {"data/a.jpg": b"x"})
    proc = mount_daemonised(rclone_server, f"s3://{s3_bucket}/dat", empty_dir, tmp_path / "bucketfs.log")
    try:
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.splitlines() == [
            f"bucketfs: warning: s3://{s3_bucket}/dat/ is empty: nothing is stored under it (a mistyped prefix?)"
        ]
        assert os.path.ismount(empty_dir)
    finally:
        assert run_cli("unmount", empty_dir).returncode == 0


def test_daemon_mode_returns_once_mounted_and_unmount_stops_it(rclone_server, s3_bucket, empty_dir, tmp_path):
    rclone_server.write_files(s3_bucket, {"p/hello.txt": b"hello"})
    log_file = tmp_path / "bucketfs.log"
    proc = mount_daemonised(rclone_server, f"s3://{s3_bucket}/p", empty_dir, log_file)
    assert proc.returncode == 0, proc.stderr
    assert os.path.ismount(empty_dir)  # mounted when the command returned: no waiting
    assert open(os.path.join(empty_dir, "hello.txt")).read() == "hello"
    assert run_cli("unmount", empty_dir).returncode == 0
    assert not os.path.ismount(empty_dir)
    wait_for(lambda: "unmounted" in log_file.read_text(), MOUNT_DEADLINE_S, "daemon exit")


def test_unmount_recovers_a_dead_mount(rclone_server, s3_bucket, empty_dir, mount_factory):
    m = mount_factory(rclone_server, s3_bucket, mountpoint=empty_dir)
    m.terminate(signal.SIGKILL)  # a crash: the mount is left dead (ENOTCONN)
    with pytest.raises(OSError):
        os.listdir(empty_dir)
    assert run_cli("unmount", empty_dir).returncode == 0
    assert os.listdir(empty_dir) == []


def test_new_mount_recovers_a_dead_mount(rclone_server, s3_bucket, empty_dir, mount_factory):
    rclone_server.write_files(s3_bucket, {"a.txt": b"a"})
    mount_factory(rclone_server, s3_bucket, mountpoint=empty_dir).terminate(signal.SIGKILL)
    mount_factory(rclone_server, s3_bucket, mountpoint=empty_dir)
    assert os.listdir(empty_dir) == ["a.txt"]


def test_a_negative_ttl_without_a_metadata_ttl_is_refused(empty_dir):
    """It would be ignored: the default mode keeps every listing for the mount's life."""
    proc = run_cli("mount", "s3://bucket/x", empty_dir, "--negative-ttl", "5")
    assert_one_line_error(proc, errors.EXIT_USAGE, "--negative-ttl needs --metadata-ttl")
    assert not os.path.ismount(empty_dir)


# -- review fixes: each test fails without its fix --------------------------------


def test_a_missing_profile_is_one_line_and_the_credentials_code(rclone_server, s3_bucket, empty_dir, tmp_path):
    (tmp_path / "aws-config").write_text("[profile other]\nregion = us-east-1\n")
    proc = run_mount(
        rclone_server,
        f"s3://{s3_bucket}/",
        empty_dir,
        "--profile",
        "nosuchprofile",
        AWS_CONFIG_FILE=str(tmp_path / "aws-config"),
    )
    assert_one_line_error(proc, errors.EXIT_ACCESS_DENIED, "nosuchprofile")
    assert not os.path.ismount(empty_dir)


@pytest.mark.parametrize(
    "option, value", [("--endpoint-url", "notaurl"), ("--endpoint-url", "http://"), ("--region", "bad!region")]
)
def test_an_endpoint_or_region_that_cannot_be_is_a_usage_error(option, value, empty_dir):
    proc = run_cli("mount", "s3://some-bucket/", empty_dir, option, value, env=server_env(**FAKE_KEYS))
    assert_one_line_error(proc, errors.EXIT_USAGE, option)


def test_an_endpoint_botocore_refuses_inside_the_daemon_is_a_usage_error(empty_dir):
    """A URL the CLI's own check lets through but botocore refuses when the daemon
    builds its client: still one line and exit 2, not 'daemon failed'."""
    proc = run_cli(
        "mount", "s3://some-bucket/", empty_dir, "--endpoint-url", "http://bad_host!name/", env=server_env(**FAKE_KEYS)
    )
    assert_one_line_error(proc, errors.EXIT_USAGE, "endpoint")
    assert not os.path.ismount(empty_dir)


def test_a_metrics_port_in_use_fails_before_mounting(rclone_server, s3_bucket, empty_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_mount(rclone_server, f"s3://{s3_bucket}/", empty_dir, "--metrics-port", str(port))
    assert_one_line_error(proc, errors.EXIT_METRICS_PORT, "--metrics-port", str(port))
    assert not os.path.ismount(empty_dir)


def test_an_unwritable_log_file_is_named_before_forking(empty_dir):
    proc = run_cli(
        "mount", "s3://some-bucket/", empty_dir, "--log-file", "/nonexistent/dir/x.log", env=server_env(**FAKE_KEYS)
    )
    assert_one_line_error(proc, errors.EXIT_USAGE, "--log-file", "/nonexistent/dir/x.log")


def test_a_symlinked_mountpoint_is_unmounted_on_sigterm(rclone_server, s3_bucket, empty_dir, tmp_path, mount_factory):
    link = tmp_path / "link"
    link.symlink_to(empty_dir)
    m = mount_factory(rclone_server, s3_bucket, mountpoint=str(link))
    assert os.path.ismount(empty_dir)
    # The mount is seen through the symlink too.
    assert_one_line_error(
        run_mount(rclone_server, f"s3://{s3_bucket}/", link), errors.EXIT_BAD_MOUNTPOINT, "already a mount"
    )
    assert m.terminate(signal.SIGTERM, timeout_s=20) == 0
    assert not os.path.ismount(empty_dir)
    assert os.listdir(empty_dir) == []  # not a dead mount


@pytest.mark.timeout(120)
def test_second_signal_ends_the_daemon_while_a_reader_is_blocked_on_a_frozen_store(tmp_path, empty_dir, mount_factory):
    """pyfuse3.terminate() waits for handlers in flight; one blocked on a store that
    stopped answering would hold the daemon for --read-timeout x --retries (150 s)."""
    with rclone_s3_server(tmp_path / "store") as server:
        bucket = server.new_bucket()
        server.write_files(bucket, {"f.bin": b"f" * 300_000})
        m = mount_factory(server, bucket, mountpoint=empty_dir)
        try:
            os.stat(m.path("f.bin"))  # listed while the store answers
            stop_twice_while_a_read_waits_on_a_frozen_store(m, server, m.path("f.bin"))
            assert "exiting now" in m.stderr_text
        finally:
            m.close()  # while its store still runs


def test_unmount_refuses_a_filesystem_that_is_not_bucketfs(empty_dir):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", empty_dir], check=True, timeout=30)
    try:
        proc = run_cli("unmount", empty_dir)
        assert_one_line_error(proc, errors.EXIT_BAD_MOUNTPOINT, "not a bucketfs mount", "tmpfs")
        assert os.path.ismount(empty_dir)
        assert_one_line_error(
            run_cli("unmount", "--lazy", empty_dir), errors.EXIT_BAD_MOUNTPOINT, "not a bucketfs mount"
        )
        assert os.path.ismount(empty_dir)
    finally:
        subprocess.run(["umount", empty_dir], timeout=30)


def test_unmount_of_a_directory_that_is_not_mounted_says_so(empty_dir):
    assert_one_line_error(run_cli("unmount", empty_dir), errors.EXIT_BAD_MOUNTPOINT, "not mounted")


@contextlib.contextmanager
def plain_http_server(root_dir):
    """`python -m http.server` on a free port: answers, but is no S3 endpoint."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
        cwd=root_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    try:
        wait_for(lambda: _answers_http(port), MOUNT_DEADLINE_S, "http.server", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_an_endpoint_that_is_not_s3_is_the_endpoint_code_with_a_hint(empty_dir, tmp_path):
    with plain_http_server(tmp_path) as url:
        proc = run_cli("mount", "s3://some-bucket/", empty_dir, "--endpoint-url", url, env=server_env(**FAKE_KEYS))
    assert_one_line_error(proc, errors.EXIT_ENDPOINT_UNREACHABLE, "is --endpoint-url an S3 endpoint?")
    assert not os.path.ismount(empty_dir)


def _pids_with_arg(arg: str) -> list:
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if arg.encode() in f.read().split(b"\0"):
                    pids.append(int(name))
        except (OSError, ValueError):
            continue
    return pids


def test_the_daemon_leaves_the_callers_directory_and_relative_paths_work(rclone_server, s3_bucket, empty_dir, tmp_path):
    rclone_server.write_files(s3_bucket, {"hello.txt": b"hello"})
    rel_mp = os.path.relpath(empty_dir, tmp_path)
    log_name = f"daemon-{os.getpid()}-{free_port()}.log"  # unique: finds the daemon's PID
    proc = mount_daemonised(rclone_server, f"s3://{s3_bucket}/", rel_mp, log_name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert open(os.path.join(empty_dir, "hello.txt")).read() == "hello"
    (pid,) = _pids_with_arg(log_name)
    assert os.readlink(f"/proc/{pid}/cwd") == "/"
    assert run_cli("unmount", rel_mp, cwd=tmp_path).returncode == 0
    wait_for(lambda: "unmounted" in (tmp_path / log_name).read_text(), MOUNT_DEADLINE_S, "daemon exit")


# -- logging and signals (session 15 review) ----------------------------------------
def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _child_pids(pid: int) -> list:
    """The forked daemons of `bucketfs mount` (pid): children running its own command
    line. Not every child: an import runs `/sbin/ldconfig -p` (ctypes.util.find_library)
    before the fork, and a test that took it for the daemon found no log (one CI run)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    own = _cmdline(pid)
    return [child for child in children if own and _cmdline(child) == own]


def _pid_is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has stopped
    except OSError:
        return True


def test_log_file_is_honoured_in_the_foreground_and_sighup_without_a_terminal_keeps_serving(
    rclone_server, s3_bucket, empty_dir, tmp_path, mount_factory
):
    """The systemd unit runs --foreground: --log-file was ignored there, and SIGHUP (a
    logrotate postrotate) unmounted the data under a training job."""
    rclone_server.write_files(s3_bucket, {"a.txt": b"a"})
    log_file = tmp_path / "bucketfs.log"
    m = mount_factory(rclone_server, s3_bucket, "", "--log-file", str(log_file), mountpoint=empty_dir, new_session=True)
    assert "mounted s3://" in log_file.read_text()
    log_file.rename(tmp_path / "bucketfs.log.1")  # logrotate's rename
    m.proc.send_signal(signal.SIGHUP)
    wait_for(
        lambda: log_file.exists() and "received SIGHUP" in log_file.read_text(),
        MOUNT_DEADLINE_S,
        "the SIGHUP line in a reopened log file",
        m.proc,
    )
    assert m.proc.poll() is None and os.path.ismount(empty_dir)
    assert open(m.path("a.txt")).read() == "a"


def test_sighup_to_a_daemonised_mount_keeps_it_and_a_rotated_log_file_is_reopened(
    rclone_server, s3_bucket, empty_dir, tmp_path
):
    rclone_server.write_files(s3_bucket, {"a.txt": b"a"})
    log_file = tmp_path / f"daemon-{os.getpid()}-{free_port()}.log"  # unique: finds the daemon's PID
    proc = mount_daemonised(rclone_server, f"s3://{s3_bucket}/", empty_dir, log_file)
    assert proc.returncode == 0, proc.stderr
    (pid,) = _pids_with_arg(str(log_file))
    log_file.rename(tmp_path / "rotated.log")
    os.kill(pid, signal.SIGHUP)
    wait_for(
        lambda: log_file.exists() and "received SIGHUP" in log_file.read_text(),
        MOUNT_DEADLINE_S,
        "the SIGHUP line in a reopened log file",
    )
    assert os.path.ismount(empty_dir) and open(os.path.join(empty_dir, "a.txt")).read() == "a"
    assert run_cli("unmount", empty_dir).returncode == 0
    wait_for(lambda: "unmounted" in log_file.read_text(), MOUNT_DEADLINE_S, "daemon exit")
    assert "ERROR" not in log_file.read_text()


def test_a_terminal_hangup_stops_a_foreground_mount(rclone_server, s3_bucket, empty_dir, tmp_path):
    """In a terminal's foreground, SIGHUP means the terminal is gone: stop as on SIGTERM."""
    import fcntl
    import pty
    import termios

    master_fd, slave_fd = pty.openpty()

    def in_its_own_terminal():
        _die_with_parent()
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # stdin is the pty: it becomes the controlling terminal

    log_file = tmp_path / "bucketfs.log"
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(
            mount_cmd(
                f"s3://{s3_bucket}/",
                empty_dir,
                "-f",
                "--log-file",
                str(log_file),
                endpoint_url=rclone_server.endpoint_url,
            ),
            env=server_env(rclone_server),
            stdin=slave_fd,
            stdout=err,
            stderr=err,
            preexec_fn=in_its_own_terminal,
        )
    os.close(slave_fd)
    try:
        wait_for(lambda: os.path.ismount(empty_dir), MOUNT_DEADLINE_S, "mount", proc)
        os.close(master_fd)  # the terminal hangs up: the kernel sends SIGHUP to its session leader
        master_fd = None
        assert proc.wait(timeout=30) == 0
        assert not os.path.ismount(empty_dir)
        assert "received SIGHUP; detaching" in log_file.read_text()
    finally:
        if master_fd is not None:
            os.close(master_fd)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def silent_store():
    """An endpoint that accepts connections and never answers: a hung store. Yields
    (url, listener); listener.accept() returns once a client is waiting on it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.settimeout(MOUNT_DEADLINE_S)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", listener


def ctrl_c_while_the_store_hangs(
    mountpoint, *args, timeout_s: float, while_probing=lambda proc: None, sigint_at_start=signal.SIG_DFL
):
    """`bucketfs mount` against a store that never answers, started with SIGINT's
    disposition `sigint_at_start` (not whatever this process has) and sent SIGINT once
    its probe has connected: (process, stdout, stderr, what `while_probing(process)`
    returned just before the signal)."""

    def preexec() -> None:
        _die_with_parent()
        signal.signal(signal.SIGINT, sigint_at_start)  # (SIG_DFL and SIG_IGN outlive the exec)

    with silent_store() as (url, listener):
        proc = subprocess.Popen(
            mount_cmd("s3://some-bucket/", mountpoint, *args, endpoint_url=url),
            env=server_env(**FAKE_KEYS),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=preexec,
        )
        try:
            conn, _ = listener.accept()  # the probe waits on the store
            with conn:
                seen = while_probing(proc)
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    return proc, out, err, seen


@pytest.mark.parametrize("sigint_at_start", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "ignored"])
def test_ctrl_c_while_a_daemonised_mount_waits_stops_the_daemon(empty_dir, tmp_path, sigint_at_start):
    """The parent exited 130 silently and left the daemon running; it mounted later.
    With SIGINT ignored at start (a script's background job has it so) the parent lost
    the signal and waited on the hung probe, past this test's timeout."""
    proc, out, err, daemon_pids = ctrl_c_while_the_store_hangs(
        empty_dir,
        "--log-file",
        str(tmp_path / "bucketfs.log"),
        timeout_s=30,
        while_probing=lambda proc: _child_pids(proc.pid),
        sigint_at_start=sigint_at_start,
    )  # (the daemon probes, the parent waits for it)
    (daemon_pid,) = daemon_pids
    assert proc.returncode == errors.EXIT_INTERRUPTED, err
    assert err == "bucketfs: interrupted\n" and out == ""
    assert _pid_is_gone(daemon_pid)
    assert not os.path.ismount(empty_dir)


def test_a_daemon_whose_mount_command_is_gone_unmounts_without_a_traceback(tmp_path, empty_dir):
    """The parent killed while the daemon waits on a slow store: once the store answers,
    the daemon mounts, cannot report readiness, and takes that as cancelled."""
    log_file = tmp_path / "bucketfs.log"
    with rclone_s3_server(tmp_path / "store") as server:
        bucket = server.new_bucket()
        server.write_files(bucket, {"a.txt": b"a"})
        env = server_env(server)
        os.kill(server.pid, signal.SIGSTOP)  # the probe waits
        try:
            proc = subprocess.Popen(
                mount_cmd(f"s3://{bucket}/", empty_dir, "--log-file", str(log_file), endpoint_url=server.endpoint_url),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
            wait_for(lambda: _child_pids(proc.pid), MOUNT_DEADLINE_S, "the daemon forked", proc)
            (daemon_pid,) = _child_pids(proc.pid)
            proc.kill()
            proc.wait(timeout=10)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        try:
            wait_for(lambda: _pid_is_gone(daemon_pid), MOUNT_DEADLINE_S, "the daemon's exit")
            text = log_file.read_text()
            assert "is gone (interrupted); unmounting" in text and "unmounted" in text, text
            assert "Traceback" not in text and " ERROR " not in text, text
            assert not os.path.ismount(empty_dir)
        finally:
            if not _pid_is_gone(daemon_pid):
                os.kill(daemon_pid, signal.SIGKILL)


def test_ctrl_c_in_the_foreground_is_prompt_while_the_store_hangs(empty_dir):
    """trio delivered the KeyboardInterrupt only once the probe's thread returned (7.6 s).
    The probe's read timeout is 10 s: an answer well within it was not waiting for the thread."""
    proc, _, err, _ = ctrl_c_while_the_store_hangs(empty_dir, "-f", timeout_s=5)
    assert proc.returncode == errors.EXIT_INTERRUPTED
    assert err.strip().splitlines()[-1] == "bucketfs: interrupted"
    assert not os.path.ismount(empty_dir)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="a private /dev/fuse needs root and unshare"
)
@pytest.mark.parametrize("foreground", [False, True])
def test_a_mount_the_kernel_refuses_gives_libfuses_reason(rclone_server, s3_bucket, empty_dir, foreground):
    """Exit 8 said only 'fuse_session_mount failed' (libfuse's reason went to the
    daemon's /dev/null). /dev/null bound over /dev/fuse in a private mount namespace:
    the device exists, and the kernel refuses the mount."""
    command = mount_cmd(
        f"s3://{s3_bucket}/", empty_dir, *(["-f"] if foreground else []), endpoint_url=rclone_server.endpoint_url
    )
    proc = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount --bind /dev/null /dev/fuse && exec "$@"',
            "-",
            *command,
        ],
        env=server_env(rclone_server),
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == errors.EXIT_MOUNT_FAILED, proc.stderr
    assert len(lines) == 1 or foreground, proc.stderr  # (in the foreground the log comes first)
    assert lines[-1].startswith("bucketfs: mount ") and "Traceback" not in proc.stderr
    assert "fuse: mount failed: Invalid argument" in lines[-1] and "--device /dev/fuse" in lines[-1]


def test_python_dash_m_bucketfs_is_the_command():
    proc = subprocess.run([sys.executable, "-m", "bucketfs", "--version"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.startswith("bucketfs "), proc.stderr


def test_stats_of_a_path_that_is_no_mount_says_what_it_is(tmp_path):
    """It said '(No data available)' of the root file system's xattr."""
    assert_one_line_error(run_cli("stats", str(tmp_path / "nonexistent")), errors.EXIT_BAD_MOUNTPOINT, "does not exist")
    assert_one_line_error(run_cli("stats", str(tmp_path)), errors.EXIT_BAD_MOUNTPOINT, "is not a bucketfs mount")
