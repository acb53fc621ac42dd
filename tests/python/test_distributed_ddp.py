"""DDP on real Gloo ranks with ampkit: the FP16/BF16 compression hooks against a single-process run over the same
global batch and against torch's own hooks + torch.amp.GradScaler (the torch-named hooks leave torch's scaled grads
bit for bit, so clipping right after backward follows torch's trajectory; the unscale hooks leave them unscaled),
Inf on one rank and compression overflow skipping the step on every rank, and O1/O2 training whose rank-0
checkpoint resumes bit-identically on every rank. Each rank runs one thread (2 cores)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ampkit
import ampkit.distributed

STEPS = 4
LOCAL_BATCH = 6


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _batch(step: int, rank: int, world: int):
    """Rank `rank`'s share of the global batch of step `step` (the same numbers for every world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * LOCAL_BATCH, 16, generator=g)
    y = torch.randn(world * LOCAL_BATCH, 8, generator=g)
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    return x[sl], y[sl]


def _init(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _spawn(fn, world: int, tmp_path, *args) -> dict:
    results = mp.Manager().dict()
    mp.spawn(fn, args=(world, str(tmp_path / "store"), results) + args, nprocs=world, join=True)
    return dict(results)


# ---- the hooks against one process and against torch's hook -------------------------------------------------------

def _train_ddp(rank, world, store, results, hook_name, scaler_kind, opt_kind):
    _init(rank, world, store)
    try:
        model = DDP(_model())
        opt = (ampkit.optim.AdamW if opt_kind == "ampkit" else torch.optim.AdamW)(model.parameters(), lr=1e-2)
        scaler = (ampkit.GradScaler if scaler_kind == "ampkit" else torch.amp.GradScaler)("cpu", init_scale=1024.0)
        if hook_name == "torch_fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook_name != "none":
            model.register_comm_hook(scaler, getattr(ampkit.distributed, hook_name))
        for step in range(STEPS):
            x, y = _batch(step, rank, world)
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
        results[rank] = ([p.detach().clone() for p in model.parameters()], scaler.get_scale(),
                         [p.grad.clone() for p in model.parameters()])
    finally:
        # The DDP reducers first (see the finally of examples/python/ddp_train.py).
        model = ddp = ddp2 = None  # noqa: F841
        dist.destroy_process_group()


def _single_process(steps: int = STEPS, world: int = 2):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x = torch.cat([_batch(step, r, world)[0] for r in range(world)])
        y = torch.cat([_batch(step, r, world)[1] for r in range(world)])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world,hook", [(world, hook) for world in (2, 4)
                                        for hook in ("fp16_compress_unscale_hook", "bf16_compress_unscale_hook")]
                         + [(2, "fp16_compress_hook"), (2, "bf16_compress_hook")])
def test_compressed_ddp_follows_one_process_over_the_global_batch(tmp_path, world, hook):
    results = _spawn(_train_ddp, world, tmp_path, hook, "ampkit", "ampkit")
    reference = _single_process(world=world)
    # 4 AdamW steps of lr 1e-2 on grads rounded to 11 (FP16) or 8 (BF16) significant bits: the weights stay within
    # a few units of 1e-3 (FP16) / 1e-2 (BF16) of the FP32 run; every rank holds the same weights bit for bit.
    tol = 2e-3 if hook.startswith("fp16") else 2e-2
    for rank in range(world):
        for ours, ref, first in zip(results[rank][0], reference, results[0][0]):
            assert torch.equal(ours, first)
            torch.testing.assert_close(ours, ref, rtol=0, atol=tol)
    assert results[0][1] == 1024.0  # no overflow: the scale did not move (growth_interval 2000)


