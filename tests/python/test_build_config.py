"""The CMake configuration's refusals, run as a user would meet them: architectures below what the installed
toolkit compiles are refused at configure time with ampkit's own message (naming the toolkit and the lowest
architecture it accepts), before CMake's compiler test would fail on them. Skipped without nvcc 13 or cmake."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if pathlib.Path("/usr/local/cuda/bin/nvcc").exists()
                                else None)


def _nvcc_release():
    if NVCC is None:
        return None
    out = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


@pytest.mark.skipif(shutil.which("cmake") is None or (_nvcc_release() or (0, 0)) < (13, 0),
                    reason="needs cmake and nvcc 13 (which dropped sm_70)")
@pytest.mark.parametrize("archs, message", [
    ("70", r"nvcc 13\.\d+ .* compiles sm_75 and newer.*lowest architecture accepted is sm_75; but\s+"
           r"AMPKIT_CUDA_ARCHS has '70'"),
    ("90;91", r"AMPKIT_CUDA_ARCHS has '91', which nvcc 13\.\d+ does not know"),
])
def test_architectures_the_toolkit_cannot_compile_are_refused_at_configure_time(tmp_path, archs, message):
    result = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(tmp_path), f"-DAMPKIT_CUDA_ARCHS={archs}", "-DAMPKIT_WITH_CUDA=ON",
         f"-DCMAKE_CUDA_COMPILER={NVCC}", "-DAMPKIT_BUILD_TESTS=OFF", "-DAMPKIT_BUILD_PYTHON=OFF"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    text = re.sub(r"\s+", " ", result.stderr)
    assert re.search(re.sub(r"\\s\+", " ", message), text), result.stderr
