"""The listing index format (bucketfs/core/listing_index.py): round trips, what a
decoded index gives the namespace, and every kind of bad file refused with its own
one-line IndexProblem, never another exception."""

from __future__ import annotations

import hashlib
import json
import random
import struct

import pytest

from bucketfs.core import listing_index as li

URL = "s3://bucket/data/"
BUILT_AT_NS = 1_795_000_000_123_456_789

pytestmark = pytest.mark.timeout(60)


def _entries() -> list:
    return [
        ("a.txt", 5, 1_700_000_000_000_000_001, "9e107d9d372bb6826bd81d3542a419d6"),
        ("empty/", 0, 0, "d41d8cd98f00b204e9800998ecf8427e"),  # a directory marker
        ("sub/b.bin", 2**63 - 1, -5, "lastmod 1700000000"),
        ("sub/deeper/c", 0, 7, ""),  # unpinned
        ("", 0, 0, "marker-of-the-prefix"),  # the prefix's own marker
        ("ünï/日本語 😀", 3, 1, "v"),
        ("weird//x", 1, 1, "w"),
        ("lone\udcffsurrogate", 1, 1, "s\ud800"),
        ("only/dirs/below/f", 1, 2, "x"),
    ]


def _by_key(entries) -> dict:
    return {key: (size, mtime_ns, version) for key, size, mtime_ns, version in entries}


def test_a_round_trip_keeps_every_object_and_the_header():
    data = li.encode_index(URL, _entries(), BUILT_AT_NS, created_by="bucketfs test")
    assert data.startswith(li.MAGIC)
    index = li.decode_index(data, expected_url=URL)
    assert index.url == URL and index.built_at_ns == BUILT_AT_NS
    assert index.built_at == "2026-11-18T11:06:40.123456Z"
    assert index.objects_count == len(_entries())
    assert index.header["created_by"] == "bucketfs test"
    assert _by_key(index.entries()) == _by_key(_entries())
    # Every ancestor of a directory with objects has a record, in code point order.
    assert index.directories() == sorted(
        ["", "empty/", "only/", "only/dirs/", "only/dirs/below/", "sub/", "sub/deeper/", "weird/", "weird//", "ünï/"]
    )
    assert index.directories_count == 10


def test_encoding_is_deterministic_and_keeps_a_repeated_key_once():
    entries = _entries()
    shuffled = entries[:]
    random.Random(1).shuffle(shuffled)
    assert li.encode_index(URL, entries, BUILT_AT_NS) == li.encode_index(URL, shuffled, BUILT_AT_NS)
    twice = li.encode_index(URL, [("k", 1, 1, "first"), ("k", 2, 2, "second")], BUILT_AT_NS)
    index = li.decode_index(twice)
    assert list(index.entries()) == [("k", 1, 1, "first")] and index.objects_count == 1


def test_listed_objects_encode_as_their_keys_relative_to_the_prefix():
    """index build hands over the ObjectInfos it listed, whole keys and in key order
    (a flat listing is then one record as it is): the same file as the relative
    entries in any order, with a key listed twice kept once."""
    from bucketfs.backends.base import ObjectInfo

    rng = random.Random(4)
    relative = sorted({*(f"x{i:05d}" for i in range(3000)), *(f"d{i % 7}/{i}" for i in range(500))})
    for names in (relative, [name for name in relative if "/" not in name]):
        entries = [(name, rng.randrange(10**9), rng.randrange(-5, 2**62), f"v{i}") for i, name in enumerate(names)]
        listed = [ObjectInfo("data/" + name, *rest) for name, *rest in entries]
        shuffled = entries + entries[:10]
        rng.shuffle(shuffled)
        expected = li.encode_index(URL, shuffled, BUILT_AT_NS)
        assert li.encode_index(URL, listed, BUILT_AT_NS, key_start=len("data/")) == expected
        assert _by_key(li.decode_index(expected).entries()) == _by_key(entries)


def test_take_gives_a_directory_once_with_its_subdirectories():
    index = li.decode_index(li.encode_index(URL, _entries(), BUILT_AT_NS))
    held_before = index.held_bytes
    objects, subdirectories = index.take("")
    assert objects == [
        ("", 0, 0, "marker-of-the-prefix"),
        ("a.txt", 5, 1_700_000_000_000_000_001, "9e107d9d372bb6826bd81d3542a419d6"),
        ("lone\udcffsurrogate", 1, 1, "s\ud800"),
    ]
    assert subdirectories == ["empty", "only", "sub", "weird", "ünï"]
    assert index.take("") is None and not index.has("")
    assert index.held_bytes < held_before
    assert index.take("sub/") == ([("b.bin", 2**63 - 1, -5, "lastmod 1700000000")], ["deeper"])
    assert index.take("only/") == ([], ["dirs"])
    assert index.take("weird/") == ([], [""])  # 'weird//' is a directory named '' (the namespace skips it)
    assert index.take("empty/") == ([("", 0, 0, "d41d8cd98f00b204e9800998ecf8427e")], [])
    assert index.take("no/such/") is None
    while index.directories():
        index.take(index.directories()[0])
    assert index.held_bytes == 0


def test_an_empty_index_has_the_root_only():
    index = li.decode_index(li.encode_index(URL, [], BUILT_AT_NS), expected_url=URL)
    assert index.objects_count == 0 and index.directories() == [""]
    assert index.take("") == ([], [])


