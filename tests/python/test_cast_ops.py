"""torch.ops.ampkit.cast_divide_ / cast_unscale_and_check_, the two passes around a compressed all-reduce: bit for bit
against the torch compositions they replace (``src.to(dtype).div_(d)``; ``out.copy_(src)`` then the unscale and
check) on random lists of every dtype pair, sizes and layouts, a float64 reference, Inf/NaN in the last element of
the last chunk, poisoned outputs and flags, bad input that must change nothing, and opcheck."""
from __future__ import annotations

import math
import random

import pytest
import torch

import ampkit
from conftest import DEVICES, bits_equal

WIRE = [torch.float16, torch.bfloat16, torch.float32]
# Around the CPU vector block (16), the CPU work item (32768) and the CUDA chunk (65536).
SIZES = [0, 1, 7, 15, 16, 17, 33, 1000, 32767, 32768, 32769, 65536, 65537]


def _random_pairs(rng: random.Random, device: str, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    src, out = [], []
    for _ in range(n):
        numel = rng.choice(SIZES)
        sd, od = rng.choice(WIRE), rng.choice(WIRE)
        scale = 10.0 ** rng.uniform(-6, 4)
        values = torch.randn(numel, dtype=torch.float64) * scale
        layout = rng.choice(["flat", "flat", "matrix-t", "strided", "offset", "out-t"])
        if layout in ("matrix-t", "out-t") and numel >= 4 and numel % 4 == 0:
            s = values.view(4, numel // 4).to(device, sd)
            o = torch.full((numel // 4, 4), math.nan, dtype=od, device=device).t()
            if layout == "matrix-t":
                s = s.t().contiguous().t()  # same strides as o: used in place
        elif layout == "strided":
            s = torch.randn(2 * numel, dtype=torch.float64).to(device, sd)[::2]
            s.copy_(values)
            o = torch.full((numel,), math.nan, dtype=od, device=device)
        elif layout == "offset":
            s = torch.empty(numel + 1, dtype=sd, device=device)[1:]
            s.copy_(values)
            o = torch.full((numel + 1,), math.nan, dtype=od, device=device)[1:]
        else:
            s = values.to(device, sd)
            o = torch.full((numel,), math.nan, dtype=od, device=device)
        src.append(s)
        out.append(o)
    return src, out


def _inject(rng: random.Random, src: list[torch.Tensor]) -> None:
    nonempty = [t for t in src if t.numel() > 0]
    if not nonempty:
        return
    t = nonempty[-1] if rng.random() < 0.5 else rng.choice(nonempty)
    i = t.numel() - 1 if rng.random() < 0.5 else rng.randrange(t.numel())
    t[torch.unravel_index(torch.tensor(i), t.shape)] = rng.choice([math.inf, -math.inf, math.nan])


def _assert_one_rounding_from(o: torch.Tensor, y: torch.Tensor) -> None:
    """`o` is the float64 reference `y` rounded once to o's dtype (within one ulp of it; Inf past its max)."""
    info = torch.finfo(o.dtype)
    o = o.double().cpu()
    y = y.cpu()
    assert torch.equal(o.isnan(), y.isnan())
    big = y.abs() > torch.finfo(torch.float32).max
    assert torch.equal(o[big], y[big])
    finite = o.isfinite() & ~y.isnan() & ~big
    # half an ulp, and half the smallest subnormal below the normal range
    torch.testing.assert_close(o[finite], y[finite], rtol=info.eps / 2, atol=info.smallest_normal * info.eps / 2)
    over = ~o.isfinite() & ~o.isnan()
    assert (y[over].abs() >= info.max).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(24))
def test_cast_divide_is_torchs_cast_then_divide(device, seed):
    rng = random.Random(seed)
    src, out = _random_pairs(rng, device, rng.randint(1, 6))
    if seed % 3 == 0:
        _inject(rng, src)
    divisor = rng.choice([1, 2, 3, 4, 7, 0.3, 1000.0, 0.125, 2.0 ** 20])
    src_before = [t.clone() for t in src]
    ampkit.cast_divide_(src, out, divisor)
    for s, o, sb in zip(src, out, src_before):
        assert bits_equal(s, sb)  # read only
        if device == "cpu":
            assert bits_equal(o, s.to(o.dtype, copy=True).div_(divisor))
        _assert_one_rounding_from(o, s.to(o.dtype).double() / divisor)
    if device != "cpu":
        cpu_out = [torch.empty_like(o, device="cpu") for o in out]
        ampkit.cast_divide_([s.cpu() for s in src], cpu_out, divisor)
        assert all(bits_equal(a.cpu(), b) for a, b in zip(out, cpu_out))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(24))
def test_cast_unscale_and_check_is_copy_then_unscale(device, seed):
    rng = random.Random(100 + seed)
    src, out = _random_pairs(rng, device, rng.randint(1, 6))
    if seed % 2 == 0:
        _inject(rng, src)
    inv = torch.full((1,), rng.choice([1.0, 0.5, 2.0 ** -16, 1 / 3.0, 3.0]), device=device)
    found = torch.zeros(1, device=device)
    ampkit.cast_unscale_and_check_(src, out, found, inv)
    expect = [torch.empty_like(o).copy_(s) for s, o in zip(src, out)]
    expect_found = torch.zeros(1, device=device)
    ampkit.unscale_and_check_(expect, expect_found, inv)
    assert all(bits_equal(a, b) for a, b in zip(out, expect))
    assert found.item() == expect_found.item()
    bad = any(not torch.isfinite(s.to(o.dtype)).all() for s, o in zip(src, out) if s.numel())
    assert found.item() == (1.0 if bad else 0.0)
    for s, o in zip(src, out):
        _assert_one_rounding_from(o, s.to(o.dtype).double() * inv.item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_in_the_last_element_of_the_last_chunk(device, value):
    src = [torch.randn(65537 * 2 + 3, device=device), torch.randn(131073, device=device)]
    src[-1][-1] = value
    out = [torch.empty(t.shape, dtype=torch.float16, device=device) for t in src]
    found = torch.zeros(1, device=device)
    ampkit.cast_unscale_and_check_(src, out, found, torch.full((1,), 0.25, device=device))
    assert found.item() == 1.0
    assert bits_equal(out[0], (src[0].half().float() * 0.25).half())


@pytest.mark.parametrize("device", DEVICES)
def test_a_value_that_only_overflows_in_the_wire_dtype_is_found(device):
    src = [torch.full((40,), 70000.0, device=device)]  # finite in FP32, Inf in FP16
    out = [torch.empty(40, dtype=torch.float16, device=device)]
    found = torch.zeros(1, device=device)
    ampkit.cast_unscale_and_check_(src, out, found, torch.full((1,), 2.0 ** -16, device=device))
    assert found.item() == 1.0
    out32 = [torch.empty(40, device=device)]
    found.zero_()
    ampkit.cast_unscale_and_check_(src, out32, found, torch.full((1,), 2.0 ** -16, device=device))
    assert found.item() == 0.0 and out32[0][0].item() == 70000.0 * 2.0 ** -16


@pytest.mark.parametrize("device", DEVICES)
def test_a_set_flag_is_never_cleared_and_empty_lists_do_nothing(device):
    found = torch.ones(1, device=device)
    src = [torch.randn(100, device=device)]
    out = [torch.empty(100, dtype=torch.bfloat16, device=device)]
    ampkit.cast_unscale_and_check_(src, out, found, torch.ones(1, device=device))
    assert found.item() == 1.0
    found.zero_()
    ampkit.cast_unscale_and_check_([], [], found, torch.ones(1, device=device))
    ampkit.cast_divide_([], [], 2.0)
    with pytest.raises(ValueError, match="divisor must be a finite number > 0 that FP32 holds, but got 0"):
        ampkit.cast_divide_([], [], 0.0)
    zero = [torch.empty(0, 3, device=device)]
    ampkit.cast_unscale_and_check_(zero, [torch.empty(0, 3, dtype=torch.float16, device=device)], found,
                                   torch.ones(1, device=device))
    assert found.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_one_source_may_feed_several_outputs(device):
    s = torch.randn(300, device=device)
    out = [torch.empty(300, dtype=torch.float16, device=device), torch.empty(300, dtype=torch.bfloat16, device=device)]
    ampkit.cast_divide_([s, s], out, 4)
    assert bits_equal(out[0], s.half() / 4) and bits_equal(out[1], s.bfloat16() / 4)


def _bad_cases():
    s = torch.randn(10)
    h = torch.empty(10, dtype=torch.float16)
    buf = torch.randn(20)
    return [
        (lambda: ([s], [h, h.clone()], 2.0), r"cast_divide_: out must have 1 tensors \(one per src\), but has 2"),
        (lambda: ([s], [torch.empty(11, dtype=torch.float16)], 2.0), r"out\[0\] must have the shape of src\[0\]"),
        (lambda: ([s.double()], [h], 2.0), r"src\[0\] must be Half, BFloat16 or Float, but got Double"),
        (lambda: ([s], [torch.empty(10, dtype=torch.int32)], 2.0), r"out\[0\] must be Half, BFloat16 or Float"),
        (lambda: ([s], [h], 0.0), r"divisor must be a finite number > 0 that FP32 holds, but got 0"),
        (lambda: ([s], [h], math.nan), r"divisor must be a finite number > 0"),
        (lambda: ([s], [h], -2.0), r"divisor must be a finite number > 0"),
        (lambda: ([s], [h], 1e-50), r"divisor must be a finite number > 0 that FP32 holds, but got 1e-50"),
        (lambda: ([s], [h], 1e39), r"divisor must be a finite number > 0 that FP32 holds"),
        (lambda: ([s], [torch.empty(1, dtype=torch.float16).expand(10)], 2.0), r"out\[0\] is written and must not"),
        (lambda: ([buf[:10]], [buf[5:15]], 2.0), r"out\[0\] and src\[0\] share memory|src\[0\] and out\[0\] share"),
        (lambda: ([s, s], [h, h], 2.0), r"out\[0\] and out\[1\] share memory"),
        (lambda: ([torch.eye(3).to_sparse()], [torch.empty(3, 3, dtype=torch.float16)], 2.0),
         r"src\[0\] must be a strided"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_raises_naming_the_argument_and_changes_nothing(case):
    make, message = _bad_cases()[case]
    src, out, divisor = make()
    before = [o.clone() for o in out if o.layout == torch.strided]
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        ampkit.cast_divide_(src, out, divisor)
    assert all(bits_equal(o, b) for o, b in zip([o for o in out if o.layout == torch.strided], before))


def test_unscale_variant_checks_its_scalars():
    s, h = [torch.randn(10)], [torch.zeros(10, dtype=torch.float16)]
    with pytest.raises(TypeError, match="cast_unscale_and_check_: found_inf must be a Float tensor"):
        ampkit.cast_unscale_and_check_(s, h, torch.zeros(1, dtype=torch.float64), torch.ones(1))
    with pytest.raises(RuntimeError, match="inv_scale must have exactly one element"):
        ampkit.cast_unscale_and_check_(s, h, torch.zeros(1), torch.ones(2))
    found = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"out\[0\] and found_inf share memory|found_inf and out\[0\] share"):
        ampkit.cast_unscale_and_check_([torch.randn(1)], [found], found, torch.ones(1))
    assert h[0].abs().sum().item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_fake_tensors(device):
    torch.manual_seed(0)
    src = [torch.randn(40, device=device), torch.randn(3, 5, device=device, dtype=torch.bfloat16)]
    out = [torch.empty(40, dtype=torch.float16, device=device), torch.empty(3, 5, device=device)]
    torch.library.opcheck(torch.ops.ampkit.cast_divide_.default, (src, out, 2.0))
    found, inv = torch.zeros(1, device=device), torch.full((1,), 0.5, device=device)
    torch.library.opcheck(torch.ops.ampkit.cast_unscale_and_check_.default, (src, out, found, inv))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ampkit.cast_divide_([torch.empty(8)], [torch.empty(8, dtype=torch.float16)], 2.0)
        with pytest.raises(RuntimeError, match=r"out\[0\] must have the shape of src\[0\]"):
            ampkit.cast_divide_([torch.empty(8)], [torch.empty(9, dtype=torch.float16)], 2.0)
