# Shared set-up of ampkit's scripts: sourced, not run. Installs what is missing (Debian packages, the pinned
# Python requirements), then builds ampkit incrementally and installs it in editable mode, so that
# `python3 -c "import ampkit"` works from any folder afterwards.
#
# Environment: PYTHON (default python3), AMPKIT_SKIP_DEPS=1 to install nothing (offline hosts),
# AMPKIT_BUILD_DIR (default build/), AMPKIT_CUDA_ARCHS, AMPKIT_WITH_CUDA (see setup.py).

set -euo pipefail

AMPKIT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
export AMPKIT_BUILD_DIR="${AMPKIT_BUILD_DIR:-$AMPKIT_ROOT/build}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
# The compiler cache lives outside the clone, so a fresh clone rebuilds from it.
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
# Paths relative to the source tree in the cache keys, so that another clone (CI's) hits the same entries.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$AMPKIT_ROOT}" CCACHE_NOHASHDIR=1

log() { printf '\033[1m[ampkit]\033[0m %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

ensure_apt_packages() {
  local missing=()
  for pkg in cmake g++ ninja-build ccache catch2 clang-format; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    log "installing Debian packages: ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

ensure_python_requirements() {
  # Fast path: every pinned requirement already satisfied (no network).
  if "$PY" - "$AMPKIT_ROOT/requirements.txt" <<'PYEOF' 2>/dev/null; then
import sys
from importlib.metadata import version, PackageNotFoundError
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, _, pin = line.partition("==")
    name = name.split(">=")[0].strip()
    try:
        have = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if pin and have.split("+")[0] != pin.strip():
        sys.exit(1)
PYEOF
    return
  fi
  log "installing Python requirements (requirements.txt)"
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q -r "$AMPKIT_ROOT/requirements.txt"
}

ensure_deps() {
  if [ "${AMPKIT_SKIP_DEPS:-0}" = 1 ]; then
    log "AMPKIT_SKIP_DEPS=1: using the packages already installed"
    return
  fi
  ensure_apt_packages
  ensure_python_requirements
}

# Builds libampkit, ampkit._C and the Catch2 tests (CMake via setup.py) and installs ampkit in editable mode.
build_ampkit() {
  log "building ampkit (CMake in $AMPKIT_BUILD_DIR, incremental)"
  (cd "$AMPKIT_ROOT" && AMPKIT_BUILD_TESTS=1 AMPKIT_WERROR="${AMPKIT_WERROR:-1}" PIP_ROOT_USER_ACTION=ignore \
     "$PY" -m pip install -q --no-build-isolation --no-deps -e .)
}

# The same build without pip or setuptools (for hosts that lack them): CMake configure, build and install into
# python/ampkit; the caller puts python/ on PYTHONPATH.
build_ampkit_cmake_only() {
  log "building ampkit with CMake only (in $AMPKIT_BUILD_DIR)"
  local gen=()
  if [ ! -f "$AMPKIT_BUILD_DIR/CMakeCache.txt" ]; then
    command -v ninja >/dev/null && gen+=(-G Ninja)
    command -v ccache >/dev/null && gen+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  cmake -S "$AMPKIT_ROOT" -B "$AMPKIT_BUILD_DIR" "${gen[@]}" -DPython3_EXECUTABLE="$(command -v "$PY")" \
    -DAMPKIT_BUILD_TESTS=ON ${AMPKIT_CUDA_ARCHS:+-DAMPKIT_CUDA_ARCHS="$AMPKIT_CUDA_ARCHS"}
  cmake --build "$AMPKIT_BUILD_DIR"
  cmake --install "$AMPKIT_BUILD_DIR" --prefix "$AMPKIT_ROOT/python/ampkit" >/dev/null
}

# Builds the C++ examples against the installed ampkit package, as a user's program would.
build_examples() {
  local prefix
  # ampkit's package, then the torch of the same Python: ampkit's CMake config would otherwise look for the
  # torch of python3 on PATH, another release when PYTHON names a different environment.
  prefix="$(cd /tmp && "$PY" -c 'import ampkit, torch.utils; print(ampkit.cmake_prefix_path + ";" + torch.utils.cmake_prefix_path)')"
  log "building examples/cpp against the installed package ($prefix)"
  local gen=()
  if [ ! -f "$AMPKIT_BUILD_DIR/examples/CMakeCache.txt" ]; then
    command -v ninja >/dev/null && gen+=(-G Ninja)
    command -v ccache >/dev/null && gen+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  fi
  cmake -S "$AMPKIT_ROOT/examples/cpp" -B "$AMPKIT_BUILD_DIR/examples" "${gen[@]}" \
    -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$AMPKIT_BUILD_DIR/examples"
}
