"""FP8 training (docs/fp8.md): scaling recipes, :class:`Float8Linear` and :func:`convert`.

The math and the decisions are the C++ core's (``torch.ops.ampkit.fp8_*``, ``<ampkit/fp8.h>``); this module holds
the recipes' settings and the module's buffers and passes them to the ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Union

import torch
from torch import nn

from . import _C

__all__ = ["CurrentScaling", "DelayedScaling", "Float8Linear", "convert", "skipped_layers"]


@dataclass(frozen=True)
class CurrentScaling:
    """Each operand's scale from its own amax, computed in the same call (dynamic scaling).

    ``granularity``: ``"tensorwise"`` (what :class:`Float8Linear` implements) or ``"rowwise"`` (accepted by
    ``torch.ops.ampkit.fp8_quantize``, not yet by the layer). ``power_of_2`` rounds each scale down to a power of
    two. ``amax_epsilon`` clamps the amax from below (1e-12: an all-zero tensor never divides by zero).
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
            return torch.ops.ampkit.fp8_linear(input, self.weight, self.bias, recipe.fp8_format, recipe.amax_epsilon,
                                               recipe.power_of_2)
        histories = [self.amax_history_input, self.amax_history_weight, self.amax_history_grad_output]
        scales = [self.scale_input, self.scale_weight, self.scale_grad_output]
        if self.training:
            torch.ops.ampkit.fp8_update_amax_history_and_scale_(
                histories, scales, recipe.amax_compute_algo, self._fp8_maxes, recipe.margin)
        return torch.ops.ampkit.fp8_linear_delayed(input, self.weight, self.bias, histories, scales,
                                                   recipe.fp8_format)

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
