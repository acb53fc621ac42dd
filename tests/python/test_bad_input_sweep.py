"""A bad-input sweep over every op: each argument of a valid call is replaced, one at a time, by something that
cannot work (wrong dtype, shape, device, layout, list length, range, an alias of another argument). Every call must
raise an error that names the op and the argument, and leave every tensor of the call bit for bit as it was."""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import ampkit  # noqa: F401  (registers torch.ops.ampkit)

N = 6


def _f(v=0.0):
    return torch.full((1,), v)


def unscale_call():
    return "unscale_and_check_", dict(grads=[torch.randn(N), torch.randn(N).half()], found_inf=_f(), inv_scale=_f(0.5))


def check_call():
    return "check_finite_", dict(tensors=[torch.randn(N), torch.randn(N).bfloat16()], found_inf=_f())


def update_call():
    return "update_scale_", dict(scale=_f(1024.0), growth_tracker=torch.zeros(1, dtype=torch.int32),
                                 found_inf=_f(1.0), growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


def hysteresis_call():
    return "update_scale_hysteresis_", dict(
        scale=_f(1024.0), growth_tracker=torch.zeros(1, dtype=torch.int32),
        hysteresis_tracker=torch.ones(1, dtype=torch.int32), stats=torch.zeros(4, dtype=torch.long), found_inf=_f(1.0),
        growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2, min_scale=1.0, max_scale=1e6,
        dynamic=True)


def adamw_call():
    params = [torch.randn(N).half(), torch.randn(3, 2).half()]
    return "adamw_step_", dict(
        params=params, grads=[torch.randn_like(p) for p in params], master_params=[p.float() for p in params],
        param_remainders=[], exp_avgs=[torch.zeros(p.shape) for p in params],
        exp_avg_sqs=[torch.zeros(p.shape) for p in params], max_exp_avg_sqs=[],
        state_steps=[torch.zeros(()) for _ in params], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
        amsgrad=False, maximize=False, decoupled_weight_decay=True, grad_scale=_f(4.0), found_inf=_f(0.0),
        lr_tensor=None)


def sgd_call():
    params = [torch.randn(N), torch.randn(2, 3)]
    return "sgd_step_", dict(
        params=params, grads=[torch.randn_like(p) for p in params], master_params=[], param_remainders=[],
        momentum_buffers=[torch.zeros(p.shape) for p in params], state_steps=[torch.ones(()) for _ in params],
        lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, grad_scale=None,
        found_inf=None, lr_tensor=None)


CALLS = [unscale_call, check_call, update_call, hysteresis_call, adamw_call, sgd_call]


def _bad_tensors(t: torch.Tensor):
    """(description, replacement) for one tensor argument."""
    wrong_dtype = torch.int64 if t.is_floating_point() else torch.float32
    yield "wrong dtype", t.to(wrong_dtype)
    yield "wrong device", torch.empty(t.shape, dtype=t.dtype, device="meta")
    if t.numel() == 1:
        yield "two elements", torch.cat([t.reshape(1), t.reshape(1)])
    else:
        yield "wrong shape", t.reshape(-1)[:-1].clone()
    if t.is_floating_point():
        yield "sparse", t.reshape(-1).to_sparse()


def _variants():
    for make in CALLS:
        op, args = make()
        for name, value in args.items():
            if isinstance(value, torch.Tensor):
                for what, bad in _bad_tensors(value):
                    yield pytest.param(make, name, None, bad, id=f"{op}-{name}-{what}")
            elif isinstance(value, list) and value:
                if op.endswith("step_") and name != "params":  # lists paired with params
                    yield pytest.param(make, name, None, value[:-1], id=f"{op}-{name}-too short")
                    yield pytest.param(make, name, None, value + [value[0].clone()], id=f"{op}-{name}-too long")
                for what, bad in _bad_tensors(value[-1]):
                    if what == "wrong shape" and not op.endswith("step_"):
                        continue  # the tensors of unscale/check may have any shape
                    yield pytest.param(make, name, -1, bad, id=f"{op}-{name}[-1]-{what}")
                if name not in ("grads", "tensors") or op == "unscale_and_check_":
                    yield pytest.param(make, name, -1, "alias", id=f"{op}-{name}[-1]-alias of [0]")
            elif isinstance(value, float) and name not in ("min_scale", "max_scale"):
                if name != "dampening":  # torch.optim.SGD takes any finite dampening
                    yield pytest.param(make, name, None, -1.0 if name != "backoff_factor" else 0.0,
                                       id=f"{op}-{name}-out of range")
                yield pytest.param(make, name, None, float("nan"), id=f"{op}-{name}-nan")
            elif isinstance(value, int) and not isinstance(value, bool):
                yield pytest.param(make, name, None, 0, id=f"{op}-{name}-zero")


def _tensors(args):
    for value in args.values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list):
            yield from value


def _snapshot(args):
    return [t.clone() if t.device.type != "meta" and t.layout == torch.strided else None for t in _tensors(args)]


def _same_bits(a, b):
    if a is None:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True


@pytest.mark.parametrize("make,name,index,bad", list(_variants()))
def test_bad_input_names_the_op_and_argument_and_changes_nothing(make, name, index, bad):
    op, args = make()
    if index is None:
        args[name] = bad
    else:
        args[name] = list(args[name])
        args[name][index] = args[name][0] if isinstance(bad, str) else bad
    before = _snapshot(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((RuntimeError, ValueError, TypeError, NotImplementedError)) as info:
            getattr(torch.ops.ampkit, op)(**args)
    message = str(info.value).splitlines()[0]
    assert op in message, message
    arg_names = {name, "found_inf"} if name in ("found_inf",) else {name}
    assert any(n in message for n in arg_names) or "share memory" in message, message
    for b, t in zip(before, _tensors(args)):
        assert _same_bits(b, t), f"{op}: an argument changed although the call failed"


# ---- soak and skip invariants ------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("cls,kwargs", [(ampkit.optim.AdamW, dict(amsgrad=True)), (ampkit.optim.Adam, {}),
                                        (ampkit.optim.SGD, dict(momentum=0.9))])
@pytest.mark.parametrize("master", [None, True, False, "remainder"])
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
            elif key not in ("master_param", "param_remainder"):  # created lazily on the skipped step
                assert value.count_nonzero().item() == 0, key
