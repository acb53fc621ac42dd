"""ampkit.GradScaler against torch.amp.GradScaler as the oracle: long runs with injected Inf/NaN, clipping,
accumulation, several optimizers and losses, the sync-free fused path, every error message; then ampkit's extras:
hysteresis, bounds, stats, overflow report, the fixed-scale BF16 mode, setters. Its state and checkpoints:
test_grad_scaler_state.py."""
from __future__ import annotations

import copy
import math
import pickle
import warnings

import pytest
import torch

import ampkit
from conftest import CUDA_ONLY, DEVICES, bits_equal
from loops import drive_scaler

SCALERS = {"torch": torch.amp.GradScaler, "ampkit": ampkit.GradScaler}


def make_model(device: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(device)


def batches(device: str, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(24, 16, generator=g).to(device), torch.randn(24, 8, generator=g).to(device)) for _ in range(n)]


def poison(model: torch.nn.Module, step: int, inf_steps: dict[int, float]) -> None:
    """On chosen steps, write Inf/NaN into the last element of the last parameter's grad."""
    if step in inf_steps:
        list(model.parameters())[-1].grad.view(-1)[-1] = inf_steps[step]


def run(kind: str, device: str, scenario: str, steps: int = 40, inf_steps=None, **scaler_kwargs):
    """Trains the same model with torch's or ampkit's scaler; returns the scale history, step results, params."""
    inf_steps = inf_steps if inf_steps is not None else {3: math.inf, 4: math.nan, 11: -math.inf, 30: math.inf}
    model = make_model(device)
    params = list(model.parameters())
    if scenario == "two_optimizers":
        opts = [torch.optim.SGD(params[:2], lr=0.05, momentum=0.9), torch.optim.Adam(params[2:], lr=1e-3)]
    elif scenario == "adam":
        opts = [torch.optim.Adam(params, lr=1e-3, weight_decay=0.01)]
    elif scenario == "fused_adamw":
        opts = [torch.optim.AdamW(params, lr=1e-3, fused=True)]
    else:
        opts = [torch.optim.SGD(params, lr=0.05, momentum=0.9)]
    scaler = SCALERS[kind](device, init_scale=2.0**10, growth_interval=5, **scaler_kwargs)
    history = []
    for step, (x, y) in enumerate(batches(device, steps)):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        dtype = torch.bfloat16
        with torch.autocast(device_type=device, dtype=dtype):
            out = model(x)
        if scenario == "two_losses":
            l1 = torch.nn.functional.mse_loss(out.float(), y)
            l2 = out.float().abs().mean()
            scaler.scale(l1).backward(retain_graph=True)
            scaler.scale(l2).backward()
        elif scenario == "accumulation":
            for xb, yb in ((x[:12], y[:12]), (x[12:], y[12:])):
                with torch.autocast(device_type=device, dtype=dtype):
                    o = model(xb)
                scaler.scale(torch.nn.functional.mse_loss(o.float(), yb) / 2).backward()
        else:
            scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
        poison(model, step, inf_steps)
        if scenario == "clipping":
            scaler.unscale_(opts[0])
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        results = [scaler.step(opt) for opt in opts]
        scaler.update()
        history.append((scaler.get_scale(), results))
    return history, [p.detach().clone() for p in model.parameters()], scaler


