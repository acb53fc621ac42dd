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


def test_a_skipped_first_step_in_remainder_mode_writes_no_weight():
    # State is created lazily inside step(); splitting an FP32 master into weight + remainder must not rewrite
    # the weight (exact ties used to be re-rounded away from zero), since the scaler may skip that very step.
    torch.manual_seed(4)
    n = 1 << 18
    w32 = torch.randn(n)
    w32.view(torch.int32)[:500] = (w32.view(torch.int32)[:500] & ~0xFFFF) | 0x8000  # exact BF16 ties
    p = torch.nn.Parameter(w32.clone())
    opt = ampkit.optim.AdamW([p], master_weights="remainder")
    opt.init_master_params()
    p.data = p.data.to(torch.bfloat16)
    before = p.detach().clone()
    p.grad = torch.randn(n).to(torch.bfloat16)
    scaler = ampkit.GradScaler("cpu")
    scaler.scale(torch.zeros((), requires_grad=True))  # creates the scale
    p.grad[-1] = math.inf
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach().view(torch.int16), before.view(torch.int16))
    master = opt.master_from_remainder(p, opt.state[p]["param_remainder"])
    ulps = (master.view(torch.int32).long() - w32.view(torch.int32).long()).abs()
    tie = (w32.view(torch.int32) & 0xFFFF) == 0x8000
    assert ulps.max().item() <= 1 and ulps[~tie].max().item() == 0  # exact but at ties rounded to even below


def _adamw(params, grads, masters, exp_avgs, exp_avg_sqs, steps, **kw):
    torch.ops.ampkit.adamw_step_(params, grads, masters, [], exp_avgs, exp_avg_sqs, [], steps, lr=1e-3, beta1=0.9,
                                 beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                                 decoupled_weight_decay=True, **kw)


def test_ops_refuse_aliased_outputs_and_change_nothing():
    p = torch.randn(8)
    g = torch.randn(8)
    m, v, m2, v2 = (torch.zeros(8) for _ in range(4))
    s, s2 = torch.zeros(1), torch.zeros(1)
    before = p.clone()
    with pytest.raises(RuntimeError, match=r"adamw_step_: params\[0\] and params\[1\] share memory"):
        _adamw([p, p], [g, g.clone()], [], [m, m2], [v, v2], [s, s2])
    with pytest.raises(RuntimeError, match=r"adamw_step_: grads\[0\] and grads\[1\] share memory"):
        _adamw([p, p.clone()], [g, g], [], [m, m2], [v, v2], [s, s2])  # grads are stored back unscaled
    with pytest.raises(RuntimeError, match="share memory"):  # a moment aliasing another one
        _adamw([p], [g], [], [m], [m], [s])
    half = torch.randn(8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="share memory"):  # a master aliasing a moment
        torch.ops.ampkit.adamw_step_([half], [half.clone()], [m], [], [m], [v], [], [s], lr=1e-3, beta1=0.9,
                                     beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                                     decoupled_weight_decay=True)
    assert torch.equal(p, before) and torch.equal(m, torch.zeros(8)) and s.item() == 0.0
    buf = torch.randn(10)
    keep = buf.clone()
    with pytest.raises(RuntimeError, match=r"grads\[0\] and grads\[1\] share memory"):
        torch.ops.ampkit.unscale_and_check_([buf[:6], buf[4:]], torch.zeros(1), torch.full((1,), 0.5))
    assert torch.equal(buf, keep)
    both = torch.tensor([0.0, 0.5])
    with pytest.raises(RuntimeError, match="found_inf and inv_scale share memory|inv_scale and found_inf share"):
        torch.ops.ampkit.unscale_and_check_([torch.randn(4)], both[:1], both[:1])


def test_interleaved_views_of_one_buffer_are_distinct_tensors():
    buf = torch.randn(4, 6)
    ref = buf.clone()
    found = torch.zeros(1)
    torch.ops.ampkit.unscale_and_check_([buf[:, ::2], buf[:, 1::2]], found, torch.full((1,), 0.5))
    assert torch.equal(buf, ref * 0.5) and found.item() == 0.0


@pytest.mark.parametrize("bad,match", [
    (dict(scale=1.0), "must lie in \\[min_scale, max_scale\\]"),
    (dict(scale=1e9), "must lie in \\[min_scale, max_scale\\]"),
    (dict(scale=1e39), "that a float32 holds"),
    (dict(growth_factor=1.0), "'growth_factor' must be a finite number > 1"),
    (dict(backoff_factor=1.5), "'backoff_factor' must be in \\(0, 1\\)"),
    (dict(growth_interval=0), "'growth_interval' must be in"),
])
def test_scaler_load_state_dict_rejects_what_the_constructor_rejects_and_changes_nothing(bad, match):
    scaler = ampkit.GradScaler("cpu", init_scale=64.0, min_scale=2.0, max_scale=1e6, growth_interval=9)
    state = dict(scaler.state_dict(), **bad)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=match):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


