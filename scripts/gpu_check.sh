#!/usr/bin/env bash
# The GPU check, in one call: on a CUDA host with no internet (the torch, nvcc, cmake, ninja and pytest already
# installed there), builds ampkit for that GPU, runs every test (the CUDA ones now run instead of skipping) and
# the benchmarks, writes logs and bench JSON under $OUT (default: out/), and prints a short summary last.
#
# What runs: ctest -L cuda (the real kernels bitwise against the CPU kernels: unscale/check over every dtype and
# a 1,000+-tensor list, adamw_step_ with masters, a CUDA scaler's stats/state_dict/save), ctest -L emulated
# (the same kernels through the emulated host build against the same CPU kernels: with the cuda label this is
# the emulated-vs-real comparison), the rest of ctest, pytest (tests/python/test_cuda_paths.py: an O2 step
# captured in a CUDA graph and replayed 100 times against eager steps, the CUDA scaler's state, ...), the C++
# examples and demos, bench/run.py (with host-sync counts) and bench/run.py --traffic.
#
# Catch2 (header-only) may be missing there: scripts/stage_gpu_deps.sh copies this machine's into .deps/,
# which the device call carries; this script finds it there.
#
# Environment: AMPKIT_CUDA_ARCHS (default 90), PYTHON (default python3), BENCH_ARGS (extra bench/run.py args).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export AMPKIT_SKIP_DEPS=1 AMPKIT_CUDA_ARCHS="${AMPKIT_CUDA_ARCHS:-90}" PYTHONUNBUFFERED=1
export AMPKIT_BUILD_DIR="${AMPKIT_BUILD_DIR:-$ROOT/build-gpu}"
[ -d "$ROOT/.deps" ] && export CMAKE_PREFIX_PATH="$ROOT/.deps${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
[ -d "$ROOT/.deps/include" ] && export CPLUS_INCLUDE_PATH="$ROOT/.deps/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"

status=()
step() {  # step NAME LOGFILE COMMAND...
  local name="$1" log="$2"
  shift 2
  local t0=$SECONDS
  echo "=== $name" | tee -a "$OUT/summary.txt"
  if "$@" >"$OUT/$log" 2>&1; then
    status+=("PASS  $name ($((SECONDS - t0)) s)")
  else
    status+=("FAIL  $name ($((SECONDS - t0)) s): see $log")
    tail -n 40 "$OUT/$log"
  fi
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  nvcc --version | tail -n 1
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

cd "$ROOT"
# CMake only (no pip/setuptools needed there); Python imports the package from python/.
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
step "build (sm_$AMPKIT_CUDA_ARCHS)" build.log bash -c "source scripts/common.sh && build_ampkit_cmake_only"
step "ctest -L cuda (real kernels vs CPU)" ctest_cuda.log ctest --test-dir "$AMPKIT_BUILD_DIR" --output-on-failure -L cuda
step "ctest -L emulated (emulated kernels vs CPU)" ctest_emulated.log ctest --test-dir "$AMPKIT_BUILD_DIR" \
  --output-on-failure -j 8 -L emulated
step "ctest (the rest)" ctest.log ctest --test-dir "$AMPKIT_BUILD_DIR" --output-on-failure -j 8 -LE "cuda|emulated"
step "pytest" pytest.log "$PY" -m pytest -q -rs tests/python
step "examples/cpp" examples.log bash -c "source scripts/common.sh && build_examples && \"\$AMPKIT_BUILD_DIR/examples/ops_demo/ops_demo\""
DIGITS="$ROOT/.deps/digits.bin"  # staged by scripts/stage_gpu_deps.sh (no scikit-learn there)
step "demo (C++, FP16)" demo_cpp.log "$AMPKIT_BUILD_DIR/examples/train_demo/train_demo" "$DIGITS" --epochs 20 \
  --inject-overflow 300 --history "$OUT/history.csv"
step "demo (Python, CUDA graph)" demo_py.log "$PY" examples/python/train_demo.py --epochs 10 --data "$DIGITS"
step "bench" bench.log "$PY" bench/run.py --json "$OUT/bench.json" ${BENCH_ARGS:-}
step "bench --traffic" traffic.log "$PY" bench/run.py --traffic --json "$OUT/traffic.json"

echo
[ -f "$OUT/bench.log" ] && grep -A 100 "^name" "$OUT/bench.log"
[ -f "$OUT/demo_cpp.log" ] && grep -A 4 "^mode" "$OUT/demo_cpp.log"
[ -f "$OUT/demo_py.log" ] && tail -n 5 "$OUT/demo_py.log"
echo
echo "==== gpu_check summary ($(date -u +%Y-%m-%d), $(head -n 3 "$OUT/env.txt" | tail -n 2 | tr '\n' ' '))"
grep -E "passed|failed" "$OUT/pytest.log" | tail -n 1
grep -E "tests passed|tests failed" "$OUT/ctest_cuda.log" "$OUT/ctest_emulated.log" "$OUT/ctest.log" 2>/dev/null
printf '%s\n' "${status[@]}" | tee -a "$OUT/summary.txt"
printf '%s\n' "${status[@]}" | grep -q FAIL && exit 1
exit 0
