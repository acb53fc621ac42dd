#!/usr/bin/env bash
# Builds ampkit and runs every test: the Catch2 tests (ctest), the C++ example built against the installed
# package, then pytest. Installs what is missing first (see scripts/common.sh).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ensure_deps
build_ampkit

log "ctest"
ctest --test-dir "$AMPKIT_BUILD_DIR" --output-on-failure -j "$CMAKE_BUILD_PARALLEL_LEVEL"

build_examples
log "examples/cpp: ops_demo, scaler_loop, o2_loop"
"$AMPKIT_BUILD_DIR/examples/ops_demo/ops_demo"
"$AMPKIT_BUILD_DIR/examples/scaler_loop/scaler_loop"
"$AMPKIT_BUILD_DIR/examples/o2_loop/o2_loop"

log "pytest"
cd "$AMPKIT_ROOT" && "$PY" -m pytest -q tests/python "$@"
log "all tests passed"
