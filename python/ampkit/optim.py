"""ampkit.optim: Adam, AdamW and SGD on ampkit's fused kernels (``torch.ops.ampkit.adamw_step_`` / ``sgd_step_``).

They take torch.optim's constructor arguments plus ``master_weights``: ``None`` (default) decides per parameter
when its state is created (on for FP16/BF16 parameters), ``True``/``False`` forces it, ``"remainder"`` (BF16
parameters) keeps the exact FP32 master as the BF16 weight plus an int16 ``state[p]["param_remainder"]`` (2 bytes
per parameter instead of 4; ties round away from zero, see ``master_from_remainder``; a master given by
``init_master_params`` keeps the cast BF16 weight as it is, so at exact ties that the cast rounded to even it is
held 1 ulp closer to the weight). With a master, the FP32
copy is ``optimizer.state[p]["master_param"]``: the kernel reads the low-precision grad, unscales it in
registers, updates the master and the FP32 moments and writes the rounded weight back, in one pass. Optimizer
states are FP32 whatever the parameter's dtype (and stay FP32 through ``load_state_dict``).

``_step_supports_amp_scaling = True``: ``ampkit.GradScaler`` and ``torch.amp.GradScaler`` hand them
``grad_scale``/``found_inf`` and the skip on overflow happens on the device, without a host sync. As torch's fused
optimizers, a step that unscales leaves ``p.grad`` unscaled (code that logs or clips after the step reads true
gradients); ``write_unscaled_grads=False`` leaves the grads scaled and saves that write (2 or 4 bytes per
parameter). On the CPU, FP32 steps are bit-identical to torch.optim's ``fused=True`` (AVX2/AVX-512 builds of
torch).
"""
from __future__ import annotations

import math
from itertools import chain
from typing import Any, Callable, Iterable, Optional

import torch
from torch.optim import adam as _torch_adam
from torch.optim import sgd as _torch_sgd

from . import _checks

