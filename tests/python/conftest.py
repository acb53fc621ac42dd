"""Shared pytest fixtures and helpers for ampkit's Python tests."""
from __future__ import annotations

import pytest
import torch

import ampkit  # noqa: F401  (registers torch.ops.ampkit)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bits everywhere, except that any NaN equals any NaN (payloads differ between SIMD/scalar paths)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = a.isnan(), b.isnan()
    if not torch.equal(nan_a, nan_b):
        return False
    it = _INT_OF_SIZE[a.element_size()]
    return torch.equal(a.masked_fill(nan_a, 0).contiguous().view(it), b.masked_fill(nan_a, 0).contiguous().view(it))


def reference_unscale(g: torch.Tensor, inv: float) -> torch.Tensor:
    """float64 reference: the product is exact in double, then rounded once to opmath and once to the dtype."""
    if inv == 1.0:
        return g.clone()
    if g.dtype == torch.float64:
        return g * float(torch.tensor(inv, dtype=torch.float32))
    return (g.double() * float(torch.tensor(inv, dtype=torch.float32))).float().to(g.dtype)
