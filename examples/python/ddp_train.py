"""Data-parallel training with DDP and ampkit: each rank runs train_demo's classifier (64 -> 256 -> 256 -> 10) under
DistributedDataParallel with ampkit's FP16 compression hook that unscales for the scaler
(``fp16_compress_unscale_hook``: the bucket all-reduced in 2 bytes, unscaled and checked for the scaler on the way
back), ampkit.GradScaler and ampkit.optim.AdamW, on a fixed synthetic 10-class problem. The ranks are processes on
this machine (Gloo); a GPU run would use NCCL and device="cuda".

Usage: python examples/python/ddp_train.py [--world 2] [--steps 60] [--hook fp16|bf16|none]
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import ampkit
import ampkit.distributed


def make_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def batch(teacher: torch.Tensor, step: int, rank: int, world: int, per_rank: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(per_rank * world, 64, generator=g)
    y = (x @ teacher).argmax(1)
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def rank_main(rank: int, world: int, store: str, steps: int, hook: str) -> None:
    torch.set_num_threads(1)  # one core per rank
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = DDP(make_model())
        optimizer = ampkit.optim.AdamW(model.parameters(), lr=2e-3)
        scaler = ampkit.GradScaler("cpu", init_scale=65536.0, growth_interval=20)
        if hook != "none":
            model.register_comm_hook(scaler, getattr(ampkit.distributed, f"{hook}_compress_unscale_hook"))
        teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))
        first = last = 0.0
        for step in range(steps):
            x, y = batch(teacher, step, rank, world, 64 // world)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            last = loss.item()
            first = last if step == 0 else first
            if rank == 0 and step % 10 == 0:
                print(f"step {step:3d}  loss {last:.4f}  scale {scaler.get_scale():.0f}", flush=True)
        checksum = sum(p.detach().double().abs().sum().item() for p in model.parameters())
        stats = scaler.stats()
        print(f"rank {rank}: first loss {first:.4f}, last loss {last:.4f}, skipped {stats['skipped_steps']} of "
              f"{stats['steps']} steps, weight checksum {checksum:.17g}", flush=True)
    finally:
        # The DDP reducer holds the process group. Dropped here, before destroy_process_group, it is not the last
        # holder, so the group is destroyed by destroy_process_group's release (which torch makes without the
        # GIL), not by the reducer's deallocation under the GIL, where ProcessGroupGloo's destructor can wait
        # forever for a worker thread that is waiting for the GIL.
        model = None
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hook", choices=["fp16", "bf16", "none"], default="fp16")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(args.world, os.path.join(tmp, "store"), args.steps, args.hook), nprocs=args.world,
                 join=True)


if __name__ == "__main__":
    main()