@pytest.mark.parametrize("hook", ["fp16_compress_unscale_hook", "fp16_compress_hook"])
def test_fp16_hook_gives_torchs_fp16_hook_and_grad_scaler_results_bit_for_bit(tmp_path, hook):
    # ampkit's hooks cast and divide as torch's does; the unscale hook's unscale multiplies by the FP64 reciprocal
    # rounded to FP32 as torch's GradScaler does after the copy back: the same bits, where the unscale pass happens
    # aside.
    ours = _spawn(_train_ddp, 2, tmp_path, hook, "ampkit", "torch")
    (tmp_path / "t").mkdir()
    theirs = _spawn(_train_ddp, 2, tmp_path / "t", "torch_fp16", "torch", "torch")
    for a, b in zip(ours[0][0], theirs[0][0]):
        assert torch.equal(a, b)
    for a, b in zip(ours[0][2], theirs[0][2]):  # the unscaled grads left behind
        assert torch.equal(a, b)


# ---- the torch-named hooks are torch's: scaled grads after backward, clipping right after it --------------------

def _grads_after_backward(rank, world, store, results, wire):
    _init(rank, world, store)
    models = []
    try:
        torch_hook = getattr(default_hooks, f"{wire}_compress_hook")
        ours = getattr(ampkit.distributed, f"{wire}_compress_hook")
        grads = {}
        for name in ("torch", "none", "group", "scaler", "hook_state"):
            scaler = ampkit.GradScaler("cpu", init_scale=1024.0)
            state = {"group": dist.group.WORLD, "scaler": scaler,
                     "hook_state": ampkit.distributed.HookState(scaler=scaler)}.get(name)
            model = DDP(_model())
            models.append(model)
            model.register_comm_hook(state, torch_hook if name == "torch" else ours)
            x, y = _batch(0, rank, world)
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            grads[name] = [p.grad.clone() for p in model.parameters()]
        results[rank] = grads
    finally:
        # The DDP reducers first (see the finally of examples/python/ddp_train.py).
        models = model = None  # noqa: F841
        dist.destroy_process_group()


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_torch_named_hooks_leave_torchs_scaled_grads_bit_for_bit_whatever_the_state(tmp_path, wire):
    results = _spawn(_grads_after_backward, 2, tmp_path, wire)
    for rank in (0, 1):
        grads = dict(results[rank])
        reference = grads.pop("torch")
        # still scaled: a random model's grads are O(0.01 .. 1), times 1024
        assert max(float(g.abs().max()) for g in reference) > 16.0
        for name, ours in grads.items():
            for a, b in zip(ours, reference):
                assert torch.equal(a, b), name
        assert all(torch.equal(a, b) for a, b in zip(reference, results[0]["torch"]))  # ranks agree


def _clip_right_after_backward(rank, world, store, results, kind):
    _init(rank, world, store)
    try:
        model = DDP(_model())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if kind == "torch":
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            scaler = ampkit.GradScaler("cpu", init_scale=1024.0)
            model.register_comm_hook(scaler, ampkit.distributed.fp16_compress_hook)
        trajectory = []
        for step in range(STEPS):
            x, y = _batch(step, rank, world)
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            # minGPT-ddp's loop: clipped right after backward, without unscale_ (the scaled grads are clipped)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            trajectory.append((float(norm), [p.detach().clone() for p in model.parameters()]))
        results[rank] = trajectory
    finally:
        # The DDP reducers first (see the finally of examples/python/ddp_train.py).
        model = None  # noqa: F841
        dist.destroy_process_group()


def test_clipping_right_after_backward_follows_torchs_hook_trajectory_bit_for_bit(tmp_path):
    ours = _spawn(_clip_right_after_backward, 2, tmp_path, "ampkit")
    (tmp_path / "t").mkdir()
    theirs = _spawn(_clip_right_after_backward, 2, tmp_path / "t", "torch")
    for rank in (0, 1):
        assert len(ours[rank]) == STEPS
        for (norm, params), (ref_norm, ref_params) in zip(ours[rank], theirs[rank]):
            assert norm == ref_norm and norm > 16.0  # the norm of scaled grads, as torch's
            assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


# ---- overflow: Inf on one rank, and overflow caused by the compression ------------------------------------------

