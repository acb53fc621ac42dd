"""ampkit.autocast, register_autocast, op_stats and decorate (O0-O3).

``ampkit.autocast`` is ``torch.autocast`` plus per-scope op overrides (``fp32_ops`` / ``lowp_ops``) implemented by
ampkit's C++ kernels on the Autocast dispatch keys (thread-local scopes; outside an override an op behaves exactly
as under torch.autocast). ``register_autocast`` gives a custom op autocast behaviour with no Python in the
dispatch path. ``op_stats`` counts which ops ran in which dtype. ``decorate`` applies the O-level presets.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, Optional, Union

import torch
from torch import nn

from . import _checks
from ._native import _C

__all__ = ["autocast", "register_autocast", "op_stats", "decorate", "precision_support", "LEVELS"]


class autocast(torch.autocast):
    """``torch.autocast(device_type, dtype, enabled, cache_enabled)`` plus, for this scope and thread only,
    ``fp32_ops`` forced to FP32 and ``lowp_ops`` forced to the low-precision dtype. Names: ``"softmax"`` (aten),
    ``"aten::linear"``, ``"myns::myop"``; all overloads of a name. Usable as a context manager or decorator."""

    def __init__(self, device_type: str, dtype: Optional[torch.dtype] = None, enabled: bool = True,
                 cache_enabled: Optional[bool] = None, *, fp32_ops: Iterable[str] = (),
                 lowp_ops: Iterable[str] = ()) -> None:
        _checks.device_type("ampkit.autocast", device_type, "device_type")
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
            raise ValueError("ampkit.autocast: dtype must be torch.float16, torch.bfloat16 or None (the device's "
                             f"default), but got {dtype!r}")
        _checks.flag("ampkit.autocast", "enabled", enabled)
        _checks.flag("ampkit.autocast", "cache_enabled", cache_enabled, optional=True)
        for arg, ops in (("fp32_ops", fp32_ops), ("lowp_ops", lowp_ops)):
            if (isinstance(ops, str) or not isinstance(ops, Iterable)
                    or not all(isinstance(op, str) for op in ops)):
                raise TypeError(f"ampkit.autocast: {arg} must be a list of op names such as ['softmax'], but got "
                                f"{ops!r}")
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        if self._enabled and self.device == "cpu" and self.fast_dtype == torch.float16:
            _advise_once("cpu", half=True)
        self._fp32_ops = list(fp32_ops)
        self._lowp_ops = list(lowp_ops)
        self._pushes: list[bool] = []  # one entry per active entry of this instance (decorators re-enter)

    def __enter__(self):
        push = bool(self._fp32_ops or self._lowp_ops) and self._enabled
        if push:
            _C._push_autocast_overrides(self.device, self._fp32_ops, self._lowp_ops)
        self._pushes.append(push)
        try:
            return super().__enter__()
        except BaseException:
            if self._pushes.pop():
                _C._pop_autocast_overrides()
            raise

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any):
        if not self._pushes:
            raise RuntimeError("ampkit.autocast: __exit__ without a matching __enter__ (this scope was never "
                               "entered)")
        try:
            return super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            if self._pushes.pop():
                _C._pop_autocast_overrides()


def register_autocast(op: str, device_type: str, policy: str) -> None:
    """Autocast behaviour for a custom op (C++ or Python defined) on ``device_type`` ("cpu"/"cuda"): ``policy``
    ``"lowp"`` casts its floating inputs to the autocast dtype, ``"fp32"`` to FP32, ``"promote"`` to the widest
    of them. Implemented in C++: no Python runs when the op is dispatched."""
    if not isinstance(op, str):
        raise TypeError(f"register_autocast: op must be an op name such as 'myns::myop', but got {type(op).__name__}")
    _checks.device_type("register_autocast", device_type, "device_type")
    if policy not in ("lowp", "fp32", "promote"):
        raise ValueError(f"register_autocast: policy must be 'lowp', 'fp32' or 'promote', but got {policy!r}")
    _C.register_autocast(op, device_type, policy)


_DTYPES = {"Half": torch.float16, "BFloat16": torch.bfloat16, "Float": torch.float32}
_warned_slow: set = set()
_advised: set = set()


def _advise_once(device: str, half: bool) -> None:
    """Warns once per process where the autocast dtype is a poor choice for the device (FP16 on a CPU where an op
    of precision_support's probe runs 3 times or more slower than in BF16)."""
    if (device, half) not in _advised:
        _advised.add((device, half))
        advice = _C.autocast_dtype_advice(device, half)
        if advice:
            warnings.warn(f"ampkit.autocast: {advice}", stacklevel=3)


def precision_support(device: Union[str, torch.device] = "cpu") -> dict:
    """Which low-precision dtypes ``device`` runs and runs fast: ``fp16``, ``bf16``, ``fp16_fast``, ``bf16_fast``
    (CUDA: FP16 from sm_53, fast with Tensor Cores from sm_70, BF16 from sm_80; CPU: both run, through FP32 where
    torch has no kernel; a dtype is fast with its units (AVX512-BF16/AMX-BF16, AVX512-FP16/AMX-FP16) and no op of a
    small probe, conv2d and linear forward and backward timed once per process, 3 times or more slower than in
    the fastest dtype), ``lowp_dtype`` (BF16 on the CPU, FP16 on CUDA), ``fast`` (whether ``lowp_dtype`` beats
    FP32 here), ``recommended`` (``lowp_dtype`` when fast, else ``torch.float32``), ``reason`` in words and, on the CPU,
    ``measured_ms`` (``{"float32"|"bfloat16"|"float16": {"conv2d": ms, "linear": ms}}``, the probe's times)."""
    _checks.device_type("precision_support", device, expected="a CPU or CUDA device")
    info = dict(_C.precision_support(str(device)))
    info["lowp_dtype"] = _DTYPES[info["lowp_dtype"]]
    info["recommended"] = _DTYPES[info["recommended"]]
    return info


class op_stats:
    """Counts the ops run on this thread inside the ``with`` block, per dtype (outermost ops only; dtype of the
    first floating output). ``counts`` maps ``(op, dtype)`` to calls; ``summary()`` formats them. The forward
    ops only, unless ``backward=True`` (then also the ops autograd's backward nodes run on this thread)."""

    def __init__(self, backward: bool = False) -> None:
        self.backward = _checks.flag("ampkit.op_stats", "backward", backward)

    def __enter__(self) -> "op_stats":
        self.counts: dict[tuple[str, str], int] = {}
        self._guard = _C.OpStatsGuard(self.backward)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.counts = dict(self._guard.counts())
        del self._guard

    def summary(self) -> str:
        dtypes = sorted({d for _, d in self.counts})
        ops = sorted({o for o, _ in self.counts})
        width = max([len(o) for o in ops] + [2])
        lines = [f"{'op':<{width}} " + " ".join(f"{d:>9}" for d in dtypes)]
        for o in ops:
            lines.append(f"{o:<{width}} " + " ".join(f"{self.counts.get((o, d), 0):>9}" for d in dtypes))
        return "\n".join(lines)


LEVELS = {
    "O0": "FP32 everywhere (the baseline).",
    "O1": "Autocast (ampkit.autocast / AutocastGuard) + a GradScaler: matmuls and convolutions in low precision, "
          "the ops on autocast's FP32 list in FP32 (docs/autocast_ops.md: on CUDA softmax, most norms and losses; "
          "on the CPU mainly losses), weights FP32. The safe default.",
    "O2": "The model's weights in FP16/BF16, normalisation layers (and `excluded` modules) kept FP32, FP32 master "
          "weights in the optimizer (taken from the FP32 weights before the cast) + a GradScaler. Faster and "
          "leaner than O1; keep embeddings that take sparse updates in `excluded`.",
    "O3": "Everything in FP16/BF16, no masters unless the optimizer keeps them: fastest, least stable; mainly a "
          "speed baseline.",
}

_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
          nn.LocalResponseNorm)


