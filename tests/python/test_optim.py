"""ampkit.optim (fused Adam/AdamW/SGD with FP32 masters): against torch.optim on FP32 for every option, BF16/FP16
params against a pure-FP32 run, bit-identical skipped steps, state_dict round trips, bad input, and the ops
under opcheck and both grad scalers."""
from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

import ampkit
from conftest import DEVICES, bits_equal
from factories import grads_for, make_params
from loops import step_in_lockstep

ADAM_OPTIONS = [dict(weight_decay=wd, amsgrad=ams, maximize=mx)
                for wd, ams, mx in itertools.product([0.0, 0.1], [False, True], [False, True])]
SGD_OPTIONS = [dict(momentum=0.0), dict(momentum=0.9), dict(momentum=0.9, dampening=0.2, weight_decay=0.01),
               dict(momentum=0.9, nesterov=True, weight_decay=0.01), dict(momentum=0.5, maximize=True)]
CASES = ([(ampkit.optim.AdamW, torch.optim.AdamW, o) for o in ADAM_OPTIONS]
         + [(ampkit.optim.Adam, torch.optim.Adam, o) for o in ADAM_OPTIONS]
         + [(ampkit.optim.SGD, torch.optim.SGD, o) for o in SGD_OPTIONS])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ours,theirs,options", CASES,
                         ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(CASES)])
def test_fp32_matches_torch_optim(device, ours, theirs, options):
    a_params = make_params(device)
    t_params = [p.detach().clone().requires_grad_() for p in a_params]
    lr = 1e-2
    a = ours(a_params, lr=lr, **options)
    t = theirs(t_params, lr=lr, **options)
    step_in_lockstep([(a_params, a), (t_params, t)], range(60))
    for p, q in zip(a_params, t_params):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6)
    for p, q in zip(a_params, t_params):
        for key, value in t.state[q].items():
            if torch.is_tensor(value) and value.numel() > 0 and key in a.state[p]:
                torch.testing.assert_close(a.state[p][key].to(value.dtype), value, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls,options", [(ampkit.optim.AdamW, dict(weight_decay=0.1)),
                                         (ampkit.optim.SGD, dict(momentum=0.9))])
def test_low_precision_params_follow_the_fp32_run_through_their_masters(device, dtype, cls, options):
    lp_params = make_params(device, dtype)
    fp_params = [p.detach().float().requires_grad_() for p in lp_params]
    lp = cls(lp_params, lr=1e-2, **options)
    fp = cls(fp_params, lr=1e-2, **options)
    # the same (rounded) grad values for both
    step_in_lockstep([(lp_params, lp, lambda g: g.to(dtype)), (fp_params, fp, lambda g: g.to(dtype).float())],
                     range(40), grads=lambda params, step: grads_for(params, step, torch.float32))
    for p, q in zip(lp_params, fp_params):
        master = lp.state[p]["master_param"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, q.detach(), rtol=1e-6, atol=1e-7)
        assert bits_equal(p.detach(), master.to(dtype))  # the weight is the master rounded once


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls,options", [(ampkit.optim.AdamW, dict(amsgrad=True)),
                                         (ampkit.optim.SGD, dict(momentum=0.9, dampening=0.5))])
def test_skipped_steps_change_nothing_even_the_first(device, cls, options):
    params = make_params(device, torch.bfloat16)
    opt = cls(params, lr=0.1, **options)
    found = torch.ones((), device=device)
    for step in range(3):
        for p, g in zip(params, grads_for(params, step)):
            p.grad = g
        if step == 1:
            opt.found_inf = torch.zeros((), device=device)
            opt.step()  # one real step in between
            del opt.found_inf
            continue
        before = copy.deepcopy(([p.detach().clone() for p in params], opt.state_dict()))
        opt.found_inf = found
        opt.step()
        del opt.found_inf
        after = ([p.detach() for p in params], opt.state_dict())
        for x, y in zip(before[0], after[0]):
            assert bits_equal(x, y)
        for pid, st in after[1]["state"].items():
            for key, value in st.items():
                if step == 0:  # the state created lazily on a skipped first step is the initial state
                    assert value.count_nonzero().item() == 0 or key == "master_param"
                else:
                    assert bits_equal(value, before[1]["state"][pid][key]), key


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip_continues_bit_identically_and_stays_fp32(device):
    params = make_params(device, torch.bfloat16)
    opt = ampkit.optim.AdamW(params, lr=1e-2)
    step_in_lockstep([(params, opt)], range(5))
    clone_params = [p.detach().clone().requires_grad_() for p in params]
    clone = ampkit.optim.AdamW(clone_params, lr=1e-2)
    clone.load_state_dict(copy.deepcopy(opt.state_dict()))
    for st in clone.state.values():
        assert all(v.dtype == torch.float32 for v in st.values())
    step_in_lockstep([(params, opt), (clone_params, clone)], range(5, 10))
    for p, q in zip(params, clone_params):
        assert bits_equal(p.detach(), q.detach())
        assert bits_equal(opt.state[p]["master_param"], clone.state[q]["master_param"])


