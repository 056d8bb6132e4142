"""The listing index: a prefix's objects in one compact, versioned, checksummed file
(`bucketfs index build` writes it, `bucketfs mount --index` reads it). The format is
documented in docs/index-format.md; this module is its one implementation.

    MAGIC (8) | FORMAT VERSION (u16 BE) | HEADER BYTES H (u32 BE) | HEADER (H, UTF-8 JSON)
    | BODY (header["body_bytes"]) | SHA-256 of everything before it (32)

The body is one record per directory, in code point order of its path (relative to
the URL's prefix: "" for the prefix itself, else ending in "/"); each record holds
the objects directly in that directory, as columns compressed with zlib:

    u32 LE path bytes | path (UTF-8) | u32 LE objects count N | u32 LE payload bytes | payload
    payload = zlib(N x u32 name lengths (code points) | N x u64 sizes | N x i64 mtimes (ns)
                   | N x u32 version lengths (code points) | u32 names bytes | names (UTF-8)
                   | versions (UTF-8))

Invariants:
- Pure: no I/O, no SDK, no trio. `encode_index` gives the bytes, `decode_index` takes
  them (a file's or an object's) and refuses anything it cannot vouch for with one of
  the `IndexProblem`s below, each saying why in one line: not an index (magic), a
  format version it does not know (checked before anything else the version
  decides), damaged (the checksum, or any structure that does not add up), or of
  another URL (`expected_url`). Never a struct, zlib or JSON error.
- Keys are relative to the URL's prefix; an object's key is its record's path plus
  its name (a name is never empty, except the prefix's own directory marker, whose
  key is the path itself). Every directory that holds an object, and each of its
  ancestors, has a record, so subdirectories are known without a listing.
- Names and versions round-trip exactly, lone surrogates included (surrogatepass).
- A decoded index keeps each directory's payload compressed until `take` decodes it
  for the namespace and forgets it: before a directory is listed it costs its share
  of the file, after it its nodes (core/namespace.py).
"""

from __future__ import annotations

import array
import datetime
import hashlib
import itertools
import json
import operator
import struct
import sys
import zlib
from typing import Iterable, Iterator, Optional

MAGIC = b"\x89BKTIDX\n"  # (PNG's trick: a byte >127 and a newline catch text-mode damage)
FORMAT_VERSION = 1
CHECKSUM_BYTES = 32  # SHA-256
_PREAMBLE = struct.Struct(">8sHI")  # magic, format version, header bytes
_RECORD_HEAD = struct.Struct("<I")
_COMPRESSION = "zlib"
_ZLIB_LEVEL = 1  # (6 compresses 3% smaller and takes 4x as long: an index is written on a build's critical path)
# A header is a few hundred bytes; anything near this is no header of ours.
_HEADER_BYTES_MAX = 1 << 20
_UNICODE = "surrogatepass"  # lone surrogates in a key survive the round trip

# array typecodes of the columns (their item sizes are checked at import).
_U32, _U64, _I64 = "I", "Q", "q"
assert array.array(_U32).itemsize == 4 and array.array(_U64).itemsize == 8 and array.array(_I64).itemsize == 8
_SWAP = sys.byteorder != "little"  # columns are little-endian on disk


class IndexProblem(Exception):
    """An index that cannot be used; the message is one line for the user."""


class NotAnIndex(IndexProblem):
    """No bucketfs index at all (the magic bytes are wrong)."""


class UnknownIndexVersion(IndexProblem):
    """A format version this bucketfs does not read (a newer one wrote it)."""

    def __init__(self, message: str, version: int):
        super().__init__(message)
        self.version = version


class DamagedIndex(IndexProblem):
    """A bucketfs index whose checksum or structure does not hold (cut short, altered)."""


class IndexOfAnotherURL(IndexProblem):
    """An intact index, built for another bucket URL than the one mounted."""

    def __init__(self, message: str, index_url: str):
        super().__init__(message)
        self.index_url = index_url


def directory_of(key: str) -> str:
    """The directory path of a relative key: everything up to its last '/'."""
    return key[: key.rfind("/") + 1]


def parent_of(path: str) -> str:
    """The parent directory of a directory path ('a/b/' -> 'a/', 'a/' -> '', 'a//' -> 'a/')."""
    return path[: path.rfind("/", 0, len(path) - 1) + 1]


