"""ampkit.optim: Adam, AdamW and SGD on ampkit's fused kernels (``torch.ops.ampkit.adamw_step_`` / ``sgd_step_``).

They take torch.optim's constructor arguments plus ``master_weights``: ``None`` (default) decides per parameter
when its state is created (on for FP16/BF16 parameters), ``True``/``False`` forces it, ``"remainder"`` (BF16
parameters) keeps the exact FP32 master as the BF16 weight plus an int16 ``state[p]["param_remainder"]`` (2 bytes
per parameter instead of 4; ties round away from zero, see ``master_from_remainder``). With a master, the FP32
copy is ``optimizer.state[p]["master_param"]``: the kernel reads the low-precision grad, unscales it in
registers, updates the master and the FP32 moments and writes the rounded weight back, in one pass. Optimizer
states are FP32 whatever the parameter's dtype (and stay FP32 through ``load_state_dict``).

``_step_supports_amp_scaling = True``: ``ampkit.GradScaler`` and ``torch.amp.GradScaler`` hand them
``grad_scale``/``found_inf`` and the skip on overflow happens on the device, without a host sync.
"""
from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Iterable, Optional

import torch

__all__ = ["Adam", "AdamW", "SGD"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _FusedOptimizer(torch.optim.Optimizer):
    _step_supports_amp_scaling = True
    #: state entries that stay FP32 whatever the parameter's dtype
    _fp32_state = ("master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "step")
    _exact_state = ("param_remainder",)  # kept bit for bit (int16) through load_state_dict

    @staticmethod
    def _master_mode(group: dict, p: torch.Tensor) -> str:
        """'master' (FP32 copy), 'remainder' (BF16 weight + int16 low half) or 'none' for this parameter."""
        mw = group.get("master_weights")
        if mw == "remainder":
            if p.dtype != torch.bfloat16:
                raise ValueError(f"master_weights='remainder' needs BFloat16 parameters, but got {p.dtype}")
            return "remainder"
        if mw is None:
            return "master" if p.dtype in _LOW_PRECISION else "none"
        return "master" if mw else "none"

    def _complete_state(self, group: dict, p: torch.Tensor, state: dict, keys: Iterable[str]) -> str:
        """Creates the state entries this step needs (a fresh state, or one loaded from torch.optim); returns
        the parameter's master mode."""
        if "step" in keys and "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for key in keys:
            if key != "step" and state.get(key) is None:
                state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        mode = self._master_mode(group, p)
        if mode == "master" and "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, copy=True)
        if mode == "remainder" and "param_remainder" not in state:
            master = state.pop("master_param", None)
            if master is None:  # the BF16 weight is the master: remainder 0
                state["param_remainder"] = torch.zeros_like(p, dtype=torch.int16,
                                                            memory_format=torch.preserve_format)
            else:  # split an FP32 master (init_master_params) into weight + remainder
                bits = master.view(torch.int32)
                low = bits & 0xFFFF
                p.detach().view(torch.int16).copy_(((bits >> 16) + (low >> 15)).to(torch.int16))
                state["param_remainder"] = low.to(torch.int16)
        return mode

    @staticmethod
    def master_from_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
        """The exact FP32 master held by a BF16 weight and its int16 remainder."""
        bits = (param.detach().view(torch.int16).to(torch.int32) << 16) + remainder.to(torch.int32)
        return bits.view(torch.float32)

    @torch.no_grad()
    def init_master_params(self) -> None:
        """Give every parameter an FP32 master copied from its current value, now. Call it while the model is
        still FP32, then cast the model to FP16/BF16 (O2, as ``ampkit.decorate`` does): the masters keep the
        unrounded weights instead of copies of the rounded ones."""
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["master_param"] = p.detach().to(torch.float32, copy=True)

    @staticmethod
    def _lr(group: dict, device: torch.device) -> tuple[float, Optional[torch.Tensor]]:
        """(float lr, device tensor lr or None). A tensor lr on the parameters' device is read on the device
        (schedules inside a captured CUDA graph); a CPU tensor lr is read on the host, which costs no sync and no
        per-step copy to the device (its value is then fixed inside a captured graph)."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            if lr.device.type == "cpu" and device.type != "cpu":
                return float(lr), None
            if lr.device == device and lr.dtype == torch.float32:
                return 0.0, lr
            return 0.0, lr.to(device=device, dtype=torch.float32)
        return float(lr), None

    def _scaling(self, device: torch.device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if grad_scale is not None:
            grad_scale = grad_scale.to(device, non_blocking=True)
        if found_inf is not None:
            found_inf = found_inf.to(device, non_blocking=True)
        return grad_scale, found_inf

    @staticmethod
    def _run_closure(closure: Optional[Callable[[], float]]):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _common_args(self, group: dict, device: torch.device, mode: str, entries: list) -> tuple[list, dict]:
        """The leading lists (params, grads, masters, remainders) and keyword arguments (lr, grad_scale, found_inf,
        lr_tensor) that both fused ops take, for one bucket."""
        grad_scale, found_inf = self._scaling(device)
        lr, lr_tensor = self._lr(group, device)
        lists = [[p for p, _ in entries], [p.grad for p, _ in entries],
                 [s["master_param"] for _, s in entries] if mode == "master" else [],
                 [s["param_remainder"] for _, s in entries] if mode == "remainder" else []]
        return lists, dict(lr=lr, grad_scale=grad_scale, found_inf=found_inf, lr_tensor=lr_tensor)

    def _buckets(self, group: dict, state_keys: tuple[str, ...]) -> dict:
        """Params with grads, grouped by (device, master mode) — one kernel launch sequence each."""
        buckets: dict = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            mode = self._complete_state(group, p, state, state_keys)
            buckets.setdefault((p.device, mode), []).append((p, state))
        return buckets

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch's base class casts floating state to each parameter's dtype; masters and moments must stay FP32.
        saved = {pid: {k: v for k, v in st.items()
                       if k in self._fp32_state + self._exact_state and torch.is_tensor(v)}
                 for pid, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(ids, params):
            for key, value in saved.get(pid, {}).items():
                dtype = torch.float32 if key in self._fp32_state else value.dtype
                self.state[p][key] = value.to(device=p.device, dtype=dtype, copy=True)


class Adam(_FusedOptimizer):
    """torch.optim.Adam's arguments and results, on ampkit's fused kernel, plus ``master_weights``."""

    _decoupled_default = False

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: Optional[bool] = None,
                 master_weights: Optional[bool] = None) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if differentiable:
            raise RuntimeError(f"{type(self).__name__} (ampkit) does not support differentiable=True")
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        decoupled_weight_decay=decoupled_weight_decay, master_weights=master_weights,
                        foreach=foreach, capturable=capturable, differentiable=False, fused=fused)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = self._run_closure(closure)
        for group in self.param_groups:
            keys = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            for (device, mode), entries in self._buckets(group, keys).items():
                lists, kwargs = self._common_args(group, device, mode, entries)
                torch.ops.ampkit.adamw_step_(
                    *lists, [s["exp_avg"] for _, s in entries], [s["exp_avg_sq"] for _, s in entries],
                    [s["max_exp_avg_sq"] for _, s in entries] if group["amsgrad"] else [],
                    [s["step"] for _, s in entries],
                    beta1=float(group["betas"][0]), beta2=float(group["betas"][1]),
                    weight_decay=float(group["weight_decay"]), eps=float(group["eps"]), amsgrad=group["amsgrad"],
                    maximize=group["maximize"], decoupled_weight_decay=group["decoupled_weight_decay"], **kwargs)
        return loss


class AdamW(Adam):
    """torch.optim.AdamW's arguments and results (decoupled weight decay), plus ``master_weights``."""

    _decoupled_default = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("decoupled_weight_decay", True)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class SGD(_FusedOptimizer):
    """torch.optim.SGD's arguments and results, on ampkit's fused kernel, plus ``master_weights``."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False, fused: Optional[bool] = None,
                 master_weights: Optional[bool] = None) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        if differentiable:
            raise RuntimeError("SGD (ampkit) does not support differentiable=True")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, master_weights=master_weights, foreach=foreach, differentiable=False,
                        fused=fused)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = self._run_closure(closure)
        for group in self.param_groups:
            momentum = float(group["momentum"])
            keys = ("step", "momentum_buffer") if momentum != 0.0 else ()
            for (device, mode), entries in self._buckets(group, keys).items():
                lists, kwargs = self._common_args(group, device, mode, entries)
                torch.ops.ampkit.sgd_step_(
                    *lists, [s["momentum_buffer"] for _, s in entries] if momentum != 0.0 else [],
                    [s["step"] for _, s in entries] if momentum != 0.0 else [],
                    momentum=momentum, dampening=float(group["dampening"]),
                    weight_decay=float(group["weight_decay"]), nesterov=group["nesterov"],
                    maximize=group["maximize"], **kwargs)
        return loss
