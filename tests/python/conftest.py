"""Shared pytest fixtures and helpers for ampkit's Python tests."""
from __future__ import annotations

import pytest
import torch

import ampkit  # noqa: F401  (registers torch.ops.ampkit)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CUDA_REASON = "needs a CUDA device"
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: runs on a CUDA device (set on collection; scripts/gpu_check.sh runs "
                            "`pytest -m cuda`)")


def _runs_on_cuda(item) -> bool:
    """A test needs a device when it skips without one (CUDA_ONLY) or is a `cuda` parametrization (DEVICES)."""
    if any(m.kwargs.get("reason") == CUDA_REASON for m in item.iter_markers("skipif")):
        return True
    callspec = getattr(item, "callspec", None)
    values = callspec.params.values() if callspec is not None else ()
    return any(v == "cuda" or (isinstance(v, torch.device) and v.type == "cuda") for v in values
               if isinstance(v, (str, torch.device)))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _runs_on_cuda(item):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate's state is a process-wide singleton: a test that uses it builds its Accelerator from scratch and
    leaves none behind."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bits everywhere, except that any NaN equals any NaN (payloads differ between SIMD/scalar paths)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = a.isnan(), b.isnan()
    if not torch.equal(nan_a, nan_b):
        return False
    it = _INT_OF_SIZE[a.element_size()]
    return torch.equal(a.masked_fill(nan_a, 0).contiguous().view(it), b.masked_fill(nan_a, 0).contiguous().view(it))
