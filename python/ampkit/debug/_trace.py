"""The recording side of ampkit.debug.replay: the module hooks, the gradient hooks and the ``TorchFunctionMode``
of one run (``_Run``, ``_Mode``), and the per-tensor comparison against the float64 reference (``_compare``) with
the helpers that walk nested values (``_tensors``, ``_floats``, ``_cast``). The reference run records float64
copies of every module output, op output and gradient; the low-precision run compares against them as it goes and
keeps one record per module call, per op and per gradient for ``_report`` to rank.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_LOWP = (torch.float16, torch.bfloat16)
# Ops that only move, view or cast data: not compared, but their output inherits the error of their input (so that
# a module behind decorate's FP32 input cast still knows how wrong its inputs are).
_PASS_THROUGH = frozenset({
    "to", "type", "half", "float", "double", "bfloat16", "type_as", "contiguous", "detach", "clone", "view",
    "view_as", "reshape", "reshape_as", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand", "expand_as",
    "flatten", "unflatten", "split", "chunk", "unbind", "narrow", "select", "getitem", "get", "size", "dim", "numel",
    "requires_grad_", "is_floating_point", "dim_order", "stride", "data_ptr", "element_size", "movedim"})
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

    def _compare_all(self, outputs: list, refs: list) -> tuple:
        """The largest relative error, the overflow and underflow counts and the largest magnitude of `outputs`
        against their references; each compared output is noted."""
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
        return err, overflow, underflow, max_abs

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
            err, overflow, underflow, max_abs = self._compare_all(outputs, refs)
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
        err, overflow, underflow, _ = self._compare_all(outputs, refs[position][1])
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