def test_loads_a_torch_optimizer_state_dict():
    params = make_params("cpu")
    t = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in params], lr=1e-2)
    tp = t.param_groups[0]["params"]
    step_in_lockstep([(tp, t)], range(4))
    a_params = [p.detach().clone().requires_grad_() for p in tp]
    a = ampkit.optim.AdamW(a_params, lr=1e-2)
    a.load_state_dict(t.state_dict())
    step_in_lockstep([(a_params, a), (tp, t)], range(4, 8))
    for p, q in zip(a_params, tp):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6)


def _op_args(device="cpu", n=3, dtype=torch.bfloat16):
    params = [torch.randn(10 + i, device=device, dtype=dtype) for i in range(n)]
    grads = [torch.randn_like(p) for p in params]
    f32 = lambda: [torch.zeros(p.shape, device=device) for p in params]  # noqa: E731
    masters = [p.float() for p in params]
    steps = [torch.zeros((), device=device) for _ in params]
    return params, grads, masters, [], f32(), f32(), [], steps


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a[1].pop(), "grads must have 3 tensors"),
    (lambda a: a[2].__setitem__(1, a[2][1].half()), r"master_params\[1\] must be Float"),
    (lambda a: a[4].__setitem__(2, torch.zeros(3)), r"exp_avgs\[2\] must have the shape and strides of params\[2\]"),
    (lambda a: a[1].__setitem__(0, a[1][0].half()),
     r"grads\[0\] must be BFloat16 or Float like params\[0\], but got Half"),
    (lambda a: a[7].__setitem__(0, torch.zeros(2)), r"state_steps\[0\] must be a one-element Float tensor"),
    (lambda a: a[3].extend(torch.zeros(p.shape, dtype=torch.int16) for p in a[0]), "not both"),
    (lambda a: a[0].__setitem__(2, a[0][2].to(torch.int32)), r"params\[2\] must be Half, BFloat16 or Float"),
])
def test_adamw_step_bad_input_raises_before_writing(mutate, message):
    args = list(_op_args())
    args = [list(x) for x in args]
    mutate(args)
    before = copy.deepcopy(args)
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        torch.ops.ampkit.adamw_step_(*args, lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
                                     amsgrad=False, maximize=False, decoupled_weight_decay=True)
    for xs, ys in zip(args, before):
        for x, y in zip(xs, ys):
            assert bits_equal(x, y)


def test_bad_hyper_parameters_raise():
    with pytest.raises(ValueError, match="Invalid learning rate"):
        ampkit.optim.AdamW(make_params("cpu"), lr=-1.0)
    with pytest.raises(ValueError, match="Nesterov momentum requires"):
        ampkit.optim.SGD(make_params("cpu"), lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="beta1 must be in"):
        torch.ops.ampkit.adamw_step_(*_op_args(), lr=0.1, beta1=1.5, beta2=0.999, weight_decay=0.0, eps=1e-8,
                                     amsgrad=False, maximize=False, decoupled_weight_decay=True)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_optimizer_ops(device):
    args = _op_args(device)
    gs = torch.full((), 4.0, device=device)
    fi = torch.zeros((), device=device)
    torch.library.opcheck(torch.ops.ampkit.adamw_step_.default, args,
                          dict(lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
                               maximize=False, decoupled_weight_decay=True, grad_scale=gs, found_inf=fi,
                               lr_tensor=torch.full((), 0.05, device=device)))
    params, grads, masters, _, bufs, _, _, steps = _op_args(device)
    torch.library.opcheck(torch.ops.ampkit.sgd_step_.default, (params, grads, masters, [], bufs, steps),
                          dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                               maximize=False, grad_scale=gs, found_inf=fi))


