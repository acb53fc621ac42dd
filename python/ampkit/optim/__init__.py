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

DTensor parameters (FSDP2's ``fully_shard``): each rank updates its local shards, and the states are DTensors of
the parameter's layout as torch.optim's (``step`` a plain scalar tensor), so ``state_dict()`` and
``torch.distributed.checkpoint`` see the same structure as with torch.optim.
"""
from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Optional

import torch
from torch.optim import adam as _torch_adam
from torch.optim import sgd as _torch_sgd

from .. import _checks, _compile, _dtensor

__all__ = ["Adam", "AdamW", "SGD", "LAMB"]

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

    @classmethod
    def _check_values(cls, group: dict) -> None:
        """torch.optim.Adam's checks and messages, for the constructor and for every group at step(): Python types
        here, ranges in the C++ core."""
        betas = group["betas"]
        for key in ("lr", "eps", "weight_decay"):
            _checks.number(None, key, group[key])
        if not isinstance(betas, (tuple, list)):
            raise TypeError(f"betas must be a pair (beta1, beta2), but got {type(betas).__name__} {betas!r}")
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), but got {betas!r}")
        for i, beta in enumerate(betas):
            _checks.number(None, f"betas[{i}]", beta)
        cls._check_ranges(group)

    def _validate(self) -> bool:
        deferred = super()._validate()
        for group in self.param_groups:
            if group["capturable"] and not torch.compiler.is_compiling():
                supported = _capturable_devices()
                for p in group["params"]:
                    if p.device.type not in supported:
                        raise AssertionError(f"If capturable=True, params and state_steps must be on supported "
                                             f"devices: {supported}.")
        return deferred

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
    _group_forced = dict(decoupled_weight_decay=True)  # as torch: an AdamW never runs coupled decay

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("decoupled_weight_decay", True)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class SGD(_FusedOptimizer):
    """torch.optim.SGD's arguments and results, on ampkit's fused kernel, plus ``master_weights``."""

    _kind = "sgd"
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

    @classmethod
    def _check_values(cls, group: dict) -> None:
        """torch.optim.SGD's checks and messages (NaN refused too), for the constructor and for every group at
        step(): Python types here, ranges in the C++ core."""
        for key in ("lr", "momentum", "dampening", "weight_decay"):
            _checks.number(None, key, group[key])
        cls._check_ranges(group)

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


class LAMB(_FusedOptimizer):
    """LAMB (You et al. 2020) on ampkit's fused kernel, with the arguments, defaults and semantics of Apex's
    ``FusedLAMB`` (NVIDIA's BERT recipe), plus ``master_weights``.

    Adam moments (``grad_averaging``: ``m = beta1 m + (1 - beta1) g``, else ``beta1 m + g``; ``bias_correction``),
    the update ``u = m^ / (sqrt(v^) + eps)`` (``+ weight_decay * w`` with ``adam_w_mode``, else L2 decay added to
    the grad), then per tensor ``w -= lr * ||w|| / ||u|| * u``: the trust ratio is 1 where either norm is 0, and for
    groups without weight decay unless ``use_nvlamb``. With ``max_grad_norm > 0`` every grad is first scaled by
    ``max_grad_norm / ||g||`` when the global norm ``||g||`` over every group's grads exceeds it (computed on the
    device each step; ``last_grad_norm`` holds it). The norms are summed in one fixed order: CPU and CUDA steps give
    the same bits. FP16/BF16/FP32 parameters dense in memory; grads are only read (never unscaled in place).
    States: ``step``, ``exp_avg``, ``exp_avg_sq`` (FP32) and ``master_param`` / ``param_remainder`` as AdamW's.
    """

    _kind = "lamb"
    _core_checks_first = False
    _flags = ("bias_correction", "adam_w_mode", "grad_averaging", "use_nvlamb")
    _group_defaults = dict(bias_correction=True, adam_w_mode=True, grad_averaging=True, use_nvlamb=False,
                           max_grad_norm=1.0, master_weights=None, differentiable=False)

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: Optional[float] = 1.0, use_nvlamb: bool = False, *,
                 master_weights: Optional[bool] = None) -> None:
        if amsgrad:
            raise RuntimeError("LAMB does not support the AMSGrad variant.")
        self.write_unscaled_grads = False  # LAMB only reads the grads
        self.set_grad_none = _checks.flag("LAMB", "set_grad_none", set_grad_none)
        self.last_grad_norm: Optional[torch.Tensor] = None
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if max_grad_norm is None:
            max_grad_norm = 0.0  # no clipping
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb, master_weights=master_weights,
                        differentiable=False)
        self._check_group(defaults)
        super().__init__(params, defaults)

    @classmethod
    def _check_values(cls, group: dict) -> None:
        """Python types here, ranges (torch.optim's messages for lr, eps, betas, weight_decay) in the C++ core."""
        betas = group["betas"]
        for key in ("lr", "eps", "weight_decay", "max_grad_norm"):
            _checks.number("LAMB", key, group[key])
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"LAMB: betas must be a pair (beta1, beta2), but got {betas!r}")
        for i, beta in enumerate(betas):
            _checks.number("LAMB", f"betas[{i}]", beta)
        cls._check_ranges(group)

    def _validate(self) -> bool:
        deferred = super()._validate()
        for group in self.param_groups:
            if group["max_grad_norm"] > 0 and _dtensor.any_dtensor(group["params"]):
                raise NotImplementedError(
                    "LAMB: max_grad_norm > 0 with DTensor parameters (FSDP2) needs a norm over every rank's shards, "
                    "which LAMB does not compute; clip with torch.nn.utils.clip_grad_norm_ and pass max_grad_norm=0")
        return deferred

    def _global_grad_norm(self, grad_scale) -> Optional[torch.Tensor]:
        if not any(group["max_grad_norm"] > 0 for group in self.param_groups):
            return None
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.last_grad_norm = _core()._optim_global_grad_norm(grads, grad_scale)
        return self.last_grad_norm

    def _traced_grad_norm(self, grad_scale) -> Optional[torch.Tensor]:
        if not any(group["max_grad_norm"] > 0 for group in self.param_groups):
            return None
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        by_device = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        norms = [torch.ops.ampkit.grad_norm(list_, None if grad_scale is None else grad_scale.to(device))
                 for device, list_ in by_device.items()]
        if not norms:
            norm = torch.zeros((), dtype=torch.float32)
        elif len(norms) == 1:
            norm = norms[0]
        else:  # as the core's global_grad_norm
            first = grads[0].device
            norm = torch.stack([n.to(first, torch.float64) for n in norms]).square().sum().sqrt().to(torch.float32)
        self.last_grad_norm = norm
        return norm

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """torch.optim's zero_grad; ``set_to_none`` defaults to the constructor's ``set_grad_none`` (Apex)."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


from . import lr_scheduler  # noqa: E402  (ampkit.optim.lr_scheduler)
