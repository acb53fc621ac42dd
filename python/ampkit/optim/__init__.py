"""ampkit.optim: Adam, AdamW and SGD on ampkit's fused kernels (``torch.ops.ampkit.adamw_step_`` / ``sgd_step_``).

They take torch.optim's constructor arguments plus ``master_weights``: ``None`` (default) decides per parameter
when its state is created (on for FP16/BF16 parameters), ``True``/``False`` forces it, ``"remainder"`` (BF16
parameters) keeps the exact FP32 master as the BF16 weight plus an int16 ``state[p]["param_remainder"]`` (2 bytes
per parameter instead of 4; ties round away from zero, see ``master_from_remainder``; a master given by
``init_master_params`` keeps the cast BF16 weight as it is, so at exact ties that the cast rounded to even it is
held 1 ulp closer to the weight), and two modes keep BF16 parameters without any FP32 copy (Adam, AdamW, SGD; the
update computed in FP32 in the same pass): ``"stochastic"`` writes the result with stochastic rounding (unbiased;
Philox4x32-10 keyed by ``state[p]["sr_seed"]``, a per-parameter int64 seed drawn from torch's default generator,
and the counter (element, step): reproducible, resumed bit-identically from a state dict, the same bits on CPU and
CUDA) and ``"kahan"`` keeps a BF16 compensation ``state[p]["kahan_comp"]`` of what the weight's rounding lost (2
bytes per parameter). With a master, the FP32
copy is ``optimizer.state[p]["master_param"]``: the kernel reads the low-precision grad, unscales it in
registers, updates the master and the FP32 moments and writes the rounded weight back, in one pass. Optimizer
states are FP32 whatever the parameter's dtype (and stay FP32 through ``load_state_dict``; ``kahan_comp`` stays
BF16 and ``sr_seed`` int64).

``_step_supports_amp_scaling = True``: ``ampkit.GradScaler`` and ``torch.amp.GradScaler`` hand them
``grad_scale``/``found_inf`` and the skip on overflow happens on the device, without a host sync. As torch's fused
optimizers, a step that unscales leaves ``p.grad`` unscaled (code that logs or clips after the step reads true
gradients); ``write_unscaled_grads=False`` leaves the grads scaled and saves that write (2 or 4 bytes per
parameter). On the CPU, FP32 steps are bit-identical to torch.optim's ``fused=True`` (AVX2/AVX-512 builds of
torch).

DTensor parameters (FSDP2's ``fully_shard``): each rank updates its local shards, and the states are DTensors of
the parameter's layout as torch.optim's (``step`` a plain scalar tensor, and ``sr_seed``, the same on every rank),
so ``state_dict()`` and ``torch.distributed.checkpoint`` see the same structure as with torch.optim, and a
checkpoint saved on N ranks loads on M (8-bit states excepted: they are packed per local shard). Stochastic rounding
keys each shard apart: a sharded run is not bit-identical to an unsharded one (NOTE [Stochastic rounding of DTensor
parameters] in ampkit/_dtensor.py).
"""
from __future__ import annotations

from ._base import FusedOptimizer
from ._optimizers import LAMB, SGD, Adam, AdamW

__all__ = ["Adam", "AdamW", "SGD", "LAMB", "FusedOptimizer"]

# The public classes keep the module they are public in (class reprs, and the path a pickled optimizer names).
for _cls in (Adam, AdamW, SGD, LAMB, FusedOptimizer):
    _cls.__module__ = __name__
del _cls

from . import lr_scheduler as lr_scheduler  # noqa: E402  (ampkit.optim.lr_scheduler)
