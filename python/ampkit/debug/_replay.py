"""The driver of ampkit.debug.replay: the argument checks (``_check``, ``_check_loss``), the float64 copy of the
model, the two runs (reference, then low precision) with the gradients taken by ``torch.autograd.grad``, the
restoring of buffers and RNG states (NOTE [Replay leaves no trace]), and the assembly of the ``ReplayReport``.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import nn

from .. import _checks
from ..autocast import autocast as _autocast
from ..autocast import precision_support
from ._report import HEALTHY_EPS, ReplayReport, _rank_ops, _rows, _suggest
from ._trace import _LOWP, _cast, _compare, _floats, _Mode, _Run, _tensors

_WHERE = "ampkit.debug.replay"


def _check(model, batch, loss_fn, dtype, device_type, scaler, fp32_ops):
    if not isinstance(model, nn.Module):
        raise TypeError(f"{_WHERE}: model must be a torch.nn.Module, but got {type(model).__name__}")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = f"a {type(batch).__name__} of length {len(batch)}" if isinstance(batch, (tuple, list)) else \
            type(batch).__name__
        raise TypeError(f"{_WHERE}: batch must be an (inputs, targets) pair, but got {got}")
    if not callable(loss_fn):
        raise TypeError(f"{_WHERE}: loss_fn must be callable as loss_fn(output, targets), but got "
                        f"{type(loss_fn).__name__}")
    if dtype is not None and dtype not in _LOWP:
        raise ValueError(f"{_WHERE}: dtype must be torch.float16, torch.bfloat16 or None, but got {dtype!r}")
    if device_type is not None:
        device_type = _checks.device_type(_WHERE, device_type, "device_type")
    if scaler is not None and not (callable(getattr(scaler, "get_scale", None))
                                   and callable(getattr(scaler, "is_enabled", None))):
        raise TypeError(f"{_WHERE}: scaler must be an ampkit.GradScaler, a torch.amp.GradScaler or None, but got "
                        f"{type(scaler).__name__}")
    ops = list(fp32_ops) if isinstance(fp32_ops, Iterable) and not isinstance(fp32_ops, str) else None
    if ops is None or not all(isinstance(op, str) for op in ops):
        raise TypeError(f"{_WHERE}: fp32_ops must be a list of op names such as ['softmax'], but got {fp32_ops!r}")
    fp32_ops = ops
    params = [p for p in model.parameters() if p.is_floating_point()]
    lowp = sorted({str(p.dtype) for p in params if p.dtype in _LOWP})
    decorated = getattr(model, "_ampkit_decorated", None) in ("O2", "O3") or bool(lowp)
    if decorated:
        model_dtype = next(p.dtype for p in params if p.dtype in _LOWP) if lowp else dtype
        if len(lowp) > 1:
            raise ValueError(f"{_WHERE}: model must hold one low-precision dtype, but its parameters are {lowp}")
        if dtype is not None and model_dtype is not None and dtype != model_dtype:
            raise ValueError(f"{_WHERE}: dtype must match the model's low-precision weights ({model_dtype}), but got "
                             f"{dtype}")
        if fp32_ops:
            raise ValueError(f"{_WHERE}: fp32_ops applies to autocast runs, but this model is decorated "
                             f"({lowp[0] if lowp else 'O2/O3'} weights) and runs without autocast; name modules in "
                             "decorate(excluded=...) instead")
        dtype = model_dtype
    tensors = list(model.parameters()) + list(model.buffers()) + _tensors(batch)
    devices = sorted({t.device.type for t in tensors})
    if device_type is None:
        device_type = "cuda" if "cuda" in devices else "cpu"
    if dtype is None:
        dtype = precision_support(device_type)["lowp_dtype"]
    return device_type, dtype, decorated, fp32_ops


def _owners(model: nn.Module) -> dict[int, str]:
    owners: dict[int, str] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), name)
    return owners


# NOTE [Replay leaves no trace]
# replay must leave a training loop exactly where it was, bit for bit. The float64 reference runs on a deep copy of
# the model (the user's parameters are never converted); gradients come from torch.autograd.grad, so no .grad is
# written or created and no post-accumulate hook fires; the scaler is only read (get_scale); buffers changed by the
# low-precision forward (BatchNorm statistics) are copied back into the same tensor objects; the CPU and CUDA RNG
# states are set before each run (both runs draw alike) and restored at the end; every module hook is removed and
# the tensor hooks go with the graphs; autocast is entered and left by context managers. Everything is restored in
# a finally block, so a model or loss that raises leaves no trace either.
def replay(model: nn.Module, batch: Any, loss_fn: Callable, *, dtype: Optional[torch.dtype] = None,
           device_type: Optional[str] = None, scaler: Any = None, fp32_ops: Iterable[str] = ()) -> ReplayReport:
    """Re-runs one step of ``model`` on ``batch`` in low precision and as a float64 reference, and reports per
    module where the low-precision run goes wrong; everything is left as it was (NOTE [Replay leaves no trace]).

    Args:
        model: the ``nn.Module`` as trained: FP32 weights (run under ``ampkit.autocast``) or decorated at O2/O3
            (FP16/BF16 weights, run as it is, floating inputs cast to its dtype).
        batch: ``(inputs, targets)``; the model is called as ``model(inputs)`` (``model(*inputs)`` for a tuple).
        loss_fn: ``loss_fn(output, targets)`` returning the scalar loss.
        dtype: ``torch.float16`` or ``torch.bfloat16``; None: the decorated model's dtype, else the device's
            (BF16 on the CPU, FP16 on CUDA).
        device_type: ``"cpu"`` or ``"cuda"`` for autocast; None: where the model lives.
        scaler: an ``ampkit.GradScaler`` (or ``torch.amp.GradScaler``): the loss is multiplied by its current scale
            before the backward, as in training (it is only read).
        fp32_ops: ops forced to FP32 in the low-precision autocast run (to check that an override fixes it).
    """
    device_type, dtype, decorated, fp32_ops = _check(model, batch, loss_fn, dtype, device_type, scaler, fp32_ops)
    scale = 1.0
    if scaler is not None and scaler.is_enabled():
        scale = float(scaler.get_scale())
    try:
        reference_model = copy.deepcopy(model)
    except Exception as e:  # noqa: BLE001  (any failure to copy is reported the same way)
        raise RuntimeError(f"{_WHERE}: could not copy the model for the float64 reference "
                           f"(copy.deepcopy raised {type(e).__name__}: {e})") from e
    reference_model.to(torch.float64)
    for p in reference_model.parameters():
        p.grad = None   # the copy's own; the model's stay as they are
    buffers = [(m, n, b, b.detach().clone()) for m in model.modules() for n, b in m.named_buffers(recurse=False)
               if b is not None]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def reset_rng() -> None:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

    inputs, targets = batch
    ref_run = low_run = None
    try:
        # the float64 reference
        reset_rng()
        ref_run = _Run(reference_model, None, dtype, device_type)
        with torch.enable_grad(), torch.autocast(device_type, enabled=False):
            with _Mode(ref_run):
                ref_in = _cast(inputs, torch.float64)
                ref_out = reference_model(*ref_in) if isinstance(ref_in, tuple) else reference_model(ref_in)
                ref_loss = loss_fn(ref_out, _cast(targets, torch.float64))
            _check_loss(ref_loss)
            ref_params = [(n, p) for n, p in reference_model.named_parameters() if p.requires_grad]
            ref_grads = _backward(ref_loss * scale, [p for _, p in ref_params])
        ref_run.remove()
        # the low-precision run
        reset_rng()
        low_run = _Run(model, ref_run, dtype, device_type)
        low_in = _cast(inputs, dtype) if decorated else inputs
        for low_t, ref_t in zip(_floats(low_in), _floats(ref_in)):  # the rounding of cast inputs counts as error
            c = _compare(low_t, ref_t, dtype)
            if c is not None:
                low_run._note(low_t, c["rel_err"])
        with torch.enable_grad():
            scope = (torch.autocast(device_type, enabled=False) if decorated
                     else _autocast(device_type, dtype=dtype, fp32_ops=fp32_ops))
            with scope, _Mode(low_run):
                low_out = model(*low_in) if isinstance(low_in, tuple) else model(low_in)
                low_loss = loss_fn(low_out, targets)
            model_out = {id(t) for t in _floats(low_out)}
            _check_loss(low_loss)
            for table in (low_run.errors, low_run.under_op, low_run.under_call, low_run.producer):
                table.clear()
            low_run.alive.clear()
            low_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            scaled = low_loss * torch.full((), scale, dtype=torch.float32, device=low_loss.device)
            low_grads = _backward(scaled, [p for _, p in low_params])
        low_run.remove()
    finally:
        for run in (ref_run, low_run):
            if run is not None:
                run.remove()
        with torch.no_grad():
            for module, name, original, saved in buffers:
                if module._buffers.get(name) is not original:
                    module._buffers[name] = original
                original.copy_(saved)
        reset_rng()
    owners = _owners(model)
    params = []
    for (name, p), g, (_, rp), rg in zip(low_params, low_grads, ref_params, ref_grads):
        if g is None or rg is None:
            continue
        c = _compare(g, rg, dtype)
        if c is not None:
            params.append(dict(param=name, module=owners.get(id(p), ""), finite=bool(torch.isfinite(g).all()), **c))
    loss = _compare(low_loss.reshape(()), ref_loss.reshape(()), dtype)
    loss = dict(low=float(low_loss.detach()), reference=float(ref_loss.detach()),
                rel_err=loss["rel_err"] if loss else None,
                type=type(loss_fn).__name__)
    rows = _rows(low_run, params, model_out)
    eps = torch.finfo(dtype).eps
    if (rows and rows[0]["introduces"] is None and rows[0]["added_err"] <= HEALTHY_EPS * eps
            and any(r["grad_underflow"] for r in rows)):
        # accurate where it computes, but gradients lost to underflow: the module losing the most is the one to name
        rows.sort(key=lambda r: (-r["grad_underflow"], r["order"]))
    ops = _rank_ops(low_run.ops)
    settings = dict(dtype=str(dtype).replace("torch.", ""), scale=scale, mode="decorated" if decorated else "autocast",
                    device_type=device_type, fp32_ops=fp32_ops)
    suggestion = _suggest(rows, loss, settings, dtype, low_out)
    return ReplayReport(rows, ops, loss, suggestion, settings)


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = f"a {tuple(loss.shape)} {loss.dtype} tensor" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"{_WHERE}: loss_fn must return a one-element floating tensor (the loss), but got {got}")


def _backward(loss: torch.Tensor, params: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    """Gradients by torch.autograd.grad: the parameters' .grad are never touched."""
    if not loss.requires_grad or not params:
        return [None] * len(params)
    return list(torch.autograd.grad(loss.reshape(()), params, allow_unused=True))
