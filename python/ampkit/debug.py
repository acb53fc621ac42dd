"""ampkit.debug.replay: which module, and which op in it, is the precision problem of one training step.

``replay`` runs one step twice, as the user's low-precision run (under ``ampkit.autocast``, or the model as
``ampkit.decorate`` left it) and as a float64 reference on a copy of the model with autocast off, and compares the
two per module (forward outputs, output and parameter gradients) and per op (through a ``TorchFunctionMode``). It
leaves the model, its gradients, the optimizer, the scaler, the RNG, autocast and the hooks as it found them.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import _checks
from .autocast import autocast as _autocast
from .autocast import precision_support

__all__ = ["replay", "ReplayReport"]

_WHERE = "ampkit.debug.replay"
_LOWP = (torch.float16, torch.bfloat16)
# Ops that only move, view or cast data: not compared, but their output inherits the error of their input (so that
# a module behind decorate's FP32 input cast still knows how wrong its inputs are).
_PASS_THROUGH = frozenset({
    "to", "type", "half", "float", "double", "bfloat16", "type_as", "contiguous", "detach", "clone", "view",
    "view_as", "reshape", "reshape_as", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand", "expand_as",
    "flatten", "unflatten", "split", "chunk", "unbind", "narrow", "select", "getitem", "get", "size", "dim", "numel",
    "requires_grad_", "is_floating_point", "dim_order", "stride", "data_ptr", "element_size", "movedim"})
#: A module adding at most this many times the dtype's machine epsilon of relative error (and no Inf/NaN or
#: underflow anywhere) is reported healthy.
HEALTHY_EPS = 8.0
_DROPOUT = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"})
_RANDOM = ("dropout", "rand", "bernoulli", "normal", "multinomial", "uniform", "exponential", "poisson")
_RENAME = {"truediv": "div", "itruediv": "div_", "iadd": "add_", "isub": "sub_", "imul": "mul_", "radd": "add",
           "rsub": "sub", "rmul": "mul", "rtruediv": "div", "rmatmul": "matmul", "rpow": "pow"}


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    name = name.strip("_") if name.startswith("__") else name
    return _RENAME.get(name, name)


def _tensors(value: Any, out: Optional[list] = None) -> list[torch.Tensor]:
    """The tensors of a (nested) value, in a fixed order: tuples, lists, dicts (ModelOutput included)."""
    out = [] if out is None else out
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, Mapping):
        for v in value.values():
            _tensors(v, out)
    return out


def _floats(value: Any) -> list[torch.Tensor]:
    return [t for t in _tensors(value) if t.is_floating_point()]


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of a nested value cast to ``dtype`` (integer tensors, e.g. token ids, as they are)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _compare(low: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Optional[dict]:
    """Relative error, new Inf/NaN and underflow of a low-precision tensor against its float64 reference."""
    if low.shape != ref.shape:
        return None
    low64 = low.detach().to(torch.float64)
    ref = ref.detach().to(low64.device)
    ref_finite = torch.isfinite(ref)
    overflow = int((ref_finite & ~torch.isfinite(low64)).sum())
    tiny = torch.finfo(dtype).tiny
    underflow = int(((low64 == 0) & (ref != 0) & (ref.abs() < tiny) & ref_finite).sum())
    both = ref_finite & torch.isfinite(low64)
    ref_f = torch.where(both, ref, torch.zeros((), dtype=torch.float64, device=ref.device))
    diff = torch.where(both, low64 - ref, torch.zeros((), dtype=torch.float64, device=ref.device))
    # normalised by the larger of the two norms: the usual relative error when it is small, at most 2 where the
    # reference is (nearly) zero and the low-precision values are not
    low_f = torch.where(both, low64, torch.zeros((), dtype=torch.float64, device=ref.device))
    norm = max(float(torch.linalg.vector_norm(ref_f)), float(torch.linalg.vector_norm(low_f)))
    diff_norm = float(torch.linalg.vector_norm(diff))
    if overflow:
        rel = math.inf
    else:
        rel = diff_norm / norm if norm > 0 else 0.0
    ref_all = torch.where(ref_finite, ref, torch.zeros((), dtype=torch.float64, device=ref.device))
    max_abs = float(ref_all.abs().max()) if ref_all.numel() else 0.0
    return dict(rel_err=rel, overflow=overflow, underflow=underflow, max_abs=max_abs)


def _all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class _Call:
    """One call of one module in one run."""

    def __init__(self, name: str, index: int, parent: Optional["_Call"]) -> None:
        self.name, self.index, self.parent = name, index, parent
        self.key = (name, index)
        self.ops = 0           # direct ops seen (the position of the next one)
        self.ops_matched = True
        self.in_err = 0.0
        self.in_finite = True
        self.child_err = 0.0
        self.child_nonfinite = False


class _Run:
    """The hooks and the op mode of one run: the reference run records float64 copies, the low-precision run
    compares against them as it goes."""

    def __init__(self, model: nn.Module, reference: Optional["_Run"], dtype: torch.dtype, device_type: str) -> None:
        self.reference = reference
        self.dtype = dtype
        self.device_type = device_type
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.stack: list[_Call] = []
        self.counts: dict[str, int] = {}
        self.order = 0
        self.paused = False
        self.handles: list[Any] = []
        self.errors: dict[int, float] = {}   # id(tensor) -> relative error (low-precision run), while alive
        self.alive: list[torch.Tensor] = []
        # id(tensor) -> the op record / module-call record whose output underflowed, while alive: an op or module
        # that turns those zeros into Inf/NaN (log, division) is not where the problem starts
        self.under_op: dict[int, dict] = {}
        self.under_call: dict[int, dict] = {}
        self.producer: dict[int, dict] = {}   # id(tensor) -> the op record that computed it, while alive
        # reference records
        self.ref_outputs: dict[tuple, list[torch.Tensor]] = {}
        self.ref_ops: dict[tuple, list[tuple[str, list[torch.Tensor]]]] = {}
        self.ref_grads: dict[tuple, torch.Tensor] = {}
        # low-precision records
        self.calls: list[dict] = []
        self.ops: list[dict] = []
        self.grads: list[dict] = []
        for module in model.modules():
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    # ---- bookkeeping of errors by tensor ----
    def _err_of(self, t: torch.Tensor) -> float:
        return self.errors.get(id(t), 0.0)

    def _note(self, t: torch.Tensor, err: float) -> None:
        self.errors[id(t)] = err
        self.alive.append(t)

    def _inherit_underflow(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        for table in (self.under_op, self.under_call):
            origin = next((table[id(t)] for t in inputs if id(t) in table), None)
            if origin is not None:
                for t in outputs:
                    table.setdefault(id(t), origin)

    # ---- module hooks ----
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.paused = True
        try:
            name = self.names.get(id(module), type(module).__name__)
            index = self.counts.get(name, 0)
            self.counts[name] = index + 1
            call = _Call(name, index, self.stack[-1] if self.stack else None)
            inputs = _floats((args, kwargs))
            if self.reference is not None:
                call.in_finite = _all_finite(inputs)
                call.in_err = max([self._err_of(t) for t in inputs], default=0.0)
            for i, t in enumerate(inputs):
                if t.requires_grad:
                    t.register_hook(self._grad_hook((call.key, "in", i), call, "in"))
            self.stack.append(call)
        finally:
            self.paused = False

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.paused = True
        try:
            call = self.stack.pop()
            outputs = _floats(output)
            self.order += 1
            for i, t in enumerate(outputs):
                if t.requires_grad:
                    t.register_hook(self._grad_hook((call.key, "out", i), call, "out"))
            if self.reference is None:
                self.ref_outputs[call.key] = [t.detach().to(torch.float64, copy=True) for t in outputs]
                return
            refs = self.reference.ref_outputs.get(call.key, [])
            err, overflow, underflow, max_abs = 0.0, 0, 0, 0.0
            for t, r in zip(outputs, refs):
                c = _compare(t, r, self.dtype)
                if c is None:
                    continue
                err = max(err, c["rel_err"])
                overflow += c["overflow"]
                underflow += c["underflow"]
                max_abs = max(max_abs, c["max_abs"])
                self._note(t, c["rel_err"])
            nonfinite = overflow > 0
            origin = next((self.under_call[id(t)] for t in _floats((args, kwargs)) if id(t) in self.under_call), None)
            introduced = 0.0
            if call.in_finite and not math.isinf(err):
                introduced = max(0.0, err - max(call.in_err, call.child_err))
            record = dict(
                module=call.name, type=type(module).__name__, call=call.index, order=self.order,
                out_rel_err=err, in_rel_err=call.in_err, introduced_err=introduced, out_overflow=overflow,
                out_underflow=underflow, max_abs=max_abs,
                forward_introducer=nonfinite and call.in_finite and not call.child_nonfinite and origin is None,
                out_ids={id(t) for t in outputs})
            self.calls.append(record)
            if nonfinite and call.in_finite and origin is not None and not call.child_nonfinite:
                origin["forward_introducer"] = True   # the zeros it made became Inf/NaN here
            for t in outputs:   # the first module to underflow a tensor keeps it (a parent returns its child's)
                if underflow or origin is not None:
                    self.under_call.setdefault(id(t), record if underflow else origin)
            if call.parent is not None:
                call.parent.child_err = max(call.parent.child_err, err)
                call.parent.child_nonfinite = call.parent.child_nonfinite or nonfinite
        finally:
            self.paused = False

    def _grad_hook(self, key: tuple, call: _Call, side: str) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if self.reference is None:
                self.ref_grads[key] = grad.detach().to(torch.float64, copy=True)
                return
            ref = self.reference.ref_grads.get(key)
            if ref is None:
                return
            c = _compare(grad, ref, self.dtype)
            if c is not None:
                self.grads.append(dict(module=call.name, side=side, finite=bool(torch.isfinite(grad).all()), **c))
        return hook

    # ---- ops ----
    def op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.paused:
            return func(*args, **kwargs)
        name = _op_name(func)
        # Dropout is off in both runs: its masks would differ between the dtypes and swamp every comparison.
        if name in _DROPOUT and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "scaled_dot_product_attention":
            if len(args) > 4:
                args = args[:4] + (0.0,) + args[5:]
            elif "dropout_p" in kwargs:
                kwargs = dict(kwargs, dropout_p=0.0)
        if not self.stack:
            return func(*args, **kwargs)
        call = self.stack[-1]
        inputs = _floats((args, kwargs))
        in_err = max([self._err_of(t) for t in inputs], default=0.0) if self.reference is not None else 0.0
        in_finite = _all_finite(inputs) if self.reference is not None else True
        out = func(*args, **kwargs)
        outputs = _floats(out)
        if not outputs:
            return out
        if name in _PASS_THROUGH:
            if self.reference is not None:
                for t in outputs:
                    if id(t) not in self.errors:
                        self._note(t, in_err)
                self._inherit_underflow(inputs, outputs)
                origin = next((self.producer[id(t)] for t in inputs if id(t) in self.producer), None)
                if origin is not None:
                    for t in outputs:
                        self.producer.setdefault(id(t), origin)
            return out
        position = call.ops
        call.ops += 1
        if self.reference is None:
            self.ref_ops.setdefault(call.key, []).append(
                (name, [t.detach().to(torch.float64, copy=True) for t in outputs]))
            return out
        refs = self.reference.ref_ops.get(call.key, [])
        if not call.ops_matched or position >= len(refs) or refs[position][0] != name \
                or len(refs[position][1]) != len(outputs):
            call.ops_matched = False   # the two runs took different paths through this module: stop comparing
            return out
        err, overflow, underflow = 0.0, 0, 0
        for t, r in zip(outputs, refs[position][1]):
            c = _compare(t, r, self.dtype)
            if c is None:
                continue
            err = max(err, c["rel_err"])
            overflow += c["overflow"]
            underflow += c["underflow"]
            self._note(t, c["rel_err"])
        increase = max(0.0, err - in_err) if in_finite and not math.isinf(err) else 0.0
        origin = next((self.under_op[id(t)] for t in inputs if id(t) in self.under_op), None)
        lowp = any(t.dtype in _LOWP for t in outputs)
        record = dict(op=name, module=call.name, dtype=str(outputs[0].dtype).replace("torch.", ""),
                      lowp=lowp, rel_err=err, in_rel_err=in_err, increase=increase, overflow=overflow,
                      underflow=underflow, introduces_nonfinite=overflow > 0 and in_finite and origin is None,
                      local_rel_err=None, local_overflow=0, local_underflow=0,
                      inputs_from=sorted({self.producer[id(t)]["op"] for t in inputs
                                          if id(t) in self.producer and self.producer[id(t)]["lowp"]}))
        if lowp and not (name.endswith("_") or "out" in kwargs or any(r in name for r in _RANDOM)):
            # the op's own share: the same op in float64 on the same (low-precision) inputs
            try:
                with torch.autocast(self.device_type, enabled=False):
                    local = func(*_cast(args, torch.float64), **_cast(kwargs, torch.float64))
            except (RuntimeError, TypeError, NotImplementedError):  # no float64 kernel: its share stays unknown
                local = None
            local_err = None if local is None else 0.0
            for t, r in zip(outputs, _floats(local) if local is not None else []):
                c = _compare(t, r, self.dtype)
                if c is not None:
                    local_err = max(local_err, c["rel_err"])
                    record["local_overflow"] += c["overflow"]
                    record["local_underflow"] += c["underflow"]
            record["local_rel_err"] = local_err
        self.ops.append(record)
        for t in outputs:
            self.producer[id(t)] = record
            self.alive.append(t)
        if overflow > 0 and in_finite and origin is not None:
            origin["introduces_nonfinite"] = True   # the zeros it made became Inf/NaN here
        if underflow:
            for t in outputs:
                self.under_op[id(t)] = record
                self.alive.append(t)
        else:
            self._inherit_underflow(inputs, outputs)
        return out


class _Mode(TorchFunctionMode):
    def __init__(self, run: _Run) -> None:
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.run.op(func, args, kwargs or {})


def _finite_float(x: Any) -> Any:
    """JSON-safe: Inf and NaN as the strings 'inf', '-inf', 'nan'."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite_float(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_float(v) for v in x]
    return x


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return "inf" if x == math.inf else str(x)
    return f"{x:.2e}"


