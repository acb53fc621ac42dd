"""A bad-input sweep over every op: each argument of a valid call is replaced, one at a time, by something that
cannot work (wrong dtype, shape, device, layout, list length, range, an alias of another argument). Every call must
raise an error that names the op and the argument, and leave every tensor of the call bit for bit as it was."""
from __future__ import annotations

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


def lamb_call():
    params = [torch.randn(N).bfloat16(), torch.randn(3, 2).bfloat16()]
    return "lamb_step_", dict(
        params=params, grads=[torch.randn_like(p) for p in params], master_params=[p.float() for p in params],
        param_remainders=[], exp_avgs=[torch.zeros(p.shape) for p in params],
        exp_avg_sqs=[torch.zeros(p.shape) for p in params], state_steps=[torch.zeros(()) for _ in params],
        lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-6, bias_correction=True, adam_w_mode=True,
        grad_averaging=True, use_nvlamb=False, max_grad_norm=1.0, grad_norm=_f(3.0), grad_scale=_f(4.0),
        found_inf=_f(0.0), lr_tensor=_f(1e-3))


def grad_norm_call():
    return "grad_norm", dict(grads=[torch.randn(N), torch.randn(2, 3).half()], grad_scale=_f(2.0))


CALLS = [unscale_call, check_call, update_call, hysteresis_call, adamw_call, sgd_call, lamb_call, grad_norm_call]


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


# ---- class methods and options: GradScaler, the optimizers, autocast -------------------------------------------

nan = float("nan")
_p = torch.zeros(3, requires_grad=True)

SCALER_OPTIONS = [
    (dict(init_scale="a"), TypeError, "init_scale must be a number"),
    (dict(init_scale=-1.0), ValueError, r"^ampkit\.GradScaler: init_scale must be a finite number > 0"),
    (dict(init_scale=nan), ValueError, "init_scale must be a finite number > 0"),
    (dict(growth_factor="x"), TypeError, "growth_factor must be a number"),
    (dict(backoff_factor=0.0), ValueError, "backoff_factor must be > 0"),
    (dict(growth_interval=0), ValueError,
     r"^ampkit\.GradScaler: growth_interval must be in \[1, 2\^31 - 1\], but got 0"),
    (dict(growth_interval=2**31), ValueError, r"^ampkit\.GradScaler: growth_interval must be in"),
    (dict(growth_interval=2**64), ValueError, "growth_interval must fit a 64-bit int"),
    (dict(hysteresis=1.5), TypeError, "hysteresis must be an int, but got float 1.5"),
    (dict(hysteresis=0), ValueError, r"^ampkit\.GradScaler: hysteresis must be in"),
    (dict(min_scale=nan), ValueError, "min_scale must be a finite number"),
    (dict(min_scale=10.0, max_scale=1.0), ValueError, "max_scale must be >= min_scale"),
    (dict(process_group=42), TypeError, "process_group must be a torch.distributed.ProcessGroup"),
    (dict(scaling="yes"), TypeError, "scaling must be True or False"),
    (dict(overflow_report=3), TypeError, "overflow_report must be True or False"),
    (dict(raise_at_min_scale="x"), TypeError, "raise_at_min_scale must be True or False"),
    (dict(enabled="x"), TypeError, "enabled must be True or False"),
    (dict(device="tpu"), ValueError, "device must be 'cpu' or 'cuda'"),
    (dict(device=3), ValueError, "device must be 'cpu' or 'cuda'"),
]


@pytest.mark.parametrize("kwargs,error,match", SCALER_OPTIONS,
                         ids=lambda v: repr(v)[:40] if isinstance(v, dict) else "")
def test_scaler_options_get_an_error_naming_the_option(kwargs, error, match):
    kwargs = dict(kwargs)
    device = kwargs.pop("device", "cpu")
    with pytest.raises(error, match=match):
        ampkit.GradScaler(device, **kwargs)


def _scaled_scaler():
    s = ampkit.GradScaler("cpu", init_scale=1024.0)
    s.scale(torch.ones(1))
    return s


SCALER_METHODS = [
    ("set_growth_factor", (nan,), ValueError, "set_growth_factor: the growth factor must be a finite number"),
    ("set_growth_factor", ("a",), TypeError, "set_growth_factor: new_factor must be a number"),
    ("set_backoff_factor", (2.0,), ValueError, "set_backoff_factor: the backoff factor must be in"),
    ("set_growth_interval", (-1,), ValueError, "set_growth_interval: growth_interval must be in"),
    ("set_growth_interval", ("a",), TypeError, "set_growth_interval: new_interval must be an int"),
    ("scale", ("loss",), ValueError, "outputs must be a Tensor or an iterable of Tensors"),
    ("scale", ([1, 2],), ValueError, "outputs must be a Tensor or an iterable of Tensors"),
    ("unscale_", ("opt",), TypeError, "unscale_: optimizer must be a torch.optim.Optimizer"),
    ("step", (None,), TypeError, "step: optimizer must be a torch.optim.Optimizer"),
    ("update", ("x",), TypeError, "update: new_scale must be a number"),
    ("update", (nan,), ValueError, r"update\(new_scale\): new_scale must be a finite number > 0"),
    ("update", (-1.0,), ValueError, r"update\(new_scale\): new_scale must be a finite number > 0"),
    ("update", (torch.tensor(-2.0),), ValueError, r"update\(new_scale\): new_scale must be a finite number > 0"),
    ("update", (torch.ones(2),), AssertionError, "new_scale should be a float or a 1-element"),
    ("load_state_dict", (5,), TypeError, "load_state_dict: state_dict must be a dict"),
    ("load_state_dict", ({"scale": "a"},), TypeError, "load_state_dict: 'scale' must be a number"),
    ("name_parameters", (5,), TypeError, "name_parameters: named_parameters must be an iterable"),
    ("name_parameters", ([("a", 1)],), TypeError, r"name_parameters: item 0 must be a \(str, Tensor\) pair"),
    ("load", ("/nonexistent/scaler.pt",), FileNotFoundError, "load: no checkpoint file at"),
]


