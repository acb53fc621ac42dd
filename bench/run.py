"""ampkit benchmarks, side by side with PyTorch's own equivalent in one process.

Each row times ampkit and torch interleaved (median of many runs) on the same inputs and reports:
  name, device, case, dtype, ampkit_ms, torch_ms, speedup (torch_ms / ampkit_ms),
  gbps (achieved by ampkit, from the bytes that must move), pct_of_copy_bw (against the copy bandwidth of
  that device, measured in the same run with tensor.copy_) and pct_of_inplace_bw (%inpl: against an in-place
  x.mul_(c) over the same 256 MiB / 2 GiB, read + write counted). The unscale and the optimizer steps are in-place
  passes: a copy into a second buffer also pays a write-allocate read of its destination, which an in-place pass
  does not, so %inpl compares like with like and %copy can exceed 100%.

Usage: python bench/run.py [--quick] [--no-compile] [--device cpu|cuda|all] [--json PATH] [--jsonl PATH]
       python bench/run.py --traffic [--json PATH]
       python bench/run.py --lean [--quick] [--device cpu|cuda|all] [--json PATH] [--jsonl PATH]
       python bench/run.py --fp8 [--quick] [--device cpu|cuda|all] [--json PATH] [--jsonl PATH]

--jsonl writes each row as one JSON line the moment it is measured (flushed), so a run stopped part way keeps
the rows it had; --json writes the whole list at the end. --no-compile leaves out the torch.compile'd step (its
compile alone takes minutes on a cold machine).

--traffic prints, for each CUDA kernel, the bytes of tensor data it reads and writes per parameter, counted by
running the kernels through the emulated host build (no GPU needed: the build's bench/ampkit_traffic), next to
the minimum the design promises, and what the emulator's memory-transaction model makes of the same launches:
sector efficiency against its goal, shared-memory wavefronts per request, global atomics per million elements,
the modelled fraction of copy bandwidth, and the source position that wastes the most sectors.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
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
    note: str = ""

    def __post_init__(self) -> None:
        # A row is complete when it is built: streamed at once (--jsonl) rather than when its section ends.
        if ROW_STREAM is not None:
            ROW_STREAM.write(json.dumps(row_dict(self)) + "\n")
            ROW_STREAM.flush()


ROW_STREAM = None  # the --jsonl file, open while the benchmarks run


def row_dict(r: Row) -> dict:
    return dict(asdict(r), pct_of_inplace_bw=100 * r.gbps / INPLACE_BW[r.device] if r.device in INPLACE_BW else 0.0)


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


def inplace_bandwidth(device: str, nbytes: int, repeats: int) -> float:
    """GB/s of x.mul_(c) over nbytes (read + write counted): an in-place pass, as the optimizer steps and the
    unscale are, without the write-allocate traffic a copy into a second buffer pays."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    factors = [2.0, 0.5]  # alternating, so that the values stay where they started
    state = {"i": 0}

    def scale() -> None:
        state["i"] ^= 1
        x.mul_(factors[state["i"]])
    (ms,) = time_pair(device, [scale], repeats, 5)
    return 2 * nbytes / (ms * 1e-3) / 1e9


INPLACE_BW: dict[str, float] = {}  # per device, measured with the copy bandwidth


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


def measure_bandwidth(device: str, repeats: int) -> float:
    """The device's copy bandwidth (returned) and in-place bandwidth (kept in INPLACE_BW), printed."""
    probe_bytes = (256 << 20) if device == "cpu" else (2 << 30)
    copy_bw = copy_bandwidth(device, probe_bytes, repeats)
    INPLACE_BW[device] = inplace_bandwidth(device, probe_bytes, repeats)
    print(f"[{device}] copy bandwidth {copy_bw:.1f} GB/s, in-place bandwidth {INPLACE_BW[device]:.1f} GB/s",
          file=sys.stderr)
    return copy_bw