class ReplayReport:
    """What :func:`replay` found: ``rows`` (one dict per module, ranked: the module that introduces the problem
    first), ``top`` (the first row), ``suggestion`` (the override that would fix it, in words), ``ops`` (the
    ops compared, ranked the same way), ``loss``, ``scale``, ``dtype``, ``mode`` (``"autocast"`` or
    ``"decorated"``), ``device_type``; ``as_dict()`` (JSON-serialisable), ``str(report)`` (a table)."""

    def __init__(self, rows: list[dict], ops: list[dict], loss: dict, suggestion: str, settings: dict) -> None:
        self.rows = rows
        self.ops = ops
        self.loss = loss
        self.suggestion = suggestion
        self.settings = settings

    @property
    def top(self) -> Optional[dict]:
        """The first row: the module that introduces the problem (None for a model without modules run)."""
        return self.rows[0] if self.rows else None

    @property
    def dtype(self) -> str:
        return self.settings["dtype"]

    @property
    def scale(self) -> float:
        return self.settings["scale"]

    @property
    def mode(self) -> str:
        return self.settings["mode"]

    @property
    def device_type(self) -> str:
        return self.settings["device_type"]

    def as_dict(self) -> dict:
        """Everything as plain dicts, lists, str, int and float (Inf/NaN as the strings 'inf'/'nan'):
        ``json.dumps(report.as_dict(), allow_nan=False)`` works."""
        return _finite_float(dict(settings=dict(self.settings), loss=dict(self.loss), suggestion=self.suggestion,
                                  rows=[dict(r) for r in self.rows], ops=[dict(o) for o in self.ops]))

    def __repr__(self) -> str:
        top = self.top["module"] if self.top else None
        return f"ReplayReport(top={top!r}, rows={len(self.rows)}, dtype={self.dtype}, scale={self.scale})"

    def __str__(self) -> str:
        s = self.settings
        lines = [f"ampkit.debug.replay: {s['dtype']} ({s['mode']}) on {s['device_type']}, scale {s['scale']:g}; "
                 f"loss {self.loss['low']:.6g} (reference {self.loss['reference']:.6g})"]
        head = ("#", "module", "type", "out rel err", "grad rel err", "added err", "overflow f/b", "underflow f/b",
                "max abs")
        body = []
        for i, r in enumerate(self.rows[:30]):
            grad = r["grad_rel_err"] if r["grad_rel_err"] is not None else r["param_grad_rel_err"]
            body.append((str(i + 1), r["module"] or "(model)", r["type"], _fmt(r["out_rel_err"]), _fmt(grad),
                         _fmt(r["added_err"]), f"{r['out_overflow']}/{r['grad_overflow']}",
                         f"{r['out_underflow']}/{r['grad_underflow']}",
                         _fmt(r["max_abs"])))
        widths = [max(len(row[c]) for row in [head] + body) for c in range(len(head))]
        for row in [head] + body:
            lines.append("  ".join(v.ljust(w) if c < 3 else v.rjust(w) for c, (v, w) in enumerate(zip(row, widths))))
        if len(self.rows) > 30:
            lines.append(f"... {len(self.rows) - 30} more rows (report.rows)")
        lines.append(f"suggestion: {self.suggestion}")
        return "\n".join(lines)


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


