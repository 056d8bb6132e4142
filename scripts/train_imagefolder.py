#!/usr/bin/env python3
"""Train a tiny CNN on a torchvision ImageFolder tree: an ordinary local-disk script.

Nothing here knows about buckets. To train from S3/GCS, mount the prefix with bucketfs
and pass the mounted path as --data; that is the only difference from local disk:

    python scripts/train_imagefolder.py --data /data/local/train      # local disk
    python scripts/train_imagefolder.py --data /mnt/data/train        # bucket, via bucketfs

How the mount is made (once per machine, outside the training script) - any one of:

    # by hand; daemonises and returns once mounted (undo: bucketfs unmount /mnt/data)
    bucketfs mount s3://my-bucket/datasets/toy /mnt/data

    # as a systemd service: the unit bucketfs@NAME reads /etc/bucketfs/NAME.conf
    systemctl enable --now bucketfs@toy

    # in /etc/fstab, mounted at boot
    s3://my-bucket/datasets/toy /mnt/data fuse.bucketfs ro,_netdev,allow_other,nofail 0 0

Layout expected under --data: one directory per class, images inside
(scripts/make_sample_dataset.py writes one: train/classNNN/imgNNNNN.jpg).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from tqdm import tqdm


def tiny_cnn(num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def image_transform(image_px: int):
    return transforms.Compose(
        [
            transforms.Resize((image_px, image_px)),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ]
    )


def make_loader(data: str, batch_size: int, workers: int, image_px: int = 64) -> DataLoader:
    dataset = datasets.ImageFolder(data, transform=image_transform(image_px))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        drop_last=False,
    )


def run_epochs(loader, model, args) -> list:
    """SGD over `loader` for args.epochs (or args.steps); one dict of figures per epoch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    epochs = []
    step = 0
    for epoch in range(args.epochs):
        samples, loss_sum, started = 0, 0.0, time.perf_counter()
        with tqdm(loader, desc=f"epoch {epoch + 1}/{args.epochs}", unit="batch", disable=args.quiet) as bar:
            for images, labels in bar:
                optimizer.zero_grad()
                loss = loss_fn(model(images), labels)
                loss.backward()
                optimizer.step()
                samples += len(labels)
                loss_sum += loss.item() * len(labels)
                step += 1
                bar.set_postfix(
                    loss=f"{loss.item():.3f}", samples_per_s=f"{samples / (time.perf_counter() - started):.0f}"
                )
                if args.steps and step >= args.steps:
                    break
        seconds = time.perf_counter() - started
        epochs.append(
            {
                "samples": samples,
                "seconds": seconds,
                "samples_per_s": samples / seconds,
                "mean_loss": loss_sum / max(samples, 1),
            }
        )
        print(
            f"epoch {epoch + 1}: {samples} samples in {seconds:.2f} s = {samples / seconds:.0f} samples/s, "
            f"mean loss {loss_sum / max(samples, 1):.3f}"
        )
        if args.steps and step >= args.steps:
            break
    return epochs


def train(args) -> dict:
    torch.manual_seed(args.seed)
    loader = make_loader(args.data, args.batch_size, args.workers)
    num_classes = len(loader.dataset.classes)
    print(f"ImageFolder {args.data}: {len(loader.dataset)} images, {num_classes} classes")
    epochs = run_epochs(loader, tiny_cnn(num_classes), args)
    return {"epochs": epochs, "classes": loader.dataset.classes, "images": len(loader.dataset)}


def add_training_args(parser) -> None:
    """The options every example training script takes."""
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: run all epochs)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="DataLoader worker processes (default: up to 4)",
    )
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data", required=True, help="ImageFolder root: one directory per class")
    add_training_args(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
