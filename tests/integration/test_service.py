"""Running as a service: systemd unit, readiness, fstab helper, stats and metrics."""

import errno
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import urllib.request

import pytest

from bucketfs import errors
from bucketfs.testing.mounting import (
    MOUNT_DEADLINE_S,
    assert_one_line_error,
    bucketfs_cmd,
    daemon_stats,
    mount_cmd,
    run_cli,
    server_env,
)
from bucketfs.testing.servers import free_port

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_unit_file_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    proc = subprocess.run(
        [analyze, "verify", os.path.join(REPO, "systemd", "bucketfs@.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "bucketfs" not in proc.stderr  # no warning about our unit at all
    broken = tmp_path / "broken@.service"  # and the check can fail
    broken.write_text(
        open(os.path.join(REPO, "systemd", "bucketfs@.service")).read().replace("/usr/bin/env", "/nonexistent/env")
    )
    assert subprocess.run([analyze, "verify", str(broken)], capture_output=True, timeout=60).returncode != 0


def test_ready_only_once_the_mount_answers_and_stopping_on_sigterm(rclone_server, s3_bucket, empty_dir, tmp_path):
    rclone_server.write_files(s3_bucket, {"d/x.txt": b"x"})
    sock_path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(sock_path)
        sock.settimeout(MOUNT_DEADLINE_S)
        proc = subprocess.Popen(
            mount_cmd(f"s3://{s3_bucket}/", empty_dir, "-f", endpoint_url=rclone_server.endpoint_url),
            env=server_env(rclone_server, NOTIFY_SOCKET=sock_path),
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert sock.recv(4096) == b"READY=1"
            # The moment READY arrives, the mount is live and serving the bucket.
            assert os.path.ismount(empty_dir)
            assert os.listdir(empty_dir) == ["d"]
            proc.send_signal(signal.SIGTERM)
            assert sock.recv(4096) == b"STOPPING=1"
            assert proc.wait(timeout=30) == 0
            assert not os.path.ismount(empty_dir)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stderr.close()


def test_no_ready_when_the_mount_fails(tmp_path, empty_dir):
    sock_path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(sock_path)
        sock.setblocking(False)
        proc = run_cli(
            "mount",
            "s3://bucket/",
            empty_dir,
            "-f",
            "--no-sign-request",
            "--endpoint-url",
            f"http://127.0.0.1:{free_port()}",
            env=server_env(NOTIFY_SOCKET=sock_path),
        )
        assert proc.returncode == errors.EXIT_ENDPOINT_UNREACHABLE
        with pytest.raises(BlockingIOError):
            sock.recv(4096)


def test_fstab_helper_as_mount_invokes_it(rclone_server, s3_bucket, empty_dir):
    rclone_server.write_files(s3_bucket, {"prefix/a.txt": b"abc"})
    opts = f"ro,_netdev,allow_other,nofail,x-systemd.automount,endpoint_url={rclone_server.endpoint_url},max_memory=256M,metadata-ttl=60"
    proc = subprocess.run(
        ["mount.fuse.bucketfs", f"s3://{s3_bucket}/prefix", empty_dir, "-o", opts],
        env=server_env(rclone_server),
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        assert proc.returncode == 0, proc.stderr
        assert os.path.ismount(empty_dir)  # mount(8) expects the helper to return once mounted
        assert open(os.path.join(empty_dir, "a.txt")).read() == "abc"
        opts_seen = [line for line in open("/proc/mounts") if empty_dir in line][0]
        assert "allow_other" in opts_seen and "fuse.bucketfs" in opts_seen
    finally:
        run_cli("unmount", empty_dir)
    assert not os.path.ismount(empty_dir)
    bad = subprocess.run(
        ["mount.fuse.bucketfs", f"s3://{s3_bucket}/", empty_dir, "-o", "ro,frobnicate"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == errors.EXIT_USAGE and "unknown fstab option 'frobnicate'" in bad.stderr


@pytest.fixture
def fstab_helper():
    """mount(8) finds the helper in /sbin: linked there for the test if it is not."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mount(8) with a helper needs root")
    helper = "/sbin/mount.fuse.bucketfs"
    created = not os.path.exists(helper)
    if created:
        os.symlink(shutil.which("mount.fuse.bucketfs"), helper)
    yield helper
    if created:
        os.unlink(helper)


def mounts_on(path: str) -> list:
    """(source, fstype) of every mount on `path`, as /proc/self/mountinfo has them."""
    from bucketfs.app.mountpoints import _unescape_mountinfo

    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            rest = fields[fields.index("-") + 1 :]
            if _unescape_mountinfo(fields[4]) == path:
                found.append((_unescape_mountinfo(rest[1]), rest[0]))
    return found


def test_mount_fstab_line_through_mount8(rclone_server, s3_bucket, empty_dir, tmp_path, fstab_helper):
    rclone_server.write_files(s3_bucket, {"p/b.txt": b"b"})
    fstab = tmp_path / "fstab"
    # `defaults` (no `ro`): mount(8) passes `rw` to the helper, which must still mount, read-only.
    fstab.write_text(
        f"s3://{s3_bucket}/p {empty_dir} fuse.bucketfs defaults,_netdev,nofail,shard_globs=*.tar:*.shard,"
        f"endpoint_url={rclone_server.endpoint_url} 0 0\n"
    )
    proc = subprocess.run(
        ["mount", "--fstab", str(fstab), empty_dir],
        env=server_env(rclone_server),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert open(os.path.join(empty_dir, "b.txt")).read() == "b"
    assert [line for line in open("/proc/mounts") if empty_dir in line][0].split()[3].startswith("ro,")
    with pytest.raises(OSError) as denied:
        open(os.path.join(empty_dir, "b.txt"), "w")
    assert denied.value.errno == errno.EROFS


def test_mounting_an_fstab_line_again_is_a_no_op(rclone_server, s3_bucket, empty_dir, tmp_path, fstab_helper):
    """The mount's source was `bucketfs:s3://bkt/p/`, not fstab's `s3://bkt/p`: mount(8)
    did not see the line mounted, and a second `mount -a` failed ("already a mount")."""
    rclone_server.write_files(s3_bucket, {"p/b.txt": b"b"})
    source = f"s3://{s3_bucket}/p"
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{source} {empty_dir} fuse.bucketfs ro,nofail,endpoint_url={rclone_server.endpoint_url} 0 0\n")
    for command in (
        ["mount", "-a", "-T", str(fstab)],
        ["mount", "-a", "-T", str(fstab)],
        ["mount", "--fstab", str(fstab), empty_dir],
    ):
        proc = subprocess.run(command, env=server_env(rclone_server), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (command, proc.stderr)
        assert mounts_on(empty_dir) == [(source, "fuse.bucketfs")]
    assert open(os.path.join(empty_dir, "b.txt")).read() == "b"
    assert run_cli("unmount", empty_dir).returncode == 0
    assert mounts_on(empty_dir) == []


@pytest.mark.parametrize("prefix", ["back\\slash", "comma,in", "spa ce", "日本語"])
def test_the_mount_source_is_the_url_as_written(rclone_server, s3_bucket, empty_dir, mount_factory, prefix):
    """libfuse's option parser ate a backslash (only commas were escaped), and a
    non-ASCII URL failed the mount (exit 1): pyfuse3 passes options as ASCII."""
    rclone_server.write_files(s3_bucket, {f"{prefix}/f.txt": b"f"})
    m = mount_factory(rclone_server, s3_bucket, prefix, mountpoint=empty_dir)
    assert mounts_on(empty_dir) == [(f"s3://{s3_bucket}/{prefix}", "fuse.bucketfs")]
    assert os.listdir(empty_dir) == ["f.txt"]
    assert run_cli("unmount", empty_dir).returncode == 0
    assert m.proc.wait(timeout=30) == 0


def test_an_object_named_like_the_stats_file_is_read_and_stats_says_what_hides_the_counters(
    rclone_server, s3_bucket, mount_factory
):
    rclone_server.write_files(s3_bucket, {".bucketfs-stats": b"the bucket's own bytes", "a.txt": b"a"})
    m = mount_factory(rclone_server, s3_bucket, "")
    assert open(m.path(".bucketfs-stats"), "rb").read() == b"the bucket's own bytes"  # never a wrong byte
    assert sorted(os.listdir(m.mountpoint)) == [".bucketfs-stats", "a.txt"]
    assert_one_line_error(
        run_cli("stats", m.mountpoint), errors.EXIT_BAD_MOUNTPOINT, "hides the counters", "--metrics-port"
    )


def test_stats_and_metrics_from_a_running_mount(rclone_server, s3_bucket, tmp_path, mount_factory):
    rclone_server.write_files(s3_bucket, {"c/img.jpg": b"j" * 50_000})
    port = free_port()
    m = mount_factory(rclone_server, s3_bucket, "", "--metrics-port", str(port))
    assert open(m.path("c", "img.jpg"), "rb").read() == b"j" * 50_000
    out = run_cli("stats", m.mountpoint)
    assert out.returncode == 0, out.stderr
    assert "requests" in out.stdout and "get 1" in out.stdout
    assert "open 1," in out.stdout  # the kernel's requests by operation
    raw = json.loads(run_cli("stats", m.mountpoint, "--json").stdout)
    assert raw["backend.requests.get"] == 1 and raw["read.bytes"] == 50_000
    # A small file's GET goes to a fetch-ahead worker, its body sent back (libcurl there).
    assert raw["backend.get_path.push"] == 1 and raw["open.worker_read"] == 1
    # The serving thread's own CPU, exactly: some, and never more than the whole daemon's.
    with open(f"/proc/{m.proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    daemon_cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    assert 0 < raw["process.serving_thread_cpu_s"] <= daemon_cpu_s + 0.02
    assert os.listdir(m.mountpoint) == ["c"]  # the stats channel adds nothing to the tree
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'bucketfs_backend_requests_total{type="get"} 1.0' in body
    assert 'bucketfs_backend_gets_total{path="push"} 1.0' in body
    assert "bucketfs_errors_total{" not in body  # (reads, listings and the stats file: no error)
    (serving,) = [line for line in body.splitlines() if line.startswith("bucketfs_serving_thread_cpu_seconds_total ")]
    assert float(serving.split()[1]) >= raw["process.serving_thread_cpu_s"]
    stats_path = os.path.join(m.mountpoint, ".bucketfs-stats")
    assert (
        os.path.isfile(stats_path) and json.load(open(stats_path))["backend.requests.get"] == 1
    )  # (what `stats` reads)
    for _ in range(2):  # ls -l asks for ACLs and labels on every file: the kernel answers after the first
        with pytest.raises(OSError) as raised:
            os.getxattr(m.path("c", "img.jpg"), "security.selinux")
        assert raised.value.errno == errno.EOPNOTSUPP
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "bucketfs_errors_total{" not in body
    assert daemon_stats(m.mountpoint).get("fuse.getxattr", 0) <= 1
    inside = run_cli("stats", m.path("c"))
    assert inside.returncode == 0 and "get 1" in inside.stdout, inside.stderr  # a path inside the mount
    fs_stat = os.statvfs(m.mountpoint)  # df lists a file system with blocks: the bytes listed so far
    assert fs_stat.f_blocks * fs_stat.f_frsize >= 50_000 and fs_stat.f_bavail == 0
    assert "bucketfs_memory_budget_bytes" in body and "bucketfs_cache_misses_total" in body
    assert "bucketfs_backend_queued_requests_total 0.0" in body  # one GET never waits for a connection
    assert 'bucketfs_fuse_requests_total{op="open"} 1.0' in body  # the one open above
    m.close()
    bad = run_cli("stats", str(tmp_path))
    assert bad.returncode == errors.EXIT_BAD_MOUNTPOINT and len(bad.stderr.strip().splitlines()) == 1


def test_stats_into_a_closed_pipe_exits_quietly(rclone_server, s3_bucket, mount_factory):
    """`bucketfs stats M | head -1` printed a BrokenPipeError traceback."""
    m = mount_factory(rclone_server, s3_bucket)
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader is gone before the first line
    with os.fdopen(write_fd, "wb") as closed_pipe:
        proc = subprocess.run(
            bucketfs_cmd("stats", m.mountpoint), stdout=closed_pipe, stderr=subprocess.PIPE, text=True, timeout=30
        )
    assert proc.returncode == 128 + signal.SIGPIPE and proc.stderr == ""  # as `yes | head -1` does


def test_metrics_on_another_address(rclone_server, s3_bucket, mount_factory):
    """--metrics-address: a Prometheus on another host can scrape (here: every interface)."""
    port = free_port()
    m = mount_factory(rclone_server, s3_bucket, "", "--metrics-port", str(port), "--metrics-address", "0.0.0.0")
    # The kernel's table of listening sockets: bound to every interface, not loopback
    # (a connection to the host name proves nothing where it resolves to 127.0.0.1).
    listening = [line.split()[1] for line in open("/proc/net/tcp").read().splitlines()[1:] if line.split()[3] == "0A"]
    assert f"00000000:{port:04X}" in listening and f"0100007F:{port:04X}" not in listening
    assert f"metrics on http://0.0.0.0:{port}/metrics" in m.stderr_text


def test_install_script_writes_unit_config_and_helper(tmp_path):
    dest = tmp_path / "root"
    proc = subprocess.run(
        [
            "bash",
            os.path.join(REPO, "scripts", "install-systemd.sh"),
            "imagenet",
            "s3://bkt/imagenet",
            "/mnt/imagenet",
            "--allow-other",
            "--max-memory",
            "2G",
        ],
        env=dict(os.environ, DESTDIR=str(dest)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert (dest / "etc/systemd/system/bucketfs@.service").exists()
    conf = (dest / "etc/bucketfs/imagenet.conf").read_text().splitlines()
    assert conf == [
        "BUCKETFS_URL=s3://bkt/imagenet",
        "BUCKETFS_MOUNTPOINT=/mnt/imagenet",
        "BUCKETFS_OPTIONS='--allow-other --max-memory 2G'",
    ]
    assert os.path.islink(dest / "sbin/mount.fuse.bucketfs")


def run_install_script(dest, *args, env=None):
    return subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "install-systemd.sh"), *args],
        env=dict(env or os.environ, DESTDIR=str(dest)),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["data", "s3:/bkt/x", "/mnt/data"], "not a bucket URL"),
        (["data", "s3://bkt/x", "/mnt/data", "--max-memry", "2G"], "--max-memry"),
        (["data", "gs://bkt/x", "/mnt/data", "--profile", "p"], "--profile is an S3 option"),
        (["data", "s3://bkt/x", "mnt/data"], "must be an absolute path"),
        (["a/b", "s3://bkt/x", "/mnt/data"], "without '/'"),
    ],
)
def test_install_script_refuses_what_the_unit_would_fail_on(tmp_path, args, fragment):
    """It wrote a bad URL, an unknown option or a relative mountpoint and exited 0: the
    error came only at systemctl start."""
    proc = run_install_script(tmp_path, *args)
    assert proc.returncode == errors.EXIT_USAGE, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
    assert not (tmp_path / "etc").exists()


def test_install_script_takes_bucketfs_from_BUCKETFS_where_sudo_hides_it(tmp_path):
    """Under sudo's secure_path a venv or pyenv install is not on PATH: the script said
    'not installed (pip install bucketfs)'."""
    import sysconfig

    bin_path = os.path.join(sysconfig.get_path("scripts"), "bucketfs")
    secure_path = dict(os.environ, PATH="/usr/sbin:/usr/bin:/sbin:/bin")
    hidden = run_install_script(tmp_path / "a", "data", "s3://bkt/x", "/mnt/data", env=secure_path)
    assert hidden.returncode == 1 and 'sudo env PATH="$PATH"' in hidden.stderr and "BUCKETFS=" in hidden.stderr
    named = run_install_script(
        tmp_path / "b", "data", "s3://bkt/x", "/mnt/data", env=dict(secure_path, BUCKETFS=bin_path)
    )
    assert named.returncode == 0, named.stderr
    assert os.readlink(tmp_path / "b/usr/local/bin/bucketfs") == bin_path
    assert os.readlink(tmp_path / "b/sbin/mount.fuse.bucketfs") == os.path.join(
        os.path.dirname(bin_path), "mount.fuse.bucketfs"
    )


def test_the_units_documentation_is_what_the_script_installs_and_its_stop_tolerates_a_gone_mount(tmp_path):
    unit = open(os.path.join(REPO, "systemd", "bucketfs@.service")).read()
    (documentation,) = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("Documentation=")]
    assert documentation.startswith("file:/")  # not an invented web address
    assert run_install_script(tmp_path, "data", "s3://bkt/x", "/mnt/data").returncode == 0
    assert (tmp_path / documentation[len("file:/") :]).read_text() == open(os.path.join(REPO, "README.md")).read()
    # ExecStop runs after the daemon exited too (a `bucketfs unmount` by hand): its
    # "not mounted" (exit 6) must not fail the unit.
    (exec_stop,) = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ExecStop=")]
    assert exec_stop.startswith("-") and "bucketfs unmount" in exec_stop


def _as_systemd_reads(conf_path) -> tuple:
    """(mountpoint, options argv) as the unit gets them: the EnvironmentFile parser
    removes one level of shell-like quotes (bash's `.` reads our lines the same way),
    then ExecStart's unbraced $BUCKETFS_OPTIONS is split at whitespace honouring quotes
    and backslashes (replace_env_argv: EXTRACT_RELAX|EXTRACT_UNQUOTE), which
    shlex.split matches for the backslash escapes the script writes."""
    out = subprocess.run(
        [
            "bash",
            "-c",
            'set -a; . "$1"; printf "%s\\0" "$BUCKETFS_MOUNTPOINT" "$BUCKETFS_OPTIONS"',
            "-",
            str(conf_path),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    mountpoint, options, _ = out.split("\0")
    return mountpoint, shlex.split(options)


def test_install_script_keeps_values_with_spaces_and_quotes_whole(tmp_path):
    dest = tmp_path / "root"
    options = [
        "--allow-other",
        "--cache-dir",
        "/var/cache/my data",
        "--log-file",
        "/var/log/it's.log",
        "--max-memory",
        "2G",
    ]
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "install-systemd.sh"), "data", "s3://bkt/p", "/mnt/my data", *options],
        env=dict(os.environ, DESTDIR=str(dest)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert _as_systemd_reads(dest / "etc/bucketfs/data.conf") == ("/mnt/my data", options)


def test_install_script_usage_is_only_the_usage(tmp_path):
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "install-systemd.sh"), "only-a-name"],
        env=dict(os.environ, DESTDIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "usage: " in proc.stderr and "NAME URL MOUNTPOINT" in proc.stderr
    assert "set -euo" not in proc.stdout + proc.stderr
    assert not (tmp_path / "etc").exists()


def test_unit_does_not_restart_on_permanent_errors_only():
    """Restart=on-failure would retry a usage error or a missing bucket every 5 s
    forever; an unreachable endpoint is worth retrying."""
    unit = open(os.path.join(REPO, "systemd", "bucketfs@.service")).read()
    (line,) = [line for line in unit.splitlines() if line.startswith("RestartPreventExitStatus=")]
    codes = {int(code) for code in line.split("=", 1)[1].split()}
    assert codes == set(errors.PERMANENT_EXIT_CODES)
    assert errors.EXIT_ENDPOINT_UNREACHABLE not in codes and errors.EXIT_FAILURE not in codes
    assert "Restart=on-failure" in unit


def test_systemd_stop_sequence_unmount_then_sigterm(rclone_server, s3_bucket, mount_factory):
    """ExecStop (bucketfs unmount --lazy) runs first, then systemd sends SIGTERM: an open
    reader still finishes, the daemon exits 0 and logs no error."""
    data = os.urandom(2 * 1024 * 1024)
    rclone_server.write_files(s3_bucket, {"f.bin": data})
    m = mount_factory(rclone_server, s3_bucket)
    with open(m.path("f.bin"), "rb", buffering=0) as f:
        head = f.read(1000)
        assert run_cli("unmount", "--lazy", m.mountpoint).returncode == 0
        m.proc.send_signal(signal.SIGTERM)
        assert head + f.read() == data
    assert m.proc.wait(timeout=30) == 0
    assert " ERROR " not in m.stderr_text
