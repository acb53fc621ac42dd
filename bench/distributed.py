"""Compressed gradient all-reduce on Gloo ranks, ampkit against torch, side by side in one run.

Each configuration trains the same model (one 2048 x 2048 Linear layer plus bias: 4.2 M FP32 gradients, one DDP
bucket of 16 MB at bucket_cap_mb=25) for some steps on every rank, ampkit.GradScaler or torch.amp.GradScaler with
ampkit.optim.AdamW, and reports per step: the median time of a whole step (forward, backward with the
all-reduce, scaler step and update) on rank 0, the bytes each rank hands to the all-reduce, and the bytes of
gradient memory read and written outside the all-reduce by the hook and the scaler's unscale/check (counted from
what each implementation does, per FP32 gradient element):
  DDP, no hook + torch GradScaler: unscale in place (read 4, write 4)                             =  8 B, 1 pass
  torch fp16_compress_hook + torch GradScaler: cast (r4 w2), divide (r2 w2), copy back (r2 w4),
      unscale in place (r4 w4)                                                                    = 24 B, 4 passes
  ampkit fp16_compress_hook + ampkit GradScaler: cast and divide in one pass (r4 w2: cast_divide_),
      widen, unscale and check in one pass (r2 w4: cast_unscale_and_check_); the scaler neither
      unscales nor checks again                                                                   = 12 B, 2 passes
  ampkit::distributed::GradientAllReduce (fp16): the same two passes straight between each grad and
      the flat buffer; DDP's copies of grads into and out of its bucket (r4 w4 each way) do not
      exist                                                                                       = 12 B, 2 passes
The passes alone are also timed in this process (one thread per pass, as on a rank), torch's four against
ampkit's two over the same 4.2 M elements, with the bytes each moves.

FSDP2 rows: the same layer under ``fully_shard`` (one FSDP module, the root: one all-gather of the parameters in
the forward, none in the backward), ampkit.GradScaler with ampkit.optim.AdamW, gradients reduced by FSDP2's default
reduce-scatter (FP32), by FSDP2 with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` (torch's BF16
reduce-scatter: Gloo adds in BF16), or by ``ampkit.distributed.compress_fsdp`` (BF16 or FP16 on the wire, FP32
sums). Their bytes are counted, not derived: each rank reads the bytes its process wrote to its sockets
(``wchar`` of /proc/self/io: Gloo's sends, headers of its own protocol included) around the forward, the backward and
the scaler's step + update of every step, and reports the median per phase; the backward's is the gradient
reduction. A ring reduce-scatter (NCCL) would send (world-1)/world of the buffer instead of Gloo's whole buffer.
Time on this machine is the loopback all-reduce of 2 processes on 2 cores: a noisy, CPU-bound stand-in for a
network; the bytes are what a network would carry.

Usage: python bench/distributed.py [--world 2] [--steps 12] [--only ddp|fsdp2] [--json PATH]
"""
from __future__ import annotations

import argparse
import gc
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
    ("ddp_torch_fp16_hook", "DDP + torch fp16_compress_hook, torch GradScaler", 2, 24, 4),
    ("ddp_ampkit_fp16_hook", "DDP + ampkit fp16_compress_unscale_hook, ampkit GradScaler", 2, 12, 2),
    ("ampkit_allreduce_fp16", "ampkit GradientAllReduce fp16, ampkit GradScaler", 2, 12, 2),
]
# (name, label, MixedPrecisionPolicy.reduce_dtype, compress_fsdp's dtype or None)
FSDP_CONFIGS = [
    ("fsdp2_fp32", "FSDP2 default (FP32 reduce-scatter), ampkit GradScaler", None, None),
    ("fsdp2_bf16_reduce_dtype", "FSDP2 reduce_dtype=BF16 (Gloo adds in BF16)", torch.bfloat16, None),
    ("fsdp2_ampkit_bf16", "FSDP2 + ampkit compress_fsdp BF16, FP32 sums", None, torch.bfloat16),
    ("fsdp2_ampkit_fp16", "FSDP2 + ampkit compress_fsdp FP16, FP32 sums", None, torch.float16),
]


