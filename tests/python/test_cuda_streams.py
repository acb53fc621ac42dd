"""The scaler across CUDA streams and without host syncs (NOTE [Scaler streams], NOTE [Watching min_scale]):
flags recorded from two streams, as DDP's bucket callbacks record them from streams of torch's pool, are all
counted; the inverse scale read from another stream waits for the update() that changed it; a DDP run whose
hooks run on pool streams skips a step whose Inf sits in any one bucket; update() with min_scale makes no host
sync, tells the host one update() late while the device runs behind, and is captured in a CUDA graph. A stream
kept busy by torch.cuda._sleep makes the order of two streams' work certain. Skipped without a device; the CPU
side of the same state: tests/cpp/test_grad_scaler_buffers.cpp, tests/python/test_grad_scaler_buffers.py and
tests/python/test_distributed_ddp.py."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import ampkit
from conftest import CUDA_ONLY, bits_equal
from loops import capture_and_replay

pytestmark = CUDA_ONLY

SLEEP = 200_000_000  # cycles (~0.1 s): far longer than the host takes to enqueue the other stream's work


def _param_and_scaler(init_scale=1024.0, **kw):
    p = torch.nn.Parameter(torch.ones(1024, device="cuda"))
    opt = ampkit.optim.SGD([p], lr=0.5)  # fused: skips on the device, no host read
    scaler = ampkit.GradScaler("cuda", init_scale=init_scale, **kw)
    return p, opt, scaler


@pytest.mark.parametrize("consumer_waits", [True, False], ids=["as-ddp", "unordered"])
def test_flags_recorded_from_two_streams_are_all_counted(consumer_waits):
    # The first bucket records from a stream still busy, the second, holding the Inf, from an idle one: with one
    # shared flag, the first bucket's zeroing ran last and erased the Inf (the step was applied).
    p, opt, scaler = _param_and_scaler()
    scaler.scale(p.sum()).backward()
    p.grad.mul_(scaler.unscale_factor("cuda"))
    torch.cuda.synchronize()
    busy, idle = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(SLEEP)
        scaler.record_unscaled_grads(torch.zeros(1, device="cuda"))
    with torch.cuda.stream(idle):
        scaler.record_unscaled_grads(torch.ones(1, device="cuda"))
    if consumer_waits:  # what DDP's reducer does before backward returns (it waits for the hooks' futures)
        torch.cuda.current_stream().wait_stream(busy)
        torch.cuda.current_stream().wait_stream(idle)
    before = p.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_ran().item()
    assert torch.equal(p.detach(), before)
    assert scaler.get_scale() == 512.0


def test_the_inverse_scale_read_from_another_stream_waits_for_the_update_that_changed_it():
    p, opt, scaler = _param_and_scaler()
    scaler.scale(p.sum()).backward()
    assert scaler.unscale_factor("cuda").item() == 1 / 1024
    p.grad[-1] = math.inf
    scaler.step(opt)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    scaler.update()  # halves the scale, late: behind the sleep on this stream
    with torch.cuda.stream(torch.cuda.Stream()):
        seen = scaler.unscale_factor("cuda").clone()
    torch.cuda.synchronize()  # `seen` was written on the other stream
    assert seen.item() == 1 / 512


def _ddp_buckets(rank, world, store, results):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampkit.distributed

    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).cuda()
        ddp = DDP(model, bucket_cap_mb=0.01)  # a bucket per layer: six callbacks per step, on pool streams
        opt = ampkit.optim.AdamW(ddp.parameters(), lr=1e-3)
        scaler = ampkit.GradScaler("cuda", init_scale=1024.0, growth_interval=100)
        ddp.register_comm_hook(scaler, ampkit.distributed.fp16_compress_hook)
        x = torch.randn(32, 64, device="cuda")
        history = []
        for step in range(4):
            victim = list(model.parameters())[step % 12]
            handle = victim.register_hook(lambda g: g.index_fill(0, torch.tensor([0], device="cuda"), math.inf)) \
                if step in (1, 3) else None
            before = [q.detach().clone() for q in model.parameters()]
            opt.zero_grad()
            scaler.scale(ddp(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            if handle is not None:
                handle.remove()
            moved = any(not torch.equal(b, q) for b, q in zip(before, model.parameters()))
            history.append((scaler.get_scale(), moved))
        results[rank] = history
    finally:
        ddp = None
        dist.destroy_process_group()


def test_ddp_hooks_on_pool_streams_skip_a_step_whose_inf_is_in_any_one_bucket(tmp_path):
    import torch.distributed as dist
    if not dist.is_nccl_available():
        pytest.skip("needs NCCL")
    import torch.multiprocessing as mp
    results = mp.Manager().dict()
    mp.spawn(_ddp_buckets, args=(1, str(tmp_path / "store"), results), nprocs=1, join=True)
    assert results[0] == [(1024.0, True), (512.0, False), (512.0, True), (256.0, False)]


def _min_scale_loop(**kw):
    p = torch.nn.Parameter(torch.ones(1024, device="cuda"))
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)  # takes grad_scale/found_inf: skips on the device
    scaler = ampkit.GradScaler("cuda", init_scale=2.0, min_scale=2.0, **kw)
    clean = torch.ones(1024, device="cuda")
    poisoned = clean.clone()
    poisoned[-1] = math.inf

    def step(overflow):
        opt.zero_grad(set_to_none=False)
        scaler.scale((p * (poisoned if overflow else clean)).sum()).backward()
        scaler.step(opt)
        scaler.update()

    return scaler, step


def _min_scale_warnings(caught):
    return [str(w.message) for w in caught if "min_scale" in str(w.message)]


def _no_sync(fn):
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_update_with_min_scale_makes_no_host_sync_and_warns_one_update_late():
    scaler, step = _min_scale_loop()
    step(False)  # the first update() creates the pinned copy of the count
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def overflow_while_behind():
            torch.cuda._sleep(SLEEP)  # the device runs behind: the count's copy is not done when update() polls
            step(True)

        _no_sync(overflow_while_behind)
        at_overflow = _min_scale_warnings(caught)
        torch.cuda.synchronize()
        _no_sync(lambda: step(False))
        after = _min_scale_warnings(caught)
        _no_sync(lambda: step(True))
    assert at_overflow == []
    assert len(after) == 1 and "1 time(s)" in after[0]
    assert len(_min_scale_warnings(caught)) == 1  # once
    assert scaler.stats()["overflows_at_min_scale"] == 2


def test_raise_at_min_scale_raises_from_the_next_update_while_the_device_runs_behind():
    scaler, step = _min_scale_loop(raise_at_min_scale=True)
    step(False)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    step(True)  # the count is not on the host yet
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="kept overflowing with the loss scale at min_scale"):
        step(False)
    assert not scaler._core.in_iteration()  # closed before the raise: usable and savable
    assert scaler.state_dict()["_overflows_at_min_scale"] == 1


def test_a_step_with_min_scale_is_captured_in_a_cuda_graph_and_replays_as_eager_steps():
    g = torch.Generator(device="cuda").manual_seed(2)
    xs = torch.randn(20, 16, 32, device="cuda", generator=g)
    ys = torch.randn(20, 16, 8, device="cuda", generator=g)
    xs[7, 0, 0] = math.inf  # one overflow, backing off to min_scale

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
        opt = ampkit.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"))
        return model, opt, ampkit.GradScaler("cuda", init_scale=2.0**10, min_scale=2.0**9, growth_interval=4)

    def step(model, opt, scaler, x, y):
        opt.zero_grad(set_to_none=False)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    # the capture once raised here: update() with min_scale read the device while it was captured
    eager, (model, opt, scaler) = capture_and_replay(setup, step, xs, ys)
    for a, b in zip(eager[0].parameters(), model.parameters()):
        assert bits_equal(a.detach(), b.detach())
    assert scaler.get_scale() == eager[2].get_scale()
    assert scaler.stats()["skipped_steps"] == eager[2].stats()["skipped_steps"] == 1
