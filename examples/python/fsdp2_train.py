"""Multi-node HSDP training with ampkit: a small GPT (built from a config, random weights) learns a random Markov
chain of tokens generated on each rank, under torchrun, with FSDP2 on a 2-D mesh (``init_device_mesh`` with
``("replicate", "shard")``: each node holds one replica of the model, sharded over the node's processes;
``fully_shard(..., mesh=mesh)``), Gloo, one thread per rank. The parameters are BF16 and ampkit.optim.AdamW keeps
FP32 masters of their shards (``--lean``: one of the lean modes instead); ampkit.GradScaler scales the loss
dynamically, FP16-style, and skips a step whose gradients hold an Inf on any rank. ``--inf-at-step N
--inf-on-node K`` writes an Inf into one gradient on one rank of node K before FSDP2 reduces it: the step is
skipped on every rank of every node and the scale halves. ``--save-at N --checkpoint DIR`` saves a distributed
checkpoint (torch.distributed.checkpoint, torch's get_state_dict: model, optimizer, scaler) after step N;
``--resume DIR`` continues from one, on this or another number of nodes.

``--compress bf16`` (or ``fp16``) hands the root module and the scaler to ``ampkit.distributed.compress_fsdp``
(NOTE [Compressed FSDP reduction] in python/ampkit/distributed.py): within each node the gradients go over an
all-to-all in BF16 (FP16) and each rank adds the parts it receives in FP32; the scaler's overflow check travels
with them, so the scaler all-reduces no found_inf flag and every rank still skips together. The all-reduce across
the nodes stays FSDP2's own, in its ``reduce_dtype``: with ``bf16`` that is the parameters' BF16 (both legs in
BF16 on the wire); ``fp16`` shards with ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``, since compress_fsdp
puts FP32 buffers only on an FP16 wire (casting and checking them there), so that leg goes in FP32. ``--compress
none`` (the default) leaves FSDP2's reduce-scatter and the scaler's all-reduce as they are. A checkpoint holds no
transport: a run resumes with or without ``--compress`` (pass it again to keep it).

Two nodes of two processes on this machine (loopback), one command per node, started together:

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \\
        --rdzv-id hsdp examples/python/fsdp2_train.py --steps 24 --inf-at-step 8 --inf-on-node 1 \\
        --save-at 16 --checkpoint /tmp/hsdp-ckpt --compress bf16
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \\
        --rdzv-id hsdp examples/python/fsdp2_train.py --steps 24 --inf-at-step 8 --inf-on-node 1 \\
        --save-at 16 --checkpoint /tmp/hsdp-ckpt --compress bf16

On a cluster, the endpoint is the first node's address and the checkpoint a folder every node writes to. The
checkpoint resumed on one node of two processes (the same global batch, split over two ranks instead of four):

    torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29501 --rdzv-id resume \\
        examples/python/fsdp2_train.py --steps 24 --resume /tmp/hsdp-ckpt --compress bf16

(or ``torchrun --standalone --nproc-per-node 2 ...``). A node is the mesh's row: the rendezvous numbers the nodes
(torchrun's GROUP_RANK), which may differ from ``--node-rank``; ``--inf-on-node`` counts as it does.
``--report DIR`` writes what each rank saw (losses, scale, skipped steps, digests of its shards and of the whole
state; with ``--compress``, the bytes compress_fsdp sent) to DIR/rank<R>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import ampkit
import ampkit.distributed

# --lean: the optimizer's arguments beyond lr and weight decay. "masters" (the default) keeps FP32 masters and FP32
# moments: 14 bytes per BF16 parameter; each lean mode keeps fewer (README's table of the lean modes).
LEAN = {
    "masters": dict(master_weights=True),
    "bf16-moments": dict(master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "8bit": dict(master_weights=True, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    "kahan": dict(master_weights="kahan"),
    "remainder": dict(master_weights="remainder"),
}
# --compress: compress_fsdp's wire dtype and the MixedPrecisionPolicy to shard with (None: FSDP2's default, reduce
# in the parameters' BF16). FP16 takes an FP32 buffer (compress_fsdp refuses BF16 grads on an FP16 wire).
COMPRESS = {
    "none": (None, None),
    "bf16": (torch.bfloat16, None),
    "fp16": (torch.float16, MixedPrecisionPolicy(reduce_dtype=torch.float32)),
}


@dataclasses.dataclass
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    width: int = 32
    heads: int = 2
    layers: int = 2


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a GELU MLP of 4x the width."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.qkv, self.proj = nn.Linear(cfg.width, 3 * cfg.width), nn.Linear(cfg.width, cfg.width)
        self.fc, self.out = nn.Linear(cfg.width, 4 * cfg.width), nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok, self.pos = nn.Embedding(cfg.vocab, cfg.width), nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build(cfg: GPTConfig, mesh, lean: str, lr: float, compress: str = "none"):
    """The model in BF16, each block and then the root sharded over the mesh's "shard" dimension and replicated
    over its "replicate" one (HSDP); the optimizer; the scaler; with ``compress`` other than "none", the gradient
    reduction of every FSDP module compressed for that scaler (compress_fsdp on the root), else None."""
    torch.manual_seed(0)  # the same initial weights on every rank
    wire, policy = COMPRESS[compress]
    shard = dict(mesh=mesh) if policy is None else dict(mesh=mesh, mp_policy=policy)
    model = GPT(cfg).to(torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, **shard)
    fully_shard(model, **shard)
    optimizer = ampkit.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, **LEAN[lean])
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**16, growth_interval=10)
    compression = None if wire is None else ampkit.distributed.compress_fsdp(model, scaler, dtype=wire)
    return model, optimizer, scaler, compression


def batch(cfg: GPTConfig, step: int, global_batch: int, rank: int, world: int) -> tuple:
    """This rank's rows of step ``step``'s global batch: sequences of a Markov chain whose transition table is drawn
    from a fixed seed (each token has a few likely successors). Every world size sees the same global batch."""
    table = torch.softmax(3.0 * torch.randn(cfg.vocab, cfg.vocab, generator=torch.Generator().manual_seed(7)), 1)
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.empty(global_batch, cfg.seq + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, cfg.vocab, (global_batch,), generator=g)
    for t in range(cfg.seq):
        ids[:, t + 1] = torch.multinomial(table[ids[:, t]], 1, generator=g).squeeze(1)
    rows = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
    return ids[rows, :-1], ids[rows, 1:]


def inject_inf(model: GPT):
    """Writes an Inf into the last element of the first block's MLP weight gradient, as this rank computes it, before
    FSDP2 reduces it; returns the hook's handle. (In the forward, ``fc.weight`` is the unsharded parameter whose
    gradient FSDP2 reduce-scatters.)"""
    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[-1] = math.inf
        return grad

    handles = []

    def register(module, args):
        handles.append(module.weight.register_hook(poison))

    handles.append(model.blocks[0].fc.register_forward_pre_hook(register))
    return handles


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def shard_digests(model, optimizer) -> dict:
    """sha256 of this rank's shards of the parameters, and of the parameters with every optimizer state entry."""
    params, everything = hashlib.sha256(), hashlib.sha256()
    for p in model.parameters():
        params.update(_bytes(_local(p)))
        everything.update(_bytes(_local(p)))
        for key in sorted(optimizer.state[p]):
            everything.update(_bytes(_local(optimizer.state[p][key])))
    return {"params": params.hexdigest(), "state": everything.hexdigest()}


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather over the mesh's shard dimension). Gloo all-gathers no int16 tensor: the
    remainders travel as the BF16 of the same bits."""
    if not isinstance(t, DTensor):
        return t
    if t.dtype == torch.int16:
        local = t.to_local().view(torch.bfloat16)
        t = DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
        return t.full_tensor().view(torch.int16)
    return t.full_tensor()


def full_digests(model, optimizer, scaler) -> dict:
    """sha256 of each whole parameter and optimizer state entry, by name, and the scaler's state: the same on every
    rank, and on every number of nodes for the same state."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = hashlib.sha256(_bytes(_full(p))).hexdigest()
        for key in sorted(optimizer.state[p]):
            out[f"{name} {key}"] = hashlib.sha256(_bytes(_full(optimizer.state[p][key]))).hexdigest()
    return {"tensors": out, "scaler": scaler.state_dict()}


