"""The DaemonSet's commands run for real on one simulated node, without Kubernetes.

A private mount namespace plays the node; the directory that stands for its
/var/lib/bucketfs is made a shared mount there (as the container runtime does for a
Bidirectional hostPath). The bucketfs "container" gets a mount namespace and a PID
namespace of its own (bucketfs is its PID 1, as in the pod), with that directory
bound in rshared (Bidirectional), and runs the DaemonSet's command with its
environment (the ConfigMap's, the Secret's keys for the local S3 server); its
readiness and preStop commands run inside it, as the kubelet runs them. The training
"pod" is another mount namespace with the directory bound rslave and read-only
(HostToContainer), started before the mount exists, as the example pod may be.

Not played: cgroups (the memory limit), the image, the kubelet's probe schedule and
the network namespace (the container shares the host's, so its metrics are served on
a free port of 127.0.0.1 instead of 0.0.0.0:9101).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from bucketfs.testing.mounting import wait_for
from bucketfs.testing.servers import free_port

from . import manifests as m

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STOP_DEADLINE_S = 45.0  # the systemd unit's TimeoutStopSec


class Node:
    """The node's mount namespace (held by a sleeping process) and what runs in it."""

    def __init__(self, base: pathlib.Path):
        self.base = base
        self.host = base / "host"  # the node's /var/lib/bucketfs
        self.started: list = []
        self.holder = self._popen(["unshare", "--mount", "--propagation", "private", "sleep", "600"])
        own_ns = os.readlink("/proc/self/ns/mnt")
        wait_for(lambda: os.readlink(f"/proc/{self.holder.pid}/ns/mnt") != own_ns, 10, "node namespace", self.holder)
        self.pid = self.holder.pid

    def _popen(self, argv, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, **kwargs)
        self.started.append(proc)
        return proc

    def run(self, *cmd, ns_pid=None, pid_ns=False, uid=None, env=None, check=True, timeout=30):
        """`cmd` run in the mount namespace of process `ns_pid` (default: the node's),
        and in its PID namespace too with `pid_ns`, as user and group `uid`."""
        ns_pid = ns_pid or self.pid
        enter = [f"--mount=/proc/{ns_pid}/ns/mnt"] + ([f"--pid=/proc/{ns_pid}/ns/pid"] if pid_ns else [])
        ids = ["--setuid", str(uid), "--setgid", str(uid)] if uid is not None else []
        proc = subprocess.run(
            ["nsenter", *enter, *ids, "--", *cmd], env=env, capture_output=True, text=True, timeout=timeout
        )
        if check:
            assert proc.returncode == 0, (cmd, proc.returncode, proc.stderr)
        return proc

    def spawn(self, *cmd, ns_pid) -> subprocess.Popen:
        """`cmd` started in the mount namespace of `ns_pid`, left running."""
        return self._popen(["nsenter", f"--mount=/proc/{ns_pid}/ns/mnt", "--", *cmd])

    def start(self, setup: str, target, cmd: list, env=None, own_pids=False, stderr=None):
        """A new mount namespace copied from the node's, with the node's
        /var/lib/bucketfs bound on `target`, then `setup` (on $T), then `cmd` exec'd.
        With `own_pids`, in a PID namespace of its own too, where `cmd` is PID 1.
        Returns (the process to wait for, the pid of `cmd` as seen from here)."""
        script = 'mount --rbind "$S" "$T" && ' + setup + ' && unset S T && exec "$@"'
        pid_ns = ["--pid", "--fork", "--mount-proc", "--kill-child"] if own_pids else []
        proc = self._popen(
            ["nsenter", f"--mount=/proc/{self.pid}/ns/mnt", "--"]
            + ["unshare", "--mount", "--propagation", "unchanged", *pid_ns, "--", "sh", "-c", script, "sh", *cmd],
            env={**(env or {"PATH": "/usr/bin:/bin"}), "S": str(self.host), "T": str(target)},
            stderr=stderr,
        )
        if not own_pids:
            return proc, proc.pid
        children = f"/proc/{proc.pid}/task/{proc.pid}/children"  # (unshare --fork's one child)
        wait_for(lambda: open(children).read().strip(), 10, "the container's PID 1", proc)
        return proc, int(open(children).read().split()[0])

    def close(self) -> None:
        for proc in reversed(self.started):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def node():
    if os.geteuid() != 0:
        pytest.skip("needs root: namespaces and mounts")
    for tool in ("unshare", "nsenter", "fusermount3", "mountpoint"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed")
    # Not under tmp_path: the training pod's user 1000 must get through its parents.
    base = pathlib.Path(tempfile.mkdtemp(prefix="bucketfs-node-"))
    base.chmod(0o755)
    (base / "host").mkdir()
    n = Node(base)
    try:
        # The container runtime makes a Bidirectional hostPath's mount shared.
        n.run("sh", "-c", 'mount --bind "$0" "$0" && mount --make-shared "$0"', str(n.host))
        yield n
    finally:
        n.close()  # (the node's mounts go with its namespace)
        shutil.rmtree(base, ignore_errors=True)


def _bucketfs_on_path(tmp_path) -> str:
    """A directory with `bucketfs`: this checkout's, by this interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "bucketfs"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH={m.ROOT} exec {sys.executable} -m bucketfs "$@"\n')
    exe.chmod(0o755)
    return str(bin_dir)


def _is_mount(node: Node, path, ns_pid=None) -> bool:
    return node.run("mountpoint", "-q", str(path), ns_pid=ns_pid, check=False).returncode == 0


def _fd_open(pid: int, fd: int) -> bool:
    return os.path.exists(f"/proc/{pid}/fd/{fd}")


def _logs(tmp_path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("container-*.log")))


def test_daemonset_and_training_pod_on_one_node(node, rclone_server, s3_bucket, tmp_path):
    files = {"train/cat/1.jpg": b"meow" * 1000, "train/dog/2.jpg": b"woof" * 3000}
    rclone_server.write_files(s3_bucket, files)
    mount = m.bucketfs_mount()
    c = mount["container"]
    pod = m.find("Pod")
    (pod_vm,) = [vm for vm in m.container(pod, "train")["volumeMounts"] if vm.get("mountPropagation")]

    # The training pod first: the data appears in it later, by propagation.
    pod_root = node.base / "pod-bucketfs"  # its /bucketfs
    pod_root.mkdir()
    ready = tmp_path / "pod-ready"
    _, pod_pid = node.start(
        'mount --make-rslave "$T" && mount -o remount,bind,ro "$T"',
        pod_root,
        ["sh", "-c", f"touch {ready} && exec sleep 600"],
    )
    wait_for(ready.exists, 10, "the training pod's namespace")
    pod_data = pod_root / mount["below"]  # /bucketfs/mnt in the pod

    # The bucketfs container: the ConfigMap's environment with this test's bucket, the
    # Secret's keys for the local server, the mountpoint under its own view of the volume.
    ctr_root = node.base / "container-var-lib-bucketfs"  # its /var/lib/bucketfs
    ctr_root.mkdir()
    port = free_port()
    script = c["args"][0]
    listen = "--metrics-port 9101 --metrics-address 0.0.0.0 "
    assert script.count(listen) == 1
    script = script.replace(listen, f"--metrics-port {port} --metrics-address 127.0.0.1 ")
    env = {
        **m.container_env(c),
        **rclone_server.env(),  # AWS_* (AWS_ENDPOINT_URL: the store is on 127.0.0.1)
        "BUCKETFS_URL": f"s3://{s3_bucket}/",
        "BUCKETFS_MOUNTPOINT": str(ctr_root / mount["below"]),
        "PATH": _bucketfs_on_path(tmp_path) + ":/usr/bin:/bin",
    }
    probe = c["readinessProbe"]["exec"]["command"]
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]

    def start_container(log_name):
        with open(tmp_path / log_name, "w") as log:
            return node.start('mount --make-rshared "$T"', ctr_root, c["command"] + [script], env, True, log)

    def ready_in(ctr) -> bool:
        proc, init = ctr
        assert proc.poll() is None, (proc.returncode, _logs(tmp_path))
        return node.run(*probe, ns_pid=init, pid_ns=True, env=env, check=False).returncode == 0

    def stop(ctr):
        """The kubelet's stop: preStop in the container, then SIGTERM to its PID 1."""
        proc, init = ctr
        node.run(*pre_stop, ns_pid=init, pid_ns=True, env=env, timeout=60)
        os.kill(init, signal.SIGTERM)
        return proc

    ctr = start_container("container-1.log")
    wait_for(lambda: ready_in(ctr), 30, "readiness")

    # Published: on the node, and in the running training pod, read-only, to a non-root user.
    host_data = node.host / mount["below"]
    assert _is_mount(node, host_data)
    for path, data in files.items():
        assert node.run("cat", str(pod_data / path), ns_pid=pod_pid, uid=1000).stdout.encode() == data
    write = node.run("touch", str(pod_data / "new"), ns_pid=pod_pid, check=False)
    assert write.returncode != 0 and "Read-only file system" in write.stderr
    # The pod's init container's wait, in the pod, as its user.
    (wait_cmd,) = m.container(pod, "wait-for-bucketfs")["args"]
    wait_cmd = wait_cmd.replace(pod_vm["mountPath"] + "/", str(pod_root) + "/")
    node.run("sh", "-c", wait_cmd, ns_pid=pod_pid, uid=1000, timeout=10)

    # Metrics at the annotations' path.
    annotations = mount["daemonset"]["spec"]["template"]["metadata"]["annotations"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{annotations['prometheus.io/path']}", timeout=10) as r:
        assert b"bucketfs_backend_requests_total" in r.read()

    # Stop with a file open in the pod: preStop's plain unmount is refused (busy), the
    # lazy one detaches the mount everywhere; the open file still reads; the daemon
    # waits for it after SIGTERM, and exits 0 once it is closed.
    reader = node.spawn("sh", "-c", f'exec 3< "{pod_data}/train/dog/2.jpg" && exec sleep 600', ns_pid=pod_pid)
    wait_for(lambda: _fd_open(reader.pid, 3), 10, "the reader's open file", reader)
    proc = stop(ctr)
    assert not _is_mount(node, host_data)
    assert not _is_mount(node, pod_data, ns_pid=pod_pid)
    with open(f"/proc/{reader.pid}/fd/3", "rb") as f:
        assert f.read() == files["train/dog/2.jpg"]
    time.sleep(0.5)  # (a daemon that did not wait for the open file would be gone by now)
    assert proc.poll() is None
    reader.kill()
    reader.wait(timeout=10)
    assert proc.wait(timeout=STOP_DEADLINE_S) == 0, _logs(tmp_path)

    # A new pod of the DaemonSet: the running training pod sees the data again.
    ctr = start_container("container-2.log")
    wait_for(lambda: ready_in(ctr), 30, "readiness after a restart")
    assert node.run("ls", str(pod_data / "train"), ns_pid=pod_pid).stdout.split() == ["cat", "dog"]

    # Killed (the OOM killer): a dead mount is left on the node; the next container
    # detaches it and mounts again, and the pod reads again.
    os.kill(ctr[1], signal.SIGKILL)
    ctr[0].wait(timeout=10)
    dead = node.run("ls", str(host_data), check=False)
    assert dead.returncode != 0 and "Transport endpoint is not connected" in dead.stderr
    ctr = start_container("container-3.log")
    wait_for(lambda: ready_in(ctr), 30, "readiness over a dead mount")
    cat = node.run("cat", str(pod_data / "train/cat/1.jpg"), ns_pid=pod_pid)
    assert cat.stdout.encode() == files["train/cat/1.jpg"]

    # Stop with no file open: preStop unmounts, the daemon exits 0 (PID 1 ignores the
    # SIGTERM that comes while it is exiting), nothing is left on the node.
    assert stop(ctr).wait(timeout=STOP_DEADLINE_S) == 0, _logs(tmp_path)
    assert not _is_mount(node, host_data)
    assert node.run("ls", "-A", str(host_data)).stdout == ""
