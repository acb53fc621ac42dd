"""Two ranks on Gloo: the scaler all-reduces found_inf over its process group, so when only one rank's grads
overflow, both skip the step and back off together."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ampkit


def _worker(rank: int, world: int, store_path: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.ones(8))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = ampkit.GradScaler("cpu", init_scale=1024.0, process_group=dist.group.WORLD)
        history = []
        for step in range(4):
            opt.zero_grad()
            scaler.scale((p * (rank + 1)).sum()).backward()
            if step == 1 and rank == 1:
                p.grad[-1] = math.inf  # only rank 1 overflows
            scaler.step(opt)
            scaler.update()
            history.append((scaler.get_scale(), p.detach().clone().tolist(), bool(scaler.last_step_ran().item())))
        results[rank] = (history, scaler.stats())
    finally:
        dist.destroy_process_group()


def test_two_ranks_skip_together_when_one_overflows(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True)
    h0, stats0 = results[0]
    h1, stats1 = results[1]
    scales0 = [h[0] for h in h0]
    assert scales0 == [h[0] for h in h1] == [1024.0, 512.0, 512.0, 512.0]
    assert [h[2] for h in h0] == [h[2] for h in h1] == [True, False, True, True]
    # Rank 0's params did not move on step 1 although its own grads were finite.
    assert h0[1][1] == h0[0][1]
    assert stats0["skipped_steps"] == stats1["skipped_steps"] == 1
