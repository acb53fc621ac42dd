"""torch.optim's constructor rules for ampkit.optim's optimizers, with torch's messages and exception types: tensor
``lr`` and ``betas``, and the ``fused``/``foreach``/``differentiable`` combinations. (A param group's value checks
are ``_checks.optimizer_group``, from the option table, with the ranges in the C++ core.)
"""
from __future__ import annotations

import torch


def _check_tensor_hparams(lr, betas, foreach, capturable) -> None:
    """torch.optim.Adam's rule for a tensor lr with foreach, with its message (its size: the C++ core's check)."""
    if isinstance(lr, torch.Tensor) and foreach and not capturable:
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")


def _check_betas(betas, foreach, capturable) -> None:
    if not ((isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor))):
        raise ValueError("betas must be either both floats or both Tensors")
    for i in (0, 1):
        if isinstance(betas[i], torch.Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
            if betas[i].numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")


def _check_fused_flags(fused, foreach, differentiable) -> None:
    if fused:
        if differentiable:
            raise RuntimeError("`fused` does not support `differentiable`")
        if foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