def bench_device(device: str, quick: bool, compile_step: bool = True) -> list[Row]:
    rows: list[Row] = []
    repeats = 7 if quick else 25
    inner = 3 if device == "cpu" else 20
    copy_bw = measure_bandwidth(device, repeats)
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

    rows += bench_grad_stats(device, quick, repeats, copy_bw, dtypes)
    rows += bench_optimizers(device, quick, repeats, copy_bw)
    rows += bench_lamb(device, quick, repeats, copy_bw)
    if compile_step:
        rows += bench_compiled_step(device, quick, repeats)
    rows += bench_fp8_quantize(device, quick, repeats, copy_bw)
    rows += bench_fp8_linear(device, quick, repeats)

    scale = torch.full((1,), 1024.0, device=device)
    tracker = torch.zeros(1, dtype=torch.int32, device=device)
    t_scale, t_tracker = scale.clone(), tracker.clone()
    found = torch.zeros(1, device=device)
    o_scale, o_tracker = scale.clone(), tracker.clone()
    # Each library's Python entry point (ampkit.ops binds the op by position; torch.ops parses a schema first).
    times = time_pair(device, [lambda: ampkit.ops.update_scale_(scale, tracker, found, 2.0, 0.5, 2000),
                               lambda: torch._amp_update_scale_(t_scale, t_tracker, found, 2.0, 0.5, 2000),
                               lambda: torch.ops.ampkit.update_scale_(o_scale, o_tracker, found, 2.0, 0.5, 2000)],
                      repeats, 50)
    rows.append(Row("update_scale", device, "scalar", "float32", times[0], times[1], times[1] / times[0], 0.0, 0.0,
                    f"ampkit.ops vs torch._amp_update_scale_; via torch.ops.ampkit {times[2] * 1e3:.2f} us"))
    return rows


def torch_grad_stats(grads: list[torch.Tensor], inv: torch.Tensor) -> torch.Tensor:
    """grad_stats' columns from torch ops, tensor by tensor (torch has no fused equivalent)."""
    rows = []
    cols = ampkit.GRAD_STATS_COLUMNS
    for g in grads:
        x = g.float().flatten()
        finite = x.isfinite()
        live = x[finite & (x != 0)].abs().double() * inv.double()
        _, e = torch.frexp(live)
        bins = (e.long() - 1 - ampkit.GRAD_STATS_HIST_MIN_EXP + 1).clamp_(0, cols - ampkit.GRAD_STATS_HIST_FIRST - 1)
        head = torch.stack([live.max() if live.numel() else live.new_zeros(()),
                            x[finite].double().square().sum().sqrt() * inv.double().squeeze(),
                            (~finite).sum().double(), (x == 0).sum().double()])
        rows.append(torch.cat([head.flatten(), torch.bincount(bins, minlength=cols - 4).double()]))
    return torch.stack(rows)


def bench_grad_stats(device: str, quick: bool, repeats: int, copy_bw: float, dtypes) -> list[Row]:
    rows: list[Row] = []
    shapes = model_shapes("transformer", quick, device)
    inv = torch.full((1,), 2.0 ** -16, device=device)
    for dtype in dtypes:
        torch.manual_seed(0)
        grads = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
        nbytes = sum(g.numel() for g in grads) * grads[0].element_size()
        times = time_pair(device, [lambda: torch.ops.ampkit.grad_stats(grads, inv),
                                   lambda: torch_grad_stats(grads, inv)], repeats, 1)
        gbps = nbytes / (times[0] * 1e-3) / 1e9
        rows.append(Row("grad_stats", device, "transformer", str(dtype).replace("torch.", ""), times[0], times[1],
                        times[1] / times[0], gbps, 100 * gbps / copy_bw))
    return rows


