"""deploy/kubernetes/ and deploy/container/Containerfile, checked without a cluster,
a container runtime or the network.

Every manifest is validated against the Kubernetes API's own schemas (OpenAPI turned
into JSON Schema) as kubernetes-validate ships them inside its wheel, in their strict
form: an unknown field fails, as `kubectl apply --validate=strict` would fail it.
Then what the schemas cannot see: rules the API server adds (Bidirectional
propagation only in a privileged container, the selector matching the template),
and what makes the DaemonSet work as a mount (the mount published Bidirectional,
consumed HostToContainer and read-only, /dev/fuse, readiness, the unmount on stop,
metrics, memory), with the container's shell command run for real and its argv
parsed by bucketfs's own command line. The Containerfile is read, not built.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import re
import shlex
import subprocess

import kubernetes_validate
import pytest

from bucketfs import backends
from bucketfs.app import cli

from . import manifests as m

pytestmark = pytest.mark.timeout(60)

# The Kubernetes releases the manifests are validated against: 1.29, an old one still
# run, and 1.37, the newest of the schemas (1.25-1.37) that kubernetes-validate 1.37.0,
# pinned in pyproject's test extra, ships. The manifests use no field newer than 1.29.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")

DOCUMENTS = m.documents()


def _doc_id(entry) -> str:
    path, doc = entry
    return f"{path}:{doc['kind']}"


def test_the_manifests_are_there():
    kinds = sorted(doc["kind"] for _, doc in DOCUMENTS)
    assert kinds == ["ConfigMap", "DaemonSet", "Job", "Namespace", "Pod", "Secret"], kinds
    # `kubectl apply -f deploy/kubernetes/` applies the top level in name order: the
    # namespace first; the examples (placeholders, a Job that needs a command bucketfs
    # does not have yet) only when applied by name.
    top = [p.name for p in m.manifest_files() if p.parent == m.KUBERNETES_DIR]
    assert top == ["00-namespace.yaml", "10-configmap.yaml", "20-daemonset.yaml"], top
    for path in m.manifest_files():
        assert path.suffix == ".yaml", path


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("entry", DOCUMENTS, ids=_doc_id)
def test_schema_strict(entry, version):
    path, doc = entry
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        pytest.fail(
            f"{path}: {doc['kind']} {doc['metadata']['name']} is not valid Kubernetes {version}: {where}: {exc.message}"
        )
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"{path}: {exc.message}")  # (the validator's command line only warns)


def test_strict_schema_refuses_unknown_fields_and_wrong_types():
    """The validator is strict and has its schemas here: a misspelt field, or an
    annotation that is no string, fails."""
    ds = m.find("DaemonSet")
    typo = copy.deepcopy(ds)
    typo["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPropogation"] = "Bidirectional"
    number = copy.deepcopy(ds)
    number["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = 9101
    for bad, fragment in ((typo, "mountPropogation"), (number, "not of type 'string'")):
        with pytest.raises(kubernetes_validate.ValidationError) as caught:
            kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[-1], strict=True)
        assert fragment in caught.value.message


def test_namespace_and_references():
    """The DaemonSet's objects live in the Namespace of 00-namespace.yaml, which lets
    privileged pods in; the ConfigMap and Secret it reads are the ones here."""
    ns = m.find("Namespace")
    name = ns["metadata"]["name"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    for path, doc in DOCUMENTS:
        if doc["kind"] not in ("Namespace", "Pod"):  # (the training pod: the user's namespace)
            assert doc["metadata"].get("namespace") == name, path
    c = m.container(m.find("DaemonSet"), "bucketfs")
    refs = {next(iter(s)): s[next(iter(s))] for s in c["envFrom"]}
    assert refs["configMapRef"]["name"] == m.find("ConfigMap")["metadata"]["name"]
    assert refs["secretRef"]["name"] == m.find("Secret")["metadata"]["name"]
    assert refs["secretRef"].get("optional") is True  # an instance role or IRSA needs none


def test_secret_example_holds_placeholders_only():
    secret = m.find("Secret")
    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    for key, value in secret["stringData"].items():
        assert value.startswith("PLACEHOLDER"), key
    assert "data" not in secret


def test_daemonset_selector_matches_its_pods():
    ds = m.find("DaemonSet")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    for key, value in ds["spec"]["selector"]["matchLabels"].items():
        assert labels.get(key) == value
    # A restart takes the data away from running training pods: only by hand.
    assert ds["spec"]["updateStrategy"]["type"] == "OnDelete"


def test_daemonset_publishes_the_mount_bidirectional():
    mount = m.bucketfs_mount()
    vm, vol, c = mount["volume_mount"], mount["volume"], mount["container"]
    assert vm["mountPropagation"] == "Bidirectional"
    assert not vm.get("readOnly")
    # The API server refuses Bidirectional in a container that is not privileged.
    assert c["securityContext"]["privileged"] is True
    assert vol["hostPath"]["type"] == "DirectoryOrCreate"
    # A directory below the volume, not the volume's root: see bucketfs_mount().
    assert mount["below"] != "." and not mount["below"].startswith("..")
    assert mount["host_mountpoint"] == "/var/lib/bucketfs/mnt"  # (what the docs name)


def test_daemonset_has_dev_fuse():
    ds = m.find("DaemonSet")
    c = m.container(ds, "bucketfs")
    (vm,) = [v for v in c["volumeMounts"] if v["mountPath"] == "/dev/fuse"]
    assert m.volume(ds, vm["name"])["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}


def _sh(c_command: list) -> str:
    """The script of an exec handler or container command `/bin/sh -c SCRIPT`."""
    assert c_command[:2] == ["/bin/sh", "-c"] and len(c_command) == 3, c_command
    return c_command[2]


def test_readiness_probe_reads_the_mount_and_fails_without_it(tmp_path):
    mount = m.bucketfs_mount()
    probe = mount["container"]["readinessProbe"]
    script = _sh(probe["exec"]["command"])
    assert "$BUCKETFS_MOUNTPOINT/.bucketfs-stats" in script
    assert probe["timeoutSeconds"] >= 1 and probe["periodSeconds"] >= 1
    # Not ready on an empty directory (nothing mounted yet), nor on a missing one.
    empty = tmp_path / "mnt"
    empty.mkdir()
    for mp in (empty, tmp_path / "missing"):
        proc = subprocess.run(
            ["/bin/sh", "-c", script], env={"BUCKETFS_MOUNTPOINT": str(mp), "PATH": "/usr/bin:/bin"}, timeout=30
        )
        assert proc.returncode != 0, mp
    # tests/deploy/test_kubernetes_rehearsal.py runs it against a real mount.


def test_prestop_unmounts_with_bucketfs_cli():
    """preStop: `bucketfs unmount MOUNTPOINT`, then `--lazy` while files are open;
    both are commands bucketfs's parser takes."""
    mount = m.bucketfs_mount()
    script = _sh(mount["container"]["lifecycle"]["preStop"]["exec"]["command"])
    commands = [shlex.split(part) for part in script.split("||")]
    parsed = []
    for words in commands:
        words = [w for w in words if not re.match(r"^\d?>", w)]  # (redirections)
        assert words[0] == "bucketfs", words
        argv = [w.replace("$BUCKETFS_MOUNTPOINT", mount["mountpoint"]) for w in words[1:]]
        args = cli.build_parser().parse_args(argv)
        assert args.command == "unmount" and args.mountpoint == mount["mountpoint"]
        parsed.append(args.lazy)
    assert parsed == [False, True]


