"""ampkit.optim's optimizers: Adam, AdamW and SGD (torch.optim's arguments and results) and LAMB (Apex's
``FusedLAMB``), each its constructor, the single-tensor step for ``differentiable=True`` and what differs from
``FusedOptimizer`` (ampkit/optim/_base.py), which owns the step itself. Their ``__module__`` is ``ampkit.optim``
(set there), where they are public.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch.optim import adam as _torch_adam
from torch.optim import sgd as _torch_sgd

from .. import _checks, _dtensor, ops
from ._base import FusedOptimizer
from ._hparams import _check_betas, _check_fused_flags, _check_tensor_hparams


class Adam(FusedOptimizer):
    """torch.optim.Adam's arguments and results, on ampkit's fused kernel, plus ``master_weights`` and the moments'
    dtypes ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (None or torch.float32, torch.bfloat16, or torch.uint8 for 8-bit
    block-wise states on parameters of 4096 elements or more)."""

    _decoupled_default = False
    _table = "Adam"
    _compat = dict(foreach=None, capturable=False, differentiable=False, fused=None)

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: Optional[bool] = None,
                 master_weights: Union[bool, str, None] = None, exp_avg_dtype: Optional[torch.dtype] = None,
                 exp_avg_sq_dtype: Optional[torch.dtype] = None, write_unscaled_grads: bool = True) -> None:
        self.write_unscaled_grads = _checks.flag(type(self).__name__, "write_unscaled_grads", write_unscaled_grads)
        _check_tensor_hparams(lr, betas, foreach, capturable)
        self._check_group(dict(lr=lr, eps=eps, betas=betas, weight_decay=weight_decay))
        _check_betas(betas, foreach, capturable)
        betas = tuple(b.squeeze() if isinstance(b, torch.Tensor) and b.dim() != 0 else b for b in betas)
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        decoupled_weight_decay=decoupled_weight_decay, master_weights=master_weights,
                        exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)
        _check_fused_flags(fused, foreach, differentiable)


    def _torch_step(self, group: dict, params: list) -> None:
        """torch.optim's own single-tensor Adam (differentiable=True), on torch's state."""
        states = [self.state[p] for p in params]
        for p, st in zip(params, states):
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        with torch.set_grad_enabled(group["differentiable"]):
            _torch_adam.adam(
                params, [p.grad for p in params], [st["exp_avg"] for st in states],
                [st["exp_avg_sq"] for st in states],
                [st["max_exp_avg_sq"] for st in states] if group["amsgrad"] else [],
                [st["step"] for st in states], foreach=False, capturable=False,
                differentiable=group["differentiable"], fused=None,
                has_complex=any(torch.is_complex(p) for p in params),
                decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=group["amsgrad"],
                beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])


class AdamW(Adam):
    """torch.optim.AdamW's arguments and results (decoupled weight decay), plus ``master_weights``."""

    _decoupled_default = True
    _table = "AdamW"
    _group_forced = dict(decoupled_weight_decay=True)  # as torch: an AdamW never runs coupled decay

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("decoupled_weight_decay", True)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class SGD(FusedOptimizer):
    """torch.optim.SGD's arguments and results, on ampkit's fused kernel, plus ``master_weights`` and the momentum
    buffer's dtype ``momentum_dtype`` (as Adam's ``exp_avg_dtype``)."""

    _kind = "sgd"
    _table = "SGD"
    _compat = dict(foreach=None, differentiable=False, fused=False)

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False, fused: Optional[bool] = None,
                 master_weights: Union[bool, str, None] = None, momentum_dtype: Optional[torch.dtype] = None,
                 write_unscaled_grads: bool = True) -> None:
        self.write_unscaled_grads = _checks.flag(type(self).__name__, "write_unscaled_grads", write_unscaled_grads)
        self._check_group(dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                                dampening=dampening))
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, master_weights=master_weights, momentum_dtype=momentum_dtype,
                        foreach=foreach,
                        differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)
        _check_fused_flags(fused, foreach, differentiable)

    def _torch_step(self, group: dict, params: list) -> None:
        """torch.optim's own single-tensor SGD (differentiable=True), on torch's state."""
        momentum = group["momentum"]
        buffers = [self.state[p].get("momentum_buffer") for p in params] if momentum != 0 else [None] * len(params)
        with torch.set_grad_enabled(group["differentiable"]):
            _torch_sgd.sgd(
                params, [p.grad for p in params], buffers, has_sparse_grad=any(p.grad.is_sparse for p in params),
                foreach=False, fused=None, weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
                dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
        if momentum != 0:
            for p, buf in zip(params, buffers):
                self.state[p]["momentum_buffer"] = buf


class LAMB(FusedOptimizer):
    """LAMB (You et al. 2020) on ampkit's fused kernel, with the arguments, defaults and semantics of Apex's
    ``FusedLAMB`` (NVIDIA's BERT recipe), plus ``master_weights``.

    Adam moments (``grad_averaging``: ``m = beta1 m + (1 - beta1) g``, else ``beta1 m + g``; ``bias_correction``),
    the update ``u = m^ / (sqrt(v^) + eps)`` (``+ weight_decay * w`` with ``adam_w_mode``, else L2 decay added to
    the grad), then per tensor ``w -= lr * ||w|| / ||u|| * u``: the trust ratio is 1 where either norm is 0, and for
    groups without weight decay unless ``use_nvlamb``. With ``max_grad_norm > 0`` every grad is first scaled by
    ``max_grad_norm / ||g||`` when the global norm ``||g||`` over every group's grads exceeds it (computed on the
    device each step; ``last_grad_norm`` holds it). The norms are summed in one fixed order: CPU and CUDA steps give
    the same bits. FP16/BF16/FP32 parameters dense in memory; grads are only read (never unscaled in place).
    DTensor parameters (FSDP2): the global norm is taken over every rank's shards, the same bits on every rank
    (NOTE [Norms of sharded grads] in ampkit/_dtensor.py), but the trust ratio is each rank's local shard's
    (``||w||`` and ``||u||`` of the shard; the kernels keep them to themselves).
    States: ``step``, ``exp_avg``, ``exp_avg_sq`` (FP32) and ``master_param`` / ``param_remainder`` /
    ``kahan_comp`` / ``sr_seed`` as AdamW's (every ``master_weights`` mode).
    """

    _kind = "lamb"
    _table = "LAMB"
    _where = "LAMB"
    _compat = dict(differentiable=False)

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: Optional[float] = 1.0, use_nvlamb: bool = False, *,
                 master_weights: Union[bool, str, None] = None) -> None:
        if amsgrad:
            raise RuntimeError("LAMB does not support the AMSGrad variant.")
        self.write_unscaled_grads = False  # LAMB only reads the grads
        self.set_grad_none = _checks.flag("LAMB", "set_grad_none", set_grad_none)
        self._norms: dict = {"grad_norm": None}  # a dict, filled in place: a traced step sets no attribute
        if max_grad_norm is None:
            max_grad_norm = 0.0  # no clipping
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb, master_weights=master_weights,
                        differentiable=False)
        self._check_group(defaults)
        super().__init__(params, defaults)


    def _global_grad_norm(self, grad_scale) -> Optional[torch.Tensor]:
        if not any(group["max_grad_norm"] > 0 for group in self.param_groups):
            return None
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if _dtensor.any_dtensor(grads):  # the norm of the whole tensors: every rank's shards (a collective)
            self._norms["grad_norm"] = _dtensor.global_grad_norm(grads, grad_scale)
        else:
            self._norms["grad_norm"] = ops.global_grad_norm(grads, grad_scale)
        return self._norms["grad_norm"]

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The global norm of the unscaled grads the last step clipped with (None before one)."""
        return self._norms["grad_norm"]

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """torch.optim's zero_grad; ``set_to_none`` defaults to the constructor's ``set_grad_none`` (Apex)."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)
