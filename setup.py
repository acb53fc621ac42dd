"""Builds ampkit by driving its CMake project (CMakeLists.txt is the one build description).

The CMake install step puts libampkit, the public headers, the CMake package and the extension ampkit._C into
the package folder, so that ``ampkit.cmake_prefix_path`` points C++ programs at the same files Python loads.

Environment:
  AMPKIT_BUILD_DIR     CMake build folder. Default: build/ for the editable install (the README's commands, kept
                       between builds), else build-wheels/<python>-torch<version>-<options>/, one folder per build
                       configuration. A folder whose CMake cache names another Python or another LibTorch (a
                       previous pip run's temporary build environment, say) is reconfigured from scratch.
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
        editable = bool(self.inplace or getattr(self, "editable_mode", False))
        build_dir = _build_dir(editable)
        build_dir.mkdir(parents=True, exist_ok=True)
        _drop_stale_cache(build_dir)
        args = [
            "-S", str(ROOT), "-B", str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DTorch_DIR={_torch_cmake_dir()}",
            # Wheels store symbolic links as copies: one unversioned libampkit.so in the package.
            "-DAMPKIT_SOVERSION=OFF",
            "-DAMPKIT_PYTHON_PACKAGE=ON",
            # NOTE [Installed RUNPATH]: site-packages/torch/lib relative to site-packages/ampkit/lib; the editable
            # package (python/ampkit in the source tree) also names this torch's folder.
            "-DAMPKIT_TORCH_RUNPATH=$ORIGIN/../../torch/lib" + (f";{_torch_lib_dir()}" if editable else ""),
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


def _torch_cmake_dir() -> str:
    import torch.utils

    return str(Path(torch.utils.cmake_prefix_path) / "Torch")


def _torch_lib_dir() -> str:
    import torch

    return str(Path(torch.__file__).parent / "lib")


def _build_dir(editable: bool) -> Path:
    if "AMPKIT_BUILD_DIR" in os.environ:
        return Path(os.environ["AMPKIT_BUILD_DIR"]).resolve()
    if editable:
        return ROOT / "build"
    import torch

    options = "-".join(os.environ.get(k, "") for k in ("AMPKIT_WITH_CUDA", "AMPKIT_CUDA_ARCHS", "AMPKIT_BUILD_TESTS"))
    key = f"{sys.implementation.cache_tag}-torch{torch.__version__}-{options}"
    return ROOT / "build-wheels" / "".join(c if c.isalnum() or c in ".-_" else "_" for c in key)


def _drop_stale_cache(build_dir: Path) -> None:
    """Removes a CMake cache configured for another Python or another LibTorch (it would keep their paths)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return
    cached = {}
    for line in cache.read_text(errors="replace").splitlines():
        for key in ("Python3_EXECUTABLE", "Torch_DIR"):
            if line.startswith(key + ":"):
                cached[key] = line.split("=", 1)[1]
    current = {"Python3_EXECUTABLE": sys.executable, "Torch_DIR": _torch_cmake_dir()}
    if any(key in cached and Path(cached[key]).resolve() != Path(value).resolve() for key, value in current.items()):
        cache.unlink()
        shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)


def _torch_requirement() -> str:
    """The torch release this build links against (libtorch's C++ ABI changes between releases)."""
    try:
        import torch
    except ImportError:
        return "torch"
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"torch=={major}.{minor}.*"


setup(
    name="ampkit",
    version="0.1.0",
    description="Mixed-precision training toolkit for LibTorch and PyTorch",
    package_dir={"": "python"},
    packages=["ampkit", "ampkit.debug", "ampkit.optim", "ampkit.integrations"],
    ext_modules=[CMakeExtension("ampkit._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=[_torch_requirement()],
    zip_safe=False,
)
