"""Typed Python spellings of the ``torch.ops.ampkit`` ops (the dispatcher does the work)."""
from __future__ import annotations

from typing import Sequence

import torch


def unscale_and_check_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and set ``found_inf`` to 1.0 if any element is Inf/NaN.

    Same semantics as ``torch._amp_foreach_non_finite_check_and_unscale_``; also takes BF16 and mixed dtypes
    on CUDA. ``found_inf`` is never cleared.
    """
    torch.ops.ampkit.unscale_and_check_(list(grads), found_inf, inv_scale)


def check_finite_(tensors: Sequence[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Set ``found_inf`` to 1.0 if any element of ``tensors`` is Inf or NaN; the tensors are only read."""
    torch.ops.ampkit.check_finite_(list(tensors), found_inf)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """One dynamic loss-scale step on the device, identical to ``torch._amp_update_scale_`` (returns None)."""
    torch.ops.ampkit.update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
