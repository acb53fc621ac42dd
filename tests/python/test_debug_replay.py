"""ampkit.debug.replay: planted precision problems (an FP16-overflowing Linear, a softmax whose probabilities
underflow into log, a softmax on huge logits, gradients that overflow at the scaler's scale) rank first and the
suggested override fixes them when applied; a healthy model reports no Inf/NaN and errors within a few eps; a small
GPT-2 runs through it under BF16 autocast and after decorate(level="O2"); the report is JSON; the replay leaves the
model, its grads, the optimizer, the scaler, the RNG, autocast and the hooks bit for bit as they were; bad input
raises naming the argument and changes nothing."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ampkit
from conftest import CUDA_ONLY, DEVICES, bits_equal

F = nn.functional


def mse(out, target):
    return F.mse_loss(out.float(), target.float())


def nll(out, target):
    return F.nll_loss(out.float(), target)


class PlantedMLP(nn.Module):
    """fc1 -> relu -> big (weights x 1e5: its FP16 output overflows) -> relu -> fc3."""

    def __init__(self, boost: float = 1e5) -> None:
        super().__init__()
        self.fc1, self.act, self.big, self.fc3 = nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4)
        with torch.no_grad():
            self.big.weight.mul_(boost)

    def forward(self, x):
        return self.fc3(torch.relu(self.big(self.act(self.fc1(x)))))


class NaiveLogSoftmax(nn.Module):
    """log(softmax(x * temperature)): with a wide spread of logits the small probabilities underflow to 0 in FP16
    and log turns them into -inf."""

    def forward(self, x):
        return torch.log(torch.softmax(x * 20.0, dim=-1))


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.logprob = nn.Linear(16, 32), NaiveLogSoftmax()

    def forward(self, x):
        return self.logprob(self.proj(x))


class ShiftedSoftmax(nn.Module):
    """softmax(x + 1000): mathematically shift-free, but in FP16/BF16 the sum is rounded to steps of 0.5-4, which
    the softmax turns into O(1) relative error."""

    def forward(self, x):
        return torch.softmax(x + 1000.0, dim=-1)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.attn, self.out = nn.Linear(16, 8), ShiftedSoftmax(), nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.attn(self.proj(x)))


def healthy(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4)).to(device)


def data(device, classes=None, n=8):
    torch.manual_seed(1)
    x = torch.randn(n, 16, device=device)
    y = torch.randint(0, classes, (n,), device=device) if classes else torch.randn(n, 4, device=device)
    return x, y


def dtype_for(device):
    return torch.float16 if device == "cuda" else torch.bfloat16


# ---- planted problems rank first ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_planted_overflowing_linear_ranks_first_under_autocast(device):
    torch.manual_seed(0)
    model = PlantedMLP().to(device)
    batch = data(device)
    report = ampkit.debug.replay(model, batch, mse, dtype=torch.float16)
    assert report.mode == "autocast" and report.dtype == "float16"
    top = report.top
    assert top["module"] == "big" and top["introduces"] == "forward", str(report)
    assert top["out_overflow"] > 0 and top["max_abs"] > torch.finfo(torch.float16).max
    assert top["op"] == "linear"
    assert "big" in report.suggestion and "fp32_ops=['linear']" in report.suggestion
    # the modules before it are finite and accurate; the ones after it only carry its Inf/NaN
    rows = {r["module"]: r for r in report.rows}
    assert rows["fc1"]["out_overflow"] == 0 and rows["fc1"]["out_rel_err"] < 16 * torch.finfo(torch.float16).eps
    assert rows["fc3"]["introduces"] is None and rows["fc3"]["out_overflow"] > 0
    # the suggestion applied: no module overflows any more
    fixed = ampkit.debug.replay(model, batch, mse, dtype=torch.float16, fp32_ops=["linear"])
    assert all(r["out_overflow"] == 0 for r in fixed.rows), str(fixed)
    assert fixed.top["introduces"] is None


@pytest.mark.parametrize("device", DEVICES)
def test_planted_overflowing_linear_ranks_first_after_o2(device):
    torch.manual_seed(0)
    model = ampkit.decorate(PlantedMLP().to(device), level="O2", dtype=torch.float16)
    report = ampkit.debug.replay(model, data(device), mse)
    assert report.mode == "decorated" and report.dtype == "float16"
    assert report.top["module"] == "big" and report.top["introduces"] == "forward", str(report)
    assert "excluded=['big']" in report.suggestion
    # its output is beyond FP16's range, so excluding it alone cannot be enough, and the suggestion says so
    assert "beyond float16's max" in report.suggestion


def test_planted_linear_with_a_healthy_boost_is_not_flagged():
    """The same model with weights x10: nothing overflows, so the planted module is not reported as one."""
    model = PlantedMLP(boost=10.0)
    report = ampkit.debug.replay(model, data("cpu"), mse, dtype=torch.float16)
    assert all(r["out_overflow"] == 0 and r["introduces"] is None for r in report.rows), str(report)


@pytest.mark.parametrize("dtype", [torch.float16])
def test_softmax_whose_probabilities_underflow_ranks_first(dtype):
    torch.manual_seed(0)
    model = Classifier()
    batch = data("cpu", classes=32)
    report = ampkit.debug.replay(model, batch, nll, dtype=dtype)
    top = report.top
    assert top["module"] == "logprob" and top["introduces"] == "forward", str(report)
    assert top["op"] == "softmax" and top["out_overflow"] > 0
    softmax = next(o for o in report.ops if o["op"] == "softmax")
    assert softmax["underflow"] > 0 and softmax["local_underflow"] > 0 and softmax["introduces_nonfinite"]
    log = next(o for o in report.ops if o["op"] == "log")
    assert not log["introduces_nonfinite"]   # log only turned the softmax's zeros into -inf
    assert "fp32_ops=['softmax']" in report.suggestion and not report.loss["low"] < float("inf")
    fixed = ampkit.debug.replay(model, batch, nll, dtype=dtype, fp32_ops=["softmax"])
    assert all(r["out_overflow"] == 0 for r in fixed.rows) and fixed.loss["rel_err"] < 1e-2, str(fixed)


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_underflow_after_o2_names_the_module_to_exclude(device):
    def build(excluded=()):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), NaiveLogSoftmax()).to(device)
        return ampkit.decorate(model, level="O2", dtype=torch.float16, excluded=excluded)

    batch = data(device, classes=32)
    report = ampkit.debug.replay(build(), batch, nll)
    assert report.top["module"] == "1" and report.top["introduces"] == "forward", str(report)
    assert "excluded=['1']" in report.suggestion
    fixed = ampkit.debug.replay(build(excluded=["1"]), batch, nll)
    assert all(r["out_overflow"] == 0 for r in fixed.rows), str(fixed)


@CUDA_ONLY
def test_cuda_autocast_runs_softmax_in_fp32_so_nothing_underflows():
    """CUDA autocast has softmax on its FP32 list (the CPU's has not): the same model is clean there."""
    torch.manual_seed(0)
    model = Classifier().cuda()
    report = ampkit.debug.replay(model, data("cuda", classes=32), nll, dtype=torch.float16)
    softmax = next(o for o in report.ops if o["op"] == "softmax")
    assert softmax["dtype"] == "float32" and softmax["underflow"] == 0
    assert all(r["out_overflow"] == 0 for r in report.rows), str(report)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_softmax_on_huge_logits_ranks_first(dtype):
    torch.manual_seed(0)
    model = Head()
    batch = data("cpu")
    report = ampkit.debug.replay(model, batch, mse, dtype=dtype)
    eps = torch.finfo(dtype).eps
    top = report.top
    assert top["module"] == "attn" and top["op"] == "softmax", str(report)
    assert top["introduced_err"] > 10 * eps and top["out_rel_err"] > 10 * eps
    assert not report.suggestion.startswith("healthy") and "attn" in report.suggestion
    # softmax's own rounding is small: it amplifies the rounding of the add that computed its input, so the fix
    # forces both to FP32; applied, the module is accurate again
    softmax = next(o for o in report.ops if o["op"] == "softmax")
    assert softmax["local_rel_err"] < 4 * eps and softmax["inputs_from"] == ["add"]
    assert top["fix_ops"] == ["add", "softmax"] and "fp32_ops=['add', 'softmax']" in report.suggestion
    fixed = ampkit.debug.replay(model, batch, mse, dtype=dtype, fp32_ops=top["fix_ops"])
    attn = next(r for r in fixed.rows if r["module"] == "attn")
    assert attn["out_rel_err"] < top["out_rel_err"] / 10 and attn["introduced_err"] < 8 * eps, str(fixed)


def test_gradient_overflow_at_the_scalers_scale():
    """A healthy forward whose scaled backward overflows FP16 at 2^24 and not at 1: judged at the scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    x, _ = data("cpu")
    y = torch.randn(8, 4) * 100
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**24)
    report = ampkit.debug.replay(model, (x, y), mse, dtype=torch.float16, scaler=scaler)
    assert report.scale == 2.0**24
    assert all(r["out_overflow"] == 0 for r in report.rows)
    # the first gradient, that of the scaled loss w.r.t. the output of the last Linear, already overflows
    top = report.top
    assert top["module"] == "4" and top["introduces"] == "backward" and top["from_loss"], str(report)
    assert top["grad_overflow"] > 0 and 1 < top["grad_max_abs"] * 2.0**-24 < 65504  # unscaled, it fits FP16
    assert "lower the loss scale" in report.suggestion
    unscaled = ampkit.debug.replay(model, (x, y), mse, dtype=torch.float16)
    assert unscaled.scale == 1.0 and all(r["grad_overflow"] == 0 for r in unscaled.rows), str(unscaled)


class WideMiddle(nn.Module):
    """A middle Linear with large weights: its output (~40) makes the last Linear's weight gradient overflow FP16
    at a scale of 1024."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.mid, self.fc3 = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)
        with torch.no_grad():
            self.fc1.weight.mul_(1e-2)
            self.mid.weight.mul_(300)

    def forward(self, x):
        return self.fc3(torch.relu(self.mid(torch.relu(self.fc1(x)))))


def test_parameter_gradient_overflow_names_the_module_whose_backward_overflows():
    torch.manual_seed(0)
    model = WideMiddle()
    batch = data("cpu")
    report = ampkit.debug.replay(model, batch, mse, dtype=torch.float16, scaler=ampkit.GradScaler("cpu", 1024.0))
    top = report.top
    assert top["module"] == "fc3" and top["introduces"] == "backward" and not top["from_loss"], str(report)
    assert top["grad_overflow"] > 0 and top["grad_rel_err"] < 16 * torch.finfo(torch.float16).eps
    assert "fc3" in report.suggestion and "lower the loss scale" in report.suggestion
    assert all(r["grad_overflow"] == 0 for r in ampkit.debug.replay(model, batch, mse, dtype=torch.float16).rows)
    # torch's own scaler is read the same way, and left as it was
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state = torch_scaler.state_dict()
    again = ampkit.debug.replay(model, batch, mse, dtype=torch.float16, scaler=torch_scaler)
    assert again.scale == 1024.0 and again.top["module"] == "fc3" and torch_scaler.state_dict() == state


def test_gradient_underflow_is_judged_at_the_scale():
    """Tiny gradients (loss x 1e-7) underflow FP16 unscaled and fit once the scaler multiplies them by 2^16."""
    model = healthy("cpu")
    batch = data("cpu")

    def tiny(out, target):
        return mse(out, target) * 1e-7

    unscaled = ampkit.debug.replay(model, batch, tiny, dtype=torch.float16)
    assert unscaled.top["grad_underflow"] > 0 and unscaled.top["grad_underflow"] == max(
        r["grad_underflow"] for r in unscaled.rows), str(unscaled)
    assert "underflow to zero" in unscaled.suggestion and "raise the loss scale" in unscaled.suggestion
    scaled = ampkit.debug.replay(model, batch, tiny, dtype=torch.float16, scaler=ampkit.GradScaler("cpu"))
    assert scaled.scale == 2.0**16 and sum(r["grad_underflow"] for r in scaled.rows) == 0, str(scaled)
    assert scaled.suggestion.startswith("healthy")


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 4), nn.Linear(8, 4)

    def forward(self, x, z):
        return self.a(x) + self.b(z)