def _column(typecode: str, values) -> bytes:
    column = array.array(typecode, values)
    if _SWAP:
        column.byteswap()
    return column.tobytes()


def _payload(names: list, sizes: list, mtimes: list, versions: list) -> bytes:
    names_blob = "".join(names).encode("utf-8", _UNICODE)
    return zlib.compress(
        b"".join(
            (
                _column(_U32, map(len, names)),
                _column(_U64, sizes),
                _column(_I64, mtimes),
                _column(_U32, map(len, versions)),
                _RECORD_HEAD.pack(len(names_blob)),
                names_blob,
                "".join(versions).encode("utf-8", _UNICODE),
            )
        ),
        _ZLIB_LEVEL,
    )


def encode_index(
    url: str, entries: Iterable[tuple], built_at_ns: int, created_by: str = "", key_start: int = 0
) -> bytes:
    """The index file of `url` (a bucket URL as config.BucketURL prints it) holding
    `entries`, (key, size, mtime_ns, version) in any order (ObjectInfos are such
    tuples), each key relative to the prefix once its first `key_start` characters are
    dropped. A key listed twice is kept once (the first). ValueError for a negative size."""
    # Column by column, in C loops where it can (a build's 200,000 entries: 0.17 s one
    # entry at a time, a Python step each, ~0.06 s so).
    rows = entries if isinstance(entries, list) else list(entries)
    keys, sizes, mtimes, versions = (list(map(operator.itemgetter(i), rows)) for i in range(4))
    if key_start:
        keys = list(map(operator.getitem, keys, itertools.repeat(slice(key_start, None))))
    if sizes and min(sizes) < 0:
        at = next(i for i, size in enumerate(sizes) if size < 0)
        raise ValueError(f"{keys[at]!r}: negative size {sizes[at]}")
    slashes = list(map(str.rfind, keys, itertools.repeat("/")))
    if max(slashes, default=-1) < 0:  # (a flat prefix: one directory, names are keys)
        names, dirs = keys, None
    else:
        names = [key[at + 1 :] for key, at in zip(keys, slashes)]
        dirs = [key[: at + 1] for key, at in zip(keys, slashes)]
    # By directory, then by name: within a directory, key order is name order. Both
    # sorts are stable, so of a key listed twice the first comes first. (A listing's
    # keys come in order, each once: a flat one is then its own record, as it is.)
    every: Optional[list] = None
    if all(map(operator.lt, keys, itertools.islice(keys, 1, None))):
        order = every = list(range(len(keys)))
    else:
        order = sorted(range(len(keys)), key=keys.__getitem__)
        if len(set(keys)) != len(keys):
            order = [i for i, before in zip(order, [None, *order]) if before is None or keys[before] != keys[i]]
    by_dir: dict = {}
    if dirs is None:
        if order:
            by_dir[""] = order
    else:
        order.sort(key=dirs.__getitem__)
        for path, group in itertools.groupby(order, key=dirs.__getitem__):
            by_dir[path] = list(group)
    for path in list(by_dir):  # every ancestor gets a record, even one holding only directories
        while path:
            path = parent_of(path)
            by_dir.setdefault(path, [])
    by_dir.setdefault("", [])
    records, objects_count, first_key = [], 0, None
    for path in sorted(by_dir):
        kept = by_dir[path]
        if kept is every:
            payload = _payload(names, sizes, mtimes, versions)
        else:
            payload = _payload(
                list(map(names.__getitem__, kept)),
                list(map(sizes.__getitem__, kept)),
                list(map(mtimes.__getitem__, kept)),
                list(map(versions.__getitem__, kept)),
            )
        if kept and first_key is None:
            first_key = path + names[kept[0]]
        path_bytes = path.encode("utf-8", _UNICODE)
        records.append(struct.pack("<I", len(path_bytes)) + path_bytes + struct.pack("<II", len(kept), len(payload)))
        records.append(payload)
        objects_count += len(kept)
    body = b"".join(records)
    header = json.dumps(
        {
            "url": url,
            "built_at": _rfc3339(built_at_ns),
            "built_at_ns": built_at_ns,
            "objects": objects_count,
            "directories": len(by_dir),
            "body_bytes": len(body),
            "compression": _COMPRESSION,
            "created_by": created_by,
            "first_key": first_key,
        },
        sort_keys=True,
        ensure_ascii=False,
    ).encode("utf-8", _UNICODE)
    head = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)) + header
    digest = hashlib.sha256(head)
    digest.update(body)
    return head + body + digest.digest()


