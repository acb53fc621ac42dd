"""ampkit.optim's shared base: ``FusedOptimizer`` (torch.optim.Optimizer's param groups, hooks and state_dict over
ampkit::optim::core in C++: group checks, the eager step, loaded-state checks, ``__setstate__``; under
torch.compile the step of ``_traced``) and ``_core``, the lazy handle to ``ampkit._C`` that every optimizer module
calls.
"""
from __future__ import annotations

import operator
from functools import partial
from itertools import chain
from typing import Any, Callable, Optional

import torch

from .. import _checks, _compile, _dtensor
from .. import integrations as _integrations
from . import _traced


def _core():
    from .._native import _C
    return _C


class FusedOptimizer(torch.optim.Optimizer):
    """What ampkit's optimizers share. Their decisions (range checks, master modes, which parameters take the fused
    kernels, state creation, loaded-state checks, torch.optim's single-tensor path for FP64/complex/sparse/non-dense
    parameters) are made by ampkit::optim::core in C++, the same code the LibTorch optimizers run; this class keeps
    what needs Python: param_groups as torch.optim.Optimizer, Python types, hooks, differentiable=True.

    Public as ``ampkit.optim.FusedOptimizer``, the class to test for: ``isinstance(opt, FusedOptimizer)`` is true of
    every ampkit.optim optimizer (what ``ampkit.decorate``'s O2 and the framework integrations take). Not built
    directly: its subclasses Adam, AdamW, SGD and LAMB are the optimizers."""

    _step_supports_amp_scaling = True
    _ampkit_traced_step = True  # GradScaler.step may trace it under torch.compile (NOTE [Compiled steps])
    _kind = "adam"  # the core's algorithm: "adam", "sgd" or "lamb"
    # The option table (NOTE [Optimizer option table] in ampkit/optim_options.h) of the optimizer a class names
    # with _table: _options (its param-group keys and defaults), _flags, _state_dtype_keys and
    # _state_dtype_entries, and with _compat (torch.optim's keys the core does not read: foreach, fused, ...)
    # _group_defaults, torch.optim's __setstate__ defaults, come from it (__init_subclass__).
    _table: Optional[str] = None
    _compat: dict = {}
    _options: dict = {}
    _group_defaults: dict = {}
    _group_forced: dict = {}

    _flags: tuple[str, ...] = ()  # the bool options of this optimizer
    _numbers: tuple[str, ...] = ()  # its number options (lr, eps, ...)
    _where: Optional[str] = None  # the prefix of its number and betas errors (None: torch.optim's, unprefixed)
    # master_weights' named modes: "remainder" (BF16 weight + int16 remainder: the exact FP32 master), and without
    # a master for BF16 weights "stochastic" (stochastic rounding, state "sr_seed") and "kahan" (state "kahan_comp")
    _master_modes: tuple[str, ...] = ("remainder", "stochastic", "kahan")
    # The group options that pick the moments' dtypes (torch.float32, torch.bfloat16, torch.uint8: NOTE [8-bit
    # block-wise states] in kernels/blockwise8.h); None is FP32. _state_dtype_entries: the state entry of each.
    _state_dtype_keys: tuple[str, ...] = ()
    _state_dtype_entries: tuple[str, ...] = ()

    @classmethod
    def _cpp_core(cls):
        """The class's C++ core, ``_C.OptimizerCore`` (NOTE [The bound optimizer core] in
        csrc/python/bind_optim.cpp), made once per class (``_bound_core``)."""
        return cls._bound_core

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls._table is not None:  # every class that has an option table, a user's subclass included
            cls._bound_core = _core().OptimizerCore(cls._table, cls.__name__)
        if "_table" not in cls.__dict__:
            return
        rows = _core()._optim_options(cls._table)
        # (name, default, python, archive, field, state entry); python "group"/"lr": a param-group key
        cls._options = {name: default for name, default, python, *_ in rows if python in ("group", "lr")}
        cls._flags = tuple(name for name, default in cls._options.items() if isinstance(default, bool))
        cls._numbers = tuple(name for name, default in cls._options.items() if isinstance(default, float))
        moments = [(name, entry) for name, _, python, _, _, entry in rows if entry is not None]
        cls._state_dtype_keys = tuple(name for name, _ in moments)
        cls._state_dtype_entries = tuple(entry for _, entry in moments)
        cls._group_defaults = dict(cls._options, **cls._compat)

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
        """The checks of a group's values: types from the class's tables, ranges in the C++ core
        (``_checks.optimizer_group``)."""
        _checks.optimizer_group(cls, group)

    @staticmethod
    def master_from_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
        """The exact FP32 master held by a BF16 weight and its int16 remainder."""
        return _core().OptimizerCore.master_from_remainder(param, remainder)

    @torch.no_grad()
    def init_master_params(self) -> None:
        """Give every parameter an FP32 master copied from its current value, now. Call it while the model is
        still FP32, then cast the model to FP16/BF16 (O2, as ``ampkit.decorate`` does): the masters keep the
        unrounded weights instead of copies of the rounded ones. Groups whose ``master_weights`` keeps no master
        (``"stochastic"``, ``"kahan"``) get none."""
        core = self._cpp_core()
        for group in self.param_groups:
            if not core.takes_master(group):
                continue
            for p in group["params"]:
                if not _dtensor.is_dtensor(p):
                    core.init_master(p, self.state[p])
                    continue
                state = self.state[p]
                before = _dtensor.local_state(state, p)
                after = dict(before)
                core.init_master(_dtensor.local(p), after)
                _dtensor.store_state(p, state, before, after)

    def _fp32_master_params(self) -> list[torch.Tensor]:
        """The parameters of the groups that keep an FP32 master (all but ``"stochastic"`` and ``"kahan"``): those
        whose master ``ampkit.decorate`` takes from the FP32 weight before its O2 cast. Changes nothing."""
        core = self._cpp_core()
        return [p for group in self.param_groups if core.takes_master(group) for p in group["params"]]

    @staticmethod
    def _run_closure(closure: Optional[Callable[[], float]]):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _validate(self) -> None:
        """The Python checks of each group's values (types, flags, master modes), re-run for a group whose values
        changed (a value replaced, a key added or removed) since it was last checked; the core checks the ranges
        and tensors of every group, each step, before it writes anything (NOTE [The policy across groups] in
        ampkit/optim_core.h)."""
        checked = self.__dict__.setdefault("_checked_values", {})
        cls = type(self)
        for group in self.param_groups:
            values = tuple(chain.from_iterable(group.items()))
            last = checked.get(id(group))
            if (last is not None and last[0] is group and len(last[1]) == len(values)
                    and all(map(operator.is_, last[1], values))):
                continue
            _checks.optimizer_group(cls, group)  # (not through _check_group: the step's walk stays one descent)
            checked[id(group)] = (group, values)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = self._run_closure(closure)
        if torch.compiler.is_compiling():
            reason = _traced.step(self)
            if reason is None:
                return loss
            # The eager step below, outside the graph (with fullgraph=True, an error that says why).
            torch._dynamo.graph_break(f"{type(self).__name__}.step: {reason}")
        if self.__dict__.get("_groups_with_duplicates"):
            self._refuse_duplicates()
        self._validate()
        core = self._bound_core
        grad_scale, found_inf = _compile.scalars(self)
        if found_inf is not None and "step" in self.__dict__:  # a scaler's step through a patched step method
            _integrations._check_unattached_accelerate(self)
        groups = self.param_groups
        # The core steps every group (NOTE [The policy across groups], NOTE [Group steps from Python] in
        # csrc/python/bind_optim.cpp); a group it leaves to Python, of DTensors or differentiable=True, it checks and
        # steps through _dtensor's functions, in that group's turns.
        core.step_groups(groups, self.state, grad_scale, found_inf, self.write_unscaled_grads,
                         partial(_dtensor.check_group, self, core, groups),
                         partial(_dtensor.step_group, self, core, groups, grad_scale, found_inf),
                         partial(self._global_grad_norm, grad_scale))
        return loss

    def _global_grad_norm(self, grad_scale) -> Optional[torch.Tensor]:
        """The global grad norm a step needs before its first update (LAMB's clipping); None: not needed."""
        return None

    def _packed_entries(self, group: dict) -> list:
        """The state entries the group keeps as 8-bit states (on parameters of 4096 elements or more)."""
        return _dtensor.packed_entries(self, group)

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
        core = self._cpp_core()
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
                entries = [(k, _dtensor.local_entry(k, v, p, f"{where}[{k!r}]")) for k, v in entries]
            core.check_loaded_state(group, f"state[{pid!r}]", _dtensor.local(p), entries)

    # NOTE [State dtype options in state dicts]
    # A param group holds its state dtype options (exp_avg_dtype, exp_avg_sq_dtype, momentum_dtype) as torch.dtype
    # objects, as they were given; state_dict() writes them by name ("bfloat16", "uint8"; None stays None), so that
    # the state dict holds tensors, Python numbers, strings and None only, as torch.optim's does.
    # torch.distributed.checkpoint.state_dict refuses any other value where it gathers or offloads a state dict
    # (get_state_dict with StateDictOptions(full_state_dict=True) or cpu_offload=True: "Unexpected value type <class
    # 'torch.dtype'>"). load_state_dict takes a name or a torch.dtype (a state dict written before), and the group
    # holds a torch.dtype again.
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict, with the state dtype options by name (NOTE [State dtype options in state
        dicts])."""
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:  # copies of the groups: the optimizer's keep their torch.dtypes
            for key in self._state_dtype_keys:
                if isinstance(group.get(key), torch.dtype):
                    group[key] = str(group[key]).removeprefix("torch.")
        return state_dict

    def _dtypes_from_names(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with the state dtype options its param groups name made torch.dtypes (a copy of the dict
        and of those groups; ``state_dict`` itself is not changed); a name of no dtype raises ValueError."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or not any(
                isinstance(g, dict) and isinstance(g.get(k), str) for g in groups for k in self._state_dtype_keys):
            return state_dict
        converted = []
        for index, group in enumerate(groups):
            if isinstance(group, dict):
                group = dict(group)
                for key in self._state_dtype_keys:
                    name = group.get(key)
                    if not isinstance(name, str):
                        continue
                    dtype = getattr(torch, name.removeprefix("torch."), None)
                    if not isinstance(dtype, torch.dtype):
                        raise ValueError(f"{type(self).__name__}.load_state_dict: param_groups[{index}][{key!r}] "
                                         "must name a torch.dtype ('float32', 'bfloat16' or 'uint8'), be one or be "
                                         f"None, but got {name!r}")
                    group[key] = dtype
            converted.append(group)
        return dict(state_dict, param_groups=converted)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = self._dtypes_from_names(state_dict)
        self._check_loaded_state(state_dict)
        core = self._cpp_core()
        # A state dtype option the saved group lacks (a torch.optim checkpoint) keeps this optimizer's value: the
        # loaded moments are converted to it below.
        kept = [{k: g[k] for k in self._state_dtype_keys if k in g and k not in saved_group}
                for g, saved_group in zip(self.param_groups, state_dict["param_groups"])]
        names = set(core.state_names())
        # torch's base class casts floating state to each parameter's dtype; masters and moments must stay FP32.
        saved = {pid: {k: v for k, v in st.items() if k in names and torch.is_tensor(v)}
                 for pid, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        for group, values in zip(self.param_groups, kept):
            group.update(values)
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable([(p, g) for p in g["params"]] for g in self.param_groups)
        for pid, (p, group) in zip(ids, params):
            if not core.takes_fused(_dtensor.local(p)):
                continue  # torch.optim's state format (the single-tensor path): the base class's cast is right
            # Moments in the group's state dtypes (an 8-bit state quantized or dequantized, kept bit for bit when
            # it is already in the group's dtype).
            for key, value in saved.get(pid, {}).items():
                if _dtensor.is_dtensor(p):
                    self.state[p][key] = self._loaded_shard_entry(group, key, value, p, pid)
                else:
                    self.state[p][key] = core.loaded_entry(group, key, value, p)

    def _loaded_shard_entry(self, group: dict, key: str, value: torch.Tensor, p: torch.Tensor, pid) -> torch.Tensor:
        """A loaded state entry of the DTensor parameter ``p``, converted on its local shard as the core converts a
        plain parameter's and wrapped as a DTensor again. An 8-bit state follows the whole parameter (NOTE [8-bit
        states of DTensor parameters] in ampkit/_dtensor.py): where the core would keep FP32 for a small shard, the
        shard's packed state is kept bit for bit, or its moment quantized, here."""
        core = self._cpp_core()
        lp = _dtensor.local(p)
        local = _dtensor.local_entry(key, value, p, f"{type(self).__name__}.load_state_dict: state[{pid!r}][{key!r}]")
        if (key in self._packed_entries(group) and lp.numel() < _dtensor.BLOCKWISE8_MIN_NUMEL <= p.numel()
                and core.takes_fused(lp)):
            if local.dtype != torch.uint8:  # in the parameter's layout first: a packed state is in memory order
                moment = torch.empty_like(lp, dtype=torch.float32).copy_(local)
                local = _core()._blockwise8_quantize(moment, key != "exp_avg_sq")
            loaded = local.to(lp.device, copy=True)
        else:
            loaded = core.loaded_entry(group, key, local, lp)
        return _dtensor.wrap_state(key, loaded, p)  # step and sr_seed stay plain (_dtensor.PLAIN_ENTRIES)

    def __setstate__(self, state: dict) -> None:
        # torch.optim's defaults for keys an older torch did not save, and Python-number steps made tensors.
        state.setdefault("write_unscaled_grads", True)
        super().__setstate__(state)
        _compile.register(self)
        core = self._cpp_core()
        for group in self.param_groups:
            for key, value in self._group_defaults.items():
                group.setdefault(key, value)
            for key, value in self._group_forced.items():
                group[key] = value
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not torch.is_tensor(st["step"]):
                    on_device = core.takes_fused(_dtensor.local(p))
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32,
                                              device=p.device if on_device else "cpu")
