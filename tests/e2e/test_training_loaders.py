"""Unmodified torch loaders over a real bucketfs mount (see conftest.py for the setup).

Each test reads the mounted prefix exactly as a training script reads local disk -
torchvision ImageFolder, webdataset by brace-expanded shard paths, DistributedSampler
ranks - in a DataLoader with worker processes, and checks what arrives against the
seeded bytes.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import subprocess
import sys

import pytest

from bucketfs.testing.mounting import daemon_stats, fuse_requests_waiting, pinned_in_page_cache, wait_for
from tests.e2e.conftest import REPO_ROOT

try:  # a missing dependency fails every test via conftest's autouse fixture, with the install line
    import torch
    import webdataset as wds
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset
    from torchvision import datasets, transforms
except ImportError:
    Dataset = object

pytestmark = pytest.mark.e2e

IMAGE_PX = 64


def _transform():
    return transforms.Compose([transforms.Resize(32), transforms.ToTensor()])


class WithIndex(Dataset):
    """(index, sample...) around an unmodified dataset, so a shuffled epoch can be checked."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        image, target = self.dataset[index]
        return index, image, target


def _describe_wds_sample(sample):
    """Runs in a DataLoader worker: key, SHA-256 of the raw .jpg, label, decoded size."""
    image = Image.open(io.BytesIO(sample["jpg"]))
    image.load()  # decode every pixel, not just the header
    return sample["__key__"], hashlib.sha256(sample["jpg"]).hexdigest(), int(sample["cls"]), image.size


def _imagefolder_epoch(dataset, workers=2, batch_size=8):
    loader = DataLoader(WithIndex(dataset), batch_size=batch_size, shuffle=True, num_workers=workers)
    seen = {}
    for indices, images, targets in loader:
        for index, image, target in zip(indices.tolist(), images, targets.tolist()):
            assert index not in seen, f"sample {index} delivered twice in one epoch"
            seen[index] = (image, target)
    return seen


def _wds_epoch(pattern, shardshuffle, workers=2):
    dataset = wds.WebDataset(pattern, shardshuffle=shardshuffle, seed=0).map(_describe_wds_sample)
    return list(DataLoader(dataset, batch_size=None, num_workers=workers))


@pytest.mark.timeout(120)
def test_imagefolder_dataloader_reads_every_image(shared_mount, sample_data):
    dataset = datasets.ImageFolder(shared_mount.train, transform=_transform())
    assert dataset.classes == sample_data.classes
    per_class = collections.Counter(dataset.classes[t] for t in dataset.targets)
    assert per_class == sample_data.per_class_count

    seen = _imagefolder_epoch(dataset)

    assert sorted(seen) == list(range(len(dataset)))
    # Reference: the same loader over the same files on local disk.
    local = datasets.ImageFolder(shared_mount.local_train, transform=_transform())
    assert [os.path.relpath(p, shared_mount.local_train) for p, _ in local.samples] == [
        os.path.relpath(p, shared_mount.train) for p, _ in dataset.samples
    ]
    for index, (image, target) in seen.items():
        expected_image, expected_target = local[index]
        assert target == expected_target, dataset.samples[index][0]
        assert image.shape == (3, 32, 32)
        assert torch.equal(image, expected_image), f"{dataset.samples[index][0]} decodes differently from local disk"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shardshuffle", [False, 8], ids=["shards-in-order", "shards-shuffled"])
def test_webdataset_reads_every_sample_once(shared_mount, sample_data, shardshuffle):
    pattern = sample_data.shard_pattern(shared_mount.root)
    assert "{000000..000007}" in pattern

    samples = _wds_epoch(pattern, shardshuffle)

    keys = collections.Counter(key for key, _, _, _ in samples)
    duplicated = [k for k, n in keys.items() if n > 1]
    assert not duplicated, f"samples delivered more than once: {duplicated[:5]}"
    assert set(keys) == set(sample_data.wds_sha256), "missing or unexpected samples"
    for key, digest, label, size in samples:
        assert digest == sample_data.wds_sha256[key], f"{key}.jpg bytes differ from the seeded object"
        assert label == sample_data.wds_label[key], key
        assert tuple(size) == (IMAGE_PX, IMAGE_PX), key


