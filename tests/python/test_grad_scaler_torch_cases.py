"""ampkit.GradScaler on PyTorch's own scaling cases (torch.testing._internal.common_cuda._create_scaling_case, the
models, data and skip iteration torch's GradScaler tests use), run on the CPU: a scaled run with an Inf injected at
the skip iteration must equal an unscaled control run that skips that step, and must match torch.amp.GradScaler
driving the same optimizer, parameters and scale bit for bit."""
from __future__ import annotations

import pytest
import torch

import ampkit

# torch.testing._internal imports expecttest (a test requirement, staged for GPU hosts by
# scripts/stage_gpu_deps.sh): without it this module skips instead of failing the collection of the suite.
_create_scaling_case = pytest.importorskip("torch.testing._internal.common_cuda")._create_scaling_case

OPTIMIZERS = [
    ("torch.optim.SGD", torch.optim.SGD, {}),
    ("torch.optim.Adam", torch.optim.Adam, {"lr": 1e-2}),
    ("ampkit.optim.SGD", ampkit.optim.SGD, {"momentum": 0.9}),
    ("ampkit.optim.Adam", ampkit.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
    ("ampkit.optim.AdamW", ampkit.optim.AdamW, {"lr": 1e-2, "amsgrad": True}),
]


def _run(scaler_cls, ctor, kwargs, *, inject: str):
    torch.manual_seed(0)
    mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = _create_scaling_case(
        device="cpu", optimizer_ctor=ctor, optimizer_kwargs=kwargs)
    scaler = scaler_cls("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1)
    for i, (inp, target) in enumerate(data):
        opt_control.zero_grad()
        loss_fn(mod_control(inp), target).backward()
        if i != skip_iter:
            opt_control.step()
        opt_scaling.zero_grad()
        scaler.scale(loss_fn(mod_scaling(inp), target)).backward()
        if i == skip_iter:
            # the last element of the last parameter's grad: the end of the last chunk the check reads
            grad = list(mod_scaling.parameters())[-1].grad
            grad.view(-1)[-1] = float(inject)
        scaler.step(opt_scaling)
        scaler.update()
    return mod_control, mod_scaling, scaler


@pytest.mark.parametrize("inject", ["inf", "nan"])
@pytest.mark.parametrize("name,ctor,kwargs", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_torch_scaling_case_skips_the_injected_step_and_matches_the_unscaled_run(name, ctor, kwargs, inject):
    mod_control, mod_scaling, scaler = _run(ampkit.GradScaler, ctor, kwargs, inject=inject)
    # 3 clean steps double the scale, the skipped one halves it: 128 * 2**3 / 2.
    assert scaler.get_scale() == 512.0
    assert scaler.stats()["skipped_steps"] == 1
    for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
        torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("inject", ["inf", "nan"])
@pytest.mark.parametrize("name,ctor,kwargs", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_torch_scaling_case_gives_torch_grad_scalers_results_bit_for_bit(name, ctor, kwargs, inject):
    _, ours, ours_scaler = _run(ampkit.GradScaler, ctor, kwargs, inject=inject)
    _, theirs, their_scaler = _run(torch.amp.GradScaler, ctor, kwargs, inject=inject)
    assert ours_scaler.get_scale() == their_scaler.get_scale()
    theirs_sd = their_scaler.state_dict()  # ampkit adds keys of its own (hysteresis, bounds, statistics)
    assert {k: ours_scaler.state_dict()[k] for k in theirs_sd} == theirs_sd
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b), (a - b).abs().max()
        assert torch.equal(a.grad, b.grad)  # unscaled grads left behind, as torch's
