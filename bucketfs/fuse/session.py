"""The mount's /dev/fuse descriptor, for processes that write FUSE notifications.

pyfuse3 keeps libfuse's session private, and with it `fuse_session_fd`. The
descriptor is the one this process holds open on /dev/fuse: libfuse opens it (as root)
or fusermount3 hands it over (other users). A notification (fetch-ahead's pushes into
the page cache: backends/http/fetchworker.py) is a write to it by any process holding
it, so the fetch-ahead workers inherit it.
"""

from __future__ import annotations

import os
from typing import Optional

FUSE_DEVICE = "/dev/fuse"


def session_fd() -> Optional[int]:
    """The one descriptor of this process open on /dev/fuse, or None if there is none or
    more than one (which would be another session's is not known)."""
    found = []
    try:
        for name in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{name}") == FUSE_DEVICE:
                    found.append(int(name))
            except OSError:
                continue  # (closed meanwhile: listdir's own descriptor)
    except OSError:
        return None
    return found[0] if len(found) == 1 else None
