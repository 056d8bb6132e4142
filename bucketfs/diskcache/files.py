"""The disk cache's data files: chunk writes, checked reads and deletes (blocking:
worker threads call them, except no-wait reads on the event loop), and the read
ahead of kept files at start.

Every file is named relative to the data directory's descriptor (dir_fd=), never by
a path: a cache directory deleted under its mount makes these fail (ENOENT) rather
than reach a directory another mount made at the same path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from typing import Optional

import trio

from bucketfs.diskcache import pagecache
from bucketfs.diskcache.journal import chunks_payload, data_name, delete_payload, eid_of

log = logging.getLogger(__name__)


def write_chunks(
    data_fd: int, name: str, offset: int, view, chunk_bytes: int, journal, eid: bytes, definition: bytes
) -> Optional[dict]:
    """Write `view` at `offset` (a chunk boundary) of the data file `name`, then journal
    the CRC-32 of each chunk in it (after `definition`, the entry's payload, if not
    journaled yet); the CRCs. None if another mount's delete of the same id removed the
    file meanwhile: then the records are followed by a delete record."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600, dir_fd=data_fd)
    try:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
        first = offset // chunk_bytes
        crcs = {
            first + n: zlib.crc32(view[at : at + chunk_bytes]) for n, at in enumerate(range(0, len(view), chunk_bytes))
        }
        chunks = chunks_payload(eid, crcs.items())
        journal.append([definition, chunks] if definition else [chunks])
        # A mount deleting this id journals its delete after the unlink. If the name still
        # holds this file now, after these records, any later unlink is journaled after
        # them too; if not, these records name bytes no file holds: journal the delete.
        if not _still_named(fd, name, data_fd):
            journal.append([delete_payload([eid])])
            return None
    finally:
        os.close(fd)
    return crcs


def _still_named(fd: int, name: str, dir_fd: int) -> bool:
    try:
        named = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (own.st_dev, own.st_ino)


def remove_files(data_fd: int, names) -> tuple:
    """Delete the files `names` in the directory `data_fd`: (how many went, the first
    error other than a missing file, or None)."""
    removed_count, first_error = 0, None
    for name in names:
        try:
            os.unlink(name, dir_fd=data_fd)
            removed_count += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            first_error = first_error or exc
    return removed_count, first_error


def remove_orphans(data_fd: int, journal, names: list) -> tuple:
    """remove_files of data files no entry names, their ids journaled as deleted after
    (another mount may have stored one of them again meanwhile, and journals it after
    its write: the delete record must come after that)."""
    removed = remove_files(data_fd, names)
    eids = [eid for eid in map(eid_of, names) if eid is not None]
    if eids and not journal.broken:
        try:
            for at in range(0, len(eids), DELETES_PER_RECORD_MAX):
                journal.append([delete_payload(eids[at : at + DELETES_PER_RECORD_MAX])])
        except OSError:
            pass  # (a journal that takes no more: nothing is stored either)
    return removed


# Ids in one delete record (16 bytes each: well within journal.RECORD_MAX_BYTES).
DELETES_PER_RECORD_MAX = 4096


def delete_files(data_fd: int, journal, eids: list) -> tuple:
    """Delete the entries' files and journal it in one append, after them (a lost
    record only costs a bad read of the missing file at a later mount): (the first
    error other than a missing file, or None; whether the record was appended)."""
    _, first_error = remove_files(data_fd, map(data_name, eids))
    if not journal.broken:
        try:
            journal.append([delete_payload(eids)])
            return first_error, True
        except OSError as exc:
            first_error = first_error or exc
    return first_error, False


WOULD_BLOCK = object()  # (a no-wait read that needs the disk)


def read_chunks(
    data_fd: int,
    name: str,
    lo: int,
    hi: int,
    crcs: list,
    chunk_bytes: int,
    start: int,
    end: int,
    into=None,
    on_loop: bool = False,
):
    """Bytes [start, end) of the object, read as the chunks [lo, hi) around them from
    its data file `name` and checked against `crcs`: as a bytes-like object, or into
    `into` (then their length). None if the file is gone, short or does not match.
    `on_loop` (on the event loop, no waiting): WOULD_BLOCK if the file's name or
    bytes are not all in the kernel's caches."""
    try:
        fd = (
            pagecache.open_cached(data_fd, name)
            if on_loop
            else os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=data_fd)
        )
    except FileNotFoundError:
        return None
    if fd is None:
        return WOULD_BLOCK
    direct = into is not None and (lo, hi) == (start, end)
    try:
        buf = into if direct else bytearray(hi - lo)
        view = memoryview(buf)[: hi - lo]
        if on_loop:
            if not pagecache.pread_cached(fd, view, lo):
                return WOULD_BLOCK
        else:
            got = 0
            while got < hi - lo:
                n = os.preadv(fd, [view[got:]], lo + got)
                if n == 0:
                    return None
                got += n
    finally:
        os.close(fd)
    for n, at in enumerate(range(0, hi - lo, chunk_bytes)):
        if zlib.crc32(view[at : at + chunk_bytes]) != crcs[n]:
            return None
    if direct:
        return end - start
    if into is not None:
        into[: end - start] = view[start - lo : end - lo]
        return end - start
    if (lo, hi) == (start, end):
        return buf  # (a whole small file, the usual hit: no second copy of it)
    return bytes(view[start - lo : end - lo])


async def read_ahead(data_fd: int, names: list, total_bytes: int) -> None:
    """Ask the kernel to read the files `names` into the page cache, from a thread; an
    unmount (a cancel) does not wait for it."""
    stop = threading.Event()
    started_s = time.monotonic()
    own_fd = os.dup(data_fd)  # the thread's own: it may outlive the cache

    def read_ahead_files():
        try:
            pagecache.read_ahead(own_fd, names, stop)
        finally:
            os.close(own_fd)

    try:
        await trio.to_thread.run_sync(read_ahead_files, abandon_on_cancel=True)
        log.info(
            "disk cache: asked the kernel to read %d files (%.1f MiB) ahead in %.2f s",
            len(names),
            total_bytes / 2**20,
            time.monotonic() - started_s,
        )
    finally:
        stop.set()  # (an unmount does not wait for the rest)
