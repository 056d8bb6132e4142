"""The FUSE adapter: with dircache.py (which sets the OPENDIR reply flags pyfuse3
cannot), the only code that speaks pyfuse3.

It turns FUSE requests into core calls and core results into pyfuse3 types, and
maps every exception to an errno in ONE table (`errno_for`). A handler never lets
an exception escape: unexpected ones are logged and become EIO.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import stat as stat_mod
import time
from typing import Optional

import cachetools
import pyfuse3
import trio

from bucketfs import errors
from bucketfs.core.filesystem import DOT_NAMES
from bucketfs.fuse import requestloop
from bucketfs.fuse.dircache import DirCacheFlags, private_layouts_allowed
from bucketfs.fuse.noopen import INODE_FH, KernelOpensFiles
from bucketfs.fuse.noopendir import KernelOpensDirs
from bucketfs.fuse.replies import REPLY_THREAD_MIN_BYTES, ReplyThread
from bucketfs.fuse.requestsize import ask_for_large_reads, pyfuse3_session
from bucketfs.fuse.session import session_fd
from bucketfs.metrics import STATS_FILE_NAME, encode_stats

log = logging.getLogger(__name__)

# Python's open() buffers in st_blksize chunks: 1 MiB turns a loader's small reads
# into few large ones.
BLKSIZE_BYTES = 1024 * 1024
# Cached attribute replies (~200 B each): enough for a 200k-file working set.
ATTRS_CACHE_MAX_COUNT = 200_000
# Vanished names waiting to be invalidated in the kernel (~100 B each). Past this,
# one is skipped: the kernel still lets go of it at revalidation or memory pressure.
INVALIDATIONS_QUEUED_MAX_COUNT = 100_000
# The stats file (metrics.STATS_FILE_NAME): inodes and handles above any the core hands
# out (it numbers both densely from 1). Each lookup of its name is a new inode that
# holds the counters as they were then (see lookup).
STATS_INODE_FIRST = 1 << 62
STATS_FH_FIRST = 1 << 62
# Readings of the stats file kept (~1-10 KB each): the kernel may keep an inode it no
# longer uses, and send its FORGET only when it lets go of it under memory pressure.
STATS_SNAPSHOTS_MAX = 256


def errno_for(exc: BaseException) -> int:
    if isinstance(exc, errors.BucketfsError):
        return exc.errno_value
    if isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    return errno.EIO


def fuse_errors(fn):
    """Run a handler; turn every failure into FUSEError(errno), count it, never crash."""

    op_key = f"fuse.{fn.__name__}"  # requests by operation: what a workload costs the daemon

    @functools.wraps(fn)
    async def wrapper(self, *args):
        self.fs.count(op_key)
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError as exc:
            if exc.errno != errno.ENOSYS:  # "not implemented, stop asking": no error
                self.fs.count(f"errors.{errno.errorcode.get(exc.errno, exc.errno)}")
            raise
        except errors.BucketfsError as exc:
            code = errno_for(exc)
            self.fs.count(f"errors.{errno.errorcode.get(code, code)}")
            if code not in (errno.ENOENT, errno.EROFS):
                log.warning("%s%r failed: %s: %s", fn.__name__, args[:2], type(exc).__name__, exc)
            raise pyfuse3.FUSEError(code) from None
        except Exception:  # noqa: BLE001 - the daemon must never die on one request
            self.fs.count("errors.EIO")
            log.exception("unexpected error in %s%r", fn.__name__, args[:2])
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


def _invalidate_entries(entries) -> None:
    """(parent inode, name) entries: the kernel forgets the name; (inode, None): the
    kernel forgets the directory's cached entries (its pages)."""
    for parent_ino, name in entries:
        try:
            if name is None:
                pyfuse3.invalidate_inode(parent_ino, attr_only=False)
            else:
                pyfuse3.invalidate_entry(parent_ino, name)
        except FileNotFoundError:
            pass  # the kernel had already let go of it
        except OSError as exc:  # e.g. the mount is going away: nothing left to invalidate
            log.debug("invalidating %r in inode %d: %s", name, parent_ino, exc)


def _read_only(name):
    async def handler(self, *args, **kwargs):
        self.fs.count("errors.EROFS")
        raise pyfuse3.FUSEError(errno.EROFS)

    handler.__name__ = name
    return handler


