"""An HF Accelerate loop with ampkit's scaler: attach() before prepare(), then Accelerate's usual loop; clipping
sees unscaled gradients and the scheduler does not advance on a skipped step.

    python examples/python/accelerate_train.py [--mixed-precision fp16|bf16] [--cpu]
"""
import argparse

import torch
from accelerate import Accelerator

import ampkit
from ampkit.integrations.accelerate import attach


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixed-precision", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", default=not torch.cuda.is_available())
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=args.cpu)
    scaler = ampkit.GradScaler(accelerator.device.type, init_scale=2.0**16)  # dynamic scaling, BF16 too
    attach(accelerator, scaler)  # before prepare

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = ampkit.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    w = torch.randn(32, 1)
    x = torch.randn(args.steps * 16, 32)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x @ w), batch_size=16)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    skipped = 0
    for step, (xb, yb) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
        if step == 5:
            loss = loss * float("inf")  # an overflow, to show the skip
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # on unscaled gradients
        opt.step()
        sched.step()  # held by Accelerate when the step was skipped
        opt.zero_grad()
        skipped += accelerator.optimizer_step_was_skipped  # one host read
    print(f"mixed_precision={args.mixed_precision} steps={step + 1} skipped={skipped} "
          f"schedule_steps={sched.scheduler.last_epoch} last_grad_norm={float(norm):.3f} "
          f"final_loss={float(loss.detach()):.4f} scale={scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
