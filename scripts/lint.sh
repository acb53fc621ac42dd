#!/usr/bin/env bash
# Checks the style without changing a file: ruff over the Python (rules in pyproject.toml) and clang-format
# (.clang-format) over every C++/CUDA source. Run by scripts/test.sh; fails on the first folder that does not pass.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

ruff check python tests bench scripts examples
git ls-files -z -- csrc kernels tests/cpp examples/cpp | grep -zE '\.(cpp|h|cu|cuh)$' | xargs -0 clang-format --dry-run -Werror
