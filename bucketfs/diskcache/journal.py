"""The disk cache's journal: what is on disk and its checksums, kept across mounts and
shared by every mount of one cache directory on a host.

One append-only file per cache directory. Records say "object version I (a 16-byte
id of its key and version) is (key, version, size)", "these chunks of I are on disk
with these CRC-32s" and "these objects are deleted". Loading it at mount gives back
the cache earlier mounts left; reading what was appended since (`read_tail`) gives a
running mount what the other mounts on the host stored and evicted.

Invariants:
- A chunk record is appended only after its bytes were written (pwrite), and every
  chunk is checked against its CRC on every read: a crash or power loss that kept the
  record but not the bytes costs a GET, never a wrong byte. No fsync is needed.
- Data files are named by the object version's id, so mounts need no shared counter:
  two mounts storing one object write the same bytes at the same places, and a record
  can only ever describe its own object's bytes (which the CRCs check).
- Several processes append: each batch of records is one write() with O_APPEND, taken
  under a shared flock of `journal.lock`, so batches never interleave. Each record
  starts with a sync word and carries its writer's id and a CRC-32 (of the id and the
  payload): a reader skips its own records, and after a torn or damaged record
  (a writer killed mid-write, a full disk, a power loss) it resynchronises at the next
  sync word that starts a whole good record, so one writer's tear never hides the
  others' later records. A record cut at the end of the file is either still being
  written or torn: it is waited for until a whole record follows it.
- A torn tail is cut at load only by a mount alone on the directory (holding the
  lock exclusively); with other mounts live nothing is ever truncated.
- No record names a file that is gone (files.py keeps it): every delete of a data
  file is journaled after the unlink, and every write checks, after its records,
  that the name still holds the file it wrote (else it journals a delete). A
  reader's own deletes come back from read_tail ("OD"), so that records it reads
  late but which came before its delete are undone, as for every other mount.
- Bounded: once it holds COMPACT_RATIO times what its live entries need (evictions
  leave dead records), one mount rewrites it (`compact`) holding `journal.lock`
  exclusively: it first reads every record appended so far, writes its index as a
  new journal whose header names its generation and where its snapshot ends, and
  renames it in place. The others finish reading the old file (still open) and go on
  in the new one after the snapshot, which holds nothing they do not know. A failed
  rewrite leaves the journal as it was. Each Entry keeps its definition payload for this.
- Every access goes through the cache directory's descriptor (dir_fd=): a journal
  deleted with its directory under a running mount takes no appends, and is never
  confused with a new journal at the same path.
- A chunk size other than the journal's: a mount alone on the directory discards the
  cache; one beside other mounts (which use it) runs without it (`incompatible`).
"""

from __future__ import annotations

import array
import collections
import errno
import fcntl
import hashlib
import itertools
import os
import secrets
import struct
import threading
import time
import zlib
from typing import Optional

MAGIC = b"bucketfs-cache-journal-2\n"
_HEADER = struct.Struct("<IQQ")  # chunk bytes, generation (rewrites so far), where the snapshot ends
HEADER_BYTES = len(MAGIC) + _HEADER.size
# Every record: sync word, payload length, CRC-32 of writer and payload, writer.
# 0xF5 never occurs in UTF-8, so keys rarely hold the sync word; a false one must
# also start a record whose CRC-32 matches to be taken.
SYNC = b"\xf5\x8b\xc3\x1e"
_RECORD = struct.Struct("<4sIIQ")
_WRITER = struct.Struct("<Q")
_ENTRY = struct.Struct("<cQH")  # b"E", object bytes, key length; then key, version
_CHUNKS = struct.Struct("<c16s")  # b"C", id; then (chunk index, CRC-32) pairs
_PAIR = struct.Struct("<II")
ID_BYTES = 16  # b"D", then ids
# The writer of a rewritten journal's snapshot: no process (every reader takes it).
SNAPSHOT_WRITER = 0
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
# Memory an Entry and its place in the index take, past its definition payload and 4
# bytes a chunk: 406 bytes traced for a 2-chunk object (a 200,000-entry index), plus
# allocator slack, plus the policy's clock stamp (a slot and an int: policy.py).
INDEX_ENTRY_BYTES = 480
# A data file no record names is removed at start only if it is older than this
# while other mounts are live: younger, it may be a write whose record is on its way.
ORPHAN_AGE_S = 600


