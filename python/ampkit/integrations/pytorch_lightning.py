"""ampkit in the standalone ``pytorch_lightning`` package: the same plugin as ampkit.integrations.lightning,
built on ``pytorch_lightning``'s classes (its Trainer checks plugins against them)."""
import pytorch_lightning as _pl

from ._lightning import make_precision_plugin as _make

AmpkitPrecision = _make(_pl, __name__)

__all__ = ["AmpkitPrecision"]
