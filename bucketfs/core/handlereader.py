"""How one handle's READs are served: through the block cache, or through sequential
read-ahead streams (prefetch.py), one per reader of the file.

Several readers can share one handle: every reader of a file, once the kernel opens
files itself (its READs come by inode, filesystem.read_inode), or threads that `pread`
one descriptor. Each reader keeps its own place in the file, a *track*: a READ goes to
the track whose stream covers it, or whose last READ it continues; any other READ is a
new reader (or this one seeking) and starts a track. With one track per handle, four
readers of a file's four quarters each looked like a seek of the others': a 64 MB
shard's READs fetched 2.7x its bytes, at half one reader's speed (ad hoc, 2026-11-28).

- A stream's READs come at most REORDER_TOLERANCE_BYTES ahead of its reader's last
  one (the kernel's read-ahead, prefetch.py); a READ further ahead, inside the bytes
  the stream already fetches, is another reader starting there: it takes over the
  stream's parts from that offset on, and the stream fetches no further than where
  they begin.
- A track no READ came for in TRACK_IDLE_S (and none in progress), while another was
  read, is closed (its reader moved on: a seek, or it finished its part of the file);
  at most MAX_TRACKS.
- A READ that reaches the file's end ends its track; a handle of the inode's own goes
  once a reader reached the file's end and no other track was read within
  TRACK_IDLE_S (`finished`; checked at each READ, and by the mount's periodic sweep
  of idle handles).
"""

from __future__ import annotations

from typing import Optional

import trio

from bucketfs import errors
from bucketfs.core.prefetch import REORDER_TOLERANCE_BYTES, PartCancelled, Prefetcher, SequentialStream

MiB = 1024 * 1024
# A stream starts after this many contiguous bytes in at least 2 reads: a random
# reader rarely chains 1 MiB, while the kernel's own read-ahead of a sequential
# reader sends READs of 1 MiB or more, so the second READ already starts a stream.
SEQUENTIAL_BYTES_TO_START = 1 * MiB
SEQUENTIAL_READS_TO_START = 2
# READs this close to a track's last one continue it (the kernel's concurrent READs
# of one reader arrive slightly reordered).
CONTIGUOUS_SLACK_BYTES = 128 * 1024
# Readers of one file at different places at once (a loader's workers each reading
# their slice of one large file).
MAX_TRACKS = 8
TRACK_IDLE_S = 1.0


class Track:
    """One reader's place in the file."""

    __slots__ = ("stream", "last_end", "contiguous_count", "contiguous_bytes", "read_at_s", "reads_in_progress")

    def __init__(self, now_s: float, stream: Optional[SequentialStream] = None):
        self.stream = stream
        self.last_end: Optional[int] = None
        self.contiguous_count = 0
        self.contiguous_bytes = 0
        self.read_at_s = now_s
        self.reads_in_progress = 0  # (a READ waiting on a slow store is not idleness)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None