def _bytes_written() -> int:
    """Bytes this process has written (sockets included) so far: /proc/self/io's wchar; -1 where there is none."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except OSError:
        return -1


def _fsdp_rank(rank, world, store, steps, name, results):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = opt = compression = None
    try:
        _, _, reduce_dtype, wire = next(c for c in FSDP_CONFIGS if c[0] == name)
        torch.manual_seed(0)
        model = torch.nn.Linear(2048, 2048)
        fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
        scaler = ampkit.GradScaler("cpu", init_scale=1024.0)
        compression = None if wire is None else ampkit.distributed.compress_fsdp(model, scaler, dtype=wire)
        opt = ampkit.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(16, 2048)
        times, phases = [], {"forward": [], "backward": [], "step": []}
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            b0 = _bytes_written()
            opt.zero_grad()
            loss = scaler.scale(model(x).square().mean())
            b1 = _bytes_written()
            loss.backward()
            b2 = _bytes_written()
            scaler.step(opt)
            scaler.update()
            b3 = _bytes_written()
            times.append(time.perf_counter() - t0)
            for phase, n in zip(phases, (b1 - b0, b2 - b1, b3 - b2)):
                phases[phase].append(n)
        if rank == 0:
            results[name] = dict(step_ms=statistics.median(times[2:]) * 1e3,
                                 bytes={k: statistics.median(v[2:]) for k, v in phases.items()},
                                 compressed_bytes_per_step=None if compression is None
                                 else compression.bytes_sent() // steps)
    finally:
        model = opt = compression = None  # DTensors hold the group: gone before it (see tests/python/test_fsdp2.py)
        gc.collect()
        dist.destroy_process_group()


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
                net.register_comm_hook(scaler, ampkit.distributed.fp16_compress_unscale_hook)
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
        model = net = None  # the DDP reducer first (see the finally of examples/python/ddp_train.py)
        dist.destroy_process_group()


def _time_passes(numel: int, world: int, reps: int = 15) -> dict:
    """Median ms of the passes outside the all-reduce (compress, then decompress + unscale + check), one thread."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    bucket = torch.randn(numel) * 1024
    inv = torch.full((1,), 1 / 1024.0)
    found = torch.zeros(1)

    def torch_passes():
        wire = bucket.to(torch.float16).div_(world)  # torch's fp16_compress_hook
        bucket.copy_(wire)
        torch._amp_foreach_non_finite_check_and_unscale_([bucket], found, inv)  # torch.amp.GradScaler

    wire = torch.empty(numel, dtype=torch.float16)

    def ampkit_passes():
        torch.ops.ampkit.cast_divide_([bucket], [wire], float(world))
        torch.ops.ampkit.cast_unscale_and_check_([wire], [bucket], found, inv)

    out = {}
    for name, fn, nbytes in (("torch", torch_passes, 24), ("ampkit", ampkit_passes, 12)):
        fn()
        times = []
        for _ in range(reps):
            bucket.normal_().mul_(1024)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        out[name] = dict(ms=ms, bytes_per_elem=nbytes, gb_per_s=numel * nbytes / (ms * 1e-3) / 1e9)
    # The machine's bound for reference: an in-place FP32 scale (read 4, write 4) of the same elements.
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        bucket.mul_(0.5)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    out["inplace_mul_fp32"] = dict(ms=ms, bytes_per_elem=8, gb_per_s=numel * 8 / (ms * 1e-3) / 1e9)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", choices=("ddp", "fsdp2"))
    parser.add_argument("--json")
    args = parser.parse_args()
    numel = 2048 * 2048 + 2048
    results = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as tmp:
        runs = ([] if args.only == "fsdp2" else [(_rank, c[0]) for c in CONFIGS]) + (
            [] if args.only == "ddp" else [(_fsdp_rank, c[0]) for c in FSDP_CONFIGS])
        for i, (fn, name) in enumerate(runs):
            mp.spawn(fn, args=(args.world, os.path.join(tmp, f"store{i}"), args.steps, name, results),
                     nprocs=args.world, join=True)
    print(f"{args.world} Gloo ranks, {numel / 1e6:.1f} M FP32 gradients, torch {torch.__version__}, median of "
          f"{args.steps - 2} steps")
    rows = [] if args.only == "fsdp2" else _ddp_table(args, numel, results)
    fsdp_rows = [] if args.only == "ddp" else _fsdp_table(results)
    passes = None if args.only == "fsdp2" else _passes_table(args, numel)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(world=args.world, numel=numel, torch=torch.__version__, rows=rows, fsdp2_rows=fsdp_rows,
                           passes=passes), f, indent=1)


def _ddp_table(args, numel: int, results) -> list:
    base = results["ddp_torch_fp16_hook"]
    rows = []
    print(f"{'configuration':<55} {'step ms':>8} {'vs torch hook':>13} {'MB sent':>8} {'B/elem outside':>15}"
          f" {'passes':>6}")
    for name, label, wire, touched, passes in CONFIGS:
        ms = results[name]
        row = dict(config=name, label=label, step_ms=ms, speedup_vs_torch_fp16_hook=base / ms,
                   bytes_sent=numel * wire, bytes_per_elem_outside_allreduce=touched, passes=passes)
        rows.append(row)
        print(f"{label:<55} {ms:8.1f} {base / ms:12.2f}x {numel * wire / 1e6:8.1f} {touched:15d} {passes:6d}")
    return rows


def _fsdp_table(results) -> list:
    """The FSDP2 rows: bytes each rank wrote per step, by phase, against FSDP2's default."""
    base = results["fsdp2_fp32"]["bytes"]["backward"]
    rows = []
    print("FSDP2, bytes rank 0 wrote to its sockets per step (median), forward (all-gather), backward (gradient "
          "reduction), step + update:")
    print(f"{'configuration':<55} {'step ms':>8} {'fwd MB':>7} {'bwd MB':>7} {'step B':>7} {'bwd vs default':>14}")
    for name, label, _, _ in FSDP_CONFIGS:
        r = results[name]
        b = r["bytes"]
        rows.append(dict(config=name, label=label, step_ms=r["step_ms"], bytes_forward=b["forward"],
                         bytes_backward=b["backward"], bytes_step=b["step"],
                         backward_vs_default=b["backward"] / base,
                         compressed_bytes_per_step=r["compressed_bytes_per_step"]))
        print(f"{label:<55} {r['step_ms']:8.1f} {b['forward'] / 1e6:7.2f} {b['backward'] / 1e6:7.2f} "
              f"{b['step']:7.0f} {b['backward'] / base:13.3f}x")
    return rows


def _passes_table(args, numel: int) -> dict:
    passes = _time_passes(numel, args.world)
    print(f"passes outside the all-reduce, one thread, {numel / 1e6:.1f} M elements:")
    for name, label in (("torch", "torch: cast, divide, copy back, unscale+check"),
                        ("ampkit", "ampkit: cast_divide_, cast_unscale_and_check_"),
                        ("inplace_mul_fp32", "reference: in-place FP32 mul_ (r4 w4)")):
        r = passes[name]
        print(f"  {label:<50} {r['ms']:7.2f} ms {r['bytes_per_elem']:3d} B/elem {r['gb_per_s']:6.1f} GB/s"
              + (f"  {passes['torch']['ms'] / r['ms']:.2f}x torch" if name == "ampkit" else ""))
    return passes


if __name__ == "__main__":
    main()
