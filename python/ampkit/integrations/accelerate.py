"""ampkit's GradScaler inside HF Accelerate (and so inside the HF Trainer, which trains through Accelerate).

``attach(accelerator, scaler)``, called before ``accelerator.prepare``, makes the accelerator use ``scaler``
(Accelerate itself only builds torch's scaler, from numbers). What changes:
- ``backward`` scales the loss with ``scaler``; ``step()`` of each prepared optimizer runs ``scaler.step`` and
  ``scaler.update``; fused ``ampkit.optim`` optimizers skip on the device;
- ``optimizer_step_was_skipped`` (and each prepared optimizer's ``step_was_skipped``) is True exactly on the steps
  the scaler skipped: one host read of the scaler's device flag when queried, none otherwise (Accelerate decides
  it by whether ``optimizer.step`` was called, which a fused optimizer always is), so Accelerate's scheduler and
  the HF Trainer do not advance the learning rate on a skipped step;
- ``clip_grad_norm_`` / ``clip_grad_value_`` / ``unscale_gradients`` unscale each optimizer's gradients once per
  step, for FP16 and for BF16 with a scaling scaler (Accelerate unscales only under FP16), so clipping sees true
  gradients; ``scaler.unscale_`` on a prepared optimizer is the same optimizer's unscale;
- FP16 autocast runs on the CPU too (Accelerate turns FP16 off there);
- ``save_state`` / ``load_state`` keep the scaler's full state in ``scaler.pt``.
"""
from __future__ import annotations

import types
from typing import Any

import accelerate
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from ..grad_scaler import GradScaler, OptState, unwrap_optimizer

__all__ = ["attach"]


class _ScaledOptimizer(AcceleratedOptimizer):
    """A prepared optimizer stepped by an attached ampkit scaler: the skip outcome is the scaler's."""

    def step(self, closure=None):
        if self.scaler is None or not self.gradient_state.sync_gradients:
            return super().step(closure)
        self.scaler.step(self.optimizer, closure)
        self.scaler.update()
        self._ampkit_ran = self.scaler.last_step_ran()  # a device flag, held: read only when asked
        self._ampkit_skipped = None

    @property
    def step_was_skipped(self) -> bool:
        if getattr(self, "_ampkit_skipped", None) is None:
            ran = getattr(self, "_ampkit_ran", None)
            self._ampkit_skipped = False if ran is None else not bool(ran)
        return self._ampkit_skipped


def _unscale_gradients(self: accelerate.Accelerator, optimizer: Any = None) -> None:
    """Accelerator.unscale_gradients with the attached scaler: each optimizer's gradients once per step."""
    scaler = self._ampkit_scaler
    if not scaler.is_enabled():
        return
    if optimizer is None:
        optimizers = self._optimizers
    elif isinstance(optimizer, (list, tuple)):
        optimizers = optimizer
    else:
        optimizers = [optimizer]
    for opt in optimizers:
        inner = unwrap_optimizer(opt)
        if scaler.stage(inner) is OptState.READY:
            scaler.unscale_(inner)


def attach(accelerator: Any, scaler: Any) -> None:
    """Makes ``accelerator`` use the ``ampkit.GradScaler`` ``scaler``; call it before ``accelerator.prepare``.

    Args:
        accelerator: an ``accelerate.Accelerator`` built with ``mixed_precision="fp16"`` or ``"bf16"``; its
            optimizers are not prepared yet.
        scaler: the ``ampkit.GradScaler`` on the accelerator's device type (``scaling=False`` for BF16
            check-and-skip without a loss scale).
    """
    where = "ampkit.integrations.accelerate.attach"
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"{where}: accelerator must be an accelerate.Accelerator, but got {type(accelerator).__name__}")
    if not isinstance(scaler, GradScaler):
        raise TypeError(f"{where}: scaler must be an ampkit.GradScaler, but got {type(scaler).__name__}")
    if getattr(accelerator, "_ampkit_scaler", None) is not None:
        raise RuntimeError(f"{where}: this accelerator already has an ampkit scaler attached")
    if accelerator._optimizers:
        raise RuntimeError(f"{where}: call attach before accelerator.prepare; this accelerator has already prepared "
                           f"{len(accelerator._optimizers)} optimizer(s), which keep the scaler they were given")
    if accelerator.mixed_precision not in ("fp16", "bf16"):
        raise ValueError(f"{where}: the accelerator's mixed_precision must be 'fp16' or 'bf16' "
                         f"(Accelerator(mixed_precision=...)), but got {accelerator.mixed_precision!r}")
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
        raise ValueError(f"{where}: {accelerator.distributed_type.value} does its own loss scaling; ampkit's scaler "
                         "works with single-device, DDP and FSDP runs")
    if scaler.is_enabled() and scaler.device != accelerator.device.type:
        raise ValueError(f"{where}: scaler is for device type {scaler.device!r}, but the accelerator runs on "
                         f"{accelerator.device.type!r}")
    accelerator._ampkit_scaler = scaler
    accelerator.scaler = scaler
    accelerator.native_amp = True  # autocast in FP16 on the CPU as well
    accelerator.unscale_gradients = types.MethodType(_unscale_gradients, accelerator)
    prepare_optimizer = accelerator.prepare_optimizer

    def prepare_scaled_optimizer(optimizer, device_placement=None):
        prepared = prepare_optimizer(optimizer, device_placement=device_placement)
        if type(prepared) is AcceleratedOptimizer:
            prepared.__class__ = _ScaledOptimizer
        return prepared

    accelerator.prepare_optimizer = prepare_scaled_optimizer