def test_grace_period_covers_the_daemons_stop():
    """The pod's grace period is at least the systemd unit's TimeoutStopSec (open
    readers 30 s, a dead store 3 s, --cache-dir writes 10 s), plus the preStop."""
    unit = (m.ROOT / "systemd" / "bucketfs@.service").read_text()
    timeout_stop_s = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M).group(1))
    grace = m.pod_spec(m.find("DaemonSet"))["terminationGracePeriodSeconds"]
    assert grace >= timeout_stop_s + 30, (grace, timeout_stop_s)


def _container_config(tmp_path, extra_env=None):
    """The DaemonSet's container command run by /bin/sh with the ConfigMap's
    environment, its `bucketfs` argv parsed by bucketfs's parser into a Config."""
    mount = m.bucketfs_mount()
    c = mount["container"]
    env = m.container_env(c)
    mountpoint = tmp_path / "var-lib-bucketfs" / mount["below"]  # (the manifest's path is the host's)
    env.update(BUCKETFS_MOUNTPOINT=str(mountpoint), **(extra_env or {}))
    run = m.run_with_stub_bucketfs(c["command"] + c["args"], env, tmp_path)
    assert run["argv"] is not None, run["stderr"]
    args = cli.build_parser().parse_args(run["argv"])
    assert args.command == "mount" and not args.check
    config = cli.config_from_args(args)
    backends.check_options(config)  # (what `bucketfs mount --check` adds)
    return run, config, env, mountpoint


