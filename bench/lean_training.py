"""Lean masters and states against FP32 masters: the small causal Transformer LM of ``bench/fp8_training.py``, its
parameters in BF16, trained from the same seed with ``ampkit.optim.AdamW`` in every master mode, side by side.

Modes: FP32 masters (``master_weights=True``, the reference), ``"remainder"`` (BF16 weight + int16 remainder: the
exact FP32 master), ``"kahan"`` (BF16 weight + BF16 compensation), ``"stochastic"`` (BF16 weight written with
stochastic rounding, no master) and plain BF16 (``master_weights=False``: round to nearest, no master), then
moments in BF16 or 8-bit block-wise (``exp_avg_dtype`` / ``exp_avg_sq_dtype``) with FP32 masters, stochastic
rounding or Kahan. Each run
prints the mean loss of its last 20 steps, its ratio to the FP32-master run's, and the bytes per parameter the
weights and the optimizer state hold, measured on the live optimizer after training (the weight's 2 bytes included;
the per-tensor ``step`` counts too, so a small model shows a little more than the asymptotic figure).

    python bench/lean_training.py [--steps 300] [--seed 0] [--lr 3e-3] [--json PATH]
"""
from __future__ import annotations

import math
import os
import sys

import torch

import ampkit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_training import BATCH, LM, SEQ, arguments, language, loss_summary, report, train_steps  # noqa: E402

U8, BF16 = torch.uint8, torch.bfloat16
# name: AdamW's master_weights and state dtype options
MODES = {"fp32 masters": dict(master_weights=True), "remainder": dict(master_weights="remainder"),
         "kahan": dict(master_weights="kahan"), "stochastic": dict(master_weights="stochastic"),
         "bf16 (no master)": dict(master_weights=False),
         "fp32 m., bf16 states": dict(master_weights=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16),
         "fp32 m., 8-bit states": dict(master_weights=True, exp_avg_dtype=U8, exp_avg_sq_dtype=U8),
         "stoch., bf16 states": dict(master_weights="stochastic", exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16),
         "stoch., 8-bit states": dict(master_weights="stochastic", exp_avg_dtype=U8, exp_avg_sq_dtype=U8),
         "kahan, 8-bit states": dict(master_weights="kahan", exp_avg_dtype=U8, exp_avg_sq_dtype=U8)}


def bytes_per_param(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    params = list(model.parameters())
    total = sum(p.nbytes for p in params)
    for p in params:
        total += sum(t.nbytes for t in optimizer.state[p].values() if isinstance(t, torch.Tensor))
    return total / sum(p.numel() for p in params)


def train(options: dict, steps: int, seed: int, lr: float, transitions: torch.Tensor) -> dict:
    torch.manual_seed(seed)
    model = LM().to(torch.bfloat16)
    optimizer = ampkit.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, **options)
    losses, seconds = train_steps(model, optimizer, steps, seed, transitions, autocast=False)
    return {**loss_summary(losses, seconds), "bytes_per_param": bytes_per_param(model, optimizer)}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--modes", nargs="*", choices=list(MODES), help="the modes to run (default: all)")
    args = parser.parse_args()
    transitions = language(args.seed)
    chosen = ["fp32 masters"] + [m for m in (args.modes or MODES) if m != "fp32 masters"]
    rows = {name: train(MODES[name], args.steps, args.seed, args.lr, transitions) for name in chosen}
    print(f"causal LM in BF16, AdamW lr {args.lr}, {args.steps} steps, batch {BATCH}x{SEQ} tokens, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads (ln 3 = {math.log(3):.3f} attainable)")
    report(rows, "fp32 masters", "loss_ratio_to_fp32_masters",
           f"{'mode':22s} {'loss':>8s} {'vs fp32':>8s} {'B/param':>8s} {'s/step':>8s}",
           lambda name, r: (f"{name:22s} {r['final_loss']:8.4f} {r['loss_ratio_to_fp32_masters']:8.4f} "
                            f"{r['bytes_per_param']:8.2f} {r['seconds_per_step']:8.3f}"),
           args.json, {"steps": args.steps, "seed": args.seed, "lr": args.lr, "torch": torch.__version__})


if __name__ == "__main__":
    main()