@pytest.mark.parametrize("method,args,error,match", SCALER_METHODS,
                         ids=[f"{m}-{i}" for i, (m, *_rest) in enumerate(SCALER_METHODS)])
def test_scaler_methods_name_the_method_and_argument_and_change_nothing(method, args, error, match):
    s = _scaled_scaler()
    before = (s.state_dict(), s.stats(), float(s._scale))
    with pytest.raises(error, match=match):
        getattr(s, method)(*args)
    assert (s.state_dict(), s.stats(), float(s._scale)) == before
    # Nothing half-done was left behind: a whole iteration runs after the error.
    p = torch.ones(3, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    s.scale(p.sum()).backward()
    s.step(opt)
    s.update()
    assert s.stats()["steps"] == 1 and torch.equal(p.detach(), torch.full((3,), 0.9))


OPTIMIZER_OPTIONS = [
    ("AdamW", dict(lr="a"), TypeError, "lr must be a number or a 1-element tensor"),
    ("AdamW", dict(lr=nan), ValueError, "Invalid learning rate: nan"),
    ("AdamW", dict(betas=0.9), TypeError, r"betas must be a pair \(beta1, beta2\)"),
    ("AdamW", dict(betas=(0.9,)), ValueError, r"betas must be a pair \(beta1, beta2\)"),
    ("AdamW", dict(betas=(0.9, "b")), TypeError, r"betas\[1\] must be a number"),
    ("AdamW", dict(eps=nan), ValueError, "Invalid epsilon value: nan"),
    ("AdamW", dict(weight_decay=nan), ValueError, "Invalid weight_decay value: nan"),
    ("AdamW", dict(master_weights="bogus"), ValueError, "AdamW: master_weights must be None, True, False or"),
    ("AdamW", dict(amsgrad="x"), TypeError, "AdamW: amsgrad must be True or False"),
    ("Adam", dict(maximize=2), TypeError, "Adam: maximize must be True or False"),
    ("AdamW", dict(write_unscaled_grads=None), TypeError, "AdamW: write_unscaled_grads must be True or False"),
    ("SGD", dict(lr=nan), ValueError, "Invalid learning rate: nan"),
    ("SGD", dict(lr=0.1, momentum=nan), ValueError, "Invalid momentum value: nan"),
    ("SGD", dict(lr=0.1, dampening=nan), ValueError, "Invalid dampening value: nan"),
    ("SGD", dict(lr=0.1, weight_decay="w"), TypeError, "weight_decay must be a number"),
    ("SGD", dict(lr=0.1, master_weights=3), ValueError, "SGD: master_weights must be None, True, False or"),
    # torch.optim's message for a tensor lr of another size, given by the C++ core for every optimizer
    ("AdamW", dict(lr=torch.full((2,), 0.1)), ValueError, "^Tensor lr must be 1-element$"),
    ("SGD", dict(lr=torch.full((2,), 0.1)), ValueError, "^Tensor lr must be 1-element$"),
    ("LAMB", dict(lr=torch.zeros(0)), ValueError, "^Tensor lr must be 1-element$"),
    ("SGD", dict(lr=torch.tensor([0.1j])), ValueError, "Tensor lr must be a 1-element real tensor"),
]


@pytest.mark.parametrize("cls,kwargs,error,match", OPTIMIZER_OPTIONS,
                         ids=[f"{c}-{i}" for i, (c, *_rest) in enumerate(OPTIMIZER_OPTIONS)])
def test_optimizer_options_are_refused_in_the_constructor_and_in_add_param_group(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        getattr(ampkit.optim, cls)([_p], **kwargs)
    opt = getattr(ampkit.optim, cls)([_p], lr=0.1)
    if not set(kwargs) <= set(opt.defaults):
        return  # a constructor-only option
    before = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
    with pytest.raises(error, match=match):
        opt.add_param_group(dict(params=[torch.zeros(2, requires_grad=True)], **kwargs))
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups] == before


@pytest.mark.parametrize("value", [-0.0003, -1e-05, -0.5, -3e-17, -1e16, -1e15, -123456789.0, float("-inf")])
@pytest.mark.parametrize("key", ["lr", "eps", "weight_decay"])
def test_optimizer_range_errors_spell_numbers_as_torch_does(key, value):
    # torch.optim prints the Python float (its repr: 0.0003, 1e-05, 1e+16); the C++ core spells it the same way.
    def message(cls) -> str:
        with pytest.raises(ValueError) as info:
            cls([_p], **{key: value})
        return str(info.value)

    assert message(ampkit.optim.AdamW) == message(torch.optim.AdamW)


AUTOCAST_OPTIONS = [
    (dict(device_type="tpu"), ValueError, "ampkit.autocast: device_type must be 'cpu' or 'cuda'"),
    (dict(device_type="cpu", dtype=torch.float64), ValueError, "ampkit.autocast: dtype must be torch.float16"),
    (dict(device_type="cpu", enabled="x"), TypeError, "ampkit.autocast: enabled must be True or False"),
    (dict(device_type="cpu", cache_enabled=3), TypeError, "ampkit.autocast: cache_enabled must be True, False"),
    (dict(device_type="cpu", fp32_ops="softmax"), TypeError, "ampkit.autocast: fp32_ops must be a list of op names"),
    (dict(device_type="cpu", lowp_ops=5), TypeError, "ampkit.autocast: lowp_ops must be a list of op names"),
    (dict(device_type="cpu", fp32_ops=["softmax"], lowp_ops=["softmax"]), ValueError,
     "'softmax' is in both fp32_ops and lowp_ops"),
    (dict(device_type="cpu", fp32_ops=["nope"]), ValueError, "no operator named 'aten::nope'"),
]


@pytest.mark.parametrize("kwargs,error,match", AUTOCAST_OPTIONS,
                         ids=lambda v: repr(v)[:50] if isinstance(v, dict) else "")
def test_autocast_options_get_an_error_and_leave_autocast_as_it_was(kwargs, error, match):
    before = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled())
    with pytest.raises(error, match=match):
        with ampkit.autocast(**kwargs):
            pass
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_autocast_cache_enabled()) == before
    with ampkit.autocast("cpu", fp32_ops=["mm"]):  # no override scope was left behind
        pass
    x = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(x, x).dtype == torch.bfloat16