class ForeachLAMB:
    """LAMB written with torch's foreach ops (torch has no LAMB; this is the best composite it offers): Apex
    FusedLAMB's formulas with adam_w_mode, bias correction, global-norm clipping and per-tensor trust ratios, on FP32
    states. `copies`: low-precision copies of the params refreshed after each step (torch's O2 path)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0,
                 copies=None):
        self.params, self.lr, self.betas, self.eps, self.wd = params, lr, betas, eps, weight_decay
        self.max_grad_norm, self.copies, self.t = max_grad_norm, copies, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        b1, b2 = self.betas
        self.t += 1
        grads = [p.grad for p in self.params]
        norm = torch.nn.utils.get_total_norm(grads)
        g = torch._foreach_div(grads, torch.clamp(norm / self.max_grad_norm, min=1.0))
        torch._foreach_lerp_(self.m, g, 1 - b1)
        torch._foreach_mul_(self.v, b2)
        torch._foreach_addcmul_(self.v, g, g, 1 - b2)
        denom = torch._foreach_div(self.v, 1 - b2 ** self.t)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, self.eps)
        u = torch._foreach_div(self.m, 1 - b1 ** self.t)
        torch._foreach_div_(u, denom)
        torch._foreach_add_(u, self.params, alpha=self.wd)
        w_norm = torch.stack(torch._foreach_norm(self.params))
        u_norm = torch.stack(torch._foreach_norm(u))
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        torch._foreach_mul_(u, list((-self.lr * ratio).unbind()))
        torch._foreach_add_(self.params, u)
        if self.copies is not None:
            torch._foreach_copy_(self.copies, self.params)


def bench_lamb(device: str, quick: bool, repeats: int, copy_bw: float) -> list[Row]:
    """ampkit.optim.LAMB (grad norm + moments pass + apply pass) vs ForeachLAMB; grad_norm vs get_total_norm."""
    import ampkit.optim

    rows: list[Row] = []
    inner = 2 if device == "cpu" else 10
    lowp = torch.float16 if device == "cuda" else torch.bfloat16
    for case in ["transformer", "many_small"]:
        shapes = model_shapes(case, quick, device)
        numel = sum(math.prod(s) for s in shapes)
        ours = ampkit.optim.LAMB(_params_with_grads(shapes, device, torch.float32), lr=1e-3)
        theirs = ForeachLAMB(_params_with_grads(shapes, device, torch.float32), lr=1e-3)
        ours.step()
        theirs.step()
        ours_w = [p for g in ours.param_groups for p in g["params"]]
        drift = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(ours_w, theirs.params))
        assert drift < 1e-5, f"ForeachLAMB and ampkit.optim.LAMB disagree by {drift}"
        a_ms, t_ms = time_pair(device, [ours.step, theirs.step], repeats, inner)
        # grad norm 4 B, moments pass 4 + 4 + 16, apply pass 12 + 4 bytes per parameter
        gbps = 44 * numel / (a_ms * 1e-3) / 1e9
        rows.append(Row("lamb", device, case, "float32", a_ms, t_ms, t_ms / a_ms, gbps, 100 * gbps / copy_bw,
                        "vs torch foreach LAMB, clip 1.0, wd 0.01"))
        # Low-precision params with FP32 masters vs the foreach LAMB on FP32 params + a cast of the weights.
        ours = ampkit.optim.LAMB(_params_with_grads(shapes, device, lowp), lr=1e-3)
        fp32 = _params_with_grads(shapes, device, torch.float32)
        theirs = ForeachLAMB(fp32, lr=1e-3, copies=[p.detach().to(lowp) for p in fp32])
        a_ms, t_ms = time_pair(device, [ours.step, theirs.step], repeats, inner)
        gbps = 42 * numel / (a_ms * 1e-3) / 1e9
        rows.append(Row("lamb_master", device, case, str(lowp).replace("torch.", ""), a_ms, t_ms, t_ms / a_ms, gbps,
                        100 * gbps / copy_bw, "vs foreach LAMB on FP32 + weight cast"))
        grads = [p.grad for p in _params_with_grads(shapes, device, lowp)]
        a_ms, t_ms = time_pair(device, [lambda: ampkit.ops.grad_norm(grads),
                                        lambda: torch.nn.utils.get_total_norm(grads)], repeats, inner)
        gbps = 2 * numel / (a_ms * 1e-3) / 1e9
        rows.append(Row("grad_norm", device, case, str(lowp).replace("torch.", ""), a_ms, t_ms, t_ms / a_ms, gbps,
                        100 * gbps / copy_bw, "vs torch.nn.utils.get_total_norm"))
    return rows


def _params_with_grads(shapes, device, dtype):
    torch.manual_seed(0)
    params = [torch.randn(s, device=device, dtype=dtype).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def count_host_syncs(device: str, fn: Callable[[], None]) -> Optional[int]:
    """Host-device synchronisations one call of fn makes (CUDA only: counted by torch's sync debug mode)."""
    if device != "cuda":
        return None
    import warnings as _w

    with _w.catch_warnings(record=True) as caught:
        _w.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def bench_optimizers(device: str, quick: bool, repeats: int, copy_bw: float) -> list[Row]:
    """AdamW and SGD: ampkit's fused kernels vs torch's fused/foreach ones, and the whole scaler + optimizer step."""
    import ampkit.optim

    rows: list[Row] = []
    inner = 2 if device == "cpu" else 10
    lowp = torch.float16 if device == "cuda" else torch.bfloat16
    cases = ["flat", "transformer", "many_small"]
    for case in cases:
        shapes = model_shapes(case, quick, device)
        if case == "flat" and device == "cpu":
            shapes = [(1 << 24,)]  # 16 M params: every state stream is well beyond the last-level cache
        numel = sum(math.prod(s) for s in shapes)

        # FP32 params, FP32 states: the same work on both sides (28 bytes per parameter).
        ours = ampkit.optim.AdamW(_params_with_grads(shapes, device, torch.float32), lr=1e-3)
        fused = torch.optim.AdamW(_params_with_grads(shapes, device, torch.float32), lr=1e-3, fused=True)
        foreach = torch.optim.AdamW(_params_with_grads(shapes, device, torch.float32), lr=1e-3, foreach=True)
        a_ms, f_ms, fe_ms = time_pair(device, [ours.step, fused.step, foreach.step], repeats, inner)
        gbps = 28 * numel / (a_ms * 1e-3) / 1e9
        rows.append(Row("adamw", device, case, "float32", a_ms, f_ms, f_ms / a_ms, gbps, 100 * gbps / copy_bw,
                        f"vs fused=True; foreach {fe_ms:.3f} ms"))

        # Low-precision params with FP32 masters in one pass, vs torch's path: FP32 params + fused AdamW + a
        # separate cast of the weights to the low-precision copy the model runs with.
        ours = ampkit.optim.AdamW(_params_with_grads(shapes, device, lowp), lr=1e-3)
        fp32 = _params_with_grads(shapes, device, torch.float32)
        for p in fp32:
            p.grad = p.grad.to(lowp).float()
        fused = torch.optim.AdamW(fp32, lr=1e-3, fused=True)
        copies = [p.detach().to(lowp) for p in fp32]

        def torch_master_step() -> None:
            fused.step()
            torch._foreach_copy_(copies, [p.detach() for p in fp32])

        a_ms, t_ms = time_pair(device, [ours.step, torch_master_step], repeats, inner)
        gbps = 28 * numel / (a_ms * 1e-3) / 1e9
        rows.append(Row("adamw_master", device, case, str(lowp).replace("torch.", ""), a_ms, t_ms, t_ms / a_ms, gbps,
                        100 * gbps / copy_bw, "vs fused=True on FP32 + weight cast"))

        # SGD with momentum, FP32: read p, g, buf; write p, buf (20 bytes per parameter).
        ours = ampkit.optim.SGD(_params_with_grads(shapes, device, torch.float32), lr=1e-2, momentum=0.9)
        fused = torch.optim.SGD(_params_with_grads(shapes, device, torch.float32), lr=1e-2, momentum=0.9,
                                fused=True)
        ours.step()
        fused.step()
        a_ms, t_ms = time_pair(device, [ours.step, fused.step], repeats, inner)
        gbps = 20 * numel / (a_ms * 1e-3) / 1e9
        rows.append(Row("sgd", device, case, "float32", a_ms, t_ms, t_ms / a_ms, gbps, 100 * gbps / copy_bw,
                        "vs fused=True, momentum 0.9"))

    rows += bench_lean_optimizers(device, quick, repeats, copy_bw)

    # The whole AMP step (check + fused update + scale update): ampkit.GradScaler + ampkit AdamW with masters
    # vs torch.amp.GradScaler + fused AdamW on FP32 params (+ the weight cast).
    shapes = model_shapes("transformer", quick, device)
    numel = sum(math.prod(s) for s in shapes)
    a_params = _params_with_grads(shapes, device, lowp)
    a_opt = ampkit.optim.AdamW(a_params, lr=1e-3)
    a_scaler = ampkit.GradScaler(device, init_scale=1.0)
    t_params = _params_with_grads(shapes, device, torch.float32)
    t_opt = torch.optim.AdamW(t_params, lr=1e-3, fused=True)
    t_scaler = torch.amp.GradScaler(device, init_scale=1.0)
    t_copies = [p.detach().to(lowp) for p in t_params]
    a_scaler.scale(torch.ones((), device=device))
    t_scaler.scale(torch.ones((), device=device))

    def ampkit_step() -> None:
        a_scaler.step(a_opt)
        a_scaler.update()

    def torch_step() -> None:
        t_scaler.step(t_opt)
        t_scaler.update()
        torch._foreach_copy_(t_copies, [p.detach() for p in t_params])

    a_ms, t_ms = time_pair(device, [ampkit_step, torch_step], repeats, inner)
    syncs_a, syncs_t = count_host_syncs(device, ampkit_step), count_host_syncs(device, torch_step)
    gbps = 30 * numel / (a_ms * 1e-3) / 1e9
    note = f"host syncs/step ampkit {syncs_a}, torch {syncs_t}" if syncs_a is not None else "host syncs: CUDA only"
    rows.append(Row("scaler_step", device, "transformer", str(lowp).replace("torch.", ""), a_ms, t_ms, t_ms / a_ms,
                    gbps, 100 * gbps / copy_bw, note))
    return rows


def bench_lean_optimizers(device: str, quick: bool, repeats: int, copy_bw: float) -> list[Row]:
    """BF16 AdamW without an FP32 master, on the same tensors, against the libraries that have the same mode (the
    "torch" column holds theirs), where they are installed: ampkit's Kahan mode against torch-optimi's
    ``kahan_sum=True`` and ampkit's stochastic rounding against torchao's ``bf16_stochastic_round=True``, each with
    the moments those libraries keep for BF16 parameters (BF16: ``exp_avg_dtype=torch.bfloat16``) and, for
    ampkit alone, with FP32 moments; and 8-bit block-wise moments against torchao's ``AdamW8bit``. Minimum bytes
    per parameter with BF16 grads (read w, g and the moments, write w and the moments): Kahan 26 with FP32 moments,
    18 with BF16 ones (plus the compensation read and written); stochastic rounding 22 and 14; 8-bit moments with
    stochastic rounding 10 plus 1/16 for the blocks' absmaxes."""
    import ampkit.optim

    rows: list[Row] = []
    inner = 2 if device == "cpu" else 10
    shapes = [(1 << 24,)] if device == "cpu" and not quick else model_shapes("transformer", quick, device)
    numel = sum(math.prod(s) for s in shapes)
    bf16, u8 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16), dict(
        exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    # (name, ampkit's options, bytes per parameter, note, the other library's optimizer or None)
    cases = [("adamw_kahan", dict(master_weights="kahan"), 26, "FP32 moments (no equivalent)", None),
             ("adamw_stochastic", dict(master_weights="stochastic"), 22, "FP32 moments (no equivalent)", None)]
    # The BF16 and 8-bit moments are timed for ampkit alone where the other library is not installed.
    try:
        import optimi

        kahan_other = lambda ps: optimi.AdamW(ps, lr=1e-3, kahan_sum=True)  # noqa: E731
        kahan_note = "vs torch-optimi AdamW(kahan_sum=True), BF16 moments"
    except ImportError:
        kahan_other, kahan_note = None, "BF16 moments (torch-optimi not installed)"
    try:
        from torchao.optim import AdamW8bit, _AdamW

        sr_other = lambda ps: _AdamW(ps, lr=1e-3, bf16_stochastic_round=True)  # noqa: E731
        sr_note = "vs torchao _AdamW(bf16_stochastic_round=True), BF16 moments"
        u8_other = lambda ps: AdamW8bit(ps, lr=1e-3, bf16_stochastic_round=True)  # noqa: E731
        u8_note = "vs torchao AdamW8bit(bf16_stochastic_round=True)"
    except ImportError:
        sr_other, sr_note = None, "BF16 moments (torchao not installed)"
        u8_other, u8_note = None, "8-bit block-wise moments (torchao not installed)"
    cases += [("adamw_kahan_bf16m", dict(master_weights="kahan", **bf16), 18, kahan_note, kahan_other),
              ("adamw_stochastic_bf16m", dict(master_weights="stochastic", **bf16), 14, sr_note, sr_other),
              ("adamw_stochastic_8bit", dict(master_weights="stochastic", **u8), 10.0625, u8_note, u8_other)]
    for name, options, bytes_per_param, note, make_other in cases:
        ours = ampkit.optim.AdamW(_params_with_grads(shapes, device, torch.bfloat16), lr=1e-3, **options)
        if make_other is None:
            a_ms, = time_pair(device, [ours.step], repeats, inner)
            t_ms = float("nan")
        else:
            theirs = make_other(_params_with_grads(shapes, device, torch.bfloat16))
            a_ms, t_ms = time_pair(device, [ours.step, theirs.step], repeats, inner)
        gbps = bytes_per_param * numel / (a_ms * 1e-3) / 1e9
        rows.append(Row(name, device, "flat" if len(shapes) == 1 else "transformer", "bfloat16", a_ms, t_ms,
                        t_ms / a_ms, gbps, 100 * gbps / copy_bw, note))
    return rows


def bench_fp8_quantize(device: str, quick: bool, repeats: int, copy_bw: float) -> list[Row]:
    """ampkit's fp8_quantize of a BF16 activation to E4M3 with a tensorwise scale (q and the amax in one pass, and
    with ``transpose=True`` the transposed copy in the same pass) against the same in torch ops: the amax, the
    saturating cast, and for the transpose a contiguous copy of q^T. Minimum bytes per element: read 2, write 1
    (2 with the transpose)."""
    rows: list[Row] = []
    inner = 3 if device == "cpu" else 20
    tokens, k = (2048, 1024) if quick or device == "cpu" else (8192, 4096)
    torch.manual_seed(0)
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
    scale = torch.full((), 64.0, device=device)
    fp8, fp8_max = torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max
    for transpose in (False, True):
        def ours() -> None:
            torch.ops.ampkit.fp8_quantize(x, scale, fp8, transpose)

        def theirs() -> None:
            x.abs().amax()
            q = (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8)
            if transpose:
                q.t().contiguous()

        a_ms, t_ms = time_pair(device, [ours, theirs], repeats, inner)
        gbps = (4 if transpose else 3) * tokens * k / (a_ms * 1e-3) / 1e9
        rows.append(Row("fp8_quantize", device, f"{tokens}x{k}", "bf16>e4m3" + ("+T" if transpose else ""), a_ms,
                        t_ms, t_ms / a_ms, gbps, 100 * gbps / copy_bw,
                        "tensorwise, q and amax" + (" and q^T" if transpose else "") + " in one pass vs torch ops"))
    return rows


def bench_fp8_linear(device: str, quick: bool, repeats: int) -> list[Row]:
    """ampkit.fp8.Float8Linear (current scaling, tensorwise and rowwise: quantize every operand, three FP8 GEMMs)
    against a BF16 nn.Linear of the same shape (the "torch" column), forward and backward of a BF16 input, and the
    forward alone. On the CPU the FP8 GEMMs run as FP32 GEMMs of the exactly widened operands (NOTE [FP8 GEMM on
    the CPU]); speedup is BF16's time over FP8's (above 1: FP8 faster); the note gives the FP8 layer's GFLOP/s."""
    from ampkit import fp8

    rows: list[Row] = []
    shapes = [(64, 784, 128), (256, 256, 256)] + ([] if quick else [(1024, 1024, 1024)])
    for tokens, k, n in shapes:
        torch.manual_seed(0)
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
        bf16 = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
        for granularity in ["tensorwise", "rowwise"]:
            f8 = fp8.Float8Linear.from_linear(torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16),
                                              fp8.CurrentScaling(granularity=granularity))
            for what, flops in [("fwd+bwd", 6 * tokens * k * n), ("fwd", 2 * tokens * k * n)]:
                def run(layer, backward=what == "fwd+bwd"):
                    def call() -> None:
                        if backward:
                            layer(x).backward(dy)
                        else:
                            with torch.no_grad():
                                layer(x)
                    return call

                a_ms, t_ms = time_pair(device, [run(f8), run(bf16)], repeats, 3)
                # A GEMM, not a pass over memory: no bandwidth columns; its GFLOP/s in the note.
                rows.append(Row("fp8_linear", device, f"{tokens}x{k}x{n}", f"{granularity[:3]} {what}", a_ms, t_ms,
                                t_ms / a_ms, 0.0, 0.0, f"{granularity} FP8 vs BF16 nn.Linear, {what}, "
                                f"{flops / (a_ms * 1e-3) / 1e9:.1f} GFLOP/s"))
    return rows


