"""ampkit.optim's step under torch.compile (NOTE [Compiled steps] in ampkit/_compile.py): Python over
``torch.ops.ampkit.*``, which Dynamo traces into the graph. It decides nothing: at trace time the C++ core plans each
group's step (``core::plan_step``, the plan the eager step follows) on the group's real values, its parameters and
the traced grads' layouts; the traced code then creates the state entries the plan names
(``torch.ops.ampkit.make_optim_state``) and makes the fused calls it lists.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _compile, _dtensor
from .._native import _C

_FUSED_CALLS = {"adam": "adamw_step_", "lamb": "lamb_step_", "sgd": "sgd_step_"}
# Each algorithm's (op list of each state entry, the op's state lists), read once (NOTE [State lists of the fused
# ops]): the traced step reads a dict, no C++ call.
_TABLES = {"adam": "Adam", "lamb": "LAMB", "sgd": "SGD"}  # an option table of each algorithm
_STATE_LISTS = {kind: _C.OptimizerCore(table, table).state_lists() for kind, table in _TABLES.items()}


def _op_options(kind: str, table: str) -> tuple:
    """The group options the fused op of `kind` takes under the same name: the param-group keys of the option table
    (NOTE [Optimizer option table]) that its schema names."""
    schema = getattr(torch.ops.ampkit, _FUSED_CALLS[kind]).default._schema
    arguments = {a.name for a in schema.arguments}
    return tuple(row[0] for row in _C._optim_options(table) if row[2] == "group" and row[0] in arguments)


_OPTIONS = {kind: _op_options(kind, table) for kind, table in _TABLES.items()}


def _meta_grad(layout: Optional[tuple]) -> Optional[torch.Tensor]:
    """A meta tensor with a traced grad's layout (None: no grad), for the core's plan."""
    if layout is None:
        return None
    shape, stride, dtype, sparse = layout
    if sparse:
        return torch.empty(shape, dtype=dtype, device="meta").to_sparse()
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


@_compile.constant
def _group_plan(key: int, index: int, entries: tuple, grads: tuple) -> tuple:
    """At trace time, on the real group ``index`` of the optimizer ``key``: (the group's values the plan was made
    with, the core's plan of its step). ``entries`` (the names each parameter's state holds, None: no state) and
    ``grads`` (each grad's shape, strides, dtype and sparsity, None: no grad) are what the traced code read, so the
    graph is guarded on them. (error type, message) for a group the core refuses (the eager step raises it);
    (None, reason) for one the graph cannot hold as it is."""
    optimizer = _compile.live(key)
    group = optimizer.param_groups[index]
    cls = type(optimizer)
    for k, value in group.items():  # a tensor option other than lr (Adam's tensor betas) is read by the eager step
        if k not in ("lr", "params") and any(isinstance(v, torch.Tensor) for v in
                                             (value if isinstance(value, (tuple, list)) else (value,))):
            return None, f"the tensor option {k!r}: the eager step"
    params = group["params"]
    states = [optimizer.state.get(p) if names is not None else None for p, names in zip(params, entries)]
    try:
        cls._check_group(group)
        plan = cls._cpp_core().plan(group, params, [_meta_grad(g) for g in grads], states)
    except (ValueError, TypeError, RuntimeError) as e:
        return type(e).__name__, str(e)
    # torch.optim's capturable/foreach/fused change nothing in ampkit's kernels (and Dynamo sets capturable while
    # it traces torch optimizers): not guarded.
    values = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in group.items()
                   if k not in ("params", "capturable", "foreach", "fused") and not isinstance(v, torch.Tensor))
    return values, plan


def _differs(value, checked) -> bool:
    if isinstance(checked, tuple):
        return len(value) != len(checked) or any(_differs(v, c) for v, c in zip(value, checked))
    return value != checked


def _layout(g: Optional[torch.Tensor]) -> Optional[tuple]:
    if g is None:
        return None
    sparse = g.layout != torch.strided
    return tuple(g.shape), None if sparse else g.stride(), g.dtype, sparse


def step(optimizer) -> Optional[str]:
    """One step of ``optimizer`` (an ampkit.optim optimizer) as traced code. None when done; else, before anything
    is written, why the graph cannot hold it (the eager step then runs, outside the graph)."""
    grad_scale, found_inf = _compile.scalars(optimizer)
    plans = []
    for index, group in enumerate(optimizer.param_groups):
        params = group["params"]
        if group.get("differentiable") or _dtensor.any_dtensor(params):
            return "a differentiable or DTensor group: the eager step"
        entries = tuple(None if (st := optimizer.state.get(p)) is None else tuple(st) for p in params)
        checked, plan = _group_plan(id(optimizer), index, entries, tuple(_layout(p.grad) for p in params))
        if not isinstance(checked, tuple):  # a refused group (the eager step raises), or one the graph cannot hold
            return plan if checked is None else f"{checked}: {plan}"
        for k, value in checked:  # guards: the graph runs only with the values the plan was made with
            if _differs(group[k], value):
                return f"group option {k!r} changed while tracing"
        planned, buckets = plan
        for _, _, fused, staged, _, _, from_master in planned:
            if not fused or staged or from_master:
                return ("a parameter the fused kernels do not take as it is (torch.optim's single-tensor path, a "
                        "grad in another layout, a remainder from a loaded master): the eager step")
        plans.append((group, planned, buckets))
    grad_norm = optimizer._global_grad_norm(grad_scale)
    for group, planned, buckets in plans:
        params = group["params"]
        for _, reads, positions in buckets:
            chosen = [params[planned[i][0]] for i in positions]
            states = [_state(optimizer, group, p, planned[i][4], planned[i][5]) for p, i in zip(chosen, positions)]
            _fused_call(optimizer, group, chosen, states, reads, grad_scale, found_inf, grad_norm)
    return None


def _state(optimizer, group: dict, p: torch.Tensor, missing: list, first_step: float) -> dict:
    """p's state with the entries the plan says it lacks created as the eager step creates them (the moments in
    the group's state dtypes)."""
    state = optimizer.state.get(p)
    if missing:
        first = group.get("momentum_dtype" if optimizer._kind == "sgd" else "exp_avg_dtype")
        made = torch.ops.ampkit.make_optim_state(p, missing, first_step, exp_avg_dtype=first,
                                                 exp_avg_sq_dtype=group.get("exp_avg_sq_dtype"))
        if state is None:
            state = optimizer.state[p] = {}
        for name, tensor in zip(missing, made):
            state[name] = tensor
    return {} if state is None else state


def _fused_call(optimizer, group: dict, params: list, states: list, reads: list, grad_scale, found_inf,
                grad_norm) -> None:
    """The fused op of one bucket of the plan, over the entries it reads."""
    kind = optimizer._kind
    device = params[0].device
    list_of, op_lists = _STATE_LISTS[kind]
    lists = {arg: [] for arg in op_lists}
    for name in reads:
        lists[list_of[name]] = [st[name] for st in states]
    options = {k: group[k] for k in _OPTIONS[kind]}
    if kind != "sgd":
        options["beta1"], options["beta2"] = group["betas"]
    if kind == "lamb":
        options["grad_norm"] = None if grad_norm is None else grad_norm.to(device)
    else:
        options["write_unscaled_grads"] = optimizer.write_unscaled_grads
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):  # a CPU lr stays there: the op reads it on the host (no copy per step)
        options["lr_tensor"], lr = lr.to(device=lr.device if lr.is_cpu else device, dtype=torch.float32), 0.0
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        options[name] = None if t is None else t.to(device)
    getattr(torch.ops.ampkit, _FUSED_CALLS[kind])(params, [p.grad for p in params], lr=lr, **lists, **options)
