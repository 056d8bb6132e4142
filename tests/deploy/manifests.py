"""What the deploy tests read from deploy/kubernetes/ and deploy/container/: the
manifests' documents, the pieces of them that belong together (the DaemonSet's mount
volume, a container's environment), and a container's command run as its image's
/bin/sh would run it, with a stand-in `bucketfs` on PATH."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
KUBERNETES_DIR = ROOT / "deploy" / "kubernetes"
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"
DOCKERIGNORE = ROOT / "deploy" / "container" / "Containerfile.dockerignore"

MiB = 1024 * 1024
# README: "The daemon stays within it [--max-memory] plus ~150 MB of overhead."
MEMORY_HEADROOM_BYTES = 150 * MiB


def manifest_files() -> list:
    return sorted(p for p in KUBERNETES_DIR.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))


def documents() -> list:
    """[(path relative to deploy/kubernetes, document)] of every manifest, in order."""
    found = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((str(path.relative_to(KUBERNETES_DIR)), doc))
    return found


def find(kind: str) -> dict:
    """The one document of `kind`."""
    docs = [doc for _, doc in documents() if doc["kind"] == kind]
    assert len(docs) == 1, f"{len(docs)} documents of kind {kind}"
    return docs[0]


def pod_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def containers(doc: dict) -> list:
    spec = pod_spec(doc)
    return spec.get("initContainers", []) + spec["containers"]


def container(doc: dict, name: str) -> dict:
    (found,) = [c for c in containers(doc) if c["name"] == name]
    return found


def volume(doc: dict, name: str) -> dict:
    (found,) = [v for v in pod_spec(doc)["volumes"] if v["name"] == name]
    return found


def container_env(c: dict) -> dict:
    """The container's environment as the kubelet builds it from these manifests: the
    ConfigMaps' keys (envFrom), then `env` (which wins). Secrets are left out."""
    env = {}
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            (cm,) = [
                doc
                for _, doc in documents()
                if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == source["configMapRef"]["name"]
            ]
            env.update(cm["data"])
    for var in c.get("env", []):
        env[var["name"]] = var["value"]
    return env


def bucketfs_mount() -> dict:
    """The DaemonSet's mount: its container, the volume it is published through, and
    the mountpoint inside the container and on the host."""
    ds = find("DaemonSet")
    c = container(ds, "bucketfs")
    mountpoint = container_env(c)["BUCKETFS_MOUNTPOINT"]
    # The volume mounted on a directory above the mountpoint (not the mountpoint itself).
    (vm,) = [m for m in c["volumeMounts"] if mountpoint.startswith(m["mountPath"].rstrip("/") + "/")]
    vol = volume(ds, vm["name"])
    below = os.path.relpath(mountpoint, vm["mountPath"])
    return {
        "daemonset": ds,
        "container": c,
        "volume_mount": vm,
        "volume": vol,
        "mountpoint": mountpoint,
        "below": below,  # the mountpoint's path below the volume
        "host_mountpoint": os.path.join(vol["hostPath"]["path"], below),
    }


def run_with_stub_bucketfs(argv: list, env: dict, tmp_path: pathlib.Path, cwd=None) -> dict:
    """Run `argv` (a container's command + args) with `env` and a stand-in `bucketfs`
    first on PATH that records its arguments. Returns {"argv": the stand-in's
    arguments or None, "exec": whether it ran in the process `argv` started (the shell
    exec'd it, so it gets the container's signals), "returncode", "stderr"}."""
    stub_dir = tmp_path / "stub-bin"
    stub_dir.mkdir(exist_ok=True)
    out = tmp_path / "stub-argv"
    stub = stub_dir / "bucketfs"
    stub.write_text(
        '#!/bin/sh\necho $$ > "$STUB_OUT.pid"\n: > "$STUB_OUT"\nfor a in "$@"; do printf "%s\\0" "$a" >> "$STUB_OUT"; done\n'
    )
    stub.chmod(0o755)
    full_env = {"PATH": f"{stub_dir}:/usr/local/bin:/usr/bin:/bin", "STUB_OUT": str(out), **env}
    proc = subprocess.Popen(
        argv, env=full_env, cwd=cwd or tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _, stderr = proc.communicate(timeout=30)
    if not out.exists():
        return {"argv": None, "exec": False, "returncode": proc.returncode, "stderr": stderr}
    raw = out.read_bytes()
    return {
        "argv": [arg.decode() for arg in raw.split(b"\0")[:-1]],
        "exec": int((tmp_path / "stub-argv.pid").read_text()) == proc.pid,
        "returncode": proc.returncode,
        "stderr": stderr,
    }


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_QUANTITY_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY_UNITS.update({f"{u}i": 1024 ** (i + 1) for i, u in enumerate("KMGTPE")})


def quantity_bytes(text) -> int:
    """A Kubernetes memory quantity ("2198Mi", "2G", "1073741824") in bytes."""
    m = _QUANTITY.match(str(text))
    assert m, f"{text!r} is not a memory quantity these tests read"
    return int(float(m.group(1)) * _QUANTITY_UNITS[m.group(2)])


def containerfile_stages() -> list:
    """[[(INSTRUCTION, arguments)]] of deploy/container/Containerfile, one list per
    stage: continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in CONTAINERFILE.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # (a comment inside a continued instruction)
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        logical.append(current + stripped)
        current = ""
    stages: list = []
    for instruction in logical:
        word, _, rest = instruction.partition(" ")
        if word.upper() == "FROM":
            stages.append([])
        stages[-1].append((word.upper(), " ".join(rest.split())))
    return stages
