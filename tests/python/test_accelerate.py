"""ampkit.integrations.accelerate.attach in a real HF Accelerate loop on the CPU: backward, clipping on unscaled
gradients (once), the step, optimizer_step_was_skipped exactly on the skipped steps with the scheduler held there,
save_state/load_state with the scaler's full state, and each run equal bit for bit to the loop written by hand;
without attach, Accelerate's own torch.amp.GradScaler stepping an ampkit optimizer warns once, naming attach."""
from __future__ import annotations

import warnings

import pytest
import torch

import ampkit

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from ampkit.integrations.accelerate import attach  # noqa: E402

STEPS = 6

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _data(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 10, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _setup(mixed_precision, scaler, opt_cls=ampkit.optim.AdamW):
    acc = accelerate.Accelerator(mixed_precision=mixed_precision, cpu=True)
    attach(acc, scaler)
    net = _net()
    opt = opt_cls(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7**s)
    loader = torch.utils.data.DataLoader(_data(), batch_size=None, shuffle=False)
    return (acc, *acc.prepare(net, opt, loader, sched))


def _accelerate_loop(acc, net, opt, loader, sched, *, clip=None, poisoned=(), steps=None, start=0):
    skipped, norms = [], []
    for i, (x, y) in enumerate(loader):
        if i < start:
            continue
        if steps is not None and i >= start + steps:
            break
        loss = torch.nn.functional.mse_loss(net(x).float(), y)
        if i in poisoned:
            loss = loss * float("inf")
        acc.backward(loss)
        if clip is not None:
            norms.append(acc.clip_grad_norm_(net.parameters(), clip))
        opt.step()
        sched.step()
        opt.zero_grad()
        skipped.append(acc.optimizer_step_was_skipped)
    return skipped, norms


def _by_hand(dtype, scaler, *, clip=None, poisoned=(), opt_cls=ampkit.optim.AdamW):
    net = _net()
    opt = opt_cls(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7**s)
    norms = []
    for i, (x, y) in enumerate(_data()):
        with torch.autocast("cpu", dtype=dtype):
            out = net(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        if i in poisoned:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), clip))
        scaler.step(opt)
        scaler.update()
        if bool(scaler.last_step_ran()):
            sched.step()
        opt.zero_grad()
    return net, sched, norms


@pytest.mark.parametrize("mixed_precision,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_attach_steps_clips_unscaled_gradients_and_reports_exactly_the_skipped_steps(mixed_precision, dtype):
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**12)
    acc, net, opt, loader, sched = _setup(mixed_precision, scaler)
    skipped, norms = _accelerate_loop(acc, net, opt, loader, sched, clip=0.5, poisoned={3})
    assert skipped == [False, False, False, True, False, False]
    assert sched.scheduler.last_epoch == STEPS - 1  # held at the skipped step
    assert scaler.stats()["skipped_steps"] == 1
    ref, ref_sched, ref_norms = _by_hand(dtype, ampkit.GradScaler("cpu", init_scale=2.0**12), clip=0.5,
                                         poisoned={3})
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b), (a - b).abs().max()
    # the norms clipping saw are the true gradients' (O(1)), not 4096 times that, and equal to the loop by hand's
    for ours, theirs in zip(norms, ref_norms):
        assert torch.equal(ours, theirs) or (not torch.isfinite(ours) and not torch.isfinite(theirs))
    assert 0.01 < float(norms[0]) < 100.0


def test_scaler_unscale_on_the_prepared_optimizer_then_clipping_unscales_once():
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**10)
    acc, net, opt, loader, sched = _setup("fp16", scaler)
    x, y = next(iter(loader))
    acc.backward(torch.nn.functional.mse_loss(net(x).float(), y))
    scaled = [p.grad.clone() for p in net.parameters()]
    scaler.unscale_(opt)  # the AcceleratedOptimizer wrapper: the same optimizer to the scaler
    acc.clip_grad_norm_(net.parameters(), 1e9)  # unscales nothing more
    for p, g in zip(net.parameters(), scaled):
        assert torch.equal(p.grad, g * torch.tensor(2.0**-10))
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt.optimizer)


def test_a_torch_optimizer_is_skipped_by_the_scaler_and_reported():
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**8)
    acc, net, opt, loader, sched = _setup("fp16", scaler, opt_cls=torch.optim.SGD)
    skipped, _ = _accelerate_loop(acc, net, opt, loader, sched, poisoned={0, 4})
    assert skipped == [True, False, False, False, True, False]
    assert sched.scheduler.last_epoch == 4


