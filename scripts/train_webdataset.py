#!/usr/bin/env python3
"""Train a tiny CNN on WebDataset shards read by path: an ordinary local-disk script.

Nothing here knows about buckets. To train from S3/GCS, mount the prefix with bucketfs
and pass the mounted shard paths as --shards; that is the only difference from local disk:

    python scripts/train_webdataset.py --shards '/data/local/shards/shard-{000000..000015}.tar'
    python scripts/train_webdataset.py --shards '/mnt/data/shards/shard-{000000..000015}.tar'

How the mount is made (once per machine, outside the training script) - any one of:

    # by hand; daemonises and returns once mounted (undo: bucketfs unmount /mnt/data)
    bucketfs mount s3://my-bucket/datasets/toy /mnt/data

    # as a systemd service: the unit bucketfs@NAME reads /etc/bucketfs/NAME.conf
    systemctl enable --now bucketfs@toy

    # in /etc/fstab, mounted at boot
    s3://my-bucket/datasets/toy /mnt/data fuse.bucketfs ro,_netdev,allow_other,nofail 0 0

Each shard is a tar of samples KEY.jpg (image) + KEY.cls (integer label as text), as
scripts/make_sample_dataset.py writes them. DataLoader workers take shards by stride
(webdataset's split_by_worker), so use at least as many shards as workers.
"""

from __future__ import annotations

import argparse
import sys

import torch
import webdataset as wds
from torch.utils.data import DataLoader
from train_imagefolder import add_training_args, image_transform, run_epochs, tiny_cnn


def make_loader(shards: str, batch_size: int, workers: int, shard_shuffle: int = 100, image_px: int = 64) -> DataLoader:
    dataset = (
        wds.WebDataset(shards, shardshuffle=shard_shuffle or False)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(image_transform(image_px), int)
    )
    return DataLoader(dataset, batch_size=batch_size, num_workers=workers, persistent_workers=workers > 0)


def train(args) -> dict:
    torch.manual_seed(args.seed)
    loader = make_loader(args.shards, args.batch_size, args.workers, args.shard_shuffle)
    print(f"WebDataset {args.shards}")
    return {"epochs": run_epochs(loader, tiny_cnn(args.num_classes), args)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--shards", required=True, help="shard paths, brace-expanded: '/dir/shard-{000000..000015}.tar'"
    )
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--shard-shuffle", type=int, default=100, help="shard shuffle buffer (0: shards in order)")
    add_training_args(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