def _overflow(rank, world, store, results, mode, hook, with_scaler):
    _init(rank, world, store)
    try:
        model = DDP(_model())
        opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2)
        init_scale = 2.0**24 if mode == "compression" else 1024.0
        scaler = ampkit.GradScaler("cpu", init_scale=init_scale, growth_interval=100)
        model.register_comm_hook(scaler if with_scaler else None, getattr(ampkit.distributed, hook))
        history = []
        for step in range(3):
            x, y = _batch(step, rank, world)
            if mode == "inf" and step == 1 and rank == 1:
                x = x.clone()
                x[-1, -1] = math.inf  # only rank 1's grads hold Inf/NaN
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            scaler.step(opt)
            scaler.update()
            moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
            finite = all(torch.isfinite(p).all() for p in model.parameters())
            history.append((scaler.get_scale(), moved, bool(finite), grads_finite))
        results[rank] = (history, scaler.stats()["skipped_steps"])
    finally:
        # The DDP reducers first (see the finally of examples/python/ddp_train.py).
        model = ddp = ddp2 = None  # noqa: F841
        dist.destroy_process_group()


# The unscale hook checks for the scaler; the torch-named hook leaves the Infs in the grads, for the scaler's own
# check, with or without the scaler as its state.
_OVERFLOW_HOOKS = pytest.mark.parametrize("hook,with_scaler", [("fp16_compress_unscale_hook", True),
                                                               ("fp16_compress_hook", True),
                                                               ("fp16_compress_hook", False)])


@_OVERFLOW_HOOKS
def test_inf_on_one_rank_skips_the_step_on_every_rank(tmp_path, hook, with_scaler):
    results = _spawn(_overflow, 2, tmp_path, "inf", hook, with_scaler)
    for rank in (0, 1):
        history, skipped = results[rank]
        assert [h[0] for h in history] == [1024.0, 512.0, 512.0]
        assert [h[1] for h in history] == [True, False, True]
        assert [h[3] for h in history] == [True, False, True]  # the Inf reached every rank's grads
        assert skipped == 1


@_OVERFLOW_HOOKS
def test_compression_overflow_is_caught_and_backs_off_on_every_rank(tmp_path, hook, with_scaler):
    # Scaled by 2^24, the grads (|g| ~ 0.1 .. 1) exceed FP16's 65504 only once compressed: the FP32 grads are
    # finite. The Infs of the reduced FP16 bucket reach the grads; every rank skips until the scale fits.
    results = _spawn(_overflow, 2, tmp_path, "compression", hook, with_scaler)
    for rank in (0, 1):
        history, skipped = results[rank]
        assert history[0][0] < 2.0**24 and not history[0][1] and not history[0][3]  # backed off, step skipped
        assert all(h[2] for h in history)  # the weights never took an Inf
    assert results[0] == results[1]


