"""ampkit in ``lightning.pytorch``: ``Trainer(plugins=[AmpkitPrecision("bf16-mixed", device="cuda")])``.

See ampkit.integrations._lightning for what the plugin changes against Lightning's ``MixedPrecision``, and
docs/frameworks.md. For the standalone ``pytorch_lightning`` package use ampkit.integrations.pytorch_lightning.
"""
import lightning.pytorch as _pl

from ._lightning import make_precision_plugin as _make

AmpkitPrecision = _make(_pl, __name__)

__all__ = ["AmpkitPrecision"]
