"""Defects a fault sweep found, each pinned by a test that failed before its fix: a scaler stuck after raising at
min_scale, last_step_ran() overwritten by later steps, optimizer steps applied to some groups before an error,
setters and update(new_scale) accepting what cannot work. Every failing call must change nothing."""
from __future__ import annotations

import math
import pickle

import pytest
import torch

import ampkit


def _step(scaler, opt, params, overflow):
    opt.zero_grad()
    scaler.scale(sum(p.float().sum() for p in params)).backward()
    if overflow:
        params[-1].grad[-1] = math.inf
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("optimizer", ["torch.optim.SGD", "ampkit.optim.SGD"])
def test_raise_at_min_scale_raises_in_update_and_leaves_the_scaler_usable(optimizer):
    # Generic (torch) and fused (ampkit) optimizers raise at the same moment: the update() of the overflow at
    # min_scale, not a later state read.
    cls = torch.optim.SGD if optimizer.startswith("torch") else ampkit.optim.SGD
    scaler = ampkit.GradScaler("cpu", init_scale=4.0, min_scale=2.0, raise_at_min_scale=True)
    params = [torch.nn.Parameter(torch.ones(4))]
    opt = cls(params, lr=1e-3)
    _step(scaler, opt, params, overflow=True)  # 4 -> 2: not yet at min_scale when it overflowed
    with pytest.raises(RuntimeError, match="min_scale"):
        _step(scaler, opt, params, overflow=True)  # overflow at min_scale
    state = scaler.state_dict()  # readable and savable, the iteration closed
    assert state["scale"] == 2.0 and scaler.stats()["overflows_at_min_scale"] == 1
    pickle.loads(pickle.dumps(scaler))
    with pytest.raises(RuntimeError, match="min_scale"):
        _step(scaler, opt, params, overflow=False)  # the next update reports the condition again, and steps
    assert scaler.stats()["steps"] == 3


def test_warn_at_min_scale_with_fused_optimizers_warns_in_update():
    scaler = ampkit.GradScaler("cpu", init_scale=2.0, min_scale=2.0)
    params = [torch.nn.Parameter(torch.ones(4))]
    opt = ampkit.optim.AdamW(params)
    with pytest.warns(UserWarning, match="min_scale"):
        _step(scaler, opt, params, overflow=True)
    scaler.state_dict()  # reading state never raises or warns again


def test_last_step_ran_is_a_fresh_flag_per_step():
    scaler = ampkit.GradScaler("cpu", init_scale=1024.0)
    params = [torch.nn.Parameter(torch.ones(4))]
    opt = ampkit.optim.SGD(params, lr=1e-3)
    truth = [True, True, False, True, True, False, True, True]
    flags = []
    for ran in truth:
        _step(scaler, opt, params, overflow=not ran)
        flags.append(scaler.last_step_ran())  # collected without a sync
    assert [bool(f) for f in flags] == truth


def test_setters_validate_like_the_constructor_and_change_nothing_on_error():
    scaler = ampkit.GradScaler("cpu", growth_interval=7)
    with pytest.raises(ValueError, match="growth_interval must be in"):
        scaler.set_growth_interval(0)
    with pytest.raises(ValueError, match="growth factor must be"):
        scaler.set_growth_factor(1.0)
    with pytest.raises(ValueError, match="backoff factor must be in"):
        scaler.set_backoff_factor(1.5)
    assert scaler.get_growth_interval() == 7 and scaler.get_growth_factor() == 2.0
    assert scaler.get_backoff_factor() == 0.5


def test_update_with_a_new_scale_cannot_change_a_fixed_scale_scaler():
    scaler = ampkit.GradScaler("cpu", scaling=False)
    params = [torch.nn.Parameter(torch.ones(4))]
    opt = torch.optim.SGD(params, lr=1e-3)
    scaler.scale(params[0].sum()).backward()
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="scaling=False"):
        scaler.update(4.0)
    assert scaler.get_scale() == 1.0


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(betas=(0.9, 1.5)), dict(eps=-1e-8), dict(weight_decay=-0.1),
                                 dict(master_weights="remainder")])
def test_an_optimizer_step_is_atomic_across_param_groups(bad):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(8, dtype=torch.float16))
    b = torch.nn.Parameter(torch.randn(8, dtype=torch.float16))
    opt = ampkit.optim.AdamW([{"params": [a]}, {"params": [b]}], lr=1e-3)
    opt.param_groups[1].update(bad)
    a.grad = torch.randn(8, dtype=torch.float16)
    b.grad = torch.randn(8, dtype=torch.float16)
    before = (a.detach().clone(), b.detach().clone())
    with pytest.raises(ValueError):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    assert len(opt.state) == 0  # no state created for parameters that never stepped


def test_an_sgd_step_is_atomic_across_param_groups():
    a = torch.nn.Parameter(torch.ones(4))
    b = torch.nn.Parameter(torch.ones(4))
    opt = ampkit.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1, momentum=0.9)
    opt.param_groups[1]["momentum"] = -0.5
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    with pytest.raises(ValueError, match="momentum"):
        opt.step()
    assert torch.equal(a, torch.ones(4)) and len(opt.state) == 0
