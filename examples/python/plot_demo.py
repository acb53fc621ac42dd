"""Plots the C++ demo's history CSV (mode, step, loss, scale, skipped): loss curves per mode and the loss-scale
history, and, with the demo's gradient log (ampkit::GradStatsLog JSON lines), the O2 gradients' exponent histogram
against what FP16 holds at the loss scale of that step, to a PNG.
Usage: python examples/python/plot_demo.py HISTORY_CSV OUT_PNG [GRAD_LOG_JSONL]"""
from __future__ import annotations

import csv
import json
import math
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

FP16_MIN_SUBNORMAL_EXP, FP16_MIN_NORMAL_EXP, FP16_MAX_EXP = -24, -14, 15


def exponent_histogram(record: dict) -> dict[int, int]:
    """Counts by floor(log2 |g|) over all parameters of one GradStatsLog record (unscaled gradients)."""
    counts: dict[int, int] = defaultdict(int)
    for g in record["grads"]:
        for i, c in enumerate(g["counts"]):
            counts[g["first_exp"] + i] += c
    return counts


def plot_grad_panel(ax, records: list[dict]) -> None:
    last = records[-1]
    counts = exponent_histogram(last)
    scale = (last.get("scaler") or {}).get("scale") or 1.0
    shift = math.log2(scale)
    if counts:
        exps = sorted(counts)
        ax.bar(exps, [counts[e] for e in exps], width=0.9, color="tab:blue", label="gradients (unscaled)")
    # An unscaled gradient g is stored as g * scale: FP16 holds it when log2|g| + log2(scale) is in FP16's range.
    ax.axvspan(FP16_MIN_NORMAL_EXP - shift, FP16_MAX_EXP + 1 - shift, color="tab:green", alpha=0.15,
               label=f"FP16 normals at scale 2^{shift:.0f}")
    ax.axvspan(FP16_MIN_SUBNORMAL_EXP - shift, FP16_MIN_NORMAL_EXP - shift, color="tab:orange", alpha=0.15,
               label="FP16 subnormals (precision lost)")
    ax.set(title=f"O2 gradient exponents, step {last['step']}", xlabel="floor(log2 |g|)", ylabel="elements",
           yscale="log")
    ax.legend(fontsize=8)


def main(history: str, out: str, grad_log: str | None = None) -> None:
    rows = defaultdict(list)
    with open(history) as f:
        for r in csv.DictReader(f):
            rows[r["mode"]].append((int(r["step"]), float(r["loss"]), float(r["scale"]), int(r["skipped"])))
    records = []
    if grad_log:
        with open(grad_log) as f:
            records = [json.loads(line) for line in f if line.strip()]
    panels = 3 if records else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    ax_loss, ax_scale = axes[0], axes[1]
    for mode, pts in rows.items():
        steps = [p[0] for p in pts]
        ax_loss.plot(steps, [p[1] for p in pts], label=mode, linewidth=1)
        if mode != "fp32":
            ax_scale.plot(steps, [p[2] for p in pts], label=mode, linewidth=1.2)
            skipped = [p for p in pts if p[3]]
            ax_scale.scatter([p[0] for p in skipped], [p[2] for p in skipped], marker="x", s=25,
                             label=f"{mode}: skipped steps")
    ax_loss.set(title="training loss", xlabel="step", ylabel="cross-entropy", yscale="log")
    ax_scale.set(title="loss scale (GradScaler)", xlabel="step", ylabel="scale")
    # Loss scales are powers of two: a base-2 axis labelled 2^k at whole powers only (a base-10 log axis puts
    # cluttered minor labels between 2^16 and 2^17).
    ax_scale.set_yscale("log", base=2)
    ax_scale.yaxis.set_major_locator(ticker.LogLocator(base=2, subs=(1.0,)))
    ax_scale.yaxis.set_minor_locator(ticker.NullLocator())
    ax_scale.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"$2^{{{math.log2(v):.0f}}}$"))
    ax_loss.legend()
    ax_scale.legend(fontsize=8)
    if records:
        plot_grad_panel(axes[2], records)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:4])