__all__ = ["Adam", "AdamW", "SGD"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_FUSED = _LOW_PRECISION + (torch.float32,)  # the dtypes the fused kernels take


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill one block of memory without gaps or overlap (any permutation of contiguous)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True



class _FusedOptimizer(torch.optim.Optimizer):
    _step_supports_amp_scaling = True
    #: state entries that stay FP32 whatever the parameter's dtype
    _fp32_state = ("master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "step")
    _exact_state = ("param_remainder",)  # kept bit for bit (int16) through load_state_dict
    _initialised_by: tuple[str, ...] = ()  # state entries whose presence means the first step has happened
    _required_together: tuple[str, ...] = ()  # state entries that are all present or all absent
    _group_defaults: dict = {}  # torch.optim's __setstate__ defaults
    _group_forced: dict = {}

    _flags: tuple[str, ...] = ("maximize",)  # torch's bool options of this optimizer

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's add_param_group, with the group's values checked (with the defaults it will take) before
        it is added: a bad group raises and the optimizer is unchanged."""
        if isinstance(param_group, dict):
            merged = dict(self.defaults, **{k: v for k, v in param_group.items() if k != "params"})
            self._check_group(merged)
        super().add_param_group(param_group)

    def _check_group(self, group: dict) -> None:
        """torch's range checks (_check_values) plus ampkit's: master_weights and bool flags."""
        self._check_values(group)
        name = type(self).__name__
        mw = group.get("master_weights")
        if not (mw is None or isinstance(mw, bool) or mw == "remainder"):
            raise ValueError(f"{name}: master_weights must be None, True, False or 'remainder', but got {mw!r}")
        for flag in self._flags:
            value = group.get(flag, False)
            if not isinstance(value, (bool, int)) or isinstance(value, int) and value not in (0, 1):
                raise TypeError(f"{name}: {flag} must be True or False, but got {type(value).__name__} {value!r}")

    def _master_mode(self, group: dict, p: torch.Tensor) -> str:
        """'master' (FP32 copy), 'remainder' (BF16 weight + int16 low half) or 'none' for this parameter."""
        mw = group.get("master_weights")
        if mw and p.dtype not in _LOW_PRECISION + (torch.float32,):
            raise ValueError(f"{type(self).__name__}: master_weights={mw!r} needs FP16, BF16 or FP32 parameters, "
                             f"but got a {p.dtype} parameter of shape {tuple(p.shape)}")
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
            # A state loaded from torch.optim.SGD has its momentum buffer but no step: the buffer is initialised,
            # so the next step must use it (step 1), not restart it from the grad (step 0).
            started = any(state.get(k) is not None for k in self._initialised_by)
            state["step"] = torch.full((), 1.0 if started else 0.0, dtype=torch.float32, device=p.device)
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
            else:
                state["param_remainder"] = self._remainder_of(p, master)
        return mode

    @staticmethod
    @torch.no_grad()
    def _remainder_of(p: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """The int16 remainder that, with the BF16 weight p as it is, holds the FP32 master (init_master_params).

        The weight is left untouched (state is created lazily inside step(), and a step that the scaler skips
        must not change a weight). p is the master rounded to nearest-even, so master bits - (p bits << 16) fits
        an int16 except at exact ties rounded down, where it is 32768: those keep 32767, a master 1 ulp (2^-24
        relative) closer to the weight. Only a weight that is not the master's rounding at all (changed after
        init_master_params) is re-derived from the master (ties away from zero, NOTE [BF16 weight + 16-bit
        remainder])."""
        bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        high = (p.detach().view(torch.int16).to(torch.int64) & 0xFFFF) << 16
        rem = bits - high
        foreign = (rem < -32768) | (rem > 32768)
        split_weight = ((bits >> 16) + ((bits & 0xFFFF) >> 15)) & 0xFFFF
        split_rem = bits & 0xFFFF
        weight = torch.where(foreign, split_weight, high >> 16)
        rem = torch.where(foreign, split_rem, rem.clamp(max=32767))
        p.detach().view(torch.int16).copy_(weight.to(torch.int16))  # the same bits unless foreign
        return rem.to(torch.int16)

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
        lr_tensor, write_unscaled_grads) that both fused ops take, for one bucket."""
        grad_scale, found_inf = self._scaling(device)
        lr, lr_tensor = self._lr(group, device)
        lists = [[p for p, _, _ in entries], [g for _, _, g in entries],
                 [s["master_param"] for _, s, _ in entries] if mode == "master" else [],
                 [s["param_remainder"] for _, s, _ in entries] if mode == "remainder" else []]
        return lists, dict(lr=lr, grad_scale=grad_scale, found_inf=found_inf, lr_tensor=lr_tensor,
                           write_unscaled_grads=self.write_unscaled_grads)

    def _write_back_staged(self, staged: list) -> None:
        """Copies the unscaled grads from the staging copies (see _partition) back into the grads."""
        if staged and self.write_unscaled_grads and getattr(self, "grad_scale", None) is not None:
            for grad, staging in staged:
                grad.copy_(staging)

    @staticmethod
    def _takes_fused(group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether the fused kernels take this parameter; the others go through torch.optim's own single-tensor
        implementation (FP64, complex, sparse grads, differentiable=True, non-dense weights), so that every
        configuration torch.optim accepts gives torch.optim's result."""
        return (p.dtype in _FUSED and not group["differentiable"] and not grad.is_sparse and _dense(p))

    def _partition(self, group: dict, state_keys: tuple[str, ...]) -> tuple[dict, list, list]:
        """(fused buckets {(device, master mode): [(param, state, grad)]}, fallback params, staged [(grad, staging
        copy)]) of one group's params with grads. Every group is validated before any state is created (see
        _validate)."""
        buckets: dict = {}
        fallback: list = []
        staged: list = []
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if not self._takes_fused(group, p, grad):
                fallback.append(p)
                continue
            if not (grad.is_contiguous() and p.is_contiguous()) and grad.stride() != p.stride():
                # The kernels read the grad in the parameter's layout: a staging copy for such (rare) grads
                # (unscaled values go back to p.grad after the step, see _write_back_staged).
                staged.append((grad, torch.empty_like(p).copy_(grad)))
                grad = staged[-1][1]
            if not state_keys and self._master_mode(group, p) == "none" and p not in self.state:
                buckets.setdefault((p.device, "none"), []).append((p, {}, grad))  # stateless: no empty entry
                continue
            state = self.state[p]
            mode = self._complete_state(group, p, state, state_keys)
            buckets.setdefault((p.device, mode), []).append((p, state, grad))
        return buckets, fallback, staged

    def _fallback_scaling(self, params: list) -> tuple[bool, Optional[torch.Tensor]]:
        """(skip, grad_scale) for the fallback params: found_inf is read on the host (a sync, on this path only),
        and the grads are unscaled in place, as torch's fused optimizers leave them."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) != 0.0:
            return True, None
        if grad_scale is not None:
            for p in params:
                p.grad.div_(grad_scale.to(p.grad.device))
        return False, grad_scale

    def _validate(self) -> None:
        """Checks every group against the kernels' rules before anything is written (an optimizer step is
        atomic: a bad group raises before the first group is updated)."""
        for group in self.param_groups:
            self._check_group(group)
            if group.get("master_weights") is None:
                continue  # the default mode cannot be refused
            for p in group["params"]:
                if p.grad is not None:
                    self._master_mode(group, p)

    def _check_loaded_state(self, state_dict: dict[str, Any]) -> None:
        """Refuses, before anything changes, a state that cannot be right: entries for parameter ids no group
        holds, tensors of the wrong shape or kind, or a partial Adam state (a missing moment or step would silently
        restart from zeros)."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ValueError(f"{type(self).__name__}.load_state_dict: expected {len(self.param_groups)} param groups, "
                             f"but the state dict has {len(groups) if isinstance(groups, list) else groups!r}")
        params = {}
        for saved, group in zip(groups, self.param_groups):
            if len(saved.get("params", ())) != len(group["params"]):
                raise ValueError(f"{type(self).__name__}.load_state_dict: a param group of {len(group['params'])} "
                                 f"parameters gets {len(saved.get('params', ()))} from the state dict")
            params.update(zip(saved["params"], group["params"]))
        for pid, st in state_dict.get("state", {}).items():
            if pid not in params:
                raise ValueError(f"{type(self).__name__}.load_state_dict: state for parameter id {pid!r}, which no "
                                 "param group of the state dict holds")
            p = params[pid]
            if p.dtype not in _FUSED:
                continue  # torch's own format (the fallback path), checked by torch's code
            for key, value in st.items():
                if not torch.is_tensor(value):
                    continue
                shape = () if key == "step" else tuple(p.shape)
                if key != "step" and tuple(value.shape) != shape:
                    raise ValueError(f"{type(self).__name__}.load_state_dict: state[{pid!r}][{key!r}] must have the "
                                     f"parameter's shape {shape}, but has {tuple(value.shape)}")
                if key == "step" and value.numel() != 1:
                    raise ValueError(f"{type(self).__name__}.load_state_dict: state[{pid!r}]['step'] must have one "
                                     f"element, but has {value.numel()}")
                if key in self._fp32_state and not value.is_floating_point():
                    raise ValueError(f"{type(self).__name__}.load_state_dict: state[{pid!r}][{key!r}] must be a "
                                     f"floating tensor, but is {value.dtype}")
                if key in self._exact_state and value.dtype != torch.int16:
                    raise ValueError(f"{type(self).__name__}.load_state_dict: state[{pid!r}][{key!r}] must be int16, "
                                     f"but is {value.dtype}")
            present = [k for k in self._required_together if k in st]
            if present and len(present) != len(self._required_together):
                missing = [k for k in self._required_together if k not in st]
                raise ValueError(f"{type(self).__name__}.load_state_dict: state[{pid!r}] has {present} but no "
                                 f"{missing}: a partial state would silently restart from zeros")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_loaded_state(state_dict)
        # torch's base class casts floating state to each parameter's dtype; masters and moments must stay FP32.
        saved = {pid: {k: v for k, v in st.items()
                       if k in self._fp32_state + self._exact_state and torch.is_tensor(v)}
                 for pid, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(ids, params):
            if p.dtype not in _FUSED:
                continue  # torch.optim's state format (the fallback path): the base class's cast is right
            for key, value in saved.get(pid, {}).items():
                dtype = torch.float32 if key in self._fp32_state else value.dtype
                if value.dim() and value.shape == p.shape and value.stride() != p.stride():
                    # e.g. a channels_last state for a contiguous parameter: the kernels take the param's layout.
                    self.state[p][key] = torch.empty_like(p, dtype=dtype).copy_(value)
                else:
                    self.state[p][key] = value.to(device=p.device, dtype=dtype, copy=True)

    def __setstate__(self, state: dict) -> None:
        # torch.optim's defaults for keys an older torch did not save, and Python-number steps made tensors.
        state.setdefault("write_unscaled_grads", True)
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self._group_defaults.items():
                group.setdefault(key, value)
            for key, value in self._group_forced.items():
                group[key] = value
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not torch.is_tensor(st["step"]):
                    on_device = p.dtype in _FUSED
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32,
                                              device=p.device if on_device else "cpu")


