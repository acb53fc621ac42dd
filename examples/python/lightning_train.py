"""A Lightning Trainer with ampkit: AmpkitPrecision (autocast + ampkit's scaler), a fused ampkit.optim.AdamW,
gradient clipping on unscaled gradients, and a per-step schedule that does not advance on a skipped step.

    python examples/python/lightning_train.py [--precision 16-mixed|bf16-mixed|bf16-true] [--device cpu|cuda]
"""
import argparse
import warnings

import lightning.pytorch as pl
import torch

import ampkit
from ampkit.integrations.lightning import AmpkitPrecision


class Regressor(pl.LightningModule):
    def __init__(self, poison_step: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                       torch.nn.Linear(64, 1))
        self.poison_step = poison_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        if self.global_step == self.poison_step:
            loss = loss * float("inf")  # an overflow, to show the skip
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        opt = ampkit.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="16-mixed", choices=["16-mixed", "bf16-mixed", "bf16-true"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    w = torch.randn(32, 1)
    x = torch.randn(args.steps * 16, 32)
    data = torch.utils.data.TensorDataset(x, x @ w + 0.1 * torch.randn(len(x), 1))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    # BF16 needs no loss scale; a scaling=False scaler still checks every step and skips a non-finite one.
    scaler = ampkit.GradScaler(args.device, scaling=args.precision.startswith("16"))
    plugin = AmpkitPrecision(args.precision, device=args.device, scaler=scaler)
    model = Regressor(poison_step=5)
    trainer = pl.Trainer(plugins=[plugin], accelerator=args.device, devices=1, max_steps=args.steps,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, loader)
    sched = trainer.lr_scheduler_configs[0].scheduler
    skipped = getattr(sched, "skipped_steps", 0)
    print(f"precision={args.precision} steps={trainer.global_step} skipped={skipped} "
          f"schedule_steps={sched.last_epoch} final_loss={float(trainer.callback_metrics['loss']):.4f} "
          f"weights={model.net[0].weight.dtype}")


if __name__ == "__main__":
    main()