def entry_id(key: str, version: str) -> bytes:
    """The name of an object version: 16 bytes, not two strings and a tuple (a million
    cached objects is ImageNet), and its data file's name in hex."""
    return _id_of(key.encode("utf-8", "surrogateescape") + b"\0" + version.encode("utf-8", "surrogateescape"))


def _id_of(key_nul_version: bytes) -> bytes:
    return hashlib.blake2b(key_nul_version, digest_size=ID_BYTES).digest()


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
        "eid",
        "object_bytes",
        "definition",
        "present",
        "crcs",
        "stored_bytes",
        "gone",
        "recorded",
        "read_at",
    )

    def __init__(self, eid: bytes, object_bytes: int, chunk_bytes: int, definition: bytes):
        self.eid, self.object_bytes = eid, object_bytes
        self.definition = definition  # its E payload, to rewrite the journal without key strings in memory
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

    def add_pairs(self, pairs: bytes, chunk_bytes: int) -> None:
        """Mark the chunks of a C record's (chunk index, CRC-32) `pairs` stored."""
        chunks_count = len(self.crcs)
        for i, crc in _PAIR.iter_unpack(pairs):
            if i < chunks_count:
                self.add(i, crc, chunk_bytes)

    def present_chunks(self) -> list:
        """The indexes of the chunks on disk, in order."""
        present = self.present
        if isinstance(present, int):
            return [i for i in range(len(self.crcs)) if present >> i & 1]
        return list(itertools.compress(range(len(present)), present))

    def records(self) -> bytes:
        """What the journal needs to know of it, as a rewrite's snapshot: its
        definition and its chunks."""
        crcs = self.crcs
        pairs = [(i, crcs[i]) for i in self.present_chunks()]
        return frame(self.definition, SNAPSHOT_WRITER) + b"".join(
            frame(chunks_payload(self.eid, pairs[at : at + CHUNKS_PER_RECORD_MAX]), SNAPSHOT_WRITER)
            for at in range(0, len(pairs), CHUNKS_PER_RECORD_MAX)
        )

    def record_bytes(self) -> int:
        """len(records()), counting every chunk (an estimate of what a rewrite keeps)."""
        return len(self.definition) + 2 * _RECORD.size + _CHUNKS.size + _PAIR.size * len(self.crcs)

    def index_bytes(self) -> int:
        """The memory it takes, as charged to the budget."""
        bitmap_bytes = 0 if isinstance(self.present, int) else len(self.present)
        return INDEX_ENTRY_BYTES + len(self.definition) + 4 * len(self.crcs) + bitmap_bytes


def frame(payload: bytes, writer: int) -> bytes:
    """A record: `payload` framed for the journal as written by `writer`."""
    return _RECORD.pack(SYNC, len(payload), _crc(writer, payload), writer) + payload


def _crc(writer: int, payload) -> int:
    return zlib.crc32(payload, zlib.crc32(_WRITER.pack(writer)))


def entry_payload(key: str, version: str, object_bytes: int) -> bytes:
    """The definition: size, key and version (one UTF-8 encoding, the one entry_id hashes)."""
    key_b, version_b = key.encode("utf-8", "surrogateescape"), version.encode("utf-8", "surrogateescape")
    return _ENTRY.pack(b"E", object_bytes, len(key_b)) + key_b + version_b


def chunks_payload(eid: bytes, pairs) -> bytes:
    """The (chunk index, CRC-32) `pairs` of an object version."""
    return _CHUNKS.pack(b"C", eid) + b"".join(_PAIR.pack(i, crc) for i, crc in pairs)


def delete_payload(eids) -> bytes:
    return b"D" + b"".join(eids)


