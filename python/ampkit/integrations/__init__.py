"""ampkit in training frameworks: one module per framework, each importing its framework only when imported.

- ``ampkit.integrations.lightning.AmpkitPrecision``: a precision plugin for ``lightning.pytorch``
  (``ampkit.integrations.pytorch_lightning.AmpkitPrecision`` for the standalone ``pytorch_lightning`` package);
- ``ampkit.integrations.accelerate.attach(accelerator, scaler)``: ampkit's scaler inside HF Accelerate, and so inside
  the HF Trainer.

docs/frameworks.md says what each adapter changes and what each framework still does on its own.

Without an adapter, a framework may drive ampkit's optimizers wrongly; the checks here, called from the optimizers'
step, say so once per optimizer, naming the adapter. They read attributes only: no import of a framework, no host
sync.
"""
from __future__ import annotations

import warnings
import weakref

_warned: weakref.WeakSet = weakref.WeakSet()


def _check_unattached_accelerate(optimizer) -> None:
    """Warns once per optimizer when HF Accelerate's loss scaler steps a fused ``ampkit.optim`` optimizer without
    ``attach``. Accelerate (and the HF Trainer with ``fp16=True``) decides that a step was skipped by whether the
    scaler called ``optimizer.step``, which it tells by patching the optimizer's ``step`` for the scaler's call
    (``accelerate.optimizer.patch_optimizer_step``). A fused optimizer is called on every step and skips on the
    device, so the learning-rate schedule would advance on skipped steps, as with torch's fused optimizers.

    Args:
        optimizer: the ampkit optimizer being stepped with a scaler's ``found_inf``; not modified.
    """
    patched = optimizer.__dict__.get("step")
    if getattr(patched, "__module__", None) != "accelerate.optimizer" or optimizer in _warned:
        return
    _warned.add(optimizer)
    name = type(optimizer).__name__
    warnings.warn(
        f"ampkit.optim.{name} is stepped by HF Accelerate's loss scaler (the HF Trainer's with fp16=True), which "
        "takes a step as skipped only when optimizer.step() is not called; ampkit's fused optimizers are called on "
        "every step and skip on the device, so optimizer_step_was_skipped stays False and the learning-rate "
        "schedule advances on skipped steps. Call ampkit.integrations.accelerate.attach(accelerator, "
        "ampkit.GradScaler(...)) before accelerator.prepare (HF Trainer: attach(trainer.accelerator, scaler) "
        "before trainer.train()).", UserWarning, stacklevel=2)

