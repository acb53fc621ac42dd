"""The FP8 ops (fp8_quantize, fp8_compute_scale, fp8_update_amax_history_and_scale_) against scalar re-derivations
of their formulas: the saturating cast as an explicit clamp followed by torch's own round-to-nearest-even cast and
as exact rationals for every code and every tie, the scale in FP32 steps, the history update as Python loops;
edge cases, bad input (a clear error, nothing written), opcheck and Meta shapes."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

import ampkit
from conftest import DEVICES

FORMATS = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FLT_MAX = torch.finfo(torch.float32).max
INF, NAN = float("inf"), float("nan")


def f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal FP8/FP32 bits, any NaN equal to any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    na, nb = a.float().isnan(), b.float().isnan()
    if not torch.equal(na, nb):
        return False
    it = torch.uint8 if a.element_size() == 1 else torch.int32
    return torch.equal(a.contiguous().view(it)[~na], b.contiguous().view(it)[~nb])


def reference_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale in FP32, clamped to the format's range (+-Inf too), then torch's round-to-nearest-even cast."""
    m = FORMATS[dtype]
    v = x.float() * scale.float()
    return torch.where(v.isnan(), v, v.clamp(-m, m)).to(dtype)


def special_input(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    specials = [0.0, -0.0, INF, -INF, 1e-40, -1e-45, 460.0, -464.0, 61440.0, 1e30]
    x[: len(specials)] = torch.tensor(specials)
    return x[torch.randperm(n, generator=g)].to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", list(FORMATS))
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.37, 1024.0, 3.0e-30])
def test_quantize_matches_clamped_cast(device, fp8, xdtype, scale):
    x = special_input(4099, xdtype, seed=1).reshape(1, 4099).to(device)
    s = f32([scale]).to(device)
    q, amax, q_t = torch.ops.ampkit.fp8_quantize(x, s, fp8, True)
    assert q.dtype == fp8 and q.shape == x.shape and q_t.shape == (4099, 1)
    assert same_bits(q.cpu(), reference_quantize(x.cpu(), s.cpu(), fp8))
    assert same_bits(q_t.cpu(), q.cpu().t().contiguous())
    assert amax.dtype == torch.float32 and amax.dim() == 0
    assert same_bits(amax.cpu(), x.cpu().abs().amax().float())
    assert torch.isinf(amax).item()  # the input holds +-Inf: the amax shows it although q saturated it


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_nan_amax_and_saturation(device):
    x = f32([1.0, NAN, -INF, 1e9]).to(device)
    for fp8, m in FORMATS.items():
        q, amax, q_t = torch.ops.ampkit.fp8_quantize(x, f32(1.0).to(device), fp8)
        assert q_t is None
        assert math.isnan(amax.item())
        qf = q.float().cpu()
        assert qf[0] == 1.0 and math.isnan(qf[1]) and qf[2] == -m and qf[3] == m


