"""Typed Python spellings of the ``torch.ops.ampkit`` ops (the dispatcher does the work)."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ._native import _C


def unscale_and_check_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and set ``found_inf`` to 1.0 if any element is Inf/NaN.

    Same semantics as ``torch._amp_foreach_non_finite_check_and_unscale_``; also takes BF16 and mixed dtypes
    on CUDA. ``found_inf`` is never cleared.
    """
    torch.ops.ampkit.unscale_and_check_(list(grads), found_inf, inv_scale)


def check_finite_(tensors: Sequence[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Set ``found_inf`` to 1.0 if any element of ``tensors`` is Inf or NaN; the tensors are only read."""
    torch.ops.ampkit.check_finite_(list(tensors), found_inf)


def cast_divide_(src: Sequence[torch.Tensor], out: Sequence[torch.Tensor], divisor: float) -> None:
    """``out[i] = src[i].to(out[i].dtype) / divisor`` in one pass (cast, then divide in the output's precision,
    as torch's fp16/bf16 compression hooks do: the same bits on the CPU). FP16, BF16 or FP32 on each side."""
    src, out = list(src), list(out)
    if src or out:
        torch.ops.ampkit.cast_divide_(src, out, divisor)
    elif not (math.isfinite(divisor) and divisor > 0 and 1.1754943508222875e-38 * 2.0 ** -23 <= divisor
              <= 3.4028234663852886e38):  # no tensor to dispatch on: checked here (a positive FP32 number)
        raise ValueError("ampkit::cast_divide_: divisor must be a finite number > 0 that FP32 holds, but got "
                         f"{divisor}")


def cast_unscale_and_check_(src: Sequence[torch.Tensor], out: Sequence[torch.Tensor], found_inf: torch.Tensor,
                            inv_scale: torch.Tensor) -> None:
    """``out[i].copy_(src[i])`` then :func:`unscale_and_check_` on ``out``, in one pass and with the same bits:
    ``found_inf`` becomes 1.0 if any element (in ``out``'s precision) is Inf or NaN; it is never cleared."""
    torch.ops.ampkit.cast_unscale_and_check_(list(src), list(out), found_inf, inv_scale)


GRAD_STATS_COLUMNS: int = _C.GRAD_STATS_COLUMNS
"""Columns of ``torch.ops.ampkit.grad_stats``' rows: 0 max |g| (finite), 1 L2 norm (finite), 2 Inf/NaN count, 3 zero
count, then the exponent histogram (:data:`GRAD_STATS_HIST_FIRST`)."""
GRAD_STATS_HIST_FIRST: int = _C.GRAD_STATS_HIST_FIRST
"""Column of the histogram's first bin (exponents below ``GRAD_STATS_HIST_MIN_EXP``); column
``GRAD_STATS_HIST_FIRST + 1 + e - GRAD_STATS_HIST_MIN_EXP`` counts exponent ``e`` up to 127; the last column counts
exponents above 127."""
GRAD_STATS_HIST_MIN_EXP: int = _C.GRAD_STATS_HIST_MIN_EXP


def grad_stats(grads: Sequence[torch.Tensor], inv_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Statistics of ``g * inv_scale`` for each gradient, in one pass, on the grads' device, no host sync: a dict of
    float64 tensors, one element (or row) per gradient: ``amax`` (max |x| over finite values), ``l2_norm`` (over
    finite values), ``nonfinite`` (Inf/NaN count), ``zeros``, and ``exp_hist`` (counts by ``floor(log2 |x|)``
    over BF16's whole exponent range, which holds FP16's: column 0 below ``GRAD_STATS_HIST_MIN_EXP``, column
    ``1 + e - GRAD_STATS_HIST_MIN_EXP`` exponent ``e`` up to 127, the last column above 127). The values are views
    of ``torch.ops.ampkit.grad_stats``' rows. The norm's summation order is fixed (the same bits on the CPU and
    CUDA); the other values do not depend on order."""
    grads = list(grads)
    if not grads and inv_scale is None:
        rows = torch.empty(0, GRAD_STATS_COLUMNS, dtype=torch.float64)
    else:
        rows = torch.ops.ampkit.grad_stats(grads, inv_scale)
    return _C.grad_stats_by_name(rows)


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


def grad_norm(grads: Sequence[torch.Tensor], grad_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The L2 norm of all ``grads`` together, divided by ``grad_scale`` when given: a 0-dim FP32 tensor on their
    device, no host sync (``torch.nn.utils.get_total_norm``'s value). Squares are summed in double in one fixed
    order, so the CPU and CUDA give the same bits. An empty list gives 0."""
    grads = list(grads)
    if not grads and grad_scale is None:
        return torch.zeros((), dtype=torch.float32)
    return torch.ops.ampkit.grad_norm(grads, grad_scale)


def global_grad_norm(grads: Sequence[torch.Tensor], grad_scale: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`grad_norm` over grads on any number of devices: each device's norm, combined in float64 on the first
    grad's device (0-dim FP32, no host sync). An empty list gives 0."""
    grads = list(grads)
    if not grads and grad_scale is None:
        return torch.zeros((), dtype=torch.float32)
    return torch.ops.ampkit.global_grad_norm(grads, grad_scale)


def lamb_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               master_params: Sequence[torch.Tensor], param_remainders: Sequence[torch.Tensor],
               exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
               state_steps: Sequence[torch.Tensor], *, lr: float, beta1: float, beta2: float, weight_decay: float,
               eps: float, bias_correction: bool = True, adam_w_mode: bool = True, grad_averaging: bool = True,
               use_nvlamb: bool = False, max_grad_norm: float = 0.0, grad_norm: torch.Tensor | None = None,
               grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
               lr_tensor: torch.Tensor | None = None) -> None:
    """One fused LAMB step (Apex ``FusedLAMB``'s semantics): Adam moments, the update ``u = m^/(sqrt(v^)+eps)``
    (``+ weight_decay * w`` in ``adam_w_mode``), then per tensor ``w -= lr * ||w||/||u|| * u`` (trust ratio 1 where
    either norm is 0, and for tensors without weight decay unless ``use_nvlamb``). Grads are only read: divided by
    ``grad_scale`` and, when ``grad_norm`` (see :func:`grad_norm`) exceeds ``max_grad_norm > 0``, scaled to that
    norm. Masters, remainders, ``found_inf`` and ``lr_tensor`` as ``adamw_step_``."""
    torch.ops.ampkit.lamb_step_(
        list(params), list(grads), list(master_params), list(param_remainders), list(exp_avgs), list(exp_avg_sqs),
        list(state_steps), lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        bias_correction=bias_correction, adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
        use_nvlamb=use_nvlamb, max_grad_norm=max_grad_norm, grad_norm=grad_norm, grad_scale=grad_scale,
        found_inf=found_inf, lr_tensor=lr_tensor)
