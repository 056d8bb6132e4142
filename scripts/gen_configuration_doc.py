#!/usr/bin/env python3
"""Regenerate docs/configuration.md from the options' definitions (`--check`: only compare).

The same as `python3 -m bucketfs.app.configdoc`; see bucketfs/app/configdoc.py.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bucketfs.app.configdoc import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
