"""ampkit.optim.lr_scheduler: schedules that do not advance on a step the scaler skipped (SkipAware: any scheduler,
one host read per step; DeviceLambdaLR: the lr a device tensor from the applied-step count, no host read)."""
from __future__ import annotations

import pytest
import torch

import ampkit
from ampkit.optim.lr_scheduler import DeviceLambdaLR, SkipAware
from conftest import CUDA_ONLY


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _train(model, opt, scaler, sched, batches, poisoned):
    lrs = []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if i in poisoned:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        lrs.append([float(g["lr"]) for g in opt.param_groups])
    return lrs


@pytest.mark.parametrize("opt_cls", [ampkit.optim.AdamW, torch.optim.SGD], ids=["fused", "torch"])
def test_skip_aware_steps_only_the_applied_steps_and_matches_a_run_without_the_skipped_batches(opt_cls):
    batches = _batches(8)
    poisoned = {2, 5}
    # the run with the two poisoned batches, wrapped
    model = _model()
    opt = opt_cls(model.parameters(), lr=0.1)
    scaler = ampkit.GradScaler("cpu", init_scale=256.0, growth_interval=1000)
    sched = SkipAware(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), scaler)
    lrs = _train(model, opt, scaler, sched, batches, poisoned)
    # the control: the clean batches only, a plain scheduler, a scaler fixed at the scale the first run had
    control = _model()
    copt = opt_cls(control.parameters(), lr=0.1)
    csched = torch.optim.lr_scheduler.StepLR(copt, step_size=2, gamma=0.5)
    clrs = []
    scale = 256.0
    for i, (x, y) in enumerate(batches):
        if i in poisoned:
            scale /= 2  # the poisoned step backed off
            clrs.append(clrs[-1] if clrs else [0.1])
            continue
        copt.zero_grad()
        (torch.nn.functional.mse_loss(control(x), y) * scale).backward()
        for p in control.parameters():
            p.grad.mul_(1 / scale)
        copt.step()
        csched.step()
        clrs.append([float(g["lr"]) for g in copt.param_groups])
    assert sched.skipped_steps == 2
    assert sched.last_epoch == 6 == csched.last_epoch  # delegated attribute
    assert lrs == clrs
    assert sched.get_last_lr() == csched.get_last_lr()
    for a, b in zip(model.parameters(), control.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_skip_aware_state_dict_is_the_wrapped_schedulers_and_loads_into_a_plain_one():
    model = _model()
    opt = ampkit.optim.AdamW(model.parameters(), lr=0.1)
    scaler = ampkit.GradScaler("cpu")
    sched = SkipAware(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s), scaler)
    _train(model, opt, scaler, sched, _batches(3), {1})
    state = sched.state_dict()
    assert state["last_epoch"] == 2 and "scheduler" not in state
    opt2 = ampkit.optim.AdamW(_model().parameters(), lr=0.1)
    plain = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.9**s)
    plain.load_state_dict(state)
    assert plain.last_epoch == 2


def test_skip_aware_steps_before_any_update_and_with_a_disabled_scaler():
    opt = torch.optim.SGD(_model().parameters(), lr=1.0)
    for scaler in (ampkit.GradScaler("cpu"), ampkit.GradScaler("cpu", enabled=False)):
        sched = SkipAware(torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), scaler)
        assert sched.last_step_applied()
        before = sched.last_epoch
        sched.step()
        assert sched.last_epoch == before + 1 and sched.skipped_steps == 0


def test_skip_aware_refuses_what_it_cannot_use():
    opt = torch.optim.SGD(_model().parameters(), lr=1.0)
    with pytest.raises(TypeError, match=r"SkipAware: scheduler must be a learning-rate scheduler \(with step\(\)\)"):
        SkipAware(object(), ampkit.GradScaler("cpu"))
    with pytest.raises(TypeError, match="SkipAware: scaler must be an ampkit.GradScaler.*but got GradScaler"):
        SkipAware(torch.optim.lr_scheduler.StepLR(opt, 1), torch.amp.GradScaler("cpu"))


