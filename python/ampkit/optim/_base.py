"""ampkit.optim's shared base: ``_FusedOptimizer`` (torch.optim.Optimizer's param groups, hooks and state_dict over
ampkit::optim::core in C++: group checks, the eager step, loaded-state checks, ``__setstate__``), its step as Python
over ``torch.ops.ampkit.*_step_`` under torch.compile (NOTE [Compiled steps] in ampkit/_compile.py), the trace-time
group plan (``_group_plan``) and ``_core``, the lazy handle to ``ampkit._C`` that every optimizer module calls.
"""
from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Optional

import torch

from .. import _compile, _dtensor

def _core():
    from .. import _C
    return _C


@_compile.constant
def _group_plan(key: int, index: int, dtypes: tuple) -> tuple:
    """At trace time, on the real group ``index`` of the optimizer ``key``: its checks (as _validate's) and the
    master mode the core gives each parameter. Returns (the checked values, the modes)."""
    optimizer = _compile.live(key)
    group = optimizer.param_groups[index]
    cls = type(optimizer)
    try:
        cls._check_group(group)
    except (ValueError, TypeError, RuntimeError) as e:  # a bad value: the eager step raises it
        return type(e).__name__, str(e)
    # torch.optim's capturable/foreach/fused change nothing in ampkit's kernels (and Dynamo sets capturable while
    # it traces torch optimizers): not guarded.
    values = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in group.items()
                   if k not in ("params", "capturable", "foreach", "fused") and not isinstance(v, torch.Tensor))
    by_dtype = {}
    for dtype in set(dtypes):  # a dtype the group's master_weights refuses matters only for parameters with grads
        try:
            by_dtype[dtype] = _core()._optim_master_mode(cls._kind, cls.__name__, group, dtype)
        except ValueError:
            by_dtype[dtype] = None
    return values, tuple(by_dtype[dtype] for dtype in dtypes)


def _differs(value, checked) -> bool:
    if isinstance(checked, tuple):
        return len(value) != len(checked) or any(_differs(v, c) for v, c in zip(value, checked))
    return value != checked