def _to(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, dtype) for k, v in value.items()}
    return value


def decorate(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, level: str = "O2",
             dtype: Optional[torch.dtype] = None, keep_norm_fp32: bool = True,
             excluded: Iterable[Union[str, nn.Module, type]] = ()):
    """Applies an O-level preset (see ``LEVELS``) to ``model`` in place; returns the model, or
    ``(model, optimizer)`` when an optimizer is given. For O2/O3 the optimizer must be an ``ampkit.optim`` one:
    its FP32 masters are taken from the FP32 weights before the cast (as Apex O2), not from rounded copies, for
    the parameters it owns. Modules kept FP32 (norms in O2, ``excluded`` in O2/O3; names, modules or module types)
    take low-precision inputs: they compute in FP32 and hand their outputs back in ``dtype``; a module sharing a
    parameter with a kept one (a decoder tied to an excluded embedding) is kept too. ``dtype=None`` picks
    BF16 for a model on the CPU and FP16 on CUDA. A model is decorated once (before loading checkpoints)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"decorate: model must be a torch.nn.Module, but got {type(model).__name__}")
    if level not in LEVELS:
        raise ValueError(f"decorate: level must be one of {sorted(LEVELS)}, but got {level!r}")
    if dtype is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        support = precision_support(device)
        dtype = support["lowp_dtype"]
        if level in ("O2", "O3") and not support["fast"] and str(device) not in _warned_slow:
            _warned_slow.add(str(device))
            warnings.warn(f"decorate: {support['reason']}", stacklevel=2)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"decorate: dtype must be torch.float16 or torch.bfloat16, but got {dtype}")
    result = model if optimizer is None else (model, optimizer)
    if level in ("O0", "O1"):
        return result
    # ampkit.optim's optimizers say which parameters keep an FP32 master (the scaler recognises them by an attribute
    # as well): autocast does not import ampkit.optim.
    fp32_master_params = getattr(optimizer, "_fp32_master_params", None)
    if optimizer is not None and fp32_master_params is None:
        raise TypeError("decorate: O2/O3 keep FP32 masters in the optimizer; pass an ampkit.optim optimizer, "
                        f"not {type(optimizer).__name__}")
    if getattr(model, "_ampkit_decorated", None) is not None:
        raise RuntimeError(f"decorate: this model is already decorated ({model._ampkit_decorated}); decorating again "
                           "would take the optimizer's masters from rounded weights and add its hooks twice")
    named = dict(model.named_modules())
    excluded = list(excluded)
    for e in excluded:
        if isinstance(e, str):
            if e not in named:
                raise ValueError(f"decorate: excluded names {e!r}, which is not a module of the model (names come "
                                 "from model.named_modules())")
        elif isinstance(e, nn.Module):
            if not any(m is e for m in named.values()):
                raise ValueError(f"decorate: excluded holds a {type(e).__name__} that is not part of the model")
        elif not (isinstance(e, type) and issubclass(e, nn.Module)):
            raise TypeError("decorate: excluded takes module names, modules or nn.Module subclasses, but got "
                            f"{e!r}")
    owned = set()
    if optimizer is not None:
        # Groups whose master_weights keeps no FP32 master ("stochastic", "kahan"): their weights are cast alone.
        owned = {id(p) for p in fp32_master_params()}
    kept: set[nn.Module] = set()

    def keep_fp32(module: nn.Module) -> None:
        kept.update(module.modules())
        module.register_forward_pre_hook(lambda _m, args: _to(args, torch.float32))
        module.register_forward_hook(lambda _m, _args, out: _to(out, dtype))

    for name, module in named.items():
        is_norm = level == "O2" and keep_norm_fp32 and isinstance(module, _NORMS)
        is_excluded = any(e == name if isinstance(e, str) else
                          (isinstance(module, e) if isinstance(e, type) else e is module) for e in excluded)
        if is_norm or is_excluded:
            keep_fp32(module)
    # A parameter shared between modules (a decoder tied to the embedding) has one dtype: when one owner stays FP32,
    # every owner does, and computes in FP32 like it (until no kept module shares a parameter with a cast one).
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    changed = True
    while changed:
        changed = False
        for modules in owners.values():
            if any(m in kept for m in modules):
                for m in modules:
                    if m not in kept:
                        keep_fp32(m)
                        changed = True
    rounded = []
    seen: set[int] = set()  # a parameter tied between modules (a decoder sharing the embedding) is cast once
    for module in model.modules():
        if module in kept:
            continue
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.is_floating_point():
                if id(p) in owned:
                    if p.dtype in (torch.float16, torch.bfloat16):
                        rounded.append(p)
                    optimizer.state[p]["master_param"] = p.detach().to(torch.float32, copy=True)
                p.data = p.data.to(dtype)
        fp32_buffers = getattr(module, "_ampkit_fp32_buffers", ())  # FP8 scaling state (ampkit.fp8.Float8Linear)
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and name not in fp32_buffers:
                setattr(module, name, buf.to(dtype))
    if rounded:
        warnings.warn(f"decorate: {len(rounded)} parameter(s) were already FP16/BF16, so their FP32 masters are "
                      "copies of rounded weights; decorate the FP32 model to keep the unrounded values", stacklevel=2)
    model._ampkit_decorated = level
    return result
