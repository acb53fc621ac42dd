"""ampkit.monitor: the records GradMonitor writes to TensorBoard (read back with TensorBoard's own reader) against
ampkit.grad_stats and the scaler; JSON lines and their conversion; the C++ GradStatsLog's lines through the same
converter."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import ampkit
import ampkit.monitor

# TensorBoard is a test requirement (requirements.txt); a host without it skips this module instead of failing
# collection of the whole suite.
EventAccumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator").EventAccumulator


def _model_with_scaled_grads(scale: float = 1024.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    scaler = ampkit.GradScaler("cpu", init_scale=scale)
    loss = model(torch.randn(8, 16)).square().mean()
    scaler.scale(loss).backward()
    return model, scaler, loss


def _read(logdir: str) -> EventAccumulator:
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_and_histograms_are_the_unscaled_grad_stats(tmp_path):
    model, scaler, _ = _model_with_scaled_grads()
    monitor = ampkit.monitor.GradMonitor(str(tmp_path), model.named_parameters(), every=5,
                                         jsonl=str(tmp_path / "log.jsonl"))
    assert monitor.log(3, scaler) is None  # not a multiple of every
    record = monitor.log(10, scaler)
    monitor.close()
    names = [n for n, _ in model.named_parameters()]
    assert [g["name"] for g in record["grads"]] == names
    inv = torch.full((1,), 1 / 1024.0)
    expect = torch.ops.ampkit.grad_stats([p.grad for p in model.parameters()], inv)
    acc = _read(str(tmp_path))
    for (name, p), row in zip(model.named_parameters(), expect):
        norm = acc.Scalars(f"grad_norm/{name}")
        assert [e.step for e in norm] == [10]
        assert norm[0].value == pytest.approx(row[1].item(), rel=1e-6)
        # the unscaled grads' norm: the scaled grads' norm / 1024
        assert norm[0].value == pytest.approx(p.grad.double().norm().item() / 1024.0, rel=1e-6)
        assert acc.Scalars(f"grad_max_abs/{name}")[0].value == pytest.approx(row[0].item(), rel=1e-6)
        hist = acc.Histograms(f"grad_log2/{name}")[0].histogram_value
        live = p.grad[p.grad != 0].double().abs() / 1024.0
        assert hist.num == live.numel()
        _, e = torch.frexp(live)
        assert hist.min == (e - 1).min().item() and hist.max == (e - 1).max().item()
        assert hist.sum == pytest.approx((e - 1).sum().item())
    assert acc.Scalars("amp/scale")[0].value == 1024.0
    assert acc.Scalars("amp/skipped_steps")[0].value == 0.0
    line = json.loads((tmp_path / "log.jsonl").read_text())
    assert line == json.loads(json.dumps(record))


def test_an_overflow_shows_as_a_skipped_step_and_non_finite_counts(tmp_path):
    model, scaler, _ = _model_with_scaled_grads()
    first = next(model.parameters())
    first.grad[0, 0] = math.inf
    opt = ampkit.optim.SGD(model.parameters(), lr=0.1)
    monitor = ampkit.monitor.GradMonitor(str(tmp_path), model.named_parameters(), every=1)
    record = monitor.log(1, scaler)
    scaler.step(opt)
    scaler.update()
    record2 = monitor.log(2, scaler, grads_scaled=False)
    monitor.close()
    assert record["grads"][0]["non_finite"] == 1 and record["grads"][1]["non_finite"] == 0
    assert record2["scaler"]["skipped_steps"] == 1 and record2["scaler"]["scale"] == 512.0
    acc = _read(str(tmp_path))
    assert [e.value for e in acc.Scalars("amp/skipped_steps")] == [0.0, 1.0]


def test_convert_reads_json_lines_and_names_a_bad_line(tmp_path):
    model, scaler, _ = _model_with_scaled_grads()
    monitor = ampkit.monitor.GradMonitor(str(tmp_path / "direct"), model.named_parameters(), every=1,
                                         jsonl=str(tmp_path / "log.jsonl"))
    for step in range(3):
        monitor.log(step, scaler)
    monitor.close()
    out = subprocess.run([sys.executable, "-m", "ampkit.monitor", str(tmp_path / "log.jsonl"),
                          str(tmp_path / "converted")], capture_output=True, text=True, check=True)
    assert "3 records" in out.stdout
    a, b = _read(str(tmp_path / "direct")), _read(str(tmp_path / "converted"))
    assert sorted(a.Tags()["scalars"]) == sorted(b.Tags()["scalars"])
    for tag in a.Tags()["scalars"]:
        assert [e.value for e in a.Scalars(tag)] == [e.value for e in b.Scalars(tag)]
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "grads": []}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not JSON"):
        ampkit.monitor.convert(str(tmp_path / "bad.jsonl"), str(tmp_path / "x"))


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="every must be an int >= 1, but got 0"):
        ampkit.monitor.GradMonitor(str(tmp_path), [], every=0)
    with pytest.raises(TypeError, match=r"named_parameters must give \(str, Tensor\) pairs"):
        ampkit.monitor.GradMonitor(str(tmp_path), [torch.ones(1)])


def test_the_cxx_log_writes_the_records_the_python_monitor_writes(tmp_path):
    model, scaler, _ = _model_with_scaled_grads()
    next(model.parameters()).grad[1, 2] = math.nan
    named = list(model.named_parameters())
    cxx = ampkit._C.GradStatsLog(str(tmp_path / "cxx.jsonl"), 4)
    assert cxx.log(3, named, scaler._core) is False
    assert cxx.log(8, named, scaler._core) is True
    assert cxx.log(12, named, None, False) is True
    del cxx
    py = ampkit.monitor.GradMonitor(str(tmp_path / "py"), named, every=4)
    expect = [py.log(8, scaler), py.log(12, None, grads_scaled=False)]
    py.close()
    lines = [json.loads(line) for line in (tmp_path / "cxx.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for got, want in zip(lines, expect):
        assert got.keys() == want.keys() and got["step"] == want["step"]
        assert got.get("scaler") == want.get("scaler")
        assert len(got["grads"]) == len(want["grads"])
        for g, w in zip(got["grads"], want["grads"]):
            assert g.keys() == w.keys()
            for key in g:  # floats printed with 17 digits: the same doubles
                assert g[key] == w[key], (g["name"], key)
    assert lines[0]["grads"][0]["non_finite"] == 1
    assert ampkit.monitor.convert(str(tmp_path / "cxx.jsonl"), str(tmp_path / "tb")) == 2
    assert "grad_log2/0.weight" in _read(str(tmp_path / "tb")).Tags()["histograms"]
    with pytest.raises(ValueError, match="every must be >= 1, but got 0"):
        ampkit._C.GradStatsLog(str(tmp_path / "x.jsonl"), 0)


def test_grads_a_compressed_all_reduce_already_unscaled_are_not_unscaled_again(tmp_path):
    model, scaler, _ = _model_with_scaled_grads()
    grads = [p.grad for p in model.parameters()]
    found = torch.zeros(1)
    ampkit.unscale_and_check_(grads, found, scaler.unscale_factor("cpu"))  # what ampkit's DDP hook does
    scaler.record_unscaled_grads(found)
    record = ampkit.monitor.GradMonitor(str(tmp_path), model.named_parameters(), every=1).log(0, scaler)
    for g, p in zip(record["grads"], model.parameters()):
        assert g["norm"] == pytest.approx(p.grad.double().norm().item(), rel=1e-12)


class _Recorder:
    def __init__(self):
        self.histograms = {}

    def add_scalar(self, *args, **kwargs):
        pass

    def add_histogram_raw(self, tag, **kw):
        self.histograms[tag] = kw


def test_histogram_bins_sit_at_their_exponents_with_out_of_range_counts_at_the_ends():
    w = _Recorder()
    base = dict(name="p", max_abs=1.0, norm=1.0, non_finite=0, zeros=0)
    ampkit.monitor.write_records(w, dict(step=1, grads=[
        dict(base, name="a", below=2, above=3, first_exp=-20, counts=[5, 0, 7]),
        dict(base, name="b", below=0, above=4, first_exp=-133, counts=[]),
        dict(base, name="c", below=0, above=0, first_exp=-3, counts=[1, 2])]))
    a = w.histograms["grad_log2/a"]
    limits, counts = a["bucket_limits"], a["bucket_counts"]
    assert limits[0] == -133.0 and counts[0] == 2  # exponents below -133, drawn at -134
    assert limits[-1] == 129.0 and counts[-1] == 3  # above 127, drawn at 128
    assert counts[limits.index(-19.0)] == 5 and counts[limits.index(-17.0)] == 7 and sum(counts) == 17
    assert a["min"] == -134.0 and a["max"] == 128.0 and a["num"] == 17
    b = w.histograms["grad_log2/b"]
    assert b["bucket_limits"][-1] == 129.0 and b["bucket_counts"][-1] == 4 and sum(b["bucket_counts"]) == 4
    c = w.histograms["grad_log2/c"]
    assert c["bucket_limits"] == [-2.0, -1.0] and c["bucket_counts"] == [1, 2] and c["sum"] == -3 + 2 * -2
