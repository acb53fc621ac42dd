"""The HF Trainer with ampkit's optimizer and scaler through ampkit.integrations.accelerate.attach, on a small
GPT-2 built from a config with random weights and data made here (nothing downloaded): a skipped step changes no
weight and does not advance the schedule, clipping and the logged grad_norm see unscaled gradients; without attach,
an FP16 Trainer stepping ampkit's optimizer through its own torch.amp.GradScaler warns once, naming attach."""
from __future__ import annotations

import warnings

import pytest
import torch

import ampkit

transformers = pytest.importorskip("transformers")
from ampkit.integrations.accelerate import attach  # noqa: E402
from conftest import DEVICES  # noqa: E402

STEPS = 6
POISONED_STEP = 2

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=STEPS * 4, length=16, vocab=64):
        g = torch.Generator().manual_seed(11)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _PoisonedTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * float("inf") if self.state.global_step == POISONED_STEP else loss


class _Weights(transformers.TrainerCallback):
    def __init__(self, model):
        self.model = model
        self.after = []

    def on_step_end(self, args, state, control, **kwargs):
        self.after.append([p.detach().clone() for p in self.model.parameters()])


def test_trainer_with_ampkit_scaler_and_optimizer_skips_without_advancing_the_schedule(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, bf16=True, use_cpu=True,
        max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0, seed=0,
        disable_tqdm=True)
    weights = _Weights(model)
    trainer = _PoisonedTrainer(model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, sched),
                               callbacks=[weights])
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**16)  # dynamic loss scaling on BF16
    attach(trainer.accelerator, scaler)
    trainer.train()

    assert trainer.state.global_step == STEPS
    assert scaler.stats()["skipped_steps"] == 1
    assert sched.last_epoch == STEPS - 1  # the Trainer held the schedule at the skipped step
    before, after = weights.after[POISONED_STEP - 1], weights.after[POISONED_STEP]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert not all(torch.equal(a, b) for a, b in zip(after, weights.after[POISONED_STEP + 1]))
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(norms) == STEPS
    finite = [n for i, n in enumerate(norms) if i != POISONED_STEP]
    # unscaled: a random-weight GPT-2's gradient norm is O(1), the scaled one 65536 times that
    assert all(0.01 < n < 100.0 for n in finite), norms
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _fp16_trainer(tmp_path, device):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config).to(device)
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, fp16=True,
        use_cpu=device == "cpu", logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0,
        seed=0, disable_tqdm=True)
    weights = _Weights(model)
    trainer = _PoisonedTrainer(model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, sched),
                               callbacks=[weights])
    return trainer, sched, weights


def _attach_warnings(trainer) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return [str(w.message) for w in caught if "ampkit.integrations.accelerate.attach" in str(w.message)]


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_trainer_stepping_an_ampkit_optimizer_without_attach_warns_once(tmp_path, device):
    trainer, sched, weights = _fp16_trainer(tmp_path, device)
    if device == "cpu":
        # Accelerate builds torch's scaler for FP16 on accelerators only (torch.amp.GradScaler("cuda") on a GPU);
        # the same scaler on the CPU, before train() prepares the optimizer with it.
        assert trainer.accelerator.scaler is None
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    assert isinstance(trainer.accelerator.scaler, torch.amp.GradScaler)
    caught = _attach_warnings(trainer)
    assert len(caught) == 1, caught
    assert "ampkit.optim.AdamW" in caught[0] and "learning-rate schedule advances on skipped steps" in caught[0]
    # What it warns of: the poisoned step was skipped on the device, yet the Trainer advanced the schedule there.
    assert trainer.state.global_step == STEPS
    assert all(torch.equal(a, b) for a, b in zip(weights.after[POISONED_STEP - 1], weights.after[POISONED_STEP]))
    assert sched.last_epoch == STEPS


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_trainer_with_attach_does_not_warn(tmp_path, device):
    trainer, sched, _ = _fp16_trainer(tmp_path, device)
    scaler = ampkit.GradScaler(device, init_scale=2.0**16)
    attach(trainer.accelerator, scaler)
    assert _attach_warnings(trainer) == []
    assert scaler.stats()["skipped_steps"] >= 1 and sched.last_epoch == STEPS - scaler.stats()["skipped_steps"]


def test_save_pretrained_of_an_o2_model_round_trips_as_the_docs_say(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    fp32 = {k: v.clone() for k, v in model.state_dict().items()}
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-3)
    ampkit.decorate(model, opt, level="O2", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    low = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert low.config.dtype == torch.bfloat16
    assert low.transformer.ln_f.weight.dtype == torch.bfloat16  # O2 kept it FP32; the reload does not
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in again.parameters())
    wte = again.transformer.wte.weight
    assert torch.equal(wte, fp32["transformer.wte.weight"].to(torch.bfloat16).float())  # the rounded weights
    ampkit.decorate(again, ampkit.optim.AdamW(again.parameters(), lr=1e-3), level="O2", dtype=torch.bfloat16)
    assert again.transformer.wte.weight.dtype == torch.bfloat16 and again.transformer.ln_f.weight.dtype == torch.float32


@pytest.mark.parametrize("excluded", [["transformer.wte"], ["lm_head"], ["transformer.wte", "lm_head"]])
def test_decorate_keeps_every_owner_of_a_tied_weight_fp32(excluded):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # GPT-2 ties them
    fp32 = model.lm_head.weight.detach().clone()
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-3)
    ampkit.decorate(model, opt, level="O2", dtype=torch.bfloat16, excluded=excluded)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.dtype == torch.float32 and torch.equal(model.lm_head.weight, fp32)
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16  # the rest is cast
    ids = torch.randint(0, 64, (2, 16))
    out = model(input_ids=ids, labels=ids)  # runs: both owners compute in FP32
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    out.loss.backward()
    opt.step()
    assert model.lm_head.weight.dtype == torch.float32 and not torch.equal(model.lm_head.weight, fp32)