def _rfc3339(ns: int) -> str:
    when = datetime.datetime.fromtimestamp(ns // 10**9, datetime.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S") + f".{ns % 10**9 // 1000:06d}Z"


class _Record:
    """A directory's objects, still compressed."""

    __slots__ = ("count", "payload")

    def __init__(self, count: int, payload: bytes):
        self.count, self.payload = count, payload


def decode_payload(payload: bytes, count: int) -> tuple:
    """(names, sizes, mtimes, versions) of a record's payload: four lists of `count`."""
    data = zlib.decompress(payload)
    columns = []
    at = 0
    for typecode, size in ((_U32, 4), (_U64, 8), (_I64, 8), (_U32, 4)):
        column = array.array(typecode)
        column.frombytes(data[at : at + count * size])
        if len(column) != count:
            raise ValueError("columns cut short")
        if _SWAP:
            column.byteswap()
        columns.append(column)
        at += count * size
    (names_bytes,) = _RECORD_HEAD.unpack_from(data, at)
    at += 4
    names_text = data[at : at + names_bytes].decode("utf-8", _UNICODE)
    versions_text = data[at + names_bytes :].decode("utf-8", _UNICODE)
    name_lens, sizes, mtimes, version_lens = columns
    return (
        _split(names_text, name_lens),
        sizes.tolist(),
        mtimes.tolist(),
        _split(versions_text, version_lens),
    )


def _split(text: str, lengths) -> list:
    ends = list(itertools.accumulate(lengths))
    if (ends[-1] if ends else 0) != len(text):
        raise ValueError("string column lengths do not add up")
    return [text[start:end] for start, end in zip(itertools.chain((0,), ends), ends)]


class ListingIndex:
    """A decoded index: its header, and per directory its objects (decoded on `take`)."""

    def __init__(self, header: dict, records: dict, children: dict, held_bytes: int):
        self.header = header
        self.url: str = header["url"]
        self.built_at_ns: int = header["built_at_ns"]
        self.objects_count: int = header["objects"]
        self.directories_count: int = header["directories"]
        self._records = records  # directory path -> _Record (until taken)
        self._children = children  # directory path -> [names of its subdirectories]
        self.held_bytes = held_bytes  # what the untaken records hold (their payloads and paths)

    @property
    def built_at(self) -> str:
        return self.header["built_at"]

    @property
    def first_key(self) -> Optional[str]:
        """One object's key (relative), to probe the store with; None if there is none."""
        key = self.header.get("first_key")
        return key if isinstance(key, str) else None

    def has(self, path: str) -> bool:
        """Whether the directory `path` (relative) is in the index and not taken yet."""
        return path in self._records

    def take(self, path: str) -> Optional[tuple]:
        """The objects and subdirectories of directory `path`, once: ([(name, size,
        mtime_ns, version)], [subdirectory names]) in name order; the index then
        forgets them. None if the index has no such directory (or gave it already).
        DamagedIndex if its payload cannot be decoded."""
        record = self._records.pop(path, None)
        if record is None:
            return None
        self.held_bytes -= len(record.payload) + len(path) + 64
        subdirectories = sorted(self._children.pop(path, []))
        try:
            names, sizes, mtimes, versions = decode_payload(record.payload, record.count)
        except (zlib.error, ValueError, struct.error, UnicodeDecodeError) as exc:
            raise DamagedIndex(f"index of {self.url}: directory {path!r} cannot be decoded ({exc})") from None
        return list(zip(names, sizes, mtimes, versions)), subdirectories

    def entries(self) -> Iterator[tuple]:
        """Every object not taken yet: (relative key, size, mtime_ns, version), in
        directory order (not key order: a directory's objects come before its
        subdirectories'). Does not take them."""
        for path, record in self._records.items():
            names, sizes, mtimes, versions = decode_payload(record.payload, record.count)
            for name, size, mtime_ns, version in zip(names, sizes, mtimes, versions):
                yield path + name, size, mtime_ns, version

    def directories(self) -> list:
        """The paths of the directories not taken yet, in code point order."""
        return list(self._records)


def decode_index(data: bytes, expected_url: Optional[str] = None, what: str = "the index") -> ListingIndex:
    """`data` as a ListingIndex, or one of the IndexProblems (`what` names the file or
    URL in their messages). `expected_url`: refuse an index of any other URL."""
    view = memoryview(data)
    if len(data) < len(MAGIC) or bytes(view[: len(MAGIC)]) != MAGIC:
        raise NotAnIndex(f"{what} is not a bucketfs index (build one with bucketfs index build)")
    if len(data) < _PREAMBLE.size:
        raise DamagedIndex(f"{what} is damaged: cut short ({len(data)} bytes); build it again")
    _magic, version, header_bytes = _PREAMBLE.unpack_from(data)
    if version != FORMAT_VERSION:
        raise UnknownIndexVersion(
            f"{what} has index format version {version}, and this bucketfs reads version {FORMAT_VERSION} "
            f"only ({'a newer bucketfs wrote it: upgrade' if version > FORMAT_VERSION else 'build it again'})",
            version,
        )
    if header_bytes > _HEADER_BYTES_MAX or len(data) < _PREAMBLE.size + header_bytes + CHECKSUM_BYTES:
        raise DamagedIndex(f"{what} is damaged: cut short ({len(data)} bytes); build it again")
    if hashlib.sha256(view[:-CHECKSUM_BYTES]).digest() != bytes(view[-CHECKSUM_BYTES:]):
        raise DamagedIndex(f"{what} is damaged: its checksum does not match its contents; build it again")
    try:
        return _decode_checked(view, header_bytes, expected_url, what)
    except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as exc:
        # (json.JSONDecodeError is a ValueError.) A checksum that holds over a structure
        # that does not: a writer's bug, or a file made to look like an index.
        raise DamagedIndex(f"{what} is damaged: {exc}; build it again") from None


def _decode_checked(view: memoryview, header_bytes: int, expected_url: Optional[str], what: str) -> ListingIndex:
    start = _PREAMBLE.size
    header = json.loads(bytes(view[start : start + header_bytes]).decode("utf-8", _UNICODE))
    if not isinstance(header, dict):
        raise ValueError("its header is no JSON object")
    for name, kind in (("url", str), ("built_at_ns", int), ("objects", int), ("directories", int), ("body_bytes", int)):
        if not isinstance(header.get(name), kind):
            raise ValueError(f"its header has no {name}")
    if header.get("compression") != _COMPRESSION:
        raise ValueError(f"unknown compression {header.get('compression')!r}")
    body_start = start + header_bytes
    body_end = len(view) - CHECKSUM_BYTES
    if body_end - body_start != header["body_bytes"]:
        raise ValueError(f"a body of {body_end - body_start} bytes where the header says {header['body_bytes']}")
    if expected_url is not None and header["url"] != expected_url:
        raise IndexOfAnotherURL(
            f"{what} is the index of {header['url']}, not of {expected_url} (build one for this URL)", header["url"]
        )
    records: dict = {}
    children: dict = {}
    at, objects_count, held_bytes, last_path = body_start, 0, 0, None
    head = struct.Struct("<I")
    counts = struct.Struct("<II")
    while at < body_end:
        (path_bytes,) = head.unpack_from(view, at)
        at += 4
        if at + path_bytes + 8 > body_end:
            raise ValueError("a directory record runs past the body")
        path = bytes(view[at : at + path_bytes]).decode("utf-8", _UNICODE)
        at += path_bytes
        count, payload_bytes = counts.unpack_from(view, at)
        at += 8
        if at + payload_bytes > body_end:
            raise ValueError("a directory record runs past the body")
        if (path and not path.endswith("/")) or (last_path is not None and path <= last_path):
            raise ValueError(f"directory {path!r} out of order")
        records[path] = _Record(count, bytes(view[at : at + payload_bytes]))
        held_bytes += payload_bytes + len(path) + 64
        at += payload_bytes
        objects_count += count
        last_path = path
    if objects_count != header["objects"] or len(records) != header["directories"]:
        raise ValueError(
            f"{objects_count} objects in {len(records)} directories where the header says "
            f"{header['objects']} in {header['directories']}"
        )
    for path in records:
        if path:
            parent = parent_of(path)
            if parent not in records:
                raise ValueError(f"directory {path!r} without its parent's record")
            children.setdefault(parent, []).append(path[len(parent) : -1])
    return ListingIndex(header, records, children, held_bytes)
