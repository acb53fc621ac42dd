"""BERT-style masked-language-model pre-training with ampkit: O2 mixed precision and LAMB, as NVIDIA's BERT recipe.

A small BERT-like encoder (token + learned position embeddings, ``torch.nn.TransformerEncoder``, an MLM head whose
decoder shares the token embedding) learns a synthetic "language" generated here from the seed: sentences from a
random first-order Markov chain over 100 words in 10 topics (each word is followed by one of two words of its
topic). The masked-token objective is BERT's: 15% of the positions are selected, of those 80% become [MASK], 10%
a random word and 10% stay; the loss covers only them. Answering the most frequent word scores a few percent;
knowing the sentence's topic, about 25%; knowing the neighbours too, over 90%.

What it shows:
  * ``ampkit.decorate(model, optimizer, level="O2")``: FP16 (CUDA) or BF16 (CPU) weights, LayerNorms kept FP32,
    and FP32 masters in the optimizer taken from the FP32 weights before the cast;
  * ``ampkit.optim.LAMB`` (Apex FusedLAMB's arguments) with BERT's two param groups: weight decay 0.01 for the
    weights, none for biases and LayerNorm parameters; its global grad-norm clipping (``max_grad_norm=1.0``);
  * ``ampkit.GradScaler`` (dynamic loss scaling for FP16, a fixed scale of 1 for BF16);
  * torch's own schedulers driving LAMB: linear warm-up, then linear decay (``SequentialLR``).

    python examples/python/bert_lamb.py [--steps 300] [--batch 64] [--seed 0] [--lr 2e-2] [--warmup 0.1]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ampkit

PAD, CLS, MASK, FIRST_WORD = 0, 1, 2, 3  # special ids (PAD reserved: the sequences have one length), then words
WORDS, SEQ_LEN = 100, 32
VOCAB = FIRST_WORD + WORDS


class Language:
    """A random first-order Markov chain over WORDS words in topics of ``topic`` words: each word is followed by
    one of ``successors`` words of its own topic (random weights), so a sentence keeps the topic of its first word."""

    def __init__(self, seed: int, successors: int = 2, topic: int = 10) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.transitions = torch.zeros(WORDS, WORDS)
        for w in range(WORDS):
            nxt = w - w % topic + torch.randperm(topic, generator=gen)[:successors]
            self.transitions[w, nxt] = torch.rand(successors, generator=gen) + 0.2

    def sentences(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """``n`` sequences of ids: [CLS] then SEQ_LEN - 1 words."""
        words = torch.empty(n, SEQ_LEN - 1, dtype=torch.long)
        words[:, 0] = torch.randint(WORDS, (n,), generator=gen)
        for t in range(1, SEQ_LEN - 1):
            words[:, t] = torch.multinomial(self.transitions[words[:, t - 1]], 1, generator=gen).squeeze(1)
        return torch.cat([torch.full((n, 1), CLS), words + FIRST_WORD], dim=1)


def mask_tokens(ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: returns (inputs, labels); labels are -100 (ignored) except at the selected positions."""
    selected = (torch.rand(ids.shape, generator=gen) < 0.15) & (ids >= FIRST_WORD)
    labels = torch.where(selected, ids, torch.full_like(ids, -100))
    draw = torch.rand(ids.shape, generator=gen)
    random_words = torch.randint(FIRST_WORD, VOCAB, ids.shape, generator=gen)
    inputs = torch.where(selected & (draw < 0.8), torch.full_like(ids, MASK), ids)
    inputs = torch.where(selected & (draw >= 0.8) & (draw < 0.9), random_words, inputs)
    return inputs, labels


class TinyBert(nn.Module):
    def __init__(self, d_model: int = 64, heads: int = 4, ff: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, d_model)
        self.positions = nn.Embedding(SEQ_LEN, d_model)
        self.embed_norm = nn.LayerNorm(d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.LayerNorm(d_model))
        self.decoder_bias = nn.Parameter(torch.zeros(VOCAB))
        for table in (self.tokens, self.positions):  # the decoder shares the token table: logits of order 1
            nn.init.normal_(table.weight, std=0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        h = self.head(self.encoder(self.embed_norm(x)))
        # The decoder is tied to the token embedding through F.linear, not by sharing the Parameter with an
        # nn.Linear: decorate would then meet the shared weight twice and take its master from the rounded copy.
        return F.linear(h, self.tokens.weight, self.decoder_bias)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """BERT's groups: decay for weight matrices and embeddings, none for biases and LayerNorm parameters."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            (no_decay if isinstance(module, nn.LayerNorm) or name.endswith("bias") else decay).append(p)
    return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]


def masked_loss_acc(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    logits = model(inputs).float()  # the loss in FP32
    loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100)
    picked = labels != -100
    return loss, (logits.argmax(-1)[picked] == labels[picked]).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=2e-2, help="LAMB's peak learning rate")
    parser.add_argument("--warmup", type=float, default=0.1, help="a fraction of --steps (< 1) or a step count")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    torch.manual_seed(args.seed)
    language = Language(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)

    model = TinyBert().to(device)  # FP32 here: the optimizer's masters are taken from these weights
    optimizer = ampkit.optim.LAMB(param_groups(model, 0.01), lr=args.lr, betas=(0.9, 0.999), eps=1e-6,
                                  max_grad_norm=1.0)
    model, optimizer = ampkit.decorate(model, optimizer, level="O2", dtype=dtype)
    scaler = ampkit.GradScaler(device, init_scale=2.0**16, scaling=dtype == torch.float16)

    warmup = max(1, round(args.warmup * args.steps) if args.warmup < 1 else int(args.warmup))
    schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.05, end_factor=1.0, total_iters=warmup),
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.01,
                                          total_iters=max(1, args.steps - warmup))], milestones=[warmup])

    every = max(1, args.steps // 10)
    losses = []
    for step in range(1, args.steps + 1):
        inputs, labels = (t.to(device) for t in mask_tokens(language.sentences(args.batch, gen), gen))
        lr = optimizer.param_groups[0]["lr"]  # the lr this step runs with
        optimizer.zero_grad()
        loss, acc = masked_loss_acc(model, inputs, labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        schedule.step()
        losses.append(loss.item())
        if step == 1 or step % every == 0:
            print(f"step {step} loss {losses[-1]:.4f} masked-acc {acc:.3f} lr {lr:.2e} scale {scaler.get_scale():g}")

    # Held out: sentences and masks the training never drew. The unigram baseline always answers the most
    # frequent word of the training text.
    held_out = torch.Generator().manual_seed(args.seed + 12345)
    inputs, labels = mask_tokens(language.sentences(512, held_out), held_out)
    counts = torch.bincount(language.sentences(512, gen).flatten(), minlength=VOCAB)[FIRST_WORD:]
    unigram = (labels[labels != -100] == counts.argmax() + FIRST_WORD).float().mean().item()
    model.eval()
    with torch.no_grad():
        eval_loss, eval_acc = masked_loss_acc(model, inputs.to(device), labels.to(device))
    w = model.encoder.layers[0].linear1.weight
    print(f"weights {w.dtype}, masters {optimizer.state[w]['master_param'].dtype}, "
          f"LayerNorm {model.embed_norm.weight.dtype}")
    print(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}, held-out loss {eval_loss.item():.4f}, "
          f"held-out masked-acc {eval_acc:.3f} (unigram baseline {unigram:.3f}), "
          f"LAMB last_grad_norm {optimizer.last_grad_norm.item():.4f}")


if __name__ == "__main__":
    main()
