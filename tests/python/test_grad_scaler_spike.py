"""GradScaler(spike_skip=...) (NOTE [Spike-aware skipping]): injected loss and gradient-norm spikes skip exactly
their steps (weights, states and step counts bit-identical across them) on the fused and the generic path, never
before the warm-up; the decisions follow a float64 re-derivation of the rule; a resumed run decides as the
uninterrupted one; no host read on the fused path; spikes are counted apart and never back the scale off; bad
options and bad states raise and change nothing."""
from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch

import ampkit
from conftest import CUDA_ONLY

SPIKE = {"window": 16, "warmup": 8}


def _data(steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 6, generator=g), torch.randn(32, 1, generator=g)) for _ in range(steps)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


OPTIMIZERS = {
    "ampkit.AdamW (fused: skips on the device)": lambda p: ampkit.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "torch SGD momentum (generic: host read)": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "torch AdamW foreach (generic: host read)": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
}


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            copy.deepcopy({k: v for k, v in opt.state_dict()["state"].items()}))


def _equal_snapshots(a, b) -> bool:
    params_a, state_a = a
    params_b, state_b = b
    if not all(torch.equal(x, y) for x, y in zip(params_a, params_b)):
        return False
    for k in state_a:
        for name, v in state_a[k].items():
            w = state_b[k][name]
            if isinstance(v, torch.Tensor) and not torch.equal(v, w):
                return False
            if not isinstance(v, torch.Tensor) and v != w:
                return False
    return True


def _train(opt_factory, spikes: dict, steps: int, spike_skip=SPIKE, grad_spikes: dict = (), scaler_kwargs=None):
    """Runs `steps` steps; the loss of step i is multiplied by spikes[i], the gradient by grad_spikes[i]. Returns
    the per-step 'ran' flags, the snapshots before and after each step, and the scaler."""
    model = _model()
    opt = opt_factory(model.parameters())
    scaler = ampkit.GradScaler("cpu", init_scale=2.0 ** 10, spike_skip=spike_skip, **(scaler_kwargs or {}))
    grad_factor = {"value": 1.0}
    model[0].weight.register_hook(lambda g: g * grad_factor["value"])
    ran, before, after = [], [], []
    for i, (x, y) in enumerate(_data(steps)):
        opt.zero_grad()
        grad_factor["value"] = dict(grad_spikes).get(i, 1.0)
        loss = torch.nn.functional.mse_loss(model(x), y) * spikes.get(i, 1.0)
        scaler.scale(loss).backward()
        before.append(_snapshot(model, opt))
        scaler.step(opt)
        scaler.update()
        after.append(_snapshot(model, opt))
        ran.append(bool(scaler.last_step_ran()))
    return ran, before, after, scaler


