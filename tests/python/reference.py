"""Independent float64 references of ampkit's ops, which the tests compare the kernels with (never the kernels'
own functors): the unscale, a LAMB step and a row of gradient statistics."""
from __future__ import annotations

import math

import torch

import ampkit


def reference_unscale(g: torch.Tensor, inv: float) -> torch.Tensor:
    """float64 reference: the product is exact in double, then rounded once to opmath and once to the dtype."""
    if inv == 1.0:
        return g.clone()
    if g.dtype == torch.float64:
        return g * float(torch.tensor(inv, dtype=torch.float32))
    return (g.double() * float(torch.tensor(inv, dtype=torch.float32))).float().to(g.dtype)


def lamb_step(ws, gs, ms, vs, steps, *, lr, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-6,
              bias_correction=True, adam_w_mode=True, grad_averaging=True, use_nvlamb=False, max_grad_norm=0.0,
              scale=1.0, norm_grads=None):
    """One LAMB step in float64 (Apex FusedLAMB's formulas); returns new (w, m, v) per tensor. `norm_grads`: the
    grads whose global norm clips (default: gs)."""
    gs = [g.double() / scale for g in gs]
    norm_of = gs if norm_grads is None else [g.double() / scale for g in norm_grads]
    gnorm = math.sqrt(sum(float((g * g).sum()) for g in norm_of))
    clip = gnorm / max_grad_norm if max_grad_norm > 0 and gnorm > max_grad_norm else 1.0
    out = []
    for w, g, m, v, step in zip(ws, gs, ms, vs, steps):
        w, m, v = w.double(), m.double(), v.double()
        g = g / clip
        if not adam_w_mode and weight_decay:
            g = g + weight_decay * w
        m = beta1 * m + ((1 - beta1) if grad_averaging else 1.0) * g
        v = beta2 * v + (1 - beta2) * g * g
        t = step + 1
        c1 = 1 - beta1 ** t if bias_correction else 1.0
        c2 = 1 - beta2 ** t if bias_correction else 1.0
        u = (m / c1) / ((v / c2).sqrt() + eps)
        if adam_w_mode and weight_decay:
            u = u + weight_decay * w
        ratio = 1.0
        if weight_decay or use_nvlamb:
            wn, un = float(w.norm()), float(u.norm())
            if wn > 0 and un > 0:
                ratio = wn / un
        out.append((w - lr * ratio * u, m, v))
    return out


def grad_stats_row(g: torch.Tensor, inv: float) -> torch.Tensor:
    """One row of ampkit.grad_stats in float64: max |g| * inv, the norm * inv, non-finite and zero counts, then the
    histogram of floor(log2(|g| * inv)) over finite non-zero elements."""
    cols, first, min_exp = ampkit.GRAD_STATS_COLUMNS, ampkit.GRAD_STATS_HIST_FIRST, ampkit.GRAD_STATS_HIST_MIN_EXP
    row = torch.zeros(cols, dtype=torch.float64)
    x = g.detach().cpu().float().double().flatten()
    finite = x.isfinite()
    row[2] = (~finite).sum()
    row[3] = (x == 0).sum()
    live = x[finite & (x != 0)].abs() * inv
    if live.numel():
        row[0] = live.max()
        row[1] = x[finite].square().sum().sqrt() * inv
        _, e = torch.frexp(live)
        e = e.long() - 1  # floor(log2)
        bins = torch.where(e < min_exp, 0, torch.where(e > 127, cols - first - 1, 1 + e - min_exp))
        row[first:] = torch.bincount(bins, minlength=cols - first).double()
    return row
