#!/usr/bin/env bash
# The ways a user installs ampkit, each checked as that user would: a wheel (pip wheel --no-build-isolation)
# installed into a fresh virtualenv that reuses the system torch, then a C++ program built with
# find_package(ampkit) and `import ampkit` from another folder, neither seeing this source tree; and a CMake-only,
# CPU-only build with AMPKIT_BUILD_PYTHON=OFF installed into a prefix and consumed the same way. Checks that the
# installed files name no path of this machine's build, that the wheel pins the torch release it was built
# against and holds one libampkit, and that the CPU-only build includes no CUDA header.
# Usage: tests/install/check_install_paths.sh   (run by scripts/test.sh; reuses the ccache of the main build)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d /tmp/ampkit-install.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}" CCACHE_NOHASHDIR=1
log() { printf '\033[1m[install-check]\033[0m %s\n' "$*" >&2; }
fail() { printf '[install-check] FAILED: %s\n' "$*" >&2; exit 1; }
gen=()
command -v ninja >/dev/null && gen+=(-G Ninja)
command -v ccache >/dev/null && gen+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
TORCH_MM="${TORCH_VERSION%.*}"

# No path of the build (source tree, build folders, pip's temporary environments) in installed text files or in
# RUNPATHs, except the LibTorch a CMake-only install was told to use ($2, may be empty).
check_no_build_paths() {
  local dir="$1" allowed="${2:-}"
  local hits
  hits="$(grep -rIl -e "$ROOT" -e "/tmp/pip-" "$dir" || true)"
  [ -z "$hits" ] || fail "build paths in installed files: $hits"
  while IFS= read -r so; do
    local runpath
    runpath="$(readelf -d "$so" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')"
    IFS=: read -ra entries <<<"$runpath"
    for e in "${entries[@]}"; do
      case "$e" in
        '$ORIGIN'*) ;;
        "$allowed") [ -n "$allowed" ] || fail "$so: RUNPATH entry $e" ;;
        *) fail "$so: RUNPATH entry $e is not relative to the installed files" ;;
      esac
    done
  done < <(find "$dir" -name '*.so*' -type f)
}

build_consumer() {  # prefix-path build-dir [consumer args]
  local prefix="$1" build="$2"
  shift 2
  (cd "$WORK" && cmake -S "$ROOT/tests/install/consumer" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
     -DCMAKE_PREFIX_PATH="$prefix" >"$build.log" 2>&1 && cmake --build "$build" >>"$build.log" 2>&1) \
    || { cat "$build.log" >&2; return 1; }
  (cd "$WORK" && "$build/consumer" "$@")
}

# ---- 1. the wheel, in a fresh virtualenv ---------------------------------------------------------------------------
log "pip wheel --no-build-isolation (build folder keyed by configuration, ccache)"
(cd "$ROOT" && PIP_ROOT_USER_ACTION=ignore "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/wheels" .) \
  || fail "pip wheel"
WHEEL="$(ls "$WORK"/wheels/ampkit-*.whl)"
"$PY" - "$WHEEL" "$TORCH_MM" <<'PYEOF' || fail "wheel contents"
import sys, zipfile
wheel, torch_mm = sys.argv[1], sys.argv[2]
z = zipfile.ZipFile(wheel)
names = z.namelist()
libs = [n for n in names if "/lib/libampkit" in n or n.startswith("ampkit/lib/libampkit")]
assert libs == ["ampkit/lib/libampkit.so"], f"expected one ampkit/lib/libampkit.so, found {libs}"
meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
requires = [l for l in meta.splitlines() if l.startswith("Requires-Dist: torch")]
assert requires == [f"Requires-Dist: torch=={torch_mm}.*"], f"torch requirement: {requires}"
print(f"[install-check] wheel: one libampkit.so, Requires-Dist torch=={torch_mm}.*", file=sys.stderr)
PYEOF
log "virtualenv --system-site-packages (the system torch), install the wheel"
"$PY" -m venv --system-site-packages "$WORK/venv"
VPY="$WORK/venv/bin/python"
PIP_ROOT_USER_ACTION=ignore "$VPY" -m pip install -q --no-deps "$WHEEL" || fail "pip install wheel"
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
check_no_build_paths "$SITE/ampkit"
(cd "$WORK" && "$VPY" - "$SITE" <<'PYEOF') || fail "import ampkit from the virtualenv"
import sys, torch, ampkit
assert ampkit.__file__.startswith(sys.argv[1]), f"imported {ampkit.__file__}, not the installed wheel"
p = torch.zeros(4, requires_grad=True)
opt = ampkit.optim.AdamW([p], lr=0.1)
p.grad = torch.ones(4)
opt.step()
assert torch.all(p < 0)
print(f"[install-check] import ampkit from {ampkit.__file__}: ok", file=sys.stderr)
PYEOF
PREFIX_PY="$(cd "$WORK" && "$VPY" -c 'import ampkit; print(ampkit.cmake_prefix_path)')"
log "C++ consumer: find_package(ampkit) from the wheel ($PREFIX_PY)"
EXPECT=()
"$VPY" -c 'import ampkit, sys; sys.exit(0 if ampkit.build_info()["cuda_compiled"] else 1)' && EXPECT=(--expect-cuda)
build_consumer "$PREFIX_PY" "$WORK/consumer-wheel" "${EXPECT[@]}" || fail "consumer of the wheel"

# ---- 2. CMake only, CPU only, no Python extension ----------------------------------------------------------------
TORCH_DIR="$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')/Torch"
TORCH_LIB="$("$PY" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
log "CMake-only build: AMPKIT_BUILD_PYTHON=OFF AMPKIT_WITH_CUDA=OFF, install into a prefix"
cmake -S "$ROOT" -B "$WORK/cmake-only" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DAMPKIT_BUILD_PYTHON=OFF \
  -DAMPKIT_WITH_CUDA=OFF -DAMPKIT_BUILD_TESTS=OFF -DAMPKIT_WERROR=ON -DTorch_DIR="$TORCH_DIR" \
  >"$WORK/cmake-only.log" 2>&1 || { cat "$WORK/cmake-only.log" >&2; fail "CMake-only configure"; }
cmake --build "$WORK/cmake-only" >>"$WORK/cmake-only.log" 2>&1 || { cat "$WORK/cmake-only.log" >&2; fail "CMake-only build"; }
cmake --install "$WORK/cmake-only" --prefix "$WORK/prefix" >/dev/null
grep -q "AMPKIT_BUILD_PYTHON:BOOL=OFF" "$WORK/cmake-only/CMakeCache.txt"
! grep -q "^Python3_INCLUDE_DIR:" "$WORK/cmake-only/CMakeCache.txt" || fail "CMake-only build looked for Python headers"
if command -v ninja >/dev/null; then
  cuda_headers="$(ninja -C "$WORK/cmake-only" -t deps | grep -E '(^|/)(cuda|cuda_runtime|cuda_runtime_api|cuda_fp16|cuda_bf16)\.h$|/cuda[^/]*/(include|targets)/' | sort -u || true)"
  [ -z "$cuda_headers" ] || fail "the CPU-only build includes CUDA headers: $cuda_headers"
  log "CPU-only build: no CUDA header among the dependencies"
fi
check_no_build_paths "$WORK/prefix" "$TORCH_LIB"
log "C++ consumer: find_package(ampkit) from the prefix"
build_consumer "$WORK/prefix" "$WORK/consumer-prefix" || fail "consumer of the CMake-only install"
log "all install paths work"
