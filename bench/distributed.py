"""Compressed gradient all-reduce on Gloo ranks, ampkit against torch, side by side in one run.

Each configuration trains the same model (one 2048 x 2048 Linear layer plus bias: 4.2 M FP32 gradients, one DDP
bucket of 16 MB at bucket_cap_mb=25) for some steps on every rank, ampkit.GradScaler or torch.amp.GradScaler with
ampkit.optim.AdamW, and reports per step: the median time of a whole step (forward, backward with the
all-reduce, scaler step and update) on rank 0, the bytes each rank hands to the all-reduce, and the bytes of
gradient memory read and written outside the all-reduce by the hook and the scaler's unscale/check (counted from
what each implementation does, per FP32 gradient element):
  DDP, no hook + torch GradScaler: unscale in place (read 4, write 4)                             =  8 B, 1 pass
  torch fp16_compress_hook + torch GradScaler: cast (r4 w2), divide (r2 w2), copy back (r2 w4),
      unscale in place (r4 w4)                                                                    = 28 B, 4 passes
  ampkit fp16_compress_hook + ampkit GradScaler: the same four passes, the unscale-and-check done
      by the hook (ampkit's kernel); the scaler neither unscales nor checks again                 = 28 B, 4 passes
  ampkit::distributed::GradientAllReduce (fp16): cast each grad into the flat buffer (r4 w2),
      divide (r2 w2), copy back into each grad (r2 w4), unscale and check (r4 w4); DDP's copies of
      grads into and out of its bucket (r4 w4 each way) do not exist                              = 28 B, 4 passes
Time on this machine is the loopback all-reduce of 2 processes on 2 cores: a noisy, CPU-bound stand-in for a
network; the bytes are what a network would carry.

Usage: python bench/distributed.py [--world 2] [--steps 12] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ampkit
import ampkit.distributed

CONFIGS = [
    ("ddp_fp32_torch_scaler", "DDP FP32, torch GradScaler", 4, 8, 1),
    ("ddp_torch_fp16_hook", "DDP + torch fp16_compress_hook, torch GradScaler", 2, 28, 4),
    ("ddp_ampkit_fp16_hook", "DDP + ampkit fp16_compress_hook, ampkit GradScaler", 2, 28, 4),
    ("ampkit_allreduce_fp16", "ampkit GradientAllReduce fp16, ampkit GradScaler", 2, 28, 4),
]


def _rank(rank, world, store, steps, name, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(2048, 2048)
        torch_scaler = name in ("ddp_fp32_torch_scaler", "ddp_torch_fp16_hook")
        scaler = (torch.amp.GradScaler if torch_scaler else ampkit.GradScaler)("cpu", init_scale=1024.0)
        sync = None
        if name == "ampkit_allreduce_fp16":
            net = model
            sync = ampkit.distributed.GradientAllReduce(model.parameters(), compression="fp16", scaler=scaler)
        else:
            net = DDP(model)
            if name == "ddp_torch_fp16_hook":
                net.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif name == "ddp_ampkit_fp16_hook":
                net.register_comm_hook(scaler, ampkit.distributed.fp16_compress_hook)
        opt = ampkit.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(16, 2048)
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            scaler.scale(net(x).square().mean()).backward()
            if sync is not None:
                sync.synchronize()
            scaler.step(opt)
            scaler.update()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            results[name] = statistics.median(times[2:]) * 1e3
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json")
    args = parser.parse_args()
    numel = 2048 * 2048 + 2048
    results = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, *_rest) in enumerate(CONFIGS):
            mp.spawn(_rank, args=(args.world, os.path.join(tmp, f"store{i}"), args.steps, name, results),
                     nprocs=args.world, join=True)
    base = results["ddp_torch_fp16_hook"]
    rows = []
    print(f"{args.world} Gloo ranks, {numel / 1e6:.1f} M FP32 gradients, torch {torch.__version__}, median of "
          f"{args.steps - 2} steps")
    print(f"{'configuration':<55} {'step ms':>8} {'vs torch hook':>13} {'MB sent':>8} {'B/elem outside':>15}"
          f" {'passes':>6}")
    for name, label, wire, touched, passes in CONFIGS:
        ms = results[name]
        row = dict(config=name, label=label, step_ms=ms, speedup_vs_torch_fp16_hook=base / ms,
                   bytes_sent=numel * wire, bytes_per_elem_outside_allreduce=touched, passes=passes)
        rows.append(row)
        print(f"{label:<55} {ms:8.1f} {base / ms:12.2f}x {numel * wire / 1e6:8.1f} {touched:15d} {passes:6d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(world=args.world, numel=numel, torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
