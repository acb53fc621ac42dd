"""The native library: the torch version check, then the extension ``ampkit._C`` (libampkit, which registers the
``torch.ops.ampkit`` ops), and the check of the GPUs against the build's CUDA architectures. Every module of the
package takes ``_C`` from here, so that nothing loads it before the version check.
"""
from __future__ import annotations

import os

import torch  # loads libtorch before the extension that links it

from ._build_config import TORCH_VERSION as BUILT_TORCH

#: The folder to pass to CMake as ``CMAKE_PREFIX_PATH`` so that ``find_package(ampkit)`` finds this installation.
cmake_prefix_path: str = os.path.dirname(os.path.abspath(__file__))


def check_torch_version(running: str, built: str) -> None:
    """libtorch's C++ ABI changes between releases: ampkit runs only with the torch release it was built for."""
    if running.split("+")[0] != built.split("+")[0]:
        raise ImportError(
            f"ampkit was built against torch {built}, but torch {running} is running; libtorch's C++ ABI differs "
            f"between releases. Rebuild ampkit against this torch (pip install --no-build-isolation . in its source "
            f"tree, or scripts/test.sh), or install torch=={built.split('+')[0]}.")


check_torch_version(torch.__version__, BUILT_TORCH)

# After the version check: the extension below needs the torch it was built against.
from . import _C  # noqa: E402


def build_info() -> dict:
    """What this build contains: ``cuda_compiled``, ``cuda_archs``, ``cpu_isa``, ``torch_version``."""
    return dict(_C.build_info())


def check_cuda_devices() -> None:
    """Raises unless every visible GPU is covered by the CUDA architectures this build compiled."""
    info = _C.build_info()
    if not info["cuda_compiled"]:
        return
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        if not _C.cuda_arch_supported(major, minor):
            raise RuntimeError(
                f"ampkit: GPU {index} ({torch.cuda.get_device_name(index)}, compute capability {major}.{minor}) "
                f"is not covered by the CUDA architectures this ampkit was built for ({info['cuda_archs']}; PTX "
                f"for the last). Rebuild with AMPKIT_CUDA_ARCHS including {major}{minor}.")


# Checked when CUDA initialises (at once if it already has), so importing ampkit never initialises CUDA itself
# (which would break fork-based workers) and a GPU no compiled architecture covers fails at its first use with
# this message, not with "no kernel image" deep inside an op.
torch.cuda._lazy_call(check_cuda_devices)
