"""Guards of ampkit's internal fast paths, each named by the NOTE that describes it: the group steps from Python
(NOTE [Group steps from Python]) that look states up by the hash Python gives (NOTE [State lookups by known hash])
and borrow parameters and states (NOTE [Borrowed states], NOTE [Borrowed tensor lists]); the unboxed autograd
kernels (NOTE [Autograd kernels]); the alias check's memo (NOTE [Alias check memo]). Each path must give what the
plain path gives, bit for bit, and refuse what it refuses."""
from __future__ import annotations

import re

import pytest
import torch

import ampkit
from conftest import bits_equal
from factories import make_params


def test_group_steps_read_the_states_and_grads_of_this_step():
    # The lists are assembled in C++ each step: a state entry or a grad the caller replaced between steps is the
    # one the next step reads and writes, parameters without a grad get no state, and no empty entry is left in
    # optimizer.state (a defaultdict).
    params = make_params("cpu")
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ours = ampkit.optim.AdamW(params, lr=1e-2)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        for i, (p, q) in enumerate(zip(params, ref_params)):
            if i == 1 and step == 0:
                p.grad, q.grad = None, None  # no grad in the first step: no state
                continue
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        if step == 0:
            assert params[1] not in ours.state
        if step == 1:
            assert params[1] not in ours.state
            # Replace a moment by a copy of it: the step must update the new tensor, not the old one.
            old = ours.state[params[0]]["exp_avg"]
            ours.state[params[0]]["exp_avg"] = old.clone()
            frozen = old.clone()
        ours.step()
        ref.step()
        if step == 1:
            assert bits_equal(old, frozen), "the replaced exp_avg was written"
    assert len(ours.state) == len(params)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-6, atol=1e-7)


class _OwnHash(torch.Tensor):
    """A tensor subclass whose hash is not its address."""

    def __hash__(self):
        return 12345


@pytest.mark.parametrize("patch", ["subclass", "parameter"])
def test_group_steps_find_states_by_the_hash_python_gives(monkeypatch, patch):
    # The group step looks plain tensors' states up by their address (NOTE [State lookups by known hash]): a
    # parameter whose hash is something else (a subclass with its own __hash__, or nn.Parameter.__hash__ replaced)
    # must still find its state, step after step, as torch.optim does.
    if patch == "parameter":
        monkeypatch.setattr(torch.nn.Parameter, "__hash__", lambda self: hash((id(self), "other")))
    base = make_params("cpu")
    if patch == "subclass":
        params = [torch.nn.Parameter(p.detach().clone()) for p in base[:-1]]
        params.append(torch.Tensor._make_subclass(_OwnHash, base[-1].detach().clone(), True))
    else:  # a plain tensor first: its hash is its address, the Parameters' are not
        params = [base[0].detach().clone().requires_grad_()]
        params += [torch.nn.Parameter(p.detach().clone()) for p in base[1:]]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in base]
    ours = ampkit.optim.AdamW(params, lr=1e-2)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p, q in zip(params, ref_params):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert len(ours.state) == len(params)
    for p, q in zip(params, ref_params):
        assert ours.state[p]["step"].item() == 3.0
        assert bits_equal(p.detach().as_subclass(torch.Tensor), q.detach())


class _ShrinksGroup(torch.Tensor):
    """A parameter whose hash (taken when the step looks its state up) cuts its param group to 12 parameters."""

    group = None

    def __hash__(self):
        if _ShrinksGroup.group is not None:
            del _ShrinksGroup.group["params"][12:]
            _ShrinksGroup.group = None
        return id(self)


