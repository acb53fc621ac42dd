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