def bench_compiled_step(device: str, quick: bool, repeats: int) -> list[Row]:
    """A whole AMP training step (autocast forward, scaled backward, scaler.step with AdamW, update) eager and under
    torch.compile(fullgraph where it can): ampkit.GradScaler + ampkit.optim.AdamW against torch.amp.GradScaler +
    torch.optim.AdamW(fused=True), each timed in the same process. The note counts each one's graph breaks."""
    from torch._dynamo.utils import counters

    import ampkit.optim

    lowp = torch.float16 if device == "cuda" else torch.bfloat16
    width, depth, batch = (256, 4, 64) if device == "cpu" or quick else (2048, 8, 256)

    def build(which: str):
        torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers).to(device)
        if which == "ampkit":
            model = model.to(lowp)  # O2: low-precision weights, FP32 masters in the optimizer
            opt = ampkit.optim.AdamW(model.parameters(), lr=1e-4)
            scaler = ampkit.GradScaler(device, init_scale=1024.0)
        else:  # torch's recipe: FP32 weights under autocast, its fused AdamW
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            scaler = torch.amp.GradScaler(device, init_scale=1024.0)
        x = torch.randn(batch, width, device=device)

        def step() -> None:
            with torch.autocast(device, dtype=lowp):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        def run(fn):
            def call() -> None:
                fn()
                opt.zero_grad(set_to_none=True)
            return call
        return step, run, model

    rows: list[Row] = []
    inner = 3 if device == "cpu" else 20
    eager = [build("ampkit"), build("torch")]
    a_ms, t_ms = time_pair(device, [r(s) for s, r, _ in eager], repeats, inner)
    numel = sum(p.numel() for p in eager[0][2].parameters())
    rows.append(Row("amp_step_eager", device, f"mlp{depth}x{width}", str(lowp).replace("torch.", ""), a_ms, t_ms,
                    t_ms / a_ms, 0.0, 0.0, f"{numel} params; ampkit O2 + AdamW vs torch autocast + fused AdamW"))
    breaks = []
    compiled = []
    for which in ("ampkit", "torch"):
        # The backward inside the graph (trace_autograd_ops) for ampkit; torch's scaler loses its inf checks
        # across the breaks that way in torch 2.13, so its step compiles with the backward outside the graphs.
        with torch._dynamo.config.patch(trace_autograd_ops=which == "ampkit"):
            torch._dynamo.reset()
            counters.clear()
            step, run, _ = build(which)
            fn = torch.compile(step, fullgraph=which == "ampkit")
            t0 = time.perf_counter()
            for _ in range(3):  # the first step creates the states: two graphs
                run(fn)()
            _sync(device)
            breaks.append((sum(counters["graph_break"].values()), time.perf_counter() - t0))
            compiled.append(run(fn))
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        a_ms, t_ms = time_pair(device, compiled, repeats, inner)
    rows.append(Row("amp_step_compiled", device, f"mlp{depth}x{width}", str(lowp).replace("torch.", ""), a_ms, t_ms,
                    t_ms / a_ms, 0.0, 0.0,
                    f"torch.compile; graph breaks ampkit {breaks[0][0]} (fullgraph), torch {breaks[1][0]}; "
                    f"compile {breaks[0][1]:.0f} s / {breaks[1][1]:.0f} s"))
    return rows


