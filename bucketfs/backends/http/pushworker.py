"""A fetch-ahead worker: a fetch worker (fetchworker.py) that holds the mount's /dev/fuse
descriptor and pushes whole files into the kernel's page cache (its PUSH requests).

    python -m bucketfs.backends.http.pushworker FD PARENT_PID MAX_TRANSFERS CONNECT_S READ_S CA_BUNDLE KERNEL_FD

A module of its own so that `ps` (and the tests) tell fetch-ahead workers from the
fetch workers of --fetch-workers.
"""

from __future__ import annotations

import sys

from bucketfs.backends.http.fetchworker import main

if __name__ == "__main__":
    sys.exit(main())
