"""Gradient monitoring for mixed-precision training: the scaler's statistics and per-parameter gradient statistics
(:func:`ampkit.grad_stats`: one fused pass, no host sync until written) to TensorBoard, so that vanishing or
exploding gradients show where they sit against what FP16 holds at the current scale.

Python: ``GradMonitor(writer_or_logdir, model.named_parameters(), every=100)`` and ``monitor.log(step, scaler)``
after ``scaler.scale(loss).backward()``. C++ programs write the same records as JSON lines
(``ampkit::GradStatsLog``); ``python -m ampkit.monitor LOG.jsonl LOGDIR`` converts them into a TensorBoard event
file. Per record: scalars ``amp/scale``, ``amp/steps``, ``amp/skipped_steps``, ``amp/overflows_at_min_scale``; per
parameter ``grad_norm/<name>``, ``grad_max_abs/<name>``, ``grad_non_finite/<name>``, ``grad_zeros/<name>`` and the
histogram ``grad_log2/<name>`` of ``floor(log2 |g|)`` of the unscaled non-zero finite gradients (FP16 holds
exponents -24 to 15, its normals -14 to 15; BF16 -133 to 127, FP32 -149 to 127; exponents below -133 are shown at
-134, above 127 at 128).
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Iterable, Optional, Union

import torch

from .ops import GRAD_STATS_COLUMNS, GRAD_STATS_HIST_FIRST, GRAD_STATS_HIST_MIN_EXP

__all__ = ["GradMonitor", "grad_records", "write_records", "convert"]

_SCALER_KEYS = ("scale", "steps", "skipped_steps", "overflows_at_min_scale")


def _row_record(name: str, row: list[float]) -> dict:
    hist = [int(c) for c in row[GRAD_STATS_HIST_FIRST + 1:GRAD_STATS_COLUMNS - 1]]
    nonzero = [i for i, c in enumerate(hist) if c]
    first, last = (nonzero[0], nonzero[-1]) if nonzero else (0, -1)
    return dict(name=name, max_abs=row[0], norm=row[1], non_finite=int(row[2]), zeros=int(row[3]),
                below=int(row[GRAD_STATS_HIST_FIRST]), above=int(row[GRAD_STATS_COLUMNS - 1]),
                first_exp=GRAD_STATS_HIST_MIN_EXP + first, counts=hist[first:last + 1])


def grad_records(named_parameters: Iterable[tuple[str, torch.Tensor]], inv_scale_of=None) -> list[dict]:
    """One record per parameter with a gradient (the JSON-lines schema of ``ampkit::GradStatsLog``): max_abs, norm,
    non_finite, zeros, below/above (exponents outside -133..127) and ``counts`` of exponents from ``first_exp``.
    ``inv_scale_of(device)`` gives the factor that unscales the grads (None: they are unscaled). One
    :func:`ampkit.grad_stats` op call per device, then one copy to the host."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, p in named_parameters:
        g = p.grad
        if g is None or g.layout != torch.strided or g.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            continue
        if hasattr(g, "to_local"):  # DTensor: this rank's shard
            g = g.to_local()
        by_device.setdefault(g.device, []).append((name, g))
    records = []
    for device, pairs in by_device.items():
        inv = inv_scale_of(device) if inv_scale_of is not None else None
        rows = torch.ops.ampkit.grad_stats([g for _, g in pairs], inv).cpu().tolist()  # one copy of every row
        records += [_row_record(name, row) for (name, _), row in zip(pairs, rows)]
    return records