@pytest.mark.timeout(180)
def test_two_distributed_sampler_ranks_partition_the_dataset(shared_mount, sample_data):
    world_size = 2
    total = sum(sample_data.per_class_count.values())
    assert total % world_size == 0, "an even split, so DistributedSampler pads nothing"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.rank_worker", shared_mount.train, str(rank), str(world_size)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]  # both ranks read the one mount at the same time
    results = []
    try:
        for rank, proc in enumerate(ranks):
            stdout, stderr = proc.communicate(timeout=150)
            assert proc.returncode == 0, f"rank {rank} failed ({proc.returncode}):\n{stderr[-3000:]}"
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    seeded = {key[len("train/") :] for key in sample_data.objects if key.startswith("train/")}
    paths = [set(result["paths"]) for result in results]
    for result, rank_paths in zip(results, paths):
        assert result["classes"] == sample_data.classes
        assert len(result["paths"]) == len(rank_paths) == total // world_size, "a rank saw a sample twice"
    assert not paths[0] & paths[1], "the ranks overlap"
    assert paths[0] | paths[1] == seeded, "together the ranks do not cover the dataset"


@pytest.mark.timeout(180)
def test_second_epoch_makes_no_new_gets(fresh_mount, sample_data):
    """Immutable default: the second epoch is served by the kernel page cache (keep_cache)."""
    proxy = fresh_mount.proxy
    dataset = datasets.ImageFolder(fresh_mount.train, transform=_transform())
    pattern = sample_data.shard_pattern(fresh_mount.root)

    assert len(_imagefolder_epoch(dataset)) == len(dataset)
    assert len(_wds_epoch(pattern, shardshuffle=False)) == len(sample_data.wds_sha256)
    epoch1 = proxy.requests
    fetched = {r.path for r in epoch1 if r.is_object_get}
    for key in sample_data.objects:  # the proxy really is in the path, and saw every object
        assert any(path.endswith("/" + key) for path in fetched), f"epoch 1 never fetched {key}"

    # The kernel's read-ahead READs of epoch 1 (past the last byte a tar reader asks
    # for) may still be on their way: they are epoch 1's, not epoch 2's.
    wait_for(lambda: fuse_requests_waiting(fresh_mount.root) in (0, None), 30, "epoch 1's READs answered")
    files = [os.path.join(fresh_mount.root, key) for key in sample_data.objects]
    with pinned_in_page_cache(files):
        daemon_before = daemon_stats(fresh_mount.root)
        assert len(_imagefolder_epoch(dataset)) == len(dataset)
        assert len(_wds_epoch(pattern, shardshuffle=False)) == len(sample_data.wds_sha256)
        epoch2 = proxy.requests[len(epoch1) :]
        daemon_after = daemon_stats(fresh_mount.root)
    assert daemon_after.get("fuse.read", 0) == daemon_before.get("fuse.read", 0), "epoch 2's bytes reached the daemon"
    # (The counters do count: every open still reaches the daemon, or, where the kernel
    # opens files itself, nothing of epoch 2 does.)
    assert daemon_after["fuse.open"] > daemon_before["fuse.open"] or (
        daemon_after.get("namespace.kernel_opens_files") == 1
        and daemon_after.get("fuse.open") == daemon_before.get("fuse.open")
    )

    new_gets = [r for r in epoch2 if r.is_object_get]
    assert not new_gets, f"epoch 2 made {len(new_gets)} object GETs, e.g. {new_gets[:5]}"
    assert not epoch2, f"epoch 2 sent {len(epoch2)} requests (LIST/HEAD?), e.g. {epoch2[:5]}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", ["train_imagefolder", "train_webdataset"])
def test_example_training_script_runs_on_the_mount(shared_mount, sample_data, script):
    data_args = (
        ["--data", shared_mount.train]
        if script == "train_imagefolder"
        else ["--shards", sample_data.shard_pattern(shared_mount.root), "--num-classes", str(len(sample_data.classes))]
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / f"{script}.py"),
            *data_args,
            "--epochs",
            "1",
            "--workers",
            "2",
            "--batch-size",
            "16",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "epoch 1:" in proc.stdout
