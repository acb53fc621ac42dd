"""O2 with ampkit: the model in FP16 (CUDA) or BF16 (CPU) with FP32 masters in ampkit.optim.AdamW, taken from the
FP32 weights before the cast; ampkit.GradScaler drives the fused optimizer without a host sync."""
from __future__ import annotations

import torch

import ampkit


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    optimizer = ampkit.optim.AdamW(model.parameters(), lr=3e-3)
    optimizer.init_master_params()  # FP32 masters from the FP32 weights...
    model.to(dtype)                 # ...then the model goes low precision
    scaler = ampkit.GradScaler(device, init_scale=1024.0, scaling=dtype == torch.float16)

    x = torch.randn(512, 32, device=device)
    y = torch.sin(x[:, :4].sum(1, keepdim=True))
    for step in range(1, 201):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 50 == 0:
            print(f"step {step:3d}  loss {loss.item():.5f}  scale {scaler.get_scale():.0f}")
    w = model[0].weight
    master = optimizer.state[w]["master_param"]
    print(f"weights {w.dtype}, masters {master.dtype}, weight == master rounded: {torch.equal(w, master.to(dtype))}")


if __name__ == "__main__":
    main()
