"""The demo's training loop in Python: the digits classifier trained with ampkit (O1: autocast + ampkit.GradScaler;
O2: ampkit.decorate + ampkit.optim.AdamW with FP32 masters; O2 FP8: two layers in FP8; O2 8-bit: AdamW's moments
in 8-bit block-wise states) and, side by side, with torch.amp (autocast +
torch.amp.GradScaler + torch.optim.AdamW). On a GPU the O2 step is also captured once in a CUDA graph and replayed
(possible because ampkit's step makes no host sync). Prints one table.

Usage: python examples/python/train_demo.py [--epochs N] [--data DIGITS_BIN]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

import ampkit

DATA_PATH = None  # --data: the binary written by export_digits.py (for hosts without scikit-learn)


def load_xy():
    if DATA_PATH is None:
        from sklearn.datasets import load_digits

        d = load_digits()
        return torch.tensor(d.data / 16.0, dtype=torch.float32), torch.tensor(d.target, dtype=torch.int64)
    raw = open(DATA_PATH, "rb").read()
    n, dim = np.frombuffer(raw[:8], dtype="<i4")
    x = np.frombuffer(raw[8:8 + 4 * n * dim], dtype="<f4").reshape(n, dim)
    y = np.frombuffer(raw[8 + 4 * n * dim:], dtype="<i8")
    return torch.tensor(x.copy()), torch.tensor(y.copy())


def data(device):
    x, y = load_xy()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm].to(device), y[perm].to(device)
    n_test = len(x) // 6
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def model_fn(device):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10)).to(device)


def run(mode: str, device: str, dtype, epochs: int):
    xtr, ytr, xte, yte = data(device)
    model = model_fn(device)
    if mode == "ampkit O2 FP8":  # the 64->256 and 256->256 layers in FP8 (256->10: not a multiple of 16, kept)
        ampkit.fp8.convert(model, ampkit.fp8.DelayedScaling(amax_history_len=16))
    if mode.startswith("ampkit O2"):
        # O2 8-bit: the moments of the layers of 4096+ weights in 8-bit block-wise states (2.03 bytes per
        # parameter instead of 8)
        lean = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8) if mode == "ampkit O2 8-bit" else {}
        opt = ampkit.optim.AdamW(model.parameters(), lr=2e-3, **lean)
        model, opt = ampkit.decorate(model, opt, level="O2", dtype=dtype)
        scaler = ampkit.GradScaler(device)
    elif mode == "ampkit O1":
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        scaler = ampkit.GradScaler(device)
    else:  # torch.amp
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        scaler = torch.amp.GradScaler(device)
    autocast = (lambda: torch.autocast(device, dtype=dtype)) if not mode.startswith("ampkit O2") else None
    steps, start, loss = 0, time.perf_counter(), None
    for _ in range(epochs):
        perm = torch.randperm(len(xtr), device=device)
        for b in range(0, len(xtr) - 49, 50):
            idx = perm[b:b + 50]
            opt.zero_grad()
            if autocast is not None:
                with autocast():
                    loss = F.cross_entropy(model(xtr[idx]).float(), ytr[idx])
            else:
                loss = F.cross_entropy(model(xtr[idx].to(dtype)).float(), ytr[idx])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            steps += 1
    seconds = time.perf_counter() - start
    with torch.no_grad():
        model.eval()
        logits = model(xte.to(dtype) if mode.startswith("ampkit O2") else xte)
        acc = (logits.argmax(1) == yte).float().mean().item()
    return dict(mode=mode, loss=loss.item(), acc=acc, steps_per_s=steps / seconds, scale=scaler.get_scale())


def cuda_graph_o2(dtype):
    """Captures one whole O2 step (forward, backward, scaler, fused optimizer) in a CUDA graph and replays it."""
    xtr, ytr, _, _ = data("cuda")
    model = model_fn("cuda")
    opt = ampkit.optim.AdamW(model.parameters(), lr=2e-3)
    model, opt = ampkit.decorate(model, opt, level="O2", dtype=dtype)
    scaler = ampkit.GradScaler("cuda")
    x, y = xtr[:50].to(dtype).clone(), ytr[:50].clone()

    def step():
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm-up: creates the optimizer and scaler state
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    for _ in range(100):
        graph.replay()
    torch.cuda.synchronize()
    return static_loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--data", help="digits binary from export_digits.py (default: load it from scikit-learn)")
    args = parser.parse_args()
    global DATA_PATH
    DATA_PATH = args.data
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    modes = ("torch.amp O1", "ampkit O1", "ampkit O2", "ampkit O2 FP8", "ampkit O2 8-bit")
    rows = [run(m, device, dtype, args.epochs) for m in modes]
    print(f"{'mode':<15} {'final loss':>10} {'test acc':>9} {'steps/s':>9} {'scale':>9}")
    for r in rows:
        print(f"{r['mode']:<15} {r['loss']:10.4f} {100 * r['acc']:8.1f}% {r['steps_per_s']:9.1f} {r['scale']:9.0f}")
    if device == "cuda":
        print(f"CUDA-graph-captured O2 step: 100 replays, loss {cuda_graph_o2(dtype):.4f}")


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