def test_a_skip_query_reads_the_device_once_and_a_loop_that_does_not_ask_reads_nothing():
    scaler = ampkit.GradScaler("cpu")
    acc, net, opt, loader, sched = _setup("fp16", scaler)
    reads = []
    real = torch.Tensor.__bool__

    def counting_bool(t):
        reads.append(t)
        return real(t)

    x, y = next(iter(loader))
    acc.backward(torch.nn.functional.mse_loss(net(x).float(), y))
    torch.Tensor.__bool__ = counting_bool
    try:
        opt.step()
        assert reads == []
        assert acc.optimizer_step_was_skipped is False and acc.optimizer_step_was_skipped is False
    finally:
        torch.Tensor.__bool__ = real
    assert len(reads) == 1


def test_save_state_and_load_state_resume_bitwise_with_the_full_scaler_state(tmp_path):
    def scaler():
        return ampkit.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, hysteresis=2)

    full_scaler = scaler()
    acc, net, opt, loader, sched = _setup("fp16", full_scaler)
    _accelerate_loop(acc, net, opt, loader, sched, clip=1.0, poisoned={1, 4})
    full = [p.detach().clone() for p in net.parameters()]
    full_state = full_scaler.state_dict()

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    first_scaler = scaler()
    acc, net, opt, loader, sched = _setup("fp16", first_scaler)
    _accelerate_loop(acc, net, opt, loader, sched, clip=1.0, poisoned={1, 4}, steps=3)
    acc.save_state(str(tmp_path / "ckpt"))
    saved = torch.load(tmp_path / "ckpt" / "scaler.pt", weights_only=False)
    assert saved["hysteresis"] == 2 and saved["_hysteresis_tracker"] == first_scaler.state_dict()["_hysteresis_tracker"]

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed_scaler = scaler()
    acc, net, opt, loader, sched = _setup("fp16", resumed_scaler)
    acc.load_state(str(tmp_path / "ckpt"))
    _accelerate_loop(acc, net, opt, loader, sched, clip=1.0, poisoned={1, 4}, start=3)
    for a, b in zip(net.parameters(), full):
        assert torch.equal(a, b)
    assert resumed_scaler.state_dict() == full_state


def test_attach_refuses_what_it_cannot_do_and_changes_nothing():
    acc = accelerate.Accelerator(mixed_precision="no", cpu=True)
    with pytest.raises(ValueError, match="mixed_precision must be 'fp16' or 'bf16'.*but got 'no'"):
        attach(acc, ampkit.GradScaler("cpu"))
    assert acc.scaler is None and not hasattr(acc, "_ampkit_scaler")
    AcceleratorState._reset_state(True)
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    with pytest.raises(TypeError, match="scaler must be an ampkit.GradScaler, but got GradScaler"):
        attach(acc, torch.amp.GradScaler("cpu"))
    opt = acc.prepare(ampkit.optim.AdamW(_net().parameters()))
    with pytest.raises(RuntimeError, match="call attach before accelerator.prepare.*1 optimizer"):
        attach(acc, ampkit.GradScaler("cpu"))
    assert acc.scaler is None and opt.scaler is None


def _attach_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "ampkit.integrations.accelerate.attach" in str(w.message)]


@pytest.mark.parametrize("opt_cls", [ampkit.optim.AdamW, ampkit.optim.SGD])
def test_accelerates_own_scaler_stepping_an_ampkit_optimizer_warns_once_naming_attach(opt_cls):
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    # torch.amp.GradScaler("cuda") is what Accelerate builds for FP16 on a GPU; the same scaler on the CPU.
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    net = _net()
    opt = opt_cls(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7**s)
    loader = torch.utils.data.DataLoader(_data(), batch_size=None, shuffle=False)
    net, opt, loader, sched = acc.prepare(net, opt, loader, sched)
    result = {}
    caught = _attach_warnings(lambda: result.update(skipped=_accelerate_loop(acc, net, opt, loader, sched,
                                                                             poisoned={2})[0]))
    assert len(caught) == 1 and f"ampkit.optim.{opt_cls.__name__}" in caught[0], caught
    # what it warns of: the skipped step is not reported, and the schedule advanced on it
    assert result["skipped"] == [False] * STEPS and sched.scheduler.last_epoch == STEPS


def test_no_warning_with_attach_or_without_accelerate():
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**8)
    acc, net, opt, loader, sched = _setup("fp16", scaler)
    assert _attach_warnings(lambda: _accelerate_loop(acc, net, opt, loader, sched, poisoned={2})) == []

    def own_loop():  # torch's scaler in a loop of one's own (no Accelerate); the scheduler wraps the optimizer's step
        net = _net()
        opt = ampkit.optim.AdamW(net.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7**s)
        torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        for x, y in _data():
            torch_scaler.scale(torch.nn.functional.mse_loss(net(x), y)).backward()
            torch_scaler.step(opt)
            torch_scaler.update()
            sched.step()
            opt.zero_grad()

    assert _attach_warnings(own_loop) == []
