"""The Lightning precision plugin, built once per Lightning package (``lightning.pytorch`` and the standalone
``pytorch_lightning`` have separate class hierarchies, and the Trainer checks plugins against its own).

The plugin is a ``MixedPrecision`` (Lightning and other code that check for one accept it). What it changes
against Lightning's ``MixedPrecision``:
- the forward runs under ``ampkit.autocast`` (with ``fp32_ops``/``lowp_ops`` overrides if given);
- ampkit's fused optimizers can clip: gradients are unscaled in place once, before the clipping hooks, when the
  Trainer clips (``gradient_clip_val``) or the optimizer is not a fused one; otherwise the fused step unscales
  inline (no extra pass);
- any ``ampkit.GradScaler`` is accepted, for BF16 too (check-and-skip with ``scaling=False``, or dynamic scaling);
- schedulers stepped per optimizer step do not advance on a step the scaler skipped (``SkipAware``);
- a ``training_step`` that returns None (a skipped batch) leaves the scaler alone: no unscale, step or update,
  clipping included;
- with ``overflow_report=True`` the scaler's report names parameters as the LightningModule does;
- ``"16-true"``/``"bf16-true"``: ampkit's O2 (``ampkit.decorate`` with the optimizer: FP32 masters from the FP32
  weights, norms kept FP32), batches cast to the low-precision dtype, ``LightningModule.dtype`` that dtype.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Optional

import torch

_PRECISIONS = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16,
               "16-true": torch.float16, "bf16-true": torch.bfloat16}


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if torch.is_floating_point(data) else data
    if isinstance(data, dict):
        return type(data)((k, _cast_floating(v, dtype)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
        return type(data)(*(_cast_floating(v, dtype) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_cast_floating(v, dtype) for v in data)
    return data


def make_precision_plugin(pl: Any, module: str) -> type:
    """The plugin class for the Lightning package ``pl`` (``lightning.pytorch`` or ``pytorch_lightning``), named as
    a class of ``module`` (Lightning keys the plugin's checkpoint state by its ``__qualname__``)."""
    from importlib import import_module

    precision_module = import_module(pl.__name__ + ".plugins.precision")
    Precision, MixedPrecision = precision_module.Precision, precision_module.MixedPrecision
    LightningModule = pl.LightningModule
    MisconfigurationException = import_module(pl.__name__ + ".utilities.exceptions").MisconfigurationException
    import ampkit
    from ampkit.grad_scaler import OptState, unwrap_optimizer
    from ampkit.optim import FusedOptimizer
    from ampkit.optim.lr_scheduler import SkipAware

    def lightning_module(model: Any) -> Optional[Any]:
        """The LightningModule inside the strategy's wrappers (DDP's ``module``, Lightning's ``_forward_module``)."""
        while model is not None and not isinstance(model, LightningModule):
            inner = getattr(model, "_forward_module", None)
            model = getattr(model, "module", None) if inner is None else inner
        return model

    class AmpkitPrecision(MixedPrecision):
        """Mixed precision with ampkit in a Lightning ``Trainer``: ``Trainer(plugins=[AmpkitPrecision(...)])``.

        A ``MixedPrecision`` whose methods are all its own: ``MixedPrecision.__init__`` (which builds a
        ``torch.amp.GradScaler`` and refuses a scaler for BF16) is not called, and the base ``Precision``'s
        behaviour is reached by name where ``MixedPrecision`` would scale, unscale or refuse fused optimizers.

        Args:
            precision: ``"16-mixed"`` / ``"bf16-mixed"`` (O1: autocast, FP32 weights) or ``"16-true"`` /
                ``"bf16-true"`` (O2: FP16/BF16 weights with FP32 masters in the one ``ampkit.optim`` optimizer;
                single-device strategies).
            device: the device type autocast and the default scaler use (``"cuda"``, ``"cpu"``).
            scaler: an ``ampkit.GradScaler``; None gives a default one for FP16 and none for BF16.
            fp32_ops, lowp_ops: ``ampkit.autocast`` overrides for the forward.
        """

        def __init__(self, precision: str, device: str, scaler: Optional[ampkit.GradScaler] = None, *,
                     fp32_ops: Iterable[str] = (), lowp_ops: Iterable[str] = ()) -> None:
            where = "AmpkitPrecision"
            if precision not in _PRECISIONS:
                raise ValueError(f"{where}: precision must be one of {sorted(_PRECISIONS)}, but got {precision!r}")
            if not isinstance(device, str) or device not in ("cpu", "cuda"):
                raise ValueError(f"{where}: device must be 'cpu' or 'cuda', but got {device!r}")
            if scaler is not None and not isinstance(scaler, ampkit.GradScaler):
                raise TypeError(f"{where}: scaler must be an ampkit.GradScaler or None, but got "
                                f"{type(scaler).__name__} (for torch.amp.GradScaler use Lightning's MixedPrecision)")
            self.precision = precision
            self.device = device
            self.dtype = _PRECISIONS[precision]
            if scaler is None and self.dtype == torch.float16:
                scaler = ampkit.GradScaler(device)
            self.scaler = scaler
            self._fp32_ops = tuple(fp32_ops)
            self._lowp_ops = tuple(lowp_ops)
            self._skipped_backward = False  # within optimizer_step: this batch's training_step returned None

        @property
        def _true(self) -> bool:
            return self.precision.endswith("-true")

        def _scaling(self) -> bool:
            return self.scaler is not None and self.scaler.is_enabled()

        # ---- set-up ------------------------------------------------------------------------------------------

        def connect(self, model: Any, optimizers: list, lr_schedulers: list) -> tuple:
            if self._true:
                if not isinstance(model, LightningModule):
                    raise MisconfigurationException(
                        f"AmpkitPrecision({self.precision!r}) decorates the LightningModule itself and supports "
                        f"single-device strategies; this strategy wrapped it in {type(model).__name__}. Use "
                        f"'{self.precision.replace('-true', '-mixed')}' with distributed strategies.")
                fused = [o for o in optimizers if isinstance(unwrap_optimizer(o), FusedOptimizer)]
                if len(optimizers) != 1 or len(fused) != 1:
                    raise MisconfigurationException(
                        f"AmpkitPrecision({self.precision!r}) keeps the FP32 masters in one ampkit.optim optimizer "
                        f"(configure_optimizers must return exactly one), but got "
                        f"{[type(unwrap_optimizer(o)).__name__ for o in optimizers]}")
                ampkit.decorate(model, unwrap_optimizer(fused[0]), level="O2", dtype=self.dtype)
                model._dtype = self.dtype  # LightningModule.dtype
            if self._scaling():
                for config in lr_schedulers:
                    if getattr(config, "interval", "step") == "step" and not isinstance(config.scheduler, SkipAware):
                        config.scheduler = SkipAware(config.scheduler, self.scaler)
                module = lightning_module(model)
                if module is not None:  # the overflow report names parameters as the LightningModule does
                    self.scaler.name_parameters(module.named_parameters())
            return Precision.connect(self, model, optimizers, lr_schedulers)

        def convert_input(self, data: Any) -> Any:
            return _cast_floating(data, self.dtype) if self._true else data

        def autocast_context_manager(self) -> torch.autocast:
            """The autocast the forward runs under, as ``MixedPrecision``'s (a ``torch.autocast`` without the
            cast cache): ``ampkit.autocast`` with the overrides; disabled for ``"16-true"``/``"bf16-true"``, whose
            weights are already FP16/BF16."""
            return ampkit.autocast(self.device, dtype=self.dtype, enabled=not self._true, cache_enabled=False,
                                   fp32_ops=self._fp32_ops, lowp_ops=self._lowp_ops)

        @contextlib.contextmanager
        def forward_context(self):
            if self._true:
                yield
                return
            with self.autocast_context_manager():
                yield

        # ---- the step ----------------------------------------------------------------------------------------

        def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
            if self._scaling():
                tensor = self.scaler.scale(tensor)
            return Precision.pre_backward(self, tensor, module)

        def _unscale_once(self, optimizer: Any) -> None:
            inner = unwrap_optimizer(optimizer)
            if self.scaler.stage(inner) is OptState.READY:
                self.scaler.unscale_(inner)

        def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
            if not self._scaling():
                return Precision.optimizer_step(self, optimizer, model=model, closure=closure, **kwargs)
            if isinstance(unwrap_optimizer(optimizer), torch.optim.LBFGS):
                raise MisconfigurationException("AmpkitPrecision: AMP and the LBFGS optimizer are not compatible.")
            closure_result = closure()
            # automatic optimization with a training_step that returned None: no backward, so no unscale (the
            # clipping hooks below included), step or update, as Lightning's MixedPrecision; an optimizer unscaled
            # without grads would stay UNSCALED into the next batch, whose step then has no inf check
            skipped = closure_result is None and model.automatic_optimization
            if not skipped:
                trainer = getattr(model, "trainer", None)
                clips = bool(getattr(trainer, "gradient_clip_val", None))
                if clips or not getattr(unwrap_optimizer(optimizer), "_step_supports_amp_scaling", False):
                    # before the hooks, as Lightning's MixedPrecision: on_before_optimizer_step and clipping see
                    # true gradients (a fused step alone unscales inline instead)
                    self._unscale_once(optimizer)
            self._skipped_backward = skipped
            try:
                self._after_closure(model, optimizer)
            finally:
                self._skipped_backward = False
            if skipped:
                return closure_result
            result = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return result

        def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
            if clip_val and clip_val > 0 and self._scaling() and not self._skipped_backward:
                self._unscale_once(optimizer)  # a configure_gradient_clipping that clips on its own
            # Precision's, not MixedPrecision's (which refuses fused optimizers: they are unscaled here)
            if gradient_clip_algorithm is None:
                return Precision.clip_gradients(self, optimizer, clip_val)
            return Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

        # ---- checkpoints -------------------------------------------------------------------------------------

        def state_dict(self) -> dict:
            return self.scaler.state_dict() if self.scaler is not None else {}

        def load_state_dict(self, state_dict: dict) -> None:
            if self.scaler is not None and state_dict:
                self.scaler.load_state_dict(state_dict)

        def on_load_checkpoint(self, checkpoint: dict) -> None:
            # a run started with Lightning's MixedPrecision (torch.amp.GradScaler) continues with ampkit's scaler
            if self.scaler is not None and type(self).__qualname__ not in checkpoint:
                for key in ("MixedPrecision", "native_amp_scaling_state"):
                    if checkpoint.get(key):
                        self.scaler.load_state_dict(checkpoint[key])
                        break
            return super().on_load_checkpoint(checkpoint)

    AmpkitPrecision.__qualname__ = "AmpkitPrecision"
    AmpkitPrecision.__module__ = module
    return AmpkitPrecision
