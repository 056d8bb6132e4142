"""Quick-start command 1 (`python3 scripts/demo.py`), run as the README runs it, on a
small generated dataset: it must start its server, mount, train both loaders for a
cold and a warm epoch, and leave nothing mounted."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from bucketfs.testing.mounting import force_unmount
from tests.e2e.conftest import REPO_ROOT

CLASSES, PER_CLASS, SHARDS, PER_SHARD = 2, 10, 2, 10


@pytest.mark.timeout(300)
def test_demo_trains_both_loaders_cold_then_warm_and_unmounts(tmp_path):
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    try:
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO_ROOT / "scripts" / "demo.py"),
                "--classes",
                str(CLASSES),
                "--per-class",
                str(PER_CLASS),
                "--shards",
                str(SHARDS),
                "--per-shard",
                str(PER_SHARD),
                "--size",
                "32",
                "--mountpoint",
                str(mountpoint),
            ],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,
        )
        assert not os.path.ismount(mountpoint), "the demo left its mount behind"
    finally:
        force_unmount(str(mountpoint))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "errors        none" in proc.stdout, proc.stdout[-3000:]

    # The summary table: loader, epoch, samples, seconds, samples/s, bucket requests.
    rows = {
        (m[1], m[2]): (int(m[3]), int(m[4]))
        for m in re.finditer(
            r"^(ImageFolder|WebDataset)\s+(cold|warm) \(.*?\)\s+(\d+)\s+\S+\s+\S+\s+(\d+)\s*$",
            proc.stdout,
            re.MULTILINE,
        )
    }
    assert set(rows) == {(loader, epoch) for loader in ("ImageFolder", "WebDataset") for epoch in ("cold", "warm")}, (
        proc.stdout[-3000:]
    )
    images, samples = CLASSES * PER_CLASS, SHARDS * PER_SHARD
    assert rows["ImageFolder", "cold"][0] == rows["ImageFolder", "warm"][0] == images
    assert rows["WebDataset", "cold"][0] == rows["WebDataset", "warm"][0] == samples
    # Cold: one GET per image (plus the listings); warm epochs come from the page cache.
    assert images <= rows["ImageFolder", "cold"][1] <= images + CLASSES + 2
    assert rows["ImageFolder", "warm"][1] == 0
    assert rows["WebDataset", "warm"][1] == 0
