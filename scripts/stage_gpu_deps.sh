#!/usr/bin/env bash
# Copies the header-only Catch2 of this machine (Debian's catch2) into .deps/ (git-ignored) so that a device
# call can carry it to a GPU host that has no Catch2 and no internet: run(carry=[".deps"], ...).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$ROOT/.deps/include" "$ROOT/.deps/lib/cmake"
cp -r /usr/include/catch2 "$ROOT/.deps/include/"
cp -r /usr/lib/cmake/Catch2 "$ROOT/.deps/lib/cmake/"
cp /usr/lib/libCatch2WithMain.a "$ROOT/.deps/lib/"
echo "staged Catch2 in $ROOT/.deps"