def test_register_autocast_refuses_a_device_it_has_no_autocast_key_for():
    with pytest.raises(ValueError, match="register_autocast: device_type must be 'cpu' or 'cuda', but got 'tpu'"):
        ampkit.register_autocast("aten::relu", "tpu", "fp32")


def test_api_misuse_gets_a_message_naming_the_call_and_changes_nothing():
    """The API-level cases of the sweep whose messages came from pybind11 or from inside the call."""
    model = torch.nn.Linear(3, 2)
    scaler = ampkit.GradScaler("cpu")
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=r"GradScaler.load_state_dict: 'growth_interval' is out of range .* but got "
                                         r"18446744073709551616"):
        scaler.load_state_dict({**before, "growth_interval": 2**64})
    assert scaler.state_dict() == before
    with pytest.raises(ValueError, match="register_autocast: policy must be 'lowp', 'fp32' or 'promote', but got None"):
        ampkit.register_autocast("aten::mm", "cpu", None)
    with pytest.raises(TypeError, match="register_autocast: op must be an op name .* but got int"):
        ampkit.register_autocast(3, "cpu", "fp32")
    with pytest.raises(TypeError, match="decorate: model must be a torch.nn.Module, but got str"):
        ampkit.decorate("model")
    with pytest.raises(ValueError, match="AdamW: lr must be a number or a one-element tensor holding a value, but "
                                         "got a tensor on the meta device"):
        ampkit.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="meta"))
    opt = ampkit.optim.AdamW([model.weight])
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch.optim's warning
        opt.add_param_group({"params": [model.bias, torch.nn.Parameter(torch.ones(2)), model.bias]})
    model(torch.randn(2, 3)).sum().backward()
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"AdamW.step: params\[0\] and params\[2\] of parameter group 1 are the "
                                         "same tensor; a fused step updates each parameter once"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights)) and not opt.state


def test_unclear_python_errors_are_now_clear():
    with pytest.raises(TypeError, match="fp32_ops must be a list of op names"):
        ampkit.autocast("cpu", fp32_ops="softmax")
    with pytest.raises(ValueError, match="in both fp32_ops and lowp_ops"):
        with ampkit.autocast("cpu", fp32_ops=["softmax"], lowp_ops=["aten::softmax"]):
            pass
    with pytest.raises(RuntimeError, match="never entered"):
        ampkit.autocast("cpu", fp32_ops=["softmax"]).__exit__(None, None, None)
    with pytest.raises(ValueError, match="growth_interval must fit a 64-bit int"):
        ampkit.GradScaler("cpu", growth_interval=2**64)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        ampkit.GradScaler("cpu", process_group=42)
    with pytest.raises(ValueError, match="betas must be a pair|Invalid beta"):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = ampkit.optim.Adam([p])
        opt.param_groups[0]["betas"] = (0.9,)
        p.grad = torch.ones(2)
        opt.step()
