"""ampkit in training frameworks: one module per framework, each importing its framework only when imported.

- ``ampkit.integrations.lightning.AmpkitPrecision``: a precision plugin for ``lightning.pytorch``
  (``ampkit.integrations.pytorch_lightning.AmpkitPrecision`` for the standalone ``pytorch_lightning`` package);
- ``ampkit.integrations.accelerate.attach(accelerator, scaler)``: ampkit's scaler inside HF Accelerate, and so inside
  the HF Trainer.

docs/frameworks.md says what each adapter changes and what each framework still does on its own.
"""
