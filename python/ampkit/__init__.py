"""ampkit: mixed-precision training for LibTorch and PyTorch.

Importing ampkit loads its C++ core, which registers the ``torch.ops.ampkit`` ops (CPU, CUDA and Meta kernels).
This module only names the public API: ``ampkit._native`` checks the torch version and loads the native library,
and every module takes ``_C`` from there.
"""
from __future__ import annotations

import torch as _torch

from . import debug, fp8, monitor, optim
from ._native import _C as _C  # ampkit._C, loaded by _native after the torch version check
from ._native import build_info, cmake_prefix_path
from .autocast import LEVELS, autocast, decorate, op_stats, precision_support, register_autocast
from .grad_scaler import GradScaler, OptState, load_scaler_state, save_scaler_state
from .ops import (
    GRAD_STATS_COLUMNS,
    GRAD_STATS_HIST_FIRST,
    GRAD_STATS_HIST_MIN_EXP,
    cast_divide_,
    cast_unscale_and_check_,
    check_finite_,
    grad_norm,
    grad_stats,
    lamb_step_,
    unscale_and_check_,
    update_scale_,
)

if _torch.distributed.is_available():
    from . import distributed  # DDP compression hooks the scaler sees

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