def test_a_cpu_lr_tensor_is_taken_with_parameters_on_another_device():
    # The CUDA op reads a CPU lr_tensor on the host (no host-to-device copy per step); the check, shared by every
    # backend, takes it (here with Meta parameters: the Meta kernel is the check) and still refuses a grad_scale
    # that is not on the parameters' device.
    args = _op_args("meta")
    hp = dict(lr=0.0, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
              decoupled_weight_decay=True)
    torch.ops.ampkit.adamw_step_(*args, **hp, lr_tensor=torch.full((), 1e-3))
    params, grads, masters, _, bufs, _, _, steps = args
    torch.ops.ampkit.sgd_step_(params, grads, masters, [], bufs, steps, lr=0.0, momentum=0.9, dampening=0.0,
                               weight_decay=0.0, nesterov=False, maximize=False, lr_tensor=torch.full((), 1e-3))
    with pytest.raises(RuntimeError, match="grad_scale must be on the device of params"):
        torch.ops.ampkit.adamw_step_(*args, **hp, grad_scale=torch.ones(()))


@pytest.mark.parametrize("scaler_cls", [ampkit.GradScaler, torch.amp.GradScaler])
def test_scalers_drive_the_fused_optimizers_like_unscaled_training(scaler_cls):
    """Power-of-two scales are exact: a scaled run with skipped overflow steps equals an unscaled run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ref = copy.deepcopy(model)
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = ampkit.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = scaler_cls("cpu", init_scale=1024.0, growth_interval=3)
    for step in range(12):
        x = torch.randn(4, 8)
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        overflow = step in (2, 7)
        if overflow:
            model[2].bias.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        if not overflow:
            ref_opt.zero_grad()
            ref(x).square().mean().backward()
            ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert bits_equal(p.detach(), q.detach()), step


def test_init_master_params_keeps_the_unrounded_fp32_weights():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    fp32 = [p.detach().clone() for p in model.parameters()]
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-3)
    opt.init_master_params()
    model.to(torch.bfloat16)
    for p, w in zip(model.parameters(), fp32):
        assert bits_equal(opt.state[p]["master_param"], w)
        assert not bits_equal(p.detach().float(), w)  # the cast rounded the weights; the masters did not
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    opt.step()
    for p in model.parameters():
        assert bits_equal(p.detach(), opt.state[p]["master_param"].to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls,options", [(ampkit.optim.AdamW, dict(weight_decay=0.1)),
                                         (ampkit.optim.SGD, dict(momentum=0.9))])
def test_remainder_mode_holds_the_exact_master_of_the_fp32_master_mode(device, cls, options):
    rem_params = make_params(device, torch.bfloat16)
    ref_params = [p.detach().clone().requires_grad_() for p in rem_params]
    rem = cls(rem_params, lr=1e-2, master_weights="remainder", **options)
    ref = cls(ref_params, lr=1e-2, **options)  # FP32 masters
    step_in_lockstep([(rem_params, rem), (ref_params, ref)], range(30))
    for p, q in zip(rem_params, ref_params):
        master = cls.master_from_remainder(p, rem.state[p]["param_remainder"])
        assert bits_equal(master, ref.state[q]["master_param"])  # exact: same FP32 math, lossless storage
        # The weight is the master rounded (to nearest; ties away from zero): within half a BF16 ulp.
        assert ((p.detach().float() - master).abs() <= master.abs() * 2.0**-8 + 1e-38).all()


def test_remainder_split_is_exact_for_ties_and_extremes():
    special = torch.tensor([1.0, -1.0, 3.4028235e38, -3.4028235e38, 1e-40, 0.0, -0.0, 2.5e-30], dtype=torch.float32)
    ties = (torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7F8000 - 0x10000], dtype=torch.int64)
            .to(torch.int32).view(torch.float32))  # low half exactly 0x8000: odd and even high halves
    g = torch.Generator().manual_seed(0)
    values = torch.cat([special, ties, torch.randn(1000, generator=g) * 1e3])
    p = torch.nn.Parameter(values.clone())
    opt = ampkit.optim.SGD([p], lr=0.0, master_weights="remainder")  # lr 0: the master must not move at all
    opt.init_master_params()
    p.data = p.data.to(torch.bfloat16)
    p.grad = torch.zeros_like(p)
    opt.step()
    master = ampkit.optim.SGD.master_from_remainder(p, opt.state[p]["param_remainder"])
    # Exact, except at exact ties that the cast rounded down (to even): the weight is not rewritten at state
    # creation (a skipped step writes nothing), so those masters sit 1 ulp below the tie, toward the weight.
    tie_down = ((values.view(torch.int32) & 0xFFFF) == 0x8000) & (
        (values.view(torch.int32) >> 16) == p.detach().view(torch.int16).to(torch.int32))
    assert bits_equal(master[~tie_down], values[~tie_down])
    ulps = (master.view(torch.int32).long() - values.view(torch.int32).long()).abs()
    assert tie_down.any() and (ulps[tie_down] == 1).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [ampkit.optim.AdamW, ampkit.optim.SGD])
def test_tensor_lr_equals_float_lr(device, cls):
    a_params = make_params(device)
    b_params = [p.detach().clone().requires_grad_() for p in a_params]
    kwargs = dict(momentum=0.9) if cls is ampkit.optim.SGD else {}
    a = cls(a_params, lr=torch.tensor(0.01, device=device), **kwargs)
    b = cls(b_params, lr=float(torch.tensor(0.01, dtype=torch.float32)), **kwargs)  # the FP32 tensor's value

    def schedule(step):
        if step == 5:  # a schedule changes the tensor in place
            a.param_groups[0]["lr"].fill_(0.005)
            b.param_groups[0]["lr"] = float(torch.tensor(0.005, dtype=torch.float32))

    step_in_lockstep([(a_params, a), (b_params, b)], range(10), before_step=schedule)
    for p, q in zip(a_params, b_params):
        assert bits_equal(p.detach(), q.detach())


def test_a_single_differentiable_group_is_still_checked_before_the_step():
    """differentiable=True runs torch's own formulas; a master_weights that cannot apply is refused first, with one
    group as with several."""
    p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    opt = ampkit.optim.Adam([p], differentiable=True, master_weights=True)
    p.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="master_weights=True needs FP16, BF16 or FP32 parameters"):
        opt.step()
    assert torch.equal(p, torch.zeros(3, dtype=torch.float64)) and not opt.state


def test_a_step_that_refuses_a_later_parameter_leaves_earlier_weights_alone():
    # Completing a remainder from a master rewrites the BF16 weight (a master the weight does not hold is split
    # anew), so every parameter of the group is checked before any state is completed.
    params = [torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16)) for _ in range(2)]
    params.append(torch.nn.Parameter(torch.randn(8)))  # FP32: master_weights="remainder" refuses it
    opt = ampkit.optim.AdamW(params, lr=1e-2, master_weights="remainder")
    for p in params:
        opt.state[p]["master_param"] = p.detach().float() + 0.37
        p.grad = torch.randn_like(p)
    before = [(p.detach().clone(), p._version, opt.state[p]["master_param"].clone()) for p in params]
    with pytest.raises(ValueError, match="needs BFloat16 parameters"):
        opt.step()
    for p, (weight, version, master) in zip(params, before):
        assert bits_equal(p.detach(), weight) and p._version == version
        assert set(opt.state[p]) == {"master_param"} and bits_equal(opt.state[p]["master_param"], master)


@pytest.mark.parametrize("cls,kwargs", [(ampkit.optim.AdamW, dict(amsgrad=True)), (ampkit.optim.Adam, {}),
                                        (ampkit.optim.SGD, dict(momentum=0.9))])
@pytest.mark.parametrize("master", [None, True, False, "remainder", "stochastic", "kahan"])
@pytest.mark.parametrize("first_step_skipped", [True, False])
def test_a_skipped_step_changes_nothing_in_every_master_mode(cls, kwargs, master, first_step_skipped):
    torch.manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in (5, 33, 1000)]
    opt = cls(params, lr=0.1, master_weights=master, **kwargs)
    if master == "remainder":
        opt.init_master_params()
    scaler = ampkit.GradScaler("cpu", init_scale=256.0)
    steps = [True] if first_step_skipped else [False, True]
    for skipped in steps:
        opt.zero_grad()
        scaler.scale(sum(p.float().sum() for p in params)).backward()
        if skipped:
            params[-1].grad[-1] = float("nan")
            before_params = [p.detach().clone() for p in params]
            before_state = {id(p): {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                            for p in params if p in opt.state}
        scaler.step(opt)
        scaler.update()
    for p, b in zip(params, before_params):
        assert torch.equal(p.detach().view(torch.int16), b.view(torch.int16))
    for p in params:
        for key, value in opt.state[p].items():
            if not torch.is_tensor(value):
                continue
            if id(p) in before_state and key in before_state[id(p)]:
                old = before_state[id(p)][key]
                assert torch.equal(value.reshape(-1).view(torch.uint8), old.reshape(-1).view(torch.uint8)), key
            elif key not in ("master_param", "param_remainder", "sr_seed"):  # created lazily on the skipped step
                assert value.count_nonzero().item() == 0, key


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(betas=(0.9, 1.5)), dict(eps=-1e-8), dict(weight_decay=-0.1),
                                 dict(master_weights="remainder"), dict(master_weights="stochastic"),
                                 dict(master_weights="kahan")])
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