# What a record says (parse's results): ("E", id, object bytes, payload),
# ("C", id, pairs bytes), ("D", [ids]); a reader's own deletes ("OD", [ids]).
def _decode(payload: bytes) -> Optional[tuple]:
    kind = payload[:1]
    if kind == b"E" and len(payload) >= _ENTRY.size:
        _, object_bytes, key_len = _ENTRY.unpack_from(payload)
        return (
            "E",
            _id_of(payload[_ENTRY.size : _ENTRY.size + key_len] + b"\0" + payload[_ENTRY.size + key_len :]),
            object_bytes,
            payload,
        )
    if kind == b"C" and len(payload) >= _CHUNKS.size:
        return ("C", payload[1 : _CHUNKS.size], payload[_CHUNKS.size :])
    if kind == b"D":
        return ("D", _ids_of(payload))
    return None  # (a kind a later version writes: its records are skipped whole)


def _ids_of(delete: bytes) -> list:
    """The ids of a D payload."""
    return [delete[at : at + ID_BYTES] for at in range(1, len(delete) - ID_BYTES + 1, ID_BYTES)]


def _whole_record_at(data: bytes, at: int) -> Optional[int]:
    """The end of the whole, good record at `at`, or None."""
    if at + _RECORD.size > len(data):
        return None
    sync, length, crc, writer = _RECORD.unpack_from(data, at)
    end = at + _RECORD.size + length
    if sync != SYNC or not 0 < length <= RECORD_MAX_BYTES or end > len(data):
        return None
    return end if _crc(writer, memoryview(data)[at + _RECORD.size : end]) == crc else None


def _next_whole_record(data: bytes, at: int) -> Optional[int]:
    """Where the first whole good record after `at` starts, or None."""
    while True:
        at = data.find(SYNC, at + 1)
        if at < 0:
            return None
        if _whole_record_at(data, at) is not None:
            return at


def parse(data: bytes, skip_writer: int = -1) -> tuple:
    """The records at the start of `data`: (what they say, as _decode's tuples, except
    the records of `skip_writer`, whose deletes are ("OD", ids); how many bytes were
    used; how many of those were skipped as torn or damaged). A record cut by the end of `data` is not used (more
    may come), unless a whole record after it shows it torn."""
    ops: list = []
    at = skipped = 0
    n = len(data)
    while at + _RECORD.size <= n:
        sync, length, crc, writer = _RECORD.unpack_from(data, at)
        start = at + _RECORD.size
        end = start + length
        if sync == SYNC and 0 < length <= RECORD_MAX_BYTES:
            if end > n:  # still being written, or torn
                resume = _next_whole_record(data, at)
                if resume is None:
                    break
                skipped += resume - at
                at = resume
                continue
            payload = data[start:end]
            if _crc(writer, payload) == crc:
                at = end
                if writer != skip_writer:
                    op = _decode(payload)
                    if op is not None:
                        ops.append(op)
                elif payload[:1] == b"D":  # (the writer's own deletes: where they fall in the order matters)
                    ops.append(("OD", _ids_of(payload)))
                continue
        # torn or damaged: go on at the next sync word (or keep the bytes one may start in)
        resume = data.find(SYNC, at + 1)
        if resume < 0:
            resume = max(at + 1, n - len(SYNC) + 1)
        skipped += resume - at
        at = resume
    return ops, at, skipped


def apply_loaded(ops: list, entries: collections.OrderedDict, chunk_bytes: int) -> None:
    """Apply parsed records to `entries` (id -> Entry, least recently written first)."""
    for op in ops:
        kind = op[0]
        if kind == "C":
            entry = entries.get(op[1])
            if entry is not None:  # (chunks of a deleted entry, from a write that raced its eviction)
                entry.add_pairs(op[2], chunk_bytes)
                entries.move_to_end(op[1])
        elif kind == "E":
            if op[1] in entries:
                entries.move_to_end(op[1])  # (defined again: two first writes at once, or another mount's)
            else:
                entries[op[1]] = Entry(op[1], op[2], chunk_bytes, op[3])
        else:
            for eid in op[1]:
                entries.pop(eid, None)