def test_group_steps_read_a_group_list_that_shrinks_mid_step():
    # The group step reads the list's length at every parameter, and so does its look-ahead (NOTE [Metadata
    # prefetch] in csrc/ops/checks.cpp): a hash that removes, and frees, the later parameters while the step reads
    # the list leaves a step over those that remain.
    gen = torch.Generator().manual_seed(12)
    params = [torch.nn.Parameter(torch.randn(5, generator=gen)) for _ in range(24)]
    params[3] = torch.Tensor._make_subclass(_ShrinksGroup, torch.randn(5, generator=gen), True)
    for p in params:
        p.grad = torch.randn(5, generator=gen)
    opt = ampkit.optim.AdamW(params, lr=1e-2)
    kept = params[:12]
    before = [p.detach().clone() for p in kept]
    del params, p  # the last 12 are held by the group alone
    _ShrinksGroup.group = opt.param_groups[0]
    opt.step()
    assert _ShrinksGroup.group is None
    assert len(opt.param_groups[0]["params"]) == 12
    assert all(not torch.equal(b, p.detach().as_subclass(torch.Tensor)) for b, p in zip(before, kept))
    assert len(opt.state) == 12
    assert all(opt.state[p]["step"].item() == 1.0 for p in kept)


def test_group_steps_refuse_a_state_that_is_not_a_dict_and_change_nothing():
    params = make_params("cpu")
    for p in params:
        p.grad = torch.randn_like(p)
    opt = ampkit.optim.SGD(params, lr=0.1, momentum=0.9)
    opt.state[params[2]] = ["not", "a", "dict"]
    before = [p.detach().clone() for p in params]
    with pytest.raises(TypeError, match=r"SGD.step: the state of params\[2\] must be a dict, but got"):
        opt.step()
    assert all(bits_equal(a, p.detach()) for a, p in zip(before, params))
    assert not any(isinstance(s, dict) and s for s in opt.state.values())


@pytest.mark.parametrize("master_weights", [None, "remainder"])
def test_group_steps_leave_every_reference_count_as_it_was(master_weights):
    # The group step borrows the parameters and (outside remainder mode) the state tensors (NOTE [Borrowed
    # states]): after many steps every Python reference count is unchanged, the states are still the tensors the
    # dicts hold (alive after the optimizer is gone) and the result is the owned-reference path's bit for bit.
    import gc
    import sys

    def run(group_steps):
        params = [p.detach().to(torch.bfloat16).requires_grad_() for p in make_params("cpu")]
        opt = ampkit.optim.AdamW(params, lr=1e-2, master_weights=master_weights)
        gen = torch.Generator().manual_seed(11)
        counts = None
        for step in range(12):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            if group_steps:
                opt.step()
            else:  # the list-based entry point, which takes references
                group = opt.param_groups[0]
                states = [opt.state.setdefault(p, {}) for p in params]
                ampkit._C.OptimizerCore("AdamW", "AdamW").step(group, params, states, None, None, True, None)
            if step == 1:
                counts = [(sys.getrefcount(t), t._use_count()) for st in opt.state.values() for t in st.values()] + \
                         [(sys.getrefcount(p), p._use_count()) for p in params]
        # Python's counts and the C++ ones (a borrow given back with a decrement, or never, would show here)
        assert counts == [(sys.getrefcount(t), t._use_count()) for st in opt.state.values() for t in st.values()] + \
               [(sys.getrefcount(p), p._use_count()) for p in params]
        states = [dict(opt.state[p]) for p in params]
        del opt
        gc.collect()
        return params, states

    ours, ours_states = run(True)
    ref, ref_states = run(False)
    for a, b, sa, sb in zip(ours, ref, ours_states, ref_states):
        assert bits_equal(a.detach(), b.detach())
        assert sa.keys() == sb.keys()
        for key in sa:
            assert bits_equal(sa[key], sb[key]), key


def test_a_group_step_that_raises_after_borrowing_gives_every_state_back_unchanged():
    # An error raised inside the core's step (here: an FP64 parameter, which takes torch's single-tensor path,
    # with only some of its Adam state) leaves every borrowed state tensor alive, unchanged and with its reference
    # counts as they were, and the next step with a whole state works.
    import gc
    import sys

    params = make_params("cpu") + [torch.randn(5, dtype=torch.float64, requires_grad=True)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = ampkit.optim.Adam(params, lr=1e-2)
    opt.step()
    opt.state[params[-1]].pop("exp_avg_sq")
    saved = {id(t): t.clone() for st in opt.state.values() for t in st.values()}
    counts = [(sys.getrefcount(t), t._use_count()) for st in opt.state.values() for t in st.values()]
    with pytest.raises(ValueError, match=r"has only some of step, exp_avg and exp_avg_sq"):
        opt.step()
    gc.collect()
    assert counts == [(sys.getrefcount(t), t._use_count()) for st in opt.state.values() for t in st.values()]
    for st in opt.state.values():
        for t in st.values():
            assert bits_equal(t, saved[id(t)])
    opt.state[params[-1]]["exp_avg_sq"] = torch.zeros_like(params[-1])
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)


