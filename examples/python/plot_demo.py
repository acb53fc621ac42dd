"""Plots the C++ demo's history CSV (mode, step, loss, scale, skipped): loss curves per mode and the loss-scale
history, to a PNG. Usage: python examples/python/plot_demo.py HISTORY_CSV OUT_PNG"""
from __future__ import annotations

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(history: str, out: str) -> None:
    rows = defaultdict(list)
    with open(history) as f:
        for r in csv.DictReader(f):
            rows[r["mode"]].append((int(r["step"]), float(r["loss"]), float(r["scale"]), int(r["skipped"])))
    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, pts in rows.items():
        steps = [p[0] for p in pts]
        ax_loss.plot(steps, [p[1] for p in pts], label=mode, linewidth=1)
        if mode != "fp32":
            ax_scale.plot(steps, [p[2] for p in pts], label=mode, linewidth=1.2)
            skipped = [p for p in pts if p[3]]
            ax_scale.scatter([p[0] for p in skipped], [p[2] for p in skipped], marker="x", s=25,
                             label=f"{mode}: skipped steps")
    ax_loss.set(title="training loss", xlabel="step", ylabel="cross-entropy", yscale="log")
    ax_scale.set(title="loss scale (GradScaler)", xlabel="step", ylabel="scale", yscale="log")
    ax_loss.legend()
    ax_scale.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
