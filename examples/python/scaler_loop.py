"""A PyTorch training loop with ampkit.GradScaler, a drop-in for torch.amp.GradScaler: autocast forward,
scaled backward, clipping on unscaled grads, a skipped step on an injected overflow, the scaler's stats.

Usage: python examples/python/scaler_loop.py [--checkpoint PATH]  (PATH: a scaler checkpoint from C++ to resume)
"""
from __future__ import annotations

import argparse

import torch

import ampkit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", help="scaler checkpoint written by C++ torch::save(scaler, path)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ampkit.GradScaler(device, init_scale=1024.0, growth_interval=20, overflow_report=True)
    scaler.name_parameters(model.named_parameters())
    if args.checkpoint:
        scaler.load(args.checkpoint)
        print(f"resumed scaler state from {args.checkpoint}: scale {scaler.get_scale():.0f}")

    x = torch.randn(256, 32, device=device)
    y = x[:, :4].sum(1, keepdim=True)
    for step in range(1, 61):
        optimizer.zero_grad()
        with torch.autocast(device_type=device, dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step == 30:
            model[2].bias.grad[0] = float("inf")
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        if step == 30:
            print(f"step 30 skipped: {not scaler.last_step_ran().item()}, overflow in {scaler.overflow_report()}")
        if step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.5f}  scale {scaler.get_scale():.0f}")
    print("stats:", scaler.stats())


if __name__ == "__main__":
    main()
