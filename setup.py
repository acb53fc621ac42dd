"""Builds ampkit by driving its CMake project (CMakeLists.txt is the one build description).

The CMake install step puts libampkit, the public headers, the CMake package and the extension ampkit._C into
the package folder, so that ``ampkit.cmake_prefix_path`` points C++ programs at the same files Python loads.

Environment:
  AMPKIT_BUILD_DIR     CMake build folder (default: build/ in the source tree; kept between builds).
  AMPKIT_BUILD_TESTS   1 to build the Catch2 tests too (scripts/test.sh sets it).
  AMPKIT_CUDA_ARCHS    CUDA architectures, e.g. "90" (default "80;90"; PTX for the last).
  AMPKIT_WITH_CUDA     ON, OFF or AUTO (default: AUTO, i.e. when nvcc is found).
  AMPKIT_WERROR        1 to treat warnings in ampkit's own sources as errors (scripts/test.sh sets it).
  CMAKE_BUILD_PARALLEL_LEVEL  build jobs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        pkg_dirs = [Path(self.get_ext_fullpath(ext.name)).resolve().parent]
        if self.inplace or getattr(self, "editable_mode", False):
            # Editable install: Python imports the source folder itself, so it gets the files too.
            pkg_dirs.append(ROOT / "python" / "ampkit")
        build_dir = Path(os.environ.get("AMPKIT_BUILD_DIR", ROOT / "build")).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "-S", str(ROOT), "-B", str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DAMPKIT_BUILD_TESTS={'ON' if os.environ.get('AMPKIT_BUILD_TESTS') == '1' else 'OFF'}",
            f"-DAMPKIT_WITH_CUDA={os.environ.get('AMPKIT_WITH_CUDA', 'AUTO')}",
        ]
        args.append(f"-DAMPKIT_WERROR={'ON' if os.environ.get('AMPKIT_WERROR') == '1' else 'OFF'}")
        if "AMPKIT_CUDA_ARCHS" in os.environ:
            args.append(f"-DAMPKIT_CUDA_ARCHS={os.environ['AMPKIT_CUDA_ARCHS']}")
        if not (build_dir / "CMakeCache.txt").exists():
            if shutil.which("ninja"):
                args += ["-G", "Ninja"]
            if shutil.which("ccache"):
                args += ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache", "-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"]
        subprocess.run(["cmake", *args], check=True)
        subprocess.run(["cmake", "--build", str(build_dir)], check=True)
        for pkg_dir in pkg_dirs:
            subprocess.run(["cmake", "--install", str(build_dir), "--prefix", str(pkg_dir)], check=True,
                           stdout=subprocess.DEVNULL)


setup(
    name="ampkit",
    version="0.1.0",
    description="Mixed-precision training toolkit for LibTorch and PyTorch",
    package_dir={"": "python"},
    packages=["ampkit"],
    ext_modules=[CMakeExtension("ampkit._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=["torch>=2.11"],
    zip_safe=False,
)
