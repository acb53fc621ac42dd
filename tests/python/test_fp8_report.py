"""ampkit.fp8's quantization report: fp8_quantization_stats against counts re-derived in Python, and the report of a
model naming the layer and operand that saturated, flushed or met a NaN."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampkit import fp8
from conftest import DEVICES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Beyond max + half an ulp a value is clamped (464 in E4M3, 61440 in E5M2); at most half the smallest subnormal it
# rounds to zero.
CLAMP = {E4M3: 464.0, E5M2: 61440.0}
FLUSH = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}


def reference_counts(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> list:
    v = x.float() * scale
    a = v.abs()
    return [int((a > CLAMP[dtype]).sum()), int(((a <= FLUSH[dtype]) & (x != 0)).sum()), int(v.isnan().sum())]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stats_match_reference_counts(device, dtype, xdtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 48, generator=g) * torch.logspace(-8, 4, 48)).to(xdtype)
    x[0, 0], x[1, 1], x[2, 2], x[3, 3], x[-1, -1] = math.inf, -math.inf, math.nan, 0.0, math.nan
    x = x.to(device)
    for scale in (torch.tensor([0.75], device=device), torch.rand(64, 1, generator=g).to(device) * 4):
        got = torch.ops.ampkit.fp8_quantization_stats(x, scale, dtype)
        assert got.dtype == torch.int64 and got.shape == (3,)
        want = reference_counts(x, scale, dtype)
        assert got.tolist() == want
        assert want[0] >= 2 and want[1] > 0 and want[2] == 2  # every kind occurs
    # Exactly at the thresholds: 464 is rounded (to 448), not clamped; half the smallest subnormal rounds to zero.
    edge = torch.tensor([CLAMP[dtype], CLAMP[dtype] * (1 + 2 ** -20), FLUSH[dtype], FLUSH[dtype] * 1.001, 0.0],
                        device=device)
    assert torch.ops.ampkit.fp8_quantization_stats(edge, torch.ones(1, device=device), dtype).tolist() == [1, 1, 0]


def test_stats_bad_input_and_meta():
    with pytest.raises(ValueError, match=r"ampkit::fp8_quantization_stats: scale must have one element or x's shape"):
        torch.ops.ampkit.fp8_quantization_stats(torch.ones(4, 8), torch.ones(8, 1), E4M3)
    with pytest.raises(TypeError, match=r"ampkit::fp8_quantization_stats: dtype must be torch.float8_e4m3fn"):
        torch.ops.ampkit.fp8_quantization_stats(torch.ones(4), torch.ones(1), torch.float16)
    out = torch.ops.ampkit.fp8_quantization_stats(torch.empty(4, 8, device="meta"), torch.empty(1, device="meta"),
                                                  E4M3)
    assert out.shape == (3,) and out.dtype == torch.int64 and out.device.type == "meta"
    empty = torch.ops.ampkit.fp8_quantization_stats(torch.empty(0, 8), torch.ones(1), E4M3)
    assert empty.tolist() == [0, 0, 0]


def _model(recipe):
    torch.manual_seed(0)
    return fp8.convert(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)), recipe)


def test_delayed_spike_saturates_and_the_report_names_the_layer():
    model = _model(fp8.DelayedScaling(amax_history_len=4))
    x = torch.randn(8, 32)
    model(x).sum().backward()  # the histories learn x's amax
    spike = x.clone()
    spike[0] *= 100.0
    with fp8.quantization_report(model) as report:
        model(spike).sum().backward()
    rows = {(r["layer"], r["operand"]): r for r in report.rows()}
    assert set(rows) == {(layer, o) for layer in ("0", "2") for o in ("input", "weight", "grad_output")}
    r = rows[("0", "input")]
    assert r["numel"] == spike.numel()
    assert [r["saturated"], r["flushed"], r["nan"]] == reference_counts(spike, model[0].scale_input, E4M3)
    assert r["saturated"] > 0 and r["saturated_fraction"] == r["saturated"] / r["numel"]
    assert report.worst(1)[0]["layer"] == "0" and report.worst(1)[0]["operand"] == "input"
    w = rows[("0", "weight")]
    assert [w["saturated"], w["flushed"], w["nan"]] == reference_counts(model[0].weight, model[0].scale_weight, E4M3)
    assert "saturated" in str(report) and "grad_output" in str(report)
    # Closed: nothing more is counted.
    model(spike).sum().backward()
    assert report.rows()[0]["numel"] == spike.numel()
    assert all(m._fp8_stats is None for m in model.modules() if isinstance(m, fp8.Float8Linear))


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_current_scaling_flushes_small_rows_beside_an_outlier_row(granularity):
    model = _model(fp8.CurrentScaling(granularity=granularity))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g) * 1e-3
    x[5] = 1e4  # an outlier token
    with fp8.quantization_report(model) as report:
        model(x)
    r = next(r for r in report.rows() if r["layer"] == "0" and r["operand"] == "input")
    amax = x.abs().amax(1, keepdim=True) if granularity == "rowwise" else x.abs().amax()
    assert [r["saturated"], r["flushed"], r["nan"]] == reference_counts(x, 448.0 / amax, E4M3)
    assert r["saturated"] == 0
    if granularity == "tensorwise":
        assert r["flushed_fraction"] > 0.3  # the small rows vanish
    else:
        assert r["flushed"] == 0


def test_nan_in_one_layers_gradient_is_reported_there():
    model = _model(fp8.CurrentScaling())
    x = torch.randn(8, 32)
    with fp8.quantization_report(model) as report:
        w = torch.ones(8, 16)
        w.view(-1)[7] = math.nan  # the loss's gradient: one NaN in the last layer's grad_output
        (model(x) * w).sum().backward()
    worst = report.worst(1)[0]
    assert (worst["layer"], worst["operand"], worst["nan"]) == ("2", "grad_output", 1)  # where the NaN came from
    spread = next(r for r in report.rows() if r["layer"] == "0" and r["operand"] == "grad_output")
    assert spread["nan"] > 1 and spread["first_nan"] > worst["first_nan"]  # where it spread to
    assert all(r["first_nan"] is None for r in report.rows() if r["operand"] != "grad_output")


def test_nan_origin_is_kept_across_iterations():
    """A layer whose operands were clean in the first iteration and met the NaN second still ranks after the
    layer the NaN came from."""
    model = _model(fp8.CurrentScaling())
    with fp8.quantization_report(model) as report:
        model(torch.randn(8, 32)).sum().backward()
        w = torch.ones(8, 16)
        w.view(-1)[3] = math.nan
        (model(torch.randn(8, 32)) * w).sum().backward()
    assert [(r["layer"], r["operand"]) for r in report.worst(2)] == [("2", "grad_output"), ("0", "grad_output")]


def test_report_closes_on_error():
    model = _model(fp8.CurrentScaling())
    with pytest.raises(RuntimeError, match="boom"):
        with fp8.quantization_report(model):
            raise RuntimeError("boom")
    assert all(m._fp8_stats is None for m in model.modules() if isinstance(m, fp8.Float8Linear))
