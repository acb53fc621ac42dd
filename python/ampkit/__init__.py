"""ampkit: mixed-precision training for LibTorch and PyTorch.

Importing ampkit loads its C++ core, which registers the ``torch.ops.ampkit`` ops (CPU, CUDA and Meta kernels).
"""
from __future__ import annotations

import os as _os

import torch as _torch  # noqa: F401  (loads libtorch before the extension that links it)

from ._build_config import TORCH_VERSION as _BUILT_TORCH


def _check_torch_version(running: str, built: str) -> None:
    """libtorch's C++ ABI changes between releases: ampkit runs only with the torch release it was built for."""
    if running.split("+")[0] != built.split("+")[0]:
        raise ImportError(
            f"ampkit was built against torch {built}, but torch {running} is running; libtorch's C++ ABI differs "
            f"between releases. Rebuild ampkit against this torch (pip install --no-build-isolation . in its source "
            f"tree, or scripts/test.sh), or install torch=={built.split('+')[0]}.")


_check_torch_version(_torch.__version__, _BUILT_TORCH)

# After the version check: the extension below needs the torch it was built against.
from . import _C, debug, fp8, monitor, optim  # noqa: E402, I001
from .autocast import LEVELS, autocast, decorate, op_stats, precision_support, register_autocast  # noqa: E402
from .grad_scaler import GradScaler, OptState, load_scaler_state, save_scaler_state  # noqa: E402
from .ops import (  # noqa: E402
    GRAD_STATS_COLUMNS, GRAD_STATS_HIST_FIRST, GRAD_STATS_HIST_MIN_EXP, cast_divide_, cast_unscale_and_check_,
    check_finite_, grad_norm, grad_stats, lamb_step_, unscale_and_check_, update_scale_)

if _torch.distributed.is_available():
    from . import distributed  # noqa: E402  (DDP compression hooks the scaler sees)

#: Folder to pass to CMake as ``CMAKE_PREFIX_PATH`` so that ``find_package(ampkit)`` finds this installation.
cmake_prefix_path: str = _os.path.dirname(_os.path.abspath(__file__))


def build_info() -> dict:
    """What this build contains: ``cuda_compiled``, ``cuda_archs``, ``cpu_isa``, ``torch_version``."""
    return dict(_C.build_info())


def _check_cuda_devices() -> None:
    """Raises unless every visible GPU is covered by the CUDA architectures this build compiled."""
    info = _C.build_info()
    if not info["cuda_compiled"]:
        return
    for index in range(_torch.cuda.device_count()):
        major, minor = _torch.cuda.get_device_capability(index)
        if not _C.cuda_arch_supported(major, minor):
            raise RuntimeError(
                f"ampkit: GPU {index} ({_torch.cuda.get_device_name(index)}, compute capability {major}.{minor}) "
                f"is not covered by the CUDA architectures this ampkit was built for ({info['cuda_archs']}; PTX "
                f"for the last). Rebuild with AMPKIT_CUDA_ARCHS including {major}{minor}.")


# Checked when CUDA initialises (at once if it already has), so importing ampkit never initialises CUDA itself
# (which would break fork-based workers) and a GPU no compiled architecture covers fails at its first use with
# this message, not with "no kernel image" deep inside an op.
_torch.cuda._lazy_call(_check_cuda_devices)


__all__ = [
    "GradScaler",
    "LEVELS",
    "autocast",
    "decorate",
    "op_stats",
    "precision_support",
    "register_autocast",
    "OptState",
    "build_info",
    "debug",
    "fp8",
    "load_scaler_state",
    "optim",
    "save_scaler_state",
    "check_finite_",
    "cmake_prefix_path",
    "distributed",
    "monitor",
    "unscale_and_check_",
    "cast_divide_",
    "cast_unscale_and_check_",
    "grad_stats",
    "grad_norm",
    "lamb_step_",
    "GRAD_STATS_COLUMNS",
    "GRAD_STATS_HIST_FIRST",
    "GRAD_STATS_HIST_MIN_EXP",
    "update_scale_",
]
