"""Fixtures for end-to-end tests: a seeded bucket on `rclone serve s3`, mounted with the
real CLI behind a request-counting proxy.

The dataset (scripts/make_sample_dataset.py) is seeded once per session under
`datasets/toy/`: an ImageFolder tree `train/classNNN/*.jpg` and WebDataset shards
`shards/shard-NNNNNN.tar`. Since rclone serves a directory, the same bytes also sit on
local disk (`E2EMount.local_root`): the reference a loader over the mount must match.

These tests need torch, torchvision, webdataset and Pillow (the `test` extra). When
they are missing every test FAILS with the install line instead of skipping, so CI
cannot go green without running them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import shutil
import sys

import pytest

from bucketfs.testing.counting_proxy import CountingProxy, counting_proxy
from bucketfs.testing.mounting import bucketfs_mount

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DATASET_PREFIX = "datasets/toy/"
INSTALL_HINT = "pip install -e '.[test]'  (or: pip install torch torchvision webdataset pillow tqdm)"


def _load_script(name: str):
    """Import scripts/NAME.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session", autouse=True)
def _e2e_requirements():
    """First of all fixtures (session-scoped autouse), so a missing package is reported
    as such, not as an error of the fixtures that need it."""
    missing = []
    for module in ("torch", "torchvision", "webdataset", "PIL"):
        try:
            __import__(module)
        except ImportError as exc:
            missing.append(f"{module} ({exc})")
    if missing:
        pytest.fail(f"e2e tests need {', '.join(missing)}: {INSTALL_HINT}", pytrace=False)
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.fail("e2e tests need FUSE: /dev/fuse and fusermount3 (apt-get install fuse3)", pytrace=False)


@pytest.fixture(scope="session")
def sample_data():
    """The seeded dataset: 5 classes x 20 JPEGs, 8 shards x 20 samples, 64x64 px (~1 MB)."""
    generator = _load_script("make_sample_dataset")
    return generator.make_dataset(classes=5, per_class=20, shards=8, per_shard=20, size_px=64, seed=0)


@pytest.fixture(scope="session")
def dataset_bucket(rclone_server, sample_data):
    bucket = rclone_server.new_bucket()
    try:
        rclone_server.write_files(bucket, {DATASET_PREFIX + key: data for key, data in sample_data.objects.items()})
        yield bucket
    finally:
        rclone_server.delete_bucket(bucket)


@dataclasses.dataclass
class E2EMount:
    root: str  # the mounted dataset prefix
    local_root: str  # the same objects as files on local disk (rclone's served directory)
    proxy: CountingProxy  # every request the mount sent to the server
    log_path: str  # the mount's own log (foreground stderr)

    @property
    def train(self) -> str:
        return os.path.join(self.root, "train")

    @property
    def local_train(self) -> str:
        return os.path.join(self.local_root, "train")


def _mount(rclone_server, bucket, directory: pathlib.Path):
    mountpoint = directory / "mnt"
    mountpoint.mkdir()
    log_path = str(directory / "bucketfs.log")
    # Credentials from the server handle; the endpoint is the proxy, never rclone directly.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(rclone_server.env())
    env.pop("AWS_ENDPOINT_URL", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    with counting_proxy(rclone_server.endpoint_url) as proxy:
        with bucketfs_mount(
            f"s3://{bucket}/{DATASET_PREFIX}", str(mountpoint), log_path, endpoint_url=proxy.url, env=env
        ):
            yield E2EMount(
                root=str(mountpoint),
                local_root=str(rclone_server.root_dir / bucket / DATASET_PREFIX),
                proxy=proxy,
                log_path=log_path,
            )


@pytest.fixture(scope="module")
def shared_mount(rclone_server, dataset_bucket, tmp_path_factory):
    """One mount shared by a module's correctness tests."""
    yield from _mount(rclone_server, dataset_bucket, tmp_path_factory.mktemp("e2e-mount"))


@pytest.fixture
def fresh_mount(rclone_server, dataset_bucket, tmp_path):
    """A mount of its own, so the kernel page cache and request counts start empty."""
    yield from _mount(rclone_server, dataset_bucket, tmp_path)
