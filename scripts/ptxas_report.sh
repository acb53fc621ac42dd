#!/bin/bash
# Registers, stack, spills and occupancy (512-thread blocks) of every kernel of ampkit's CUDA sources, from
# ptxas -v for one architecture (default sm_90), with the build's flags (-O3 --fmad=false). Needs nvcc, no GPU.
# Usage: scripts/ptxas_report.sh [--check] [sm_XX]   (bench/results/*_ptxas_*.txt are its output)
# --check: exit 1, naming them, if any kernel spills registers (a ctest runs this for sm_90).
set -euo pipefail
check=0
if [ "${1:-}" = "--check" ]; then
  check=1
  shift
fi
arch=${1:-sm_90}
root=$(cd "$(dirname "$0")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for f in "$root"/kernels/cuda/*.cu; do
  "$nvcc" --expt-relaxed-constexpr --expt-extended-lambda -O3 -DNDEBUG --fmad=false -std=c++17 -arch="$arch" \
    -Xptxas -v -c "$f" -o "$tmp/k.o" 2>&1
done | CHECK=$check python3 -c '
import os, re, subprocess, sys
name = None
spilling = []
stack = spill_st = spill_ld = "0"
for line in sys.stdin.read().splitlines():
    m = re.search(r"Compiling entry function .(\S+). for", line)
    if m:
        name = m.group(1)
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m:
        stack, spill_st, spill_ld = m.groups()
        continue
    m = re.search(r"Used (\d+) registers", line)
    if m and name:
        regs = int(m.group(1))
        blocks = min(4, 65536 // (max(regs, 1) * 512))
        pretty = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()
        for ns in ("ampkit::kernels::cuda::", "ampkit::kernels::(anonymous namespace)::", "ampkit::kernels::"):
            pretty = pretty.replace(ns, "")
        print(f"{regs:4d} regs  stack {int(stack):3d} B  spills {spill_st}/{spill_ld}  "
              f"blocks/SM(512 thr) {blocks}  occupancy {blocks * 25}%  {pretty[:110]}")
        if spill_st != "0" or spill_ld != "0":
            spilling.append(f"{pretty[:110]} ({spill_st} B spill stores, {spill_ld} B spill loads)")
if not name:
    sys.exit("scripts/ptxas_report.sh: ptxas reported no kernel (did nvcc fail?)")
if os.environ.get("CHECK") == "1" and spilling:
    sys.exit("scripts/ptxas_report.sh --check: kernels that spill registers:\n  " + "\n  ".join(spilling))
'
