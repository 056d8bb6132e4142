#!/usr/bin/env bash
# Install everything bucketfs and its tests need on a fresh Debian/Ubuntu machine:
# the FUSE 3 runtime and headers (apt), then bucketfs with its test extra (pip).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse3-dev pkg-config >/dev/null
python3 -m pip install -q --upgrade pip
python3 -m pip install -q -e ".[test]"
echo "setup done: $(bucketfs --version)"
