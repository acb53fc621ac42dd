#!/usr/bin/env bash
# Stages in .deps/ (git-ignored) what the GPU host lacks and cannot download (it has no internet), so that a device
# call carries it: run(carry=[".deps"], command="scripts/gpu_check.sh"). scripts/gpu_check.sh finds each on its own
# path: Catch2's header and CMake package (Debian's catch2) under .deps/include and .deps/lib/cmake, the pure-Python
# test dependencies the GPU host lacks (expecttest, which torch.testing._internal imports) under .deps/python, and
# the demo's dataset (.deps/digits.bin, exported from scikit-learn's copy).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
DEPS="$ROOT/.deps"
rm -rf "$DEPS"
mkdir -p "$DEPS/include" "$DEPS/lib/cmake" "$DEPS/python"
cp -r /usr/include/catch2 "$DEPS/include/"
cp -r /usr/lib/cmake/Catch2 "$DEPS/lib/cmake/"
[ -f /usr/lib/libCatch2WithMain.a ] && cp /usr/lib/libCatch2WithMain.a "$DEPS/lib/"
# Pure-Python test requirements missing on the GPU host, at the versions requirements.txt pins.
for pkg in expecttest; do
  pin=$(grep -E "^$pkg==" "$ROOT/requirements.txt" | cut -d' ' -f1)
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-deps --no-compile --target "$DEPS/python" "${pin:-$pkg}"
done
"$PY" "$ROOT/examples/python/export_digits.py" "$DEPS/digits.bin" >/dev/null
echo "staged in $DEPS ($(du -sh "$DEPS" | cut -f1)): Catch2, expecttest, the digits dataset"
