"""ampkit.fp8: fp8_linear / fp8_linear_delayed and Float8Linear against a dequantized-operand FP32 reference and
against FP32 nn.Linear by SQNR; delayed scaling's one-iteration lag on a spike, current scaling following it;
convert, autocast, state_dict, opcheck and torch.compile."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampkit
from ampkit import fp8
from conftest import DEVICES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum())).item()


def dequantized(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The operand the FP8 GEMM multiplies: q(x) = clamp(x * scale).to(dtype), then times 1/scale, in FP32."""
    x = x.float()
    if scale is None:
        amax = torch.clamp(x.abs().amax(), min=1e-12)
        scale = torch.tensor(MAX[dtype], dtype=torch.float32) / amax
    scale = scale.reshape(())
    q = (x * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q.float() * torch.reciprocal(scale)


# NOTE [FP8 GEMM error model]
# A GEMM of quantized operands, c = sum_k a_k b_k over K terms, against the exact sum of the dequantized operands'
# products (the reference, in FP64). Every product of two FP8 values is exact (4 x 4 significand bits fit any
# accumulator), so a result differs from the reference only by
#   - the accumulation: with a unit roundoff u_acc per addition, in any order or grouping, at most
#     K * u_acc * S with S = sum_k |a_k b_k| (recursive summation: gamma_(K-1) <= K u, Higham, "Accuracy and
#     Stability of Numerical Algorithms", 2nd ed., section 4.2; a tensor core that aligns a group of terms to the
#     largest and truncates the rest loses < u_acc * S per term, the same bound).
#     CPU: exactly FP32 accumulation of the exact products (NOTE [FP8 GEMM on the CPU]), u_acc = 2^-24.
#     CUDA: Hopper's FP8 tensor cores keep fewer bits than FP32 between promotions of the partial sums: "limited
#     to retaining around 14 bits" on H800 (DeepSeek-V3 Technical Report, arXiv:2412.19437, section 3.3.2,
#     "Increasing Accumulation Precision"), i.e. 13 fraction bits, truncated. cuBLASLt and CUTLASS without fast
#     accumulation (use_fast_accum=False, as ampkit calls torch._scaled_mm; CUBLASLT_MATMUL_DESC_FAST_ACCUM off)
#     promote them to FP32 every few k-blocks (DeepSeek-V3: every 128 elements). The bound takes u_acc = 2^-13
#     over all K, crediting no promotion: exact up to the promotion interval (K <= 128 here), safe beyond.
#   - the scaling: the kernel multiplies the sum by the dequantizing scales, the reference multiplies each operand
#     by its own: at most 4 FP32 roundings per product, covered by 5 * 2^-24 * S.
#   - the output: one rounding, 2^-24 relative to FP32, 2^-8 to BF16 (round to nearest, 8-bit significand). The
#     GPU's rowwise GEMM writes BF16 only (csrc/ops/fp8_linear.cpp, scaled_mm): on CUDA a rowwise result carries
#     BF16's rounding whatever the output dtype.
# The bound stays far tighter than a wrong scale: on this file's inputs (K = 96) the CUDA bound is about 11% of
# |c| at the median and the CPU's 6e-5; a factor of 2 (100%) fails on 94% of the elements on CUDA, all on the CPU,
# while a simulated 13-bit truncating accumulation with BF16 output stays within 0.19 of the CUDA bound
# (test_the_error_model_rejects_a_scale_off_by_two).
FP32_UNIT, BF16_UNIT = 2.0**-24, 2.0**-8
ACC_UNIT = {"cpu": FP32_UNIT, "cuda": 2.0**-13}
OUT_UNIT = {torch.float32: FP32_UNIT, torch.bfloat16: BF16_UNIT}


def gemm_bound(a: torch.Tensor, b: torch.Tensor, device: str, out_dtype: torch.dtype, rowwise: bool = False,
               bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, bound): a @ b^T of the dequantized operands in FP64 (plus bias), and the elementwise bound on
    |result - reference| of ampkit's FP8 GEMM on `device` writing `out_dtype` (NOTE [FP8 GEMM error model]); a
    bias is added in `out_dtype`, one more rounding."""
    device = torch.device(device).type
    a, b = a.double().cpu(), b.double().cpu()
    ref = a @ b.t()
    acc = (a.shape[1] * ACC_UNIT[device] + 5 * FP32_UNIT) * (a.abs() @ b.abs().t())
    gemm_out = torch.bfloat16 if device == "cuda" and rowwise else out_dtype
    bound = acc + OUT_UNIT[gemm_out] * (ref.abs() + acc)
    if bias is not None:
        ref = ref + bias.double().cpu()
        bound = bound + OUT_UNIT[out_dtype] * (ref.abs() + bound)
    return ref, bound


def assert_within(got: torch.Tensor, ref_and_bound: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    ref, bound = ref_and_bound
    err = (got.detach().double().cpu() - ref).abs()
    worst = (err / bound).nan_to_num(nan=0.0, posinf=float("inf")).max().item()
    assert bool((err <= bound).all()), f"{what}: error up to {worst:.3g} times the bound"


def make(device, n=64, k=96, m=48, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g).to(device, dtype)
    layer = nn.Linear(k, m).to(device)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(m, k, generator=g) * 0.1)
        layer.bias.copy_(torch.randn(m, generator=g))
    dy = torch.randn(n, m, generator=g).to(device, dtype)
    return x, layer, dy


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("tokens", [64, 37])  # 37: padded to 48 for the GPU's GEMM shapes, cut back
def test_forward_backward_match_dequantized_reference(device, fmt, tokens):
    x, layer, dy = make(device, n=tokens)
    f8 = fp8.Float8Linear.from_linear(copy.deepcopy(layer), fp8.CurrentScaling(fp8_format=fmt))
    xg = x.clone().requires_grad_()
    y = f8(xg)
    y.backward(dy)
    dy_dtype = E5M2 if fmt == "hybrid" else E4M3
    xq, wq, dyq = dequantized(x, E4M3), dequantized(layer.weight.detach(), E4M3), dequantized(dy, dy_dtype)
    # Bounds per device from the error model (NOTE [FP8 GEMM error model]): FP32 accumulation on the CPU, Hopper's
    # reduced-precision FP8 accumulation on CUDA; every output FP32.
    f32 = torch.float32
    assert_within(y, gemm_bound(xq, wq, device, f32, bias=layer.bias.detach()), "y")
    assert_within(xg.grad, gemm_bound(dyq, wq.t(), device, f32), "dx")
    assert_within(f8.weight.grad, gemm_bound(dyq.t(), xq.t(), device, f32), "dw")
    torch.testing.assert_close(f8.bias.grad, dy.sum(0), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_sqnr_against_fp32_linear(device):
    x, layer, dy = make(device, n=256, k=256, m=128, seed=1)
    ref = copy.deepcopy(layer)
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    f8 = fp8.convert(copy.deepcopy(layer), fp8.CurrentScaling())
    assert isinstance(f8, fp8.Float8Linear)
    xg = x.clone().requires_grad_()
    y = f8(xg)
    y.backward(dy)
    assert sqnr(ref(x), y) >= 25.0
    assert sqnr(xr.grad, xg.grad) >= 20.0
    assert sqnr(ref.weight.grad, f8.weight.grad) >= 20.0


def dequantized_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rowwise: each row of x quantized with its own scale fp8_max / max|row|, then dequantized, in FP32."""
    x = x.float()
    scale = torch.tensor(MAX[dtype], dtype=torch.float32, device=x.device) / x.abs().amax(1, keepdim=True).clamp(
        min=1e-12)
    q = (x * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q.float() * torch.reciprocal(scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [48, 21])
def test_rowwise_matches_dequantized_reference(device, fmt, dtype, tokens):
    """Each GEMM's operands scaled by row along the dimension it sums over: y from x and W by rows, dX from dY by
    rows and W by columns, dW from dY and x by columns (tokens)."""
    x, layer, dy = make(device, n=tokens, k=64, m=32, seed=11, dtype=dtype)
    layer = layer.to(dtype)
    f8 = fp8.Float8Linear.from_linear(copy.deepcopy(layer), fp8.CurrentScaling(granularity="rowwise",
                                                                               fp8_format=fmt))
    xg = x.clone().requires_grad_()
    y = f8(xg)
    y.backward(dy)
    dyd = E5M2 if fmt == "hybrid" else E4M3
    w = layer.weight.detach()
    # Bounds per device and dtype from the error model (NOTE [FP8 GEMM error model]): on CUDA the rowwise GEMM's
    # BF16 output and the reduced-precision accumulation, on the CPU FP32 accumulation.
    y_ref = gemm_bound(dequantized_rows(x, E4M3), dequantized_rows(w, E4M3), device, dtype, rowwise=True,
                       bias=layer.bias.detach())
    dx_ref = gemm_bound(dequantized_rows(dy, dyd), dequantized_rows(w.t(), E4M3), device, dtype, rowwise=True)
    dw_ref = gemm_bound(dequantized_rows(dy.t(), dyd), dequantized_rows(x.t(), E4M3), device, dtype, rowwise=True)
    assert y.dtype == xg.grad.dtype == f8.weight.grad.dtype == dtype
    assert_within(y, y_ref, "y")
    assert_within(xg.grad, dx_ref, "dx")
    assert_within(f8.weight.grad, dw_ref, "dw")
    # Not the tensorwise result: the scales did differ by row.
    tensorwise = fp8.Float8Linear.from_linear(copy.deepcopy(layer), fp8.CurrentScaling(fp8_format=fmt))
    assert not torch.equal(tensorwise(x), y.detach())


# Each device's model, named apart from the devices: these run on the CPU (no `cuda` parametrization).
MODELS = {"fp32-accumulation": "cpu", "fp8-tensor-core-accumulation": "cuda"}


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_the_error_model_rejects_a_scale_off_by_two(model_name, granularity):
    """The bounds the FP8 layer tests use, for either device's model (computed here, no device needed), are far
    tighter than the error of a scale off by a factor of 2: such a result fails on almost every element."""
    model = MODELS[model_name]
    x, layer, _ = make("cpu")
    deq = dequantized if granularity == "tensorwise" else dequantized_rows
    a, b = deq(x, E4M3), deq(layer.weight.detach(), E4M3)
    ref, bound = gemm_bound(a, b, model, torch.float32, rowwise=granularity == "rowwise")
    caught = (ref.abs() > bound).double().mean().item()  # |2c - c| = |c| beyond the bound
    assert caught >= (0.999 if model == "cpu" else 0.9), caught
    assert (bound / ref.abs()).median().item() <= (1e-4 if model == "cpu" else 0.15)
    for wrong in (2.0, 0.5):
        with pytest.raises(AssertionError, match="times the bound"):
            assert_within((a * wrong) @ b.t(), (ref, bound), "y")
    # And loose enough for the model's own device: its accumulation, simulated (each partial sum truncated to
    # 13 fraction bits on CUDA, rounded to FP32 on the CPU, never promoted), and its output's rounding.
    acc = torch.zeros_like(ref)
    for k in range(a.shape[1]):
        acc = acc + a[:, k:k + 1].double() * b[:, k].double()
        if model == "cuda":
            mantissa, exponent = torch.frexp(acc)
            acc = torch.ldexp(torch.trunc(mantissa * 2.0**14), exponent - 14)
        else:
            acc = acc.float().double()
    out = torch.bfloat16 if model == "cuda" and granularity == "rowwise" else torch.float32
    assert_within(acc.to(out), (ref, bound), "simulated")


def test_rowwise_keeps_small_rows_accurate_beside_outlier_rows():
    """Rows 1e5 times apart (outlier tokens): under one tensorwise scale the small rows fall into E4M3's subnormals
    (6.8 dB left), rowwise keeps every row at full FP8 precision (28.7 dB, as without outliers)."""
    x, layer, dy = make("cpu", n=256, k=256, m=128, seed=12)
    layer.bias.data.zero_()
    x[::16] *= 1e5
    ref = layer(x).detach()
    small = torch.ones(256, dtype=torch.bool)
    small[::16] = False
    got = {}
    for gran in ("tensorwise", "rowwise"):
        f8 = fp8.Float8Linear.from_linear(copy.deepcopy(layer), fp8.CurrentScaling(granularity=gran))
        got[gran] = sqnr(ref[small], f8(x).detach()[small])
    assert got["rowwise"] >= 25.0
    assert got["rowwise"] >= got["tensorwise"] + 15.0, got


@pytest.mark.parametrize("device", DEVICES)
def test_rowwise_zero_rows_and_all_zero_rows(device):
    x, layer, dy = make(device, n=32, k=32, m=16, seed=13)
    f8 = fp8.Float8Linear.from_linear(copy.deepcopy(layer), fp8.CurrentScaling(granularity="rowwise"))
    empty = torch.zeros(0, 32, device=device, requires_grad=True)
    y = f8(empty)
    y.sum().backward()
    assert y.shape == (0, 16) and torch.equal(f8.weight.grad, torch.zeros_like(f8.weight))
    x[3] = 0.0  # an all-zero row: the amax epsilon keeps its scale finite
    xg = x.clone().requires_grad_()
    y = f8(xg)
    y.backward(dy)
    assert torch.isfinite(y).all() and torch.isfinite(xg.grad).all()
    torch.testing.assert_close(y[3], layer.bias.detach(), rtol=0, atol=0)


def _delayed(layer, history_len=16, algo="max"):
    return fp8.Float8Linear.from_linear(copy.deepcopy(layer), fp8.DelayedScaling(amax_history_len=history_len,
                                                                                 amax_compute_algo=algo))


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_lags_a_spike_by_one_iteration(device):
    x, layer, dy = make(device, seed=2)
    f8 = _delayed(layer)
    ref = lambda inp: layer(inp).detach()  # noqa: E731
    for _ in range(3):  # warm the histories on ordinary data
        f8(x).backward(dy)
    assert sqnr(ref(x), f8(x).detach()) >= 25.0
    spike = x * 64.0
    y_spike = f8(spike)  # quantized with the scale of the earlier iterations: saturates
    assert sqnr(ref(spike), y_spike.detach()) < 15.0
    assert f8.amax_history_input[0].item() == spike.abs().amax().item()  # the spike's amax is recorded
    y_next = f8(spike)  # the next iteration's scale has seen the spike
    assert sqnr(ref(spike), y_next.detach()) >= 25.0
    assert f8.scale_input.item() == pytest.approx(448.0 / spike.abs().amax().item(), rel=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_current_scaling_follows_a_spike(device):
    x, layer, _ = make(device, seed=3)
    f8 = fp8.Float8Linear.from_linear(copy.deepcopy(layer))
    assert sqnr(layer(x), f8(x)) >= 25.0
    assert sqnr(layer(x * 64.0), f8(x * 64.0)) >= 25.0


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_grad_output_history_and_state_dict_round_trip(device):
    x, layer, dy = make(device, seed=4)
    f8 = _delayed(layer, algo="most_recent")
    f8(x).backward(dy)
    assert f8.amax_history_grad_output[0].item() == dy.abs().amax().item()
    assert f8.amax_history_weight[0].item() == layer.weight.abs().amax().item()
    f8(x).backward(dy)  # the second forward updated the scales from the first iteration's amaxes
    assert f8.scale_grad_output.item() == pytest.approx(57344.0 / dy.abs().amax().item(), rel=1e-6)
    state = f8.state_dict()
    for name in ("amax_history_input", "amax_history_weight", "amax_history_grad_output", "scale_input",
                 "scale_weight", "scale_grad_output"):
        assert name in state
    other = _delayed(nn.Linear(96, 48).to(device), algo="most_recent")
    other.load_state_dict(state)
    for name, value in state.items():
        assert torch.equal(other.state_dict()[name], value)
    assert torch.equal(other.eval()(x), f8.eval()(x))


def test_convert_skips_unsupported_shapes_and_filtered_layers():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10), nn.Sequential(nn.Linear(64, 64)))
    params = list(model.parameters())
    out = fp8.convert(model, fp8.DelayedScaling(amax_history_len=4),
                      module_filter_fn=lambda module, fqn: fqn != "3.0")
    assert out is model
    assert isinstance(model[0], fp8.Float8Linear) and type(model[2]) is nn.Linear and type(model[3][0]) is nn.Linear
    skipped = fp8.skipped_layers(model)
    assert "multiples of 16" in skipped["2"] and skipped["3.0"] == "excluded by module_filter_fn"
    assert [p for p in model.parameters()] == params  # the same Parameter objects
    assert model[0].amax_history_input.shape == (4,)


def test_bad_recipes_and_shapes_raise():
    with pytest.raises(ValueError, match=r"^ampkit\.fp8: CurrentScaling granularity must be 'tensorwise' or "
                       "'rowwise', but got 'columnwise'"):
        fp8.Float8Linear(32, 32, recipe=fp8.CurrentScaling(granularity="columnwise"))
    with pytest.raises(ValueError, match="ampkit::fp8_linear: granularity must be 'tensorwise' or 'rowwise'"):
        torch.ops.ampkit.fp8_linear(torch.randn(4, 32), torch.randn(32, 32), None, granularity="blockwise")
    with pytest.raises(ValueError, match=r"^ampkit\.fp8: amax_compute_algo must be 'max' or 'most_recent'"):
        fp8.Float8Linear(32, 32, recipe=fp8.DelayedScaling(amax_compute_algo="mean"))
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.Float8Linear(30, 32)
    with pytest.raises(ValueError, match="ampkit::fp8_linear: input must have weight.size"):
        torch.ops.ampkit.fp8_linear(torch.randn(4, 16), torch.randn(32, 32), None)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_output_dtype_and_grads(device):
    x, layer, _ = make(device, seed=5)
    f8 = fp8.Float8Linear.from_linear(copy.deepcopy(layer))
    xg = x.clone().requires_grad_()
    with ampkit.autocast(device, dtype=torch.bfloat16):
        y = f8(xg)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert xg.grad.dtype == torch.float32 and f8.weight.grad.dtype == torch.float32
    assert sqnr(layer(x), y.float()) >= 25.0
    yb = f8(x.bfloat16())  # BF16 input outside autocast: BF16 output
    assert yb.dtype == torch.bfloat16


# torch's SchemaCheckMode (opcheck's test_schema) compares every tensor an inner op sees with a multiply, which
# torch has no CPU kernel for on FP8 tensors (_scaled_mm's operands); test_schema's point, which arguments an op
# mutates, is checked directly below instead.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_fp8_linear(device):
    x, layer, _ = make(device, n=32, k=32, m=16, seed=6)
    w, b = layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()
    xg = x.clone().requires_grad_()
    torch.library.opcheck(torch.ops.ampkit.fp8_linear.default, (xg, w, b), test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.ampkit.fp8_linear.default, (x, w.detach(), None, "e4m3", 1e-12, True),
                          test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.ampkit.fp8_linear.default, (xg, w, b), {"granularity": "rowwise"},
                          test_utils=OPCHECK_UTILS)
    hist = [torch.zeros(4, device=device) for _ in range(3)]
    scales = [torch.ones(1, device=device) for _ in range(3)]
    torch.library.opcheck(torch.ops.ampkit.fp8_linear_delayed.default, (x, w.detach(), b.detach(), hist, scales),
                          test_utils=("test_faketensor",))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_linear_mutates_only_what_its_schema_says(device):
    x, layer, dy = make(device, n=32, k=32, m=16, seed=8)
    w, b = layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()
    xg = x.clone().requires_grad_()
    before = [t.detach().clone() for t in (xg, w, b)]
    torch.ops.ampkit.fp8_linear(xg, w, b).backward(dy)
    assert all(torch.equal(t.detach(), c) for t, c in zip((xg, w, b), before))
    hist = [torch.zeros(4, device=device) for _ in range(3)]
    scales = [torch.full((1,), 2.0, device=device) for _ in range(3)]
    versions = [h._version for h in hist]
    torch.ops.ampkit.fp8_linear_delayed(xg, w, b, hist, scales).backward(dy)
    assert all(torch.equal(t.detach(), c) for t, c in zip((xg, w, b), before))
    assert all(s.item() == 2.0 for s in scales)  # scales are read only
    assert [h[0].item() for h in hist] == [x.abs().amax().item(), w.abs().amax().item(), dy.abs().amax().item()]
    assert all(h[1:].eq(0).all() for h in hist)
    assert all(h._version > v for h, v in zip(hist, versions))


def test_meta_shape():
    x = torch.empty(2, 5, 32, device="meta", dtype=torch.bfloat16)
    y = torch.ops.ampkit.fp8_linear(x, torch.empty(64, 32, device="meta"), None)
    assert y.shape == (2, 5, 64) and y.dtype == torch.bfloat16


def test_torch_compile_current_scaling_matches_eager():
    x, layer, dy = make("cpu", seed=7)
    eager = fp8.Float8Linear.from_linear(copy.deepcopy(layer))
    compiled_module = fp8.Float8Linear.from_linear(copy.deepcopy(layer))
    compiled = torch.compile(compiled_module, backend="aot_eager", fullgraph=True)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye, yc = eager(xe), compiled(xc)
    ye.backward(dy)
    yc.backward(dy)
    assert torch.equal(ye, yc)
    assert torch.equal(xe.grad, xc.grad) and torch.equal(eager.weight.grad, compiled_module.weight.grad)


def test_torch_compile_delayed_scaling_matches_eager():
    """The histories written in the forward and (grad_output) in the backward, and the scales updated at each
    forward, come out of the compiled module bit for bit as in eager mode, through a spike."""
    x, layer, dy = make("cpu", n=16, k=32, m=48, seed=9)
    eager = _delayed(layer, history_len=4)
    compiled_module = _delayed(layer, history_len=4)
    compiled = torch.compile(compiled_module, backend="aot_eager", fullgraph=True)
    for i in range(4):
        xi = x * (64.0 if i == 2 else 1.0)
        xe, xc = xi.clone().requires_grad_(), xi.clone().requires_grad_()
        ye, yc = eager(xe), compiled(xc)
        ye.backward(dy)
        yc.backward(dy)
        assert torch.equal(ye, yc) and torch.equal(xe.grad, xc.grad)
        assert torch.equal(eager.weight.grad, compiled_module.weight.grad)
        for name, buffer in eager.named_buffers():
            assert torch.equal(buffer, compiled_module.get_buffer(name)), (i, name)