def _capturable_devices() -> list[str]:
    """The device types on which torch.optim accepts capturable=True."""
    from torch.optim import optimizer as _optimizer
    getter = getattr(_optimizer, "_get_capturable_supported_devices", None)
    return getter() if getter is not None else ["cuda"]


def _check_tensor_hparams(lr, betas, foreach, capturable) -> None:
    """torch.optim.Adam's rules for tensor lr and betas, with its messages and exception types."""
    if isinstance(lr, torch.Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")


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


class Adam(_FusedOptimizer):
    """torch.optim.Adam's arguments and results, on ampkit's fused kernel, plus ``master_weights``."""

    _decoupled_default = False
    _flags = ("amsgrad", "maximize", "decoupled_weight_decay")
    _required_together = ("step", "exp_avg", "exp_avg_sq")
    _group_defaults = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                           decoupled_weight_decay=False, fused=None, master_weights=None)

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: Optional[bool] = None,
                 master_weights: Optional[bool] = None, write_unscaled_grads: bool = True) -> None:
        self.write_unscaled_grads = _checks.flag(type(self).__name__, "write_unscaled_grads", write_unscaled_grads)
        _check_tensor_hparams(lr, betas, foreach, capturable)
        self._check_values(dict(lr=lr, eps=eps, betas=betas, weight_decay=weight_decay))
        _check_betas(betas, foreach, capturable)
        betas = tuple(b.squeeze() if isinstance(b, torch.Tensor) and b.dim() != 0 else b for b in betas)
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        decoupled_weight_decay=decoupled_weight_decay, master_weights=master_weights,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)
        _check_fused_flags(fused, foreach, differentiable)

    @staticmethod
    def _check_values(group: dict) -> None:
        """torch.optim.Adam's range checks and messages, for the constructor and for every group at step()."""
        lr, eps, betas, weight_decay = group["lr"], group["eps"], group["betas"], group["weight_decay"]
        _checks.number(None, "lr", lr)
        _checks.number(None, "eps", eps)
        _checks.number(None, "weight_decay", weight_decay)
        if not isinstance(betas, (tuple, list)):
            raise TypeError(f"betas must be a pair (beta1, beta2), but got {type(betas).__name__} {betas!r}")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), but got {betas!r}")
        for i, beta in enumerate(betas):
            _checks.number(None, f"betas[{i}]", beta)
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")

    def _validate(self) -> None:
        super()._validate()
        for group in self.param_groups:
            if group["capturable"] and not torch.compiler.is_compiling():
                supported = _capturable_devices()
                for p in group["params"]:
                    if p.device.type not in supported:
                        raise AssertionError(f"If capturable=True, params and state_steps must be on supported "
                                             f"devices: {supported}.")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = self._run_closure(closure)
        self._validate()
        for group in self.param_groups:
            keys = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            buckets, fallback, staged = self._partition(group, keys)
            beta1, beta2 = (float(b) for b in group["betas"])
            for (device, mode), entries in buckets.items():
                lists, kwargs = self._common_args(group, device, mode, entries)
                torch.ops.ampkit.adamw_step_(
                    *lists, [s["exp_avg"] for _, s, _ in entries], [s["exp_avg_sq"] for _, s, _ in entries],
                    [s["max_exp_avg_sq"] for _, s, _ in entries] if group["amsgrad"] else [],
                    [s["step"] for _, s, _ in entries],
                    beta1=beta1, beta2=beta2,
                    weight_decay=float(group["weight_decay"]), eps=float(group["eps"]), amsgrad=group["amsgrad"],
                    maximize=group["maximize"], decoupled_weight_decay=group["decoupled_weight_decay"], **kwargs)
            self._write_back_staged(staged)
            if fallback:
                self._fallback_step(group, fallback)
        return loss

    def _fallback_step(self, group: dict, params: list) -> None:
        """torch.optim's own single-tensor Adam for the parameters the kernels do not take, on torch's state."""
        skip, _ = self._fallback_scaling(params)
        if skip:
            return
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
    _group_forced = dict(decoupled_weight_decay=True)  # as torch: an AdamW never runs coupled decay

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("decoupled_weight_decay", True)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class SGD(_FusedOptimizer):
    """torch.optim.SGD's arguments and results, on ampkit's fused kernel, plus ``master_weights``."""

    _initialised_by = ("momentum_buffer",)
    _flags = ("nesterov", "maximize")
    _group_defaults = dict(nesterov=False, maximize=False, foreach=None, differentiable=False, fused=False,
                           master_weights=None)

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False, fused: Optional[bool] = None,
                 master_weights: Optional[bool] = None, write_unscaled_grads: bool = True) -> None:
        self.write_unscaled_grads = _checks.flag(type(self).__name__, "write_unscaled_grads", write_unscaled_grads)
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        self._check_values(dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                                dampening=dampening))
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, master_weights=master_weights, foreach=foreach,
                        differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)
        _check_fused_flags(fused, foreach, differentiable)

    @staticmethod
    def _check_values(group: dict) -> None:
        """torch.optim.SGD's range checks and messages (NaN refused too), for the constructor and for every group
        at step()."""
        for key in ("lr", "momentum", "dampening", "weight_decay"):
            _checks.number(None, key, group[key])
        if not 0.0 <= group["lr"]:
            raise ValueError(f"Invalid learning rate: {group['lr']}")
        if not 0.0 <= group["momentum"] < math.inf:
            raise ValueError(f"Invalid momentum value: {group['momentum']}")
        if not -math.inf < group["dampening"] < math.inf:
            raise ValueError(f"Invalid dampening value: {group['dampening']}")
        if not 0.0 <= group["weight_decay"]:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = self._run_closure(closure)
        self._validate()
        for group in self.param_groups:
            momentum = float(group["momentum"])
            keys = ("step", "momentum_buffer") if momentum != 0.0 else ()
            buckets, fallback, staged = self._partition(group, keys)
            for (device, mode), entries in buckets.items():
                lists, kwargs = self._common_args(group, device, mode, entries)
                torch.ops.ampkit.sgd_step_(
                    *lists, [s["momentum_buffer"] for _, s, _ in entries] if momentum != 0.0 else [],
                    [s["step"] for _, s, _ in entries] if momentum != 0.0 else [],
                    momentum=momentum, dampening=float(group["dampening"]),
                    weight_decay=float(group["weight_decay"]), nesterov=group["nesterov"],
                    maximize=group["maximize"], **kwargs)
            self._write_back_staged(staged)
            if fallback:
                self._fallback_step(group, fallback)
        return loss

    def _fallback_step(self, group: dict, params: list) -> None:
        """torch.optim's own single-tensor SGD for the parameters the kernels do not take, on torch's state."""
        skip, _ = self._fallback_scaling(params)
        if skip:
            return
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
