"""The disk cache's journal: what is on disk and its checksums, kept across mounts.

One append-only file per cache directory. Records say "entry N is (key, version,
size)", "these chunks of entry N are on disk with these CRC-32s" and "entry N is
deleted". Loading it at mount gives back the cache a previous mount left.

Invariants:
- A chunk record is appended only after its bytes were written (pwrite), and every
  chunk is checked against its CRC on every read: a crash or power loss that kept the
  record but not the bytes costs a GET, never a wrong byte. No fsync is needed.
- Each record carries its own CRC-32; loading stops at the first torn or bad one and
  cuts the file there, so appends resume after the last good record.
- Entry numbers are never reused (data files are named by them): a record can never
  describe another object's file.
- A chunk size other than the one the journal was written with discards the cache.
- Every access goes through the cache directory's descriptor (dir_fd=): a journal
  deleted with its directory under a running mount takes no appends, and is never
  confused with a new journal at the same path.
- An entry number defined twice as two different objects (only two writers sharing
  one journal could do that) is dropped at load: its file and CRCs are nobody's.
- Writes come from worker threads: each record batch is one write() with O_APPEND,
  so batches do not interleave. A short or failed write leaves a torn tail; the
  journal then takes no more appends (loading would stop at the tear).
- Bounded: once it holds COMPACT_RATIO times what its live entries need (evictions
  leave dead records), it is rewritten from the index (`compact`, at load or while
  mounted), appends held meanwhile; a failed rewrite leaves the journal as it was. Each Entry keeps its definition record for this.
"""

from __future__ import annotations

import array
import collections
import errno
import hashlib
import itertools
import os
import struct
import threading
import zlib
from typing import Optional

MAGIC = b"bucketfs-cache-journal-1\n"
_HEADER = struct.Struct("<I")  # chunk bytes
_RECORD = struct.Struct("<II")  # payload length, CRC-32 of the payload
_ENTRY = struct.Struct("<cQQH")  # b"E", entry number, object bytes, key length; then key, version
_CHUNKS = struct.Struct("<cQ")  # b"C", entry number; then (chunk index, CRC-32) pairs
_PAIR = struct.Struct("<II")
_DELETE = struct.Struct("<cQ")  # b"D", entry number
# Rewritten (at load, or while mounted) once it holds this many times the bytes its
# live records need, plus a margin (evictions leave dead records behind): the caller's
# `min_bytes`, at most COMPACT_MIN_BYTES.
COMPACT_RATIO = 2
COMPACT_MIN_BYTES = 1024 * 1024
LOAD_BLOCK_BYTES = 8 * 1024 * 1024
# Chunk records hold at most this many chunks (a 100 GB object has 1.6 M), so no
# record is long: a length field past RECORD_MAX_BYTES is a torn one.
CHUNKS_PER_RECORD_MAX = 8192
RECORD_MAX_BYTES = 1024 * 1024
# Memory an Entry and its place in the index take, past its definition record and 4
# bytes a chunk: 406 bytes traced for a 2-chunk object (a 200,000-entry index), plus
# allocator slack, plus the policy's clock stamp (a slot and an int: policy.py).
INDEX_ENTRY_BYTES = 480


def entry_id(key: str, version: str) -> bytes:
    """The in-memory name of an object version: 16 bytes, not two strings and a tuple
    (a million cached objects is ImageNet)."""
    return hashlib.blake2b(f"{key}\0{version}".encode("utf-8", "surrogateescape"), digest_size=16).digest()


# Objects of up to this many chunks keep their chunk bitmap in an int (28-36 bytes;
# shifts of a few machine words cost nothing). Larger ones keep a bytearray, a byte a
# chunk, so storing or checking a chunk is O(1) however large the object: an int of a
# million bits (a 64 GiB object) is rebuilt by every change, which made loading or
# storing it quadratic (minutes).
INT_BITMAP_CHUNKS_MAX = 64


