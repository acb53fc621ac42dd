"""The CPU loops are compiled once per instruction set (AVX-512, AVX2, portable vector code) and a process runs the
widest its processor has; AMPKIT_CPU_ISA caps that choice. Each copy this machine can run computes the same case
here in a process of its own, and every result must be equal bit for bit across the copies: the element-wise steps
(every optimizer and weight mode, FP32/BF16/8-bit states, stochastic rounding), the reductions in their fixed order
(grad_norm, LAMB's norms, grad_stats' lanes), the counts (grad_stats' histogram), the unscale/cast passes and the
FP8 quantize (every BF16 pattern, its amax and transposed copy)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import bits_equal

_CASE = r'''
import math, sys, torch, ampkit
from ampkit.optim import SGD, Adam, AdamW, LAMB

out = {"isa": ampkit.build_info()["cpu_isa"]}
gen = torch.Generator().manual_seed(3)
SHAPES = [(1003,), (64, 33), (7,), (40000,), (0,)]


def rand(shape, scale=1.0):
    return torch.randn(shape, generator=gen) * scale


def run(name, cls, dtype, steps=3, scaler=False, **options):
    torch.manual_seed(11)  # stochastic rounding seeds
    params = [torch.nn.Parameter(rand(s).to(dtype)) for s in SHAPES]
    opt = cls(params, lr=1e-2, **options)
    sc = ampkit.GradScaler(init_scale=2.0 ** 10) if scaler else None
    for step in range(steps):
        for p in params:
            p.grad = rand(p.shape, 2.0 ** 10 if scaler else 1.0).to(p.dtype)
        if scaler:
            if step == 1:
                params[3].grad[-1] = math.inf  # a skipped step
            sc.step(opt)
            sc.update()
        else:
            opt.step()
    out[name] = [p.detach().clone() for p in params] + [
        v.clone() for p in params for k, v in sorted(opt.state[p].items()) if torch.is_tensor(v)]


for dtype in (torch.float32, torch.bfloat16):
    run(f"adamw-{dtype}", AdamW, dtype, amsgrad=True)
    run(f"adam-maximize-{dtype}", Adam, dtype, maximize=True, weight_decay=0.1)
    run(f"sgd-nesterov-{dtype}", SGD, dtype, momentum=0.9, nesterov=True, weight_decay=0.01)
    run(f"lamb-{dtype}", LAMB, dtype, max_grad_norm=1.0)
    run(f"adamw-scaled-{dtype}", AdamW, dtype, scaler=True)
run("adamw-half-master", AdamW, torch.float16, master_weights=True, scaler=True)
for mode in ("remainder", "kahan", "stochastic"):
    run(f"adamw-{mode}", AdamW, torch.bfloat16, master_weights=mode)
    run(f"sgd-{mode}", SGD, torch.bfloat16, master_weights=mode, momentum=0.9)
    run(f"lamb-{mode}", LAMB, torch.bfloat16, master_weights=mode)
for state in (torch.bfloat16, torch.uint8):
    run(f"adamw-states-{state}", AdamW, torch.bfloat16, master_weights="stochastic", exp_avg_dtype=state,
        exp_avg_sq_dtype=state)
    run(f"sgd-momentum-{state}", SGD, torch.float32, momentum=0.9, momentum_dtype=state)

grads = [rand(s, 3.0).to(d) for s in SHAPES for d in (torch.float32, torch.bfloat16, torch.float16)]
grads[4][5] = math.nan
out["grad_norm"] = [ampkit.grad_norm(grads), ampkit.grad_norm(grads, torch.full((1,), 2.0 ** 10))]
for name, g in (("unscale", [t.clone() for t in grads]), ("unscale-clean", [t.clone() for t in grads[5:]])):
    found = torch.zeros(1)
    ampkit.unscale_and_check_(g, found, torch.full((1,), 1 / 3.0))
    out[name] = g + [found]
cast = [torch.empty_like(t, dtype=torch.float32) for t in grads]
found = torch.zeros(1)
ampkit.cast_unscale_and_check_(grads, cast, found, torch.full((1,), 2.0 ** -4))
out["cast-unscale"] = cast + [found]
half = [torch.empty_like(t, dtype=torch.bfloat16) for t in grads]
ampkit.cast_divide_(grads, half, 3.0)
out["cast-divide"] = half

n = 65536 + 3 * 2048 + 515
x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(
    (torch.arange(n) // 2048 % 4 * 30 - 60).double() + torch.randint(-3, 3, (n,), generator=gen).double())
x[::11] = 0.0
x[5000:5070] *= 2.0 ** 40
x[-1] = math.nan
x[-2000] = -math.inf
x[70000:70016] = 1e-41
stats_grads = [x.float(), x.bfloat16(), x.clamp(-6e4, 6e4).half(), x.float()[1::2], x.float()[:0], x.float()[:17]]
out["grad_stats"] = [torch.ops.ampkit.grad_stats(stats_grads, torch.full((1,), inv))
                     for inv in (1.0, 2.0 ** -16, 1 / 3.0, 2.0 ** -126)]
xq = torch.cat([torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float(),
                torch.randn(4099, generator=gen) * 300])
for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
    for xd in (torch.float32, torch.bfloat16, torch.float16):
        for rows in (1, 19):  # one long row; 19 rows of 3,665 elements with their own scales, and the transpose
            xr = xq.to(xd).reshape(rows, -1)
            s = torch.rand(rows, 1, generator=gen) * 8 if rows > 1 else torch.full((), 0.37)
            q, amax, q_t = torch.ops.ampkit.fp8_quantize(xr, s, fp8, True)
            out[f"fp8-{fp8}-{xd}-{rows}"] = [q.view(torch.uint8), amax, q_t.view(torch.uint8)]
        # NaN products (NaN x or scale, 0 * Inf): x's sign in every copy. -0 and its neighbours, -Inf, the
        # negative NaNs, +0 and up, +Inf and the positive NaNs.
        specials = torch.cat([xq[:40], xq[32600:32968], xq[65280:65536]]).to(xd)
        for scale in (math.nan, -math.nan, math.inf, 0.0):
            q, _, _ = torch.ops.ampkit.fp8_quantize(specials, torch.tensor(scale), fp8)
            out[f"fp8-{fp8}-{xd}-scale-{scale}"] = [q.view(torch.uint8)]
torch.save(out, sys.argv[1])
'''


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="the x86 copies of the loops")
def test_every_cpu_isa_copy_computes_the_same_bits(tmp_path):
    script = tmp_path / "case.py"
    script.write_text(_CASE)
    results = {}
    for isa in ("avx512", "avx2", "default"):
        out = tmp_path / f"{isa}.pt"
        done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "AMPKIT_CPU_ISA": isa, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        got = torch.load(out)
        results.setdefault(got.pop("isa"), got)  # a cap above the processor's runs its widest copy again
    assert "default" in results, sorted(results)  # the portable copy runs everywhere
    (first, reference), *others = results.items()
    assert len(reference) >= 30
    for isa, got in others:
        assert sorted(got) == sorted(reference)
        for name, tensors in reference.items():
            assert len(got[name]) == len(tensors), name
            for k, (a, b) in enumerate(zip(tensors, got[name])):
                assert a.dtype == b.dtype and a.shape == b.shape and bits_equal(a, b), (first, isa, name, k)
    case = results["default"]
    assert case["grad_stats"][0][0, 2].item() == 2 and case["unscale"][-1].item() == 1.0  # the case holds
    assert case["unscale-clean"][-1].item() == 0.0  # what it claims to
    assert any(t.dtype == torch.uint8 for t in case["adamw-states-torch.uint8"])  # 8-bit states were stepped
    assert any(t.dtype == torch.int64 for t in case["adamw-stochastic"])  # and stochastic rounding seeds kept