class HandleReader:
    """Per handle: picks the block cache or a reader's sequential stream for each read."""

    def __init__(self, prefetcher: Prefetcher, cache, key, version, size_bytes, is_shard, config, on_progress=None):
        self.pf, self.cache = prefetcher, cache
        self.key, self.version, self.size_bytes = key, version, size_bytes
        self.is_shard = is_shard
        self.config = config
        self.on_progress = on_progress  # called with (read_end, window_bytes) after stream reads: shard warming
        self.tracks: list[Track] = []  # least recently read first
        self.end_reached = False  # a reader read to the file's end
        self._last_stream: Optional[SequentialStream] = None

    @property
    def stream(self) -> Optional[SequentialStream]:
        """The stream that served the last READ a stream served (closed, if its reader
        has finished)."""
        return self._last_stream

    async def read(self, off: int, end: int):
        now_s = trio.current_time()
        track = self._track_for(off, now_s)
        if track is None:
            # Reordered READ of bytes a stream already passed: serve it alone.
            self.pf.stats["prefetch.reordered_reads"] += 1
            return await self.cache.read(self.key, self.version, self.size_bytes, off, end)
        contiguous = track.last_end is not None and abs(off - track.last_end) <= CONTIGUOUS_SLACK_BYTES
        if contiguous:
            track.contiguous_count += 1
            track.contiguous_bytes += end - off
        else:
            track.contiguous_count, track.contiguous_bytes = 1, 0
        track.last_end = end
        track.read_at_s = now_s
        self._close_idle(now_s, track)
        stream = track.stream
        if stream is None and self._starts_stream(track, off):
            stream = track.stream = self._stream_at(off)
        if stream is None:
            data = await self.cache.read(self.key, self.version, self.size_bytes, off, end)
            self._done_with(track, end)
            return data
        track.reads_in_progress += 1
        try:
            data = await stream.read(off, end)
        except PartCancelled:
            data = await self.cache.read(self.key, self.version, self.size_bytes, off, end)
        except errors.BucketfsError:
            if track.stream is stream:
                track.close()
            raise
        else:
            self._last_stream = stream
            if self.on_progress is not None:
                self.on_progress(stream.read_end, stream.window_bytes)
        finally:
            track.reads_in_progress -= 1
        self._done_with(track, end)
        return data

    def _track_for(self, off: int, now_s: float) -> Optional[Track]:
        """The track a READ at `off` belongs to (made most recent), a new one, or None
        for a READ just behind a stream (the kernel reordered it)."""
        found = None
        for track in reversed(self.tracks):
            s = track.stream
            # (a reader's READs come at most the kernel's reordering ahead of its last)
            if s is not None and s.covers(off) and off <= s.read_end + REORDER_TOLERANCE_BYTES:
                found = track
                break
        if found is None:
            if any(t.stream is not None and t.stream.near(off) for t in self.tracks):
                return None
            for track in reversed(self.tracks):
                if track.stream is None and track.last_end is not None:
                    if abs(off - track.last_end) <= CONTIGUOUS_SLACK_BYTES:
                        found = track
                        break
        if found is not None:
            self.tracks.remove(found)
            self.tracks.append(found)
            return found
        if self.tracks:
            self.pf.stats["prefetch.seeks"] += 1
        track = Track(now_s, self._stream_at(off, inside_only=True))
        self.tracks.append(track)
        if len(self.tracks) > MAX_TRACKS:
            self.tracks.pop(0).close()
        return track

    def _stream_at(self, off: int, inside_only: bool = False) -> Optional[SequentialStream]:
        """A stream for a reader at `off`, over the bytes up to where the next stream
        ahead begins (streams of one file never fetch the same bytes): a stream behind
        that fetches past `off` hands over its parts from there and ends where they
        begin.
        `inside_only`: only where such parts were handed over (a reader starting
        inside another's window), else None."""
        handed: list = []
        limit_end = self.size_bytes
        window_bytes = 0
        for track in self.tracks:
            s = track.stream
            if s is None:
                continue
            if s.first_offset() > off:
                limit_end = min(limit_end, s.first_offset())
            elif s.limit_end > off:
                handed = s.hand_over_from(off)
                window_bytes = s.window_bytes
        if inside_only and not handed:
            return None
        self.pf.stats["prefetch.streams"] += 1
        return SequentialStream(
            self.pf,
            self.key,
            self.version,
            self.size_bytes,
            off,
            window_bytes or min(self._initial_window_bytes(), self.config.readahead_max_bytes),
            self.config.readahead_max_bytes,
            handed_parts=handed,
            limit_end=limit_end,
        )

    def _close_idle(self, now_s: float, current: Track) -> None:
        for track in [
            t
            for t in self.tracks
            if t is not current and not t.reads_in_progress and now_s - t.read_at_s > TRACK_IDLE_S
        ]:
            self.tracks.remove(track)
            track.close()

    def _initial_window_bytes(self) -> int:
        """A shard's stream starts wide, so that one reader has many GETs in flight at
        once; streams running beside it share that width (each at least one part),
        and each grows from there only if its reader waits. Every byte of a window
        starts in a fresh buffer (the pool has not seen so many yet): four shard
        readers starting at the full width held 256 MiB before their first part
        came back."""
        if not self.is_shard:
            return self.config.readahead_initial_bytes
        sharing = len(self.pf.streams) + 1
        return max(self.config.shard_readahead_initial_bytes // sharing, self.pf.part_size_bytes)

    def _starts_stream(self, track: Track, off: int) -> bool:
        if self.is_shard and off == 0:
            return True
        return (
            track.contiguous_count >= SEQUENTIAL_READS_TO_START and track.contiguous_bytes >= SEQUENTIAL_BYTES_TO_START
        )

    def finished(self) -> bool:
        """Whether a reader read to the file's end and no other reader read it within
        TRACK_IDLE_S (each other reader done with its slice, or gone)."""
        now_s = trio.current_time()
        return self.end_reached and not any(
            t.reads_in_progress or now_s - t.read_at_s <= TRACK_IDLE_S for t in self.tracks
        )

    def _done_with(self, track: Track, end: int) -> None:
        """A reader that reached the file's end is done: its track goes. (One that
        reached where the next reader's stream begins may still read on into it: it
        goes once idle.)"""
        if end >= self.size_bytes:
            self.end_reached = True
            if track in self.tracks:
                self.tracks.remove(track)
                track.close()

    def close(self) -> None:
        while self.tracks:
            self.tracks.pop().close()
