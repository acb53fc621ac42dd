"""ampkit.GradScaler: a drop-in for torch.amp.GradScaler driven by ampkit's C++ GradScaler.

The C++ class owns the state machine, the checks, the device state and the error messages. This adapter only
does what needs Python: reading a ``torch.optim.Optimizer``'s parameter groups, calling its ``step()``, and
handing ``grad_scale``/``found_inf`` to optimizers that take them (``_step_supports_amp_scaling``).
"""
from __future__ import annotations

import inspect
import os
import warnings
from collections import abc
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from . import _checks, _compile, _dtensor
from ._native import _C

__all__ = ["GradScaler", "OptState", "load_scaler_state", "save_scaler_state", "unwrap_optimizer"]


# torch's enum itself: code written for torch.amp.GradScaler compares stages by identity
# (``state["stage"] is OptState.UNSCALED``), and the values are the C++ core's Stage.
OptState = torch.amp.grad_scaler.OptState


def _params(optimizer: torch.optim.Optimizer) -> _dtensor.StepParams:
    """The optimizer's parameters, with the kind of the call decided once: plain, or DTensors (FSDP2)."""
    params = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, torch.Tensor):
                raise AssertionError(f"expected param to be torch.Tensor, got {type(p).__name__}")
            params.append(p)
    return _dtensor.StepParams(params)


def _number(where: str, name: str, value: Any) -> float:
    _checks.number(where, name, value)
    return float(value)


_SPIKE_KEYS = {"window": int, "sigmas": float, "warmup": int, "loss": bool, "grad_norm": bool}


def _spike_options(where: str, spike_skip: Any) -> Optional[dict]:
    """spike_skip as the C++ options take it (NOTE [Spike-aware skipping]): None/False off, True the defaults, or
    a dict of some of window, sigmas, warmup, loss, grad_norm (ranges are checked in C++)."""
    if spike_skip is None or spike_skip is False:
        return None
    if spike_skip is True:
        return {}
    if not isinstance(spike_skip, dict):
        raise TypeError(f"{where}: spike_skip must be True, False, None or a dict of {', '.join(_SPIKE_KEYS)}, but "
                        f"got {type(spike_skip).__name__}")
    out = {}
    for key, value in spike_skip.items():
        kind = _SPIKE_KEYS.get(key)
        if kind is None:
            raise ValueError(f"{where}: spike_skip has no option {key!r}; the options are {', '.join(_SPIKE_KEYS)}")
        if kind is bool:
            _checks.flag(where, f"spike_skip[{key!r}]", value)
        elif kind is int:  # the C++ option's type; its range is checked there
            value = _checks.integer(where, f"spike_skip[{key!r}]", value)
        elif kind is float:
            value = _number(where, f"spike_skip[{key!r}]", value)
        out[key] = value
    return out


