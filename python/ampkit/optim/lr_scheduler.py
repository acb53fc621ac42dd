"""ampkit.optim.lr_scheduler: learning-rate schedules that do not advance on a step the scaler skipped.

A step skipped for Inf/NaN grads changes no weight, so a schedule counted in optimizer steps must not count it
either (torch.optim's schedulers are stepped unconditionally by most loops: pytorch/pytorch#44511).

- :class:`SkipAware` wraps any scheduler: ``step()`` steps it only when the scaler's last step was applied (one
  host read of the scaler's device flag per ``step()``).
- :class:`DeviceLambdaLR` keeps the learning rate a device tensor computed from the count of applied steps, on the
  device: no host read at all, so a step of an ``ampkit.optim`` optimizer stays sync-free and graph-capturable.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["SkipAware", "DeviceLambdaLR"]


def _scaler(where: str, scaler: Any, *, optional: bool = False):
    """``scaler`` when it reports each step's outcome (``last_step_ran``, which ampkit.GradScaler has and
    torch.amp.GradScaler has not); ampkit.optim does not import the scaler's module."""
    if scaler is None and optional:
        return None
    if not callable(getattr(scaler, "last_step_ran", None)):
        raise TypeError(f"{where}: scaler must be an ampkit.GradScaler (it reports whether each step was applied), "
                        f"but got {type(scaler).__name__}")
    return scaler


def _step_ran(scaler: Any, optimizer: Any) -> Optional[torch.Tensor]:
    """The scaler's flag for ``optimizer``'s last step where it took part in the last iteration (several optimizers
    on one scaler), else the iteration's flag (None before the first ``update()``)."""
    ran = scaler.last_step_ran(optimizer) if isinstance(getattr(optimizer, "param_groups", None), list) else None
    return scaler.last_step_ran() if ran is None else ran


class SkipAware:
    """Steps ``scheduler`` only when ``scaler``'s last step was applied.

    Args:
        scheduler: any learning-rate scheduler (``torch.optim.lr_scheduler.LRScheduler`` or an object with
            ``step()``, ``state_dict()`` and ``load_state_dict()``); stepped with the arguments ``step()`` gets.
        scaler: the ``ampkit.GradScaler`` whose ``update()`` ends each iteration.

    Call ``step()`` once per optimizer step, after ``scaler.update()``. Each call reads the scaler's device flag
    ``last_step_ran(scheduler.optimizer)`` once (a host read; none before the first ``update()`` or with a disabled
    scaler, when every call steps): with several optimizers on one scaler (a GAN), each scheduler follows its own
    optimizer's step, the iteration's flag where that optimizer took no part. ``skipped_steps`` counts the calls
    that did not step. ``state_dict()`` is the wrapped scheduler's, so checkpoints move between wrapped and
    unwrapped schedulers; every other attribute (``get_last_lr()``, ``optimizer``, ``last_epoch``) is the wrapped
    scheduler's.
    """

    def __init__(self, scheduler: Any, scaler: Any) -> None:
        for name in ("step", "state_dict", "load_state_dict"):
            if not callable(getattr(scheduler, name, None)):
                raise TypeError(f"SkipAware: scheduler must be a learning-rate scheduler (with {name}()), but got "
                                f"{type(scheduler).__name__}")
        self.scheduler = scheduler
        self.scaler = _scaler("SkipAware", scaler)
        self.skipped_steps = 0

    def last_step_applied(self) -> bool:
        """Whether the scaler's last step of the scheduler's optimizer was applied (True before the first
        ``update()``): one host read."""
        ran = _step_ran(self.scaler, getattr(self.scheduler, "optimizer", None))
        return True if ran is None else bool(ran)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.last_step_applied():
            self.scheduler.step(*args, **kwargs)
        else:
            self.skipped_steps += 1

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "scaler", "skipped_steps"):  # not yet set: during unpickling
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"SkipAware({self.scheduler!r})"


