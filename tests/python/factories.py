"""Seeded random inputs shared by the optimizer tests: parameters of several shapes (empty and one-element ones
included) and each step's grads, never all zero. The same seed gives the same tensors on every device."""
from __future__ import annotations

import torch

PARAM_SHAPES = [(64, 33), (33,), (7, 5, 3), (1,), (0,), (4097,)]


def make_params(device="cpu", dtype=torch.float32, seed=0, shapes=PARAM_SHAPES) -> list[torch.Tensor]:
    """Leaf tensors that require grad, one per shape, drawn in FP32 and cast to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in shapes]


def grads_for(params, step, dtype=None, first_seed=1000) -> list[torch.Tensor]:
    """Step `step`'s grads for `params` (their shapes, devices and, unless `dtype` is given, dtypes)."""
    g = torch.Generator().manual_seed(first_seed + step)
    return [torch.randn(p.shape, generator=g).to(p.device, dtype or p.dtype) for p in params]
