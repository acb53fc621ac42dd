"""torch.compile support for ampkit.GradScaler and ampkit.optim.

NOTE [Compiled steps]
Dynamo cannot trace into pybind classes, so a compiled training step would break its graph at every GradScaler
method. Under ``torch.compile`` the Python GradScaler instead calls its C++ core through the custom ops below,
which take the core as an opaque reference object (``torch.library.register_opaque_type``): the graph keeps each
call, in program order (ops with an opaque argument have ordered effects), and when the graph runs each op runs
the same C++ method the eager path runs. The state machine (stages per optimizer, found_inf, hysteresis, the
statistics, errors) stays in one place, the C++ ``ampkit::GradScaler``. Two differences a graph needs:

* the grads are passed explicitly, because a compiled step that runs the backward assigns ``.grad`` only after
  its graph has run;
* the tensors the ops return are copies (the scale, found_inf), so that nothing in the graph aliases the scaler's
  buffers, which ``update()`` rewrites in place; a fused optimizer stepped after ``unscale_()`` gets a
  ``grad_scale`` of 1 instead of ``None`` (multiplying by 1 changes no bit).

ampkit.optim's step is plain Python over ``torch.ops.ampkit.*`` when compiling (ampkit/optim/_traced.py), and it
decides nothing: at trace time the C++ core plans each group's step (``core::plan_step``, the plan the eager step
follows: checks, master modes, which parameters the fused kernels take, the state entries to create, the fused
calls and the entries each reads) on the group's real values, its parameters and the traced grads' layouts. The
traced code creates the entries with ``make_optim_state`` (what the eager step creates them with) and makes the
calls; it compares each group value with the one planned with, and the state entries and grad layouts it passes
to the plan are read in traced code, which makes them guards of the graph: a changed value (a float lr set by a
scheduler) recompiles and is planned again. A tensor lr is read by the kernels and changes without recompiling.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

_LIVE: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def register(obj: Any) -> None:
    """Makes ``obj`` reachable by ``live(id(obj))`` from functions that run at trace time."""
    _LIVE[id(obj)] = obj


def live(key: int) -> Any:
    return _LIVE[key]

SUPPORTED = False  # whether this torch takes opaque objects in custom ops (compiled GradScaler methods)


# NOTE [Scale hand-over under compile]
# A traced GradScaler.step gives grad_scale/found_inf to the optimizer's step through this dict (keyed by the
# optimizer's id, removed after the step), not as attributes of the optimizer as the eager step does: torch 2.11's
# Dynamo refuses a setattr on an optimizer inside a graph. ampkit.optim's scalars() below is what
# both steps read. It lives here, below both, so that the scaler and the optimizers import neither the other.
HANDED_OVER: dict[int, tuple] = {}


def scalars(optimizer) -> tuple:
    """The (grad_scale, found_inf) of an ampkit.optim step: handed over by a traced scaler step (NOTE [Scale
    hand-over under compile]), else the attributes a scaler (or the user) set on the optimizer, else (None, None)."""
    if HANDED_OVER:
        handed = HANDED_OVER.get(id(optimizer))
        if handed is not None:
            return handed
    return getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)


def is_compiling() -> bool:
    return torch.compiler.is_compiling()


def constant(fn):
    """``fn`` runs at trace time, on constant arguments, and its result is a constant of the graph."""
    return torch.compiler.assume_constant_result(fn)


try:
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase
except ImportError:  # an older torch: GradScaler methods break the graph, as torch's own do
    OpaqueBase = object
    register_opaque_type = None


class ScalerHandle(OpaqueBase):
    """The C++ GradScaler as an opaque object of the compiled graph."""

    def __init__(self, core: Any) -> None:
        self.core = core


if register_opaque_type is not None:
    try:
        register_opaque_type(ScalerHandle, typ="reference")
        SUPPORTED = True
    except (TypeError, ValueError, AssertionError):
        SUPPORTED = False


def _result_device(grads: list) -> torch.device:
    """Where _scaler_prepare_fused_step returns its copies: the first grad's device (the scaler's own device may
    be another one; the optimizer moves the copies to each parameter's device)."""
    return grads[0].device if grads else torch.device("cpu")


def _ones_like_scale(like: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=like.device)


def _define_ops() -> None:
    """Registers the GradScaler ops (a torch whose custom ops do not take the opaque type raises here)."""

    @torch.library.custom_op("ampkit::_scaler_scale_factor", mutates_args=())
    def _scaler_scale_factor(scaler: ScalerHandle, like: torch.Tensor) -> torch.Tensor:
        """The scale on ``like``'s device (created there by the first call), as GradScaler.scale multiplies;
        ``like`` is the tensor being scaled (detached): the loss that spike_skip watches."""
        factor = scaler.core.scale_factor(like)
        scaler.core.observe_loss(like)
        return factor

    @_scaler_scale_factor.register_fake
    def _(scaler, like):
        return torch.empty((), dtype=torch.float32, device=like.device)

    @torch.library.custom_op("ampkit::_scaler_unscale_", mutates_args=("grads",))
    def _scaler_unscale_(scaler: ScalerHandle, key: int, params: list[torch.Tensor],
                         grads: list[torch.Tensor]) -> None:
        """GradScaler.unscale_ of the optimizer ``key``: grads[i] is params[i]'s grad."""
        scaler.core.unscale_params_(key, params, grads)

    @_scaler_unscale_.register_fake
    def _(scaler, key, params, grads):
        return None

    @torch.library.custom_op("ampkit::_scaler_prepare_fused_step", mutates_args=())
    def _scaler_prepare_fused_step(scaler: ScalerHandle, key: int, params: list[torch.Tensor],
                                   grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """GradScaler.step's checks and inf check for a fused optimizer: [grad_scale, found_inf] (copies)."""
        scaler.core.begin_step(key)
        grad_scale, found_inf = scaler.core.prepare_fused_step(key, params, grads)
        device = _result_device(grads)
        grad_scale = _ones_like_scale(found_inf) if grad_scale is None else grad_scale
        return [grad_scale.to(device, copy=True), found_inf.to(device, copy=True)]

    @_scaler_prepare_fused_step.register_fake
    def _(scaler, key, params, grads):
        return [torch.empty((), dtype=torch.float32, device=_result_device(grads)) for _ in range(2)]

    @torch.library.custom_op("ampkit::_scaler_mark_stepped", mutates_args=())
    def _scaler_mark_stepped(scaler: ScalerHandle, key: int) -> None:
        scaler.core.mark_stepped(key)

    @_scaler_mark_stepped.register_fake
    def _(scaler, key):
        return None

    @torch.library.custom_op("ampkit::_scaler_update", mutates_args=())
    def _scaler_update(scaler: ScalerHandle) -> None:
        scaler.core.update()

    @_scaler_update.register_fake
    def _(scaler):
        return None

    try:  # ordered with one another (torch also infers it from the opaque argument)
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
        for _op in (_scaler_scale_factor, _scaler_unscale_, _scaler_prepare_fused_step, _scaler_mark_stepped,
                    _scaler_update):
            _register_effectful_op(_op._opoverload, _EffectType.ORDERED)
    except (ImportError, AttributeError, RuntimeError):
        pass

if SUPPORTED:
    try:
        _define_ops()
    except Exception:  # noqa: BLE001 - this torch's custom ops cannot take the handle: the eager path only
        SUPPORTED = False
