"""A whole AMP training step under torch.compile(fullgraph=True): forward under autocast, scaler.scale(loss)
.backward(), scaler.step(optimizer) with ampkit.optim, scaler.update(). No graph breaks; the parameters, optimizer
states and scaler state are bitwise those of the same steps run eagerly (a skipped overflow step included);
errors of the C++ state machine reach the compiled caller; groups a graph cannot hold take the eager step."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import ampkit
from ampkit import _compile
from conftest import bits_equal

pytestmark = pytest.mark.skipif(not _compile.SUPPORTED, reason="this torch has no opaque objects for custom ops")

OPTIMIZERS = {
    "adamw": lambda p: ampkit.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "sgd": lambda p: ampkit.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
    "lamb": lambda p: ampkit.optim.LAMB(p, lr=1e-2, max_grad_norm=0.5),
    "adam_amsgrad": lambda p: ampkit.optim.Adam(p, lr=torch.tensor(1e-2), amsgrad=True),
    "sgd_plain_remainder": lambda p: ampkit.optim.SGD(p, lr=1e-2, master_weights="remainder"),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        yield
    torch._dynamo.reset()


def make(kind: str, dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(dtype)
    optimizer = OPTIMIZERS[kind](model.parameters())
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, hysteresis=2)
    return model, optimizer, scaler


def inputs(n: int = 7, overflow_at=(3, 4)):
    torch.manual_seed(1)
    xs = [torch.randn(4, 16) for _ in range(n)]
    for i in overflow_at:  # two overflows in a row: the first only skips (hysteresis 2), the second backs off
        xs[i][-1, -1] = float("inf")
    return xs


def amp_step(model, optimizer, scaler, unscale_and_clip=False):
    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        if unscale_and_clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=True)
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()
    return step


def train(kind, compiled, unscale_and_clip=False, backend="inductor"):
    model, optimizer, scaler = make(kind)
    step = amp_step(model, optimizer, scaler, unscale_and_clip)
    if compiled:
        step = torch.compile(step, fullgraph=True, backend=backend)
    for x in inputs():
        step(x)
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, scaler


def assert_same_run(eager, compiled):
    (m1, o1, s1), (m2, o2, s2) = eager, compiled
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert bits_equal(p1.detach(), p2.detach())
        st1, st2 = o1.state[p1], o2.state[p2]
        assert sorted(st1) == sorted(st2)
        for key in st1:
            assert bits_equal(st1[key], st2[key]), key
    assert s1.state_dict() == s2.state_dict()
    assert s1.stats() == s2.stats()


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_compiled_amp_step_is_one_graph_and_matches_eager(kind):
    eager = train(kind, compiled=False)
    compiled = train(kind, compiled=True)
    assert dict(counters["graph_break"]) == {}
    # One graph for the first step (it creates the optimizer states) and one for the steps after.
    assert counters["stats"]["unique_graphs"] == 2
    assert_same_run(eager, compiled)
    stats = compiled[2].stats()
    assert (stats["steps"], stats["skipped_steps"], stats["last_overflow_step"]) == (7, 2, 5)
    assert compiled[2].get_scale() == eager[2].get_scale() < 2.0**10 * 4  # grew, then backed off once


def test_compiled_unscale_clip_step_matches_eager():
    eager = train("adamw", compiled=False, unscale_and_clip=True)
    compiled = train("adamw", compiled=True, unscale_and_clip=True, backend="aot_eager")
    assert dict(counters["graph_break"]) == {}
    assert_same_run(eager, compiled)


def test_compiled_step_after_unscale_fp32_params_matches_eager():
    # FP32 parameters without masters: the clipped grads are read by the kernel with a grad_scale of 1.
    def run(compiled):
        model, optimizer, scaler = make("sgd", dtype=torch.float32)
        step = amp_step(model, optimizer, scaler, unscale_and_clip=True)
        step = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        for x in inputs(5, overflow_at=(2,)):
            step(x)
            optimizer.zero_grad(set_to_none=True)
        return model, optimizer, scaler
    assert_same_run(run(False), run(True))


def test_compiled_state_machine_errors_come_from_the_core():
    model, optimizer, scaler = make("adamw")

    def twice(x):
        scaler.scale(model(x.to(torch.bfloat16)).float().sum()).backward()
        scaler.step(optimizer)
        scaler.step(optimizer)

    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        torch.compile(twice, fullgraph=True, backend="aot_eager")(torch.randn(2, 16))
    scaler.update()  # the first step was recorded: the scaler is usable again
    assert scaler.stats()["steps"] == 1

    def unscale_fp16(x):
        scaler.scale(model16(x).float().sum()).backward()
        scaler.unscale_(opt16)

    model16 = torch.nn.Linear(16, 4).half()
    opt16 = ampkit.optim.SGD(model16.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        torch.compile(unscale_fp16, fullgraph=True, backend="aot_eager")(torch.randn(2, 16, dtype=torch.half))


def test_compiled_step_before_scale_raises_torchs_assertion():
    _, optimizer, scaler = make("sgd")

    def step_only():
        scaler.step(optimizer)

    with pytest.raises(AssertionError, match="Attempted step but _scale is None"):
        torch.compile(step_only, fullgraph=True, backend="aot_eager")()


def test_groups_a_graph_cannot_hold_take_the_eager_step():
    # An FP64 parameter (torch.optim's single-tensor path) in the group: the step leaves the graph and gives the
    # eager results.
    def run(compiled):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
        v = torch.nn.Parameter(torch.randn(5))
        optimizer = ampkit.optim.AdamW([w, v], lr=0.1)

        # The backward stays outside: Dynamo cannot resume a graph whose own backward made the grads after a
        # break that follows a read of the parameters.
        f = torch.compile(optimizer.step, backend="aot_eager") if compiled else optimizer.step
        for _ in range(3):
            (w.square().sum() + v.float().square().sum()).backward()
            f()
            optimizer.zero_grad()
        return [w.detach().clone(), v.detach().clone()], optimizer
    (pe, _), (pc, _) = run(False), run(True)
    assert all(bits_equal(a, b) for a, b in zip(pe, pc))
    assert sum(counters["graph_break"].values()) >= 1  # the eager step outside the graph


def test_a_changed_group_value_is_checked_again():
    model, optimizer, scaler = make("adamw")
    step = torch.compile(amp_step(model, optimizer, scaler), fullgraph=True, backend="aot_eager")
    step(torch.randn(4, 16))
    optimizer.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.param_groups[0]["lr"] = -1.0  # a guard of the graph: it recompiles and the core checks it
    with pytest.raises(torch._dynamo.exc.Unsupported, match="AdamW.step: ValueError: Invalid learning rate: -1.0"):
        step(torch.randn(4, 16))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # Without fullgraph the step leaves the graph and raises the eager step's error, before any write.
    model(torch.randn(4, 16).to(torch.bfloat16)).float().sum().backward()
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        torch.compile(optimizer.step, backend="aot_eager")()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_scheduled_lr_recompiles_and_a_tensor_lr_does_not():
    def run(lr, compiled):
        model, _, scaler = make("adamw")
        optimizer = ampkit.optim.AdamW(model.parameters(), lr=lr)
        step = amp_step(model, optimizer, scaler)
        step = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        for i, x in enumerate(inputs(4, overflow_at=())):
            step(x)
            optimizer.zero_grad(set_to_none=True)
            value = 1e-2 / (i + 2)
            if isinstance(lr, torch.Tensor):
                optimizer.param_groups[0]["lr"].fill_(value)
            else:
                optimizer.param_groups[0]["lr"] = value
        return model, optimizer, scaler
    for lr in (1e-2, torch.tensor(1e-2)):
        eager = run(lr.clone() if isinstance(lr, torch.Tensor) else lr, compiled=False)
        torch._dynamo.reset()
        counters.clear()
        compiled = run(lr.clone() if isinstance(lr, torch.Tensor) else lr, compiled=True)
        assert_same_run(eager, compiled)
        assert dict(counters["graph_break"]) == {}
        # float lr: a graph per value after the first two (states created, then steady); tensor lr: two graphs
        assert counters["stats"]["unique_graphs"] == (2 if isinstance(lr, torch.Tensor) else 4)


def test_a_parameter_without_grad_whose_dtype_the_group_refuses_compiles_as_eager_runs():
    # master_weights="remainder" refuses FP32 parameters, but only those the step updates (with a grad).
    def run(compiled):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8).to(torch.bfloat16)
        unused = torch.nn.Parameter(torch.randn(3))  # FP32, never gets a grad
        optimizer = ampkit.optim.SGD([*model.parameters(), unused], lr=0.1, master_weights="remainder")
        scaler = ampkit.GradScaler("cpu", init_scale=256.0)

        def step(x):
            scaler.scale(model(x).float().square().mean()).backward()
            scaler.step(optimizer)
            scaler.update()
        f = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        for x in inputs(3, overflow_at=()):
            f(x.to(torch.bfloat16))
            optimizer.zero_grad(set_to_none=True)
        return model, optimizer, scaler
    assert_same_run(run(False), run(True))
    assert dict(counters["graph_break"]) == {}


def test_optimizers_the_graph_does_not_step_take_the_eager_path():
    # torch's own fused AdamW (no traceable step): the scaler's step leaves the graph, with eager's results.
    def run(compiled):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = ampkit.GradScaler("cpu", init_scale=256.0)

        def step():
            scaler.step(optimizer)
            scaler.update()
        f = torch.compile(step, backend="aot_eager") if compiled else step
        for x in inputs(3, overflow_at=(1,)):
            scaler.scale(model(x).square().mean()).backward()
            f()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()], scaler.stats()
    (pe, se), (pc, sc) = run(False), run(True)
    assert all(bits_equal(a, b) for a, b in zip(pe, pc)) and se == sc


def test_without_opaque_objects_the_scaler_methods_run_eagerly():
    # A torch without opaque custom-op arguments (ampkit._compile.SUPPORTED False): the scaler has no handle and
    # its methods break the graph, with the eager results.
    def run(compiled):
        model, optimizer, scaler = make("adamw")
        if compiled:
            scaler._handle = None
        step = amp_step(model, optimizer, scaler)
        step = torch.compile(step, backend="aot_eager") if compiled else step
        for x in inputs(4, overflow_at=(2,)):
            step(x)
            optimizer.zero_grad(set_to_none=True)
        return model, optimizer, scaler
    with torch._dynamo.config.patch(trace_autograd_ops=False):
        eager = run(False)
        compiled = run(True)
    assert_same_run(eager, compiled)
    assert sum(counters["graph_break"].values()) >= 1
