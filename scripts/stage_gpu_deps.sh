#!/usr/bin/env bash
# Copies the header-only Catch2 of this machine (Debian's catch2) and the demo's dataset into .deps/ (git-ignored)
# so that a device call can carry them to a GPU host that has neither and no internet: run(carry=[".deps"], ...).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$ROOT/.deps/include" "$ROOT/.deps/lib/cmake"
cp -r /usr/include/catch2 "$ROOT/.deps/include/"
cp -r /usr/lib/cmake/Catch2 "$ROOT/.deps/lib/cmake/"
cp /usr/lib/libCatch2WithMain.a "$ROOT/.deps/lib/"
# The demo's dataset, exported here (the GPU host has no scikit-learn).
"${PYTHON:-python3}" "$ROOT/examples/python/export_digits.py" "$ROOT/.deps/digits.bin"
echo "staged Catch2 and the digits dataset in $ROOT/.deps"
