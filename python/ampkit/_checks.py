"""The argument checks the Python classes share: each error names where it happened and the argument."""
from __future__ import annotations

import numbers
from typing import Any, Optional

import torch


def _prefix(where: Optional[str]) -> str:
    return f"{where}: " if where else ""


def number(where: Optional[str], name: str, value: Any, any_size: bool = False) -> None:
    """A real number or a one-element real tensor (TypeError / ValueError naming `name` otherwise); `any_size`:
    a real tensor of any size, where the C++ check that follows owns the size (an optimizer's lr)."""
    if isinstance(value, torch.Tensor):
        if (value.numel() != 1 and not any_size) or value.is_complex():
            raise ValueError(f"{_prefix(where)}Tensor {name} must be a 1-element real tensor, but got shape "
                             f"{tuple(value.shape)} {value.dtype}")
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_prefix(where)}{name} must be a number or a 1-element tensor, but got "
                        f"{type(value).__name__} {value!r}")


def integer(where: str, name: str, value: Any) -> int:
    """A Python int that fits the C++ option's int64 (TypeError / ValueError naming `name` otherwise); its range is
    the C++ check's."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_prefix(where)}{name} must be an int, but got {type(value).__name__} {value!r}")
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{_prefix(where)}{name} must fit a 64-bit int, but got {value}")
    return int(value)


def flag(where: str, name: str, value: Any, optional: bool = False) -> Optional[bool]:
    """True or False (or None when `optional`), else a TypeError naming `name`."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    expected = "True, False or None" if optional else "True or False"
    raise TypeError(f"{where}: {name} must be {expected}, but got {value!r}")


def device_type(where: str, device: Any, name: str = "device", expected: str = "'cpu' or 'cuda'") -> str:
    """'cpu' or 'cuda' from a device string or torch.device, else a ValueError naming `name`."""
    kind = None
    if isinstance(device, torch.device):
        kind = device.type
    elif isinstance(device, str):
        try:
            kind = torch.device(device).type
        except RuntimeError:
            kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{where}: {name} must be {expected}, but got {device!r}")
    return kind


def capturable_devices() -> list[str]:
    """The device types on which torch.optim accepts capturable=True."""
    from torch.optim import optimizer as _optimizer
    getter = getattr(_optimizer, "_get_capturable_supported_devices", None)
    return getter() if getter is not None else ["cuda"]


def optimizer_group(cls, group: dict) -> None:
    """The checks of an ampkit.optim param group's values, from the optimizer class's tables (NOTE [Optimizer option
    table]): master_weights None, a bool or one of cls._master_modes; each bool option (cls._flags) True or False;
    each number option (cls._numbers) a real number or one-element real tensor (lr a real tensor of any size: its
    size is the core's check); betas, where the optimizer has them, a pair of numbers; torch.optim's rule for
    capturable=True; then the ranges, torch.optim's messages, in the C++ core (cls._bound_core). Number and betas
    errors are prefixed with cls._where (None: torch.optim's own messages, unprefixed)."""
    name = cls.__name__
    mw = group.get("master_weights")
    if not (mw is None or isinstance(mw, bool) or mw in cls._master_modes):
        modes = ", ".join(repr(m) for m in cls._master_modes)
        raise ValueError(f"{name}: master_weights must be None, True, False or one of {modes}, but got {mw!r}")
    for key in cls._flags:
        value = group.get(key, False)
        if not isinstance(value, (bool, int)) or isinstance(value, int) and value not in (0, 1):
            raise TypeError(f"{name}: {key} must be True or False, but got {type(value).__name__} {value!r}")
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor) and lr.is_meta:
        raise ValueError(f"{name}: lr must be a number or a one-element tensor holding a value, but got a tensor on "
                         "the meta device")
    where = cls._where
    for key in cls._numbers:
        number(where, key, group[key], any_size=key == "lr")
    if "betas" in cls._options:
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)):
            raise TypeError(f"{_prefix(where)}betas must be a pair (beta1, beta2), but got {type(betas).__name__} "
                            f"{betas!r}")
        if len(betas) != 2:
            raise ValueError(f"{_prefix(where)}betas must be a pair (beta1, beta2), but got {betas!r}")
        for i, beta in enumerate(betas):
            number(where, f"betas[{i}]", beta)
    if group.get("capturable") and not torch.compiler.is_compiling():
        supported = capturable_devices()
        for p in group.get("params", ()):
            if p.device.type not in supported:
                raise AssertionError(f"If capturable=True, params and state_steps must be on supported devices: "
                                     f"{supported}.")
    cls._bound_core.check_config(group)
