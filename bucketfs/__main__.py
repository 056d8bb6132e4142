"""`python -m bucketfs ...`: the `bucketfs` command, for an install without its script on PATH."""

import sys

from bucketfs.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