def test_tuple_inputs_are_unpacked_and_lists_are_not():
    torch.manual_seed(0)
    x, y = data("cpu")
    z = torch.randn(8, 8)
    report = ampkit.debug.replay(TwoInputs(), ((x, z), y), mse, dtype=torch.bfloat16)
    assert {r["module"] for r in report.rows} == {"", "a", "b"} and report.suggestion.startswith("healthy")
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        ampkit.debug.replay(TwoInputs(), ([x, z], y), mse, dtype=torch.bfloat16)


# ---- a healthy model ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_healthy_model_reports_no_overflow_and_small_errors(device, dtype):
    model = healthy(device)
    report = ampkit.debug.replay(model, data(device), mse, dtype=dtype)
    eps = torch.finfo(dtype).eps
    assert report.suggestion.startswith("healthy"), str(report)
    assert len(report.rows) == 5 and {r["module"] for r in report.rows} == {"", "0", "1", "2", "3"}
    for r in report.rows:
        assert r["out_overflow"] == r["grad_overflow"] == r["out_underflow"] == 0, r
        assert r["out_rel_err"] < 4 * eps and r["added_err"] < 2 * eps, r
        assert r["grad_rel_err"] < 4 * eps, r
        assert r["param_grad_rel_err"] is None or r["param_grad_rel_err"] < 4 * eps, r
    assert report.top["out_rel_err"] > 0   # the low-precision run did run in low precision
    assert abs(report.loss["low"] - report.loss["reference"]) < 8 * eps * abs(report.loss["reference"])
    text = str(report)
    assert text.splitlines()[1].split()[:3] == ["#", "module", "type"] and "suggestion: healthy" in text


