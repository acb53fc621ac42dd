"""ampkit.optim's options against the option table the C++ core declares them in (NOTE [Optimizer option table] in
ampkit/optim_options.h): the constructors' signatures, the defaults a constructed optimizer keeps, the flags and
state dtype keys, and the core's reading of a param group, all from the table."""
from __future__ import annotations

import inspect

import pytest
import torch

import ampkit
from ampkit import _C

OPTIMIZERS = {"Adam": ampkit.optim.Adam, "AdamW": ampkit.optim.AdamW, "SGD": ampkit.optim.SGD,
              "LAMB": ampkit.optim.LAMB}


def _rows(name):
    """(name, default, python, archive, field, state entry) per option."""
    return [tuple(r) for r in _C._optim_options(name)]


def _keyword(cls, key):
    """The parameter `key` of the first __init__ along cls's MRO that names it."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and key in inspect.signature(init).parameters:
            return inspect.signature(init).parameters[key]
    return None


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_table_rows_are_well_formed(name):
    rows = _rows(name)
    names = [r[0] for r in rows]
    assert len(names) == len(set(names)) >= 10
    assert {r[2] for r in rows} <= {"group", "lr", "attribute", "none"}
    assert {r[3] for r in rows} <= {"required", "optional", "python only"}
    assert [r[0] for r in rows if r[2] == "lr"] == ["lr"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_signatures_and_defaults_follow_the_table(name):
    cls = OPTIMIZERS[name]
    opt = cls([torch.nn.Parameter(torch.zeros(3))])
    for key, default, python, *_ in _rows(name):
        if python == "none":
            continue
        param = _keyword(cls, key)
        assert param is not None, f"{name}.__init__ has no keyword {key}"
        if python == "attribute":
            assert getattr(opt, key) == default and param.default == default, key
            continue
        # the default a group takes; the signature's, unless it is None standing for the class's own (torch's
        # decoupled_weight_decay=None)
        value = opt.param_groups[0][key]
        assert value == default and type(value) is type(default), (key, value, default)
        if param.default is not None or default is None:
            assert param.default == default and type(param.default) is type(default), (key, param.default)
    assert set(cls._options) == {r[0] for r in _rows(name) if r[2] in ("group", "lr")}
    assert set(cls._options) <= set(opt.defaults)
    # torch.optim's own keys that the core does not read stay Python's
    assert set(opt.defaults) - set(cls._options) == set(cls._compat)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_flags_and_state_dtype_keys_come_from_the_table(name):
    cls = OPTIMIZERS[name]
    rows = _rows(name)
    assert set(cls._flags) == {r[0] for r in rows if r[2] == "group" and isinstance(r[1], bool)}
    assert dict(zip(cls._state_dtype_keys, cls._state_dtype_entries)) == {r[0]: r[5] for r in rows if r[5]}
    defaults = cls([torch.nn.Parameter(torch.zeros(3))]).defaults
    for flag in cls._flags:  # every flag is checked as one
        with pytest.raises(TypeError, match=f"{flag} must be True or False"):
            cls._check_group(dict(defaults, **{flag: 2}))


def test_state_dtype_entries():
    assert dict(zip(ampkit.optim.Adam._state_dtype_keys, ampkit.optim.Adam._state_dtype_entries)) == {
        "exp_avg_dtype": "exp_avg", "exp_avg_sq_dtype": "exp_avg_sq"}
    assert dict(zip(ampkit.optim.SGD._state_dtype_keys, ampkit.optim.SGD._state_dtype_entries)) == {
        "momentum_dtype": "momentum_buffer"}
    assert ampkit.optim.LAMB._state_dtype_keys == ()


def test_core_reads_every_group_option():
    """A group option reaches the core: a value out of its range is refused by the core under its own name."""
    for name, key, bad, message in [
            ("Adam", "eps", -1.0, "Invalid epsilon value"),
            ("Adam", "weight_decay", -1.0, "Invalid weight_decay value"),
            ("Adam", "exp_avg_dtype", torch.float16, "exp_avg_dtype"),
            ("SGD", "momentum", -1.0, "Invalid momentum value"),
            ("SGD", "momentum_dtype", torch.float16, "momentum_dtype"),
            ("LAMB", "max_grad_norm", -1.0, "max_grad_norm"),
            ("LAMB", "betas", (1.5, 0.9), "beta"),
            ("AdamW", "master_weights", "sometimes", "master_weights")]:
        group = {r[0]: r[1] for r in _rows(name) if r[2] in ("group", "lr")}
        _C.OptimizerCore(name, name).check_config(group)  # the table's defaults pass
        group[key] = bad
        with pytest.raises((ValueError, TypeError), match=message):
            _C.OptimizerCore(name, name).check_config(group)


def test_a_group_lacking_options_takes_the_table_defaults():
    # only lr: every other option from the table (LAMB's defaults clip at max_grad_norm 1.0)
    _C.OptimizerCore("LAMB", "LAMB").check_config({"lr": 1e-3})
    _C.OptimizerCore("SGD", "SGD").check_config({"lr": torch.tensor(0.5)})
    with pytest.raises(ValueError, match="Invalid learning rate"):
        _C.OptimizerCore("Adam", "Adam").check_config({"lr": -1.0})


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "LAMB"])
def test_a_partial_group_steps_as_the_optimizers_defaults(name):
    """A group with only lr, stepped by a class's core, takes that class's defaults (AdamW's decoupled weight
    decay of 1e-2, not Adam's 0): the bits of the optimizer built with lr alone."""
    torch.manual_seed(0)
    # (LAMB's clipping norm is the optimizer's, over every group: without it the core steps unclipped)
    kwargs = {"SGD": dict(momentum=0.9), "LAMB": dict(max_grad_norm=0.0)}.get(name, {})
    params = [torch.randn(40, dtype=torch.float32) for _ in range(3)]
    grads = [torch.randn_like(p) for p in params]
    ours = [p.clone().requires_grad_() for p in params]
    theirs = [p.clone().requires_grad_() for p in params]
    for p, g in zip(ours + theirs, grads + grads):
        p.grad = g.clone()
    opt = getattr(ampkit.optim, name)(theirs, lr=1e-2, **kwargs)
    core = _C.OptimizerCore(name, name)
    states = [{} for _ in ours]
    for _ in range(2):
        opt.step()
        core.step(dict(lr=1e-2, **kwargs), ours, states, None, None, True, None)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], params[0])


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="optimizer must be 'Adam', 'AdamW', 'SGD' or 'LAMB', but got 'Adagrad'"):
        _C._optim_options("Adagrad")