def _is_ancestor(parent: str, child: str) -> bool:
    return parent != child and (parent == "" or child.startswith(parent + "."))


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


def _rows(run: _Run, params: list[dict], model_out: set[int]) -> list[dict]:
    rows: dict[str, dict] = {}
    for c in run.calls:
        r = rows.get(c["module"])
        if r is None:
            r = rows[c["module"]] = dict(from_loss=False, _facing=False,
                module=c["module"], type=c["type"], calls=0, order=c["order"], introduces=None, out_rel_err=0.0,
                in_rel_err=0.0, introduced_err=0.0, out_overflow=0, out_underflow=0, max_abs=0.0, grad_rel_err=None,
                param_grad_rel_err=None, grad_overflow=0, grad_underflow=0, grad_max_abs=0.0, op=None, _fwd=False,
                _bwd=False, _out_grad_finite=True)
        r["calls"] += 1
        for k in ("out_rel_err", "in_rel_err", "introduced_err", "max_abs"):
            r[k] = max(r[k], c[k])
        r["out_overflow"] += c["out_overflow"]
        r["out_underflow"] += c["out_underflow"]
        r["_fwd"] = r["_fwd"] or c["forward_introducer"]
        r["_facing"] = r["_facing"] or bool(c.pop("out_ids") & model_out)
    grads_in_bad: dict[str, bool] = {}
    in_grad_err: dict[str, float] = {}
    for g in run.grads:
        r = rows.get(g["module"])
        if r is None:
            continue
        if g["side"] == "out":
            r["grad_rel_err"] = max(r["grad_rel_err"] or 0.0, g["rel_err"])
            r["grad_overflow"] += g["overflow"]
            r["grad_underflow"] += g["underflow"]
            r["grad_max_abs"] = max(r["grad_max_abs"], g["max_abs"])
            r["_out_grad_finite"] = r["_out_grad_finite"] and g["finite"]
        else:
            in_grad_err[g["module"]] = max(in_grad_err.get(g["module"], 0.0), g["rel_err"])
            if not g["finite"]:
                grads_in_bad[g["module"]] = True
    for p in params:
        r = rows.get(p["module"])
        if r is None:
            continue
        r["param_grad_rel_err"] = max(r["param_grad_rel_err"] or 0.0, p["rel_err"])
        r["grad_overflow"] += p["overflow"]
        r["grad_underflow"] += p["underflow"]
        if not p["finite"]:
            grads_in_bad[p["module"]] = True
    for name, r in rows.items():
        r["_bwd"] = r["_out_grad_finite"] and grads_in_bad.get(name, False)
        # the backward's error increase: from the gradient of its outputs to those of its inputs and parameters
        produced = max(in_grad_err.get(name, 0.0), r["param_grad_rel_err"] or 0.0)
        r["_bwd_added"] = 0.0
        # (a gradient inherits the error of its output gradient and of the forward values it is computed from)
        inherited = max(r["grad_rel_err"] or 0.0, r["in_rel_err"], r["out_rel_err"])
        if r["grad_rel_err"] is not None and math.isfinite(inherited) and math.isfinite(produced):
            r["_bwd_added"] = max(0.0, produced - inherited)
    for name, r in rows.items():  # what a submodule adds is not its parent's (the forward does this per call)
        inner = max([o["_bwd_added"] for n, o in rows.items() if _is_ancestor(name, n)], default=0.0)
        r["grad_introduced_err"] = max(0.0, r["_bwd_added"] - inner)
    for r in rows.values():
        r["added_err"] = max(r["introduced_err"], r["grad_introduced_err"])
    if any(r["_fwd"] for r in rows.values()):   # Inf/NaN in the forward: the backward's follow from it
        for r in rows.values():
            r["_bwd"] = False
    bwd = [n for n, r in rows.items() if r["_bwd"]]
    for n in bwd:  # a module is not the one that introduces when one of its submodules is
        if any(_is_ancestor(n, other) for other in bwd):
            rows[n]["_bwd"] = False
    if not any(r["_bwd"] or r["_fwd"] or r["out_overflow"] for r in rows.values()):
        # the first gradient of the backward, that of the scaled loss w.r.t. the model's output, already overflows:
        # the innermost module computing that output is where it shows
        facing = [r for r in rows.values() if r["_facing"] and not r["_out_grad_finite"]]
        if facing:
            first = min(facing, key=lambda r: r["order"])
            first["_bwd"] = first["from_loss"] = True
    by_module: dict[str, list[dict]] = {}
    for o in run.ops:
        by_module.setdefault(o["module"], []).append(o)
    for name, r in rows.items():
        r["introduces"] = "forward" if r["_fwd"] else ("backward" if r["_bwd"] else None)
        worst = _rank_ops(by_module.get(name, []))
        r["op"] = worst[0]["op"] if worst else None
        r["op_dtype"] = worst[0]["dtype"] if worst else None
        r["fix_ops"] = _fix_ops(worst[0]) if worst else []
        for k in ("_fwd", "_bwd", "_out_grad_finite", "_bwd_added", "_facing"):
            del r[k]

    def key(r: dict) -> tuple:
        if r["introduces"] == "forward":
            return (0, r["order"])
        if r["introduces"] == "backward":
            return (1, -r["order"])  # the backward runs in reverse: the last module forward is the first backward
        return (2, -r["added_err"], r["order"])

    return sorted(rows.values(), key=key)