def print_table(rows: list[Row]) -> None:
    head = f"{'name':<18} {'device':<6} {'case':<12} {'dtype':<9} {'ampkit_ms':>10} {'torch_ms':>10} " \
           f"{'speedup':>8} {'gbps':>8} {'%copy':>6} {'%inpl':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        t = f"{r.torch_ms:10.4f}" if r.torch_ms is not None else f"{'refuses':>10}"
        s = f"{r.speedup:8.2f}" if r.speedup is not None else f"{'-':>8}"
        inplace = 100 * r.gbps / INPLACE_BW[r.device] if r.device in INPLACE_BW else 0.0
        print(f"{r.name:<18} {r.device:<6} {r.case:<12} {r.dtype:<9} {r.ampkit_ms:10.4f} {t} {s} "
              f"{r.gbps:8.1f} {r.pct_of_copy_bw:6.1f} {inplace:6.1f}  {r.note}")


def traffic_rows() -> list[dict]:
    """Runs the build's ampkit_traffic tool (emulated CUDA kernels) and returns its rows."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    build = os.environ.get("AMPKIT_BUILD_DIR", os.path.join(root, "build"))
    tool = os.path.join(build, "bench", "ampkit_traffic")
    if not os.path.exists(tool):
        sys.exit(f"bench/run.py --traffic: {tool} not found; build with the tests (scripts/test.sh, or "
                 "AMPKIT_BUILD_TESTS=1) on a machine with the CUDA toolkit's headers")
    out = subprocess.run([tool], check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller inputs and fewer repeats")
    parser.add_argument("--device", default="all", choices=["cpu", "cuda", "all"])
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list of objects")
    parser.add_argument("--jsonl", metavar="PATH",
                        help="write each row as one JSON line the moment it is measured (flushed)")
    parser.add_argument("--no-compile", dest="compile_step", action="store_false",
                        help="leave out the torch.compile'd training step (amp_step_compiled)")
    parser.add_argument("--traffic", action="store_true",
                        help="bytes per parameter each CUDA kernel moves, counted in the emulated build")
    parser.add_argument("--lean", action="store_true",
                        help="only the BF16 optimizer rows without an FP32 master, against torch-optimi and torchao")
    parser.add_argument("--fp8", action="store_true",
                        help="only the FP8 rows: fp8_quantize against torch ops, the FP8 layer against BF16 nn.Linear")
    args = parser.parse_args()
    if args.traffic:
        rows = traffic_rows()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        # NOTE [Memory transaction model] (kernels/cuda/emulation_model.cpp): sectors = the share of the 32-byte
        # sectors moved that the kernel asked for (goal beside it), wavefr = shared-memory passes per request,
        # atom/M = global atomics per million elements (same = on an address another lane also updates),
        # sh.atom/M = shared-memory atomics per million elements, model bw = the minimum bytes over the sector
        # bytes moved: the modelled fraction of copy bandwidth. "<" marks a row below its goal.
        print(f"{'kernel':<38} {'dtype':<28} {'bytes/param':>11} {'minimum':>8} {'sectors':>8} {'goal':>5} "
              f"{'wavefr':>6} {'atom/M':>8} {'same/M':>8} {'sh.atom/M':>9} {'model bw':>8}  worst site")
        for r in rows:
            flag = "" if r["sector_efficiency"] >= r["goal"] else " <"
            print(f"{r['kernel']:<38} {r['dtype']:<28} {r['bytes_per_param']:11.4g} {r['min_bytes_per_param']:8.4g} "
                  f"{100 * r['sector_efficiency']:7.1f}% {100 * r['goal']:4.0f}% "
                  f"{r['shared_wavefronts_per_request']:6.2f} {r['global_atomics_per_M']:8.1f} "
                  f"{r['same_address_atomics_per_M']:8.1f} {r['shared_atomics_per_M']:9.0f} "
                  f"{100 * r['modelled_copy_bw_fraction']:7.1f}%  {r['worst_site']}{flag}")
        return
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"ampkit bench: torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} CPU threads, GPU {gpu}, build {ampkit.build_info()}", file=sys.stderr)
    global ROW_STREAM
    ROW_STREAM = open(args.jsonl, "w") if args.jsonl else None
    rows: list[Row] = []
    try:
        for device in devices:
            repeats = 7 if args.quick else 25
            if args.lean:
                rows += bench_lean_optimizers(device, args.quick, repeats, measure_bandwidth(device, repeats))
            elif args.fp8:
                rows += bench_fp8_quantize(device, args.quick, repeats, measure_bandwidth(device, repeats))
                rows += bench_fp8_linear(device, args.quick, repeats)
            else:
                rows += bench_device(device, args.quick, args.compile_step)
    finally:
        if ROW_STREAM is not None:
            ROW_STREAM.close()
            ROW_STREAM = None
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row_dict(r) for r in rows], f, indent=1)
    print_table(rows)


if __name__ == "__main__":
    main()
