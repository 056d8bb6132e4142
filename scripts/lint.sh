#!/usr/bin/env bash
# Lint and type checks, as CI runs them before the tests: ruff (lint and format) on the
# whole repository, mypy on the package. `bash scripts/lint.sh --fix` fixes what ruff can.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ "${1:-}" = "--fix" ]; then
    "$PYTHON" -m ruff check --fix .
    "$PYTHON" -m ruff format .
fi
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
"$PYTHON" -m mypy
echo "lint: ruff and mypy clean"
