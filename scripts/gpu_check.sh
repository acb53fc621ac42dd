#!/usr/bin/env bash
# The GPU check: the device half of ampkit's tests, planned to fit one short visit to a GPU host (one command of
# at most 10 minutes there; target: 6 minutes from a cold machine, so a rerun fits in the same visit).
#
#   scripts/gpu_check.sh             on the GPU host (carry .deps/, staged by scripts/stage_gpu_deps.sh)
#   scripts/gpu_check.sh --dry-run   the same plan on a host without a GPU: builds exactly what the device builds,
#                                    runs every step, and reports each step that needs a device as SKIP
#
# What runs here and what does not: the device builds only what runs on it (libampkit, ampkit._C, the Catch2
# `cuda` tests, the C++ demo) for one architecture with the CUDA kernels forced on (a build that finds no nvcc
# fails, rather than passing as CPU-only), sanitizers off, every core; then, in this order, the `cuda` ctest label
# (the real kernels bitwise against the CPU kernels), pytest's CUDA tests (`-m cuda`: every test that skips
# without a device, plus the `cuda` parametrizations; see tests/python/conftest.py; 90 s per test at most, on
# several workers when pytest-xdist is there, so a hang costs one test), bench/run.py --device cuda --quick
# without the compiled step (host-sync counts; one JSON line per row as it is measured), and the C++ and Python
# demos on FP16. Everything that needs no GPU (the emulated kernels under the
# sanitizers, the rest of ctest and pytest, the CPU bench rows, --traffic, the CPU examples) runs on the CPU
# hosts: scripts/test.sh, bench/run.py --device cpu, bench/run.py --traffic.
#
# Output: each step prints `PASS|FAIL|SKIP name (N s)` the moment it ends (a killed run still shows what it did),
# and keeps going after a failure; the summary at the end (environment, statuses, failing tests, the bench table)
# fits in the last 12,000 characters (its longest parts, the bench table and the failing tests, come first and are
# capped, the step statuses last). Under $OUT (default out/) at most 8 files, rewritten after every step:
# summary.txt, logs.tar.gz (every step's log), bench_cuda.jsonl (one row a line, as measured), history_fp16.csv.
#
# Environment: OUT, PYTHON (default python3), AMPKIT_CUDA_ARCHS (default 90), JOBS (default: every core),
# AMPKIT_BUILD_DIR (default build-gpu/), GPU_CHECK_BUDGET_S (default 540: no step starts a timeout past it),
# PYTEST_WORKERS (default 4, with pytest-xdist), BENCH_ARGS (extra bench/run.py arguments).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
OUT="${OUT:-$ROOT/out}"
# Logs are written outside $OUT and packed into one tar there after every step (at most 8 files come back).
LOGS="$(mktemp -d)/logs"
mkdir -p "$OUT" "$LOGS"
rm -f "$OUT/summary.txt" "$OUT/logs.tar.gz" "$OUT/bench_cuda.jsonl" "$OUT/history_fp16.csv"
PY="${PYTHON:-python3}"
# The cores this process may use: nproc also obeys OMP_NUM_THREADS, which a test environment may set to 1.
CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
JOBS="${JOBS:-$CORES}"
# The limits are the GPU host's (16 cores). A dry run on fewer cores scales every timeout and the budget by
# GPU_CHECK_TIME_SCALE (default there: 16 / cores, times 2 for a shared machine), so the plan is checked, not the
# speed of the host.
if [ "$DRY_RUN" = 1 ]; then
  SCALE="${GPU_CHECK_TIME_SCALE:-$(( (16 + CORES - 1) / CORES * 2 ))}"
else
  SCALE="${GPU_CHECK_TIME_SCALE:-1}"
fi
BUDGET=$(( ${GPU_CHECK_BUDGET_S:-540} * SCALE ))
export AMPKIT_SKIP_DEPS=1 AMPKIT_CUDA_ARCHS="${AMPKIT_CUDA_ARCHS:-90}" PYTHONUNBUFFERED=1
export AMPKIT_BUILD_DIR="${AMPKIT_BUILD_DIR:-$ROOT/build-gpu}" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS"
DEPS="$ROOT/.deps"
[ -d "$DEPS" ] && export CMAKE_PREFIX_PATH="$DEPS${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
[ -d "$DEPS/include" ] && export CPLUS_INCLUDE_PATH="$DEPS/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
# CMake only (no pip there): the package is assembled in the build folder (python/ampkit's modules plus what
# cmake installs), never in the source tree, so a dry run leaves this tree's own build alone; Python imports it
# from there and the staged pure-Python test dependencies (expecttest) from .deps/python.
PKG="$AMPKIT_BUILD_DIR/python"
export PYTHONPATH="$PKG${DEPS:+:$DEPS/python}${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