SCENARIOS = ["sgd", "adam", "clipping", "accumulation", "two_optimizers", "two_losses", "fused_adamw"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_training_run_bit_identical_to_torch(device, scenario):
    h_t, p_t, s_t = run("torch", device, scenario)
    h_a, p_a, s_a = run("ampkit", device, scenario)
    assert [h[0] for h in h_a] == [h[0] for h in h_t]  # same scale after every step
    assert [h[1] for h in h_a] == [h[1] for h in h_t]  # same step() return values
    for a, b in zip(p_a, p_t):
        assert bits_equal(a, b)
    st = s_t.state_dict()
    sa = s_a.state_dict()
    assert {k: sa[k] for k in st} == st
    assert all(type(sa[k]) is type(st[k]) for k in st)  # plain float / int, as torch's
    # The injected overflows were skipped and backed the scale off.
    scales = [h[0] for h in h_a]
    assert scales[3] == scales[2] / 2 and scales[4] == scales[3] / 2
    assert sa["skipped_steps"] == 4 and sa["steps"] == 40 and sa["last_overflow_step"] == 31


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_step_leaves_params_and_optimizer_state_bit_identical(device):
    model = make_model(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = ampkit.GradScaler(device, init_scale=256.0)
    for step, (x, y) in enumerate(batches(device, 3)):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == 2:
            before = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
            poison(model, 0, {0: math.nan})
        scaler.step(opt)
        scaler.update()
    assert all(bits_equal(a, b) for a, b in zip(before[0].values(), model.state_dict().values()))
    for k, st in before[1]["state"].items():
        for name, t in st.items():
            assert bits_equal(t, opt.state_dict()["state"][k][name])
    assert not scaler.last_step_ran().item()


def test_every_error_message_matches_torch():
    def scenario(kind, what):
        scaler = SCALERS[kind]("cpu")
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([p], lr=0.1)
        if what == "step_before_scale":
            p.grad = torch.ones(3)
            scaler.step(opt)
        if what == "update_before_scale":
            scaler.update()
        scaler.scale(p.sum()).backward()
        if what == "unscale_twice":
            scaler.unscale_(opt)
            scaler.unscale_(opt)
        elif what == "unscale_after_step":
            scaler.step(opt)
            scaler.unscale_(opt)
        elif what == "step_twice":
            scaler.step(opt)
            scaler.step(opt)
        elif what == "update_without_checks":
            scaler.update()
        elif what == "fp16_grads":
            p.grad = torch.ones(3, dtype=torch.float16)
            scaler.unscale_(opt)
        elif what == "closure":
            scaler.step(opt, closure=lambda: 0.0)
        elif what == "bad_new_scale":
            scaler.step(opt)
            scaler.update(torch.ones(2))

    for what in ["step_before_scale", "update_before_scale", "unscale_twice", "unscale_after_step", "step_twice",
                 "update_without_checks", "fp16_grads", "closure", "bad_new_scale"]:
        errors = {}
        for kind in SCALERS:
            with pytest.raises(Exception) as info:
                scenario(kind, what)
            errors[kind] = info.value
        assert str(errors["ampkit"]) == str(errors["torch"]), what
        assert isinstance(errors["ampkit"], type(errors["torch"])), (what, type(errors["ampkit"]))

    for kwargs, msg in [(dict(growth_factor=1.0), "The growth factor must be > 1.0."),
                        (dict(backoff_factor=1.0), "The backoff factor must be < 1.0.")]:
        for kind in SCALERS:
            with pytest.raises(AssertionError, match=msg):
                SCALERS[kind]("cpu", **kwargs)


def test_disabled_scaler_is_a_pass_through():
    scaler = ampkit.GradScaler("cpu", enabled=False)
    t = torch.ones(2)
    assert scaler.scale(t) is t
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), math.inf)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.step(opt)
    assert math.isinf(p[0].item())  # no check when disabled, as torch
    no_cuda = pytest.warns(UserWarning, match="CUDA is not available")
    with no_cuda if not torch.cuda.is_available() else warnings.catch_warnings():
        ampkit.GradScaler("cuda")


def test_scale_nested_outputs_like_torch():
    for kind in SCALERS:
        scaler = SCALERS[kind]("cpu", init_scale=4.0)
        out = scaler.scale([torch.ones(2), (torch.full((1,), 2.0), torch.zeros(1))])
        assert isinstance(out, list) and isinstance(out[1], tuple)
        assert out[0].tolist() == [4.0, 4.0] and out[1][0].item() == 8.0
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        ampkit.GradScaler("cpu").scale([1.0])


@pytest.mark.parametrize("device", DEVICES)
def test_hysteresis_tolerates_overflows_until_the_nth_since_growth(device):
    scaler = ampkit.GradScaler(device, init_scale=1024.0, growth_interval=3, hysteresis=3)
    #             overflow: x  x  x  .  .  .  x  x  .  x  x
    history = drive_scaler(scaler, [1, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1], device=device)
    assert history == [1024, 1024, 512, 512, 512, 1024, 1024, 1024, 1024, 512, 256]
    stats = scaler.stats()
    assert stats["skipped_steps"] == 7 and stats["steps"] == 11 and stats["last_overflow_step"] == 11
    # hysteresis=1 is torch's rule
    overflows = [1, 1, 0, 0, 0, 1]
    h1 = drive_scaler(ampkit.GradScaler(device, init_scale=1024.0, growth_interval=3), overflows, device=device)
    ht = drive_scaler(torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=3), overflows, device=device)
    assert h1 == ht


