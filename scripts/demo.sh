#!/usr/bin/env bash
# ampkit's main job: trains the same digits classifier from C++ in FP32, O1 and O2 (with the GradScaler; FP16 on
# CUDA when present, BF16 on the CPU otherwise), prints the comparison table, and plots the loss curves and the
# loss-scale history to a PNG. By default an Inf is injected into a gradient every 300 steps to show the scaler
# backing off, skipping and recovering (DEMO_INJECT=0 to turn that off). Extra arguments go to the C++ program
# (--epochs N, --inject-overflow K). Installs what is missing first (see scripts/common.sh).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ensure_deps
build_ampkit
build_examples

out="$AMPKIT_BUILD_DIR/demo"
mkdir -p "$out"
data="$out/digits.bin"
[ -f "$data" ] || "$PY" "$AMPKIT_ROOT/examples/python/export_digits.py" "$data"
inject=()
[ "${DEMO_INJECT:-1}" = 0 ] || inject=(--inject-overflow 300)
"$AMPKIT_BUILD_DIR/examples/train_demo/train_demo" "$data" --history "$out/history.csv" "${inject[@]}" "$@"
"$PY" "$AMPKIT_ROOT/examples/python/plot_demo.py" "$out/history.csv" "$out/amp_demo.png"
echo "plot of the loss curves and the loss-scale history: $out/amp_demo.png"