def _fix_ops(op: dict) -> list[str]:
    """The ops to force to FP32 for ``op``'s problem: the op itself where its own rounding, overflow or underflow
    makes it (its float64 twin on the same inputs is right), else also the low-precision ops that computed its
    inputs (it amplifies their rounding, as softmax does on large logits)."""
    own = (op["local_overflow"] or op["local_underflow"] or not op["inputs_from"]
           or (op["local_rel_err"] is not None and op["local_rel_err"] >= 0.5 * op["rel_err"]))
    if own:
        return [op["op"]]
    return op["inputs_from"] + ([op["op"]] if op["lowp"] and op["op"] not in op["inputs_from"] else [])


def _rank_ops(ops: list[dict]) -> list[dict]:
    merged: dict[tuple, dict] = {}
    for i, o in enumerate(ops):
        k = (o["module"], o["op"])
        m = merged.get(k)
        if m is None:
            m = merged[k] = dict(o, calls=0, first=i)
            m["overflow"] = m["underflow"] = 0
            m["local_overflow"] = m["local_underflow"] = 0
        m["calls"] += 1
        for f in ("rel_err", "in_rel_err", "increase"):
            m[f] = max(m[f], o[f])
        m["overflow"] += o["overflow"]
        m["underflow"] += o["underflow"]
        m["introduces_nonfinite"] = m["introduces_nonfinite"] or o["introduces_nonfinite"]
        if o["local_rel_err"] is not None:
            m["local_rel_err"] = max(m["local_rel_err"] or 0.0, o["local_rel_err"])
        m["local_overflow"] += o["local_overflow"]
        m["local_underflow"] += o["local_underflow"]
        m["inputs_from"] = sorted(set(m["inputs_from"]) | set(o["inputs_from"]))
        m["lowp"] = m["lowp"] or o["lowp"]
    ranked = sorted(merged.values(), key=lambda m: (not m["introduces_nonfinite"], m["first"] if
                                                    m["introduces_nonfinite"] else 0, -m["underflow"],
                                                    -m["increase"], m["first"]))
    for m in ranked:
        del m["first"]
    return ranked


