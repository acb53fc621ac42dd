"""The eager and the compiled ampkit.optim step follow one plan (core::plan_step; NOTE [Compiled steps]): fed the
same odd parameters (channels-last, a CPU tensor lr, frozen, mixed dtypes in one group, partial states), both give
the same bits, the compiled one in one graph; what the graph cannot hold as it is (a grad in another layout than
its parameter) leaves it and still gives the eager bits. And the documented O2 flow compiles in one graph."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import ampkit
from ampkit import _compile
from conftest import bits_equal

pytestmark = pytest.mark.skipif(not _compile.SUPPORTED, reason="this torch has no opaque objects for custom ops")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def odd_params():
    """Parameters of every kind the plan tells apart, with seeded values."""
    torch.manual_seed(11)
    conv = torch.nn.Parameter(torch.randn(4, 3, 3, 3).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last))
    return {
        "conv_cl": conv,  # channels_last BF16: dense, fused
        "bf16": torch.nn.Parameter(torch.randn(33, 5).to(torch.bfloat16)),
        "fp16": torch.nn.Parameter(torch.randn(17).to(torch.float16)),
        "fp32": torch.nn.Parameter(torch.randn(9, 2)),
        "frozen": torch.nn.Parameter(torch.randn(6).to(torch.bfloat16)),  # never gets a grad
        "empty": torch.nn.Parameter(torch.randn(0, 3)),
    }


def set_grads(params: dict, step: int, same_layout: bool = True) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for name, p in params.items():
        if name == "frozen":
            p.grad = None
            continue
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        if name == "conv_cl" and same_layout:
            g = g.contiguous(memory_format=torch.channels_last)
        p.grad = g


OPTIMIZERS = {
    "adamw_cpu_tensor_lr": lambda ps: ampkit.optim.AdamW(ps, lr=torch.tensor(3e-2), weight_decay=0.1),
    "adam_amsgrad_masters_on": lambda ps: ampkit.optim.Adam(ps, lr=1e-2, amsgrad=True, master_weights=True),
    "sgd_nesterov": lambda ps: ampkit.optim.SGD(ps, lr=5e-2, momentum=0.9, nesterov=True),
    "sgd_plain": lambda ps: ampkit.optim.SGD(ps, lr=5e-2),
    "lamb": lambda ps: ampkit.optim.LAMB(ps, lr=1e-2, max_grad_norm=0.5),
    "two_groups_remainder": lambda ps: ampkit.optim.AdamW(
        [{"params": [ps[0], ps[1], ps[4]], "master_weights": "remainder"}, {"params": ps[2:4] + ps[5:]}],
        lr=torch.tensor(1e-2)),
    "two_groups_kahan": lambda ps: ampkit.optim.AdamW(
        [{"params": [ps[0], ps[1], ps[4]], "master_weights": "kahan"}, {"params": ps[2:4] + ps[5:]}], lr=1e-2),
    # The seeds are drawn from torch's default generator, seeded alike for both runs by odd_params().
    "sgd_two_groups_stochastic": lambda ps: ampkit.optim.SGD(
        [{"params": [ps[0], ps[1], ps[4]], "master_weights": "stochastic"}, {"params": ps[2:4] + ps[5:]}],
        lr=5e-2, momentum=0.9),
}


def run(kind: str, compiled: bool, same_layout: bool = True, steps: int = 4):
    params = odd_params()
    optimizer = OPTIMIZERS[kind](list(params.values()))
    step = torch.compile(optimizer.step, fullgraph=same_layout, backend="aot_eager") if compiled else optimizer.step
    for i in range(steps):
        set_grads(params, i, same_layout)
        step()
    return params, optimizer


def assert_same(eager, compiled):
    (pe, oe), (pc, oc) = eager, compiled
    for name in pe:
        assert bits_equal(pe[name].detach(), pc[name].detach()), name
        se, sc = oe.state.get(pe[name], {}), oc.state.get(pc[name], {})
        assert sorted(se) == sorted(sc), name
        for key in se:
            assert bits_equal(se[key], sc[key]), (name, key)
            assert se[key].stride() == sc[key].stride(), (name, key)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_odd_parameters_give_the_same_bits_eager_and_compiled(kind):
    eager = run(kind, compiled=False)
    compiled = run(kind, compiled=True)
    assert dict(counters["graph_break"]) == {}
    assert_same(eager, compiled)
    params, optimizer = eager
    assert params["frozen"] not in optimizer.state  # planned out: no grad
    moved = odd_params()
    assert not bits_equal(moved["bf16"].detach(), params["bf16"].detach())  # the steps did update
    if kind != "sgd_plain" and kind != "two_groups_remainder":
        assert optimizer.state[params["conv_cl"]]["exp_avg" if "sgd" not in kind else "momentum_buffer"].stride() \
            == params["conv_cl"].stride()  # states in the parameter's layout


def test_a_grad_in_another_layout_leaves_the_graph_with_the_eager_bits():
    # A channels_last parameter with a contiguous grad: the eager step reads it through a staging copy; the
    # compiled step, planned the same, leaves the graph for it.
    eager = run("adamw_cpu_tensor_lr", compiled=False, same_layout=False)
    compiled = run("adamw_cpu_tensor_lr", compiled=True, same_layout=False)
    assert_same(eager, compiled)
    assert sum(counters["graph_break"].values()) >= 1


def test_partial_states_are_completed_in_the_graph_as_eager_completes_them():
    # A torch.optim.SGD momentum buffer (no step: the next step is 1) and an O2 master without moments.
    def run_partial(compiled):
        params = odd_params()
        optimizer = ampkit.optim.SGD([params["bf16"], params["fp32"]], lr=0.1, momentum=0.9)
        optimizer.state[params["fp32"]]["momentum_buffer"] = torch.full_like(params["fp32"], 0.5)
        adam = ampkit.optim.AdamW([params["fp16"]], lr=0.1)
        adam.state[params["fp16"]]["master_param"] = params["fp16"].detach().float() + 1e-3
        steps = [torch.compile(o.step, fullgraph=True, backend="aot_eager") if compiled else o.step
                 for o in (optimizer, adam)]
        for i in range(3):
            set_grads(params, i)
            for s in steps:
                s()
        return params, optimizer, adam
    (pe, oe, ae), (pc, oc, ac) = run_partial(False), run_partial(True)
    assert dict(counters["graph_break"]) == {}
    for name in ("bf16", "fp32", "fp16"):
        assert bits_equal(pe[name].detach(), pc[name].detach()), name
    assert oe.state[pe["fp32"]]["step"].item() == oc.state[pc["fp32"]]["step"].item() == 4.0  # 1 + 3 steps
    for key in ("step", "exp_avg", "exp_avg_sq", "master_param"):
        assert bits_equal(ae.state[pe["fp16"]][key], ac.state[pc["fp16"]][key]), key


def test_the_documented_o2_flow_compiles_in_one_graph():
    # init_master_params while FP32, the cast to BF16, then scale/step/update compiled with fullgraph=True.
    def train(compiled):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        optimizer = ampkit.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        optimizer.init_master_params()
        model.to(torch.bfloat16)
        scaler = ampkit.GradScaler("cpu", init_scale=2.0**8)

        def step(x):
            loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            return loss.detach()
        f = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        torch.manual_seed(1)
        for _ in range(4):
            f(torch.randn(4, 16).to(torch.bfloat16))
            optimizer.zero_grad(set_to_none=True)
        return model, optimizer, scaler
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        (me, oe, se), (mc, oc, sc) = train(False), train(True)
    assert dict(counters["graph_break"]) == {}
    for p1, p2 in zip(me.parameters(), mc.parameters()):
        assert bits_equal(p1.detach(), p2.detach())
        assert sorted(oe.state[p1]) == sorted(oc.state[p2]) == ["exp_avg", "exp_avg_sq", "master_param", "step"]
        for key in oe.state[p1]:
            assert bits_equal(oe.state[p1][key], oc.state[p2][key]), key
    assert se.state_dict() == sc.state_dict()


def test_make_optim_state_creates_each_entry_and_refuses_bad_names():
    p = torch.randn(3, 4, 2, 2).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    names = ["step", "exp_avg", "master_param", "param_remainder"]
    step, exp_avg, master, remainder = torch.ops.ampkit.make_optim_state(p, names, 2.0)
    assert step.dtype == torch.float32 and step.shape == () and step.item() == 2.0
    assert exp_avg.dtype == torch.float32 and exp_avg.stride() == p.stride() and not exp_avg.any()
    assert bits_equal(master, p.float()) and master.data_ptr() != p.data_ptr()
    assert remainder.dtype == torch.int16 and remainder.stride() == p.stride() and not remainder.any()
    meta = torch.ops.ampkit.make_optim_state(p.to("meta"), names, 0.0)
    assert [t.device.type for t in meta] == ["meta"] * 4 and meta[1].stride() == p.stride()
    with pytest.raises(ValueError, match=r"make_optim_state: entries\[1\] must be one of .* but got 'exp_avgs'"):
        torch.ops.ampkit.make_optim_state(p, ["step", "exp_avgs"], 0.0)
    with pytest.raises(ValueError, match=r"entries\[0\] \('step'\) is named twice"):
        torch.ops.ampkit.make_optim_state(p, ["step", "step"], 0.0)
    with pytest.raises(TypeError, match="param must be FP16, BF16 or FP32, but got Double"):
        torch.ops.ampkit.make_optim_state(p.double(), ["step"], 0.0)
    torch.library.opcheck(torch.ops.ampkit.make_optim_state.default, (p, names, 1.0))


def test_global_grad_norm_op_matches_a_float64_norm():
    torch.manual_seed(2)
    grads = [torch.randn(1000).to(torch.bfloat16), torch.randn(7, 3), torch.randn(5).to(torch.float16)]
    scale = torch.tensor(4.0)
    ref = torch.cat([g.double().reshape(-1) for g in grads]).norm() / 4.0
    got = ampkit.ops.global_grad_norm(grads, scale)
    assert got.dtype == torch.float32 and got.shape == ()
    assert abs(got.item() - ref.item()) <= 1e-6 * ref.item()
    assert bits_equal(got, ampkit.ops.grad_norm(grads, scale))  # one device: grad_norm itself
    assert ampkit.ops.global_grad_norm([]).item() == 0.0
    torch.library.opcheck(torch.ops.ampkit.global_grad_norm.default, (grads, scale))