@pytest.mark.parametrize("make_opt", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_injected_loss_spikes_skip_exactly_their_steps(make_opt):
    spikes = {3: 1e3, 40: 1e3, 70: 50.0}  # step 3 is inside the warm-up: it must run
    ran, before, after, scaler = _train(make_opt, spikes, 80)
    assert [i for i, r in enumerate(ran) if not r] == [40, 70]
    for i in (40, 70):
        assert _equal_snapshots(before[i], after[i])  # weights and every state entry (step counts) untouched
    for i in (3, 39, 41):
        assert not _equal_snapshots(before[i], after[i])
    stats = scaler.stats()
    assert stats["spike_skipped_steps"] == 2 and stats["skipped_steps"] == 0 and stats["steps"] == 80
    assert stats["scale"] == 2.0 ** 10  # a spike is not an overflow: no back-off (growth_interval 2000)


def test_without_spike_skip_the_same_spikes_are_applied():
    ran, before, after, scaler = _train(OPTIMIZERS["ampkit.AdamW (fused: skips on the device)"], {40: 1e3}, 45,
                                        spike_skip=None)
    assert all(ran) and not _equal_snapshots(before[40], after[40])
    assert "spike_skipped_steps" in scaler.stats() and scaler.stats()["spike_skipped_steps"] == 0
    assert not any(k.startswith("_spike") for k in scaler.state_dict())


@pytest.mark.parametrize("make_opt", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_gradient_norm_spikes_skip_with_the_grad_norm_signal_only(make_opt):
    grad_spikes = {30: 1e3, 50: 1e3}  # the loss is unchanged: only the gradient jumps
    ran, before, after, scaler = _train(make_opt, {}, 60, dict(SPIKE, loss=False, grad_norm=True), grad_spikes)
    assert [i for i, r in enumerate(ran) if not r] == [30, 50]
    assert _equal_snapshots(before[30], after[30]) and _equal_snapshots(before[50], after[50])
    ran_loss_only, *_ = _train(make_opt, {}, 60, SPIKE, grad_spikes)
    assert all(ran_loss_only)


def test_an_overflow_and_a_spike_in_one_step_count_once_as_an_overflow():
    # Step 20: the loss jumps and a gradient holds Inf in the same step.
    ran, _, _, scaler = _train(OPTIMIZERS["ampkit.AdamW (fused: skips on the device)"], {20: 1e3}, 30,
                               grad_spikes={20: math.inf})
    assert [i for i, r in enumerate(ran) if not r] == [20]
    stats = scaler.stats()
    assert stats["spike_skipped_steps"] == 0 and stats["skipped_steps"] == 1 and stats["scale"] == 2.0 ** 9


def test_a_window_alone_sets_a_warmup_that_fits_it():
    ran, *_ = _train(OPTIMIZERS["ampkit.AdamW (fused: skips on the device)"], {20: 1e3}, 25, {"window": 12})
    assert [i for i, r in enumerate(ran) if not r] == [20]  # warm-up: min(64, window) = 12


def test_every_update_variant_ends_the_decision():
    """update(new_scale) as a float or a tensor closes the iteration's decision: the next iteration judges its own
    loss, and the spike is counted once."""
    for new_scale in (512.0, torch.tensor(512.0)):
        scaler = ampkit.GradScaler("cpu", spike_skip={"window": 8, "warmup": 4})
        _feed(scaler, [1.0, 1.1, 0.9, 1.0, 1.05, 0.95])
        p = torch.nn.Parameter(torch.zeros(3))
        opt = torch.optim.SGD([p], lr=1.0)
        scaler.scale(torch.tensor(50.0))  # a spike
        p.grad = torch.ones(3)
        scaler.step(opt)
        scaler.update(new_scale)
        assert torch.equal(p.detach(), torch.zeros(3)) and scaler.stats()["spike_skipped_steps"] == 1
        scaler.scale(torch.tensor(1.0))  # an ordinary loss: judged on its own
        p.grad = torch.full((3,), 512.0)  # 1 once unscaled at the new scale
        scaler.step(opt)
        scaler.update()
        assert torch.equal(p.detach(), -torch.ones(3)) and scaler.stats()["spike_skipped_steps"] == 1
        assert scaler.state_dict()["_spike_loss_history"][-2:] == [50.0, 1.0]


def test_two_optimizers_on_one_scaler_skip_together_on_the_first_loss():
    """A GAN iteration: the decision is taken at the first step, from the losses scaled before it, and skips both
    optimizers; the second loss, scaled after the decision, is not pushed."""
    d = torch.nn.Linear(4, 1)
    g = torch.nn.Linear(4, 4)
    opt_d = ampkit.optim.AdamW(d.parameters(), lr=1e-2)
    opt_g = torch.optim.SGD(g.parameters(), lr=1e-2)
    scaler = ampkit.GradScaler("cpu", spike_skip={"window": 16, "warmup": 8})
    skipped = []
    for i, (x, _) in enumerate(_data(30)):
        x = x[:, :4]
        opt_d.zero_grad()
        opt_g.zero_grad()
        loss_d = d(g(x).detach()).square().mean() * (1e3 if i == 25 else 1.0)
        scaler.scale(loss_d).backward()
        before = [t.detach().clone() for t in (*d.parameters(), *g.parameters())]
        scaler.step(opt_d)
        loss_g = -d(g(x)).mean() * 7.0
        scaler.scale(loss_g).backward()
        scaler.step(opt_g)
        scaler.update()
        after = [t.detach().clone() for t in (*d.parameters(), *g.parameters())]
        if not bool(scaler.last_step_ran()):
            skipped.append(i)
            assert all(torch.equal(a, b) for a, b in zip(before, after))
            assert not bool(scaler.last_step_ran(opt_d)) and not bool(scaler.last_step_ran(opt_g))
    assert skipped == [25] and scaler.stats()["spike_skipped_steps"] == 1
    assert scaler.state_dict()["_spike_loss_count"] == 30


def test_a_state_loaded_in_mid_iteration_keeps_the_iterations_decision():
    scaler = ampkit.GradScaler("cpu", spike_skip={"window": 8, "warmup": 4})
    _feed(scaler, [1.0, 1.1, 0.9, 1.0, 1.05, 0.95])
    saved = scaler.state_dict()
    p = torch.nn.Parameter(torch.zeros(3))
    opt = ampkit.optim.AdamW([p], lr=1.0)
    scaler.scale(torch.tensor(50.0))
    p.grad = torch.ones(3)
    scaler.step(opt)  # decided: a spike, skipped on the device
    scaler.load_state_dict(saved)
    scaler.update()
    assert not bool(scaler.last_step_ran()) and torch.equal(p.detach(), torch.zeros(3))
    assert scaler.stats()["spike_skipped_steps"] == 1


def test_the_deprecated_grad_scaler_handshake_sees_the_spike():
    """An optimizer that takes grad_scaler= reads _check_inf_per_device: a spike is in it."""
    class Legacy(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            found = sum(v.item() for v in grad_scaler._check_inf_per_device(self).values())
            if found == 0:
                for group in self.param_groups:
                    for q in group["params"]:
                        q.data.add_(q.grad / grad_scaler.get_scale(), alpha=-group["lr"])

    scaler = ampkit.GradScaler("cpu", spike_skip={"window": 8, "warmup": 4})
    _feed(scaler, [1.0, 1.1, 0.9, 1.0, 1.05, 0.95])
    p = torch.nn.Parameter(torch.zeros(3))
    opt = Legacy([p], lr=1.0)
    scaler.scale(torch.tensor(50.0) + (p * 1e-3).sum()).backward()  # a spike, with non-zero grads
    with pytest.warns(FutureWarning):
        scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), torch.zeros(3)) and scaler.stats()["spike_skipped_steps"] == 1


def _spike_worker(rank: int, world: int, store_path: str, grouped: bool, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        p = torch.nn.Parameter(torch.ones(4))
        opt = ampkit.optim.AdamW([p], lr=1e-3)  # the loss stays near 4
        scaler = ampkit.GradScaler("cpu", spike_skip={"window": 8, "warmup": 4},
                                   process_group=dist.group.WORLD if grouped else None)
        ran = []
        try:
            for step in range(12):
                opt.zero_grad()
                # Only rank 1's batch is bad at step 10.
                loss = (p * (1.0 + 0.01 * step)).sum() * (1e3 if step == 10 and rank == 1 else 1.0)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                ran.append(bool(scaler.last_step_ran()))
            results[rank] = (ran, p.detach().tolist(), scaler.stats()["spike_skipped_steps"])
        except ValueError as e:
            results[rank] = str(e)
    finally:
        scaler = opt = None  # the scaler holds the group: released before it is destroyed
        dist.destroy_process_group()


def test_two_ranks_skip_together_when_one_spikes(tmp_path):
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_spike_worker, args=(2, str(tmp_path / "store"), True, results), nprocs=2, join=True)
    (ran0, p0, n0), (ran1, p1, n1) = results[0], results[1]
    assert ran0 == ran1 and [i for i, r in enumerate(ran0) if not r] == [10]
    assert p0 == p1 and n0 == n1 == 1
    ungrouped = mp.Manager().dict()
    mp.spawn(_spike_worker, args=(2, str(tmp_path / "store2"), False, ungrouped), nprocs=2, join=True)
    assert all("spike_skip in a run of 2 processes needs process_group" in ungrouped[r] for r in (0, 1))


def _reference_decisions(values, window, warmup, sigmas):
    """The documented rule in float64: value i spikes when finite, at least `warmup` values were seen before it,
    and it exceeds mean + sigmas * (sample std) of the finite ones among the last `window` before it."""
    out = []
    for i, v in enumerate(values):
        hist = [h for h in values[max(0, i - window):i] if math.isfinite(h)]
        spike = False
        if i >= warmup and len(hist) >= 2 and math.isfinite(v):
            mean = sum(hist) / len(hist)
            std = math.sqrt(sum((h - mean) ** 2 for h in hist) / (len(hist) - 1))
            threshold = mean + sigmas * std
            if abs(v - threshold) <= 1e-4 * abs(threshold):
                spike = None  # too close to call in FP32
            else:
                spike = v > threshold
        out.append(spike)
    return out


def _feed(scaler, values, start=0):
    """Steps a parameter with zero grads once per value, the value handed to scale() as the loss."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    ran = []
    for v in values[start:]:
        scaler.scale(torch.tensor(v))
        p.grad = torch.zeros(3)
        scaler.step(opt)
        scaler.update()
        ran.append(bool(scaler.last_step_ran()))
    return ran


@pytest.mark.parametrize("seed", range(4))
def test_decisions_follow_a_float64_reference(seed):
    g = torch.Generator().manual_seed(seed)
    values = (2.0 + 0.1 * torch.randn(200, generator=g, dtype=torch.float64)).tolist()
    for i in torch.randint(10, 200, (12,), generator=g).tolist():
        values[i] *= float(torch.empty(1, dtype=torch.float64).uniform_(1.05, 3.0, generator=g))
    values[57] = math.nan  # kept out of the statistics, counted towards the warm-up
    values[120] = math.inf
    options = {"window": 24, "warmup": 10, "sigmas": 3.0}
    ran = _feed(ampkit.GradScaler("cpu", spike_skip=options), values)
    expected = _reference_decisions(values, 24, 10, 3.0)
    decided = [(i, e) for i, e in enumerate(expected) if e is not None]
    assert sum(e for _, e in decided) >= 3  # the sequence does spike
    assert [not ran[i] for i, _ in decided] == [e for _, e in decided]


def test_a_resumed_run_decides_as_the_uninterrupted_one():
    g = torch.Generator().manual_seed(7)
    values = (1.0 + 0.05 * torch.randn(120, generator=g, dtype=torch.float64)).tolist()
    for i in (30, 61, 62, 90, 110):
        values[i] *= 2.0
    options = {"window": 20, "warmup": 10}
    whole = _feed(ampkit.GradScaler("cpu", spike_skip=options), values)
    first = ampkit.GradScaler("cpu", spike_skip=options)
    head = _feed(first, values[:61])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = ampkit.GradScaler("cpu", spike_skip=options)
    resumed.load_state_dict(torch.load(buf))
    assert resumed.state_dict() == first.state_dict()
    tail = _feed(resumed, values, start=61)
    assert head + tail == whole and not all(whole)
    again = pickle.loads(pickle.dumps(first))  # pickling keeps the windows too
    assert _feed(again, values, start=61) == tail
    # A scaler that never saw the history warms up again and misses the spike at 62.
    assert _feed(ampkit.GradScaler("cpu", spike_skip=options), values, start=61) != tail


def test_a_window_shorter_than_the_saved_one_keeps_the_newest_values():
    long = ampkit.GradScaler("cpu", spike_skip={"window": 32, "warmup": 4})
    _feed(long, [float(i) for i in range(40)])
    state = long.state_dict()
    assert state["_spike_loss_history"] == [float(i) for i in range(8, 40)] and state["_spike_loss_count"] == 40
    short = ampkit.GradScaler("cpu", spike_skip={"window": 8, "warmup": 4})
    short.load_state_dict(state)
    assert short.state_dict()["_spike_loss_history"] == [float(i) for i in range(32, 40)]


def test_states_cross_with_torch_amp_grad_scaler():
    spiky = ampkit.GradScaler("cpu", spike_skip=SPIKE)
    _feed(spiky, [1.0] * 5)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(spiky.state_dict())  # the extra entries are ignored by torch
    assert theirs.get_scale() == spiky.get_scale()
    fresh = ampkit.GradScaler("cpu", spike_skip=SPIKE)
    fresh.load_state_dict(theirs.state_dict())  # torch's state: the windows start empty
    assert fresh.state_dict()["_spike_loss_count"] == 0 and fresh.state_dict()["_spike_loss_history"] == []


def test_the_fused_step_reads_nothing_on_the_host():
    from test_lr_scheduler import _CountingMode

    model = _model()
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ampkit.GradScaler("cpu", spike_skip=dict(SPIKE, grad_norm=True))
    counting = _CountingMode()
    flags = []
    for i, (x, y) in enumerate(_data(20)):
        opt.zero_grad()
        with counting:
            loss = torch.nn.functional.mse_loss(model(x), y) * (1e3 if i == 15 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            flags.append(scaler.last_step_ran())  # a device flag that keeps its value (NOTE [Step-ran flags])
    assert counting.host_reads == 0
    assert [i for i, f in enumerate(flags) if not bool(f)] == [15]
    assert scaler.stats()["spike_skipped_steps"] == 1


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("unscale_first", [False, True])
def test_the_fused_path_reads_the_grads_once_for_the_check_and_the_norm(unscale_first):
    """With ampkit's optimizers the grad_norm pass is the inf check: one grad_norm and no check_finite_ per step;
    after unscale_ the grads are unscaled and checked there, and the norm reads them once more."""
    model = _model()
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ampkit.GradScaler("cpu", spike_skip=dict(SPIKE, grad_norm=True))
    x, y = _data(1)[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    counter = _OpCounter()
    with counter:
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    reads = {k: counter.calls.get(k, 0) for k in ("grad_norm", "check_finite_", "unscale_and_check_")}
    assert reads == ({"grad_norm": 1, "check_finite_": 0, "unscale_and_check_": 1} if unscale_first
                     else {"grad_norm": 1, "check_finite_": 0, "unscale_and_check_": 0})


def test_the_norm_pass_still_flags_an_overflow():
    ran, before, after, scaler = _train(OPTIMIZERS["ampkit.AdamW (fused: skips on the device)"], {12: math.inf},
                                        20, dict(SPIKE, grad_norm=True))
    assert [i for i, r in enumerate(ran) if not r] == [12] and _equal_snapshots(before[12], after[12])
    assert scaler.stats()["skipped_steps"] == 1 and scaler.stats()["spike_skipped_steps"] == 0
    assert scaler.stats()["scale"] == 2.0 ** 9  # backed off: an overflow


def test_the_compiled_steps_scale_op_notes_the_loss():
    if not ampkit._compile.SUPPORTED:
        pytest.skip("this torch has no opaque-object custom ops")
    scaler = ampkit.GradScaler("cpu", spike_skip=SPIKE)
    factor = torch.ops.ampkit._scaler_scale_factor(scaler._handle, torch.tensor(3.5))
    assert factor.item() == 2.0 ** 16
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.zeros(2)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.step(opt)
    scaler.update()
    assert scaler.state_dict()["_spike_loss_history"] == [3.5]


@pytest.mark.parametrize(
    "spike_skip, error, message",
    [
        ({"window": 1}, ValueError, r"spike_skip window must be in \[2, 2\^24\], but got 1"),
        ({"warmup": 200}, ValueError, r"spike_skip warmup must be in \[2, window\] = \[2, 128\], but got 200"),
        ({"sigmas": 0.0}, ValueError, "spike_skip sigmas must be a finite number > 0, but got 0"),
        ({"loss": False}, ValueError, "spike_skip needs a signal"),
        ({"window_size": 8}, ValueError, "spike_skip has no option 'window_size'; the options are window, sigmas"),
        ({"window": 8.0}, TypeError, r"spike_skip\['window'\] must be an int, but got float 8.0"),
        ({"grad_norm": 1}, TypeError, r"spike_skip\['grad_norm'\] must be True or False, but got 1"),
        ("on", TypeError, "spike_skip must be True, False, None or a dict"),
    ],
)
def test_bad_options_raise_naming_the_option(spike_skip, error, message):
    with pytest.raises(error, match=message):
        ampkit.GradScaler("cpu", spike_skip=spike_skip)


@pytest.mark.parametrize(
    "entries, drop, error, message",
    [
        ({"_spike_loss_history": "abc"}, (), TypeError, "'_spike_loss_history' must be a number, a list of numbers"),
        ({"_spike_loss_history": [1.0, "x"]}, (), TypeError,
         "'_spike_loss_history' must hold numbers, but holds a str"),
        ({}, ("_spike_loss_history",), ValueError, r"'_spike_loss_history' and '_spike_loss_count' come together"),
        ({"_spike_loss_history": [1.0, 2.0], "_spike_loss_count": 1}, (), ValueError,
         r"'_spike_loss_count' \(1\) must be at least the length of '_spike_loss_history' \(2\)"),
        ({"spike_skipped_steps": -1}, (), ValueError, "'spike_skipped_steps' must be an int >= 0, but got -1"),
    ],
)
def test_a_bad_state_raises_and_changes_nothing(entries, drop, error, message):
    scaler = ampkit.GradScaler("cpu", spike_skip=SPIKE)
    _feed(scaler, [1.0, 2.0, 1.5])
    before = scaler.state_dict()
    bad = {k: v for k, v in before.items() if k not in drop}
    bad.update(entries)
    with pytest.raises(error, match=message):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before


@CUDA_ONLY
def test_a_cuda_step_with_spike_skip_makes_no_host_sync():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).cuda()
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ampkit.GradScaler("cuda", spike_skip=dict(SPIKE, grad_norm=True))
    x = torch.randn(8, 16, device="cuda")
    for i in range(12):
        opt.zero_grad()
        loss = model(x).square().mean() * (1e3 if i == 11 else 1.0)
        scaler.scale(loss).backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not bool(scaler.last_step_ran()) and scaler.stats()["spike_skipped_steps"] == 1