def test_container_command_is_a_mount_bucketfs_parses(tmp_path):
    run, config, env, mountpoint = _container_config(tmp_path)
    assert run["exec"], "the shell must exec bucketfs, so that SIGTERM reaches it"
    assert mountpoint.is_dir()  # (made by the command: bucketfs mount wants it there)
    assert config.source == env["BUCKETFS_URL"] == m.find("ConfigMap")["data"]["BUCKETFS_URL"]
    assert config.mountpoint == os.path.realpath(mountpoint)
    assert config.foreground  # the container's process is the daemon
    assert config.allow_other  # training pods run as other users
    assert config.log_file is None  # stderr: `kubectl logs`


def test_container_command_does_not_glob_options(tmp_path):
    (tmp_path / "a.tar,b.tgz").write_bytes(b"")  # (what the unquoted word would match)
    _, config, _, _ = _container_config(tmp_path, {"BUCKETFS_OPTIONS": "--max-memory 2G --shard-globs *.tar,*.tgz"})
    assert config.shard_globs == ("*.tar", "*.tgz")


def test_metrics_are_scraped_where_they_are_served(tmp_path):
    _, config, _, _ = _container_config(tmp_path)
    ds = m.find("DaemonSet")
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == config.metrics_port
    (port,) = m.container(ds, "bucketfs")["ports"]
    assert port["containerPort"] == config.metrics_port and port["name"] == "metrics"
    assert config.metrics_address == "0.0.0.0"  # the pod's IP, not its loopback


def test_memory_limit_is_the_budget_plus_headroom(tmp_path):
    _, config, _, _ = _container_config(tmp_path)
    resources = m.container(m.find("DaemonSet"), "bucketfs")["resources"]
    limit = m.quantity_bytes(resources["limits"]["memory"])
    assert limit == config.max_memory_bytes + m.MEMORY_HEADROOM_BYTES, (limit, config.max_memory_bytes)
    assert m.quantity_bytes(resources["requests"]["memory"]) == limit
    assert "cpu" not in resources["limits"]


def test_training_pod_reads_the_mount_host_to_container_read_only():
    mount = m.bucketfs_mount()
    pod = m.find("Pod")
    (vol,) = [v for v in m.pod_spec(pod)["volumes"] if "hostPath" in v]
    # The DaemonSet's volume (the mountpoint's parent), so that a restarted mount
    # propagates here too; Directory: a node without bucketfs is no empty dataset.
    assert vol["hostPath"] == {"path": mount["volume"]["hostPath"]["path"], "type": "Directory"}
    users = [(c, vm) for c in m.containers(pod) for vm in c.get("volumeMounts", []) if vm["name"] == vol["name"]]
    assert {c["name"] for c, _ in users} == {"wait-for-bucketfs", "train"}
    for c, vm in users:
        assert vm["mountPropagation"] == "HostToContainer", c["name"]
        assert vm["readOnly"] is True, c["name"]
        assert not c.get("securityContext", {}).get("privileged"), c["name"]
    data_root = os.path.join(users[0][1]["mountPath"], mount["below"])
    wait = m.container(pod, "wait-for-bucketfs")
    assert f"{data_root}/.bucketfs-stats" in " ".join(wait["args"])
    train = m.container(pod, "train")["command"]
    assert train[train.index("--data") + 1].startswith(data_root + "/")