class Entry:
    """One object version in the cache: which chunks of its data file hold its bytes,
    and their CRC-32s. Memory: `index_bytes()`."""

    __slots__ = (
        "entry_no",
        "object_bytes",
        "definition",
        "present",
        "crcs",
        "stored_bytes",
        "gone",
        "recorded",
        "read_at",
    )

    def __init__(self, entry_no: int, object_bytes: int, chunk_bytes: int, definition: bytes):
        self.entry_no, self.object_bytes = entry_no, object_bytes
        self.definition = definition  # its E record, to rewrite the journal without key strings in memory
        chunks_count = -(-object_bytes // chunk_bytes)
        # chunk i is on disk: bit i of an int, or byte i of a bytearray (INT_BITMAP_CHUNKS_MAX)
        self.present = 0 if chunks_count <= INT_BITMAP_CHUNKS_MAX else bytearray(chunks_count)
        self.crcs = array.array("I", bytes(4 * chunks_count))  # CRC-32 of each present chunk
        self.stored_bytes = 0  # of the object's bytes, on disk
        self.gone = False  # evicted: a write still in flight must delete what it wrote
        self.recorded = False  # the journal has its definition
        self.read_at = 0  # the replacement policy's clock at its last read (policy.py)

    def has(self, first: int, last: int) -> bool:
        """Chunks [first, last) are all on disk."""
        present = self.present
        if isinstance(present, int):
            mask = (1 << (last - first)) - 1
            return (present >> first) & mask == mask
        return present.find(0, first, last) < 0

    def add(self, chunk: int, crc: int, chunk_bytes: int) -> None:
        """Mark a chunk stored (its bytes count in stored_bytes once)."""
        self.crcs[chunk] = crc
        present = self.present
        if isinstance(present, int):
            if present >> chunk & 1:
                return
            self.present = present | 1 << chunk
        else:
            if present[chunk]:
                return
            present[chunk] = 1
        self.stored_bytes += min(chunk_bytes, self.object_bytes - chunk * chunk_bytes)

    def present_chunks(self) -> list:
        """The indexes of the chunks on disk, in order."""
        present = self.present
        if isinstance(present, int):
            return [i for i in range(len(self.crcs)) if present >> i & 1]
        return list(itertools.compress(range(len(present)), present))

    def records(self) -> bytes:
        """What the journal needs to know of it: its definition and its chunks."""
        crcs = self.crcs
        pairs = [(i, crcs[i]) for i in self.present_chunks()]
        return self.definition + b"".join(
            chunks_record(self.entry_no, pairs[at : at + CHUNKS_PER_RECORD_MAX])
            for at in range(0, len(pairs), CHUNKS_PER_RECORD_MAX)
        )

    def record_bytes(self) -> int:
        """len(records()), counting every chunk (an estimate of what a rewrite keeps)."""
        return len(self.definition) + _RECORD.size + _CHUNKS.size + _PAIR.size * len(self.crcs)

    def index_bytes(self) -> int:
        """The memory it takes, as charged to the budget."""
        bitmap_bytes = 0 if isinstance(self.present, int) else len(self.present)
        return INDEX_ENTRY_BYTES + len(self.definition) + 4 * len(self.crcs) + bitmap_bytes


def _record(payload: bytes) -> bytes:
    return _RECORD.pack(len(payload), zlib.crc32(payload)) + payload


def entry_record(entry_no: int, key: str, version: str, object_bytes: int) -> bytes:
    """The definition record: entry number, size, key and version (one UTF-8 encoding,
    the one entry_id hashes)."""
    key_b, version_b = key.encode("utf-8", "surrogateescape"), version.encode("utf-8", "surrogateescape")
    return _record(_ENTRY.pack(b"E", entry_no, object_bytes, len(key_b)) + key_b + version_b)


def chunks_record(entry_no: int, pairs) -> bytes:
    """The record of (chunk index, CRC-32) `pairs` of an entry."""
    return _record(_CHUNKS.pack(b"C", entry_no) + b"".join(_PAIR.pack(i, crc) for i, crc in pairs))


def delete_record(entry_no: int) -> bytes:
    return _record(_DELETE.pack(b"D", entry_no))


def _parse(data: memoryview, chunk_bytes: int, entries: collections.OrderedDict, ids: dict, conflicts: set) -> tuple:
    """Apply the whole records at the start of `data` to `entries` (entry number ->
    Entry, least recently written first) and `ids` (entry number -> entry_id):
    (their length, the highest entry number seen, whether a bad record stopped it).
    `conflicts`: entry numbers defined as two different objects (dropped, and every
    later record of them ignored)."""
    at = highest_no = 0
    while at + _RECORD.size <= len(data):
        length, crc = _RECORD.unpack_from(data, at)
        start = at + _RECORD.size
        payload = data[start : start + length]
        if length > RECORD_MAX_BYTES:
            return at, highest_no, True  # a torn length field: do not read on for it
        if len(payload) < length:
            break  # (cut by the end of `data`: the next block may hold the rest)
        if not length or zlib.crc32(payload) != crc:
            return at, highest_no, True
        at = start + length
        kind = bytes(payload[:1])
        if kind == b"E":
            _, no, object_bytes, key_len = _ENTRY.unpack_from(payload)
            highest_no = max(highest_no, no)
            body = bytes(payload[_ENTRY.size :])
            # the id straight from the bytes: entry_id's encoding of the decoded strings
            eid = hashlib.blake2b(body[:key_len] + b"\0" + body[key_len:], digest_size=16).digest()
            known = ids.get(no)
            if no in conflicts:
                continue
            if known is None:
                entries[no] = Entry(no, object_bytes, chunk_bytes, bytes(data[start - _RECORD.size : at]))
                ids[no] = eid
            elif known != eid:
                # One number, two objects: two writers shared this journal (numbers are
                # never reused otherwise). Neither its file nor its CRCs can be trusted.
                del entries[no], ids[no]
                conflicts.add(no)
                continue
            entries.move_to_end(no)  # (a repeated definition, from two first writes at once, keeps the chunks)
        elif kind == b"C":
            _, no = _CHUNKS.unpack_from(payload)
            entry = entries.get(no)
            if entry is not None:  # (chunks of a deleted entry, from a write that raced its eviction)
                chunks_count = len(entry.crcs)
                for i, chunk_crc in _PAIR.iter_unpack(payload[_CHUNKS.size :]):
                    if i < chunks_count:
                        entry.add(i, chunk_crc, chunk_bytes)
                entries.move_to_end(no)
        elif kind == b"D":
            no = _DELETE.unpack_from(payload)[1]
            if entries.pop(no, None) is not None:
                del ids[no]
        else:
            return at, highest_no, True
    return at, highest_no, False


def _load(dir_fd: int, header: bytes, chunk_bytes: int, entries: collections.OrderedDict, ids: dict) -> Optional[tuple]:
    """Read the journal in the directory `dir_fd` in blocks (a journal of a million
    objects is hundreds of MB: never all of it in memory at once): (the length of its
    good prefix, its total length, the highest entry number seen), or None if it is
    missing or does not start with `header`."""
    try:
        fd = os.open(JOURNAL_NAME, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    conflicts: set = set()
    with open(fd, "rb") as f:
        if f.read(len(header)) != header:
            return None
        good, highest_no, pending = len(header), 0, b""
        while True:
            block = f.read(LOAD_BLOCK_BYTES)
            data = pending + block
            used, highest, bad = _parse(memoryview(data), chunk_bytes, entries, ids, conflicts)
            good += used
            highest_no = max(highest_no, highest)
            pending = data[used:]
            if bad or not block:
                return good, good + len(pending) + len(f.read()), highest_no


JOURNAL_NAME = "journal"
_NEW_NAME = "journal.new"


class Journal:
    """The journal of the cache directory open as `dir_fd` (every access relative to
    it: a directory deleted under the mount fails appends, never finds another's),
    loaded and open for appends. `entries` (entry number -> Entry, least recently
    written first) and `ids` (entry number -> entry_id) are what earlier mounts left,
    for the cache to take over. `fresh`: there was no usable journal (new, or another
    format or chunk size), so it needs `compact` before any append. A torn tail is cut
    in place (a truncate needs no free space). `broken`: it takes no appends."""

    def __init__(self, dir_fd: int, chunk_bytes: int):
        self.dir_fd = dir_fd
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.ids: dict = {}
        self.broken = False
        self._lock = threading.Lock()  # appends against a rewrite
        self._header = MAGIC + _HEADER.pack(chunk_bytes)
        _unlink_quietly(_NEW_NAME, dir_fd)  # (a rewrite a crash interrupted)
        loaded = _load(dir_fd, self._header, chunk_bytes, self.entries, self.ids)
        highest_no = 0
        self.fresh = loaded is None
        self.size_bytes = 0
        if loaded is not None:
            self.size_bytes, file_bytes, highest_no = loaded
            if self.size_bytes < file_bytes:  # cut a torn tail, so appends follow the last good record
                fd = os.open(JOURNAL_NAME, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)
                try:
                    os.ftruncate(fd, self.size_bytes)
                finally:
                    os.close(fd)
        self.next_entry_no = highest_no + 1  # never an earlier number, even a deleted one's

    def needs_compacting(self, live_record_bytes: int, min_bytes: int) -> bool:
        return self.size_bytes > COMPACT_RATIO * live_record_bytes + min_bytes

    def compact(self, entries) -> None:
        """Rewrite the journal as the records of `entries` (an iterable evaluated with
        appends held: a callable's result, for a snapshot taken then). On failure the
        journal is as it was (and no journal.new is left)."""
        with self._lock:
            if callable(entries):
                entries = entries()
            try:
                fd = os.open(_NEW_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600, dir_fd=self.dir_fd)
                with open(fd, "wb") as f:
                    f.write(self._header)
                    for entry in entries:
                        f.write(entry.records())
                    f.flush()
                    os.fsync(f.fileno())  # the rename must not publish an empty file after a crash
                    size_bytes = f.tell()
                os.replace(_NEW_NAME, JOURNAL_NAME, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            except BaseException:
                _unlink_quietly(_NEW_NAME, self.dir_fd)
                raise
            self.size_bytes = size_bytes
            self.fresh = False

    def append(self, data: bytes) -> None:
        """Append record bytes (from any thread); OSError if the journal takes no more."""
        with self._lock:
            if self.broken or self.fresh:
                raise OSError(errno.EIO, "the disk cache journal takes no more appends")
            try:
                # Opened per append (microseconds, beside the data write it follows): no
                # descriptor of a replaced journal is ever written.
                fd = os.open(JOURNAL_NAME, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC, dir_fd=self.dir_fd)
                try:
                    written = os.write(fd, data)
                finally:
                    os.close(fd)
            except OSError:
                self.broken = True
                raise
            self.size_bytes += written
            if written != len(data):
                self.broken = True
                raise OSError(f"short write to the disk cache journal ({written} of {len(data)} bytes)")


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


DATA_DIR_NAME = "data"


def data_name(entry_no: int) -> str:
    """The name of an entry's data file in the data directory."""
    return f"{entry_no:012d}"


def find_orphans(data_fd: int, live_entry_nos) -> tuple:
    """The data files no live entry names (left by a crash between a write and its
    record, an eviction whose record was lost, or objects evicted at load) and the
    highest entry number any file is named by: (names, highest number)."""
    live = set(live_entry_nos)
    orphans, highest_no = [], 0
    with os.scandir(data_fd) as it:
        for item in it:
            number: Optional[int] = int(item.name) if item.name.isdigit() else None
            if number is not None:
                highest_no = max(highest_no, number)
            if number not in live:
                orphans.append(item.name)
    return orphans, highest_no