class _FusedOptimizer(torch.optim.Optimizer):
    """What ampkit's optimizers share. Their decisions (range checks, master modes, which parameters take the fused
    kernels, state creation, loaded-state checks, torch.optim's single-tensor path for FP64/complex/sparse/non-dense
    parameters) are made by ampkit::optim::core in C++, the same code the LibTorch optimizers run; this class keeps
    what needs Python: param_groups as torch.optim.Optimizer, Python types, hooks, differentiable=True."""

    _step_supports_amp_scaling = True
    _ampkit_traced_step = True  # GradScaler.step may trace it under torch.compile (NOTE [Compiled steps])
    _kind = "adam"  # the core's algorithm: "adam" or "sgd"
    _group_defaults: dict = {}  # torch.optim's __setstate__ defaults
    _group_forced: dict = {}

    _flags: tuple[str, ...] = ("maximize",)  # torch's bool options of this optimizer
    _core_checks_first = True  # step() runs nothing before the core's checks of a group (LAMB: its grad norm)

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's add_param_group, with the group's values checked (with the defaults it will take) before
        it is added: a bad group raises and the optimizer is unchanged."""
        if isinstance(param_group, dict):
            merged = dict(self.defaults, **{k: v for k, v in param_group.items() if k != "params"})
            self._check_group(merged)
        super().add_param_group(param_group)  # warns of a parameter listed twice in the group, as torch
        if len({id(p) for p in self.param_groups[-1]["params"]}) != len(self.param_groups[-1]["params"]):
            self.__dict__.setdefault("_groups_with_duplicates", []).append(self.param_groups[-1])
        _compile.register(self)  # NOTE [Compiled steps]: read at trace time

    def _refuse_duplicates(self) -> None:
        """A parameter listed twice in a group: torch.optim steps it twice, a fused step cannot write one tensor
        from two work items; the step raises, before anything is written, naming both positions."""
        for index, group in enumerate(self.param_groups):
            if not any(group is g for g in self._groups_with_duplicates):
                continue
            first: dict[int, int] = {}
            for i, p in enumerate(group["params"]):
                j = first.setdefault(id(p), i)
                if j != i:
                    raise ValueError(f"{type(self).__name__}.step: params[{j}] and params[{i}] of parameter group "
                                     f"{index} are the same tensor; a fused step updates each parameter once "
                                     "(list it once)")

    @classmethod
    def _check_group(cls, group: dict) -> None:
        """torch's checks (_check_values) plus ampkit's: master_weights and bool flags."""
        name = cls.__name__
        mw = group.get("master_weights")
        if not (mw is None or isinstance(mw, bool) or mw == "remainder"):
            raise ValueError(f"{name}: master_weights must be None, True, False or 'remainder', but got {mw!r}")
        for flag in cls._flags:
            value = group.get(flag, False)
            if not isinstance(value, (bool, int)) or isinstance(value, int) and value not in (0, 1):
                raise TypeError(f"{name}: {flag} must be True or False, but got {type(value).__name__} {value!r}")
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor) and lr.is_meta:
            raise ValueError(f"{name}: lr must be a number or a one-element tensor holding a value, but got a tensor "
                             "on the meta device")
        cls._check_values(group)

    @classmethod
    def _check_ranges(cls, group: dict) -> None:
        """torch.optim's range checks and messages, made by the C++ core."""
        _core()._optim_check_config(cls._kind, cls.__name__, group)

    @staticmethod
    def master_from_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
        """The exact FP32 master held by a BF16 weight and its int16 remainder."""
        return _core()._optim_master_from_remainder(param, remainder)

    @torch.no_grad()
    def init_master_params(self) -> None:
        """Give every parameter an FP32 master copied from its current value, now. Call it while the model is
        still FP32, then cast the model to FP16/BF16 (O2, as ``ampkit.decorate`` does): the masters keep the
        unrounded weights instead of copies of the rounded ones."""
        for group in self.param_groups:
            for p in group["params"]:
                if not _dtensor.is_dtensor(p):
                    _core()._optim_init_master(p, self.state[p])
                    continue
                state = self.state[p]
                before = _dtensor.local_state(state)
                after = dict(before)
                _core()._optim_init_master(_dtensor.local(p), after)
                _dtensor.store_state(p, state, before, after)

    @staticmethod
    def _run_closure(closure: Optional[Callable[[], float]]):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _validate(self) -> bool:
        """Checks every group before anything is written (an optimizer step is atomic: a bad group raises before
        the first group is updated). True when the check of the only group is left to step(): the core checks a
        group of plain tensors before writing anything, and step() checks a DTensor group before its shards."""
        for group in self.param_groups:
            self._check_group(group)
            if self._core_checks_first and len(self.param_groups) == 1 and not group.get("differentiable"):
                return True
            self._check_tensors(group)
        return False

    def _check_tensors(self, group: dict) -> None:
        name = type(self).__name__
        with _dtensor.local_grads(group["params"], name) as params:  # DTensors: their local shards
            _core()._optim_check(self._kind, name, group, params)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = self._run_closure(closure)
        if _compile.is_compiling():
            if self._traced_step():
                return loss
            # The eager step below, outside the graph (with fullgraph=True, an error that says why).
            torch._dynamo.graph_break(f"{type(self).__name__}.step: {self._graph_break}")
        if self.__dict__.get("_groups_with_duplicates"):
            self._refuse_duplicates()
        deferred = self._validate()
        core = _core()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        name = type(self).__name__
        grad_norm = self._global_grad_norm(grad_scale)
        get_state = self.state.get  # dict.get: no default entry created (one hash per parameter)
        dtensor_type = _dtensor._type()
        for group in self.param_groups:
            # The lists are assembled in C++ (NOTE [Group steps from Python] in csrc/python/module.cpp); False for
            # a group of DTensors, which steps its local shards below.
            if not group["differentiable"] and core._optim_step_group(
                    self._kind, name, group, self.state, grad_scale, found_inf, self.write_unscaled_grads,
                    grad_norm, _dtensor._PLAIN, dtensor_type):
                continue
            if deferred:  # the only group, of DTensors: checked now, before its shards are stepped
                self._check_tensors(group)
            params = [p for p in group["params"] if p.grad is not None]
            if group["differentiable"]:
                self._differentiable_step(group, params, grad_scale, found_inf)
                continue
            states = [get_state(p) for p in params]
            new = [i for i, st in enumerate(states) if st is None]
            for i in new:
                states[i] = {}
            self._local_step(group, params, states, grad_scale, found_inf)
            for i in new:  # states the core created
                if states[i]:
                    self.state[params[i]] = states[i]
        return loss

    # ---- under torch.compile (NOTE [Compiled steps] in ampkit/_compile.py) ----------------------------------------

    _FUSED_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}

    def _traced_step(self) -> bool:
        """step() as Python over the fused ops, which torch.compile traces into one graph. False, before anything
        is written, when a group is one the graph does not hold (differentiable, DTensor, tensor betas, parameters
        the fused kernels do not take, partial states): the eager step then runs, breaking the graph."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        plans = []
        # Every parameter of a group must suit the graph, with or without a grad. (Dynamo 2.13 cannot resume after
        # this break when the same compiled function ran the backward: compile such steps with fused groups only.)
        for index, group in enumerate(self.param_groups):
            params = group["params"]
            if not self._graph_holds(group, params):
                self._graph_break = ("a group the graph does not hold (differentiable, DTensor, tensor betas, or "
                                     "parameters the fused kernels do not take: the eager step)")
                return False
            checked, modes = _group_plan(id(self), index, tuple(self._FUSED_DTYPES[p.dtype] for p in params))
            if isinstance(checked, str):  # a bad value: the eager step raises the check's error
                self._graph_break = f"{checked}: {modes}"
                return False
            for key, value in checked:  # guards: the graph runs only with the values checked
                if _differs(group[key], value):
                    self._graph_break = f"group option {key!r} changed while tracing"
                    return False
            states = []
            for p, mode in zip(params, modes):
                state = self.state.get(p)
                if state is not None and not self._complete_for_graph(group, state, mode):
                    self._graph_break = "a partial state (loaded from torch.optim): the eager step completes it"
                    return False
                states.append(state)
            plans.append((group, params, modes, states))
        for group, params, modes, states in plans:
            for p, mode in zip(params, modes):
                g = p.grad
                if g is not None and mode is None:
                    self._graph_break = "master_weights refuses a parameter's dtype: the eager step raises it"
                    return False
                if g is not None and (g.layout != torch.strided or g.dtype != p.dtype or g.shape != p.shape
                                      or not g.is_contiguous()):
                    self._graph_break = "a sparse, other-dtype or strided grad: the eager step"
                    return False
        plans = [(group, *zip(*[(p, m, st) for p, m, st in zip(params, modes, states) if p.grad is not None]))
                 for group, params, modes, states in plans]
        grad_norm = self._traced_grad_norm(grad_scale)
        for group, *entries in plans:
            if not entries:
                continue
            params, modes, states = entries
            buckets = {}
            for p, mode, state in zip(params, modes, states):
                if state is None:
                    state = self._new_state(group, p, mode)
                    if state:
                        self.state[p] = state
                buckets.setdefault((p.device, mode), []).append((p, state))
            for (device, mode), entries in buckets.items():
                self._fused_call(group, device, mode, entries, grad_scale, found_inf, grad_norm)
        return True

    def _graph_holds(self, group: dict, params: list) -> bool:
        """Whether the graph can hold the group's step (else the eager step)."""
        if group.get("differentiable") or _dtensor.any_dtensor(params):
            return False
        for p in params:
            if p.dtype not in self._FUSED_DTYPES or p.layout != torch.strided or not p.is_contiguous():
                return False
        for key, value in group.items():  # tensor options other than lr (Adam's tensor betas)
            if key in ("lr", "params"):
                continue
            values = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, torch.Tensor) for v in values):
                return False
        return True

    def _complete_for_graph(self, group: dict, state: dict, mode: str) -> bool:
        """Whether ``state`` has every entry the fused call reads (a state loaded from torch.optim may lack the
        master or the step; the eager step completes it)."""
        needed = []
        if self._stateful(group):
            needed += ["step", "momentum_buffer"] if self._kind == "sgd" else ["step", "exp_avg", "exp_avg_sq"]
            if self._kind == "adam" and group["amsgrad"]:
                needed.append("max_exp_avg_sq")
        if mode in ("master", "remainder"):
            needed.append("master_param" if mode == "master" else "param_remainder")
        return all(key in state for key in needed)

    def _stateful(self, group: dict) -> bool:
        """Whether the fused op reads steps and moments (SGD without momentum reads neither)."""
        return self._kind != "sgd" or group["momentum"] != 0

    def _new_state(self, group: dict, p: torch.Tensor, mode: str) -> dict:
        """A parameter's first state, as the core creates it (optim_core.cpp, complete_state)."""
        state = {}
        if self._stateful(group):
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        if self._kind != "sgd":
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            if self._kind == "adam" and group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                           memory_format=torch.preserve_format)
        elif group["momentum"] != 0:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        if mode == "master":
            state["master_param"] = p.detach().to(torch.float32, copy=True)
        elif mode == "remainder":
            state["param_remainder"] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
        return state

    def _traced_grad_norm(self, grad_scale) -> Optional[torch.Tensor]:
        return None

    def _fused_call(self, group: dict, device, mode: str, entries: list, grad_scale, found_inf, grad_norm) -> None:
        """One fused op over a (device, master mode) bucket, as the core's fused_call."""
        params = [p for p, _ in entries]
        grads = [p.grad for p in params]
        states = [st for _, st in entries]
        stateful = self._stateful(group)
        masters = [st["master_param"] for st in states] if mode == "master" else []
        remainders = [st["param_remainder"] for st in states] if mode == "remainder" else []
        steps = [st["step"] for st in states] if stateful else []
        lr = group["lr"]
        lr_tensor = None
        if isinstance(lr, torch.Tensor):  # a CPU lr stays there: the op reads it on the host (no copy per step)
            lr_tensor, lr = lr.to(device=lr.device if lr.is_cpu else device, dtype=torch.float32), 0.0
        on = {}
        for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
            on[name] = None if t is None else t.to(device)
        if self._kind == "sgd":
            buffers = [st["momentum_buffer"] for st in states] if stateful else []
            torch.ops.ampkit.sgd_step_(
                params, grads, masters, remainders, buffers, steps, lr=lr, momentum=group["momentum"],
                dampening=group["dampening"], weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                maximize=group["maximize"], lr_tensor=lr_tensor, write_unscaled_grads=self.write_unscaled_grads,
                **on)
            return
        beta1, beta2 = group["betas"]
        exp_avgs = [st["exp_avg"] for st in states]
        exp_avg_sqs = [st["exp_avg_sq"] for st in states]
        if self._kind == "lamb":
            torch.ops.ampkit.lamb_step_(
                params, grads, masters, remainders, exp_avgs, exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
                weight_decay=group["weight_decay"], eps=group["eps"], bias_correction=group["bias_correction"],
                adam_w_mode=group["adam_w_mode"], grad_averaging=group["grad_averaging"],
                use_nvlamb=group["use_nvlamb"], max_grad_norm=group["max_grad_norm"],
                grad_norm=None if grad_norm is None else grad_norm.to(device), lr_tensor=lr_tensor, **on)
            return
        max_sqs = [st["max_exp_avg_sq"] for st in states] if group["amsgrad"] else []
        torch.ops.ampkit.adamw_step_(
            params, grads, masters, remainders, exp_avgs, exp_avg_sqs, max_sqs, steps, lr=lr, beta1=beta1,
            beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=group["amsgrad"],
            maximize=group["maximize"], decoupled_weight_decay=group["decoupled_weight_decay"], lr_tensor=lr_tensor,
            write_unscaled_grads=self.write_unscaled_grads, **on)

    def _global_grad_norm(self, grad_scale) -> Optional[torch.Tensor]:
        """The global grad norm a step needs before its first update (LAMB's clipping); None: not needed."""
        return None

    def _local_step(self, group: dict, params: list, states: list, grad_scale, found_inf) -> None:
        """The step of a group holding DTensor parameters: the core updates each rank's local shards (params,
        grads and states share storage with the DTensors); states it creates are stored as DTensors."""
        name = type(self).__name__
        before = [_dtensor.local_state(st) for st in states]
        after = [dict(b) for b in before]
        with _dtensor.local_grads(params, name) as local_params:
            _core()._optim_step(self._kind, name, group, local_params, after, grad_scale, found_inf,
                                self.write_unscaled_grads, None)
        for p, st, b, a in zip(params, states, before, after):
            _dtensor.store_state(p, st, b, a)

    def _differentiable_step(self, group: dict, params: list, grad_scale, found_inf) -> None:
        """differentiable=True: torch.optim's own single-tensor functions (autograd through the update)."""
        if found_inf is not None and float(found_inf) != 0.0:
            return
        if grad_scale is not None:
            for p in params:
                p.grad.div_(grad_scale.to(p.grad.device))
        if params:
            self._torch_step(group, params)

    def _check_loaded_state(self, state_dict: dict[str, Any]) -> None:
        """Refuses, before anything changes, a state that cannot be right: entries for parameter ids no group
        holds, tensors of the wrong shape or kind, or a partial Adam state (a missing moment or step would silently
        restart from zeros)."""
        name = type(self).__name__
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ValueError(f"{name}.load_state_dict: expected {len(self.param_groups)} param groups, "
                             f"but the state dict has {len(groups) if isinstance(groups, list) else groups!r}")
        params = {}
        for saved, group in zip(groups, self.param_groups):
            if len(saved.get("params", ())) != len(group["params"]):
                raise ValueError(f"{name}.load_state_dict: a param group of {len(group['params'])} "
                                 f"parameters gets {len(saved.get('params', ()))} from the state dict")
            params.update((pid, (p, group)) for pid, p in zip(saved["params"], group["params"]))
        core = _core()
        for pid, st in state_dict.get("state", {}).items():
            if pid not in params:
                raise ValueError(f"{name}.load_state_dict: state for parameter id {pid!r}, which no "
                                 "param group of the state dict holds")
            p, group = params[pid]
            # Fused or torch.optim's own format (the single-tensor path): shapes, kinds, whole states. A step saved
            # as a Python number (older torch) counts as present; it is made a tensor on load.
            entries = [(k, v if torch.is_tensor(v) else torch.tensor(float(v))) for k, v in st.items()
                       if torch.is_tensor(v) or k == "step" and isinstance(v, (int, float))]
            if _dtensor.is_dtensor(p):  # DTensor states (torch.optim's, DCP's) are checked on local shards
                where = f"{name}.load_state_dict: state[{pid!r}]"
                entries = [(k, _dtensor.local_entry(v, p, f"{where}[{k!r}]")) for k, v in entries]
            core._optim_check_loaded_state(self._kind, name, group, f"state[{pid!r}]", _dtensor.local(p), entries)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_loaded_state(state_dict)
        core = _core()
        names = set(core._optim_state_names())
        # torch's base class casts floating state to each parameter's dtype; masters and moments must stay FP32.
        saved = {pid: {k: v for k, v in st.items() if k in names and torch.is_tensor(v)}
                 for pid, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(ids, params):
            if not core._optim_takes_fused(_dtensor.local(p)):
                continue  # torch.optim's state format (the single-tensor path): the base class's cast is right
            for key, value in saved.get(pid, {}).items():
                if _dtensor.is_dtensor(p):
                    loaded = core._optim_loaded_entry(key, _dtensor.local(value), _dtensor.local(p))
                    self.state[p][key] = loaded if key == "step" else _dtensor.wrap_like(loaded, p)
                else:
                    self.state[p][key] = core._optim_loaded_entry(key, value, p)

    def __setstate__(self, state: dict) -> None:
        # torch.optim's defaults for keys an older torch did not save, and Python-number steps made tensors.
        state.setdefault("write_unscaled_grads", True)
        super().__setstate__(state)
        _compile.register(self)
        core = _core()
        for group in self.param_groups:
            for key, value in self._group_defaults.items():
                group.setdefault(key, value)
            for key, value in self._group_forced.items():
                group[key] = value
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not torch.is_tensor(st["step"]):
                    on_device = core._optim_takes_fused(_dtensor.local(p))
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32,
                                              device=p.device if on_device else "cpu")