class FuseOperations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, fs, config):
        super().__init__()
        self.fs = fs
        self.config = config
        self.uid = os.getuid() if config.uid is None else config.uid
        self.gid = os.getgid() if config.gid is None else config.gid
        # Immutable data: the kernel may keep entries, attributes and pages for good.
        timeout_s = 365 * 24 * 3600.0 if config.immutable else float(config.metadata_ttl_s)
        self.entry_timeout_s = timeout_s
        self.negative_timeout_s = timeout_s if config.immutable else min(timeout_s, float(config.negative_ttl_s))
        # Immutable mode: a node's attributes never change, so build each reply once
        # (a cached walk of 20,000 entries spent most of its time building them).
        self._attrs_cache = {} if config.immutable else None
        # With a TTL, the namespace drops vanished nodes once the kernel lets go of
        # them: it needs every entry reply counted (lookup, READDIRPLUS) and every FORGET.
        self._count_lookups = fs.tracks_lookups
        self._vanished_tx, self._vanished_rx = trio.open_memory_channel(INVALIDATIONS_QUEUED_MAX_COUNT)
        self._stats_name = os.fsencode(STATS_FILE_NAME)
        self._stats_fhs = itertools.count(STATS_FH_FIRST)
        self._stats_reads: dict = {}  # fh -> the counters its inode holds
        self._stats_inodes = itertools.count(STATS_INODE_FIRST)
        # inode -> (the counters encoded, when they were taken in ns)
        self._stats_snapshots: cachetools.LRUCache = cachetools.LRUCache(STATS_SNAPSHOTS_MAX)
        # Listings never change in immutable mode: the kernel may keep them, if this mount
        # may write into pyfuse3's and libfuse's private memory (--kernel-dir-cache, and
        # a tested pyfuse3). With neither object, nothing is ever written there.
        private = config.immutable and private_layouts_allowed(config.kernel_dir_cache, fs.stats)
        self._dir_cache = DirCacheFlags(fs.stats) if private else None
        # ... and may open directories itself: no OPENDIR or RELEASEDIR round trips.
        self._kernel_opens_dirs = KernelOpensDirs(fs.stats) if private else None
        # ... and files: no OPEN or RELEASE round trips, READs by inode (noopen.py).
        # ... and, once it does, READs are answered from a thread of their own (replies.py).
        self._replies = ReplyThread(fs.stats) if private else None
        self._kernel_opens_files = (
            KernelOpensFiles(fs.stats, self._serve_read if self._replies.available else None) if private else None
        )
        self._nursery: Optional[trio.Nursery] = None
        self._reads_in_flight = 0  # READs served by this object's own tasks (_read_and_reply)
        self._reads_idle = trio.Event()
        self._reads_idle.set()

    def start(self, nursery: trio.Nursery) -> None:
        """Once mounted: tell the kernel about names that vanished or changed (with a
        TTL, or in the immutable default after a replaced object was found); READs the
        kernel sends without an OPEN are served by tasks of `nursery`."""
        self._nursery = nursery
        kernel_fd = session_fd()
        if kernel_fd is not None and self.fs.start_pushing(kernel_fd, self._list_to_kernel):
            log.info(
                "fetch-ahead: %d worker(s) fetch a shuffled pass's files into the page cache",
                self.config.fetch_ahead_workers_count,
            )
        if self._dir_cache is not None:
            self._dir_cache.install()
        if self._replies is not None:  # (pyfuse3's private layouts are used)
            session = pyfuse3_session(kernel_fd)
            if self._replies.available:
                ask_for_large_reads(session, self.fs.stats)
            loop = requestloop.install(session, kernel_fd, self, self.fs.stats)
            if loop is not None:
                loop.hold_ioctl = self.fs.open_pushes.hold  # (a Python open() asks isatty() first)
        self.fs.watch_vanished(self._note_vanished)
        nursery.start_soon(self._invalidate_vanished)

    def _list_to_kernel(self, directory) -> None:
        """(On a thread: the kernel's READDIRPLUS comes to this process's loop.) List
        `directory` (a Node) through the mount."""
        with os.scandir(os.path.join(self.config.mountpoint, directory.path)) as entries:
            for _ in entries:
                pass

    def _note_vanished(self, parent_ino: int, name: str) -> None:
        try:
            if self.config.immutable:
                # The kernel keeps this directory's entries (DirCacheFlags, KernelOpensDirs):
                # drop them too, so a readdir lists the new inode.
                self._vanished_tx.send_nowait((parent_ino, None))
            self._vanished_tx.send_nowait((parent_ino, os.fsencode(name)))
        except trio.WouldBlock:
            self.fs.count("namespace.invalidations_skipped")

    async def _invalidate_vanished(self) -> None:
        """Invalidate vanished names in the kernel, so it FORGETs their inodes and the
        namespace drops their nodes; otherwise their dentries (and our nodes) stay
        until memory pressure. In a thread: the call blocks while a request on the
        parent is in flight, and that request needs this event loop to finish.
        Batched: one thread hop per re-listing, not per name."""
        async for first in self._vanished_rx:
            batch = [first]
            while True:
                try:
                    batch.append(self._vanished_rx.receive_nowait())
                except trio.WouldBlock:
                    break
            batch = list(dict.fromkeys(batch))  # (a directory's pages once per batch)
            await trio.to_thread.run_sync(_invalidate_entries, batch)
            self.fs.count("namespace.invalidations", len(batch))

    def _attrs(self, node) -> pyfuse3.EntryAttributes:
        if self._attrs_cache is not None:
            attrs = self._attrs_cache.get(node.ino)
            if attrs is None:
                if len(self._attrs_cache) >= ATTRS_CACHE_MAX_COUNT:
                    self._attrs_cache.clear()  # bounded: rebuilding is cheap, memory is not
                attrs = self._attrs_cache[node.ino] = self._build_attrs(node)
            return attrs
        return self._build_attrs(node)

    def _build_attrs(self, node) -> pyfuse3.EntryAttributes:
        attrs = pyfuse3.EntryAttributes()
        attrs.st_ino = node.ino
        attrs.generation = 0
        attrs.entry_timeout = self.entry_timeout_s
        attrs.attr_timeout = self.entry_timeout_s
        if node.is_dir:
            attrs.st_mode = stat_mod.S_IFDIR | self.config.dir_mode
            attrs.st_nlink = 2
        else:
            attrs.st_mode = stat_mod.S_IFREG | self.config.file_mode
            attrs.st_nlink = 1
        attrs.st_size = node.size_bytes
        attrs.st_blocks = (node.size_bytes + 511) // 512
        attrs.st_blksize = BLKSIZE_BYTES
        attrs.st_atime_ns = attrs.st_mtime_ns = attrs.st_ctime_ns = node.mtime_ns
        attrs.st_uid, attrs.st_gid = self.uid, self.gid
        return attrs

    # -- metadata ------------------------------------------------------------
    @fuse_errors
    async def lookup(self, parent_inode, name, ctx=None):
        try:
            node = await self.fs.lookup(parent_inode, os.fsdecode(name))
        except errors.NotFound:
            if parent_inode == pyfuse3.ROOT_INODE and name == self._stats_name:
                # A new inode for each lookup (its entry is never cached), holding the
                # counters as they are now, of their exact size and never changed: each
                # reading reads one snapshot, through the page cache or not, however
                # other readings interleave with it. (One inode whose content changed
                # under the kernel's cached size gave concurrent readers the end of one
                # snapshot and zeros or another's bytes after it.)
                self._uncount("lookup")
                ino = next(self._stats_inodes)
                self._stats_snapshots[ino] = (encode_stats(self.fs.snapshot()), time.time_ns())
                return self._stats_attrs(ino)
            # st_ino 0 asks the kernel to cache the negative entry for entry_timeout.
            attrs = pyfuse3.EntryAttributes()
            attrs.st_ino = 0
            attrs.entry_timeout = self.negative_timeout_s
            return attrs
        if self._count_lookups:
            self.fs.note_lookup(node)
        return self._attrs(node)

    @fuse_errors
    async def getattr(self, inode, ctx=None):
        if inode >= STATS_INODE_FIRST:
            self._uncount("getattr")
            return self._stats_attrs(inode)
        return self._attrs(await self.fs.getattr(inode))

    def _uncount(self, op: str) -> None:
        # Reading the counters is not the mount's work: `stats` between two epochs
        # would otherwise show OPEN, READ and RELEASE in a warm epoch that had none.
        self.fs.uncount(f"fuse.{op}")  # (to zero: as if never asked, no "open 0")

    def _stats_snapshot(self, ino: int) -> tuple:
        """(counters, taken at ns) of the stats inode `ino`; ESTALE once let go of."""
        snapshot = self._stats_snapshots.get(ino)
        if snapshot is None:
            raise pyfuse3.FUSEError(errno.ESTALE)
        return snapshot

    def _stats_attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        # Timeouts 0: each path lookup is a new reading, and an object of that name may
        # appear in a listing.
        data, taken_ns = self._stats_snapshot(ino)
        attrs = pyfuse3.EntryAttributes()
        attrs.st_ino = ino
        attrs.st_size = len(data)
        attrs.st_mode = stat_mod.S_IFREG | 0o444
        attrs.st_nlink = 1
        attrs.st_blksize = BLKSIZE_BYTES
        attrs.st_atime_ns = attrs.st_mtime_ns = attrs.st_ctime_ns = taken_ns
        attrs.st_uid, attrs.st_gid = self.uid, self.gid
        attrs.entry_timeout = attrs.attr_timeout = 0
        return attrs

    @fuse_errors
    async def opendir(self, inode, ctx):
        opens = self._kernel_opens_dirs
        if opens is not None and opens.skips_opendir(lambda: self._dir_cache.request_pointer(inode)):
            # ENOSYS: the kernel stops sending OPENDIR and RELEASEDIR for this mount and
            # keeps every directory's listing; READDIRPLUS comes with handle 0.
            files = self._kernel_opens_files
            if files is not None and not files.installed and opens.table is not None:
                files.install(opens.table)  # (observing READs until it may skip OPEN too)
            raise pyfuse3.FUSEError(errno.ENOSYS)
        dh = await self.fs.opendir(inode)
        if self._dir_cache is not None:
            self._dir_cache.mark(inode)
        return dh

    @fuse_errors
    async def readdir(self, fh, start_id, token):
        counting = self._count_lookups
        if fh == 0:  # no OPENDIR (handles count from 1): the directory is the request's inode
            ino = self._kernel_opens_dirs.inode_of(token) if self._kernel_opens_dirs else None
            if ino is None:
                raise errors.BucketfsError("READDIR with no handle and no inode noted for it")
            entries = await self.fs.readdir_inode(ino, start_id)
        else:
            entries = await self.fs.readdir(fh, start_id)
        last_child = None
        for i, (name, node) in enumerate(entries, start=start_id + 1):
            # The kernel takes no reference for "." and ".." (libfuse: their lookup
            # count is not raised), and a directory's node is never replaced.
            child = name not in DOT_NAMES
            if counting and child:
                # Re-listed since this handle's snapshot? Send what the name is now (a
                # rewritten file's new node: the old one may be dropped, and its number
                # must not reach the kernel again), or skip a name that is gone.
                node = self.fs.current(node)
                if node is None:
                    continue
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attrs(node), i):
                return
            if child:
                last_child = node
            if counting and child:
                self.fs.note_lookup(node)  # a READDIRPLUS entry counts as a lookup
        if last_child is not None:
            self.fs.note_listed_to_kernel(last_child.parent)  # (its last entries went in this reply)

    @fuse_errors
    async def releasedir(self, fh):
        self.fs.releasedir(fh)

    @fuse_errors
    async def statfs(self, ctx):
        stat = pyfuse3.StatvfsData()
        stat.f_bsize = BLKSIZE_BYTES
        stat.f_frsize = 4096
        # Used: the files listed so far; free: none (read-only). df hides a file system of
        # 0 blocks as a pseudo one, and `df /mnt/data` is how users check a mount is up.
        stat.f_blocks = -(-self.fs.listed_file_bytes // stat.f_frsize)
        stat.f_bfree = stat.f_bavail = 0
        stat.f_files = self.fs.entries_count
        stat.f_ffree = stat.f_favail = 0
        stat.f_namemax = 255
        return stat

    @fuse_errors
    async def access(self, inode, mode, ctx):
        if mode & os.W_OK:
            raise pyfuse3.FUSEError(errno.EROFS)
        return True

    async def getxattr(self, inode, name, ctx):
        # ENOSYS: the kernel answers every later call itself ("not supported"), where
        # each `ls -l` entry cost two round trips (ACLs, security label). Counted to show it.
        self.fs.count("fuse.getxattr")
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def listxattr(self, inode, ctx):
        self.fs.count("fuse.listxattr")
        raise pyfuse3.FUSEError(errno.ENOSYS)

    # -- data ----------------------------------------------------------------
    @fuse_errors
    async def open(self, inode, flags, ctx):
        files = self._kernel_opens_files
        if files is not None and files.skips_open():
            if not files.handles_released:
                # (nor RELEASE for the files it opened before: their later READs go by inode)
                files.handles_released = True
                self.fs.release_all_open_handles()
            # ENOSYS: the kernel stops sending OPEN and RELEASE for this mount and keeps
            # every file's pages; READs come by inode (read_inode).
            self._uncount("open")
            raise pyfuse3.FUSEError(errno.ENOSYS)
        if inode >= STATS_INODE_FIRST:
            self._uncount("open")
            fh = next(self._stats_fhs)
            self._stats_reads[fh] = self._stats_snapshot(inode)[0]  # (its own: past the LRU's bound)
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=True)
        fh = await self.fs.open(inode, flags)
        # keep_cache: the page cache stays across opens, so a second epoch never
        # reaches the daemon. Safe with a TTL too: an inode is one version of an
        # object (a changed object gets a new inode), so its pages are that version's.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=False)

    @fuse_errors
    async def read(self, fh, off, size, pieces=False):
        """pyfuse3's READ (one buffer); `pieces` for the reply thread (Filesystem.read's)."""
        if fh & INODE_FH:  # (the kernel opened the file itself: noopen.py)
            ino = fh ^ INODE_FH
            if ino >= STATS_INODE_FIRST:
                self._uncount("read")
                return self._stats_snapshot(ino)[0][off : off + size]
            return await self.fs.read_inode(ino, off, size, pieces)
        if fh >= STATS_FH_FIRST:
            self._uncount("read")
            return self._stats_reads[fh][off : off + size]
        if self._kernel_opens_files is not None:
            self._kernel_opens_files.saw_handle(fh)
        return await self.fs.read(fh, off, size, pieces)

    def _serve_read(self, req: int, fh: int, off: int, size: int) -> bool:
        """Whether this READ is taken from pyfuse3's handler (noopen.py) and served by a
        task whose reply the reply thread writes: a large one (streaming shards). A
        small file's READ is left to pyfuse3: its reply costs less than the task and
        the hand-off to the thread would (W2 lost ~15% of its files/s so). (The stats
        file's may go either way: each of its readings is one immutable snapshot.)"""
        if size < REPLY_THREAD_MIN_BYTES or self._nursery is None:
            return False
        self._nursery.start_soon(self._read_and_reply, req, fh, off, size)
        return True

    async def _read_and_reply(self, req: int, fh: int, off: int, size: int) -> None:
        """read(), then its reply from the reply thread; exactly one reply, whatever happens."""
        assert self._replies is not None
        self._reads_in_flight += 1
        if self._reads_in_flight == 1:
            self._reads_idle = trio.Event()
        try:
            data = await self.read(fh, off, size, True)
        except pyfuse3.FUSEError as exc:
            self._replies.error(req, exc.errno)
            return
        except BaseException:  # (cancelled: the mount is ending; read() turns the rest into FUSEError)
            self._replies.error(req, errno.EINTR)
            raise
        finally:
            self._reads_in_flight -= 1
            if not self._reads_in_flight:
                self._reads_idle.set()
        self._replies.submit(req, data)

    async def reads_done(self) -> None:
        """Once no READ is being served by this object's own tasks. pyfuse3's loop ends
        without waiting for them (they are not its handlers): the mount waits here
        while the stop's deadline (mount.py) still runs, as pyfuse3 waits for its own."""
        await self._reads_idle.wait()

    def stop(self) -> None:
        """Once no task queues a reply any more, before the FUSE session is destroyed:
        the queued replies are written and the reply thread ends."""
        if self._replies is not None:
            self._replies.stop()

    async def flush(self, fh):
        # ENOSYS makes the kernel stop sending FLUSH for this mount: one round trip
        # less per close, and nothing to flush on a read-only mount.
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @fuse_errors
    async def release(self, fh):
        if fh >= STATS_FH_FIRST:
            self._uncount("release")
            self._stats_reads.pop(fh, None)
            return
        self.fs.release(fh)

    async def forget(self, inode_list):
        # No reply and no errno: a failure here is logged, never raised. (Each stats
        # inode is looked up once: its FORGET lets go of it.)
        try:
            for ino, count in inode_list:
                if ino >= STATS_INODE_FIRST:
                    self._stats_snapshots.pop(ino, None)
                elif self._count_lookups:  # (immutable: nodes live as long as the mount)
                    self.fs.forget(ino, count)
        except Exception:  # noqa: BLE001 - the daemon must never die on one request
            log.exception("forget failed")

    # -- every write operation is EROFS ----------------------------------------
    setattr = _read_only("setattr")
    mknod = _read_only("mknod")
    mkdir = _read_only("mkdir")
    unlink = _read_only("unlink")
    rmdir = _read_only("rmdir")
    symlink = _read_only("symlink")
    rename = _read_only("rename")
    link = _read_only("link")
    write = _read_only("write")
    create = _read_only("create")
    setxattr = _read_only("setxattr")
    removexattr = _read_only("removexattr")

    async def fsync(self, fh, datasync):
        # Nothing is ever dirty; ENOSYS makes the kernel answer every later fsync with success.
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def fsyncdir(self, fh, datasync):
        raise pyfuse3.FUSEError(errno.ENOSYS)
