"""Skipped steps at the start of FP16 training: torch.amp.GradScaler's blind 2^16 against ampkit's calibrated
first scale (GradScaler(init_scale="auto"), NOTE [Calibrated first scale]), on three small workloads trained
under FP16 autocast: the digits classifier of the demo (scikit-learn's bundled data), a GAN with two optimizers
on one scaler, and a randomly initialised GPT-2 built from a config on local random tokens.

    python bench/calibration.py [--steps 100] [--device cpu] [--json out.json]

Prints, per workload and scaler, the skipped steps among the first --steps, the step of the first applied
update, and the scale at the end."""
from __future__ import annotations

import argparse
import json
import warnings

import torch

import ampkit


def digits(device, reduction="mean"):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32, device=device) / 16.0
    y = torch.tensor(data.target, device=device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)

    def step(scaler, dtype):
        idx = torch.randint(0, x.shape[0], (128,), generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        with ampkit.autocast(device, dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx], reduction=reduction)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return step


def digits_sum(device):
    """The digits classifier with a summed loss (reduction="sum", as many losses are written): 128x the grads."""
    return digits(device, reduction="sum")


def gan(device):
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).to(device)
    disc = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LeakyReLU(0.2), torch.nn.Linear(128, 1)).to(device)
    opt_g = ampkit.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = ampkit.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
    g = torch.Generator().manual_seed(2)
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def step(scaler, dtype):
        real = (torch.randn(64, 64, generator=g) * 0.5 + 1.0).to(device)
        z = torch.randn(64, 16, generator=g).to(device)
        opt_d.zero_grad(set_to_none=True)
        with ampkit.autocast(device, dtype=dtype):
            fake = gen(z)
            d_real, d_fake = disc(real), disc(fake.detach())
            loss_d = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
        scaler.scale(loss_d).backward()
        scaler.step(opt_d)
        opt_g.zero_grad(set_to_none=True)
        with ampkit.autocast(device, dtype=dtype):
            out = disc(fake)
            loss_g = bce(out, torch.ones_like(out))
        scaler.scale(loss_g).backward()
        scaler.step(opt_g)
        scaler.update()
    return step


def gpt2(device):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config).to(device)
    opt = ampkit.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(3)

    def step(scaler, dtype):
        ids = torch.randint(0, 512, (8, 64), generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        with ampkit.autocast(device, dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return step


WORKLOADS = {"digits": digits, "digits_sum": digits_sum, "gan": gan, "gpt2": gpt2}


def measure(name, device, steps, scaler_kind, **kwargs):
    step = WORKLOADS[name](device)
    scaler = (torch.amp.GradScaler(device, **kwargs) if scaler_kind == "torch.amp"
              else ampkit.GradScaler(device, **kwargs))
    first_applied = None
    skipped = 0
    for i in range(steps):
        before = scaler.get_scale()
        step(scaler, torch.float16)
        if scaler.get_scale() < before:
            skipped += 1  # torch.amp's scaler backs off exactly on the skipped steps (hysteresis 1)
        elif first_applied is None:
            first_applied = i + 1
    if scaler_kind == "ampkit":
        assert skipped == scaler.stats()["skipped_steps"]  # the scaler's own count agrees
    return {"workload": name, "scaler": scaler_kind, "options": {k: v for k, v in kwargs.items()},
            "skipped": skipped, "first_applied_step": first_applied, "final_scale": scaler.get_scale()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # FP16 on a CPU without FP16 units: said once, not the subject here
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    # torch's and Apex's first scale, Megatron's and DeepSpeed's larger one, then the calibrated one by margin.
    configs = [("torch.amp", {}), ("torch.amp", {"init_scale": 2.0**32}), ("ampkit", {}),
               ("ampkit", {"init_scale": "auto", "calibration_margin": 0.0}),
               ("ampkit", {"init_scale": "auto", "calibration_margin": 1.0}),
               ("ampkit", {"init_scale": "auto", "calibration_margin": 2.0}),
               ("ampkit", {"init_scale": "auto", "calibration_margin": 4.0})]
    print(f"first {args.steps} FP16 steps on {args.device}, torch {torch.__version__}")
    print(f"{'workload':10} {'scaler':46} {'skipped':>7} {'first applied':>13} {'final scale':>12}")
    for name in WORKLOADS:
        for kind, kwargs in configs:
            row = measure(name, args.device, args.steps, kind, **kwargs)
            rows.append(row)
            label = kind + ("" if not kwargs else " " + ", ".join(f"{k}={v}" for k, v in kwargs.items()))
            print(f"{name:10} {label:46} {row['skipped']:7d} {str(row['first_applied_step']):>13} "
                  f"{row['final_scale']:12.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "device": args.device, "torch": torch.__version__, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
