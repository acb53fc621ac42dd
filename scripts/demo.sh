#!/usr/bin/env bash
# ampkit's main job: trains the same digits classifier from C++ in FP32, O1 and O2 (with the GradScaler; FP16 on
# CUDA when present, BF16 on the CPU otherwise), prints the comparison table, and plots the loss curves, the
# loss-scale history and the O2 gradients' exponent histogram against FP16's range at the loss scale to a PNG. By
# default an Inf is injected into a gradient every 300 steps to show the scaler backing off, skipping and
# recovering (DEMO_INJECT=0 to turn that off). Extra arguments go to the C++ program (--epochs N,
# --inject-overflow K). Then examples/python/bert_lamb.py (O2 + LAMB on a small BERT-like encoder; DEMO_BERT=0 skips
# it). Installs what is missing first (see scripts/common.sh).
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
"$AMPKIT_BUILD_DIR/examples/train_demo/train_demo" "$data" --history "$out/history.csv" \
  --grad-log "$out/grads.jsonl" "${inject[@]}" "$@"
"$PY" "$AMPKIT_ROOT/examples/python/plot_demo.py" "$out/history.csv" "$out/amp_demo.png" "$out/grads.jsonl"
echo "plot of the loss curves, the loss-scale history and the O2 gradient exponents: $out/amp_demo.png"
echo "gradient statistics for TensorBoard: $PY -m ampkit.monitor $out/grads.jsonl $out/tensorboard"
# BERT-style pre-training: a small Transformer encoder with a masked-token objective, O2 + LAMB + warm-up
# (examples/python/bert_lamb.py; DEMO_BERT=0 skips it).
if [ "${DEMO_BERT:-1}" != 0 ]; then
  "$PY" "$AMPKIT_ROOT/examples/python/bert_lamb.py"
fi
