"""ampkit.GradScaler on PyTorch's own scaling cases (torch.testing._internal.common_cuda._create_scaling_case, the
models, data and skip iteration torch's GradScaler tests use), run on the CPU: a scaled run with an Inf injected at
the skip iteration must equal an unscaled control run that skips that step, and must match torch.amp.GradScaler
driving the same optimizer, parameters and scale bit for bit. Then torch's type and the private members torch's own
GradScaler tests and frameworks use (``_unscale_grads_``, ``_per_optimizer_states``, an assigned
``_init_growth_tracker``), used as those tests use them, side by side with torch.amp.GradScaler."""
from __future__ import annotations

import pytest
import torch

import ampkit
from loops import drive_scaler

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


# ---- torch.amp.GradScaler's type and private members, as torch's own tests and frameworks use them -------------

SCALERS = [ampkit.GradScaler, torch.amp.GradScaler]


def test_it_is_a_torch_amp_grad_scaler_whose_state_stays_ampkits():
    scaler = ampkit.GradScaler("cpu", init_scale=8.0, hysteresis=2)
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler._scale is None and scaler._growth_tracker is None  # torch's __init__ did not run
    drive_scaler(scaler, [1, 0])
    # hysteresis=2: one overflow skips the step without backing off (an extra torch's scaler does not have)
    assert scaler.get_scale() == 8.0 and scaler.stats()["skipped_steps"] == 1
    assert ampkit.OptState is torch.amp.grad_scaler.OptState


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _storm_grads(inject: int, device: str = "cpu"):
    """Grads of mixed dtypes and layouts (contiguous, a non-dense slice, a transpose, FP16); an Inf at [2, 2] of
    grads[inject] when inject >= 0."""
    g = torch.full((20, 20), 4.0, device=device)
    grads = [g.clone(), g.clone()[:, :5], g.clone().t(), g.to(torch.float16), g.to(torch.float16)]
    if inject >= 0:
        grads[inject][2, 2] = float("inf")
    return grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inject", range(-1, 5))
