"""An unmodified torchvision ImageFolder in a shuffled DataLoader with worker processes
over a mounted tree of small JPEGs: every sample arrives once and decodes as the
same file on local disk does, and the mount fetched the tree ahead of the loader
(bucketfs/core/fetchahead.py) with at most one GET per file.

As the rest of the e2e tier (conftest.py), this fails with the install line, rather
than skips, when torch, torchvision, webdataset or Pillow is missing.
"""

from __future__ import annotations

import collections
import io
import os
import random

import pytest

from bucketfs.testing.counting_proxy import counting_proxy
from bucketfs.testing.mounting import bucketfs_mount, daemon_stats
from tests.e2e.conftest import REPO_ROOT

try:  # a missing dependency fails every test via conftest's autouse fixture, with the install line
    import torch
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset
    from torchvision import datasets, transforms
except ImportError:
    Dataset = object

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PREFIX = "fetch-ahead/"
CLASSES = 8
PER_CLASS = 60
FILES_COUNT = CLASSES * PER_CLASS
LOG_TAIL_CHARS = 6000


def make_jpegs(seed: int = 0) -> dict:
    """{key: JPEG bytes}: train/classNN/imgNNNN.jpg, noise images of 48 to 96 px a side."""
    rng = random.Random(seed)
    objects = {}
    for c in range(CLASSES):
        for i in range(PER_CLASS):
            side = rng.randrange(48, 97)
            image = Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3))
            out = io.BytesIO()
            image.save(out, format="JPEG", quality=90)
            objects[f"train/class{c:02d}/img{i:04d}.jpg"] = out.getvalue()
    return objects


class WithIndex(Dataset):
    """(index, image, target) around an unmodified dataset, so a shuffled epoch can be checked."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        image, target = self.dataset[index]
        return index, image, target


def _transform():
    return transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor()])


@pytest.fixture
def jpeg_mount(rclone_server, tmp_path, request):
    """(mountpoint, local copy of the prefix, proxy): a fresh bucket of JPEGs mounted with
    default options behind a counting proxy; the mount's log is printed if the test fails."""
    bucket = rclone_server.new_bucket()
    try:
        rclone_server.write_files(bucket, {PREFIX + key: data for key, data in make_jpegs().items()})
        mountpoint = tmp_path / "mnt"
        mountpoint.mkdir()
        log_path = str(tmp_path / "bucketfs.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(rclone_server.env())
        env.pop("AWS_ENDPOINT_URL", None)  # the endpoint is the proxy, never rclone directly
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        with counting_proxy(rclone_server.endpoint_url) as proxy:
            try:
                with bucketfs_mount(
                    f"s3://{bucket}/{PREFIX}", str(mountpoint), log_path, endpoint_url=proxy.url, env=env
                ):
                    yield str(mountpoint), str(rclone_server.root_dir / bucket / PREFIX), proxy
            finally:
                report = getattr(request.node, "rep_call", None)
                if report is not None and report.failed:
                    with open(log_path, errors="replace") as f:
                        print(f"--- log of the mount (tail) ---\n{f.read()[-LOG_TAIL_CHARS:]}")
    finally:
        rclone_server.delete_bucket(bucket)


def _counters(stats: dict) -> dict:
    return {k: v for k, v in sorted(stats.items()) if k.startswith(("fetch_ahead.", "backend.", "cache.", "memory."))}


def test_a_shuffled_imagefolder_epoch_is_fetched_ahead_with_one_get_per_file(jpeg_mount):
    mountpoint, local_root, proxy = jpeg_mount
    train = os.path.join(mountpoint, "train")
    dataset = datasets.ImageFolder(train, transform=_transform())
    assert len(dataset) == FILES_COUNT
    assert dataset.classes == [f"class{c:02d}" for c in range(CLASSES)]

    loader = DataLoader(WithIndex(dataset), batch_size=16, shuffle=True, num_workers=4)
    seen = {}
    for indices, images, targets in loader:
        for index, image, target in zip(indices.tolist(), images, targets.tolist()):
            assert index not in seen, f"sample {index} delivered twice in one epoch"
            seen[index] = (image, target)
    assert sorted(seen) == list(range(FILES_COUNT))

    # Every sample decodes as the same file on local disk does (rclone's served directory).
    local = datasets.ImageFolder(os.path.join(local_root, "train"), transform=_transform())
    assert [os.path.relpath(p, local.root) for p, _ in local.samples] == [
        os.path.relpath(p, train) for p, _ in dataset.samples
    ]
    for index, (image, target) in seen.items():
        expected_image, expected_target = local[index]
        assert target == expected_target, dataset.samples[index][0]
        assert torch.equal(image, expected_image), f"{dataset.samples[index][0]} decodes differently from local disk"

    stats = daemon_stats(mountpoint)
    assert stats.get("fetch_ahead.passes", 0) >= 1, _counters(stats)
    assert stats.get("fetch_ahead.files", 0) > 0, _counters(stats)
    assert stats.get("fetch_ahead.failed", 0) == 0, _counters(stats)
    assert stats.get("fetch_ahead.used_files", 0) == stats["fetch_ahead.files"], _counters(stats)
    per_key = collections.Counter(r.path for r in proxy.object_gets())
    twice = {path: n for path, n in per_key.items() if n > 1}
    assert not twice, f"objects fetched more than once in one epoch: {list(twice.items())[:5]}; {_counters(stats)}"
    assert sum(per_key.values()) <= FILES_COUNT, _counters(stats)
    assert stats.get("backend.requests.get", 0) <= FILES_COUNT, _counters(stats)
