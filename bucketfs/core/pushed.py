"""The files a fetch-ahead pass pushed into the kernel's page cache, until it sees them
opened, and how many of them it hears of.

A loader reads a pushed file from the page cache: the daemon hears nothing of it. It
hears of a "told" push's file (one in every few: its push ended the inode's cached
attributes, so the loader's first stat() is a GETATTR), and of any pushed file whose
READ reached it (the READ came before the push was done, or the kernel dropped its
pages). Each told push stands for the untold ones pushed after it, until the next
told one (its stratum): when the told file is opened, the pass counts its stratum
opened. A loader opens files in random order, and a stratum's pushes go out together,
so what the told files say of the pass as a whole (the bytes held unread, the files
opened) is about right; a test holds it within a quarter of the truth.
"""

from __future__ import annotations

from typing import Optional


class PushedFiles:
    """One pass's pushes not yet seen opened (ints: inodes and bytes)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.held_bytes = 0  # the bytes of the strata whose told file is not yet opened
        self.credited_untold_count = 0  # untold files counted opened with their stratum, not seen opened
        self._strata: dict = {}  # told ino -> [files, bytes] (the told one included)
        self._untold: dict = {}  # ino -> (told ino, bytes)
        self._newest: Optional[int] = None  # the stratum untold pushes join
        self._until_told = 0
        self._orphans: list = []  # untold inos whose told push failed: the next told one's

    def __bool__(self) -> bool:
        return bool(self._strata or self._untold)

    def is_told(self, ino: int) -> bool:
        return ino in self._strata

    def next_is_told(self) -> bool:
        """Whether the next push is to be told: every `every`th (add's), and any whose
        stratum would have no told file left unopened."""
        return self._newest not in self._strata or self._until_told <= 0

    def add(self, ino: int, size_bytes: int, told: bool, every: int) -> None:
        """A push begins; `every`: how many pushes a told one stands for from now."""
        self._until_told -= 1
        self.held_bytes += size_bytes
        if not told:
            assert self._newest is not None
            self._untold[ino] = (self._newest, size_bytes)
            self._strata[self._newest][0] += 1
            self._strata[self._newest][1] += size_bytes
            return
        self._until_told = every - 1
        self._newest = ino
        self._strata[ino] = [1, size_bytes]
        self._adopt_orphans()

    def _adopt_orphans(self) -> None:
        """The newest stratum takes the untold files whose told push failed."""
        stratum = self._strata[self._newest]
        for orphan in self._orphans:
            orphan_bytes = self._untold[orphan][1]
            self._untold[orphan] = (self._newest, orphan_bytes)
            stratum[0] += 1
            stratum[1] += orphan_bytes
        self._orphans = []

    def opened(self, ino: int) -> tuple:
        """The loader opened `ino` (the daemon heard): (files, bytes) to count opened now."""
        stratum = self._strata.pop(ino, None)
        if stratum is not None:
            self.held_bytes -= stratum[1]
            self.credited_untold_count += stratum[0] - 1
            return stratum[0], stratum[1]
        entry = self._untold.pop(ino, None)
        if entry is None:
            return 0, 0
        told, size_bytes = entry
        if ino in self._orphans:
            self._orphans.remove(ino)
            self.held_bytes -= size_bytes
            return 1, size_bytes
        stratum = self._strata.get(told)
        if stratum is None:  # (counted with its told file)
            self.credited_untold_count -= 1
            return 0, 0
        stratum[0] -= 1
        stratum[1] -= size_bytes
        self.held_bytes -= size_bytes
        return 1, size_bytes

    def failed(self, ino: int) -> tuple:
        """`ino`'s push failed (the kernel does not hold it): (whether it was one of
        these, (files, bytes) counted opened that must not be)."""
        stratum = self._strata.pop(ino, None)
        if stratum is not None:
            # Its untold files go to the newest stratum, or to the next told push.
            self.held_bytes -= stratum[1]
            members = [other for other, (told, _) in self._untold.items() if told == ino]
            self._orphans.extend(members)
            for member in members:
                self.held_bytes += self._untold[member][1]
            if self._newest in self._strata:
                self._adopt_orphans()
            return True, (0, 0)
        entry = self._untold.pop(ino, None)
        if entry is None:
            return False, (0, 0)
        told, size_bytes = entry
        if ino in self._orphans:
            self._orphans.remove(ino)
            self.held_bytes -= size_bytes
            return True, (0, 0)
        stratum = self._strata.get(told)
        if stratum is None:  # (counted opened with its told file)
            self.credited_untold_count -= 1
            return True, (1, size_bytes)
        stratum[0] -= 1
        stratum[1] -= size_bytes
        self.held_bytes -= size_bytes
        return True, (0, 0)

    def end(self) -> tuple:
        """The pass is over: (files, bytes) never heard of as opened; forgets them all."""
        files = sum(stratum[0] for stratum in self._strata.values()) + len(self._orphans)
        unused = files, self.held_bytes
        self._reset()
        return unused
