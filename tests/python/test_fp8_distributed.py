"""Two ranks on Gloo: ampkit.fp8.sync_amaxes makes the delayed-scaling amaxes (and so the scales) of every rank
agree, either in the GradScaler's found_inf all-reduce (no collective of its own) or in one collective of its own;
both ranks skip together when one overflows, and end with the same scales and weights."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ampkit
from ampkit import fp8

ITERS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    return fp8.convert(model, fp8.DelayedScaling(amax_history_len=3))


def _all_reduces(prof) -> int:
    return sum(1 for e in prof.events() if e.name == "c10d::allreduce_")


def _iteration(model, opt, scaler, x, mode, overflow):
    opt.zero_grad()
    loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    for p in model.parameters():  # data parallel: average the grads
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    if overflow:
        model[0].weight.grad[-1, -1] = math.inf
    before = [r.clone() for r in fp8.current_amaxes(model)]
    if mode == "scaler":
        fp8.sync_amaxes(model, scaler)
    elif mode == "group":
        fp8.sync_amaxes(model, process_group=dist.group.WORLD)
    scaler.step(opt)
    scaler.update()
    return before, [r.clone() for r in fp8.current_amaxes(model)]


def _worker(rank: int, world: int, store_path: str, mode: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = ampkit.GradScaler("cpu", init_scale=256.0, process_group=dist.group.WORLD)
        g = torch.Generator().manual_seed(100 + rank)
        rows = []
        counts = []
        for it in range(ITERS):
            x = torch.randn(16, 32, generator=g) * (1.0 + 2.0 * rank + it)  # amaxes differ by rank
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                before, after = _iteration(model, opt, scaler, x, mode, overflow=(it == 2 and rank == 1))
            counts.append(_all_reduces(prof))
            rows.append((before, after, bool(scaler.last_step_ran().item())))
        buffers = {k: v.clone() for k, v in model.state_dict().items()}
        results[rank] = (rows, counts, buffers)
    finally:
        dist.destroy_process_group()


def _run(tmp_path, mode):
    tmp_path.mkdir(parents=True, exist_ok=True)
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), mode, results), nprocs=2, join=True)
    return results[0], results[1]


def _check_agreement(r0, r1):
    rows0, _, state0 = r0
    rows1, _, state1 = r1
    for it in range(ITERS):
        before0, after0, ran0 = rows0[it]
        before1, after1, ran1 = rows1[it]
        assert ran0 == ran1 == (it != 2)  # rank 1's overflow skips both
        assert len(after0) == 6
        for b0, b1, a0, a1 in zip(before0, before1, after0, after1):
            torch.testing.assert_close(a0, torch.maximum(b0, b1), rtol=0, atol=0)
            torch.testing.assert_close(a1, a0, rtol=0, atol=0)
        # The inputs' amaxes differ by rank: the reduction did something.
        assert not torch.equal(before0[0], before1[0])
    assert state0.keys() == state1.keys()
    for k in state0:
        torch.testing.assert_close(state0[k], state1[k], rtol=0, atol=0, msg=k)


def test_amaxes_travel_in_the_scalers_found_inf_all_reduce(tmp_path):
    r0, r1 = _run(tmp_path, "scaler")
    _check_agreement(r0, r1)
    # The same number of all-reduces as a run whose amaxes are not synchronized: none of their own.
    base0, _ = _run(tmp_path / "base", "none")
    assert r0[1] == r1[1] == base0[1]
    assert all(c == base0[1][0] for c in base0[1])


def test_amaxes_all_reduced_in_one_collective_of_their_own(tmp_path):
    r0, r1 = _run(tmp_path, "group")
    _check_agreement(r0, r1)
    base0, _ = _run(tmp_path / "base", "none")
    assert [c - b for c, b in zip(r0[1], base0[1])] == [1] * ITERS


def test_unsynchronized_ranks_diverge(tmp_path):
    """What the synchronization prevents: each rank's scales follow its own data."""
    r0, r1 = _run(tmp_path, "none")
    assert not torch.equal(r0[2]["0.scale_input"], r1[2]["0.scale_input"])
