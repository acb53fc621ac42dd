"""Run by test_autocast.py in a fresh process: torch.autocast results of a set of ops before ampkit installs its
override kernels on them, and after (outside any override scope), must be bit-identical."""
from __future__ import annotations

import sys

import torch

import ampkit
from conftest import bits_equal
from test_autocast import DT, OPS, _inputs


def run_all():
    out = {}
    for dtype in (torch.float32, DT):
        x = _inputs(dtype)
        for name, fn in OPS.items():
            with torch.autocast("cpu", dtype=DT):
                out[(name, dtype)] = fn(x)
    return out


before = run_all()
names = sorted({"mm", "matmul", "bmm", "addmm", "baddbmm", "linear", "conv2d", "softmax", "log_softmax",
                "layer_norm", "group_norm", "cross_entropy_loss", "mse_loss", "sum", "mean", "cat", "stack", "relu"})
with ampkit.autocast("cpu", dtype=DT, fp32_ops=names):  # installs the kernels (process-wide, kept)
    pass
after = run_all()
bad = [k for k in before if before[k].dtype != after[k].dtype or not bits_equal(before[k], after[k])]
print(f"checked {len(before)} results; mismatches: {bad}")
sys.exit(1 if bad else 0)