def save(path: str, step: int, model, optimizer, scaler) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict(), "step": step}, checkpoint_id=path)


def load(path: str, model, optimizer, scaler) -> int:
    """Loads the checkpoint into this run's shards (DCP reads what each rank's shards hold); returns its step."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # makes the optimizer's state (a step of lr 0) if none
    state = {"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scaler.load_state_dict(state["scaler"])
    return state["step"]


def train(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = world // per_node
    node = rank // per_node  # the mesh's row: the rendezvous's numbering of the nodes (GROUP_RANK)
    mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
    cfg = GPTConfig()
    model, optimizer, scaler, compression = build(cfg, mesh, args.lean, args.lr, args.compress)
    report = {"rank": rank, "world": world, "node": node, "group_rank": int(os.environ.get("GROUP_RANK", node)),
              "mesh": [nodes, per_node], "lean": args.lean, "compress": args.compress, "steps": []}
    start = 0
    if args.resume:
        start = load(args.resume, model, optimizer, scaler)
        report["loaded"] = dict(full_digests(model, optimizer, scaler), step=start)
    report["start"] = shard_digests(model, optimizer)
    for step in range(start, args.steps):
        x, y = batch(cfg, step, args.global_batch, rank, world)
        optimizer.zero_grad(set_to_none=True)
        injected = step == args.inf_at_step and node == args.inf_on_node and rank % per_node == 0
        handles = inject_inf(model) if injected else []
        loss = F.cross_entropy(model(x).float().reshape(-1, cfg.vocab), y.reshape(-1))
        scaler.scale(loss).backward()
        for handle in handles:
            handle.remove()
        # whether this rank's reduced shards hold the Inf (the scaler all-reduces its flag over the shards; with
        # --compress, every rank's do: compress_fsdp passes the flag on inside the reduced grads)
        nonfinite = any(not _local(p.grad).isfinite().all() for p in model.parameters() if p.grad is not None)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        ran = bool(scaler.last_step_ran())
        report["steps"].append(dict(step=step, loss=loss.item(), scale_before=scale, scale=scaler.get_scale(),
                                    ran=ran, injected=injected, local_nonfinite=nonfinite,
                                    **shard_digests(model, optimizer)))
        if rank == 0 and (step % args.log_every == 0 or not ran or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f} (rank 0's rows)  scale {scaler.get_scale():.0f}"
                  + ("" if ran else "  skipped"), flush=True)
        if args.save_at is not None and step + 1 == args.save_at:
            save(args.checkpoint, step + 1, model, optimizer, scaler)
            report["saved"] = dict(full_digests(model, optimizer, scaler), step=step + 1)
            if rank == 0:
                print(f"saved the state after step {step} to {args.checkpoint}", flush=True)
    stats = scaler.stats()
    if compression is not None:
        report["compressed_bytes_sent"] = compression.bytes_sent()
    if rank == 0:
        losses = [s["loss"] for s in report["steps"]]
        print(f"{nodes} node(s) x {per_node} process(es), {args.lean}, compress {args.compress}: steps "
              f"{start}-{args.steps - 1}, loss {losses[0]:.4f} -> {losses[-1]:.4f}, skipped "
              f"{stats['skipped_steps']}, scale {stats['scale']:.0f}", flush=True)
    if args.report:
        os.makedirs(args.report, exist_ok=True)
        with open(os.path.join(args.report, f"rank{rank}.json"), "w") as f:
            json.dump(report, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="train until this step (from the checkpoint's on)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step over every rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lean", choices=sorted(LEAN), default="masters", help="the optimizer's state mode")
    parser.add_argument("--compress", choices=list(COMPRESS), default="none",
                        help="the gradients' dtype on the wire within a node (ampkit.distributed.compress_fsdp)")
    parser.add_argument("--inf-at-step", type=int, default=None)
    parser.add_argument("--inf-on-node", type=int, default=0)
    parser.add_argument("--save-at", type=int, default=None, help="save after this many steps (needs --checkpoint)")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--resume", default=None, help="a checkpoint folder to continue from")
    parser.add_argument("--report", default=None, help="a folder for each rank's rank<R>.json")
    parser.add_argument("--log-every", type=int, default=4)
    args = parser.parse_args()
    if args.save_at is not None and args.checkpoint is None:
        parser.error("--save-at needs --checkpoint")
    torch.set_num_threads(1)  # one core per rank
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        train(args)
    finally:
        # DTensors hold the process groups, and FSDP2's modules sit in reference cycles: collected while the groups
        # live, not at exit (see the finally of tests/python/test_fsdp2.py's _worker).
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