class DeviceLambdaLR:
    """``torch.optim.lr_scheduler.LambdaLR`` counted in applied steps, on the device.

    Each group's ``lr`` becomes a one-element float32 tensor on the group's device (ampkit.optim optimizers read
    it on the device), set in place to ``initial_lr * lr_lambda(applied)``, where ``applied`` is a float32 device
    tensor counting the steps the scaler applied to ``optimizer`` (every step without a scaler). ``lr_lambda`` must
    compute with torch operations on that tensor (e.g. ``lambda s: torch.clamp((s + 1) / 100, max=1.0)``); it may
    return a tensor or a number. ``step()`` makes no host read and no host-to-device copy, so it can be captured in
    a CUDA graph together with the step.

    Args:
        optimizer: the optimizer whose groups' ``lr`` it sets (its groups' ``lr`` are the initial values).
        lr_lambda: a function of the applied-step count, or a list of one function per group.
        scaler: an ``ampkit.GradScaler``, or None (every step counts).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, lr_lambda: Any, scaler: Any = None) -> None:
        where = "DeviceLambdaLR"
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list) or not groups:
            raise TypeError(f"{where}: optimizer must be a torch.optim.Optimizer with parameter groups, but got "
                            f"{type(optimizer).__name__}")
        lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * len(groups)
        if len(lambdas) != len(groups):
            raise ValueError(f"{where}: lr_lambda must be one function or one per parameter group ({len(groups)}), "
                             f"but got {len(lambdas)}")
        for i, fn in enumerate(lambdas):
            if not callable(fn):
                raise TypeError(f"{where}: lr_lambda[{i}] must be callable, but got {type(fn).__name__}")
        self.scaler = _scaler(where, scaler, optional=True)
        devices, initials = [], []
        for i, group in enumerate(groups):  # every check before the first write
            if not group["params"]:
                raise ValueError(f"{where}: param_groups[{i}] has no parameters")
            initial = group.get("initial_lr", group["lr"])
            if isinstance(initial, torch.Tensor):
                if initial.numel() != 1:
                    raise ValueError(f"{where}: param_groups[{i}]['lr'] must be a number or a one-element tensor, "
                                     f"but got a tensor of shape {tuple(initial.shape)}")
                initial = float(initial)  # once, at construction
            if not isinstance(initial, (int, float)) or isinstance(initial, bool):
                raise TypeError(f"{where}: param_groups[{i}]['lr'] must be a number, but got {initial!r}")
            devices.append(group["params"][0].device)
            initials.append(float(initial))
        for group, initial in zip(groups, initials):
            group["initial_lr"] = initial
        self.optimizer = optimizer
        self.lr_lambdas = lambdas
        self._devices = devices
        self.applied = torch.zeros((), dtype=torch.float32, device=devices[0])
        self._set_lrs()

    def _lr_tensor(self, group: dict, device: torch.device) -> torch.Tensor:
        """The group's lr tensor, written in place; a new one only where the group holds none of the right kind
        (at construction, or after ``optimizer.load_state_dict`` replaced the groups' values)."""
        lr = group["lr"]
        if not (isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and lr.numel() == 1
                and lr.device == device):
            lr = group["lr"] = torch.empty((), dtype=torch.float32, device=device)
        return lr

    def _set_lrs(self) -> None:
        for group, device, fn in zip(self.optimizer.param_groups, self._devices, self.lr_lambdas):
            lr = self._lr_tensor(group, device)
            factor = fn(self.applied.to(device, non_blocking=True))
            lr.copy_(torch.as_tensor(factor, dtype=torch.float32, device=device) * group["initial_lr"])

    def step(self) -> None:
        """Counts the last step if the scaler applied it, and sets each group's lr from the new count."""
        ran = None if self.scaler is None else _step_ran(self.scaler, self.optimizer)
        if ran is None:
            self.applied.add_(1.0)
        else:
            self.applied.add_(ran.to(self.applied.device, torch.float32, non_blocking=True))
        self._set_lrs()

    def get_last_lr(self) -> list[torch.Tensor]:
        """Each group's lr as its device tensor (no host read; ``float()`` of one reads it)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        """The applied-step count and the initial lrs (a host read of the count)."""
        return {"applied_steps": int(self.applied.item()),
                "initial_lrs": [g["initial_lr"] for g in self.optimizer.param_groups]}

    def load_state_dict(self, state_dict: dict) -> None:
        where = "DeviceLambdaLR.load_state_dict"
        if not isinstance(state_dict, dict) or "applied_steps" not in state_dict:
            raise ValueError(f"{where}: state_dict must be a dict from DeviceLambdaLR.state_dict() (with "
                             f"'applied_steps'), but got {state_dict!r:.80}")
        steps = state_dict["applied_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"{where}: 'applied_steps' must be a non-negative int, but got {steps!r}")
        initial = state_dict.get("initial_lrs", [g["initial_lr"] for g in self.optimizer.param_groups])
        if len(initial) != len(self.optimizer.param_groups):
            raise ValueError(f"{where}: 'initial_lrs' has {len(initial)} entries for "
                             f"{len(self.optimizer.param_groups)} parameter groups")
        for group, lr in zip(self.optimizer.param_groups, initial):
            group["initial_lr"] = float(lr)
        self.applied.fill_(float(steps))
        self._set_lrs()