def test_healthy_model_after_o2_keeps_its_norm_fp32():
    model = ampkit.decorate(healthy("cpu"), level="O2", dtype=torch.bfloat16)
    report = ampkit.debug.replay(model, data("cpu"), mse)
    assert report.mode == "decorated" and report.suggestion.startswith("healthy"), str(report)
    dtypes = {o["module"]: o["dtype"] for o in report.ops}
    assert dtypes["0"] == "bfloat16" and dtypes["1"] == "float32"   # decorate computes the LayerNorm in FP32


# ---- GPT-2 ----------------------------------------------------------------------------------------------------


def gpt2(device):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(device)
    ids = torch.randint(0, 128, (2, 16), device=device)
    return model, (ids, ids)


def lm_loss(out, labels):
    return F.cross_entropy(out.logits[:, :-1].float().reshape(-1, 128), labels[:, 1:].reshape(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_gpt2_under_bf16_autocast(device):
    model, batch = gpt2(device)
    report = ampkit.debug.replay(model, batch, lm_loss, dtype=torch.bfloat16)
    names = {r["module"] for r in report.rows}
    assert {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head", ""} <= names
    eps = torch.finfo(torch.bfloat16).eps
    assert all(r["out_overflow"] == 0 and r["grad_overflow"] == 0 for r in report.rows), str(report)
    assert abs(report.loss["low"] - report.loss["reference"]) < 16 * eps * report.loss["reference"]
    assert any(o["op"] == "linear" or o["op"] == "addmm" for o in report.ops if o["dtype"] == "bfloat16")
    json.dumps(report.as_dict(), allow_nan=False)


@pytest.mark.parametrize("device", DEVICES)
def test_gpt2_after_o2(device):
    model, batch = gpt2(device)
    model = ampkit.decorate(model, level="O2", dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = ampkit.debug.replay(model, batch, lm_loss)
    after = model.state_dict()
    assert all(bits_equal(v, after[k]) for k, v in before.items()) and model.training
    assert all(p.grad is None for p in model.parameters())
    assert report.mode == "decorated" and report.dtype == "bfloat16"
    rows = {r["module"]: r for r in report.rows}
    assert rows["transformer.h.0.ln_1"]["calls"] == 1 and rows["transformer.h.1.mlp.c_proj"]["grad_rel_err"] > 0
    ln_ops = {o["dtype"] for o in report.ops if o["module"].endswith("ln_1")}
    assert ln_ops == {"float32"}   # decorate keeps the norms FP32
    assert all(r["out_overflow"] == 0 for r in report.rows) and report.loss["rel_err"] < 0.05, str(report)


# ---- the report -----------------------------------------------------------------------------------------------


def test_report_as_dict_is_json_with_infs_as_strings():
    report = ampkit.debug.replay(PlantedMLP(), data("cpu"), mse, dtype=torch.float16)
    d = json.loads(json.dumps(report.as_dict(), allow_nan=False))
    assert d["rows"][0]["module"] == "big" and d["rows"][0]["out_rel_err"] == "inf"
    assert d["settings"] == {"dtype": "float16", "scale": 1.0, "mode": "autocast", "device_type": "cpu",
                             "fp32_ops": []}
    assert d["suggestion"] == report.suggestion and len(d["ops"]) == len(report.ops)
    assert report.rows[0] is report.top and "big" in repr(report)
    lines = str(report).splitlines()
    assert lines[2].split()[1] == "big" and lines[-1].startswith("suggestion: big")


# ---- nothing changes ------------------------------------------------------------------------------------------


class WithState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn = nn.Linear(16, 32), nn.BatchNorm1d(32)
        self.drop, self.fc2 = nn.Dropout(0.3), nn.Linear(32, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        x = x + 1e-4 * torch.randn_like(x)   # draws from the RNG, which replay must put back
        return self.frozen(self.fc2(self.drop(torch.relu(self.bn(self.fc1(x))))))


def snapshot(model, optimizer, scaler):
    def hooks(m):
        return [len(getattr(m, a)) for a in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                               "_backward_pre_hooks", "_state_dict_hooks")]
    return dict(
        state={k: v.clone() for k, v in model.state_dict().items()},
        grads={n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        ids={n: (id(p), id(p.grad)) for n, p in model.named_parameters()},
        optimizer=optimizer.state_dict(), scaler=scaler.state_dict(), stats=scaler.stats(),
        scale=scaler.get_scale(), rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        training=[m.training for m in model.modules()], hooks=[hooks(m) for m in model.modules()],
        autocast=(torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")), grad=torch.is_grad_enabled())


def assert_same(a, b):
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert bits_equal(a["state"][k], b["state"][k]), k
    for k in a["grads"]:
        assert (a["grads"][k] is None) == (b["grads"][k] is None), k
        if a["grads"][k] is not None:
            assert bits_equal(a["grads"][k], b["grads"][k]), k
    assert a["ids"] == b["ids"]
    for k in ("scaler", "stats", "scale", "training", "hooks", "autocast", "grad"):
        assert a[k] == b[k], k
    assert torch.equal(a["rng"], b["rng"])
    if a["cuda_rng"] is not None:
        assert all(torch.equal(x, y) for x, y in zip(a["cuda_rng"], b["cuda_rng"]))
    oa, ob = a["optimizer"], b["optimizer"]
    assert oa["param_groups"] == ob["param_groups"] and oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            assert bits_equal(v, ob["state"][i][k]) if isinstance(v, torch.Tensor) else v == ob["state"][i][k]


def trained(device, o2=False):
    torch.manual_seed(0)
    model = WithState().to(device)
    optimizer = ampkit.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if o2:
        model, optimizer = ampkit.decorate(model, optimizer, level="O2", dtype=torch.float16)
    scaler = ampkit.GradScaler(device, init_scale=2.0**10)
    x, y = data(device)
    for step in range(2):   # a real step, then one that leaves grads in place
        with ampkit.autocast(device, dtype=torch.float16, enabled=not o2):
            loss = mse(model(x.half() if o2 else x), y)
        scaler.scale(loss).backward()
        if step == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    model.fc1.bias.grad = None   # one parameter without a grad
    return model, optimizer, scaler, (x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("o2", [False, True])
def test_replay_leaves_everything_bitwise_unchanged(device, o2):
    model, optimizer, scaler, batch = trained(device, o2)
    model.train()
    torch.manual_seed(123)
    before = snapshot(model, optimizer, scaler)
    report = ampkit.debug.replay(model, batch, mse, dtype=torch.float16, scaler=scaler)
    assert report.scale == 2.0**10 and len(report.rows) == 6
    # the replay ran in training mode (BatchNorm on batch statistics, which it put back) with dropout off
    assert report.loss["rel_err"] < 0.01, str(report)
    assert_same(before, snapshot(model, optimizer, scaler))
    # and the RNG continues exactly where it was
    assert torch.equal(torch.rand(4), (torch.manual_seed(123), torch.rand(4))[1])


def test_replay_inside_an_autocast_region_or_no_grad_restores_it():
    model, optimizer, scaler, batch = trained("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = snapshot(model, optimizer, scaler)
        ampkit.debug.replay(model, batch, mse, dtype=torch.float16)
        assert_same(before, snapshot(model, optimizer, scaler))
    with torch.no_grad():
        before = snapshot(model, optimizer, scaler)
        report = ampkit.debug.replay(model, batch, mse, dtype=torch.float16)
        assert report.top["grad_rel_err"] is not None   # the gradients were computed all the same
        assert_same(before, snapshot(model, optimizer, scaler))


# ---- bad input ------------------------------------------------------------------------------------------------


BAD = [
    (dict(model=lambda x: x), TypeError, r"ampkit\.debug\.replay: model must be a torch\.nn\.Module, but got function"),
    (dict(batch=torch.zeros(3)), TypeError, r"batch must be an \(inputs, targets\) pair, but got Tensor"),
    (dict(batch=(1, 2, 3)), TypeError, r"batch must be an \(inputs, targets\) pair, but got a tuple of length 3"),
    (dict(loss_fn="mse"), TypeError, r"loss_fn must be callable as loss_fn\(output, targets\), but got str"),
    (dict(dtype=torch.float32), ValueError, r"dtype must be torch\.float16, torch\.bfloat16 or None, but got "
                                            r"torch\.float32"),
    (dict(dtype="fp16"), ValueError, r"dtype must be torch\.float16, torch\.bfloat16 or None, but got 'fp16'"),
    (dict(device_type="tpu"), ValueError, r"device_type must be 'cpu' or 'cuda', but got 'tpu'"),
    (dict(scaler=2.0**16), TypeError, r"scaler must be an ampkit\.GradScaler, a torch\.amp\.GradScaler or None, "
                                      r"but got float"),
    (dict(fp32_ops=iter([1])), TypeError, r"fp32_ops must be a list of op names such as \['softmax'\], but got "
                                           r"<list_iterator"),
    (dict(fp32_ops="softmax"), TypeError, r"fp32_ops must be a list of op names such as \['softmax'\], but got "
                                          r"'softmax'"),
    (dict(loss_fn=lambda out, y: out), ValueError, r"loss_fn must return a one-element floating tensor \(the "
                                                   r"loss\), but got a \(8, 4\)"),
]


@pytest.mark.parametrize("bad,error,message", BAD, ids=[next(iter(b)) + str(i) for i, (b, _, _) in enumerate(BAD)])
def test_bad_input_raises_and_changes_nothing(bad, error, message):
    model, optimizer, scaler, batch = trained("cpu")
    before = snapshot(model, optimizer, scaler)
    args = dict(model=model, batch=batch, loss_fn=mse, dtype=torch.float16, scaler=scaler)
    args.update(bad)
    with pytest.raises(error, match=message):
        ampkit.debug.replay(args.pop("model"), args.pop("batch"), args.pop("loss_fn"), **args)
    assert_same(before, snapshot(model, optimizer, scaler))


def test_decorated_model_refuses_another_dtype_and_fp32_ops():
    model, optimizer, scaler, batch = trained("cpu", o2=True)
    before = snapshot(model, optimizer, scaler)
    with pytest.raises(ValueError, match=r"ampkit\.debug\.replay: dtype must match the model's low-precision "
                                         r"weights \(torch\.float16\), but got torch\.bfloat16"):
        ampkit.debug.replay(model, batch, mse, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"ampkit\.debug\.replay: fp32_ops applies to autocast runs, but this "
                                         r"model is decorated \(torch\.float16 weights\)"):
        ampkit.debug.replay(model, batch, mse, fp32_ops=["softmax"])
    assert_same(before, snapshot(model, optimizer, scaler))