JOURNAL_NAME = "journal"
_NEW_NAME = "journal.new"
LOCK_NAME = "journal.lock"


class Journal:
    """The journal of the cache directory open as `dir_fd` (every access relative to
    it: a directory deleted under the mount fails appends, never finds another's),
    loaded and open for appends. `entries` (id -> Entry, least recently written first)
    is what earlier mounts left, for the cache to take over; `read_tail` then gives
    what other mounts append. `alone`: no other mount uses the directory (a torn tail
    may be cut, a journal of another chunk size discarded). `fresh`: there was no
    usable journal, so it needs `compact` before any append. `broken`: it takes no
    appends. `incompatible`: other mounts use it with another chunk size."""

    def __init__(self, dir_fd: int, chunk_bytes: int, alone: bool = True):
        self.dir_fd = dir_fd
        self.chunk_bytes = chunk_bytes
        self.writer = secrets.randbits(63) | 1  # this process's records (never SNAPSHOT_WRITER)
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.broken = self.incompatible = self.fresh = False
        self.size_bytes = 0  # the file's, as last seen
        self.skipped_bytes = 0  # of torn or damaged records
        self._lock = threading.Lock()  # this process's appends and rewrites, one at a time
        self._read_lock = threading.Lock()  # the reading position, against a rewrite's switch
        # (file inode, start, end, ids deleted) of this writer's appends, oldest first:
        # read_tail steps over them (a deque: appended from writing threads).
        self._own_spans: collections.deque = collections.deque()
        self._read_fd: Optional[int] = None
        self._read_ino = 0
        self.position = 0  # of the next record to read
        self.generation = 0
        self._snapshot_end = 0
        self._lock_fd: Optional[int] = None
        try:
            self._lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
                raise
            self.broken = True  # (a full disk: what it holds is served, nothing is stored)
        try:
            with self._flock(fcntl.LOCK_EX if alone else fcntl.LOCK_SH):
                if alone:
                    _unlink_quietly(_NEW_NAME, dir_fd)  # (a rewrite a crash interrupted)
                state = self._open_current()
                if state == "ok":
                    self._load()
                    if alone and self.position < self.size_bytes:  # cut a torn tail (a truncate needs no space)
                        self._truncate_tail()
                elif state == "incompatible" and not alone:
                    self.incompatible = self.broken = True
                else:
                    self.fresh = True  # (missing, or discarded by the first rewrite)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd in (self._read_fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._read_fd = self._lock_fd = None

    def _flock(self, mode: int):
        return _Flock(self._lock_fd, mode)  # (no lock file: a broken journal, never written)

    def _header(self, generation: int, snapshot_end: int) -> bytes:
        return MAGIC + _HEADER.pack(self.chunk_bytes, generation, snapshot_end)

    def _open_current(self) -> str:
        """Open the journal now at its name for reading: "ok" (reading from after its
        header), "missing" or "incompatible" (another format or chunk size; then the
        descriptor read so far is kept)."""
        try:
            fd = os.open(JOURNAL_NAME, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return "missing"
        header = os.pread(fd, HEADER_BYTES, 0)
        if len(header) < HEADER_BYTES or not header.startswith(MAGIC):
            os.close(fd)
            return "incompatible"
        chunk_bytes, generation, snapshot_end = _HEADER.unpack_from(header, len(MAGIC))
        if chunk_bytes != self.chunk_bytes:
            os.close(fd)
            return "incompatible"
        if self._read_fd is not None:
            os.close(self._read_fd)
        self._read_fd, self._read_ino = fd, os.fstat(fd).st_ino
        self.generation, self._snapshot_end, self.position = generation, snapshot_end, HEADER_BYTES
        return "ok"

    def _load(self) -> None:
        """Read the whole journal into `entries`, in blocks (a journal of a million
        objects is hundreds of MB: never all of it in memory at once)."""
        at, pending, fd = self.position, b"", self._read_fd
        assert fd is not None
        while True:
            block = os.pread(fd, LOAD_BLOCK_BYTES, at)
            at += len(block)
            data = pending + block
            ops, used, skipped = parse(data)
            apply_loaded(ops, self.entries, self.chunk_bytes)
            self.position += used
            self.skipped_bytes += skipped
            pending = data[used:]
            if not block:
                break
        self.size_bytes = at

    def _truncate_tail(self) -> None:
        fd = os.open(JOURNAL_NAME, os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        try:
            os.ftruncate(fd, self.position)
        finally:
            os.close(fd)
        self.size_bytes = self.position

    def read_tail(self) -> list:
        """What other mounts appended since the last call (or the load), in order, as
        parse's tuples. After another mount's rewrite: the old file to its end, then
        the new one from the end of its snapshot. If a rewrite was missed (two or more
        since the last look), the new one whole, and last ("R", ids): the object
        versions it holds, every writer's records counted; what it does not hold was
        deleted in between (the caller drops what it still knows of them)."""
        if self.incompatible:
            return []
        with self._read_lock:
            if self._read_fd is not None:
                st = os.fstat(self._read_fd)
                if st.st_nlink:  # (a rewrite renames another file over it: its last link goes)
                    return self._read_new(st.st_size)
            try:
                ino = os.stat(JOURNAL_NAME, dir_fd=self.dir_fd).st_ino
            except FileNotFoundError:
                return []
            if self._read_fd is not None and ino == self._read_ino:
                return self._read_new()
            followed, generation = self._read_fd is not None, self.generation
            ops = self._read_new() if followed else []
            if self._open_current() != "ok":
                return ops  # (gone again, or a journal no mount of this chunk size can use)
            if followed and self.generation == generation + 1:
                self.position = self._snapshot_end
                return ops + self._read_new()
            return ops + self._read_new(whole=True)

    def _read_new(self, size: Optional[int] = None, whole: bool = False) -> list:
        """The records from `position` to the end (`size`, or as fstat says), but this
        writer's; `whole` (read from the header): and the ("R", ids) of what the journal
        holds. This writer's own appends at `position` are stepped over unread (a mount
        alone reads nothing back), their deletes said all the same."""
        fd = self._read_fd
        assert fd is not None
        if size is None:
            size = os.fstat(fd).st_size
        self.size_bytes = size
        ops: list = []
        spans = self._own_spans
        while spans and not whole:
            ino, start, end, deleted = spans[0]
            if ino != self._read_ino or end <= self.position:  # (another file's, or read already)
                spans.popleft()
            elif start != self.position:
                break  # (another mount's records come first)
            else:
                spans.popleft()
                self.position = end
                if deleted:
                    ops.append(("OD", deleted))
        if size <= self.position:
            return ops + [("R", set())] if whole else ops
        data = os.pread(fd, size - self.position, self.position)
        parsed, used, skipped = parse(data, self.writer)
        ops += parsed
        self.position += used
        self.skipped_bytes += skipped
        if whole:
            held: set = set()
            for op in parse(data)[0]:  # (this writer's records too: they count)
                if op[0] == "E":
                    held.add(op[1])
                elif op[0] == "D":
                    held.difference_update(op[1])
            ops.append(("R", held))
        return ops

    def needs_compacting(self, live_record_bytes: int, min_bytes: int) -> bool:
        return self.size_bytes > COMPACT_RATIO * live_record_bytes + min_bytes

    def compact(self, snapshot) -> bool:
        """Rewrite the journal as the records of the entries `snapshot()` returns
        (called with every appender held off: the caller reads the tail in it, so what
        it returns knows every record so far), or leave it if that returns None (another
        mount rewrote it meanwhile); whether it was rewritten. On failure the journal
        is as it was (and no journal.new is left)."""
        if self._lock_fd is None:
            raise OSError(errno.ENOSPC, "no room for the disk cache journal's lock file")
        with self._lock, self._flock(fcntl.LOCK_EX):
            entries = snapshot()
            if entries is None:
                return False
            generation = self.generation + 1
            try:
                fd = os.open(_NEW_NAME, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600, dir_fd=self.dir_fd)
                try:
                    with open(os.dup(fd), "wb") as f:
                        f.write(self._header(generation, 0))
                        for entry in entries:
                            f.write(entry.records())
                        size_bytes = f.tell()
                    os.pwrite(fd, self._header(generation, size_bytes), 0)
                    os.fsync(fd)  # the rename must not publish an empty file after a crash
                    os.replace(_NEW_NAME, JOURNAL_NAME, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
                except BaseException:
                    os.close(fd)
                    raise
            except BaseException:
                _unlink_quietly(_NEW_NAME, self.dir_fd)
                raise
            with self._read_lock:
                if self._read_fd is not None:
                    os.close(self._read_fd)
                self._read_fd, self._read_ino = fd, os.fstat(fd).st_ino
                self.generation = generation
                self._snapshot_end = self.position = self.size_bytes = size_bytes
            self.fresh = self.broken = self.incompatible = False
            return True

    def append(self, payloads) -> None:
        """Append records of `payloads` (from any thread) in one write; OSError if the
        journal takes no more."""
        data = b"".join(frame(payload, self.writer) for payload in payloads)
        with self._lock:
            if self.broken or self.fresh:
                raise OSError(errno.EIO, "the disk cache journal takes no more appends")
            try:
                with self._flock(fcntl.LOCK_SH):  # (a rewrite waits for it, and it for a rewrite)
                    # Opened per append (microseconds, beside the data write it follows):
                    # no descriptor of a replaced journal is ever written.
                    fd = os.open(JOURNAL_NAME, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC, dir_fd=self.dir_fd)
                    try:
                        written = os.write(fd, data)
                        # (O_APPEND: the offset is now the end of this write, whoever wrote after it)
                        end, ino = os.lseek(fd, 0, os.SEEK_CUR), os.fstat(fd).st_ino
                        if written == len(data):
                            deleted = [eid for p in payloads if p[:1] == b"D" for eid in _ids_of(p)]
                            self._own_spans.append((ino, end - written, end, deleted))
                    finally:
                        os.close(fd)
            except OSError:
                self.broken = True
                raise
            with self._read_lock:
                # read_tail (another thread) may have seen this write's bytes already and
                # set the size from fstat: the file's end then, not a sum.
                self.size_bytes = max(self.size_bytes, end) if ino == self._read_ino else self.size_bytes + written
            if written != len(data):
                self.broken = True
                raise OSError(f"short write to the disk cache journal ({written} of {len(data)} bytes)")


class _Flock:
    """flock(2) of `fd` held in a with block."""

    def __init__(self, fd: Optional[int], mode: int):
        self.fd, self.mode = fd, mode

    def __enter__(self):
        if self.fd is not None:
            fcntl.flock(self.fd, self.mode)

    def __exit__(self, *exc_info):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


DATA_DIR_NAME = "data"


def data_name(eid: bytes) -> str:
    """The name of an object version's data file in the data directory."""
    return eid.hex()


def eid_of(name: str) -> Optional[bytes]:
    """The id a data file `name` is named by (data_name's inverse), or None (a file
    of an earlier format, or no cache file)."""
    if len(name) != 2 * ID_BYTES:
        return None
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None


def find_orphans(data_fd: int, index, min_age_s: float = 0) -> list:
    """The names of the data files no entry of `index` (ids) names, left by a crash
    between a write and its record, an eviction whose record was lost, objects evicted
    at load, or an earlier format; only those older than `min_age_s`."""
    oldest_s = time.time() - min_age_s
    orphans = []
    with os.scandir(data_fd) as it:
        for item in it:
            eid = eid_of(item.name)
            if eid in index:
                continue
            if min_age_s:
                try:
                    if item.stat(follow_symlinks=False).st_mtime > oldest_s:
                        continue
                except OSError:
                    continue
            orphans.append(item.name)
    return orphans
