"""FP8 training (docs/fp8.md): scaling recipes, :class:`Float8Linear` and :func:`convert`.

The math and the decisions are the C++ core's (``torch.ops.ampkit.fp8_*``, ``<ampkit/fp8.h>``); this module holds
the recipes' settings and the module's buffers and passes them to the ops.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch
from torch import nn

from ._native import _C

__all__ = ["CurrentScaling", "DelayedScaling", "Float8Linear", "QuantizationReport", "convert", "current_amaxes",
           "quantization_report", "skipped_layers", "sync_amaxes"]


@dataclass(frozen=True)
class CurrentScaling:
    """Each operand's scale from its own amax, computed in the same call (dynamic scaling).

    ``granularity``: ``"tensorwise"`` (one scale per operand) or ``"rowwise"`` (one scale per row of each GEMM
    operand, along the dimension the GEMM sums over: more accurate with outliers, each operand quantized once per
    GEMM it enters). ``power_of_2`` rounds each scale down to a power of two. ``amax_epsilon`` clamps the amax
    from below (1e-12: an all-zero tensor never divides by zero).
    ``fp8_format``: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``.
    """

    granularity: str = "tensorwise"
    power_of_2: bool = False
    amax_epsilon: float = 1e-12
    fp8_format: str = "hybrid"


@dataclass(frozen=True)
class DelayedScaling:
    """Scales from the amaxes of earlier iterations (Transformer Engine's default recipe).

    Each operand keeps an amax history of ``amax_history_len`` rows; at every training forward the scale becomes
    ``(fp8_max / amax) / 2**margin`` with amax the maximum over the history (``"max"``) or its latest entry
    (``"most_recent"``), the history rolls and the new amax is recorded.
    """

    amax_history_len: int = 1024
    margin: float = 0.0
    amax_compute_algo: str = "max"
    fp8_format: str = "hybrid"


Recipe = Union[CurrentScaling, DelayedScaling]


def _check_recipe(recipe: Recipe) -> None:
    if isinstance(recipe, CurrentScaling):
        _C.fp8_check_current_scaling(recipe.granularity, recipe.power_of_2, recipe.amax_epsilon, recipe.fp8_format)
    elif isinstance(recipe, DelayedScaling):
        _C.fp8_check_delayed_scaling(recipe.amax_history_len, recipe.margin, recipe.amax_compute_algo,
                                     recipe.fp8_format)
    else:
        raise TypeError(f"ampkit.fp8: recipe must be a CurrentScaling or a DelayedScaling, but got {type(recipe)}")


_ROLES = ("input", "weight", "grad_output")
_BUFFERS = ("amax_history_input", "amax_history_weight", "amax_history_grad_output", "scale_input", "scale_weight",
            "scale_grad_output")


class Float8Linear(nn.Linear):
    """An :class:`torch.nn.Linear` whose three GEMMs run in FP8 on ``torch._scaled_mm``.

    ``y = q(x) q(W)^T + b``, ``dX = q(dY) q(W)``, ``dW = q(x)^T q(dY)`` (``torch.ops.ampkit.fp8_linear``); the output
    has the input's dtype, or autocast's under autocast. With :class:`DelayedScaling` the module holds the buffers
    ``amax_history_{input,weight,grad_output}`` and ``scale_{input,weight,grad_output}`` (saved in ``state_dict``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: Optional[Recipe] = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe if recipe is not None else CurrentScaling()
        _check_recipe(self.recipe)
        reason = _C.fp8_unsupported_reason(in_features, out_features)
        if reason:
            raise ValueError(f"ampkit.fp8.Float8Linear: {reason}")
        # The formats' maxima for (input, weight, grad_output), looked up once (no C++ call in the traced forward).
        self._fp8_maxes = list(_C.fp8_maxes(self.recipe.fp8_format))
        self._fp8_dtypes = list(_C.fp8_dtypes(self.recipe.fp8_format))
        self._fp8_stats: Optional[tuple] = None  # (report, layer name) inside quantization_report()
        self._init_scaling_buffers(self.weight.device)

    def _init_scaling_buffers(self, device: torch.device) -> None:
        if not isinstance(self.recipe, DelayedScaling):
            return
        rows = self.recipe.amax_history_len
        for name in _BUFFERS:
            if name.startswith("amax_history"):
                self.register_buffer(name, torch.zeros(rows, dtype=torch.float32, device=device))
            else:
                self.register_buffer(name, torch.ones(1, dtype=torch.float32, device=device))

    # Scaling state that stays FP32 when the module is cast (decorate, .to(dtype), .half()): its precision decides
    # the scales.
    _ampkit_fp32_buffers = _BUFFERS

    def _apply(self, fn, recurse=True):
        kept = {name: buf for name, buf in self._buffers.items() if name in _BUFFERS and buf is not None}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(new.device)
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Optional[Recipe] = None) -> "Float8Linear":
        """A Float8Linear sharing ``linear``'s parameters (the same Parameter objects: an optimizer that holds
        them keeps working)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  recipe=recipe)
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_scaling_buffers(linear.weight.device)
        new.train(linear.training)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        recipe = self.recipe
        if isinstance(recipe, CurrentScaling):
            out = torch.ops.ampkit.fp8_linear(input, self.weight, self.bias, recipe.fp8_format, recipe.amax_epsilon,
                                              recipe.power_of_2, granularity=recipe.granularity)
        else:
            histories = [self.amax_history_input, self.amax_history_weight, self.amax_history_grad_output]
            scales = [self.scale_input, self.scale_weight, self.scale_grad_output]
            if self.training:
                torch.ops.ampkit.fp8_update_amax_history_and_scale_(
                    histories, scales, recipe.amax_compute_algo, self._fp8_maxes, recipe.margin)
            out = torch.ops.ampkit.fp8_linear_delayed(input, self.weight, self.bias, histories, scales,
                                                      recipe.fp8_format)
        if self._fp8_stats is not None:
            self._count(0, input)
            self._count(1, self.weight)
            if out.requires_grad:
                out.register_hook(lambda grad: self._count(2, grad))
        return out

    def _count(self, role: int, x: torch.Tensor) -> None:
        """quantization_report: what quantizing ``x`` as operand ``role`` (input, weight, grad_output) loses, with the
        scale the layer quantizes it with (rowwise: the rows of its first GEMM)."""
        recipe = self.recipe
        x = x.detach().reshape(-1, x.shape[-1]) if x.dim() != 2 else x.detach()
        fp8_max = self._fp8_maxes[role]
        if isinstance(recipe, DelayedScaling):
            scale = (self.scale_input, self.scale_weight, self.scale_grad_output)[role]
        else:
            dims = (1,) if recipe.granularity == "rowwise" else None
            amax = (torch.zeros((x.shape[0], 1) if dims else (), device=x.device) if x.shape[-1] == 0 or x.numel() == 0
                    else torch.linalg.vector_norm(x, float("inf"), dim=dims, keepdim=dims is not None).float())
            scale = torch.ops.ampkit.fp8_compute_scale(amax, fp8_max, 0.0, recipe.amax_epsilon, recipe.power_of_2)
        dtype = self._fp8_dtypes[role]
        report, name = self._fp8_stats
        report._record(name, _ROLES[role], x.numel(), torch.ops.ampkit.fp8_quantization_stats(x, scale, dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def convert(model: nn.Module, recipe: Optional[Recipe] = None,
            module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Replace every :class:`torch.nn.Linear` of ``model`` (itself included) by a :class:`Float8Linear` that shares
    its parameters, in place, and return the model.

    ``module_filter_fn(module, fqn)`` returning False keeps a layer as it is; layers ``torch._scaled_mm`` cannot take
    (features not multiples of 16) are kept too, and :func:`skipped_layers` says which and why.
    """
    recipe = recipe if recipe is not None else CurrentScaling()
    _check_recipe(recipe)
    skipped: Dict[str, str] = {}

    def swap(module: nn.Module, fqn: str) -> Optional[nn.Module]:
        if type(module) is not nn.Linear:
            return None
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            skipped[fqn] = "excluded by module_filter_fn"
            return None
        reason = _C.fp8_unsupported_reason(module.in_features, module.out_features)
        if reason:
            skipped[fqn] = reason
            return None
        return Float8Linear.from_linear(module, recipe)

    root = swap(model, "")
    if root is not None:
        model = root
    else:
        for fqn, module in list(model.named_modules()):
            for name, child in list(module.named_children()):
                child_fqn = f"{fqn}.{name}" if fqn else name
                new = swap(child, child_fqn)
                if new is not None:
                    setattr(module, name, new)
    model._ampkit_fp8_skipped = skipped
    return model


def skipped_layers(model: nn.Module) -> Dict[str, str]:
    """The layers :func:`convert` left as they were, by qualified name, with the reason."""
    return dict(getattr(model, "_ampkit_fp8_skipped", {}))


def current_amaxes(model: nn.Module) -> List[torch.Tensor]:
    """Row 0 of every amax history of ``model``'s delayed-scaling :class:`Float8Linear` layers (the amaxes this
    iteration recorded), as views, in module order (input, weight, grad_output per layer)."""
    rows = []
    for module in model.modules():
        if isinstance(module, Float8Linear) and isinstance(module.recipe, DelayedScaling):
            for name in _BUFFERS[:3]:
                rows.append(getattr(module, name)[:1])
    return rows


def sync_amaxes(model: nn.Module, scaler: Any = None, process_group: Any = None) -> None:
    """Make every rank's FP8 scales agree: all-reduce (MAX) the amaxes this iteration recorded (:func:`current_amaxes`)
    over the ranks, in one collective. Call it once per iteration, after backward and before the optimizer step.

    With ``scaler`` (an :class:`ampkit.GradScaler` made with ``process_group=``), the amaxes travel in the scaler's
    ``found_inf`` all-reduce at its next ``unscale_``/``step`` (:meth:`ampkit.GradScaler.reduce_with_found_inf`): no
    collective of their own. Otherwise they are all-reduced now over ``process_group`` (the default group when None).
    Current scaling keeps no amaxes: nothing to do.
    """
    rows = current_amaxes(model)
    if scaler is not None:
        if process_group is not None:
            raise ValueError("ampkit.fp8.sync_amaxes: pass scaler or process_group, not both (the amaxes are reduced "
                             "over the scaler's process_group)")
        if rows:
            scaler.reduce_with_found_inf(rows)
        return
    if not rows:
        return
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ampkit.fp8.sync_amaxes: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first or pass a scaler with a process_group")
    group = process_group if process_group is not None else dist.group.WORLD
    _C.all_reduce_max(rows, group)


class QuantizationReport:
    """What FP8 quantization lost in each :class:`Float8Linear` operand while :func:`quantization_report` was open:
    per layer and operand (``input``, ``weight``, ``grad_output``), the elements quantized and the fractions that
    saturated (clamped to the format's largest value), were flushed to zero (nonzero values below half the smallest
    subnormal) or were NaN. A diverging FP8 run names its layer here."""

    def __init__(self) -> None:
        # (layer, operand) -> [numel, counts (int64[3] on the device), the record that first met a NaN (int64, -1)]
        self._entries: Dict[tuple, list] = {}
        self._records = 0  # quantizations counted, in the order they ran

    def _record(self, layer: str, operand: str, numel: int, counts: torch.Tensor) -> None:
        entry = self._entries.get((layer, operand))
        if entry is None:
            entry = self._entries[(layer, operand)] = [0, torch.zeros_like(counts), torch.full_like(counts[0], -1)]
        entry[0] += numel
        entry[1] += counts
        # On the device (no sync): where a NaN was first met, so that the NaN's origin can be told from where it
        # spread to (a NaN gradient reaches every layer before it in the backward).
        entry[2] = torch.where((entry[2] < 0) & (counts[2] > 0), self._records, entry[2])
        self._records += 1

    def rows(self) -> List[Dict[str, Any]]:
        """One dict per (layer, operand), in the order they were first quantized: ``layer``, ``operand``,
        ``numel``, ``saturated``, ``flushed``, ``nan`` (counts), ``saturated_fraction``, ``flushed_fraction`` and
        ``first_nan`` (the position of the quantization that first met a NaN among all counted, None if none).
        Reads the device counts: synchronizes."""
        out = []
        for (name, operand), (numel, counts, nan_at) in self._entries.items():
            saturated, flushed, nan = (int(c) for c in counts.tolist())
            first = int(nan_at)
            out.append(dict(layer=name, operand=operand, numel=numel, saturated=saturated, flushed=flushed,
                            nan=nan, saturated_fraction=saturated / numel if numel else 0.0,
                            flushed_fraction=flushed / numel if numel else 0.0,
                            first_nan=first if first >= 0 else None))
        return out

    def worst(self, n: int = 5) -> List[Dict[str, Any]]:
        """The ``n`` rows most worth a look: those that met a NaN, the first to meet one first (where it came
        from, not where it spread to), then the largest saturated plus flushed fraction."""
        def key(r):
            return (r["first_nan"] is None, r["first_nan"] or 0, -(r["saturated_fraction"] + r["flushed_fraction"]))
        return sorted(self.rows(), key=key)[:n]

    def __str__(self) -> str:
        lines = [f"{'layer':<32} {'operand':<12} {'numel':>12} {'saturated':>10} {'flushed':>10} {'nan':>8}"]
        for r in self.rows():
            lines.append(f"{r['layer']:<32} {r['operand']:<12} {r['numel']:>12} {r['saturated_fraction']:>10.2e} "
                         f"{r['flushed_fraction']:>10.2e} {r['nan']:>8}")
        return "\n".join(lines)


@contextlib.contextmanager
def quantization_report(model: nn.Module) -> Iterator[QuantizationReport]:
    """Count, for every :class:`Float8Linear` of ``model``, what quantizing its operands loses in the forwards and
    backwards run inside the ``with`` block (each layer's scales as it quantizes with them; rowwise: the rows of the
    operand's first GEMM). The counts stay on the device until read. Costs one extra pass over each operand::

        with ampkit.fp8.quantization_report(model) as report:
            loss = model(x).loss
            loss.backward()
        print(report.worst(3))
    """
    report = QuantizationReport()
    layers = [(name or type(m).__name__, m) for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    for name, m in layers:
        m._fp8_stats = (report, name)
    try:
        yield report
    finally:
        for _, m in layers:
            m._fp8_stats = None