def _buckets(rank, world, store, results, victim_of_step):
    _init(rank, world, store)
    try:
        model = _model()
        ddp = DDP(model, bucket_cap_mb=1e-5)  # 10 bytes: one bucket per parameter
        opt = ampkit.optim.AdamW(ddp.parameters(), lr=1e-2)
        scaler = ampkit.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
        recorded = []
        record = scaler.record_unscaled_grads

        def counting_record(found_inf):
            recorded.append(float(found_inf))
            record(found_inf)

        scaler.record_unscaled_grads = counting_record
        ddp.register_comm_hook(scaler, ampkit.distributed.fp16_compress_unscale_hook)
        params = list(model.parameters())
        history = []
        for step in range(len(victim_of_step)):
            victim = victim_of_step[step]
            handle = None
            if victim is not None and rank == 1:  # an Inf in one element of one bucket, on one rank
                handle = params[victim].register_hook(lambda g: g.flatten().index_fill(0, torch.tensor([0]),
                                                                                      math.inf).view_as(g))
            x, y = _batch(step, rank, world)
            before = [p.detach().clone() for p in params]
            recorded.clear()
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(ddp(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            if handle is not None:
                handle.remove()
            moved = [not torch.equal(b, p) for b, p in zip(before, params)]
            history.append((scaler.get_scale(), moved, list(recorded)))
        results[rank] = (history, scaler.stats()["skipped_steps"], all(torch.isfinite(p).all() for p in params))
    finally:
        # The DDP reducers first (see the finally of examples/python/ddp_train.py).
        model = ddp = ddp2 = None  # noqa: F841
        dist.destroy_process_group()


def test_an_inf_in_any_one_of_many_buckets_skips_the_step_on_every_rank(tmp_path):
    # Four buckets from the second step on (DDP reduces the first step's grads in one bucket, then rebuilds them
    # by the cap), one flag recorded per bucket and step; the Inf sits in one element of one parameter on one
    # rank, in the bucket reduced first, in a middle one and in the last one: every rank skips that step and
    # backs off, the other steps move every parameter.
    victims = [None, 3, None, 0, 1, None]
    results = _spawn(_buckets, 2, tmp_path, victims)
    for rank in (0, 1):
        history, skipped, finite = results[rank]
        assert [h[0] for h in history] == [1024.0, 512.0, 512.0, 256.0, 128.0, 128.0]
        for step, ((scale, moved, recorded), victim) in enumerate(zip(history, victims)):
            assert len(recorded) == (1 if step == 0 else 4)  # every bucket's flag reached the scaler
            assert any(recorded) == (victim is not None)
            assert moved == [victim is None] * 4
        assert skipped == 3 and finite
    # The ranks agree, but not on the order in which the buckets' callbacks recorded their flags: that order
    # is whichever all-reduce completed first.
    assert [(s, m, sorted(r)) for s, m, r in results[0][0]] == [(s, m, sorted(r)) for s, m, r in results[1][0]]


# ---- O1 / O2 with checkpoints ---------------------------------------------------------------------------------

def _o_level(rank, world, store, results, level, ckpt):
    _init(rank, world, store)
    try:
        dtype = torch.bfloat16

        def build():
            model = _model()
            opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2)
            if level == "O2":
                model, opt = ampkit.decorate(model, opt, level="O2", dtype=dtype)
            ddp = DDP(model)
            scaler = ampkit.GradScaler("cpu", init_scale=256.0, growth_interval=2)
            hook = ampkit.distributed.bf16_compress_unscale_hook
            ddp.register_comm_hook(scaler, hook)
            return ddp, opt, scaler

        def run(ddp, opt, scaler, steps):
            for step in steps:
                x, y = _batch(step, rank, world)
                opt.zero_grad()
                with ampkit.autocast("cpu", dtype=dtype):
                    out = ddp(x.to(dtype) if level == "O2" else x)
                    loss = torch.nn.functional.mse_loss(out.float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()

        ddp, opt, scaler = build()
        run(ddp, opt, scaler, range(3))
        if rank == 0:
            torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()},
                       ckpt)
        dist.barrier()
        run(ddp, opt, scaler, range(3, 6))
        straight = [p.detach().clone() for p in ddp.parameters()]
        masters = [opt.state[p]["master_param"].clone() for p in ddp.parameters() if "master_param" in opt.state[p]]

        ddp2, opt2, scaler2 = build()
        saved = torch.load(ckpt, weights_only=False)
        ddp2.module.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])
        scaler2.load_state_dict(saved["scaler"])
        run(ddp2, opt2, scaler2, range(3, 6))
        resumed = [p.detach().clone() for p in ddp2.parameters()]
        masters2 = [opt2.state[p]["master_param"].clone() for p in ddp2.parameters()
                    if "master_param" in opt2.state[p]]
        results[rank] = (straight, resumed, masters, masters2, scaler.get_scale(), scaler2.get_scale(),
                         [p.dtype for p in ddp.parameters()])
    finally:
        # The DDP reducers first (see the finally of examples/python/ddp_train.py).
        model = ddp = ddp2 = None  # noqa: F841
        dist.destroy_process_group()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ddp_trains_and_a_rank0_checkpoint_resumes_bit_identically_on_every_rank(tmp_path, level):
    results = _spawn(_o_level, 2, tmp_path, level, str(tmp_path / "ckpt.pt"))
    for rank in (0, 1):
        straight, resumed, masters, masters2, scale, scale2, dtypes = results[rank]
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
        assert all(torch.equal(a, b) for a, b in zip(masters, masters2))
        assert scale == scale2
        if level == "O2":
            assert torch.bfloat16 in dtypes and masters  # BF16 weights with FP32 masters
        else:
            assert set(dtypes) == {torch.float32} and not masters
        assert all(torch.equal(a, b) for a, b in zip(straight, results[0][0]))  # ranks agree


