"""One data-parallel rank: ImageFolder + DistributedSampler + DataLoader over a directory.

    python -m tests.e2e.rank_worker ROOT RANK WORLD_SIZE

No torch.distributed init: DistributedSampler takes num_replicas and rank explicitly,
as each rank of a real job computes them. Prints one JSON line: the relative paths this
rank's loader delivered, in delivery order (checked against the labels it delivered).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms


def main(root: str, rank: int, world_size: int) -> int:
    dataset = datasets.ImageFolder(root, transform=transforms.Compose([transforms.Resize(32), transforms.ToTensor()]))
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0, drop_last=True)
    sampler.set_epoch(0)
    indices = list(sampler)  # the order the loader delivers them in (batches keep sampler order)
    loader = DataLoader(dataset, batch_size=5, sampler=sampler, num_workers=2)
    labels = []
    for images, targets in loader:
        assert images.shape[1:] == (3, 32, 32), images.shape
        assert torch.isfinite(images).all()
        labels += targets.tolist()
    expected = [dataset.targets[i] for i in indices]
    if labels != expected:
        print(f"rank {rank}: delivered labels differ from the sampler's samples", file=sys.stderr)
        return 1
    paths = [os.path.relpath(dataset.samples[i][0], root) for i in indices]
    print(json.dumps({"rank": rank, "paths": paths, "classes": dataset.classes}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