def test_one_bucketfs_image():
    images = {
        c["image"]
        for _, doc in DOCUMENTS
        if doc["kind"] in ("DaemonSet", "Job", "Pod")
        for c in m.containers(doc)
        if c["name"] != "train"
    }
    assert images == {"registry.example.com/bucketfs:0.1.0"}


def test_index_build_job_uses_the_planned_command(tmp_path):
    """The Job's command is `bucketfs index build URL --out INDEX`, the interface
    being built. Until bucketfs has it, only its shape is checked; then bucketfs's
    parser must take it."""
    job = m.find("Job")
    c = m.container(job, "index-build")
    env = m.container_env(c)
    run = m.run_with_stub_bucketfs(c["command"] + c["args"], env, tmp_path)
    assert run["exec"]
    argv = run["argv"]
    assert argv == ["index", "build", env["BUCKETFS_URL"], "--out", env["BUCKETFS_INDEX"]], argv
    subcommands = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    if "index" not in subcommands:
        pytest.skip("bucketfs has no `index` command yet: the Job's argv is not parsed")
    cli.build_parser().parse_args(argv)


def _readme_apt_packages() -> list:
    readme = (m.ROOT / "README.md").read_text()
    (line,) = [ln for ln in readme.splitlines() if ln.startswith("sudo apt-get install")]
    return [w for w in line.split()[3:] if not w.startswith("-")]


def test_containerfile_installs_bucketfs_the_readme_way():
    build, run = m.containerfile_stages()
    assert re.match(r"^debian:bookworm(-slim)?(@sha256:\w+)? AS build$", build[0][1]), build[0]
    runs = " && ".join(args for op, args in build if op == "RUN")
    packages = set(re.search(r"apt-get install -y ((?:[\w.+-]+ ?)+)", runs).group(1).split())
    assert set(_readme_apt_packages()) <= packages, set(_readme_apt_packages()) - packages
    # The README's venv and `pip install .` from the source tree copied in.
    assert ("COPY", ". /src") in build and ("WORKDIR", "/src") in build
    assert "python3 -m venv /opt/bucketfs" in runs
    assert re.search(r"/opt/bucketfs/bin/pip install (--no-cache-dir )?\.( |$)", runs), runs
    # The runtime stage: Debian 12's own python3 (the venv's), fuse3, the venv.
    assert re.match(r"^debian:bookworm(-slim)?(@sha256:\w+)?$", run[0][1]), run[0]
    run_packages = " ".join(args for op, args in run if op == "RUN")
    for package in ("fuse3", "python3", "ca-certificates"):
        assert re.search(rf"\b{package}\b", run_packages), package
    assert ("COPY", "--from=build /opt/bucketfs /opt/bucketfs") in run
    assert ("ENV", "PATH=/opt/bucketfs/bin:$PATH") in run
    assert ("ENTRYPOINT", '["bucketfs"]') in run
    # Root: mounting FUSE needs it (the Containerfile's header says why).
    assert not [args for op, args in build + run if op == "USER"]


def test_containerfile_context_keeps_what_pip_install_needs():
    patterns = [ln.strip() for ln in m.DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    needed = ["pyproject.toml", "README.md", "bucketfs/__init__.py", "bucketfs/app/cli.py"]
    for path in needed:
        for pattern in patterns:
            assert not fnmatch.fnmatch(path, pattern) and not path.startswith(pattern.rstrip("/") + "/"), (
                path,
                pattern,
            )