def test_every_op_has_an_unboxed_autograd_kernel_that_bumps_what_it_writes():
    # NOTE [Autograd kernels]: without one, torch's boxed autograd fallback converts every tensor of every list.
    names = [n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("ampkit::") and not n.startswith("ampkit::_scaler_")]
    assert "adamw_step_" in names and "grad_norm" in names
    for name in names:
        dump = torch._C._dispatch_dump(f"ampkit::{name}")
        line = next((ln for ln in dump.splitlines() if ln.startswith("Autograd[alias]")), "")
        assert "autograd_kernels.cpp" in line and "unboxed" in line, f"{name}: {line or 'no Autograd kernel'}"
    # With grad mode on and leaves that require grad: the op runs, its results carry no graph, and every tensor it
    # writes gets a new version (as torch's in-place ops), read-only ones keep theirs.
    w = torch.randn(6, requires_grad=True)
    g = torch.randn(6)
    scale = torch.full((1,), 2.0)
    before, g_before = w.detach().clone(), g.clone()
    versions = (w._version, g._version, scale._version)
    torch.ops.ampkit.sgd_step_([w], [g], [], [], [], [], lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0,
                               nesterov=False, maximize=False, grad_scale=scale)
    assert torch.equal(g, g_before / 2.0)  # unscaled in place
    assert torch.equal(w.detach(), before - 0.5 * g)
    assert (w._version, g._version, scale._version) == (versions[0] + 1, versions[1] + 1, versions[2])
    # So autograd refuses a backward through a weight an optimizer step changed after the forward saved it.
    x = torch.randn(6, requires_grad=True)
    y = (x * x).sum()
    x.grad = torch.ones(6)
    ampkit.optim.SGD([x], lr=0.1).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    with pytest.raises(ValueError):  # a bad call raises before the op and bumps nothing
        torch.ops.ampkit.sgd_step_([w], [g], [], [], [], [], lr=-1.0, momentum=0.0, dampening=0.0,
                                   weight_decay=0.0, nesterov=False, maximize=False)
    assert w._version == versions[0] + 1
    norm = torch.ops.ampkit.grad_norm([w])
    assert norm.grad_fn is None and not norm.requires_grad
    assert torch.allclose(norm, torch.linalg.vector_norm(w.detach().double()).float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("op", ["adamw_step_", "sgd_step_"])
def test_optimizer_steps_bump_the_grads_versions_only_when_they_write_them(op):
    def call(w, g, **kw):
        if op == "adamw_step_":
            torch.ops.ampkit.adamw_step_([w], [g], [], [], [torch.zeros(6)], [torch.zeros(6)], [], [torch.zeros(())],
                                         lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                                         maximize=False, decoupled_weight_decay=True, **kw)
        else:
            torch.ops.ampkit.sgd_step_([w], [g], [], [], [], [], lr=0.1, momentum=0.0, dampening=0.0,
                                       weight_decay=0.0, nesterov=False, maximize=False, **kw)

    scale = torch.full((1,), 4.0)
    for kw, grads_written in [({}, False), ({"grad_scale": scale}, True),
                              ({"grad_scale": scale, "write_unscaled_grads": False}, False),
                              ({"write_unscaled_grads": True}, False)]:
        w = torch.randn(6, requires_grad=True)
        g = torch.randn(6)
        g_before = g.clone()
        wv, gv = w._version, g._version
        call(w, g, **kw)
        assert w._version == wv + 1, kw
        assert g._version == gv + (1 if grads_written else 0), kw
        assert torch.equal(g, g_before / 4.0 if grads_written else g_before), kw


def test_an_overlap_after_calls_that_passed_is_still_refused():
    # The alias check keeps the last call that passed (NOTE [Alias check memo]): the same lists pass again, and
    # any change that makes two tensors share memory (a moment replaced by a view of another, the same tensor
    # twice, one read-only list turned into a written one) is refused, naming both, with nothing written.
    n = 3
    ps = [torch.randn(37) for _ in range(n)]
    gs = [torch.randn(37) for _ in range(n)]
    ms = [torch.zeros(37) for _ in range(n)]
    vs = [torch.zeros(37) for _ in range(n)]
    steps = [torch.zeros(()) for _ in range(n)]

    def call(m, v):
        torch.ops.ampkit.adamw_step_(ps, gs, [], [], m, v, [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
                                     weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                                     decoupled_weight_decay=True)

    call(ms, vs)
    call(ms, vs)  # the memo's hit
    before = [t.clone() for t in ps + ms + vs + steps]
    for m, v, pattern in [([ms[0], ms[1], ms[2]], [vs[0], ms[1], vs[2]]) + (r"exp_avgs\[1\] and exp_avg_sqs\[1\]|"
                                                                           r"exp_avg_sqs\[1\] and exp_avgs\[1\]",),
                          ([ms[0], ms[1], vs[2][0:37]], vs) + (r"exp_avgs\[2\] and exp_avg_sqs\[2\]|"
                                                              r"exp_avg_sqs\[2\] and exp_avgs\[2\]",)]:
        with pytest.raises(RuntimeError, match=pattern):
            call(m, v)
        assert all(torch.equal(a, b) for a, b in zip(before, ps + ms + vs + steps))
    # The same tensor twice in a written list, right after a call that passed.
    call(ms, vs)
    with pytest.raises(RuntimeError, match=r"params\[0\] and params\[1\]|params\[1\] and params\[0\]"):
        torch.ops.ampkit.adamw_step_([ps[0], ps[0], ps[2]], gs, [], [], ms, vs, [], steps, lr=1e-3, beta1=0.9,
                                     beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                                     decoupled_weight_decay=True)


def _adamw_step(ps, gs, ms, vs, steps):
    torch.ops.ampkit.adamw_step_(ps, gs, [], [], ms, vs, [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
                                 weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False,
                                 decoupled_weight_decay=True)


def _step_lists(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(17 + i % 5, generator=gen) for i in range(n)]
    gs = [torch.randn(p.shape, generator=gen) for p in ps]
    ms = [torch.randn(p.shape, generator=gen) * 0.1 for p in ps]
    vs = [torch.rand(p.shape, generator=gen) * 0.01 for p in ps]
    steps = [torch.full((), float(i % 3)) for i in range(n)]
    return ps, gs, ms, vs, steps


@pytest.fixture
def intra_op_threads():
    """Sets torch's intra-op threads (NOTE [Checks in parts]: the step's checks run in parts from 512 parameters and
    two threads) and restores them."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("bad", ["first_part", "second_part", "both_parts", "alias_across_parts"])
def test_checks_in_parts_refuse_what_one_pass_refuses_naming_the_same_tensors(intra_op_threads, bad):
    # 700 parameters: two parts on two threads (parameters 0-349 and 350-699). The error is the one pass's, named by
    # the first bad parameter, whichever part meets it first; nothing is written.
    ps, gs, ms, vs, steps = _step_lists(700, seed=5)
    if bad in ("first_part", "both_parts"):
        gs[100] = torch.randn(3)
    if bad in ("second_part", "both_parts"):
        vs[600] = vs[600].double()
    if bad == "alias_across_parts":
        ms[650] = ms[20]
    before = [t.clone() for t in ps + gs + ms + vs + steps]
    messages = []
    for threads in (2, 1):
        intra_op_threads(threads)
        with pytest.raises((RuntimeError, TypeError)) as error:
            _adamw_step(ps, gs, ms, vs, steps)
        messages.append(str(error.value).splitlines()[0])
        assert all(torch.equal(a, b) for a, b in zip(before, ps + gs + ms + vs + steps))
    assert messages[0] == messages[1]
    expected = {"first_part": r"grads\[100\] must have the shape", "second_part": r"exp_avg_sqs\[600\] must be Float",
                "both_parts": r"grads\[100\] must have the shape",
                "alias_across_parts": r"exp_avgs\[20\] and exp_avgs\[650\]|exp_avgs\[650\] and exp_avgs\[20\]"}[bad]
    assert re.search(expected, messages[0]), messages[0]


def test_checks_in_parts_step_copy_on_write_states_as_one_pass_does(intra_op_threads):
    # Moments that are lazy clones (copy-on-write storages shared with their sources) in both parts: the step
    # materializes them (NOTE [Checks in parts]: the parts give up and one pass runs), writes the clones and leaves
    # the sources as they were; the bits equal those of plain copies stepped on one thread.
    ps, gs, ms, vs, steps = _step_lists(700, seed=6)
    sources = {i: ms[i].clone() for i in (3, 340, 351, 699)}
    frozen = {i: s.clone() for i, s in sources.items()}
    lazy = list(ms)
    for i, s in sources.items():
        lazy[i] = torch._lazy_clone(s)
    # Two views of one lazy clone, one in each part: its storage is materialized once, and both views step in it.
    shared_source = torch.cat([ms[10], ms[500]])
    shared_frozen = shared_source.clone()
    shared = torch._lazy_clone(shared_source)
    lazy[10], lazy[500] = shared[:ms[10].numel()], shared[ms[10].numel():]
    ref = [[t.clone() for t in lst] for lst in (ps, gs, ms, vs, steps)]
    intra_op_threads(2)
    _adamw_step(ps, gs, lazy, vs, steps)
    intra_op_threads(1)
    _adamw_step(*ref)
    for ours, theirs in zip([ps, gs, lazy, vs, steps], ref):
        assert all(bits_equal(a, b) for a, b in zip(ours, theirs))
    assert all(torch.equal(sources[i], frozen[i]) for i in sources)
    assert torch.equal(shared_source, shared_frozen)
    assert not torch.equal(lazy[3], frozen[3])
    assert lazy[10].data_ptr() + 4 * lazy[10].numel() == lazy[500].data_ptr()  # still views of one storage


@pytest.mark.parametrize("make, dtype", [
    (lambda ps: ampkit.optim.AdamW(ps, lr=1e-2, amsgrad=True), torch.float32),
    (lambda ps: ampkit.optim.AdamW(ps, lr=1e-2, master_weights=True), torch.bfloat16),
    (lambda ps: ampkit.optim.AdamW(ps, lr=1e-2, master_weights="kahan"), torch.bfloat16),
    (lambda ps: ampkit.optim.AdamW(ps, lr=1e-2, master_weights="stochastic",
                                   exp_avg_dtype=torch.bfloat16), torch.bfloat16),
    (lambda ps: ampkit.optim.SGD(ps, lr=1e-2, momentum=0.9), torch.float16),
    (lambda ps: ampkit.optim.LAMB(ps, lr=1e-2), torch.float32),
], ids=["adamw_amsgrad", "adamw_bf16_master", "adamw_kahan", "adamw_stochastic_bf16m", "sgd_fp16", "lamb"])
def test_steps_checked_in_parts_equal_one_pass_bit_for_bit(intra_op_threads, make, dtype):
    # 700 parameters on two threads (checked in parts, NOTE [Checks in parts]) and one (one pass), two steps each,
    # the second through a grad scale: the same weights and states, bit for bit.
    gen = torch.Generator().manual_seed(7)
    base = [torch.randn(17 + i % 6, generator=gen) for i in range(700)]
    grads = [torch.randn(t.shape, generator=gen) for t in base]
    results = []
    for threads in (2, 1):
        intra_op_threads(threads)
        torch.manual_seed(11)  # (stochastic rounding's seeds come from torch's generator)
        params = [t.to(dtype).requires_grad_() for t in base]
        opt = make(params)
        for step in range(2):
            for p, g in zip(params, grads):
                p.grad = (g * (step + 1)).to(dtype)
            opt.step()
        results.append((params, opt.state))
    (ours, our_state), (ref, ref_state) = results
    assert all(bits_equal(a.detach(), b.detach()) for a, b in zip(ours, ref))
    for a, b in zip(ours, ref):
        assert our_state[a].keys() == ref_state[b].keys()
        assert all(bits_equal(our_state[a][k], ref_state[b][k]) for k in our_state[a])
