"""FP8 training against BF16: the same small causal Transformer LM trained from the same seed in BF16 autocast, then
with every ``nn.Linear`` in FP8 (``ampkit.fp8.convert``) under current and under delayed scaling, side by side.

The data is a synthetic language made here from the seed (a first-order Markov chain over 256 words in 16 topics,
each word followed by one of 3 words of its topic), so the attainable loss is known: about ln 3 = 1.1 nats once the
model has learnt the successors. Each run prints the mean loss of its last 20 steps, its ratio to BF16's, the
seconds per step and the bytes the linear layers' GEMM operands move per step. On the CPU, ``torch._scaled_mm``
dequantizes to FP32 and multiplies there, so the FP8 step times measure nothing but correctness here; the loss and
the bytes are the point. (On a GPU the FP8 GEMMs run on its FP8 tensor cores.)

    python bench/fp8_training.py [--steps 300] [--seed 0] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit import fp8

WORDS, TOPIC, SUCCESSORS, SEQ, BATCH = 256, 16, 3, 64, 32


def language(seed: int) -> torch.Tensor:
    """The transition matrix: each word goes to one of SUCCESSORS words of its own topic."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.zeros(WORDS, WORDS)
    for w in range(WORDS):
        nxt = w - w % TOPIC + torch.randperm(TOPIC, generator=gen)[:SUCCESSORS]
        t[w, nxt] = 1.0
    return t


def batch(transitions: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    ids = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(WORDS, (BATCH,), generator=gen)
    for i in range(1, SEQ + 1):
        ids[:, i] = torch.multinomial(transitions[ids[:, i - 1]], 1, generator=gen).squeeze(1)
    return ids


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class LM(nn.Module):
    def __init__(self, d: int = 128, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(WORDS, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, WORDS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gemm_bytes(model: nn.Module, tokens: int, fp8_operands: bool) -> int:
    """Bytes of the GEMM operands of every linear layer in one step (forward and the two backward GEMMs): each GEMM
    reads its two operands once and writes its result, operands 1 byte in FP8 and 2 in BF16, results 2 bytes."""
    total = 0
    operand = 1 if fp8_operands else 2
    for m in model.modules():
        if isinstance(m, nn.Linear):
            n_in, n_out = m.in_features, m.out_features
            x, w, y = tokens * n_in, n_in * n_out, tokens * n_out
            total += (x + w) * operand + y * 2  # y = x W^T
            total += (y + w) * operand + x * 2  # dX = dY W
            total += (x + y) * operand + w * 2  # dW = x^T dY
    return total


def train_steps(model: nn.Module, optimizer, steps: int, seed: int, transitions: torch.Tensor,
                autocast: bool) -> tuple[list[float], float]:
    """`steps` optimizer steps of next-word loss on batches drawn from `transitions` (seeded by seed + 1), the
    forward under BF16 autocast when asked; stops at a non-finite loss. Returns (losses, seconds per step)."""
    gen = torch.Generator().manual_seed(seed + 1)
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        ids = batch(transitions, gen)
        with ampkit.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, WORDS), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
    return losses, (time.perf_counter() - start) / len(losses)


def loss_summary(losses: list[float], seconds: float) -> dict:
    """A run's row: the mean loss of its last 20 steps, its first loss, its steps and the seconds per step."""
    return {"final_loss": sum(losses[-20:]) / len(losses[-20:]), "first_loss": losses[0], "steps": len(losses),
            "seconds_per_step": seconds}


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options every LM run takes: --steps, --seed, --json."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    return parser


def report(rows: dict, baseline: str, ratio_key: str, columns: str, line: Callable[[str, dict], str],
           json_path: Optional[str], record: dict) -> None:
    """Gives each row its final loss relative to the `baseline` row's (under `ratio_key`), prints `columns` and
    `line(name, row)` for each row, and writes `record` with the rows to `json_path` when given."""
    base = rows[baseline]["final_loss"]
    print(columns)
    for name, r in rows.items():
        r[ratio_key] = r["final_loss"] / base
        print(line(name, r))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({**record, "rows": rows}, f, indent=1)


def train(recipe, steps: int, seed: int, transitions: torch.Tensor) -> dict:
    torch.manual_seed(seed)
    model = LM()
    if recipe is not None:
        fp8.convert(model, recipe)
    optimizer = ampkit.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses, seconds = train_steps(model, optimizer, steps, seed, transitions, autocast=True)
    converted = sum(isinstance(m, fp8.Float8Linear) for m in model.modules())
    return {**loss_summary(losses, seconds), "fp8_layers": converted, "skipped_layers": fp8.skipped_layers(model),
            "gemm_bytes_per_step": gemm_bytes(model, BATCH * SEQ, recipe is not None)}


def main() -> None:
    args = arguments(__doc__).parse_args()
    transitions = language(args.seed)
    runs = {"bf16": None, "fp8 current": fp8.CurrentScaling(), "fp8 delayed": fp8.DelayedScaling(amax_history_len=16)}
    rows = {name: train(recipe, args.steps, args.seed, transitions) for name, recipe in runs.items()}
    print(f"causal LM, {args.steps} steps, batch {BATCH}x{SEQ} tokens, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads (ln {SUCCESSORS} = {math.log(SUCCESSORS):.3f} attainable)")
    report(rows, "bf16", "loss_ratio_to_bf16",
           f"{'run':12s} {'loss':>8s} {'vs bf16':>8s} {'s/step':>8s} {'GEMM MB/step':>13s} {'fp8 layers':>10s}",
           lambda name, r: (f"{name:12s} {r['final_loss']:8.4f} {r['loss_ratio_to_bf16']:8.4f} "
                            f"{r['seconds_per_step']:8.3f} {r['gemm_bytes_per_step'] / 1e6:13.2f} "
                            f"{r['fp8_layers']:10d}"),
           args.json, {"steps": args.steps, "seed": args.seed, "torch": torch.__version__})


if __name__ == "__main__":
    main()
