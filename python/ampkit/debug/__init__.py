"""ampkit.debug: which module, and which op in it, is the precision problem of one training step.

``replay`` runs one step twice, as the user's low-precision run (under ``ampkit.autocast``, or the model as
``ampkit.decorate`` left it) and as a float64 reference on a copy of the model with autocast off, and compares the
two per module (forward outputs, output and parameter gradients) and per op (through a ``TorchFunctionMode``). It
leaves the model, its gradients, the optimizer, the scaler, the RNG, autocast and the hooks as it found them. This
file owns the public names only; ``_trace`` records and compares the two runs, ``_report`` ranks what they found
and words the suggestion (``ReplayReport``), ``_replay`` checks the arguments and drives the runs.
"""
from ._replay import replay
from ._report import HEALTHY_EPS as HEALTHY_EPS
from ._report import ReplayReport

__all__ = ["replay", "ReplayReport"]
