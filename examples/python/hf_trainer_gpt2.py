"""The HF Trainer with ampkit's AdamW and GradScaler on a small GPT-2 built from a config (random weights, random
tokens: nothing is downloaded). The smallest set-up: build the Trainer with ampkit's optimizer, attach the scaler
to trainer.accelerator, train. Skipped steps do not advance the Trainer's schedule.

    python examples/python/hf_trainer_gpt2.py [--steps 30]
"""
import argparse
import tempfile

import torch
import transformers

import ampkit
from ampkit.integrations.accelerate import attach


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, length=32, vocab=128):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    on_cpu = not torch.cuda.is_available()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    with tempfile.TemporaryDirectory() as out:
        trainer = transformers.Trainer(
            model=model, train_dataset=Tokens(args.steps * 8), optimizers=(opt, sched),
            args=transformers.TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=8,
                                                bf16=True, use_cpu=on_cpu, max_grad_norm=1.0, logging_steps=10,
                                                report_to=[], save_strategy="no", disable_tqdm=True))
        scaler = ampkit.GradScaler("cpu" if on_cpu else "cuda", init_scale=2.0**16)
        attach(trainer.accelerator, scaler)  # before train(), which prepares
        result = trainer.train()
    print(f"steps={trainer.state.global_step} skipped={scaler.stats()['skipped_steps']} "
          f"schedule_steps={sched.last_epoch} train_loss={result.training_loss:.4f}")


if __name__ == "__main__":
    main()