T0=$SECONDS
BUILD_OK=1
status=()
failed_tests=()

pack_logs() {  # one tar of every log, rewritten after each step so a killed run leaves what it had
  tar -czf "$OUT/logs.tar.gz.tmp" -C "$(dirname "$LOGS")" logs 2>/dev/null && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
}

record() {  # record STATUS NAME SECONDS [DETAIL]
  local line
  line=$(printf '%-4s %s (%s s)%s' "$1" "$2" "$3" "${4:+: $4}")
  status+=("$line")
  echo "$line"
  echo "$line" >>"$SUMMARY"
  pack_logs
}

# step NAME EXPECTED_S TIMEOUT_S NEEDS_DEVICE LOG COMMAND...
# EXPECTED_S is the time on the GPU host (16 cores), from a dry run here scaled to its cores; TIMEOUT_S bounds
# the step, and no step runs past the budget. NEEDS_DEVICE=1: in a dry run the command still runs (a plan check
# that never touches a GPU, see each caller), and the step is reported as SKIP (no device), never as PASS.
step() {
  local name="$1" expected="$2" limit="$3" needs_device="$4" log="$LOGS/$5"
  shift 5
  limit=$((limit * SCALE))
  local left=$((BUDGET - (SECONDS - T0)))
  if [ "$BUILD_OK" = 0 ]; then
    record SKIP "$name" 0 "the build failed"
    return
  fi
  if [ "$left" -lt 15 ]; then
    record SKIP "$name" 0 "no time left in the ${BUDGET} s budget"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS rc
  echo "=== $name (expected ~${expected} s on the GPU host, timeout ${limit} s)"
  # Commands may be this script's functions (exported below): timeout runs them in a bash of their own, and
  # signals that bash's whole process group (ninja and the compilers with it) when the limit is reached.
  timeout --kill-after=10 "$limit" bash -c '"$@"' step "$@" >"$log" 2>&1
  rc=$?
  local took=$((SECONDS - t0))
  if [ "$rc" -eq 0 ]; then
    if [ "$DRY_RUN" = 1 ] && [ "$needs_device" = 1 ]; then
      record SKIP "$name" "$took" "no device (plan checked)"
    else
      record PASS "$name" "$took"
    fi
  else
    local why="exit $rc"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="timed out after ${limit} s"
    record FAIL "$name" "$took" "$why, log logs/$(basename "$log")"
    # The failing tests by name (ctest and pytest's short summary), at most 15 lines of 200 characters a step,
    # then the log's last lines.
    local names
    names=$(grep -E '^FAILED |^ERROR |\(Failed\)|\(SEGFAULT\)|\(Subprocess aborted\)|\(Timeout\)|\*\*\*Exception' \
      "$log" | sort -u | head -n 15 | cut -c 1-200)
    [ -n "$names" ] && failed_tests+=("$name:" "$names")
    tail -n 15 "$log"
  fi
}

has_device() { "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

export ROOT OUT LOGS PY JOBS DRY_RUN DEPS PKG
export -f has_device

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)$([ "$DRY_RUN" = 1 ] && echo ', dry run (no device)')"
  echo "host: $CORES cores, $(uname -m); GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader 2>/dev/null || echo none)"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', \
torch.version.cuda, '| device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -n 1); cmake $(cmake --version | head -n 1 | cut -d' ' -f3)"
  echo "plan: sm_$AMPKIT_CUDA_ARCHS, -j$JOBS, budget ${BUDGET} s (time scale $SCALE), build dir $AMPKIT_BUILD_DIR"
} >"$LOGS/env.txt" 2>&1
cat "$LOGS/env.txt" | tee -a "$SUMMARY"
if [ "$DRY_RUN" = 0 ] && ! has_device; then
  echo "gpu_check: torch sees no CUDA device here; run scripts/gpu_check.sh --dry-run on a host without one" >&2
  exit 2
fi
if [ ! -d "$DEPS" ]; then
  echo "gpu_check: no .deps/ (Catch2, expecttest, the digits data): run scripts/stage_gpu_deps.sh and carry .deps" \
    | tee -a "$SUMMARY"
fi
cd "$ROOT"

