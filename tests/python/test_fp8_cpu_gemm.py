"""The FP8 layer's GEMMs on the CPU (NOTE [FP8 GEMM on the CPU]): the FP8 operands widened to FP32 exactly, one FP32
GEMM (the exact products an FP8 tensor core makes, summed in FP32), then the dequantizing scales. Checked against a
float64 reference within the FP32-accumulation bound, on every finite code of both formats, and bit for bit against
torch's own CPU _scaled_mm where its order of operations gives the same bits (power-of-two scales, a CPU without
AMX-INT8, where torch takes oneDNN's FP8 GEMM instead)."""
from __future__ import annotations

import pytest
import torch

import ampkit  # noqa: F401  (registers torch.ops.ampkit)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}
EPS32 = 2.0 ** -24


def quantize(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, power_of_2: bool = False):
    """q(x) and the dequantizing scale the layer uses: current scaling from x's amax (per row when rowwise)."""
    amax = x.abs().amax(dim=1, keepdim=True) if rowwise else x.abs().amax()
    scale = torch.ops.ampkit.fp8_compute_scale(amax.float(), MAX[dtype], 0.0, 1e-12, power_of_2)
    q, _, _ = torch.ops.ampkit.fp8_quantize(x, scale, dtype, False)
    return q, torch.reciprocal(scale)


def reference_and_bound(qa, inv_a, qb, inv_b, rowwise):
    """float64 y = (qa @ qb^T) * inv_a * inv_b, and the bound on an FP32-accumulated result's error: k * 2^-24 of
    the sum of |products| (the GEMM), plus the rounding of the two scalings and of the result."""
    a, b = qa.double(), qb.double()
    k = a.shape[1]
    inv_b = inv_b.double().reshape(1, -1) if rowwise else inv_b.double()
    scale = inv_a.double() * inv_b
    y = (a @ b.t()) * scale
    bound = k * EPS32 * ((a.abs() @ b.abs().t()) * scale.abs()) + 4 * EPS32 * y.abs()
    return y, bound


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("mnk", [(64, 48, 96), (37, 16, 1000), (1, 32, 16), (128, 128, 512)])
def test_cpu_fp8_gemm_is_exact_products_summed_in_fp32(fmt, rowwise, mnk):
    m, n, k = mnk
    g = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, k).reshape(1, k)  # wide dynamic range
    w = torch.randn(n, k, generator=g) * 0.05
    granularity = "rowwise" if rowwise else "tensorwise"
    if fmt == E5M2:  # the forward's operands are E4M3 in both recipes: reach E5M2 through dX = q(dY) q(W)
        xg = x.clone().requires_grad_()
        dy = torch.randn(m, n, generator=g)
        wt = w.clone().requires_grad_()
        torch.ops.ampkit.fp8_linear(xg, wt, None, "hybrid", 1e-12, False, None, granularity).backward(dy)
        qd, inv_d = quantize(dy, E5M2, rowwise)
        qw, inv_w = quantize(w.t().contiguous() if rowwise else w, E4M3, rowwise)
        if rowwise:  # dX sums over out_features: W's columns are its rows here
            y64, bound = reference_and_bound(qd, inv_d, qw, inv_w, rowwise)
        else:
            y64, bound = reference_and_bound(qd, inv_d, qw.t().contiguous(), inv_w, rowwise)
        got = xg.grad
    else:
        got = torch.ops.ampkit.fp8_linear(x, w, None, "e4m3", 1e-12, False, None, granularity)
        qx, inv_x = quantize(x, E4M3, rowwise)
        qw, inv_w = quantize(w, E4M3, rowwise)
        y64, bound = reference_and_bound(qx, inv_x, qw, inv_w, rowwise)
    assert got.dtype == torch.float32 and got.shape == y64.shape
    err = (got.double() - y64).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g} over bound {(err / bound).max().item():.3g}"
    # Not vacuous: the bound is far tighter than BF16 accumulation would meet.
    assert bool((bound <= 2.0 ** -8 * (y64.abs() + bound).max()).all())


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cpu_fp8_gemm_decodes_every_finite_code_exactly(fmt):
    """x holds every finite value of the format (both zeros, the subnormals, the maximum) and its amax is the
    format's maximum, so its power-of-two scale is 1 and q(x) = x; W = I scaled into FP8 exactly. y = x @ W^T is
    then each value times one power of two: the widening must give back every code's exact value."""
    codes = torch.arange(256, dtype=torch.uint8).view(fmt).float()
    finite = codes[torch.isfinite(codes)]
    n = 16
    x = torch.cat([finite, torch.zeros((-finite.numel()) % n)]).reshape(-1, n)
    w = torch.eye(n)
    # Forward operands are E4M3; E5M2 codes reach the GEMM as grad_output in dX = q(dY) q(W) (hybrid recipe).
    if fmt == E4M3:
        y = torch.ops.ampkit.fp8_linear(x, w, None, "e4m3", 0.0, True, None, "tensorwise")
        expected = x
    else:
        xg = torch.zeros(x.shape[0], n, requires_grad=True)
        wt = w.clone().requires_grad_()
        torch.ops.ampkit.fp8_linear(xg, wt, None, "hybrid", 0.0, True, None, "tensorwise").backward(x)
        y, expected = xg.grad, x  # dX = dY @ W, W = I
    assert torch.equal(y, expected)
    assert finite.numel() == (254 if fmt == E4M3 else 248)


@pytest.mark.skipif(torch.cpu._is_amx_tile_supported(), reason="torch's _scaled_mm runs oneDNN's FP8 GEMM on AMX CPUs")
@pytest.mark.parametrize("mnk", [(64, 48, 96), (32, 16, 784)])
def test_cpu_fp8_gemm_equals_torch_scaled_mm_bitwise_with_power_of_two_scales(mnk):
    """torch's CPU _scaled_mm scales the widened operands and then runs the FP32 GEMM; with power-of-two scales that
    scaling is exact, so the same GEMM gives the same bits as scaling after it."""
    m, n, k = mnk
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.1
    got = torch.ops.ampkit.fp8_linear(x, w, None, "e4m3", 1e-12, True, None, "tensorwise")
    qx, inv_x = quantize(x, E4M3, False, power_of_2=True)
    qw, inv_w = quantize(w, E4M3, False, power_of_2=True)
    theirs = torch._scaled_mm(qx, qw.t(), inv_x, inv_w, out_dtype=torch.float32)
    assert torch.equal(got, theirs)


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_cpu_fp8_layer_never_calls_torch_scaled_mm(granularity):
    """On CPUs with AMX-INT8, torch's CPU _scaled_mm is oneDNN's FP8 GEMM, orders of magnitude slower than the FP32
    GEMM the layer runs instead: no GEMM of the forward or the backward may reach it."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=g, requires_grad=True)
    w = torch.randn(32, 64, generator=g, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ops.ampkit.fp8_linear(x, w, None, "hybrid", 1e-12, False, None, granularity).sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert "ampkit::fp8_linear" in names and "aten::mm" in names
    assert "aten::_scaled_mm" not in names