def test_a_large_flat_directory_round_trips_compactly():
    entries = [(f"img{i:07d}.jpg", 100_000 + i, 1_700_000_000 * 10**9 + i, f"{i:032x}") for i in range(100_000)]
    data = li.encode_index(URL, entries, BUILT_AT_NS)
    assert len(data) < 40 * len(entries)  # compressed: ~58 B of raw columns per entry
    index = li.decode_index(data)
    objects, subdirectories = index.take("")
    assert objects == entries and subdirectories == []


def _rebuilt(data: bytes, header_changes=None, body=None, version=None) -> bytes:
    """`data` with its header changed, its body replaced, or its version, with a valid checksum."""
    magic, old_version, header_bytes = struct.unpack_from(">8sHI", data)
    start = struct.calcsize(">8sHI")
    header = json.loads(data[start : start + header_bytes])
    old_body = data[start + header_bytes : -32]
    header.update(header_changes or {})
    if body is not None:
        header["body_bytes"] = len(body)
    header_raw = json.dumps(header).encode()
    out = struct.pack(">8sHI", magic, version or old_version, len(header_raw)) + header_raw
    out += old_body if body is None else body
    return out + hashlib.sha256(out).digest()


def test_each_bad_index_is_refused_with_its_own_problem():
    good = li.encode_index(URL, _entries(), BUILT_AT_NS)
    cases = [
        (b"", li.NotAnIndex, "not a bucketfs index"),
        (b'{"a": 1}\n' * 10, li.NotAnIndex, "not a bucketfs index"),
        (good.replace(li.MAGIC, b"\x89BKTIDY\n", 1), li.NotAnIndex, "not a bucketfs index"),
        (good[:12], li.DamagedIndex, "cut short"),
        (good[:-1], li.DamagedIndex, "checksum"),
        (good[:100], li.DamagedIndex, "cut short"),
        (good[:-40] + bytes([good[-40] ^ 1]) + good[-39:], li.DamagedIndex, "checksum"),
        (_rebuilt(good, version=2), li.UnknownIndexVersion, "version 2"),
        (_rebuilt(good, {"objects": 3}), li.DamagedIndex, "where the header says"),
        (_rebuilt(good, {"compression": "zstd"}), li.DamagedIndex, "unknown compression"),
        (_rebuilt(good, {"url": 5}), li.DamagedIndex, "no url"),
        (_rebuilt(good, body=b"\xff" * 64), li.DamagedIndex, "runs past the body"),
        (_rebuilt(good, body=b""), li.DamagedIndex, "where the header says"),
    ]
    for data, problem, fragment in cases:
        with pytest.raises(problem) as caught:
            li.decode_index(data, expected_url=URL, what="/tmp/x.idx")
        message = str(caught.value)
        assert fragment in message and "\n" not in message and "/tmp/x.idx" in message, message
    # A format version from the future is named before its checksum is looked at:
    # the layout after the version is the version's to define.
    future = struct.pack(">8sHI", li.MAGIC, 7, 0) + b"whatever follows in version 7"
    with pytest.raises(li.UnknownIndexVersion, match="upgrade") as caught:
        li.decode_index(future)
    assert caught.value.version == 7


def test_an_index_of_another_url_is_refused_and_names_both():
    data = li.encode_index("s3://bucket/other/", _entries(), BUILT_AT_NS)
    with pytest.raises(li.IndexOfAnotherURL) as caught:
        li.decode_index(data, expected_url=URL, what="idx")
    assert "s3://bucket/other/" in str(caught.value) and URL in str(caught.value)
    assert caught.value.index_url == "s3://bucket/other/"
    assert li.decode_index(data).url == "s3://bucket/other/"  # (no URL expected: any)


def test_any_flipped_byte_is_an_index_problem_never_another_error():
    data = li.encode_index(URL, _entries()[:4], BUILT_AT_NS)
    rng = random.Random(38)
    for at in range(len(data)):
        damaged = bytearray(data)
        damaged[at] ^= 1 << rng.randrange(8)
        with pytest.raises(li.IndexProblem):
            li.decode_index(bytes(damaged), expected_url=URL)
    for cut in range(len(data)):
        with pytest.raises(li.IndexProblem):
            li.decode_index(data[:cut])


def test_a_valid_checksum_over_a_nonsense_body_is_still_damaged():
    """A writer's bug (or a file made to pass the checksum): structure checks, one line each."""
    good = li.encode_index(URL, _entries(), BUILT_AT_NS)
    rng = random.Random(7)
    for _ in range(300):
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80)))
        with pytest.raises(li.DamagedIndex):
            li.decode_index(_rebuilt(good, body=body))

    # Records out of order, or a directory whose parent has no record.
    def record(path: str, count: int = 0) -> bytes:
        payload = li._payload([], [], [], [])
        raw = path.encode()
        return struct.pack("<I", len(raw)) + raw + struct.pack("<II", count, len(payload)) + payload

    for records, fragment in (
        (["", "b/", "a/"], "out of order"),
        (["", "a/b/"], "without its parent"),
        (["", "x"], "out of order"),
    ):
        body = b"".join(record(path) for path in records)
        with pytest.raises(li.DamagedIndex, match=fragment):
            li.decode_index(_rebuilt(good, {"objects": 0, "directories": len(records)}, body=body))
    # A payload that does not decode is damaged too, when its directory is taken.
    bad_payload = struct.pack("<I", 0) + struct.pack("<II", 2, 3) + b"zzz"
    index = li.decode_index(_rebuilt(good, {"objects": 2, "directories": 1}, body=bad_payload))
    with pytest.raises(li.DamagedIndex, match="cannot be decoded"):
        index.take("")


def test_a_negative_size_is_refused_when_writing():
    with pytest.raises(ValueError, match="negative size"):
        li.encode_index(URL, [("k", -1, 0, "v")], BUILT_AT_NS)
