#!/usr/bin/env bash
# Install everything bucketfs and its tests need on a fresh Debian/Ubuntu machine:
# the FUSE 3 runtime and headers, a C compiler and Python's headers (pyfuse3 is
# built from source; so is pycurl where pip finds no wheel, hence libcurl's and
# OpenSSL's headers), then bucketfs with its test extra (pip). PYTHON names another
# interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    fuse3 libfuse3-dev pkg-config gcc python3-dev python3-pip libcurl4-openssl-dev libssl-dev >/dev/null
PIP=("$PYTHON" -m pip install -q)
if "$PYTHON" -c 'import os, sys, sysconfig
sys.exit(sys.prefix != sys.base_prefix
         or not os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
    # Debian's and Ubuntu's own python3 refuse pip installs (PEP 668). This quick start
    # is for a fresh machine and installs into it anyway; on a shared workstation use a
    # venv instead (README, Install). Its pip belongs to apt: not upgraded here.
    echo "setup: $PYTHON is the system's Python; installing into it (--break-system-packages)"
    PIP+=(--break-system-packages)
else
    "$PYTHON" -m pip install -q --upgrade pip
fi
"${PIP[@]}" -e ".[test]"
echo "setup done: $("$PYTHON" -m bucketfs --version)"