# 1. Build: what the device runs and nothing else (the emulated, sanitized tests are the CPU hosts' work).
build() {
  local gen=()
  if [ ! -f "$AMPKIT_BUILD_DIR/CMakeCache.txt" ]; then
    command -v ninja >/dev/null && gen+=(-G Ninja)
    command -v ccache >/dev/null && gen+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  # AMPKIT_WITH_CUDA=ON, not AUTO: without nvcc the configure fails instead of building a CPU-only ampkit
  # whose CUDA tests would all skip.
  cmake -S "$ROOT" -B "$AMPKIT_BUILD_DIR" "${gen[@]}" -DPython3_EXECUTABLE="$(command -v "$PY")" \
    -DCMAKE_BUILD_TYPE=Release -DAMPKIT_BUILD_TESTS=ON -DAMPKIT_EMULATED_SANITIZE=OFF -DAMPKIT_WITH_CUDA=ON \
    -DAMPKIT_CUDA_ARCHS="$AMPKIT_CUDA_ARCHS" &&
  cmake --build "$AMPKIT_BUILD_DIR" -j "$JOBS" --target ampkit ampkit_python test_ops_cuda &&
  rm -rf "$PKG" && mkdir -p "$PKG" &&
  tar -C "$ROOT/python" --exclude='ampkit/lib' --exclude='ampkit/include' --exclude='ampkit/share' \
    --exclude='ampkit/_C*' --exclude='__pycache__' -cf - ampkit | tar -xf - -C "$PKG" &&
  cmake --install "$AMPKIT_BUILD_DIR" --prefix "$PKG/ampkit" >/dev/null &&
  (cd /tmp && "$PY" -c "
import sys, ampkit
info = ampkit.build_info()
print('ampkit', ampkit.__file__, info)
sys.exit(0 if info['cuda_compiled'] else 'ampkit.build_info() reports no CUDA kernels compiled')")
}
export -f build
# Expected on the GPU host: ~70 s. The dry runs of 2026-12-05 built this in 290 s (torch 2.13) and 264 s (2.11)
# on 2 cores, cold: about 35 s on 16, plus configure and link
# (bench/results/2026-12-05_dry-run_gpu-check_torch-2.13.0_2.11.0.txt).
step "build (sm_$AMPKIT_CUDA_ARCHS: libampkit, ampkit._C, cuda tests)" 70 330 0 build.log build
printf '%s\n' "${status[@]}" | grep -q "^FAIL build" && BUILD_OK=0

# 2. The cuda label: the real kernels against the CPU kernels. A dry run lists the tests (none: an error).
# Expected on the GPU host: ~25 s.
if [ "$DRY_RUN" = 1 ]; then
  ctest_cuda_listed() {  # -N ignores --no-tests: count the selection
    ctest --test-dir "$AMPKIT_BUILD_DIR" -N -L cuda | tee /dev/stderr | grep -Eq "^Total Tests: [1-9]"
  }
  export -f ctest_cuda_listed
  step "ctest -L cuda" 25 120 1 ctest_cuda.log ctest_cuda_listed
else
  step "ctest -L cuda" 25 120 1 ctest_cuda.log ctest --test-dir "$AMPKIT_BUILD_DIR" --output-on-failure -L cuda \
    --no-tests=error -j 4 --timeout 100
fi

# 3. pytest's CUDA tests. Without a device they are all skipped: the dry run checks that every module collects
# with the device's packages and that the selection is not empty. -v names each test as it ends (a failure shows
# before the step does), --durations the slowest. With pytest-timeout (the GPU host has it), no test runs past 90 s;
# with pytest-xdist too, the tests run on PYTEST_WORKERS processes sharing the GPU and a test past its time ends
# its worker (the thread method: a hang inside a CUDA call never returns to Python for a signal), which xdist
# reports as that test's failure and replaces: a hang costs one test, not the step.
# Expected on the GPU host: ~90 s.
pytest_cuda() {
  local args=(-v -rfE --durations=25)
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    args+=(-p timeout --timeout=90)
    if "$PY" -c "import xdist" 2>/dev/null; then
      args+=(-n "${PYTEST_WORKERS:-4}" --timeout-method=thread)
    fi
  else
    echo "pytest-timeout is not installed: no per-test timeout, one process"
  fi
  echo "pytest ${args[*]}"
  "$PY" -m pytest "${args[@]}" -m cuda -p no:cacheprovider --junitxml="$LOGS/pytest_cuda.xml" tests/python "$@"
  local rc=$?
  [ "$rc" -eq 5 ] && echo "pytest -m cuda selected no test" && return 5
  return "$rc"
}
export -f pytest_cuda
step "pytest -m cuda" 90 240 1 pytest_cuda.log pytest_cuda

DIGITS="$DEPS/digits.bin"
export DIGITS BENCH_ARGS="${BENCH_ARGS:-}"

# 4. The CUDA bench rows with host-sync counts (--quick; the compiled step left out: its compile alone takes minutes
# cold), each row a JSON line in $OUT/bench_cuda.jsonl the moment it is measured, so a run stopped at its timeout
# keeps the rows it had. A dry run runs the same command: no CUDA device, so no row, the arguments and imports
# checked. Expected on the GPU host: ~60 s.
bench_cuda() {
  "$PY" bench/run.py --device cuda --quick --no-compile --jsonl "$OUT/bench_cuda.jsonl" ${BENCH_ARGS:-}
}
export -f bench_cuda
step "bench --device cuda --quick" 60 150 1 bench_cuda.log bench_cuda

# 5. The demos on FP16 (the C++ one built against the installed package, as a user's program).
# Expected on the GPU host: ~40 s (C++, its build included) and ~30 s (Python).
demo_cpp() {
  source "$ROOT/scripts/common.sh" && build_examples >/dev/null || return 1
  [ -f "$DIGITS" ] || { echo "no $DIGITS: run scripts/stage_gpu_deps.sh"; return 1; }
  [ "$DRY_RUN" = 1 ] && { echo "dry run: built $AMPKIT_BUILD_DIR/examples/train_demo/train_demo, not run"; return 0; }
  "$AMPKIT_BUILD_DIR/examples/train_demo/train_demo" "$DIGITS" --epochs 20 --inject-overflow 300 \
    --history "$OUT/history_fp16.csv"
}
export -f demo_cpp
step "demo (C++, CUDA FP16)" 40 150 1 demo_cpp.log demo_cpp
demo_py() {
  [ "$DRY_RUN" = 1 ] && { "$PY" examples/python/train_demo.py --help >/dev/null; return; }
  "$PY" examples/python/train_demo.py --epochs 10 --data "$DIGITS"
}
export -f demo_py
step "demo (Python, CUDA graph)" 30 120 1 demo_py.log demo_py


# The summary, within the last 12,000 characters of the output: lines cut at 200 characters, the bench table at
# 45 rows, the failing tests at 15 lines a step; the longest parts first and the step statuses last. Printed whole
# up to 11,000 characters (a full bench table and three failing steps: about 9,000), else its last 11,000, which
# keep the failing tests and the statuses; summary.txt keeps all of it.
SUMMARY_TAIL="$(dirname "$LOGS")/summary_tail.txt"
{
  echo
  echo "==== gpu_check summary ($(date -u +%Y-%m-%d), $((SECONDS - T0)) s$([ "$DRY_RUN" = 1 ] && echo ', dry run'))"
  head -n 4 "$LOGS/env.txt" | cut -c 1-200
  if [ -f "$LOGS/bench_cuda.log" ] && grep -q "^name" "$LOGS/bench_cuda.log"; then
    grep -A 45 "^name" "$LOGS/bench_cuda.log" | cut -c 1-200
  elif [ -s "$OUT/bench_cuda.jsonl" ]; then
    echo "bench: stopped after $(wc -l <"$OUT/bench_cuda.jsonl") rows, in bench_cuda.jsonl"
  fi
  [ -f "$LOGS/demo_cpp.log" ] && grep -A 4 "^mode" "$LOGS/demo_cpp.log" | cut -c 1-200
  [ -f "$LOGS/demo_py.log" ] && [ "$DRY_RUN" = 0 ] && tail -n 6 "$LOGS/demo_py.log" | cut -c 1-200
  if [ "${#failed_tests[@]}" -gt 0 ]; then
    echo "failing tests:"
    printf '  %s\n' "${failed_tests[@]}"
  fi
  grep -hE "^[0-9]+ (passed|failed|skipped)|^=+ .*(passed|failed|skipped|deselected|error)" "$LOGS/pytest_cuda.log" \
    2>/dev/null | tail -n 1 | cut -c 1-200
  grep -hE "tests passed|tests failed|^Total Tests" "$LOGS/ctest_cuda.log" 2>/dev/null | tail -n 1
  printf '%s\n' "${status[@]}"
} >"$SUMMARY_TAIL"
cat "$SUMMARY_TAIL" >>"$SUMMARY"
if [ "$(wc -c <"$SUMMARY_TAIL")" -le 11000 ]; then
  cat "$SUMMARY_TAIL"
else
  echo "(the summary's last 11,000 characters; all of it in summary.txt)"
  tail -c 11000 "$SUMMARY_TAIL"
fi
pack_logs
rm -rf "$(dirname "$LOGS")"
echo "files: $(cd "$OUT" && ls | tr '\n' ' ')"
printf '%s\n' "${status[@]}" | grep -q "^FAIL" && exit 1
exit 0