# ---- the scaler's side, in one process ------------------------------------------------------------------------

@pytest.mark.parametrize("opt_cls", [ampkit.optim.SGD, torch.optim.SGD])
def test_recorded_unscaled_grads_are_not_unscaled_again_and_their_flag_decides_the_step(opt_cls):
    p = torch.nn.Parameter(torch.ones(4))
    opt = opt_cls([p], lr=0.5)
    scaler = ampkit.GradScaler("cpu", init_scale=8.0)
    scaler.scale(p.sum()).backward()
    p.grad.mul_(scaler.unscale_factor("cpu"))  # what a hook does while decompressing: grads are now 1
    scaler.record_unscaled_grads(torch.zeros(1))
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), torch.full((4,), 0.5)) and torch.equal(p.grad, torch.ones(4))
    # A recorded flag skips the step, although the grads themselves are finite.
    opt.zero_grad()
    scaler.scale(p.sum()).backward()
    scaler.record_unscaled_grads(torch.ones(1))
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), torch.full((4,), 0.5)) and scaler.get_scale() == 4.0


def test_record_unscaled_grads_refuses_bad_flags_and_late_calls():
    p = torch.nn.Parameter(torch.ones(4))
    opt = ampkit.optim.SGD([p], lr=0.5)
    scaler = ampkit.GradScaler("cpu", init_scale=8.0)
    with pytest.raises(AssertionError, match="scale"):
        scaler.record_unscaled_grads(torch.zeros(1))  # before the first scale(), as torch's methods
    scaler.scale(p.sum()).backward()
    with pytest.raises(ValueError, match="one-element float32 tensor, but got .*Long"):
        scaler.record_unscaled_grads(torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="one-element float32"):
        scaler.record_unscaled_grads(torch.zeros(2))
    with pytest.raises(TypeError, match="must be a Tensor"):
        scaler.record_unscaled_grads(0.0)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already unscaled or stepped"):
        scaler.record_unscaled_grads(torch.zeros(1))
    scaler.step(opt)  # the refused calls changed nothing: the grads were unscaled once, by unscale_
    assert torch.equal(p.detach(), torch.full((4,), 0.5))


def _twice(rank, world, store, results):
    _init(rank, world, store)
    try:
        model = DDP(_model())
        scaler = ampkit.GradScaler("cpu", init_scale=1024.0)
        model.register_comm_hook(scaler, ampkit.distributed.fp16_compress_unscale_hook)
        x, y = _batch(0, rank, world)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        try:
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            results[rank] = "no error"
        except RuntimeError as e:
            results[rank] = str(e)
    finally:
        # The DDP reducers first (see the finally of examples/python/ddp_train.py).
        model = ddp = ddp2 = None  # noqa: F841
        dist.destroy_process_group()


def test_a_second_synchronising_backward_in_one_iteration_is_refused(tmp_path):
    # Its grads would add scaled values to unscaled ones and be unscaled twice: use no_sync() to accumulate.
    message = _spawn(_twice, 1, tmp_path)[0]
    assert "bucket 0 was already all-reduced and unscaled in this iteration" in message and "no_sync" in message