def write_records(writer, record: dict) -> None:
    """Writes one record (``{"step", "scaler", "grads"}``) to a ``torch.utils.tensorboard.SummaryWriter``."""
    step = int(record["step"])
    for key, value in (record.get("scaler") or {}).items():
        if value is not None:
            writer.add_scalar(f"amp/{key}", float(value), step)
    for g in record.get("grads", []):
        name = g["name"]
        writer.add_scalar(f"grad_norm/{name}", g["norm"], step)
        writer.add_scalar(f"grad_max_abs/{name}", g["max_abs"], step)
        writer.add_scalar(f"grad_non_finite/{name}", g["non_finite"], step)
        writer.add_scalar(f"grad_zeros/{name}", g["zeros"], step)
        # Exponents -134 (everything below -133) to 128 (everything above 127) at most, zero bins filled in.
        counts = list(g["counts"])
        first = int(g["first_exp"])
        if not counts:
            first = GRAD_STATS_HIST_MIN_EXP
        if g["below"]:
            counts = [g["below"]] + [0] * (first - GRAD_STATS_HIST_MIN_EXP) + counts
            first = GRAD_STATS_HIST_MIN_EXP - 1
        if g["above"]:
            last = first + len(counts) - 1
            counts = counts + [0] * (127 - last) + [g["above"]]
        total = sum(counts)
        if total == 0:
            continue
        exps = [first + i for i in range(len(counts))]
        writer.add_histogram_raw(
            f"grad_log2/{name}", min=float(exps[0]), max=float(exps[-1]), num=total,
            sum=float(sum(c * e for c, e in zip(counts, exps))),
            sum_squares=float(sum(c * e * e for c, e in zip(counts, exps))),
            bucket_limits=[float(e + 1) for e in exps], bucket_counts=counts, global_step=step)


class GradMonitor:
    """Every ``every`` steps, the scaler's statistics and each parameter's gradient statistics to TensorBoard.

    Args:
        writer: a ``SummaryWriter`` or a log directory (a writer is made for it).
        named_parameters: ``model.named_parameters()`` (kept as a list).
        every: log when ``step % every == 0``.
        jsonl: optional path; each record is also appended there as one JSON line (the C++ format).
    """

    def __init__(self, writer: Union[str, Any], named_parameters: Iterable[tuple[str, torch.Tensor]],
                 every: int = 100, jsonl: Optional[str] = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"ampkit.monitor.GradMonitor: every must be an int >= 1, but got {every!r}")
        self.named_parameters = list(named_parameters)
        if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                   and isinstance(item[1], torch.Tensor) for item in self.named_parameters):
            raise TypeError("ampkit.monitor.GradMonitor: named_parameters must give (str, Tensor) pairs, as "
                            "module.named_parameters() does")
        if isinstance(writer, str):
            from torch.utils.tensorboard import SummaryWriter
            writer = SummaryWriter(writer)
        self.writer = writer
        self.every = every
        self.jsonl = jsonl

    def log(self, step: int, scaler=None, grads_scaled: bool = True) -> Optional[dict]:
        """Logs at multiples of ``every`` and returns the record (None on other steps). Call it after backward;
        ``grads_scaled``: the grads still carry the loss scale (before ``scaler.unscale_``/``step``), so they are
        unscaled by the scaler's ``1/scale`` for the statistics (not when a compressed all-reduce of
        :mod:`ampkit.distributed` already unscaled them this iteration). Reads the device (one copy per device)."""
        if step % self.every:
            return None
        inv_of = None
        if (scaler is not None and grads_scaled and scaler.is_enabled() and scaler._get_scale_async() is not None
                and not scaler._core.grads_unscaled_outside()):  # ampkit's DDP unscale hooks unscaled them already
            inv_of = scaler.unscale_factor
        record = dict(step=int(step), grads=grad_records(self.named_parameters, inv_of))
        if scaler is not None:
            stats = scaler.stats()
            record["scaler"] = {k: stats.get(k) for k in _SCALER_KEYS}
        write_records(self.writer, record)
        if self.jsonl is not None:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def close(self) -> None:
        self.writer.close()


def convert(jsonl: str, logdir: str) -> int:
    """Writes the records of a JSON-lines file (``ampkit::GradStatsLog``, or ``GradMonitor(jsonl=...)``) into a
    TensorBoard event file in ``logdir``; returns the number of records."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(logdir)
    n = 0
    with open(jsonl) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"ampkit.monitor.convert: {jsonl}:{line_no} is not JSON ({e})") from None
            write_records(writer, record)
            n += 1
    writer.close()
    return n


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ampkit.monitor",
                                     description="Convert ampkit gradient-statistics JSON lines to TensorBoard.")
    parser.add_argument("jsonl")
    parser.add_argument("logdir")
    args = parser.parse_args(argv)
    n = convert(args.jsonl, args.logdir)
    print(f"{n} records from {args.jsonl} written to {args.logdir}")


if __name__ == "__main__":
    main()