def test_a_fixed_scale_scaler_refuses_a_scaled_state():
    scaled = ampkit.GradScaler("cpu").state_dict()
    fixed = ampkit.GradScaler("cpu", scaling=False)
    with pytest.raises(ValueError, match="scaling=False"):
        fixed.load_state_dict(scaled)
    assert fixed.get_scale() == 1.0


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


def _saved_adamw():
    p = torch.nn.Parameter(torch.randn(6, dtype=torch.bfloat16))
    opt = ampkit.optim.AdamW([p])
    p.grad = torch.randn(6, dtype=torch.bfloat16)
    opt.step()
    return opt.state_dict()


@pytest.mark.parametrize("corrupt,match", [
    (lambda sd: sd["state"][0].update(master_param=torch.zeros(5)), "must have the parameter's shape"),
    (lambda sd: sd["state"][0].pop("exp_avg_sq"), "partial state"),
    (lambda sd: sd["state"][0].pop("step"), "partial state"),
    (lambda sd: sd["state"][0].update(exp_avg=torch.zeros(6, dtype=torch.int32)), "must be a floating tensor"),
    (lambda sd: sd["state"].update({7: {"step": torch.zeros(())}}), "no param group of the state dict holds"),
])
def test_optimizer_load_state_dict_refuses_what_cannot_be_right_and_changes_nothing(corrupt, match):
    sd = _saved_adamw()
    corrupt(sd)
    p = torch.nn.Parameter(torch.randn(6, dtype=torch.bfloat16))
    opt = ampkit.optim.AdamW([p], lr=5e-4)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert len(opt.state) == 0 and opt.param_groups[0]["lr"] == 5e-4


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make,what", [
    (lambda: torch.eye(3).to_sparse_csr(), "layout SparseCsr"),
    (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), "a quantized tensor"),
    (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), "a nested tensor"),
])
def test_non_strided_layouts_get_an_error_that_names_the_argument(make, what):
    good = torch.randn(2)
    keep = good.clone()
    with pytest.raises(RuntimeError, match=rf"ampkit::unscale_and_check_: grads\[1\] must be a strided .*{what}"):
        torch.ops.ampkit.unscale_and_check_([good, make()], torch.zeros(1), torch.full((1,), 0.5))
    assert torch.equal(good, keep)


def test_unclear_python_errors_are_now_clear():
    with pytest.raises(TypeError, match="fp32_ops must be a list of op names"):
        ampkit.autocast("cpu", fp32_ops="softmax")
    with pytest.raises(ValueError, match="in both fp32_ops and lowp_ops"):
        with ampkit.autocast("cpu", fp32_ops=["softmax"], lowp_ops=["aten::softmax"]):
            pass
    with pytest.raises(RuntimeError, match="never entered"):
        ampkit.autocast("cpu", fp32_ops=["softmax"]).__exit__(None, None, None)
    with pytest.raises(ValueError, match="growth_interval must be an int"):
        ampkit.GradScaler("cpu", growth_interval=2**64)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        ampkit.GradScaler("cpu", process_group=42)
    with pytest.raises(ValueError, match="betas must be a pair|Invalid beta"):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = ampkit.optim.Adam([p])
        opt.param_groups[0]["betas"] = (0.9,)
        p.grad = torch.ones(2)
        opt.step()


def test_register_autocast_on_an_aten_op_says_it_is_process_wide():
    with pytest.warns(UserWarning, match="changes plain torch.autocast"):
        ampkit.register_autocast("aten::relu", "cpu", "fp32")
    ampkit.register_autocast("aten::relu", "cpu", "promote")  # relu: no cast, as ATen


def test_import_refuses_a_torch_other_than_the_one_ampkit_was_built_for():
    assert ampkit._BUILT_TORCH.split("+")[0] == torch.__version__.split("+")[0]
    with pytest.raises(ImportError, match=r"built against torch 2\.13\.0, but torch 2\.11\.0\+cu130 is running"):
        ampkit._check_torch_version("2.11.0+cu130", "2.13.0")
    ampkit._check_torch_version("2.13.0+cu130", "2.13.0")  # local build tags do not matter


def test_decorate_owns_only_the_optimizers_parameters_validates_excluded_and_runs_once():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    opt = ampkit.optim.AdamW(model[2].parameters())  # a subset of the model
    with pytest.raises(ValueError, match="excluded names 'nope'"):
        ampkit.decorate(model, opt, excluded=["nope"])
    with pytest.raises(TypeError, match="excluded takes module names"):
        ampkit.decorate(model, opt, excluded=[42])
    assert model[0].weight.dtype == torch.float32 and len(opt.state) == 0  # the failed calls changed nothing
    ampkit.decorate(model, opt, level="O2")
    assert model[0].weight.dtype == torch.bfloat16  # CPU: BF16 when no dtype is given
    assert set(opt.state) == set(model[2].parameters())
    opt.state_dict()  # no state for parameters the optimizer does not own
    with pytest.raises(RuntimeError, match="already decorated"):
        ampkit.decorate(model, opt)


def test_decorate_warns_when_masters_would_copy_rounded_weights():
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt = ampkit.optim.AdamW(model.parameters())
    with pytest.warns(UserWarning, match="copies of rounded weights"):
        ampkit.decorate(model, opt)
