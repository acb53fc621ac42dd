"""grad_stats on the CPU: the op's throughput on one large gradient per dtype (1 thread and every thread), on
three shapes of FP32 data (randn, exponents over the whole range, two clusters 2^40 apart: the last two wider than
the loop's 30-bin window, NOTE [Histogram by bit counts]), and the transformer rows of bench/run.py (the same
columns from torch ops side by side), against the copy bandwidth measured in the same process.

    python bench/grad_stats.py [--numel 33554432] [--repeats 10] [--json out.json]

grad_stats only reads its gradients, so GB/s counts the bytes read; copy bandwidth counts read + write."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as bench  # noqa: E402  (bench/run.py: copy_bandwidth, bench_grad_stats)


def best_seconds(g: torch.Tensor, repeats: int) -> float:
    """The fastest of `repeats` grad_stats calls on [g] (inv_scale 2^-16), after three warm-up calls."""
    inv = torch.full((1,), 2.0 ** -16)
    for _ in range(3):
        torch.ops.ampkit.grad_stats([g], inv)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.ops.ampkit.grad_stats([g], inv)
        best = min(best, time.perf_counter() - t0)
    return best


def single_tensor(numel: int, repeats: int, threads: int, dtype: torch.dtype) -> dict:
    torch.set_num_threads(threads)
    g = torch.randn(numel, dtype=dtype)
    best = best_seconds(g, repeats)
    return {"dtype": str(dtype).replace("torch.", ""), "threads": threads, "numel": numel, "ms": best * 1e3,
            "gelem_per_s": numel / best / 1e9, "gbps": numel * g.element_size() / best / 1e9}


def data_shapes(numel: int, repeats: int) -> list[dict]:
    """One FP32 tensor per shape of data, every thread: ms and Gelem/s."""
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(numel, generator=gen)
    sign = torch.where(torch.rand(numel, generator=gen) < 0.5, -1.0, 1.0)
    shapes = {
        "randn": normal,
        "whole range": torch.exp2(torch.randint(-130, 127, (numel,), generator=gen).float()) * sign
        * (1 + torch.rand(numel, generator=gen)),
        "two clusters": torch.where(torch.rand(numel, generator=gen) < 0.1, normal * 2.0 ** 40, normal),
    }
    rows = []
    for name, g in shapes.items():
        best = best_seconds(g, repeats)
        rows.append({"data": name, "numel": numel, "ms": best * 1e3, "gelem_per_s": numel / best / 1e9})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=32 << 20)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    cores = torch.get_num_threads()
    copy_bw = bench.copy_bandwidth("cpu", 256 << 20, args.repeats)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {cores} threads, "
          f"copy bandwidth {copy_bw:.1f} GB/s (read + write)")
    rows = []
    for threads in sorted({1, cores}):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            r = single_tensor(args.numel, args.repeats, threads, dtype)
            r["pct_of_copy_bw"] = 100 * r["gbps"] / copy_bw
            rows.append(r)
            print(f"one tensor of {args.numel}  {r['dtype']:9s} {threads} thread(s)  {r['ms']:7.2f} ms  "
                  f"{r['gelem_per_s']:5.2f} Gelem/s  {r['gbps']:6.2f} GB/s  {r['pct_of_copy_bw']:5.1f}% of copy")
    torch.set_num_threads(cores)
    for r in data_shapes(args.numel, args.repeats):
        rows.append(r)
        print(f"FP32 data: {r['data']:12s} {cores} thread(s)  {r['ms']:7.2f} ms  {r['gelem_per_s']:5.2f} Gelem/s")
    for row in bench.bench_grad_stats("cpu", False, args.repeats, copy_bw,
                                      [torch.bfloat16, torch.float16, torch.float32]):
        rows.append(row.__dict__)
        print(f"transformer grads {row.dtype:9s} ampkit {row.ampkit_ms:7.2f} ms  torch ops {row.torch_ms:8.2f} ms  "
              f"{row.speedup:5.1f}x  {row.gbps:6.2f} GB/s  {row.pct_of_copy_bw:5.1f}% of copy")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw_gbps": copy_bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
