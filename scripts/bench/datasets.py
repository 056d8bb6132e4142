"""The data set: its shape at a scale (`Spec`), generated once into --data-dir and
reused while its manifest (sizes and digests of every file and shard sample) matches;
`Dataset` to look files up, `Verifier` to check every byte a run reads."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import random
import shutil
import tarfile
import threading
import time
from pathlib import Path
from typing import Callable

from .common import HASH_NAME, MB, MiB, digest, log, new_hash


@dataclasses.dataclass(frozen=True)
class Spec:
    scale: float
    shard_count: int = 8
    shard_bytes: int = 64 * MB
    sample_bytes: int = 100_000  # mean size of a sample / ImageFolder file (80-120 KB)
    class_count: int = 50
    files_per_class: int = 200
    flat_count: int = 20_000
    tree_dirs: int = 200
    tree_per_dir: int = 100
    small_bytes: int = 1_000  # mean size of a W3 object (500-1500 B)

    @classmethod
    def for_scale(cls, scale: float) -> "Spec":
        return cls(
            scale=scale,
            shard_bytes=max(2 * MB, int(64 * MB * scale)),
            files_per_class=max(2, round(200 * scale)),
            flat_count=max(100, round(20_000 * scale)),
            tree_per_dir=max(1, round(100 * scale)),
        )

    @property
    def bucket(self) -> str:
        return "bench-full" if self.scale == 1 else f"bench-s{self.scale:g}"


def _random_bytes_factory(seed: int) -> Callable[[int], bytes]:
    try:
        import numpy

        rng = numpy.random.default_rng(seed)
        return rng.bytes
    except ImportError:
        return os.urandom


def _jpeg_like(rand, size: int, name: str) -> bytes:
    head = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00" + name.encode() + b"\x00"
    return head + rand(max(0, size - len(head) - 2)) + b"\xff\xd9"


def generate(spec: Spec, bucket_dir: Path) -> None:
    """Write the data set into a scratch directory, then rename it into place."""
    scratch = bucket_dir.parent.parent / f"partial-{spec.bucket}"
    shutil.rmtree(scratch, ignore_errors=True)
    rand = _random_bytes_factory(1234)
    sizes = random.Random(42)
    t0 = time.perf_counter()
    (scratch / "shards").mkdir(parents=True)
    sample = 0
    for s in range(spec.shard_count):
        with tarfile.open(scratch / "shards" / f"shard-{s:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            written = 0
            while written < spec.shard_bytes:
                key = f"{sample:06d}"
                jpg = _jpeg_like(rand, sizes.randint(80_000, 120_000), key)
                cls = str(sizes.randrange(1000)).encode()
                for name, data in ((f"{key}.jpg", jpg), (f"{key}.cls", cls)):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
                    tar.addfile(info, io.BytesIO(data))
                written += len(jpg) + len(cls) + 1024
                sample += 1
    for c in range(spec.class_count):
        d = scratch / "imagefolder" / f"class-{c:03d}"
        d.mkdir(parents=True)
        for i in range(spec.files_per_class):
            name = f"img-{c:03d}-{i:05d}.jpg"
            (d / name).write_bytes(_jpeg_like(rand, sizes.randint(80_000, 120_000), name))
    (scratch / "flat").mkdir()
    for i in range(spec.flat_count):
        (scratch / "flat" / f"obj-{i:06d}.bin").write_bytes(rand(sizes.randint(500, 1500)))
    for d in range(spec.tree_dirs):
        sub = scratch / "tree" / f"dir-{d:03d}"
        sub.mkdir(parents=True)
        for i in range(spec.tree_per_dir):
            (sub / f"obj-{i:05d}.bin").write_bytes(rand(sizes.randint(500, 1500)))
    os.sync()
    shutil.rmtree(bucket_dir, ignore_errors=True)
    bucket_dir.parent.mkdir(parents=True, exist_ok=True)
    os.rename(scratch, bucket_dir)
    log(f"generated {spec.bucket} in {time.perf_counter() - t0:.1f}s")


def build_manifest(spec: Spec, bucket_dir: Path) -> dict:
    """Sizes and digests of every file, and of every sample in the shards."""
    files, samples = {}, {}
    for dirpath, _dirs, names in os.walk(bucket_dir):
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, bucket_dir)
            h = new_hash()
            size = 0
            with open(path, "rb", buffering=0) as f:
                while chunk := f.read(8 * MiB):
                    h.update(chunk)
                    size += len(chunk)
            files[rel] = [size, h.intdigest()]
    for rel in sorted(files):
        if rel.startswith("shards/"):
            entries = {}
            with tarfile.open(bucket_dir / rel) as tar:
                for member in tar:
                    key, _, ext = member.name.partition(".")
                    data = tar.extractfile(member).read()
                    entry = entries.setdefault(key, [None, None])
                    if ext == "jpg":
                        entry[0] = digest(data)
                    else:
                        entry[1] = data.decode()
            samples[rel] = entries
    return {"version": 1, "spec": dataclasses.asdict(spec), "hash": HASH_NAME, "files": files, "samples": samples}


def ensure_dataset(spec: Spec, data_dir: Path) -> tuple:
    """(bucket_dir, manifest): generated once, reused while the spec matches."""
    bucket_dir = data_dir / "srv" / spec.bucket
    manifest_path = data_dir / f"{spec.bucket}.manifest.json"
    manifest = None
    if manifest_path.exists() and bucket_dir.is_dir():
        with contextlib.suppress(ValueError, OSError):
            manifest = json.loads(manifest_path.read_text())
        if manifest and manifest.get("spec") != dataclasses.asdict(spec):
            manifest = None
        elif manifest and not _files_present(bucket_dir, manifest):
            log(f"{bucket_dir} does not match its manifest: regenerating")
            manifest = None
        elif manifest and manifest.get("hash") != HASH_NAME:
            log(f"re-hashing {bucket_dir} with {HASH_NAME}")
            manifest = build_manifest(spec, bucket_dir)
            manifest_path.write_text(json.dumps(manifest))
    if manifest is None:
        log(f"generating the data set {spec.bucket} in {bucket_dir} (once; reused afterwards)")
        manifest_path.unlink(missing_ok=True)
        generate(spec, bucket_dir)
        manifest = build_manifest(spec, bucket_dir)
        manifest_path.write_text(json.dumps(manifest))
    else:
        log(f"reusing the data set in {bucket_dir}")
    return bucket_dir, manifest


def _files_present(bucket_dir: Path, manifest: dict) -> bool:
    try:
        return all(os.stat(bucket_dir / rel).st_size == size for rel, (size, _) in manifest["files"].items())
    except OSError:
        return False


class Dataset:
    def __init__(self, spec: Spec, bucket_dir: Path, manifest: dict):
        self.spec, self.bucket_dir, self.manifest = spec, bucket_dir, manifest
        self.bucket = spec.bucket
        self.files = manifest["files"]
        self.shards = sorted(r for r in self.files if r.startswith("shards/"))
        self.images = sorted(r for r in self.files if r.startswith("imagefolder/"))
        self.flat = sorted(r for r in self.files if r.startswith("flat/"))
        self.tree = sorted(r for r in self.files if r.startswith("tree/"))
        self.sample_count = sum(len(v) for v in manifest["samples"].values())

    def size(self, rel: str) -> int:
        return self.files[rel][0]

    def bytes_of(self, rels) -> int:
        return sum(self.files[r][0] for r in rels)


class Verifier:
    """Collects mismatches (thread safe); a run with any is a FAIL."""

    def __init__(self, dataset: Dataset):
        self.files = dataset.files
        self.errors: list = []
        self._lock = threading.Lock()

    def fail(self, what: str) -> None:
        with self._lock:
            self.errors.append(what)

    def check(self, rel: str, size: int, value: int) -> None:
        want_size, want = self.files[rel]
        if size != want_size or value != want:
            self.fail(f"{rel}: got {size} bytes digest {value:x}, expected {want_size} bytes digest {want:x}")
