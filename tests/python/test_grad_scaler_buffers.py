"""ampkit.GradScaler's device-side flags and watches on the CPU: the min_scale watch warns and raises from update()
(NOTE [Watching min_scale]) with generic and fused optimizers, and the flags last_step_ran() hands out are fresh
each step, reused only while nobody holds them (NOTE [Step-ran flags]). The C++ side:
tests/cpp/test_grad_scaler_buffers.cpp; the CUDA side: test_cuda_streams.py."""
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


def test_last_step_ran_flags_are_reused_while_nobody_holds_them_and_never_while_held():
    # update() writes into a flag only the scaler references (NOTE [Step-ran flags]): the same one step after
    # step while none is kept, a different one for each flag kept, and a kept flag is never written again.
    scaler = ampkit.GradScaler("cpu", init_scale=1024.0)
    params = [torch.nn.Parameter(torch.ones(4))]
    opt = ampkit.optim.SGD(params, lr=1e-3)
    written = set()
    for i in range(6):
        _step(scaler, opt, params, overflow=i % 2 == 1)
        assert bool(scaler.last_step_ran()) == (i % 2 == 0)
        written.add(scaler.last_step_ran().data_ptr())
    assert len(written) == 1
    kept = []
    for i in range(6):
        _step(scaler, opt, params, overflow=i % 3 == 0)
        kept.append((scaler.last_step_ran()[None], i % 3 != 0))  # a view keeps the storage, and so the flag
    assert len({flag.data_ptr() for flag, _ in kept}) == 6
    for _ in range(3):
        _step(scaler, opt, params, overflow=True)
    assert [bool(flag) for flag, _ in kept] == [ran for _, ran in kept]
