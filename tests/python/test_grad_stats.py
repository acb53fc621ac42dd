"""torch.ops.ampkit.grad_stats against a float64 reference written with torch ops: max, norm, counts and the exponent
histogram of every dtype, size and layout, with Inf/NaN/zeros/subnormals, scaled and unscaled; the norm's order is
the same run after run; bad input raises; opcheck and fake tensors."""
from __future__ import annotations

import math
import random

import pytest
import torch

import ampkit
from conftest import DEVICES, bits_equal
from reference import grad_stats_row

COLS = ampkit.GRAD_STATS_COLUMNS
FIRST = ampkit.GRAD_STATS_HIST_FIRST
MIN_EXP = ampkit.GRAD_STATS_HIST_MIN_EXP
SIZES = [0, 1, 7, 8, 9, 4095, 4096, 4097, 65535, 65536, 65537, 200003]


def stats_rows(grads, inv_scale=None):
    """The op's rows rebuilt from ampkit.grad_stats' named view, so that every test below goes through it."""
    named = ampkit.grad_stats(grads, inv_scale)
    assert sorted(named) == ["amax", "exp_hist", "l2_norm", "nonfinite", "zeros"]
    return torch.cat([named["amax"][:, None], named["l2_norm"][:, None], named["nonfinite"][:, None],
                      named["zeros"][:, None], named["exp_hist"]], dim=1)


