"""ampkit benchmarks, side by side with PyTorch's own equivalent in one process.

Each row times ampkit and torch interleaved (median of many runs) on the same inputs and reports:
  name, device, case, dtype, ampkit_ms, torch_ms, speedup (torch_ms / ampkit_ms),
  gbps (achieved by ampkit, from the bytes that must move) and pct_of_copy_bw (against the copy bandwidth of
  that device, measured in the same run with tensor.copy_).

Usage: python bench/run.py [--quick] [--device cpu|cuda|all] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

import ampkit


@dataclass
class Row:
    name: str
    device: str
    case: str
    dtype: str
    ampkit_ms: float
    torch_ms: Optional[float]
    speedup: Optional[float]
    gbps: float
    pct_of_copy_bw: float


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_pair(device: str, fns: list[Callable[[], None]], repeats: int, inner: int) -> list[float]:
    """Median milliseconds per call of each fn, timed interleaved: A, B, A, B, ..."""
    samples: list[list[float]] = [[] for _ in fns]
    for fn in fns:  # warm-up
        fn()
    _sync(device)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
                samples[i].append(start.elapsed_time(end) / inner)
            else:
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                samples[i].append((time.perf_counter() - t0) * 1e3 / inner)
    return [statistics.median(s) for s in samples]


def copy_bandwidth(device: str, nbytes: int, repeats: int) -> float:
    """GB/s of dst.copy_(src) for nbytes (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    (ms,) = time_pair(device, [lambda: dst.copy_(src)], repeats, 5)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def model_shapes(case: str, quick: bool, device: str) -> list[tuple[int, ...]]:
    small = quick or device == "cpu"
    if case == "flat":
        # Several times the last-level cache, so that it measures memory and not cache bandwidth.
        return [(1 << (26 if device == "cpu" or quick else 28),)]
    if case == "transformer":
        h = 256 if small else 1024
        layers = 12 if small else 24
        shapes: list[tuple[int, ...]] = [(32000 if not small else 8000, h)]
        for _ in range(layers):
            shapes += [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,), (h,),
                       (h,)]
        return shapes
    if case == "many_small":
        return [(1000 + (i % 7),) for i in range(2000 if small else 5000)]
    raise ValueError(case)


def torch_accepts(dtype: torch.dtype, device: str) -> bool:
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(4, dtype=dtype, device=device)], torch.zeros(1, device=device), torch.ones(1, device=device))
        return True
    except RuntimeError:
        return False


def bench_device(device: str, quick: bool) -> list[Row]:
    rows: list[Row] = []
    repeats = 7 if quick else 25
    inner = 3 if device == "cpu" else 20
    probe_bytes = (256 << 20) if device == "cpu" else (2 << 30)
    copy_bw = copy_bandwidth(device, probe_bytes, repeats)
    print(f"[{device}] copy bandwidth {copy_bw:.1f} GB/s", file=sys.stderr)
    dtypes = [torch.float16, torch.bfloat16] if device == "cuda" else [torch.bfloat16, torch.float32]
    for case in ["flat", "transformer", "many_small"]:
        shapes = model_shapes(case, quick, device)
        for dtype in dtypes:
            torch.manual_seed(0)
            grads = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
            theirs = [g.clone() for g in grads]
            numel = sum(g.numel() for g in grads)
            nbytes = numel * grads[0].element_size()
            found = torch.zeros(1, device=device)
            # Alternate x2 and x0.5 so repeated in-place calls keep the values where they started.
            invs = [torch.full((1,), 2.0, device=device), torch.full((1,), 0.5, device=device)]
            state = {"a": 0, "t": 0}

            def run_ampkit() -> None:
                state["a"] ^= 1
                torch.ops.ampkit.unscale_and_check_(grads, found, invs[state["a"]])

            def run_torch() -> None:
                state["t"] ^= 1
                torch._amp_foreach_non_finite_check_and_unscale_(theirs, found, invs[state["t"]])

            accepts = torch_accepts(dtype, device)
            fns = [run_ampkit, run_torch] if accepts else [run_ampkit]
            times = time_pair(device, fns, repeats, inner)
            a_ms = times[0]
            t_ms = times[1] if accepts else None
            gbps = 2 * nbytes / (a_ms * 1e-3) / 1e9
            rows.append(Row("unscale_and_check", device, case, str(dtype).replace("torch.", ""), a_ms, t_ms,
                            (t_ms / a_ms) if t_ms else None, gbps, 100 * gbps / copy_bw))

            def check_ampkit() -> None:
                torch.ops.ampkit.check_finite_(grads, found)

            # torch has no read-only check: its nearest equivalent is the unscale with inv_scale == 1.
            one = torch.ones(1, device=device)

            def check_torch() -> None:
                torch._amp_foreach_non_finite_check_and_unscale_(theirs, found, one)

            fns = [check_ampkit, check_torch] if accepts else [check_ampkit]
            times = time_pair(device, fns, repeats, inner)
            t_ms = times[1] if accepts else None
            gbps = nbytes / (times[0] * 1e-3) / 1e9
            rows.append(Row("check_finite", device, case, str(dtype).replace("torch.", ""), times[0], t_ms,
                            (t_ms / times[0]) if t_ms else None, gbps, 100 * gbps / copy_bw))

    scale = torch.full((1,), 1024.0, device=device)
    tracker = torch.zeros(1, dtype=torch.int32, device=device)
    t_scale, t_tracker = scale.clone(), tracker.clone()
    found = torch.zeros(1, device=device)
    times = time_pair(device, [lambda: torch.ops.ampkit.update_scale_(scale, tracker, found, 2.0, 0.5, 2000),
                               lambda: torch._amp_update_scale_(t_scale, t_tracker, found, 2.0, 0.5, 2000)],
                      repeats, 50)
    rows.append(Row("update_scale", device, "scalar", "float32", times[0], times[1], times[1] / times[0], 0.0, 0.0))
    return rows


def print_table(rows: list[Row]) -> None:
    head = f"{'name':<18} {'device':<6} {'case':<12} {'dtype':<9} {'ampkit_ms':>10} {'torch_ms':>10} " \
           f"{'speedup':>8} {'gbps':>8} {'%copy':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        t = f"{r.torch_ms:10.4f}" if r.torch_ms is not None else f"{'refuses':>10}"
        s = f"{r.speedup:8.2f}" if r.speedup is not None else f"{'-':>8}"
        print(f"{r.name:<18} {r.device:<6} {r.case:<12} {r.dtype:<9} {r.ampkit_ms:10.4f} {t} {s} "
              f"{r.gbps:8.1f} {r.pct_of_copy_bw:6.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller inputs and fewer repeats")
    parser.add_argument("--device", default="all", choices=["cpu", "cuda", "all"])
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list of objects")
    args = parser.parse_args()
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"ampkit bench: torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} CPU threads, GPU {gpu}, build {ampkit.build_info()}", file=sys.stderr)
    rows: list[Row] = []
    for device in devices:
        rows += bench_device(device, args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    print_table(rows)


if __name__ == "__main__":
    main()
