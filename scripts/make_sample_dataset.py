#!/usr/bin/env python3
"""Generate a small, deterministic training dataset in the layout bucketfs's demo expects.

    PREFIX/train/CLASS/NAME.jpg            torchvision ImageFolder tree (real JPEGs)
    PREFIX/shards/shard-000000.tar ...     WebDataset shards: KEY.jpg + KEY.cls (label as text)

Write it to a local directory, or upload it to a bucket to try bucketfs on real storage:

    python scripts/make_sample_dataset.py /tmp/sample
    python scripts/make_sample_dataset.py s3://my-bucket/bucketfs-sample [--endpoint-url URL] [--profile P]

As a module (used by scripts/demo.py and tests/e2e): `imagefolder_objects()` and
`webdataset_objects()` return `{key: bytes}`; `Dataset` bundles both with the facts a
test checks against (classes, per-class counts, per-sample SHA-256).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import os
import random
import sys
import tarfile
from typing import Dict, List, Optional

from PIL import Image, ImageDraw

JPEG_QUALITY = 90
TAR_MTIME = 1_700_000_000  # fixed mtime so shard bytes are reproducible


def sample_jpeg(rng: random.Random, size_px: int) -> bytes:
    """A real JPEG: a random background with random coloured rectangles and a little noise
    (so it compresses like a photo thumbnail, a few KB, not like a flat colour)."""
    image = Image.new("RGB", (size_px, size_px), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 10)):
        x0, y0 = rng.randrange(size_px), rng.randrange(size_px)
        x1, y1 = rng.randint(x0, size_px), rng.randint(y0, size_px)
        draw.rectangle((x0, y0, x1, y1), fill=tuple(rng.randrange(256) for _ in range(3)))
    noise = Image.frombytes("L", (size_px, size_px), rng.randbytes(size_px * size_px)).convert("RGB")
    image = Image.blend(image, noise, 0.15)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def class_names(classes: int) -> List[str]:
    return [f"class{c:03d}" for c in range(classes)]


def imagefolder_objects(
    prefix: str = "train/", classes: int = 5, per_class: int = 20, size_px: int = 64, seed: int = 0
) -> Dict[str, bytes]:
    """`{prefix}CLASS/imgNNNNN.jpg` -> JPEG bytes, `classes` x `per_class` images."""
    rng = random.Random(f"imagefolder-{seed}")
    objects = {}
    for name in class_names(classes):
        for i in range(per_class):
            objects[f"{prefix}{name}/img{i:05d}.jpg"] = sample_jpeg(rng, size_px)
    return objects


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def webdataset_samples(
    shards: int = 8, per_shard: int = 20, classes: int = 5, size_px: int = 64, seed: int = 0
) -> List[List[tuple]]:
    """Per shard, a list of (key, jpeg bytes, label); keys are unique across shards."""
    rng = random.Random(f"webdataset-{seed}")
    return [
        [(f"s{s:06d}_{i:05d}", sample_jpeg(rng, size_px), rng.randrange(classes)) for i in range(per_shard)]
        for s in range(shards)
    ]


def tar_bytes(members: List[tuple]) -> bytes:
    """A tar of `(name, bytes)` members, in order (WebDataset groups consecutive KEY.*)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), TAR_MTIME, 0o444
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def webdataset_objects(
    prefix: str = "shards/", samples: Optional[List[List[tuple]]] = None, **sample_args
) -> Dict[str, bytes]:
    """`{prefix}shard-NNNNNN.tar` -> tar bytes with KEY.jpg and KEY.cls per sample."""
    samples = samples if samples is not None else webdataset_samples(**sample_args)
    objects = {}
    for index, shard in enumerate(samples):
        members = []
        for key, jpeg, label in shard:
            members += [(f"{key}.jpg", jpeg), (f"{key}.cls", str(label).encode())]
        objects[f"{prefix}{shard_name(index)}"] = tar_bytes(members)
    return objects


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass
class Dataset:
    """Both layouts under one prefix plus what a reader must see."""

    objects: Dict[str, bytes]  # key (relative to the dataset prefix) -> bytes
    classes: List[str]
    per_class_count: Dict[str, int]
    shard_count: int
    wds_sha256: Dict[str, str]  # WebDataset sample key -> SHA-256 of its .jpg
    wds_label: Dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(len(v) for v in self.objects.values())

    def shard_pattern(self, root: str) -> str:
        """Brace pattern for all shards under `root` (a mounted or local dataset prefix)."""
        return os.path.join(root, "shards", f"shard-{{{0:06d}..{self.shard_count - 1:06d}}}.tar")


def make_dataset(
    classes: int = 5, per_class: int = 20, shards: int = 8, per_shard: int = 20, size_px: int = 64, seed: int = 0
) -> Dataset:
    objects = imagefolder_objects("train/", classes, per_class, size_px, seed)
    samples = webdataset_samples(shards, per_shard, classes, size_px, seed)
    objects.update(webdataset_objects("shards/", samples))
    flat = [sample for shard in samples for sample in shard]
    return Dataset(
        objects=objects,
        classes=class_names(classes),
        per_class_count={name: per_class for name in class_names(classes)},
        shard_count=shards,
        wds_sha256={key: sha256(jpeg) for key, jpeg, _ in flat},
        wds_label={key: label for key, _, label in flat},
    )


def write_local(root: str, objects: Dict[str, bytes]) -> None:
    for key, data in objects.items():
        path = os.path.join(root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def upload_s3(url: str, objects: Dict[str, bytes], endpoint_url=None, profile=None) -> None:
    import concurrent.futures

    import boto3

    bucket, _, prefix = url[len("s3://") :].partition("/")
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
    client = boto3.session.Session(profile_name=profile).client("s3", endpoint_url=endpoint_url)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key=prefix + kv[0], Body=kv[1]), objects.items()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Layout:\n  DEST/train/classNNN/imgNNNNN.jpg\n  DEST/shards/shard-NNNNNN.tar",
    )
    parser.add_argument("dest", help="a local directory, or s3://BUCKET/PREFIX to upload with boto3")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=200, help="ImageFolder images per class")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--per-shard", type=int, default=250, help="WebDataset samples per shard")
    parser.add_argument("--size", type=int, default=128, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint (for s3:// destinations)")
    parser.add_argument("--profile", help="AWS profile (for s3:// destinations)")
    args = parser.parse_args(argv)
    dataset = make_dataset(args.classes, args.per_class, args.shards, args.per_shard, args.size, args.seed)
    if args.dest.startswith("s3://"):
        upload_s3(args.dest, dataset.objects, args.endpoint_url, args.profile)
    else:
        write_local(args.dest, dataset.objects)
    print(f"wrote {len(dataset.objects)} objects, {dataset.total_bytes / 1e6:.1f} MB to {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