def _values_of_codes(fp8: torch.dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    finite = codes[torch.isfinite(codes)]
    return sorted({Fraction(v) for v in finite.tolist() if v >= 0})


@pytest.mark.parametrize("fp8", list(FORMATS))
def test_quantize_every_code_and_every_tie(fp8):
    """Every non-negative finite code round-trips; every midpoint between neighbours goes to the even code (ties to
    even), and just above / below a midpoint to the nearer code: exact rationals, independent of any cast."""
    values = _values_of_codes(fp8)
    xs, expected = [], []
    for lo, hi in zip(values, values[1:]):
        mid = (lo + hi) / 2
        lo_code = torch.tensor([float(lo)]).to(fp8).view(torch.uint8).item()
        even = lo if lo_code % 2 == 0 else hi
        for x, e in ((lo, lo), (mid, even), (mid + (hi - lo) / 8, hi), (mid - (hi - lo) / 8, lo)):
            xs.append(float(x))  # every value here is exact in FP32
            expected.append(float(e))
    x = torch.tensor(xs + [-v for v in xs], dtype=torch.float32)
    want = torch.tensor(expected + [-v for v in expected], dtype=torch.float32)
    q, _, _ = torch.ops.ampkit.fp8_quantize(x, f32(1.0), fp8)
    assert torch.equal(q.float(), want)
    assert torch.equal(torch.signbit(q.float()), torch.signbit(want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", list(FORMATS))
def test_quantize_rowwise_noncontiguous_and_empty(device, fp8):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 33, generator=g) * 100).to(device)[:, 1::2]  # non-contiguous, 40 x 16
    s = (torch.rand(40, 1, generator=g) * 10).to(device)
    q, amax, q_t = torch.ops.ampkit.fp8_quantize(x, s, fp8, True)
    assert same_bits(q.cpu(), reference_quantize(x.cpu(), s.cpu(), fp8))
    assert same_bits(q_t.cpu(), q.cpu().t().contiguous())
    assert amax.item() == x.abs().amax().item()
    x3 = x.reshape(4, 10, 16)
    q3, _, _ = torch.ops.ampkit.fp8_quantize(x3, s.reshape(4, 10, 1), fp8)
    assert same_bits(q3.reshape(40, 16).cpu(), q.cpu())
    empty = torch.empty(0, 16, device=device)
    qe, ae, te = torch.ops.ampkit.fp8_quantize(empty, f32(2.0).to(device), fp8, True)
    assert qe.shape == (0, 16) and te.shape == (16, 0) and ae.item() == 0.0


def _every_pattern(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern of a 2-byte dtype (both NaN signs and payloads, subnormals, +-0, +-Inf); for FP32, 2^20
    random patterns and the FP8 rounding boundaries' neighbours."""
    if dtype != torch.float32:
        return torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2 ** 31), 2 ** 31, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([v for fp8 in FORMATS for v in _values_of_codes(fp8)], dtype=torch.float64)
    mids = torch.cat([edges, (edges[1:] + edges[:-1]) / 2]).float().view(torch.int32)
    near = (mids[:, None] + torch.arange(-2, 3, dtype=torch.int32)).flatten()
    return torch.cat([bits, near, near | (-(2 ** 31))]).view(torch.float32)


@pytest.mark.parametrize("fp8", list(FORMATS))
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_vector_loop_matches_scalar_code_bit_for_bit(fp8, xdtype):
    """The CPU loop casts whole vectors and leaves a row's last elements to the scalar functor: a row of n elements
    takes the vector code, n rows of one element the scalar one. Every code bit (NaN's sign and payload included)
    and the amax bits agree, for every 2-byte pattern and 2^20 FP32 ones, at scales that keep, shrink into the
    subnormals and overflow the values, and Inf and NaN scales."""
    x = _every_pattern(xdtype, seed=5)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))]
    for scale in (1.0, 0.37, 2.0 ** -14, 1e-30, 3e30, INF, -NAN, NAN):
        s = f32(scale)
        q, amax, _ = torch.ops.ampkit.fp8_quantize(x, s, fp8)
        q1, amax1, _ = torch.ops.ampkit.fp8_quantize(x.reshape(-1, 1), s, fp8)
        assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8).flatten()), scale
        assert torch.equal(amax.view(torch.int32), amax1.view(torch.int32)), scale
        assert same_bits(q, reference_quantize(x, s, fp8)), scale
    assert math.isnan(amax.item())  # the patterns hold NaNs


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_nan_product_takes_the_sign_of_x(xdtype):
    """A NaN x * scale (a NaN x or scale, 0 * Inf) is the NaN code with x's sign, whichever NaN the hardware's
    multiply returned (x86 returns an operand the compiler may swap; 0 * Inf its negative default NaN)."""
    x = torch.tensor([NAN, NAN, 0.0, -0.0, 1.5, -1.5, INF, -INF] * 5, dtype=xdtype)  # 40: vectors and a tail
    bits = x.view(torch.int32 if xdtype == torch.float32 else torch.int16)
    bits[1::8] |= bits.new_tensor(-(2 ** (8 * x.element_size() - 1)))  # -NaN (casts to 2-byte types drop its sign)
    assert torch.signbit(x[1::8].float()).all() and x[1::8].isnan().all()
    for fp8 in FORMATS:
        nan_code = 0x7F if fp8 == torch.float8_e4m3fn else None
        for scale, nan_at in ((NAN, range(8)), (-NAN, range(8)), (INF, (0, 1, 2, 3)), (0.0, (0, 1, 6, 7))):
            q, _, _ = torch.ops.ampkit.fp8_quantize(x, f32(scale), fp8)
            codes = q.view(torch.uint8).reshape(5, 8)
            for k in nan_at:
                want_sign = 0x80 if k % 2 else 0x00  # x's sign: the odd positions are negative
                got = codes[:, k]
                assert torch.all(got & 0x80 == want_sign), (fp8, scale, k, got)
                assert torch.all(q.float().reshape(5, 8)[:, k].isnan()), (fp8, scale, k)
                if nan_code is not None:
                    assert torch.all(got & 0x7F == nan_code), (fp8, scale, k, got)


