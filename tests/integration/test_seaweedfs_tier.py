"""A cache tier on an existing distributed store (issue 38): four bucketfs mounts
("nodes") of a SeaweedFS S3 gateway whose remote storage caches the origin bucket.

The origin is rclone's S3 server behind a counting proxy (every GET SeaweedFS sends it
is counted per key); SeaweedFS (bucketfs/testing/seaweed.py) mounts the origin bucket
with `remote.mount`, and the four mounts read it through the gateway. Each node reads
a disjoint share of an ImageFolder-like tree, as torch's DistributedSampler splits it:
the indices shuffled with the epoch's seed, node r taking every 4th from r. Two
epochs, each with its own shuffle and so its own split; every byte is compared with
what was uploaded. Through the tier the origin serves each object about once over
both epochs (<= 1.05 GETs per object); four mounts straight on the origin fetch again
every file whose node changed between the epochs (~1.75 GETs per object).

Mounts use `--fetch-ahead off`: a node reads only its share. With fetch-ahead on, a
node's shuffled reads start a pass that fetches the tree ahead (bucketfs cannot know
the other nodes read the rest until the node's next epoch begins), so in the first
epoch every node fetches most files: the last test shows the tier still asks the
origin for each object about once then, because the tier's filer copies an object
once however many GETs for it arrive together.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import random

import pytest

from bucketfs.backends import versions
from bucketfs.testing.counting_proxy import CountingProxy, counting_proxy
from bucketfs.testing.seaweed import seaweed_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

KB = 1000
NODES = 4
THREADS_PER_NODE = 4  # a node's DataLoader workers
CLASSES = 8
PER_CLASS = 80
FILES_COUNT = CLASSES * PER_CLASS  # 640: a multiple of NODES, so no sampler padding
TARGET_GETS_PER_OBJECT = 1.05
SAMPLER_SEED = 38


def image_tree(seed: int = 0) -> dict:
    """{key: bytes}: train/classNN/imgNNNN.jpg, 8 x 80 files of 8-40 KB."""
    rng = random.Random(seed)
    return {
        f"train/class{c:02d}/img{i:04d}.jpg": rng.randbytes(rng.randrange(8 * KB, 40 * KB + 1))
        for c in range(CLASSES)
        for i in range(PER_CLASS)
    }


def distributed_shares(keys, epoch: int, nodes: int = NODES) -> list:
    """Each node's share of `keys` in `epoch`, as DistributedSampler(shuffle=True) with
    set_epoch(epoch) gives it: a permutation seeded with seed + epoch, node r taking
    positions r, r + nodes, ... (the tree's sorted order is ImageFolder's index order)."""
    order = sorted(keys)
    random.Random(SAMPLER_SEED + epoch).shuffle(order)
    return [order[rank::nodes] for rank in range(nodes)]


def read_digest(mount, key: str) -> tuple:
    with open(mount.path(key), "rb") as f:
        return key, hashlib.sha256(f.read()).digest()


def distributed_epoch(mounts, keys, epoch: int) -> dict:
    """All nodes at once, each reading its share with THREADS_PER_NODE threads: {key: digest}."""
    shares = distributed_shares(keys, epoch, len(mounts))
    with concurrent.futures.ThreadPoolExecutor(len(mounts) * THREADS_PER_NODE) as pool:
        futures = [pool.submit(read_digest, mount, key) for mount, share in zip(mounts, shares) for key in share]
        read = dict(future.result() for future in futures)
    assert len(read) == len(keys)  # the shares are disjoint and cover the tree
    return read


def assert_bytes_match(read: dict, digests: dict) -> None:
    assert set(read) == set(digests)
    wrong = sorted(key for key, digest in read.items() if digest != digests[key])
    assert not wrong, f"{len(wrong)} files differ from the origin's, e.g. {wrong[:5]}"


def gets_per_key(proxy: CountingProxy, bucket: str) -> collections.Counter:
    prefix = f"/{bucket}/"
    return collections.Counter(r.path[len(prefix) :] for r in proxy.object_gets() if r.path.startswith(prefix))


def scan(mount) -> list:
    """The tree's files as ImageFolder's scan finds them (a walk: listings only)."""
    found = []
    for root, dirs, files in os.walk(mount.path("train")):
        dirs.sort()
        found.extend(os.path.relpath(os.path.join(root, name), mount.mountpoint) for name in sorted(files))
    return found


def nodes_read_two_epochs(mounts, digests: dict, proxy: CountingProxy, bucket: str) -> tuple:
    """Both epochs on `mounts`, bytes checked: (origin GETs per key after epoch 1, after epoch 2)."""
    for mount in mounts:
        assert scan(mount) == sorted(digests)
    assert_bytes_match(distributed_epoch(mounts, digests, epoch=0), digests)
    after_first = gets_per_key(proxy, bucket)
    assert_bytes_match(distributed_epoch(mounts, digests, epoch=1), digests)
    return after_first, gets_per_key(proxy, bucket)


def node_counters(mounts) -> list:
    return [
        {k: v for k, v in sorted(m.stats().items()) if k in ("backend.requests.get", "fetch_ahead.files")}
        for m in mounts
    ]


@pytest.fixture(scope="module")
def origin_proxy(rclone_server):
    """The counting proxy in front of the origin (rclone): SeaweedFS's remote endpoint."""
    with counting_proxy(rclone_server.endpoint_url) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def tier(rclone_server, origin_proxy):
    """A SeaweedFS server whose remote storage `origin` is the origin, through the proxy."""
    with seaweed_server() as server:
        server.configure_remote(
            origin_proxy.url, rclone_server.access_key, rclone_server.secret_key, rclone_server.region
        )
        yield server