def _optimizer(where: str, optimizer: Any) -> torch.optim.Optimizer:
    if not isinstance(getattr(optimizer, "param_groups", None), list):
        raise TypeError(f"{where}: optimizer must be a torch.optim.Optimizer (something with param_groups), but got "
                        f"{type(optimizer).__name__}")
    return optimizer


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer a framework's wrapper holds (Accelerate's AcceleratedOptimizer ``.optimizer``, Lightning's
    LightningOptimizer ``._optimizer``): a wrapper sharing its ``param_groups`` list with the optimizer inside is the
    same optimizer to the scaler, so ``unscale_(wrapper)`` and ``step(inner)`` are one optimizer's iteration.

    Args:
        optimizer: an optimizer, or a wrapper of one (wrappers of wrappers are read through); not modified.

    Returns:
        the innermost optimizer that shares ``optimizer``'s ``param_groups``; ``optimizer`` itself when it wraps none.
    """
    while True:
        for attr in ("optimizer", "_optimizer"):
            inner = getattr(optimizer, attr, None)
            if inner is not None and inner is not optimizer and getattr(inner, "param_groups", None) is getattr(
                    optimizer, "param_groups", ()):
                optimizer = inner
                break
        else:
            return optimizer


class _OptimizerState(abc.Mapping):
    """torch's per-optimizer entry, ``{"stage": OptState, "found_inf_per_device": {device: found_inf}}``, read
    from the C++ core at each access (it follows the iteration; after ``update()`` the optimizer is READY again)."""

    __slots__ = ("_core", "_key")
    _KEYS = ("stage", "found_inf_per_device")

    def __init__(self, core: Any, key: int) -> None:
        self._core, self._key = core, key

    def __getitem__(self, name: str) -> Any:
        if name == "stage":
            return OptState(self._core.stage(self._key))
        if name == "found_inf_per_device":
            return {t.device: t for t in self._core.found_inf_per_device(self._key)}
        raise KeyError(name)

    def __iter__(self):
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)

    def __setitem__(self, name: str, value: Any) -> None:
        raise TypeError(f"GradScaler._per_optimizer_states[{self._key}][{name!r}] is read-only: the C++ core owns "
                        "the stage and found_inf (use unscale_, step and update)")


class _PerOptimizerStates:
    """torch's ``_per_optimizer_states`` read through: ``[id(optimizer)]`` gives that optimizer's entry, READY with
    no found_inf when it took no part in this iteration (torch's defaultdict). Read-only, and not iterable: the C++
    core keys its state by optimizer and does not list the keys."""

    __slots__ = ("_core",)

    def __init__(self, core: Any) -> None:
        self._core = core

    def __getitem__(self, key: int) -> _OptimizerState:
        if isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"GradScaler._per_optimizer_states: the key must be id(optimizer), an int, but got "
                            f"{type(key).__name__}")
        return _OptimizerState(self._core, key)

    def get(self, key: int, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __contains__(self, key: Any) -> bool:
        return isinstance(key, int) and (self._core.stage(key) != OptState.READY.value
                                         or bool(self._core.found_inf_per_device(key)))

    def __setitem__(self, key: int, value: Any) -> None:
        raise TypeError("GradScaler._per_optimizer_states is read-only: the C++ core owns each optimizer's stage "
                        "and found_inf (use unscale_, step and update)")

    def __iter__(self):
        raise TypeError("GradScaler._per_optimizer_states cannot be iterated: index it by id(optimizer)")


class GradScaler(torch.amp.GradScaler):
    """Dynamic loss scaling, with torch.amp.GradScaler's methods and behaviour (same scales, skipped steps and
    parameters with the default extras), plus:

    Args (keyword-only, beyond torch's):
        hysteresis: the scale backs off at the ``hysteresis``-th overflow since the last growth (1: every
            overflow, as torch); overflows before it only skip the step.
        min_scale, max_scale: bounds of the scale. Overflows that continue at ``min_scale`` warn once
            (``raise_at_min_scale=True``: raise) from ``update()`` instead of driving the scale to 0. Their count
            reaches the host without a sync, so on a GPU possibly one ``update()`` late (docs/api.md).
        process_group: a ``torch.distributed`` group over which found_inf is all-reduced (MAX) before the skip
            decision, so every rank skips together.
        scaling: ``False`` fixes the scale at 1 (BF16 runs) while still checking grads and skipping
            non-finite steps.
        dynamic: ``False`` keeps a static loss scale, ``init_scale`` for ever (Apex's ``loss_scale=128``, Paddle's
            ``use_dynamic_loss_scaling=False``); non-finite steps are still skipped and counted.
        overflow_report: record which parameters held Inf/NaN grads; see :meth:`overflow_report`.
        calibration_margin: with ``init_scale="auto"``, the headroom of the calibrated scale in powers of two.

    ``init_scale="auto"`` calibrates the first scale: the first iteration runs at scale 1, and its ``update()``
    sets the scale to ``2**floor(log2(65504 / (amax * 2**calibration_margin)))`` (``amax``: that iteration's
    largest gradient; clamped to ``[min_scale, max_scale]``), on the device, without a sync (docs/api.md).

    ``stats()`` returns steps, skipped_steps, last_overflow_step, scale and the trackers; ``last_step_ran()`` a
    device bool telling whether the last step's update ran, without a sync (it keeps its value while held).

    A subclass of ``torch.amp.GradScaler``, so that code checking ``isinstance(scaler, torch.amp.GradScaler)``
    (Lightning, Accelerate, frameworks) takes it; torch's ``__init__`` is not called (the C++ core holds the
    state) and every method torch's scaler has is overridden here, torch's private members included (their
    meaning is torch's), but ``_check_scale_growth_tracker`` and ``_maybe_opt_step``, which read only those.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: Union[float, str] = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: Optional[float] = None,
        max_scale: Optional[float] = None,
        process_group: Any = None,
        scaling: bool = True,
        overflow_report: bool = False,
        raise_at_min_scale: bool = False,
        dynamic: bool = True,
        calibration_margin: float = 2.0,
        spike_skip: Union[bool, dict, None] = None,
    ) -> None:
        where = "ampkit.GradScaler"
        if not isinstance(device, str):  # torch's GradScaler takes a device-type string
            raise ValueError(f"{where}: device must be 'cpu' or 'cuda', but got {device!r}")
        _checks.device_type(where, device)
        calibrate = isinstance(init_scale, str) and init_scale == "auto"
        if isinstance(init_scale, str) and not calibrate:
            raise TypeError(f"{where}: init_scale must be a number or 'auto', but got {init_scale!r}")
        init_scale = 1.0 if calibrate else _number(where, "init_scale", init_scale)
        calibration_margin = _number(where, "calibration_margin", calibration_margin)
        growth_factor = _number(where, "growth_factor", growth_factor)
        backoff_factor = _number(where, "backoff_factor", backoff_factor)
        min_scale = None if min_scale is None else _number(where, "min_scale", min_scale)
        max_scale = None if max_scale is None else _number(where, "max_scale", max_scale)
        for name, value in (("enabled", enabled), ("scaling", scaling), ("overflow_report", overflow_report),
                            ("raise_at_min_scale", raise_at_min_scale), ("dynamic", dynamic)):
            _checks.flag(where, name, value)
        self._device = device
        if device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            enabled = False
        self._enabled = enabled
        growth_interval = _checks.integer(where, "growth_interval", growth_interval)  # ranges: the C++ options'
        hysteresis = _checks.integer(where, "hysteresis", hysteresis)
        spike_skip = _spike_options(where, spike_skip)
        group_type = getattr(torch.distributed, "ProcessGroup", ())
        if process_group is not None and not isinstance(process_group, group_type):
            raise TypeError("ampkit.GradScaler: process_group must be a torch.distributed.ProcessGroup (e.g. "
                            f"torch.distributed.group.WORLD) or None, but got {type(process_group).__name__}")
        self._core = _C.GradScaler(
            init_scale=float(init_scale),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=int(growth_interval),
            enabled=enabled,
            hysteresis=int(hysteresis),
            min_scale=None if min_scale is None else float(min_scale),
            max_scale=None if max_scale is None else float(max_scale),
            raise_at_min_scale=raise_at_min_scale,
            scaling=scaling,
            overflow_report=overflow_report,
            process_group=process_group,
            dynamic=dynamic,
            calibrate=calibrate,
            calibration_margin=float(calibration_margin),
            spike_skip=spike_skip,
        )
        self._handle = _compile.ScalerHandle(self._core) if _compile.SUPPORTED else None
        self._options = dict(
            device=device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, enabled=enabled, hysteresis=hysteresis, min_scale=min_scale,
            max_scale=max_scale, scaling=scaling, overflow_report=overflow_report,
            raise_at_min_scale=raise_at_min_scale, dynamic=dynamic,
            calibration_margin=calibration_margin, spike_skip=spike_skip)
        self._grouped = process_group is not None
        self._hook_buckets: set = set()  # the DDP buckets unscaled by ampkit.distributed's unscale hooks
        # The rank sets (sorted tuples of global ranks) on which this iteration's recorded flags agree (NOTE
        # [Compressed FSDP reduction] in ampkit/distributed.py): found_inf is not all-reduced over those ranks again.
        self._agreed_ranks: set = set()
        # A value assigned to _init_growth_tracker (torch's attribute): read back as assigned; before the first
        # scale() it is also the growth tracker the device state starts from (pending until then).
        self._assigned_growth_tracker: Optional[int] = None
        self._growth_tracker_pending = False
        if calibrate:
            self._options["init_scale"] = "auto"

    # ---- the training loop ----------------------------------------------------------------------------------

    def scale(self, outputs: Union[torch.Tensor, Iterable[torch.Tensor]]):
        """Multiply a tensor, or the tensors of a (nested) iterable, by the scale factor."""
        if not self._enabled:
            return outputs
        scaled = self._scale_outputs(outputs)
        if self._growth_tracker_pending:
            self._start_growth_tracker()
        return scaled

    def _scale_outputs(self, outputs: Union[torch.Tensor, Iterable[torch.Tensor]]):
        if self._traced():  # NOTE [Compiled steps]: the C++ core through a custom op
            def scale_one(t):
                return t * torch.ops.ampkit._scaler_scale_factor(self._handle, t.detach())
        else:
            scale_one = self._core.scale
        if isinstance(outputs, torch.Tensor):
            return scale_one(outputs)
        if isinstance(outputs, (str, bytes)):
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        def apply_scale(val):
            if isinstance(val, torch.Tensor):
                return scale_one(val)
            if isinstance(val, abc.Iterable):
                iterable = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(iterable)
                return iterable
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    def _start_growth_tracker(self) -> None:
        """Once the device state exists (the first scale()): a growth tracker assigned to ``_init_growth_tracker``
        before it is where it starts, as torch's lazy initialisation does."""
        tracker = self._core.get_growth_tracker_async()
        if tracker is not None:
            tracker.fill_(self._assigned_growth_tracker)
            self._growth_tracker_pending = False

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record Inf/NaN (no host sync)."""
        if not self._enabled:
            return
        optimizer = unwrap_optimizer(_optimizer("GradScaler.unscale_", optimizer))
        params = _params(optimizer)
        if self._traced() and not params.sharded:
            with_grads = [p for p in params.params if p.grad is not None]
            torch.ops.ampkit._scaler_unscale_(self._handle, id(optimizer), with_grads, [p.grad for p in with_grads])
            return
        self._unscale(id(optimizer), params)

    def _traced(self) -> bool:
        """Whether this call is traced by torch.compile and the methods go through custom ops."""
        return self._handle is not None and _compile.is_compiling()

    def _check_calibration(self, where: str, params: _dtensor.StepParams) -> None:
        """init_scale="auto" measures the grads this rank holds: DTensor shards need the process group over which
        the scaler all-reduces the amax, else each rank would set its own scale (NOTE [Calibrated first scale])."""
        if self._options["init_scale"] == "auto" and not self._grouped and params.sharded_grads():
            raise ValueError(f"ampkit.{where}: init_scale='auto' with DTensor (FSDP2) gradients needs "
                             "process_group=<the group the shards are reduced over, e.g. "
                             "torch.distributed.group.WORLD>, so that every rank calibrates the same scale; pass "
                             "it to GradScaler, or give a numeric init_scale")
        spike = self._options["spike_skip"]
        if spike is not None and spike.get("grad_norm", False) and params.sharded_grads():
            raise ValueError(f"ampkit.{where}: spike_skip with grad_norm=True measures the gradients this rank "
                             "holds, and DTensor (FSDP2) shards are part of the norm only; use spike_skip={'loss': "
                             "True, 'grad_norm': False} with FSDP2 (NOTE [Spike-aware skipping])")

    def _unscale(self, key: int, params: _dtensor.StepParams) -> None:
        # DTensor grads (FSDP2): the core unscales and checks the local shards; an Inf/NaN is seen only by the
        # rank holding its shard, so found_inf is all-reduced (MAX) over the grads' mesh, as torch's DTensor does.
        self._check_calibration("GradScaler.unscale_", params)
        with params.local_grads("GradScaler.unscale_") as local:
            self._core.unscale_params_(key, local)
        params.all_reduce_found_inf(self._core.found_inf_per_device(key), self._agreed())

    def _prepare_fused_step(self, key: int, params: _dtensor.StepParams):
        checks = self._core.stage(key) == OptState.READY.value  # else unscale_ checked (and all-reduced)
        self._check_calibration("GradScaler.step", params)
        with params.local_grads("GradScaler.step") as local:
            grad_scale, found_inf = self._core.prepare_fused_step(key, local)
        if checks:
            params.all_reduce_found_inf([found_inf, *self._core.found_inf_per_device(key)], self._agreed())
        return grad_scale, found_inf

    def _agreed(self) -> set:
        """The rank sets on which every rank holds this iteration's found_inf already: those noted by
        :meth:`_note_agreed_ranks`, when the flags were recorded (``record_unscaled_grads``), else none."""
        return self._agreed_ranks if self._agreed_ranks and self._core.grads_unscaled_outside() else set()

    def _check_spike_group(self, where: str) -> None:
        """Each rank sees its own loss: several processes must all-reduce the decision (NOTE [Spike-aware
        skipping]), else one rank skips while another steps and the replicas part."""
        if (self._options["spike_skip"] is not None and not self._grouped and torch.distributed.is_available()
                and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            raise ValueError(f"ampkit.{where}: spike_skip in a run of {torch.distributed.get_world_size()} "
                             "processes needs process_group=<the group the ranks train in, e.g. "
                             "torch.distributed.group.WORLD>, so that every rank takes the same decision; each "
                             "rank sees only its own loss")

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[float]:
        """Unscale (unless :meth:`unscale_` ran) and run ``optimizer.step(*args, **kwargs)`` unless a grad held
        Inf/NaN. Optimizers with ``_step_supports_amp_scaling`` get ``grad_scale``/``found_inf`` and skip on the
        device (no sync); others are stepped after a host read of found_inf, as torch does."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        _optimizer("GradScaler.step", optimizer)
        self._check_spike_group("GradScaler.step")
        # A framework's wrapper is stepped as given; the scaler's bookkeeping and the grad_scale/found_inf
        # hand-over are the optimizer's inside it, which reads them.
        inner = unwrap_optimizer(optimizer)
        key = id(inner)
        params = _params(optimizer)  # the step's kind, decided once: plain or DTensor parameters
        if (self._traced() and not params.sharded and getattr(optimizer, "_ampkit_traced_step", False)
                and getattr(optimizer, "grad_scale", None) is None):
            return self._traced_fused_step(key, optimizer, params.params, args, kwargs)
        self._core.begin_step(key)
        if getattr(inner, "_step_supports_amp_scaling", False):
            if "grad_scaler" in inspect.signature(optimizer.step).parameters:
                # The deprecated handshake, as torch's scaler still offers it: the optimizer reads this scaler.
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. In "
                    "the near future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the "
                    "passed optimizer and let the optimizer use them directly.", FutureWarning, stacklevel=2)
                retval = optimizer.step(*args, **dict(kwargs, grad_scaler=self))
                self._core.mark_stepped(key)
                return retval
            grad_scale, found_inf = self._prepare_fused_step(key, params)
            # As torch: None once unscale_ ran (the grads are unscaled), else the scale times any grad_scale the
            # optimizer already carries.
            user_scale = getattr(inner, "grad_scale", None)
            inner.grad_scale = (None if grad_scale is None
                                else grad_scale if user_scale is None else grad_scale * user_scale)
            inner.found_inf = found_inf
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del inner.grad_scale
                del inner.found_inf
            self._core.mark_stepped(key)
            return retval
        retval = None
        if params.sharded and self._core.stage(key) == OptState.READY.value:
            self._unscale(key, params)  # found_inf all-reduced over the mesh before the decision
        with params.local_grads("GradScaler.step") as local:
            run = self._core.prepare_step(key, local)
        if run:
            retval = optimizer.step(*args, **kwargs)
        self._core.mark_stepped(key)
        return retval

    def _traced_fused_step(self, key: int, optimizer: torch.optim.Optimizer, params: list, args, kwargs):
        """step() of an ampkit.optim optimizer under torch.compile (NOTE [Compiled steps]): the checks and the inf
        check by the C++ core, through custom ops; a grad_scale of 1 after unscale_() (``None`` in eager). Other
        optimizers, DTensor parameters and optimizers carrying their own grad_scale take the eager path."""
        params = [p for p in params if p.grad is not None]
        grad_scale, found_inf = torch.ops.ampkit._scaler_prepare_fused_step(self._handle, key, params,
                                                                          [p.grad for p in params])
        _compile.HANDED_OVER[key] = (grad_scale, found_inf)  # NOTE [Scale hand-over under compile]
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del _compile.HANDED_OVER[key]
        torch.ops.ampkit._scaler_mark_stepped(self._handle, key)
        return retval

    def record_unscaled_grads(self, found_inf: torch.Tensor) -> None:
        """Record that this iteration's grads were unscaled (by :meth:`unscale_factor`) and checked outside the
        scaler, e.g. by ``ampkit.distributed``'s DDP unscale hooks while decompressing: ``found_inf`` (one float32
        element, nonzero when a grad held Inf/NaN) is copied on the current stream, and the first
        ``unscale_``/``step`` sums every recorded flag on its own stream after waiting for each (buckets may record
        from different streams and threads; ``found_inf`` may be reused at once). Until :meth:`update`, ``unscale_`` and
        ``step`` use that flag for every optimizer instead of unscaling or checking again (fused optimizers get no
        ``grad_scale``), so every parameter they step must have gone through that path."""
        if not self._enabled:
            return
        if not isinstance(found_inf, torch.Tensor):
            raise TypeError("GradScaler.record_unscaled_grads: found_inf must be a Tensor, but got "
                            f"{type(found_inf).__name__}")
        self._core.record_unscaled_grads(found_inf)

    def reduce_with_found_inf(self, tensors: Sequence[torch.Tensor]) -> None:
        """All-reduce (MAX) ``tensors`` (float32, on the scale's device) over ``process_group`` in the same collective
        as this iteration's ``found_inf``: every rank then holds the maximum of each. ``ampkit.fp8.sync_amaxes`` uses
        it for the FP8 amaxes. The tensors are read when that collective runs, at the next ``unscale_``/``step`` of
        this iteration (they may be written until then); if none comes before :meth:`update`, ``update`` reduces them
        alone; a disabled scaler (or one before its first ``scale``) reduces them at once. Every rank passes tensors
        of the same sizes in the same order."""
        if not self._grouped:
            raise ValueError("GradScaler.reduce_with_found_inf: needs a scaler made with process_group=<the group "
                             "whose ranks must agree, e.g. torch.distributed.group.WORLD>, but this one has none")
        items = None if isinstance(tensors, torch.Tensor) else list(tensors)
        if items is None or not all(isinstance(t, torch.Tensor) for t in items):
            raise TypeError("GradScaler.reduce_with_found_inf: tensors must be a sequence of Tensors, but got "
                            f"{type(tensors).__name__}")
        self._core.reduce_with_found_inf(items)

    def _note_hook_bucket(self, index: int, hook: str) -> None:
        """ampkit.distributed's unscale hooks: refuse a second unscale of one DDP bucket in an iteration (a second
        backward before update() would add scaled grads to unscaled ones and unscale both)."""
        buckets = self._hook_buckets
        if index in buckets:
            raise RuntimeError(
                f"ampkit.distributed.{hook}: DDP bucket {index} was already all-reduced and unscaled in this "
                "iteration; a second backward before scaler.update() would unscale its grads twice. Accumulate "
                "micro-batches under ddp.no_sync() so that only the last backward synchronizes.")
        buckets.add(index)

    def _note_agreed_ranks(self, ranks: tuple) -> None:
        """ampkit.distributed.compress_fsdp: the flags it records in this iteration are the same on every rank of
        ``ranks`` (a sorted tuple of global ranks), so found_inf needs no all-reduce over a group of those ranks."""
        self._agreed_ranks.add(ranks)

    def unscale_factor(self, device: Union[str, torch.device]) -> torch.Tensor:
        """``1 / scale`` on ``device`` as a one-element float32 tensor (the float64 reciprocal rounded once, the
        factor :meth:`unscale_` multiplies by), without a host sync; computed once per scale (a call from another
        stream waits for that computation) and valid until :meth:`update`."""
        return self._core.unscale_factor(str(torch.device(device)))

    def minimize(self, optimizer: torch.optim.Optimizer, scaled_loss: Optional[torch.Tensor] = None):
        """Paddle's ``scaler.minimize(optimizer, scaled_loss)``: :meth:`step` then :meth:`update`, after the
        backward of the scaled loss (with gradient accumulation, once per optimizer step, after the last
        micro-batch's backward). ``scaled_loss`` is taken for Paddle's signature and not used. Returns what
        ``optimizer.step()`` returned."""
        _optimizer("GradScaler.minimize", optimizer)
        if scaled_loss is not None and not isinstance(scaled_loss, torch.Tensor):
            raise TypeError("GradScaler.minimize: scaled_loss must be a Tensor or None, but got "
                            f"{type(scaled_loss).__name__}")
        result = self.step(optimizer)
        self.update()
        return result

    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """Back off or grow the scale on the device from this iteration's inf checks (or set ``new_scale``)."""
        if not self._enabled:
            return
        if self._hook_buckets:  # (no __dict__ access: torch 2.11's Dynamo cannot trace one in a compiled update)
            self._hook_buckets.clear()
        if self._agreed_ranks:
            self._agreed_ranks.clear()
        if new_scale is None and self._traced():
            torch.ops.ampkit._scaler_update(self._handle)
        elif new_scale is None:
            self._core.update()
        elif isinstance(new_scale, torch.Tensor):
            self._core.update_to_tensor(new_scale)
        else:
            self._core.update_to(_number("GradScaler.update", "new_scale", new_scale))

    # ---- state --------------------------------------------------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync), or 1.0 when disabled."""
        return self._core.get_scale()

    def _get_scale_async(self) -> Optional[torch.Tensor]:
        return self._core.get_scale_async()


    def _get_growth_tracker(self) -> int:
        if self._growth_tracker_pending:  # torch's: _init_growth_tracker until the device state exists
            return self._assigned_growth_tracker
        return self._core.get_growth_tracker()

    def get_growth_factor(self) -> float:
        return self._core.get_growth_factor()

    def set_growth_factor(self, new_factor: float) -> None:
        self._core.set_growth_factor(_number("GradScaler.set_growth_factor", "new_factor", new_factor))

    def get_backoff_factor(self) -> float:
        return self._core.get_backoff_factor()

    def set_backoff_factor(self, new_factor: float) -> None:
        self._core.set_backoff_factor(_number("GradScaler.set_backoff_factor", "new_factor", new_factor))

    def get_growth_interval(self) -> int:
        return self._core.get_growth_interval()

    def set_growth_interval(self, new_interval: int) -> None:
        self._core.set_growth_interval(_checks.integer("GradScaler.set_growth_interval", "new_interval", new_interval))

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def device(self) -> str:
        """The device type the scaler was built for (``"cuda"``, ``"cpu"``): the ``device`` argument."""
        return self._device

    def last_step_ran(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[torch.Tensor]:
        """A device bool tensor: whether the last :meth:`update`'s step ran (False: skipped). No sync; it keeps its
        value while held (:meth:`update` writes into a reused flag that nobody else holds). With several optimizers
        on one scaler (a GAN), ``last_step_ran()`` is False when any of them skipped, and
        ``last_step_ran(optimizer)`` says whether that one's step ran (None when it took no part in the last
        iteration)."""
        if optimizer is None:
            return self._core.last_step_ran()
        optimizer = unwrap_optimizer(_optimizer("GradScaler.last_step_ran", optimizer))
        return self._core.last_step_ran_of(id(optimizer))

    def stage(self, optimizer: torch.optim.Optimizer) -> OptState:
        """``optimizer``'s stage in this iteration: ``OptState.READY`` before its :meth:`unscale_` or :meth:`step`,
        ``UNSCALED`` after :meth:`unscale_`, ``STEPPED`` after :meth:`step`; READY again after :meth:`update`. A
        framework's wrapper reads as the optimizer inside (:func:`unwrap_optimizer`). Changes nothing; no sync."""
        optimizer = unwrap_optimizer(_optimizer("GradScaler.stage", optimizer))
        return OptState(self._core.stage(id(optimizer)))

    def stats(self) -> dict:
        """steps, skipped_steps, last_overflow_step (None: none yet), scale, growth_tracker, hysteresis_tracker,
        overflows_at_min_scale. Reads the device (a sync)."""
        stats = self._core.stats()
        if self._growth_tracker_pending:
            stats["growth_tracker"] = self._assigned_growth_tracker
        return stats

    def overflow_report(self) -> list[str]:
        """Names of the parameters whose grads held Inf/NaN in the last :meth:`update`'s step (needs
        ``overflow_report=True``; name them with :meth:`name_parameters`)."""
        return self._core.overflow_report()

    def name_parameters(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Register names for the overflow report, e.g. ``scaler.name_parameters(model.named_parameters())``."""
        if not isinstance(named_parameters, abc.Iterable):
            raise TypeError("GradScaler.name_parameters: named_parameters must be an iterable of (name, tensor) "
                            f"pairs such as model.named_parameters(), but got {type(named_parameters).__name__}")
        pairs = list(named_parameters)
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], torch.Tensor)):
                raise TypeError(f"GradScaler.name_parameters: item {i} must be a (str, Tensor) pair, but got "
                                f"{pair!r:.80}")
        # DTensor parameters (FSDP2) are checked on their local shards: those carry the names.
        self._core.set_parameter_names([(name, _dtensor.local(p)) for name, p in pairs])

    def state_dict(self) -> dict[str, Any]:
        """torch.amp.GradScaler's keys (plain floats and ints) plus ampkit's; ``{}`` when disabled."""
        state = self._core.state_dict()
        if self._growth_tracker_pending:
            state["_growth_tracker"] = self._assigned_growth_tracker
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch.amp.GradScaler's or ampkit's state; on a malformed dict raise and change nothing."""
        if not isinstance(state_dict, abc.Mapping):
            raise TypeError("GradScaler.load_state_dict: state_dict must be a dict (from state_dict()), but got "
                            f"{type(state_dict).__name__}")
        if not self._enabled:
            return
        for key, value in state_dict.items():
            if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
                raise ValueError(f"GradScaler.load_state_dict: {key!r} is out of range (beyond a 64-bit integer), "
                                 f"but got {value}")
        self._core.load_state_dict(dict(state_dict))
        self._assigned_growth_tracker = None  # the loaded one is _init_growth_tracker now, as in torch
        self._growth_tracker_pending = False

    def save(self, path: str) -> None:
        """Write the state in the checkpoint format of C++ ``torch::save(scaler, path)``."""
        self._core.save(str(path))

    def load(self, path: str) -> None:
        """Read a checkpoint written by :meth:`save` or by C++ ``torch::save(scaler, path)``."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GradScaler.load: no checkpoint file at {str(path)!r}")
        self._core.load(str(path))

    # ---- torch.amp.GradScaler's internals, with torch's meaning (frameworks, user code and torch's tests use them)

    @property
    def _scale(self) -> Optional[torch.Tensor]:
        """The scale's 0-dim float32 device tensor; None before the first :meth:`scale` (or when disabled)."""
        return self._core.get_scale_async() if self._enabled else None

    @property
    def _growth_tracker(self) -> Optional[torch.Tensor]:
        """The growth tracker's 0-dim int32 device tensor; None before the first :meth:`scale`."""
        return self._core.get_growth_tracker_async() if self._enabled else None

    @property
    def _init_scale(self) -> float:
        """The scale the device state starts from: ``init_scale``, then the last loaded ``scale``."""
        return self._core.init_scale()

    @property
    def _init_growth_tracker(self) -> int:
        """The growth tracker the device state starts from: 0, then the last loaded ``_growth_tracker``; a value
        assigned here reads back as assigned and, before the first :meth:`scale`, is where the tracker starts (once
        the device state exists it changes nothing else, as in torch)."""
        if self._assigned_growth_tracker is not None:
            return self._assigned_growth_tracker
        return self._core.init_growth_tracker()

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        value = _checks.integer("GradScaler._init_growth_tracker", "value", value)
        self._assigned_growth_tracker = value
        self._growth_tracker_pending = self._enabled and self._core.get_growth_tracker_async() is None

    @property
    def _per_optimizer_states(self) -> _PerOptimizerStates:
        """torch's ``_per_optimizer_states[id(optimizer)]``: ``{"stage": OptState, "found_inf_per_device":
        {device: found_inf}}`` for this iteration, read from the C++ core (read-only)."""
        return _PerOptimizerStates(self._core)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict:
        """torch's: multiply the optimizer's grads by ``inv_scale`` in place and check them for Inf/NaN into a copy
        of ``found_inf`` (left as it is) per device of the grads; returns those copies, ``{device: flag}``. Sparse
        grads are unscaled through their values (FP16 ones coalesced first, as torch). The scaler's own state
        (stages, found_inf, scale) is untouched. ``allow_fp16=False`` refuses FP16 grads."""
        where = "GradScaler._unscale_grads_"
        optimizer = _optimizer(where, optimizer)
        for name, t in (("inv_scale", inv_scale), ("found_inf", found_inf)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}: {name} must be a Tensor, but got {type(t).__name__}")
        _checks.flag(where, "allow_fp16", allow_fp16)
        params = [p for p in _params(optimizer).params if p.grad is not None]
        if not allow_fp16 and any(p.grad.dtype == torch.float16 for p in params):
            raise ValueError("Attempting to unscale FP16 gradients.")
        per_device: dict = {}
        with torch.no_grad():
            for p in params:
                if p.grad.is_sparse:
                    if p.grad.dtype == torch.float16:
                        p.grad = p.grad.coalesce()  # duplicate FP16 entries could overflow when summed later
                    grad = p.grad._values()
                else:
                    grad = p.grad
                per_device.setdefault(grad.device, []).append(grad)
            flags = {}
            for device, grads in per_device.items():
                flag = found_inf.to(device, non_blocking=True, copy=True)
                scale = inv_scale if inv_scale.device == device else inv_scale.to(device, non_blocking=True)
                torch.ops.ampkit.unscale_and_check_(grads, flag, scale)
                flags[device] = flag
        return flags

    def _lazy_init_scale_growth_tracker(self, dev: Union[str, torch.device]) -> None:
        """Creates the device state on ``dev`` before the first :meth:`scale` (Accelerate calls it after
        ``load_state_dict`` on resume); a no-op when it exists on ``dev``."""
        if self._enabled:
            self._core.lazy_init_state(str(torch.device(dev)))
            if self._growth_tracker_pending:
                self._start_growth_tracker()

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict:
        optimizer = unwrap_optimizer(_optimizer("GradScaler._check_inf_per_device", optimizer))
        _, found_inf = self._prepare_fused_step(id(optimizer), _params(optimizer))
        if self._options["spike_skip"] is not None:  # the flag the step decides on: overflows and a spike
            return {found_inf.device: found_inf}
        return self._found_inf_per_device(optimizer)

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict:
        return {t.device: t for t in self._core.found_inf_per_device(id(unwrap_optimizer(optimizer)))}

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled and self._core.in_iteration():
            raise AssertionError("A GradScaler instance may only be pickled at the beginning "
                                 "of an iteration, or at the end after scaler.update().")
        return {"options": self._options, "state": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        options = dict(state["options"])
        device = options.pop("device")
        self.__init__(device, **{k: options[k] for k in ("init_scale", "growth_factor", "backoff_factor",
                                                          "growth_interval", "enabled")},
                      **{k: options[k] for k in ("hysteresis", "min_scale", "max_scale", "scaling",
                                                 "overflow_report", "raise_at_min_scale")},
                      dynamic=options.get("dynamic", True), calibration_margin=options.get("calibration_margin", 2.0),
                      spike_skip=options.get("spike_skip"))
        if state["state"]:
            self.load_state_dict(state["state"])


def load_scaler_state(path: str) -> dict[str, Any]:
    """The state of a scaler checkpoint (C++ ``torch::save(scaler, path)``, ``GradScaler.save``) as a dict that
    ``torch.amp.GradScaler.load_state_dict`` and ``ampkit.GradScaler.load_state_dict`` accept."""
    return _C.read_scaler_state(str(path))


def save_scaler_state(state_dict: dict[str, Any], path: str) -> None:
    """Write a scaler state_dict (torch.amp.GradScaler's or ampkit's) as a checkpoint for C++
    ``torch::load(scaler, path)``."""
    _C.write_scaler_state(dict(state_dict), str(path))
