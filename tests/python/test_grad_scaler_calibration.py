"""GradScaler(init_scale="auto"): the calibrated first scale (NOTE [Calibrated first scale]) against a float64
reference of its formula on gradients of known amax, on the generic (torch.optim) and the fused (ampkit.optim)
path, with its exceptions (an overflowing first iteration, all-zero grads, NaN, bounds), its checkpoints and its
argument checks."""
from __future__ import annotations

import math
import pickle

import pytest
import torch

import ampkit
from conftest import CUDA_ONLY, DEVICES

FP16_MAX = 65504.0


def expected_scale(amax: float, margin: float, lo: float = 0.0, hi: float = 2.0**32) -> float:
    """The formula in float64: 2^floor(log2(65504 / (amax * 2^margin))) clamped to [lo, hi] (hi: max_scale, 2^32
    without one)."""
    return min(max(2.0 ** math.floor(math.log2(FP16_MAX / (amax * 2.0**margin))), lo), hi)


def model_with_grads(device: str, amax: float, seed: int, dtype=torch.float32) -> torch.nn.Module:
    """A model whose loss gives each weight a gradient of known size; the largest |gradient| is `amax`."""
    torch.manual_seed(seed)
    return torch.nn.Linear(7, 3, bias=False).to(device=device, dtype=dtype)