def _suggest(rows: list[dict], loss: dict, settings: dict, dtype: torch.dtype, low_out: Any) -> str:
    """The top row in words, and the override that fixes it."""
    info = torch.finfo(dtype)
    where = f"{settings['dtype']} at scale {settings['scale']:g}"
    top = rows[0] if rows else None
    out_finite = _all_finite(_floats(low_out))
    if top is None or (top["introduces"] is None and out_finite and math.isfinite(loss["low"])
                       and top["added_err"] <= HEALTHY_EPS * info.eps
                       and not any(r["out_overflow"] or r["grad_overflow"] or r["out_underflow"]
                                   or r["grad_underflow"] for r in rows)):
        if top is None:
            return f"no module ran; nothing to compare ({where})"
        return (f"healthy in {where}: no Inf/NaN and no underflow; the largest error increase is "
                f"{top['added_err']:.2e} ({top['added_err'] / info.eps:.1f} x {settings['dtype']} eps) at "
                f"{top['module'] or '(model)'} ({top['type']}); no override needed")
    if top["introduces"] is None and out_finite and not math.isfinite(loss["low"]):
        return (f"the loss ({loss['type']}) turns Inf/NaN from finite model outputs in {where}: compute it in FP32, "
                "loss_fn(output.float(), targets)")
    name = top["module"] or "(model)"
    if top["introduces"] is None and top["grad_underflow"] and top["added_err"] <= HEALTHY_EPS * info.eps:
        return (f"{name} ({top['type']}): {top['grad_underflow']} of its gradient values underflow to zero in "
                f"{where} ({settings['dtype']}'s normals end at {info.smallest_normal:.3g}, its subnormals at "
                f"{info.smallest_normal * info.eps:.3g}): raise the loss scale (ampkit.GradScaler, a larger "
                "init_scale)")
    what = {"forward": "its output holds Inf/NaN from finite inputs",
            "backward": "its gradients hold Inf/NaN from finite output gradients (the scaled backward overflows)",
            None: (f"it adds the largest error ({top['added_err']:.2e}, "
                   + ("in the backward" if top["grad_introduced_err"] > top["introduced_err"] else "in the forward")
                   + ")")}[top["introduces"]]
    if top["out_underflow"] and top["introduces"] is None:
        what = f"{top['out_underflow']} of its output values underflow to zero"
    text = f"{name} ({top['type']}): {what} in {where}. "
    if settings["mode"] == "decorated":
        text += f"Fix: ampkit.decorate(model, optimizer, excluded=[{top['module']!r}]) keeps it FP32"
        if top["max_abs"] > info.max:
            text += (f"; its output reaches {top['max_abs']:.3g}, beyond {settings['dtype']}'s max {info.max:g}, so "
                     "the modules that take it must stay FP32 as well (or use bfloat16)")
    else:
        op, fix = top["op"], [o for o in top["fix_ops"] if o not in settings["fp32_ops"]]
        if op is None:
            return text + ("No op of this module was compared; run its forward in FP32 (inside "
                           "ampkit.autocast(..., enabled=False))")
        if not fix:
            text += f"{', '.join(top['fix_ops'])} already run(s) in FP32 here; the problem is in its inputs or range"
        else:
            how = ("its op" if fix == [op] else "its inputs are computed by " + ", ".join(o for o in fix if o != op)
                   + f" in {settings['dtype']} and its op")
            text += (f"Fix: ampkit.autocast({settings['device_type']!r}, dtype=torch.{settings['dtype']}, "
                     f"fp32_ops={settings['fp32_ops'] + fix!r}) ({how} {op} ran in {top['op_dtype']})")
    if top["introduces"] == "backward" and top["from_loss"]:
        return (f"{name} ({top['type']}): the gradient of the scaled loss w.r.t. its output (the model's output) "
                f"already overflows {where} (max |grad| {top['grad_max_abs']:.3g} in the reference): lower the loss "
                f"scale (the scaler backs off by itself after a skipped step; GradScaler(max_scale=...) bounds it)")
    if top["introduces"] == "backward":
        text += "; or lower the loss scale (the scaler backs off by itself after a skipped step)"
    return text

