#!/usr/bin/env bash
# ampkit's main job: builds ampkit and its C++ example against the installed package, then runs it.
# Installs what is missing first (see scripts/common.sh).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ensure_deps
build_ampkit
build_examples
log "running examples/cpp/ops_demo"
"$AMPKIT_BUILD_DIR/examples/ops_demo/ops_demo" "$@"