def test_min_and_max_scale_bound_the_scale_and_warn_once():
    scaler = ampkit.GradScaler("cpu", init_scale=8.0, min_scale=2.0, growth_interval=1, max_scale=16.0)
    with pytest.warns(UserWarning, match="min_scale") as record:
        history = drive_scaler(scaler, [1, 1, 1, 1, 1])
    assert history == [4.0, 2.0, 2.0, 2.0, 2.0]
    assert len([w for w in record if "min_scale" in str(w.message)]) == 1
    assert drive_scaler(scaler, [0, 0, 0, 0]) == [4.0, 8.0, 16.0, 16.0]
    raising = ampkit.GradScaler("cpu", init_scale=2.0, min_scale=2.0, raise_at_min_scale=True)
    with pytest.raises(RuntimeError, match="min_scale"):
        drive_scaler(raising, [1])


def test_fixed_scale_mode_checks_and_skips_without_scaling():
    scaler = ampkit.GradScaler("cpu", scaling=False)
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=0.5)
    loss = scaler.scale(p.float().sum())
    assert loss.item() == 4.0  # scale fixed at 1
    loss.backward()
    p.grad[0] = math.nan
    scaler.step(opt)
    scaler.update()
    assert p.tolist() == [1.0] * 4  # skipped
    assert scaler.get_scale() == 1.0 and scaler.stats()["skipped_steps"] == 1
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(p.float().sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert p.tolist() == [-0.5] * 4 and scaler.get_scale() == 1.0


def test_overflow_report_names_the_parameters():
    model = make_model("cpu")
    scaler = ampkit.GradScaler("cpu", overflow_report=True)
    scaler.name_parameters(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches("cpu", 1)[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    model[0].weight.grad[3, 3] = math.nan
    model[2].bias.grad[-1] = math.inf
    scaler.step(opt)
    scaler.update()
    assert scaler.overflow_report() == ["0.weight", "2.bias"]
    opt.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.overflow_report() == []
    with pytest.raises(RuntimeError, match="overflow_report=True"):
        ampkit.GradScaler("cpu").overflow_report()


@CUDA_ONLY
def test_cuda_fused_step_makes_no_host_sync():
    model = make_model("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = ampkit.GradScaler("cuda")
    x, y = batches("cuda", 1)[0]
    for i in range(3):
        opt.zero_grad(set_to_none=False)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if i == 0:  # first step allocates the scaler's buffers
            scaler.step(opt)
            scaler.update()
            continue
        allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.step(opt)
            scaler.update()
            ran = scaler.last_step_ran()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # Nothing allocated on the device by the step after the first.
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocated
    assert ran.item()


@CUDA_ONLY
def test_cuda_bf16_grads_are_checked_and_skipped():
    p = torch.nn.Parameter(torch.ones(1000, device="cuda", dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ampkit.GradScaler("cuda", init_scale=8.0)
    scaler.scale(p.float().sum()).backward()
    p.grad[-1] = math.inf
    scaler.step(opt)
    scaler.update()
    assert (p == 1).all().item() and scaler.get_scale() == 4.0


def test_sparse_gradients_like_torch():
    """Sparse grads (nn.Embedding(sparse=True)) are unscaled through their values, FP16 ones coalesced first."""
    results = {}
    for kind in SCALERS:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(50, 8, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler = SCALERS[kind]("cpu", init_scale=64.0)
        for step in range(4):
            opt.zero_grad()
            idx = torch.tensor([[1, 2, 2, 7], [7, 3, 1, 1]])
            scaler.scale(emb(idx).square().sum()).backward()
            if step == 2:
                emb.weight.grad._values()[0, 0] = math.inf
            scaler.step(opt)
            scaler.update()
        results[kind] = (emb.weight.detach().clone(), scaler.get_scale())
    assert bits_equal(results["ampkit"][0], results["torch"][0])
    assert results["ampkit"][1] == results["torch"][1] == 32.0


# ---- static loss scale, minimize ----------------------------------------------------------------------------

def test_static_loss_scale_never_changes_and_still_skips_and_counts_overflows():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ampkit.GradScaler("cpu", init_scale=128.0, growth_interval=2, dynamic=False)
    overflow_steps = {3, 4, 9}
    for step in range(12):
        before = p.detach().clone()
        opt.zero_grad()
        loss = (p * torch.randn(8)).sum()
        if step in overflow_steps:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 128.0
        assert torch.equal(p.detach(), before) == (step in overflow_steps)
    stats = scaler.stats()
    assert stats["steps"] == 12 and stats["skipped_steps"] == 3 and stats["last_overflow_step"] == 10
    state = scaler.state_dict()
    assert state["dynamic"] is False and state["scale"] == 128.0
    dynamic = ampkit.GradScaler("cpu")
    before = dynamic.state_dict()
    with pytest.raises(ValueError, match="the state is of a static-scale scaler, but this scaler is dynamic"):
        dynamic.load_state_dict(state)
    assert dynamic.state_dict() == before
    with pytest.raises(RuntimeError, match="this scaler has a static loss scale"):
        scaler.scale(torch.ones(1))
        scaler.update(64.0)
    again = pickle.loads(pickle.dumps(ampkit.GradScaler("cpu", init_scale=32.0, dynamic=False)))
    assert again.state_dict()["dynamic"] is False and again.get_scale() == 32.0
    torch.amp.GradScaler("cpu").load_state_dict(state)  # torch's scaler takes it (its keys are there)


def _accumulation_run(minimize: bool, micro_batches: int):
    torch.manual_seed(1)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = ampkit.GradScaler("cpu", init_scale=1024.0) if micro_batches else None
    data = torch.randn(5, 8, 6), torch.randn(5, 8, 3)
    for x, y in zip(*data):
        opt.zero_grad()
        if scaler is None:  # one large batch, FP32, no scaler: the reference
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            continue
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = torch.nn.functional.mse_loss(model(xs), ys) / micro_batches
            scaler.scale(loss).backward()
        if minimize:
            scaler.minimize(opt, loss)
        else:
            scaler.step(opt)
            scaler.update()
    return [p.detach() for p in model.parameters()], scaler


def test_minimize_is_step_then_update_and_accumulation_equals_one_large_batch():
    stepped, s1 = _accumulation_run(minimize=False, micro_batches=4)
    minimized, s2 = _accumulation_run(minimize=True, micro_batches=4)
    assert all(torch.equal(a, b) for a, b in zip(stepped, minimized))
    assert s1.state_dict() == s2.state_dict()
    # 4 micro-batches of 2 with the scaler = one batch of 8 without it, up to summation order (power-of-2 scales
    # are exact): rtol 1e-6.
    reference, _ = _accumulation_run(minimize=False, micro_batches=0)
    for a, b in zip(minimized, reference):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match="GradScaler.minimize: optimizer must be a torch.optim.Optimizer"):
        s1.minimize("sgd")
    with pytest.raises(TypeError, match="GradScaler.minimize: scaled_loss must be a Tensor or None"):
        s1.minimize(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), 1.0)


def test_torchs_private_members_have_torchs_meaning():
    ours, theirs = ampkit.GradScaler("cpu", init_scale=512.0), torch.amp.GradScaler("cpu", init_scale=512.0)
    for s in (ours, theirs):
        assert s._scale is None and s._growth_tracker is None
        assert s._init_scale == 512.0 and s._init_growth_tracker == 0
    sd = {**theirs.state_dict(), "scale": 8.0, "_growth_tracker": 3}
    for s in (ours, theirs):
        s.load_state_dict(sd)
        assert s._init_scale == 8.0 and s._init_growth_tracker == 3 and s._scale is None
        # Accelerate's FSDP2 resume: load_state_dict, then the device state created ahead of scale()
        s._lazy_init_scale_growth_tracker(torch.device("cpu"))
    for name, dtype in (("_scale", torch.float32), ("_growth_tracker", torch.int32)):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype == dtype and a.shape == b.shape == () and a.device == b.device
        assert a.item() == b.item()
    assert ours._scale.item() == 8.0 and ours._growth_tracker.item() == 3
    ours._lazy_init_scale_growth_tracker("cpu")  # exists there: a no-op
    with pytest.raises(ValueError, match=r"_lazy_init_scale_growth_tracker: the scaler's state is already on cpu, "
                                         r"but got device cuda"):
        ours._lazy_init_scale_growth_tracker("cuda")
    assert ours.get_scale() == 8.0
    # found_inf per device, as torch's, after an unscale with an Inf in the last element of the last grad
    for s in (ours, theirs):
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s.scale(model(torch.randn(4, 3)).sum()).backward()
        model.bias.grad.view(-1)[-1] = float("inf")
        s.unscale_(opt)
        found = s._found_inf_per_device(opt)
        assert list(found) == [torch.device("cpu")] and found[torch.device("cpu")].item() == 1.0
    disabled = ampkit.GradScaler("cpu", enabled=False)
    disabled.scale(torch.ones(()))
    assert disabled._scale is None and disabled._growth_tracker is None


class _Wrapper:
    """A framework's optimizer wrapper (Accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer): it
    shares the wrapped optimizer's param_groups and steps it."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, *args, **kwargs):
        return self.optimizer.step(*args, **kwargs)


@pytest.mark.parametrize("opt_cls", [ampkit.optim.AdamW, torch.optim.SGD], ids=["fused", "torch"])
def test_a_wrapper_sharing_param_groups_is_the_same_optimizer_to_the_scaler(opt_cls):
    def run(wrap):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3)
        opt = opt_cls(model.parameters(), lr=0.1)
        scaler = ampkit.GradScaler("cpu", init_scale=64.0)
        for step in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.randn(4, 5)).square().mean()).backward()
            if step == 1:
                scaler.unscale_(_Wrapper(opt) if wrap else opt)  # then step(): no second unscale
            scaler.step(_Wrapper(opt) if wrap else opt)
            scaler.update()
        return model, scaler

    wrapped, wscaler = run(True)
    plain, pscaler = run(False)
    for a, b in zip(wrapped.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    assert wscaler.state_dict() == pscaler.state_dict()


def test_an_unscale_refused_for_an_overlapping_grad_leaves_the_scaler_as_it_was():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampkit.GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    good = model.weight.grad.clone()
    model.weight.grad = torch.ones(1, 4).expand(3, 4)  # every row the same memory
    with pytest.raises(RuntimeError, match="overlap"):
        scaler.unscale_(opt)
    assert not scaler._core.in_iteration()
    assert torch.equal(model.weight.grad, torch.ones(3, 4))  # nothing written
    model.weight.grad = good.clone()
    scaler.unscale_(opt)  # not "already been called"
    assert torch.equal(model.weight.grad, good / 8.0)


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


def test_overflow_report_never_names_a_parameter_that_no_longer_exists():
    scaler = ampkit.GradScaler("cpu", overflow_report=True)
    for trial in range(30):
        old = torch.nn.Linear(4, 4)
        scaler.name_parameters((f"deleted_model_{trial}.{n}", p) for n, p in old.named_parameters())
        del old
        new = torch.nn.Linear(4, 4)  # often allocated where the deleted model's tensors were
        opt = torch.optim.SGD(new.parameters(), lr=0.1)
        scaler.scale(new(torch.ones(1, 4)).sum()).backward()
        new.weight.grad[0, 0] = math.inf
        scaler.step(opt)
        scaler.update()
        report = scaler.overflow_report()
        assert report and not any("deleted_model" in name for name in report), report


def test_soak_ampkit_and_torch_scalers_in_lockstep_with_random_overflows():
    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model_b = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model_b.load_state_dict(model_a.state_dict())
    opt_a = torch.optim.SGD(model_a.parameters(), lr=1e-2, momentum=0.9)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=1e-2, momentum=0.9)
    ours = ampkit.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    gen = torch.Generator().manual_seed(1)
    for step in range(2000):
        x = torch.randn(4, 8, generator=gen)
        inject = torch.rand((), generator=gen).item() < 0.05
        for model, opt, scaler in ((model_a, opt_a, ours), (model_b, opt_b, theirs)):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            if inject:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        assert ours.get_scale() == theirs.get_scale(), step
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)
    assert ours.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"]