def test_the_core_is_one_bound_object_per_class():
    opt = ampkit.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    core = opt._cpp_core()
    assert isinstance(core, _C.OptimizerCore) and core is type(opt)._cpp_core()
    assert (core.algorithm, core.optimizer, core.name) == ("adam", "AdamW", "AdamW")
    assert not [n for n in dir(_C) if n.startswith("_optim_") and n != "_optim_options"]
    with pytest.raises(ValueError, match="optimizer must be 'Adam', 'AdamW', 'SGD' or 'LAMB', but got 'adagrad'"):
        _C.OptimizerCore("adagrad", "Adagrad")


@pytest.mark.parametrize("table,algorithm,op", [("Adam", "adam", "adamw_step_"), ("SGD", "sgd", "sgd_step_"),
                                                ("LAMB", "lamb", "lamb_step_")])
def test_state_lists_are_the_ops_lists(table, algorithm, op):
    """NOTE [State lists of the fused ops]: every state list of the op's schema is in the table, and every entry
    travels in one of them."""
    list_of, op_lists = _C.OptimizerCore(table, "X").state_lists()
    schema = getattr(torch.ops.ampkit, op).default._schema
    tensor_lists = [a.name for a in schema.arguments if str(a.type) == "List[Tensor]"]
    assert set(op_lists) == set(tensor_lists) - {"params", "grads"}
    assert set(list_of.values()) == set(op_lists)
    moments = {"adam": {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, "lamb": {"exp_avg", "exp_avg_sq"},
               "sgd": {"momentum_buffer"}}[algorithm]
    assert set(list_of) == {"step", "master_param", "param_remainder", "kahan_comp", "sr_seed"} | moments