def _grads(rng: random.Random, device: str) -> list[torch.Tensor]:
    out = []
    for _ in range(rng.randint(1, 5)):
        n = rng.choice(SIZES)
        dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
        t = torch.randn(n, dtype=torch.float64) * 10.0 ** rng.uniform(-8, 5)
        if n:
            t[torch.randint(n, (max(1, n // 50),))] = 0.0
            if rng.random() < 0.5:
                t[-1] = rng.choice([math.inf, -math.inf, math.nan])
        t = t.to(dtype)
        layout = rng.choice(["flat", "strided", "matrix-t"])
        if layout == "strided":
            t = torch.stack([t, t]).t().contiguous()[:, 0]  # every other element of a buffer
        elif layout == "matrix-t" and n % 4 == 0 and n:
            t = t.view(4, n // 4).t()
        out.append(t.to(device))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(16))
def test_matches_a_float64_reference(device, seed):
    rng = random.Random(seed)
    grads = _grads(rng, device)
    inv = rng.choice([None, 1.0, 2.0 ** -16, 1 / 3.0, 2.0 ** 100 / 2.0 ** 90])
    inv_t = None if inv is None else torch.full((1,), inv, device=device)
    stats = stats_rows(grads, inv_t)
    assert stats.shape == (len(grads), COLS) and stats.dtype == torch.float64 and stats.device.type == device
    used_inv = torch.tensor(1.0 if inv is None else inv, dtype=torch.float32).item()
    for g, row in zip(grads, stats.cpu()):
        ref = grad_stats_row(g, used_inv)
        assert torch.equal(row[2:4], ref[2:4])
        assert torch.equal(row[FIRST:], ref[FIRST:]), (row[FIRST:].nonzero(), ref[FIRST:].nonzero())
        assert row[0].item() == ref[0].item()
        torch.testing.assert_close(row[1], ref[1], rtol=1e-12, atol=0)
    again = stats_rows(grads, inv_t)
    assert torch.equal(again, stats)  # the norm's order is fixed
    if device != "cpu":
        on_cpu = stats_rows([g.cpu() for g in grads], None if inv_t is None else inv_t.cpu())
        assert torch.equal(on_cpu, stats.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inv", [1.0, 2.0 ** -16, 1 / 3.0])
def test_histogram_of_rows_spanning_many_binades(device, dtype, inv):
    """Rows whose elements lie far apart in exponent (240 binades), at 14, 15 and 16 binades under a row's
    largest, and rows whose top bin is among the lowest; zeros, Inf/NaN and partial vectors at the ends of rows."""
    gen = torch.Generator().manual_seed(5)
    top = 2.0 ** 20
    edges = [top, top * 1.5, top * 2.0 ** -14, top * 2.0 ** -15, top * 2.0 ** -16, 0.0, -top * 2.0 ** -14]
    spread = torch.randn(3 * 512 + 7, generator=gen, dtype=torch.float64) * 2.0 ** torch.randint(
        -120, 120, (3 * 512 + 7,), generator=gen).double()
    lowest = torch.tensor([2.0 ** -133, 2.0 ** -130, 2.0 ** -120, -2.0 ** -126, 0.0] * 41, dtype=torch.float64)
    grads = [torch.tensor(edges * 75, dtype=torch.float64), spread, lowest,
             torch.cat([spread[:517], torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)])]
    grads = [g.to(dtype).to(device) for g in grads]
    stats = stats_rows(grads, torch.full((1,), inv, device=device))
    used_inv = torch.tensor(inv, dtype=torch.float32).item()
    for g, row in zip(grads, stats.cpu()):
        ref = grad_stats_row(g, used_inv)
        assert torch.equal(row[2:4], ref[2:4])
        assert torch.equal(row[FIRST:], ref[FIRST:]), (row[FIRST:].nonzero(), ref[FIRST:].nonzero())
        assert row[0].item() == ref[0].item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inv", [2.0 ** -16, 1 / 3.0, 2.0 ** -126, 2.0 ** 100])  # the last two: windows at the ends
def test_histogram_of_chunks_whose_binades_move(device, dtype, inv):
    """NOTE [Histogram by bit counts]: the CPU loop counts a window of 30 bins under a chunk's first row's largest;
    these chunks start with a row of zeros, then blocks of 2048 elements each 40 (FP16: 12) binades from the one before,
    blocks with a few elements (fewer and more than 64) far under or over the rest, the window's edge bins, and
    ends with partial rows and Inf/NaN. Every count must equal the float64 reference."""
    gen = torch.Generator().manual_seed(17)
    n = 2 * 65536 + 3 * 512 + 77
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    block = torch.arange(n) // 2048
    step = 12 if dtype == torch.float16 else 40  # FP16 holds 2^-24..2^15
    x = x * torch.exp2((block % 3 * step - step).double())
    x[:512] = 0.0  # the first row of the first chunk: nothing live
    for start, far in ((4 * 2048, 60), (5 * 2048, 65), (6 * 2048, 500)):
        idx = start + torch.randperm(2048, generator=gen)[:far]
        x[idx] = x[idx] * 2.0 ** -20 * torch.exp2(torch.randint(-12, 12, (far,), generator=gen).double())
    x[7 * 2048:7 * 2048 + 40] = 2.0 ** torch.arange(-20, 20).double()  # 40 consecutive binades in one vector run
    x[-700:-600] = 2.0 ** 10
    x[-3:] = torch.tensor([math.inf, math.nan, -0.0], dtype=torch.float64)
    g = x.clamp(-60000, 60000).to(dtype) if dtype == torch.float16 else x.to(dtype)
    g[-3:-1] = torch.tensor([math.inf, math.nan])
    g = g.to(device)
    inv32 = torch.tensor(inv, dtype=torch.float32).item()
    # Data wider than any window (exponents spread over the whole range, and two clusters 2^40 apart): after its
    # window's last move a chunk counts element by element.
    lo, hi = (-24, 15) if dtype == torch.float16 else (-140, 127)
    spread = torch.exp2(torch.randint(lo, hi, (2 * 65536 + 100,), generator=gen).double()) * (1 + torch.rand(
        2 * 65536 + 100, generator=gen, dtype=torch.float64))
    clusters = torch.randn(65536 + 4096, generator=gen, dtype=torch.float64)
    clusters[torch.rand(clusters.numel(), generator=gen) < 0.1] *= 2.0 ** (12 if dtype == torch.float16 else 40)
    # Zeros and Inf/NaN before and after the switch to counting element by element (rows counted both ways in one
    # chunk: the zeros of the window's rows are derived from counts, the later rows' counted one by one).
    for wide in (spread, clusters):
        wide[torch.randint(wide.numel(), (300,), generator=gen)] = 0.0
        wide[[5, 3000, 40000, 65536 + 1000, wide.numel() - 1]] = torch.tensor(
            [math.inf, math.nan, -math.inf, math.nan, math.inf], dtype=torch.float64)
    tensors = [g, g[1:], g[513:], spread.to(dtype).to(device), clusters.to(dtype).to(device)]
    row = stats_rows(tensors, torch.full((1,), inv, device=device)).cpu()
    for r, t in zip(row, tensors):
        ref = grad_stats_row(t, inv32)
        assert torch.equal(r[2:4], ref[2:4]) and r[0] == ref[0]
        assert torch.equal(r[FIRST:], ref[FIRST:]), (r[FIRST:] - ref[FIRST:]).nonzero()
    if 2.0 ** -20 <= inv <= 1.0:  # (at the histogram's ends, most elements clamp into its first or last bin)
        assert (row[0, FIRST:] > 0).sum() > 32  # more bins than the 30 of a window


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inv", [1.0, 2.0 ** -16, 1 / 3.0, 2.0 ** -126, 2.0 ** 127])  # the last two: at the ends
def test_elements_at_the_windows_edges_are_counted_once(device, dtype, inv):
    """NOTE [Histogram by bit counts]: a chunk's window spans 25 bins under its first row's largest and 4 over it. A
    few elements (too few to move the window) in the window's first and last bins and in the bins just outside it
    (one, two and three over, one and two under: the AVX-512 blocks' unmasked one-hot shift sets bits 30 and 31 for
    the first two over), one edge per block, with zeros, subnormals and Inf/NaN among them, must each land in its own
    bin once; the norm, with Inf in one lane of a block's four rows, stays NOTE [Deterministic norm]'s, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    n = 65536 + 3 * 2048 + 100
    x = torch.randn(n, generator=gen, dtype=torch.float64) * 0.25
    x[:512] = torch.rand(512, generator=gen, dtype=torch.float64) + 0.5  # the first row's largest: 1.5, exponent 0
    x[0] = 1.5
    # One edge per block of 4 rows (the AVX-512 loop's unit), each block of the first chunk and of the second.
    for b, edge in enumerate([4, 5, 6, 7, -25, -26, -27]):
        for start in (2048 * (2 + b) + 37 * b, 65536 + 2048 * (b % 2) + 300 + b):
            x[start:start + 2] = torch.tensor([1.5, -1.5], dtype=torch.float64) * 2.0 ** edge
            x[start + 2:start + 6] = 0.0
            x[start + 6] = 2.0 ** -140  # FP32/BF16: subnormal; FP16: zero
    x[20 * 2048 + 9] = math.inf
    x[20 * 2048 + 700] = math.nan
    x[20 * 2048 + 701] = -math.inf
    x[21 * 2048 + 5:22 * 2048:512] = math.inf  # the same lane of a block's four rows
    g = x.to(dtype)
    bits = g.view(torch.int16 if dtype != torch.float32 else torch.int32)
    bits[21 * 2048 + 6] = -1  # a negative NaN with every payload bit set
    bits[21 * 2048 + 1000] = 0x7C01 if dtype == torch.float16 else (0x7F81 if dtype == torch.bfloat16 else 0x7F800001)
    g = g.to(device)
    inv32 = torch.tensor(inv, dtype=torch.float32).item()
    tensors = [g, g[2048:]]
    rows = stats_rows(tensors, torch.full((1,), inv, device=device)).cpu()
    for row, t in zip(rows, tensors):
        ref = grad_stats_row(t, inv32)
        assert torch.equal(row[2:4], ref[2:4]) and row[0] == ref[0]
        assert torch.equal(row[FIRST:], ref[FIRST:]), (row[FIRST:] - ref[FIRST:]).nonzero()
        assert row[1].item() == math.sqrt(deterministic_sum_of_squares(t)) * inv32  # Inf/NaN rows summed again
    assert rows[0, 2].item() == 9 and rows[0, 3].item() >= 12


def deterministic_sum_of_squares(g: torch.Tensor) -> float:
    """NOTE [Deterministic norm] re-derived: chunks of 65536, element i of a chunk in lane i % 512, each lane summing
    its finite squares in element order in double, a chunk its lanes in lane order, the tensor its chunks in order."""
    x = g.detach().cpu().float().double().flatten()
    x = torch.where(x.isfinite(), x, torch.zeros_like(x))
    total = 0.0
    for c in range(0, x.numel(), 65536):
        chunk = x[c:c + 65536]
        rows = torch.nn.functional.pad(chunk, (0, (-chunk.numel()) % 512)).view(-1, 512)
        lanes = torch.zeros(512, dtype=torch.float64)
        for row in rows:
            lanes = lanes + row * row  # one rounded square, one rounded add per element, in element order
        chunk_sum = 0.0
        for lane in lanes.tolist():
            chunk_sum += lane
        total += chunk_sum
    return total


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 511, 512, 513, 65536 + 700, 3 * 65536 + 17])
@pytest.mark.parametrize("inv", [1.0, 2.0 ** -16, 1 / 3.0])
def test_norm_follows_the_documented_order_bit_for_bit(device, dtype, n, inv):
    """The CPU loop (vectorized) and the CUDA kernel both add squares in NOTE [Deterministic norm]'s order: the
    norm equals that order re-derived here, bit for bit, with zeros, Inf/NaN and subnormals in every lane position
    and a non-finite value in the last element of the last chunk; the other columns match the float64 reference
    with a power-of-two inv_scale (the loop reads exponents from the float's bits) and another one."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(torch.randint(-30, 12, (n,), generator=gen))
    x[torch.randint(n, (max(1, n // 7),), generator=gen)] = 0.0
    if n > 4:
        x[1] = -math.inf
        x[2] = 1e-40  # subnormal in FP32 and BF16 (zero in FP16)
        x[3] = -3e-39 if dtype != torch.float16 else 2.0 ** -20  # subnormal in every dtype
        x[-1] = math.nan
    g = x.to(dtype).to(device)
    inv32 = torch.tensor(inv, dtype=torch.float32).item()
    row = stats_rows([g], torch.full((1,), inv, device=device))[0].cpu()
    assert row[1].item() == math.sqrt(deterministic_sum_of_squares(g)) * inv32
    ref = grad_stats_row(g, inv32)
    assert torch.equal(row[2:4], ref[2:4]) and torch.equal(row[FIRST:], ref[FIRST:]) and row[0] == ref[0]


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_range_lands_in_its_documented_columns(device):
    g = torch.tensor([2.0 ** -24, 65504.0, -1.0, 0.0, math.inf, math.nan], dtype=torch.float16, device=device)
    row = stats_rows([g])[0].cpu()
    assert row[114] == 1 and row[153] == 1 and row[FIRST + 1 - MIN_EXP] == 1  # 2^-24, 65504, 1.0
    assert row[2] == 2 and row[3] == 1 and row[0] == 65504.0 and row[FIRST:].sum() == 3
    scaled = stats_rows([g], torch.full((1,), 2.0 ** -149, device=device))[0].cpu()
    assert scaled[FIRST] == 3  # all below 2^-133 once unscaled
    huge = stats_rows([torch.full((3,), 2.0 ** 100, device=device)], torch.full((1,), 2.0 ** 60, device=device))
    assert huge[0, -1].item() == 3 and huge[0, 0].item() == 2.0 ** 160


def test_empty_lists_and_zero_size_tensors():
    assert stats_rows([]).shape == (0, COLS)
    stats = stats_rows([torch.empty(0), torch.ones(3), torch.empty(2, 0, dtype=torch.bfloat16)])
    assert torch.equal(stats[0], torch.zeros(COLS)) and torch.equal(stats[2], torch.zeros(COLS))
    assert stats[1, 1].item() == math.sqrt(3.0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ([torch.ones(3, dtype=torch.float64)], None),
         r"grad_stats: grads\[0\] must be Half, BFloat16 or Float"),
        (lambda: ([torch.ones(3), torch.ones(2, dtype=torch.int32)], None), r"grads\[1\] must be Half"),
        (lambda: ([torch.ones(3)], torch.ones(2)), "inv_scale must have exactly one element"),
        (lambda: ([torch.ones(3)], torch.ones(1, dtype=torch.float16)), "inv_scale must be a Float tensor"),
        (lambda: ([torch.eye(3).to_sparse()], None), r"grads\[0\] must be a strided"),
    ],
)
def test_bad_input_raises_naming_the_argument(make, message):
    grads, inv = make()
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        stats_rows(grads, inv)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_fake_tensors(device):
    grads = [torch.randn(100, device=device), torch.randn(3, 7, device=device, dtype=torch.bfloat16)]
    torch.library.opcheck(torch.ops.ampkit.grad_stats.default, (grads, torch.full((1,), 0.5, device=device)))
    torch.library.opcheck(torch.ops.ampkit.grad_stats.default, (grads,))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = stats_rows([torch.empty(5), torch.empty(6, dtype=torch.float16)])
        assert out.shape == (2, COLS) and out.dtype == torch.float64


def test_the_named_view_is_views_of_the_ops_rows_column_by_column():
    torch.manual_seed(9)
    grads = [torch.randn(50), torch.tensor([float("nan"), 0.0, 2.0 ** -140, 3.0]), torch.randn(7).half()]
    rows = torch.ops.ampkit.grad_stats(grads)
    named = ampkit.grad_stats(grads)
    assert bits_equal(named["amax"], rows[:, 0]) and bits_equal(named["l2_norm"], rows[:, 1])
    assert named["nonfinite"].tolist() == [0.0, 1.0, 0.0] and named["zeros"].tolist() == [0.0, 1.0, 0.0]
    assert named["exp_hist"].shape == (3, ampkit.GRAD_STATS_COLUMNS - ampkit.GRAD_STATS_HIST_FIRST)
    assert named["exp_hist"][1, 0].item() == 1.0  # 2^-140: below the histogram's first exponent
    assert named["exp_hist"][1, 1 + 1 - ampkit.GRAD_STATS_HIST_MIN_EXP].item() == 1.0  # 3.0: exponent 1
    again = ampkit._C.grad_stats_by_name(rows)
    assert all(again[k].data_ptr() >= rows.data_ptr() and again[k].untyped_storage().data_ptr()
               == rows.untyped_storage().data_ptr() for k in again)  # views: no copy
    with pytest.raises(ValueError, match=r"grad_stats_by_name: rows must be grad_stats' \[n, 267\] float64 rows, "
                                         r"but got a Float tensor of shape \[3, 267\]"):
        ampkit._C.grad_stats_by_name(rows.float())
    empty = ampkit.grad_stats([])
    assert empty["amax"].shape == (0,) and empty["exp_hist"].shape == (0, 263)