@pytest.mark.parametrize("shape", [(8, 8), (37, 53), (64, 1030), (9, 7), (1, 4099), (3000, 3), (130, 16),
                                   (203, 517), (203, 2048)])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_quantize_transpose_every_shape_edge(shape, xdtype):
    """The transposed copy is written in 8 x 8 byte blocks, rows and columns past the last whole block byte by
    byte, a pass of rows at a time, over the row ranges of the parallel loop (on two threads, 203 rows split into
    ranges of 102 and 101 rows, the second starting off the 8-row grid; 203 x 2048 in passes of 32 rows): q_t is
    q's transpose bit for bit, q the per-row scalar code's."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 300).to(xdtype)
    s = torch.rand(shape[0], 1, generator=g) * 4
    q, _, q_t = torch.ops.ampkit.fp8_quantize(x, s, torch.float8_e4m3fn, True)
    assert torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t().contiguous())
    for r in range(0, shape[0], max(1, shape[0] // 5)):  # some rows, through the scalar code
        qr, _, _ = torch.ops.ampkit.fp8_quantize(x[r].reshape(-1, 1), s[r].reshape(()), torch.float8_e4m3fn)
        assert torch.equal(q[r].view(torch.uint8), qr.view(torch.uint8).flatten()), r


def test_quantize_bad_input_names_op_and_argument():
    x, s = torch.randn(4, 4), f32(1.0)
    cases = [
        ((x.double(), s, torch.float8_e4m3fn), TypeError, "x must be Float, BFloat16 or Half"),
        ((x, s.double(), torch.float8_e4m3fn), TypeError, "scale must be a Float tensor"),
        ((x, torch.ones(3), torch.float8_e4m3fn), ValueError, "scale must have one element"),
        ((x, s, torch.float16), ValueError, "dtype must be torch.float8_e4m3fn or torch.float8_e5m2"),
        ((x.reshape(16), s, torch.float8_e4m3fn, True), ValueError, "transpose=True needs a 2-D x"),
    ]
    for args, kind, message in cases:
        with pytest.raises(kind, match=f"ampkit::fp8_quantize: {message}"):
            torch.ops.ampkit.fp8_quantize(*args)


def reference_scale(amax: float, fp8_max: float, margin: float, eps: float, p2: bool, fallback: float = 1.0):
    a = f32(amax)
    if a < f32(eps):
        a = f32(eps)
    if a == 0 or not torch.isfinite(a):
        return f32(fallback)
    s = (f32(fp8_max) / a) / f32(2.0 ** margin)
    if torch.isinf(s):
        s = f32(FLT_MAX)
    if p2:
        mantissa, exponent = math.frexp(s.item())
        if s.item() >= torch.finfo(torch.float32).tiny:
            s = f32(math.ldexp(0.5, exponent))
    return s


AMAXES = [0.0, -0.0, INF, NAN, 1e-45, 1e-40, 1e-12, 3e-3, 1.0, 2.5, 448.0, 57344.0, 1e30, FLT_MAX]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
@pytest.mark.parametrize("margin", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("eps", [0.0, 1e-12])
@pytest.mark.parametrize("p2", [False, True])
def test_compute_scale_matches_reference(device, fp8_max, margin, eps, p2):
    amax = f32(AMAXES).to(device)
    got = torch.ops.ampkit.fp8_compute_scale(amax, fp8_max, margin, eps, p2).cpu()
    want = torch.stack([reference_scale(a, fp8_max, margin, eps, p2) for a in AMAXES])
    assert same_bits(got, want), (got, want)


def test_compute_scale_documented_cases():
    s = torch.ops.ampkit.fp8_compute_scale(f32([0.0, INF, NAN, 1e-45, 448.0]), 448.0, 0.0, 0.0, False)
    assert s.tolist()[:3] == [1.0, 1.0, 1.0]  # current scaling: 0, Inf, NaN give 1
    assert s[3].item() == FLT_MAX  # 448 / 1e-45 overflows
    assert s[4].item() == 1.0
    default_eps = torch.ops.ampkit.fp8_compute_scale(f32([0.0]), 448.0)  # amax_epsilon 1e-12 by default
    assert default_eps.item() == (f32(448.0) / f32(1e-12)).item()
    with pytest.raises(ValueError, match="ampkit::fp8_compute_scale: fp8_max must be a finite number > 0"):
        torch.ops.ampkit.fp8_compute_scale(f32([1.0]), 0.0)
    with pytest.raises(ValueError, match="ampkit::fp8_compute_scale: epsilon must be"):
        torch.ops.ampkit.fp8_compute_scale(f32([1.0]), 448.0, 0.0, -1.0)


def reference_update(histories, scales, algo, maxes, margin):
    """Python loops over the columns: the amax, the scale (a 0/Inf/NaN amax keeps the scale), roll -1, zero row 0."""
    for i, (h, s) in enumerate(zip(histories, scales)):
        fp8_max = maxes[i] if len(maxes) > 1 else maxes[0]
        cols = h.reshape(h.shape[0], -1)
        flat_s = s.reshape(-1)
        for c in range(cols.shape[1]):
            col = cols[:, c]
            if algo == "most_recent":
                a = col[0].item()
            else:
                a = NAN if col.isnan().any() else col.abs().max().item()
            flat_s[c] = reference_scale(a, fp8_max, margin, 0.0, False, fallback=flat_s[c].item())
        rolled = torch.roll(cols, -1, 0)
        rolled[0] = 0.0
        cols.copy_(rolled)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("rows", [1, 2, 16])
def test_update_history_matches_reference(device, algo, rows):
    g = torch.Generator().manual_seed(rows)
    shapes = [(rows,), (rows, 1), (rows, 3), (rows, 2, 2)]
    histories = [torch.rand(shape, generator=g) * 100 for shape in shapes]
    histories[0][rows - 1] = INF  # a non-finite amax in the oldest row (max: keeps the scale)
    histories[1][0] = 0.0  # a zero current amax (most_recent: keeps the scale)
    histories[2][0, 1] = NAN
    histories[3][0, 0, 0] = 1e-45  # subnormal: the scale overflows to FLT_MAX (most_recent)
    scales = [torch.rand(shape[1:] if len(shape) > 1 else (1,), generator=g) + 0.5 for shape in shapes]
    maxes = [448.0, 57344.0, 448.0, 57344.0]
    want_h, want_s = [h.clone() for h in histories], [s.clone() for s in scales]
    reference_update(want_h, want_s, algo, maxes, 1.0)
    got_h, got_s = [h.to(device) for h in histories], [s.to(device) for s in scales]
    torch.ops.ampkit.fp8_update_amax_history_and_scale_(got_h, got_s, algo, maxes, 1.0)
    for i in range(len(shapes)):
        assert same_bits(got_h[i].cpu(), want_h[i]), i
        assert same_bits(got_s[i].cpu(), want_s[i]), i


def test_update_history_scale_of_iteration_i_comes_from_earlier_amaxes():
    h, s = torch.zeros(4), torch.ones(1)
    update = torch.ops.ampkit.fp8_update_amax_history_and_scale_
    update([h], [s], "max", [448.0], 0.0)
    assert s.item() == 1.0  # an empty history keeps the scale
    h[0] = 2.0  # iteration 0's amax
    update([h], [s], "max", [448.0], 0.0)
    assert s.item() == 224.0 and h.tolist() == [0.0, 0.0, 0.0, 2.0]
    h[0] = 1.0
    update([h], [s], "max", [448.0], 0.0)
    assert s.item() == 224.0 and h.tolist() == [0.0, 0.0, 2.0, 1.0]  # the max over the history
    update([h], [s], "most_recent", [448.0], 0.0)
    assert s.item() == 224.0  # row 0 is 0: most_recent keeps the scale


def test_update_bad_input_writes_nothing():
    h, s = torch.rand(4, 2), torch.ones(2)
    before = (h.clone(), s.clone())
    update = torch.ops.ampkit.fp8_update_amax_history_and_scale_
    op = "ampkit::fp8_update_amax_history_and_scale_"
    bad = [
        (([h, torch.rand(3)], [s, torch.ones(1)], "max", [448.0], 0.0), ValueError,
         r"amax_histories\[1\] must have 4 rows"),
        (([h], [torch.ones(3)], "max", [448.0], 0.0), ValueError, r"scales\[0\] must have one element per column"),
        (([h], [s], "mean", [448.0], 0.0), ValueError, "amax_compute_algo must be 'max' or 'most_recent'"),
        (([h], [s], "max", [448.0, 1.0], 0.0), ValueError, "fp8_maxes must have one value per amax history"),
        (([h], [s], "max", [-1.0], 0.0), ValueError, r"fp8_maxes\[0\] must be a finite number > 0"),
        (([h], [s.double()], "max", [448.0], 0.0), TypeError, "must be Float tensors"),
        (([h.t()], [s], "max", [448.0], 0.0), RuntimeError, "must be contiguous"),
        (([h], [h[0]], "max", [448.0], 0.0), RuntimeError, "share memory|overlap"),
    ]
    for args, kind, message in bad:
        with pytest.raises(kind, match=message) as info:
            update(*args)
        assert op in str(info.value)
        assert torch.equal(h, before[0]) and torch.equal(s, before[1])


def test_update_lazy_clones_update_as_copies():
    """Copy-on-write histories and scales (torch._lazy_clone; two row blocks of one lazy clone) update as plain
    copies do, the list spread over the threads, and the tensors they were cloned from keep their values."""
    update = torch.ops.ampkit.fp8_update_amax_history_and_scale_
    src, scale_src = torch.rand(4, 6) * 100, torch.ones(6)
    orig = src.clone()
    want_h, want_s = src.clone(), scale_src.clone()
    update([want_h], [want_s], "max", [448.0], 0.0)
    lazy, lazy_scale = torch._lazy_clone(src), torch._lazy_clone(scale_src)
    rows = torch._lazy_clone(torch.cat([src, src]))
    h0, h1 = rows[:4], rows[4:]
    s0, s1 = torch.ones(6), torch.ones(6)
    update([lazy, h0, h1], [lazy_scale, s0, s1], "max", [448.0] * 3, 0.0)
    for h, s in ((lazy, lazy_scale), (h0, s0), (h1, s1)):
        assert torch.equal(h, want_h) and torch.equal(s, want_s)
    assert torch.equal(src, orig) and torch.equal(scale_src, torch.ones(6))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_fp8_ops(device):
    x = torch.randn(32, 48, device=device)
    s = f32([0.5]).to(device)
    for fp8 in FORMATS:
        torch.library.opcheck(torch.ops.ampkit.fp8_quantize.default, (x, s, fp8, True))
        torch.library.opcheck(torch.ops.ampkit.fp8_quantize.default, (x, s, fp8, False))
    torch.library.opcheck(torch.ops.ampkit.fp8_quantize.default, (x, torch.rand(32, 1, device=device),
                                                                  torch.float8_e5m2, False))
    torch.library.opcheck(torch.ops.ampkit.fp8_compute_scale.default, (f32([0.0, 3.0]).to(device), 448.0, 1.0))
    hist = [torch.rand(8, device=device), torch.rand(8, 2, device=device)]
    scales = [torch.ones(1, device=device), torch.ones(2, device=device)]
    torch.library.opcheck(torch.ops.ampkit.fp8_update_amax_history_and_scale_.default,
                          (hist, scales, "max", [448.0, 57344.0], 0.0))


def test_meta_shapes():
    x = torch.empty(6, 32, device="meta")
    q, amax, q_t = torch.ops.ampkit.fp8_quantize(x, torch.empty(1, device="meta"), torch.float8_e4m3fn, True)
    assert (q.shape, q.dtype, amax.shape, amax.dtype, q_t.shape) == ((6, 32), torch.float8_e4m3fn, (), torch.float32,
                                                                     (32, 6))
    s = torch.ops.ampkit.fp8_compute_scale(torch.empty(3, 1, device="meta"), 448.0)
    assert s.shape == (3, 1) and s.dtype == torch.float32
    with pytest.raises(ValueError, match="ampkit::fp8_quantize: scale must have one element"):
        torch.ops.ampkit.fp8_quantize(x, torch.empty(5, device="meta"), torch.float8_e4m3fn)


def test_fp8_formats_dtypes_and_maxima_are_torchs():
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    assert ampkit._C.fp8_dtypes("hybrid") == (e4m3, e4m3, e5m2)
    assert ampkit._C.fp8_dtypes("e4m3") == (e4m3, e4m3, e4m3)
    for fmt in ("hybrid", "e4m3"):
        assert ampkit._C.fp8_maxes(fmt) == tuple(torch.finfo(d).max for d in ampkit._C.fp8_dtypes(fmt))
    with pytest.raises(ValueError, match="fp8_format must be 'hybrid' or 'e4m3', but got 'e5m2'"):
        ampkit._C.fp8_dtypes("e5m2")