def test_unscale_grads_finds_an_inf_in_any_grad_and_unscales_as_torchs(inject, device):
    results = []
    for cls in SCALERS:
        scaler = cls(device)
        grads = _storm_grads(inject, device)
        params = [torch.empty_like(g) for g in grads]
        opt = torch.optim.SGD(params, lr=1.0)
        for p, g in zip(params, grads):
            p.grad = g
        inv_scale = torch.full((1,), 0.25, device=device)
        found_inf = torch.full((1,), 0.0, device=device)
        per_device = scaler._unscale_grads_(opt, inv_scale, found_inf, True)
        assert list(per_device) == [found_inf.device] and found_inf.item() == 0.0  # a copy is checked
        results.append((per_device[found_inf.device].item(), [p.grad for p in params]))
        if cls is ampkit.GradScaler:
            assert scaler._per_optimizer_states[id(opt)]["stage"] is ampkit.OptState.READY  # no state touched
    (ours, our_grads), (theirs, their_grads) = results
    assert ours == theirs == (0.0 if inject < 0 else 1.0)
    for a, b in zip(our_grads, their_grads):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_unscale_grads_refuses_fp16_grads_unless_allowed_as_torchs():
    for cls in SCALERS:
        grads = _storm_grads(-1)
        params = [torch.empty_like(g) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        with pytest.raises(ValueError, match="^Attempting to unscale FP16 gradients.$"):
            cls("cpu")._unscale_grads_(torch.optim.SGD(params, lr=1.0), torch.full((1,), 0.25),
                                       torch.full((1,), 0.0), False)
        assert all(torch.equal(p.grad, g) and bool((p.grad == 4).all()) for p, g in zip(params, grads))


@pytest.mark.parametrize("values,dtype", [([16.0, 32.0, 64.0], torch.float32),
                                          ([16.0, 32.0, float("inf")], torch.float32),
                                          ([16.0, 32.0, float("nan")], torch.float32),
                                          ([64000.0, 32.0, 64000.0], torch.float16)])
def test_unscale_grads_of_sparse_grads_as_torchs(values, dtype):
    # FP16: indices repeated, so coalescing sums 64000 + 64000 to Inf, which the check must see
    indices = torch.tensor([[0, 1, 0], [2, 0, 2]]) if dtype == torch.float16 else torch.tensor([[0, 1, 1], [2, 0, 2]])
    results = []
    for cls in SCALERS:
        s = torch.sparse_coo_tensor(indices, torch.tensor(values), (2, 3), check_invariants=True).to(dtype)
        p = s.clone()
        opt = torch.optim.SGD([p], lr=1.0)
        p.grad = s.clone()
        found_inf = torch.zeros(1)
        found = cls("cpu")._unscale_grads_(opt, torch.full((1,), 0.25), found_inf, dtype == torch.float16)
        results.append((found[torch.device("cpu")].item(), p.grad.is_coalesced(), p.grad.to_dense()))
    (ours, our_coalesced, our_grad), (theirs, their_coalesced, their_grad) = results
    assert ours == theirs == (0.0 if values == [16.0, 32.0, 64.0] else 1.0)
    assert our_coalesced == their_coalesced
    assert torch.equal(our_grad.nan_to_num(), their_grad.nan_to_num())


def test_per_optimizer_states_follow_the_iteration_as_torchs():
    OptState = torch.amp.grad_scaler.OptState
    seen = {}
    for cls in SCALERS:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        other = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        scaler = cls("cpu", init_scale=64.0)
        states = scaler._per_optimizer_states
        record = [states[id(other)]["stage"], dict(states[id(other)]["found_inf_per_device"])]
        for poison in (False, True):
            scaler.scale(model(torch.randn(3, 4)).sum()).backward()
            if poison:
                model.bias.grad[1] = float("nan")
            scaler.unscale_(opt)
            state = scaler._per_optimizer_states[id(opt)]
            record += [state["stage"], {d: t.item() for d, t in state["found_inf_per_device"].items()}]
            scaler.step(opt)
            record.append(scaler._per_optimizer_states[id(opt)]["stage"])
            scaler.update()
            opt.zero_grad()
            state = scaler._per_optimizer_states[id(opt)]
            record += [state["stage"], dict(state["found_inf_per_device"])]
        seen[cls] = record
    cpu = torch.device("cpu")
    assert seen[ampkit.GradScaler] == seen[torch.amp.GradScaler] == [
        OptState.READY, {},
        OptState.UNSCALED, {cpu: 0.0}, OptState.STEPPED, OptState.READY, {},
        OptState.UNSCALED, {cpu: 1.0}, OptState.STEPPED, OptState.READY, {}]


def test_per_optimizer_states_are_read_only():
    scaler = ampkit.GradScaler("cpu")
    with pytest.raises(TypeError, match=r"_per_optimizer_states\[1\]\['stage'\] is read-only"):
        scaler._per_optimizer_states[1]["stage"] = ampkit.OptState.STEPPED
    with pytest.raises(TypeError, match="key must be id\\(optimizer\\), an int, but got str"):
        scaler._per_optimizer_states["opt"]


@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_init_growth_tracker_is_assignable_and_load_state_dict_overwrites_it_as_torchs(lazy_init_scale):
    seen = {}
    for cls in SCALERS:
        s0 = cls("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        s1 = cls("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        s1._init_growth_tracker = 7  # a value for load_state_dict to overwrite
        record = [s1._init_growth_tracker, s1.state_dict()["_growth_tracker"]]
        if lazy_init_scale:
            s1.scale(torch.full((1,), 4.0))
            assert isinstance(s1._scale, torch.FloatTensor)
        s1.load_state_dict(s0.state_dict())
        record += [s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval(),
                   s1._init_growth_tracker, s1._get_growth_tracker()]
        seen[cls] = record
    assert seen[ampkit.GradScaler] == seen[torch.amp.GradScaler] == [7, 7, 3.0, 4.0, 0.5, 2, 0, 0]


@pytest.mark.parametrize("assigned_after_first_scale", [False, True])
def test_an_assigned_init_growth_tracker_is_where_the_tracker_starts_as_torchs(assigned_after_first_scale):
    seen = {}
    for cls in SCALERS:
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = cls("cpu", init_scale=16.0, growth_interval=4)
        if assigned_after_first_scale:
            scaler.scale(torch.ones(1))
        scaler._init_growth_tracker = 3  # the tracker starts at 3 if the device state does not exist yet
        record = [scaler._init_growth_tracker]
        for _ in range(2):
            scaler.scale(p.sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            record += [scaler.get_scale(), scaler._get_growth_tracker()]
        seen[cls] = record
    expected = [3, 16.0, 1, 16.0, 2] if assigned_after_first_scale else [3, 32.0, 0, 32.0, 1]
    assert seen[ampkit.GradScaler] == seen[torch.amp.GradScaler] == expected


def test_init_growth_tracker_must_be_an_int():
    with pytest.raises(TypeError, match=r"GradScaler._init_growth_tracker: value must be an int, but got float 1.5"):
        ampkit.GradScaler("cpu")._init_growth_tracker = 1.5