@pytest.fixture
def seeded_bucket(rclone_server, s3_bucket):
    """(bucket, {key: sha256}): the origin's bucket holding image_tree()."""
    tree = image_tree()
    rclone_server.write_files(s3_bucket, tree)
    return s3_bucket, {key: hashlib.sha256(data).digest() for key, data in tree.items()}


def mount_nodes(mount_factory, server, bucket: str, *args) -> list:
    return [mount_factory(server, bucket, "", "--fetch-ahead", "off", *args) for _ in range(NODES)]


def test_four_nodes_through_the_tier_cost_the_origin_one_get_per_object(
    tier, origin_proxy, seeded_bucket, mount_factory
):
    bucket, digests = seeded_bucket
    tier.mount_remote(bucket)
    assert not gets_per_key(origin_proxy, bucket), "remote.mount fetched objects"
    mounts = mount_nodes(mount_factory, tier, bucket)

    first, both = nodes_read_two_epochs(mounts, digests, origin_proxy, bucket)
    total = sum(both.values())
    print(
        f"\nthrough the SeaweedFS tier: {total} origin GETs for {FILES_COUNT} objects over 2 epochs "
        f"({total / FILES_COUNT:.3f} per object; epoch 1 {sum(first.values())}, epoch 2 {total - sum(first.values())})"
    )
    assert set(both) == set(digests)  # every object came from the origin, through the tier
    assert total / FILES_COUNT <= TARGET_GETS_PER_OBJECT, (both.most_common(5), node_counters(mounts))
    # Epoch 2 reads each file on a node that mostly did not read it in epoch 1: the tier
    # served it from its own volumes.
    assert total - sum(first.values()) <= (TARGET_GETS_PER_OBJECT - 1) * FILES_COUNT

    # A node mounted now lists the objects with the ETags the tier gave them when it
    # cached them (If-Match pinned, not Last-Modified): its reads are right and cost
    # the origin nothing.
    late = mount_factory(tier, bucket, "", "--fetch-ahead", "off")
    sample = random.Random(1).sample(sorted(digests), 64)
    read = dict(read_digest(late, key) for key in sample)
    assert_bytes_match(read, {key: digests[key] for key in sample})
    assert gets_per_key(origin_proxy, bucket) == both
    assert versions.PINNING_LOG[versions.ETAG] in late.stderr_text
    assert versions.PINNING_LOG[versions.LASTMOD] not in late.stderr_text
    # The first nodes listed before anything was cached: no ETags, Last-Modified pins.
    assert versions.PINNING_LOG[versions.LASTMOD] in mounts[0].stderr_text


def test_four_nodes_on_the_origin_fetch_again_what_another_node_read(
    rclone_server, origin_proxy, seeded_bucket, mount_factory
):
    bucket, digests = seeded_bucket
    mounts = [
        mount_factory(rclone_server, bucket, "", "--fetch-ahead", "off", endpoint_url=origin_proxy.url)
        for _ in range(NODES)
    ]

    first, both = nodes_read_two_epochs(mounts, digests, origin_proxy, bucket)
    total = sum(both.values())
    print(
        f"\nfour mounts on the origin: {total} origin GETs for {FILES_COUNT} objects over 2 epochs "
        f"({total / FILES_COUNT:.3f} per object)"
    )
    # Epoch 1: each object once. Epoch 2: again each object whose node changed (its own
    # node keeps it in the page cache): about 3/4 of them with 4 nodes.
    assert sum(first.values()) == FILES_COUNT and max(first.values()) == 1, first.most_common(3)
    old_node = {key: rank for rank, share in enumerate(distributed_shares(digests, 0)) for key in share}
    moved = sum(
        1 for rank, share in enumerate(distributed_shares(digests, 1)) for key in share if old_node[key] != rank
    )
    assert moved > 0.6 * FILES_COUNT
    assert FILES_COUNT + moved <= total <= FILES_COUNT + moved + 0.02 * FILES_COUNT, node_counters(mounts)


def test_fetch_ahead_on_every_node_still_reaches_the_origin_once_per_object(
    tier, origin_proxy, seeded_bucket, mount_factory
):
    """With fetch-ahead on (the default), each node's shuffled reads start a pass over
    the whole tree: four nodes ask the tier for every object, often at the same
    moment; the tier's filer makes one origin GET of each."""
    bucket, digests = seeded_bucket
    tier.mount_remote(bucket)
    mounts = [mount_factory(tier, bucket, "") for _ in range(NODES)]

    _first, both = nodes_read_two_epochs(mounts, digests, origin_proxy, bucket)
    total = sum(both.values())
    counters = node_counters(mounts)
    tier_gets = sum(c.get("backend.requests.get", 0) for c in counters)
    print(
        f"\nfetch-ahead on, through the tier: {total} origin GETs ({total / FILES_COUNT:.3f} per object); "
        f"the nodes made {tier_gets} GETs to the tier ({tier_gets / FILES_COUNT:.2f} per object): {counters}"
    )
    assert total / FILES_COUNT <= TARGET_GETS_PER_OBJECT, (both.most_common(5), counters)