class _CountingMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that read a tensor on the host or copy between devices (a step must make none)."""

    def __init__(self):
        super().__init__()
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.host_reads += 1
        return func(*args, **(kwargs or {}))


def test_device_lambda_lr_counts_applied_steps_on_the_device_without_a_host_read():
    batches = _batches(7)
    model = _model()
    opt = ampkit.optim.AdamW(model.parameters(), lr=0.5)
    scaler = ampkit.GradScaler("cpu", init_scale=64.0)
    sched = DeviceLambdaLR(opt, lambda s: torch.clamp((s + 1) / 4, max=1.0), scaler)
    assert float(opt.param_groups[0]["lr"]) == 0.5 * 0.25  # set at construction, as LambdaLR
    lrs = []
    counting = _CountingMode()
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y) * (float("nan") if i in (1, 4) else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        with counting:
            sched.step()
        lrs.append(float(sched.get_last_lr()[0]))
    assert counting.host_reads == 0
    applied = [1, 1, 2, 3, 3, 4, 5]  # after each step; steps 1 and 4 skipped
    assert lrs == [0.5 * min((a + 1) / 4, 1.0) for a in applied]
    assert sched.state_dict() == {"applied_steps": 5, "initial_lrs": [0.5]}


@CUDA_ONLY
def test_device_lambda_lr_keeps_a_cuda_step_free_of_host_syncs():
    model = _model().cuda()
    opt = ampkit.optim.AdamW(model.parameters(), lr=0.5)
    scaler = ampkit.GradScaler("cuda", init_scale=64.0)
    sched = DeviceLambdaLR(opt, lambda s: torch.clamp((s + 1) / 4, max=1.0), scaler)
    x, y = torch.randn(8, 6, device="cuda"), torch.randn(8, 1, device="cuda")
    for _ in range(2):  # the first step creates the states
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.step(opt)
            scaler.update()
            sched.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert float(opt.param_groups[0]["lr"]) == 0.5 * 0.75


def test_device_lambda_lr_state_round_trip_and_optimizer_reload():
    model = _model()
    opt = ampkit.optim.SGD(model.parameters(), lr=2.0)
    sched = DeviceLambdaLR(opt, lambda s: 0.5**s)  # no scaler: every step counts
    for _ in range(3):
        sched.step()
    assert float(opt.param_groups[0]["lr"]) == 2.0 * 0.125
    state, opt_state = sched.state_dict(), opt.state_dict()
    opt2 = ampkit.optim.SGD(_model().parameters(), lr=2.0)
    sched2 = DeviceLambdaLR(opt2, lambda s: 0.5**s)
    opt2.load_state_dict(opt_state)  # replaces the groups' lr values
    sched2.load_state_dict(state)
    assert float(opt2.param_groups[0]["lr"]) == 2.0 * 0.125
    sched2.step()
    assert float(opt2.param_groups[0]["lr"]) == 2.0 * 0.0625
    with pytest.raises(ValueError, match="DeviceLambdaLR.load_state_dict: 'applied_steps' must be a non-negative int"):
        sched2.load_state_dict({"applied_steps": -1})
    assert float(opt2.param_groups[0]["lr"]) == 2.0 * 0.0625  # unchanged by the refused load


def test_device_lambda_lr_refuses_bad_arguments():
    opt = ampkit.optim.SGD(_model().parameters(), lr=1.0)
    with pytest.raises(ValueError, match=r"lr_lambda must be one function or one per parameter group \(1\), but got 2"):
        DeviceLambdaLR(opt, [lambda s: s, lambda s: s])
    with pytest.raises(TypeError, match=r"lr_lambda\[0\] must be callable, but got int"):
        DeviceLambdaLR(opt, 3)
    with pytest.raises(TypeError, match="scaler must be an ampkit.GradScaler"):
        DeviceLambdaLR(opt, lambda s: s, scaler=torch.amp.GradScaler("cpu"))
    assert opt.param_groups[0]["lr"] == 1.0 and "initial_lr" not in opt.param_groups[0]  # nothing changed


# ---- several optimizers on one scaler (a GAN): per-optimizer step outcomes ----------------------------------------


def _two_optimizer_iteration(models, opts, scaler, batch, poison):
    """One GAN-like iteration: each model's loss scaled and stepped by its own optimizer, one update() after both;
    ``poison`` names the models whose grads get an Inf in their last element."""
    x, y = batch
    for k, (model, opt) in enumerate(zip(models, opts)):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if k in poison:
            last = list(model.parameters())[-1]
            last.grad.view(-1)[-1] = float("inf")
        scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("classes", [(ampkit.optim.AdamW, torch.optim.SGD), (torch.optim.SGD, ampkit.optim.SGD)],
                         ids=["fused+torch", "torch+fused"])
def test_each_optimizer_reports_its_own_step_and_the_iteration_flag_reports_any_skip(classes):
    models = [_model(0), _model(1)]
    opts = [cls(m.parameters(), lr=0.05) for cls, m in zip(classes, models)]
    scaler = ampkit.GradScaler("cpu", init_scale=64.0, growth_interval=1000)
    assert scaler.last_step_ran(opts[0]) is None  # before the first update()
    batches = _batches(4)
    outcomes = []
    for batch, poison in zip(batches, [(), (0,), (1,), (0, 1)]):
        before = [[p.detach().clone() for p in m.parameters()] for m in models]
        _two_optimizer_iteration(models, opts, scaler, batch, poison)
        ran = [scaler.last_step_ran(o) for o in opts]
        outcomes.append(([bool(r) for r in ran], bool(scaler.last_step_ran())))
        for k, model in enumerate(models):  # the flag says what happened to that model's weights
            same = all(torch.equal(a, p) for a, p in zip(before[k], model.parameters()))
            assert same == (k in poison)
    assert outcomes == [([True, True], True), ([False, True], False), ([True, False], False),
                        ([False, False], False)]


def test_per_optimizer_flags_keep_their_values_and_a_lone_optimizer_gets_the_iterations_flag():
    models = [_model(0), _model(1)]
    opts = [ampkit.optim.AdamW(m.parameters(), lr=0.05) for m in models]
    scaler = ampkit.GradScaler("cpu", init_scale=64.0, growth_interval=1000)
    held = []
    for batch, poison in zip(_batches(6), [(0,), (1,), (), (0,), (1,), ()]):
        _two_optimizer_iteration(models, opts, scaler, batch, poison)
        held.append((scaler.last_step_ran(opts[0]), scaler.last_step_ran(opts[1])))
    # flags collected iteration after iteration, read at the end: each kept its own value
    assert [(bool(a), bool(b)) for a, b in held] == [(False, True), (True, False), (True, True)] * 2
    # an iteration of one optimizer: its flag is the iteration's, the other took no part
    x, y = _batches(1, seed=7)[0]
    opts[1].zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(models[1](x), y) * float("inf")).backward()
    scaler.step(opts[1])
    scaler.update()
    assert scaler.last_step_ran(opts[0]) is None
    assert not bool(scaler.last_step_ran(opts[1])) and not bool(scaler.last_step_ran())


def test_last_step_ran_refuses_what_is_not_an_optimizer_and_a_disabled_scaler_reports_nothing():
    scaler = ampkit.GradScaler("cpu")
    with pytest.raises(TypeError, match=r"GradScaler.last_step_ran: optimizer must be a torch.optim.Optimizer"):
        scaler.last_step_ran("opt_d")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    off = ampkit.GradScaler("cpu", enabled=False)
    x, y = _batches(1)[0]
    off.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    off.step(opt)
    off.update()
    assert off.last_step_ran(opt) is None


def test_two_skip_aware_schedules_follow_their_own_optimizers():
    models = [_model(0), _model(1)]
    opts = [ampkit.optim.AdamW(models[0].parameters(), lr=0.1), torch.optim.SGD(models[1].parameters(), lr=0.1)]
    scaler = ampkit.GradScaler("cpu", init_scale=64.0, growth_interval=1000)
    scheds = [SkipAware(torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5), scaler) for o in opts]
    poisons = [(0,), (), (1,), (0, 1), ()]
    for batch, poison in zip(_batches(5), poisons):
        _two_optimizer_iteration(models, opts, scaler, batch, poison)
        for s in scheds:
            s.step()
    applied = [sum(1 for p in poisons if k not in p) for k in range(2)]
    assert [s.skipped_steps for s in scheds] == [len(poisons) - a for a in applied] == [2, 2]
    assert float(opts[1].param_groups[0]["lr"]) == pytest.approx(0.1 * 0.5 ** applied[1], rel=0, abs=0)
    # DeviceLambdaLR counts the applied steps of its own optimizer: rebuilt on the same outcomes
    models2 = [_model(0), _model(1)]
    opts2 = [ampkit.optim.AdamW(models2[0].parameters(), lr=0.1), torch.optim.SGD(models2[1].parameters(), lr=0.1)]
    scaler2 = ampkit.GradScaler("cpu", init_scale=64.0, growth_interval=1000)
    device_sched = DeviceLambdaLR(opts2[0], lambda s: 1.0 / (1.0 + s), scaler2)
    for batch, poison in zip(_batches(5), poisons):
        _two_optimizer_iteration(models2, opts2, scaler2, batch, poison)
        device_sched.step()
    assert float(device_sched.applied) == applied[0] == 3