def first_iteration(scaler, model, opt, amax: float, seed: int):
    """One iteration whose grads are random with their largest |value| exactly `amax` (times the scale)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(model.weight.shape, generator=g, dtype=torch.float64)
    target = target / target.abs().max() * amax
    target = target.to(model.weight.dtype).to(model.weight.device)
    opt.zero_grad(set_to_none=True)
    # d/dw sum(w * target) = target: the backward of the scaled loss leaves scale * target in .grad.
    scaler.scale((model.weight * target).sum()).backward()
    scaler.step(opt)
    scaler.update()
    return target


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["torch_sgd", "ampkit_adamw", "torch_adam_unscaled_first"])
@pytest.mark.parametrize("margin", [0.0, 2.0, 4.0, 7.5])
def test_the_first_update_sets_the_formulas_scale(device, optimizer, margin):
    for seed, amax in enumerate([3.1e-7, 0.0123, 1.0, 47.0, 6.0e3]):
        model = model_with_grads(device, amax, seed)
        if optimizer == "ampkit_adamw":
            opt = ampkit.optim.AdamW(model.parameters(), lr=1e-3)
        elif optimizer == "torch_sgd":
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        scaler = ampkit.GradScaler(device, init_scale="auto", calibration_margin=margin)
        assert scaler.get_scale() == 1.0  # the first iteration runs at scale 1
        before = model.weight.detach().clone()
        g = torch.Generator().manual_seed(seed)
        target = torch.randn(model.weight.shape, generator=g, dtype=torch.float64)
        target = (target / target.abs().max() * amax).float().to(device)
        opt.zero_grad(set_to_none=True)
        scaler.scale((model.weight * target).sum()).backward()
        if optimizer == "torch_adam_unscaled_first":
            scaler.unscale_(opt)  # the amax is taken before the grads are unscaled in place
        scaler.step(opt)
        scaler.update()
        want = expected_scale(float(target.abs().max().double()), margin)
        assert scaler.get_scale() == want, (amax, margin)
        assert scaler.stats()["growth_tracker"] == 0
        assert scaler.stats()["skipped_steps"] == 0
        assert not torch.equal(before, model.weight.detach())  # the calibrating step is applied
        # The second iteration runs at the calibrated scale, and its update is an ordinary one.
        opt.zero_grad(set_to_none=True)
        scaler.scale((model.weight * target).sum()).backward()
        assert torch.allclose(model.weight.grad, target * want)
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == want and scaler.stats()["growth_tracker"] == 1


def test_the_calibrating_step_equals_an_unscaled_step():
    torch.manual_seed(0)
    ref = torch.nn.Linear(5, 4)
    model = torch.nn.Linear(5, 4)
    model.load_state_dict(ref.state_dict())
    x, y = torch.randn(8, 5), torch.randn(8, 4)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    opt_ref.step()
    scaler = ampkit.GradScaler("cpu", init_scale="auto")
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert scaler.get_scale() > 1.0


def test_the_amax_is_the_largest_over_every_optimizer_stepped():
    torch.manual_seed(1)
    a, b = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), ampkit.optim.SGD(b.parameters(), lr=0.1)
    scaler = ampkit.GradScaler("cpu", init_scale="auto", calibration_margin=1.0)
    ta, tb = torch.full((4, 4), 0.25), torch.full((4, 4), 0.5)
    tb[3, 3] = -300.0
    scaler.scale((a.weight * ta).sum() + (b.weight * tb).sum()).backward()
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()
    assert scaler.get_scale() == expected_scale(300.0, 1.0) == 64.0


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_an_overflowing_first_iteration_backs_off_from_one_and_ends_the_calibration(bad):
    torch.manual_seed(2)
    model = torch.nn.Linear(3, 2)
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ampkit.GradScaler("cpu", init_scale="auto", growth_interval=1000)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(4, 3)).sum()).backward()
    model.bias.grad[-1] = bad  # the last element of the last gradient
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    assert scaler.get_scale() == 0.5 and scaler.stats()["skipped_steps"] == 1
    # The next clean iteration is an ordinary update: no calibration any more.
    opt.zero_grad()
    scaler.scale(model(torch.randn(4, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 0.5 and scaler.stats()["growth_tracker"] == 1


def test_all_zero_gradients_give_torchs_first_scale():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampkit.GradScaler("cpu", init_scale="auto")
    scaler.scale(model(torch.randn(2, 3)).sum() * 0.0).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 65536.0


def test_the_calibrated_scale_is_clamped_to_the_bounds():
    cases = [(1e-9, 0.0, 2.0**20, 2.0**20), (1e5, 0.5, math.inf, 0.5), (1.0, 0.0, 8.0, 8.0),
             (1e-30, 0.0, math.inf, 2.0**32), (1e-30, 0.0, 2.0**40, 2.0**40)]  # 2^32 unless max_scale says more
    for amax, lo, hi, want in cases:
        model = torch.nn.Linear(3, 2, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ampkit.GradScaler("cpu", init_scale="auto", min_scale=lo, max_scale=None if math.isinf(hi) else hi)
        first_iteration(scaler, model, opt, amax, seed=3)
        assert scaler.get_scale() == want == expected_scale(amax, 2.0, lo, 2.0**32 if math.isinf(hi) else hi)


def test_fp16_grads_of_an_fp16_model():
    model = torch.nn.Linear(6, 6, bias=False).half()
    opt = ampkit.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampkit.GradScaler("cpu", init_scale="auto", calibration_margin=0.0)
    target = first_iteration(scaler, model, opt, 12.5, seed=4)
    assert scaler.get_scale() == expected_scale(float(target.abs().max()), 0.0) == 4096.0


def test_a_checkpoint_before_the_first_update_keeps_the_calibration_pending():
    fresh = ampkit.GradScaler("cpu", init_scale="auto")
    state = fresh.state_dict()
    assert state["scale"] == 1.0 and state["steps"] == 0
    resumed = ampkit.GradScaler("cpu", init_scale="auto")
    resumed.load_state_dict(state)
    model = torch.nn.Linear(3, 2, bias=False)
    first_iteration(resumed, model, torch.optim.SGD(model.parameters(), lr=0.1), 2.0, seed=5)
    assert resumed.get_scale() == expected_scale(2.0, 2.0)
    # A later checkpoint, or torch's state (no step count), continues as an ordinary scaler.
    for later in (resumed.state_dict(), torch.amp.GradScaler("cpu", init_scale=8.0).state_dict()):
        other = ampkit.GradScaler("cpu", init_scale="auto")
        other.load_state_dict(later)
        scale = other.get_scale()
        model = torch.nn.Linear(3, 2, bias=False)
        first_iteration(other, model, torch.optim.SGD(model.parameters(), lr=0.1), 1e-6, seed=6)
        assert other.get_scale() == scale


def test_zero_size_and_refused_grads_are_not_measured():
    model = torch.nn.Linear(3, 2, bias=False)
    empty = torch.nn.Parameter(torch.zeros(0, 4))
    empty.grad = torch.zeros(0, 4)
    opt = torch.optim.SGD([model.weight, empty], lr=0.1)
    scaler = ampkit.GradScaler("cpu", init_scale="auto")
    # A refused call (an overlapping grad) counts nothing: its huge value must not reach the amax.
    scaler.scale(model(torch.randn(2, 3)).sum()).backward()
    good = model.weight.grad.clone()
    model.weight.grad = torch.full((2, 1), 1e4).expand(2, 3)
    with pytest.raises(RuntimeError, match="overlapping"):
        scaler.step(opt)
    model.weight.grad = good
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == expected_scale(float(good.abs().max()), 2.0)


def test_pickling_keeps_auto_and_the_margin():
    scaler = ampkit.GradScaler("cpu", init_scale="auto", calibration_margin=1.0)
    copy = pickle.loads(pickle.dumps(scaler))
    model = torch.nn.Linear(3, 2, bias=False)
    first_iteration(copy, model, torch.optim.SGD(model.parameters(), lr=0.1), 3.0, seed=7)
    assert copy.get_scale() == expected_scale(3.0, 1.0)


def test_update_with_a_new_scale_ends_the_calibration():
    model = torch.nn.Linear(3, 2, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampkit.GradScaler("cpu", init_scale="auto")
    scaler.scale(model(torch.randn(2, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update(256.0)
    assert scaler.get_scale() == 256.0
    first_iteration(scaler, model, opt, 1.0, seed=8)
    assert scaler.get_scale() == 256.0


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(init_scale="automatic"), TypeError, "init_scale must be a number or 'auto', but got 'automatic'"),
    (dict(init_scale="auto", calibration_margin=-1.0), ValueError, "calibration_margin must be a finite number >= 0"),
    (dict(init_scale="auto", calibration_margin=math.nan), ValueError, "calibration_margin must be a finite"),
    (dict(init_scale="auto", calibration_margin="4"), TypeError, "calibration_margin"),
    (dict(init_scale="auto", scaling=False), ValueError, "calibrate sets a first scale, so it needs a dynamic"),
    (dict(init_scale="auto", dynamic=False), ValueError, "a static one (dynamic=False)"),
    (dict(init_scale="auto", min_scale=2.0), ValueError, "first iteration at scale 1, which must lie in"),
])
def test_bad_arguments_are_refused_with_the_argument_named(kwargs, error, words):
    with pytest.raises(error, match="GradScaler") as info:
        ampkit.GradScaler("cpu", **kwargs)
    assert words in str(info.value)


@CUDA_ONLY
def test_cuda_calibration_makes_no_host_sync():
    model = torch.nn.Linear(64, 64).cuda()
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ampkit.GradScaler("cuda", init_scale="auto")
    x = torch.randn(8, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().square().mean()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    amax = max(float(p.grad.abs().max()) for p in model.parameters())  # grads at scale 1: the true ones
    assert scaler.get_scale() == expected_scale(amax, 2.0)
