"""FSDP2 (``fully_shard``: DTensor parameters, grads and optimizer states) on the CPU over Gloo, two ranks, one
thread each: ampkit.optim against torch.optim under the same sharding and data, distributed checkpoints, and
loss scaling with an Inf/NaN in one rank's shard of a gradient.

The model has uneven shards (3 rows over 2 ranks) and an empty one (1 row: rank 1 holds none). Each rank checks
its own local shards, so no collective runs between the ranks' checks; cross-rank facts are checked here from
what the ranks save. torch.optim's fused CPU kernels are the bitwise reference (ampkit's FP32 steps are
bit-identical to them, see test_optim_bitwise_torch.py); torch.optim's default (single-tensor) steps differ from
them by rounding only, checked to rtol 1e-5, atol 1e-7.
"""
from __future__ import annotations

import gc
import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ampkit

WORLD = 2
STEPS = 4

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
except ImportError:  # torch without distributed support or without FSDP2
    fully_shard = None

# Also the marker of the other FSDP2 test files.
NEEDS_FSDP2 = pytest.mark.skipif(
    fully_shard is None or not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with Gloo and FSDP2 (torch.distributed.fsdp.fully_shard)")
pytestmark = [
    NEEDS_FSDP2,
    pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                       reason="bit-identity with torch's fused CPU kernels holds for its AVX2/AVX-512 kernels"),
]


# ---- running the ranks ------------------------------------------------------------------------------------------

def _run(tmp_path, case: str, *args, world: int = WORLD) -> list:
    """Runs ``case(rank, out_dir, *args)`` on ``world`` spawned ranks; returns what each rank returned."""
    store = tmp_path / f"store{world}"
    mp.spawn(_worker, args=(str(store), str(tmp_path), case, args, world), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _worker(rank: int, store: str, out_dir: str, case, args: tuple, world: int) -> None:
    """One rank of ``case``: the name of a case of this module, or a case function of another test module (which the
    rank imports to unpickle it: test_checkpoint_reshard.py's)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        result = (case if callable(case) else globals()[case])(rank, out_dir, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        # DTensors hold the process group, and a case's objects can outlive it in reference cycles (an exception
        # checked with pytest.raises keeps its frame): collected here, while the group lives, and not at exit, where
        # the last holder destroyed the Gloo group with a worker thread still joinable (SIGABRT, "terminate called
        # without an active exception"; see the finally of examples/python/ddp_train.py for the DDP twin).
        result = None
        gc.collect()
        dist.destroy_process_group()


# ---- model, data and checks -------------------------------------------------------------------------------------

def _unsharded_model(dtype=torch.float32) -> nn.Module:
    """The model of :func:`_model` before sharding, seeded alike."""
    torch.manual_seed(0)
    # 16 rows: even shards; 3 rows: 2 + 1; 1 row: rank 1's shard is empty.
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3), nn.ReLU(), nn.Linear(3, 1)).to(dtype)


def _model(mp_policy=None, dtype=torch.float32, mesh=None) -> nn.Module:
    model = _unsharded_model(dtype)
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    if mesh is not None:
        kwargs["mesh"] = mesh
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own batch
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    return (model(x.to(next(model.parameters()).dtype)).float() - y).square().mean()


def _train(model, opt, rank: int, steps=range(STEPS), scaler=None, inf_at=None) -> list:
    """Trains; returns the local shards of the parameters after each step."""
    history = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, rank, step)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if step == inf_at and rank == 1:
                with torch.no_grad():
                    model[2].weight.grad.to_local()[-1, -1] = math.inf  # a shard only rank 1 holds
            scaler.step(opt)
            scaler.update()
        history.append([p.detach().to_local().clone() for p in model.parameters()])
    return history


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if exact:
        return torch.equal(a, b)
    return torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-7)


def _check_like(ref_model, ref_opt, model, opt, exact: bool, what: str) -> None:
    """Same local shards of parameters and states, and states of the same kinds (DTensor of the parameter's
    layout, or plain tensor) as the reference. ampkit's SGD with momentum also keeps a ``step``, which torch's
    doesn't (a plain scalar, as Adam's)."""
    for i, (rp, p) in enumerate(zip(ref_model.parameters(), model.parameters())):
        assert isinstance(p, DTensor) and rp.placements == p.placements
        assert _same(rp.detach().to_local(), p.detach().to_local(), exact), f"{what}: param {i}"
        ref_st, st = ref_opt.state[rp], opt.state[p]
        assert set(st) - _extra_keys(ref_opt, opt) == set(ref_st), f"{what}: state keys {set(st)} of param {i}"
        if "step" in st:
            assert type(st["step"]) is torch.Tensor and st["step"].dim() == 0, what
        for key, ref_v in ref_st.items():
            v = st[key]
            assert type(v) is type(ref_v), f"{what}: state[{key!r}] of param {i} is a {type(v).__name__}"
            if isinstance(v, DTensor):
                assert v.placements == ref_v.placements and v.shape == ref_v.shape, f"{what}: {key} of param {i}"
                v, ref_v = v.to_local(), ref_v.to_local()
            # step counts are exact either way
            assert _same(ref_v, v, exact or key == "step"), f"{what}: state[{key!r}] of param {i}"


def _extra_keys(ref_opt, opt) -> set:
    return {"step"} if isinstance(opt, ampkit.optim.SGD) and not isinstance(ref_opt, ampkit.optim.SGD) else set()


def _check_state_dicts(ref_opt, opt, what: str) -> None:
    """optimizer.state_dict() of the same structure as torch.optim's (ids, keys, tensor kinds)."""
    ref_sd, sd = ref_opt.state_dict(), opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in ref_sd["param_groups"]], what
    assert sd["state"].keys() == ref_sd["state"].keys(), what
    extra = _extra_keys(ref_opt, opt)
    for pid, ref_st in ref_sd["state"].items():
        kinds = {k: type(v) for k, v in sd["state"][pid].items() if k not in extra}
        assert kinds == {k: type(v) for k, v in ref_st.items()}, what


# ---- optimizers against torch.optim -----------------------------------------------------------------------------

def _train_with_shadow(model, opt, rank: int, shadow_cls, shadow_kwargs: dict, prepare=None) -> tuple:
    """Trains ``model`` with ``opt`` and, step by step, a ``shadow_cls`` optimizer on plain tensors that start as
    each rank's local shards and get the same local grads: an elementwise update of the shards must equal it.
    ``prepare(shadow_opt)``, if given, adjusts the shadow optimizer before the first step."""
    params = list(model.parameters())
    shadows = [nn.Parameter(p.detach().to_local().clone()) for p in params]
    shadow_opt = shadow_cls(shadows, **shadow_kwargs)
    if prepare is not None:
        prepare(shadow_opt)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _loss(model, rank, step).backward()
        for p, s in zip(params, shadows):
            s.grad = p.grad.to_local().clone()
        opt.step()
        shadow_opt.step()
    return params, shadow_opt, shadows


def _check_shadow(opt, params, shadow_opt, shadows, what: str) -> None:
    """Each shard and state entry equal to the shadow's; ``step`` and ``sr_seed`` plain scalars (the shadow's seed is
    the shard's key, :func:`_shard_key`), every other entry a DTensor of the parameter's layout."""
    extra = _extra_keys(shadow_opt, opt)
    for i, (p, s) in enumerate(zip(params, shadows)):
        assert torch.equal(p.detach().to_local(), s.detach()), f"{what}: param {i}"
        assert set(opt.state[p]) - extra == set(shadow_opt.state[s]), what
        for key, v in opt.state[p].items():
            if key in ("step", "sr_seed"):
                assert type(v) is torch.Tensor and v.dim() == 0, what
                v = _shard_key(v, p) if key == "sr_seed" else v
            else:
                assert isinstance(v, DTensor) and v.placements == p.placements and v.shape == p.shape, what
                v = v.to_local()
            if key not in extra:
                assert torch.equal(v, shadow_opt.state[s][key]), f"{what}: state[{key!r}] of param {i}"


def _shard_key(seed: torch.Tensor, p) -> torch.Tensor:
    """The key this rank's shard of ``p`` (on a one-dimensional mesh, or replicated over one) rounds with in
    master_weights="stochastic": the parameter's seed XOR k * 0x9E3779B97F4A7C15 mod 2^64, k the shard's index (NOTE
    [Stochastic rounding of DTensor parameters] in ampkit/_dtensor.py); shard 0's is the seed."""
    dims = [d for d, placement in enumerate(p.placements) if placement.is_shard()]
    k = p.device_mesh.get_local_rank(dims[0]) if dims else 0
    mask = k * 0x9E3779B97F4A7C15 % 2**64
    return seed ^ (mask - 2**64 if mask >= 2**63 else mask)


def _keyed_like(opt, params):
    """A ``prepare`` of :func:`_train_with_shadow` for master_weights="stochastic": before its first step, the
    shadow of each shard takes the shard's key as its seed (the sharded step, which runs first, has made the seeds)."""
    def prepare(shadow_opt):
        shadows = shadow_opt.param_groups[0]["params"]

        def take_keys(optimizer, args, kwargs):
            for p, s in zip(params, shadows):
                if not optimizer.state.get(s):
                    optimizer.state[s]["sr_seed"] = _shard_key(opt.state[p]["sr_seed"], p)
        shadow_opt.register_step_pre_hook(take_keys)
    return prepare


# FSDP2 mixed-precision policies of test_optimizers_match_torch_under_fsdp2: none, BF16 compute (reduce-scatter in
# BF16), BF16 compute with a FP32 reduce-scatter (FP32 grads of BF16 compute: what FSDP2 offers in place of BF16
# sharded parameters with grad_dtype=torch.float32, which torch 2.13 refuses; test_grad_dtype.py).
POLICIES = {"fp32": None, "bf16-mixed-precision-policy": dict(param_dtype=torch.bfloat16),
            "bf16-compute-fp32-reduce": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def _case_optimizers(rank: int, out_dir: str, policy_name: str) -> dict:
    policy = MixedPrecisionPolicy(**POLICIES[policy_name]) if POLICIES[policy_name] else None
    bf16_compute = policy is not None
    # (name, torch's class, ampkit's, arguments, {torch's variant: bit-identical to ampkit's?}). torch's fused SGD
    # has no DTensor sharding rule: it is run on plain tensors holding the shards instead.
    cases = [
        ("AdamW", torch.optim.AdamW, ampkit.optim.AdamW, dict(lr=1e-2, weight_decay=0.1),
         {"fused": True, "default": False}),
        ("Adam amsgrad", torch.optim.Adam, ampkit.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True),
         {"fused": True, "default": False}),
        ("SGD momentum", torch.optim.SGD, ampkit.optim.SGD,
         dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True), {"fused on shards": True, "default": False}),
    ]
    for name, torch_cls, ampkit_cls, kwargs, refs in cases:
        model = _model(policy)
        opt = ampkit_cls(model.parameters(), **kwargs)
        if "fused on shards" in refs:
            shadowed = _train_with_shadow(model, opt, rank, torch_cls, dict(kwargs, fused=True))
            _check_shadow(opt, *shadowed, what=f"{name} vs torch fused on the shards")
        else:
            _train(model, opt, rank)
        if bf16_compute:  # FSDP2 keeps FP32 sharded parameters and grads; compute and reduce-scatter in BF16
            p = next(model.parameters())
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        for variant, exact in refs.items():
            if variant == "fused on shards":
                continue
            ref_model = _model(policy)
            ref_opt = torch_cls(ref_model.parameters(), **kwargs, **({"fused": True} if variant == "fused" else {}))
            _train(ref_model, ref_opt, rank)
            _check_like(ref_model, ref_opt, model, opt, exact=exact, what=f"{name} vs torch {variant}")
            _check_state_dicts(ref_opt, opt, name)
    return {}


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_optimizers_match_torch_under_fsdp2(tmp_path, policy_name):
    _run(tmp_path, "_case_optimizers", policy_name)


def _case_low_precision_params(rank: int, out_dir: str) -> dict:
    """BF16 sharded parameters with FP32 masters, remainders, Kahan compensations or stochastic rounding: the update
    of each rank's shards is exactly ampkit's update of plain tensors holding those shards and grads (and, for
    stochastic rounding, the shard's key); masters, remainders and compensations are DTensors of the parameter's
    layout, stochastic rounding's seeds plain scalars. Each rank's default generator is seeded apart before the first
    step: the seeds, which the ranks return, must agree all the same. Then :func:`_stochastic_shards` and an HSDP run
    of stochastic rounding (whose two replicas, returned, must stay equal)."""
    cases = [(ampkit.optim.AdamW, dict(lr=1e-2)), (ampkit.optim.AdamW, dict(lr=1e-2, master_weights="remainder")),
             (ampkit.optim.SGD, dict(lr=0.05, momentum=0.9)),
             (ampkit.optim.AdamW, dict(lr=1e-2, master_weights="kahan", exp_avg_dtype=torch.bfloat16,
                                       exp_avg_sq_dtype=torch.bfloat16)),
             (ampkit.optim.AdamW, dict(lr=1e-2, master_weights="stochastic")),
             (ampkit.optim.SGD, dict(lr=0.05, master_weights="stochastic")),  # a state of step and sr_seed alone
             # LAMB's trust ratio is each local shard's (its clipping's global norm: test_lamb_clips_with_the_norm_...)
             (ampkit.optim.LAMB, dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.0, master_weights="stochastic"))]
    out = {"seeds": {}}
    for cls, kwargs in cases:
        model = _model(dtype=torch.bfloat16)
        torch.manual_seed(100 + rank)  # (dropout seeded per rank, say)
        opt = cls(model.parameters(), **kwargs)
        what = f"{cls.__name__} {kwargs}"
        stochastic = kwargs.get("master_weights") == "stochastic"
        prepare = _keyed_like(opt, list(model.parameters())) if stochastic else None
        params, shadow_opt, shadows = _train_with_shadow(model, opt, rank, cls, kwargs, prepare)
        assert all(p.dtype == torch.bfloat16 for p in params), what
        _check_shadow(opt, params, shadow_opt, shadows, what)
        for p in params:
            if kwargs.get("master_weights") == "remainder":
                assert opt.state[p]["param_remainder"].dtype == torch.int16, what
            elif kwargs.get("master_weights") == "kahan":  # BF16 moments: DTensors of the parameter's layout
                assert opt.state[p]["kahan_comp"].dtype == torch.bfloat16, what
                assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16, what
            elif stochastic:
                assert opt.state[p]["sr_seed"].dtype == torch.int64 and "master_param" not in opt.state[p], what
            else:
                assert opt.state[p]["master_param"].dtype == torch.float32, what
        if stochastic:
            out["seeds"][what] = [opt.state[p]["sr_seed"].item() for p in params]
    out["shards"] = _stochastic_shards(rank)
    # HSDP (each rank a replica of the whole model): the replicas round alike and stay equal.
    from torch.distributed.device_mesh import init_device_mesh
    model = _model(dtype=torch.bfloat16, mesh=init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate",
                                                                                                  "shard")))
    torch.manual_seed(100 + rank)
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2, master_weights="stochastic")
    out["replica"] = _train(model, opt, rank)
    # A group the optimizer refuses (FP64 shards, masters asked for) raises before any shard or state changes.
    model = _model(dtype=torch.float64)
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2, master_weights=True)
    _loss(model, rank, 0).backward()
    before = [p.to_local().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="master_weights=True needs FP16, BF16 or FP32 parameters"):
        opt.step()
    assert all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))
    assert len(opt.state) == 0
    # The step of DTensor groups walks down the package as a plain one does (tests/python/test_layering.py): two
    # groups whose lr changed, LAMB's norm over every shard included.
    from test_layering import _returns, _walk
    for cls, kwargs in ((ampkit.optim.AdamW, dict(lr=1e-2)), (ampkit.optim.LAMB, dict(lr=1e-2, max_grad_norm=0.5))):
        model = _model()
        params = list(model.parameters())
        opt = cls([{"params": params[:1]}, {"params": params[1:]}], **kwargs)
        _loss(model, rank, 0).backward()
        opt.step()
        for group in opt.param_groups:
            group["lr"] = 2e-2
        seq = _walk(opt.step)
        assert _returns(seq) <= 2 and "ampkit._dtensor" in seq, (cls.__name__, seq)
    return out


def _stochastic_shards(rank: int) -> dict:
    """Stochastic rounding of a (2, 4096) BF16 weight, one row per rank, sharded and whole: every element 1.5, and
    each SGD step (lr 1) the same grad, a fraction f of 1.5's unit in the last place (2^-7), so that each step
    rounds an element down by one unit with probability f. Returns f, this rank's seed and, after each step, its row
    sharded and the same row of the whole weight, stepped with the whole grad and the same seed."""
    layer = nn.Linear(4096, 2, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.fill_(1.5)
    fully_shard(layer)
    w = layer.weight
    whole = nn.Parameter(w.detach().full_tensor())
    grad = torch.full((1, 4096), 0.3 * 2**-7, dtype=torch.bfloat16)
    opt = ampkit.optim.SGD([w], lr=1.0, master_weights="stochastic")
    whole_opt = ampkit.optim.SGD([whole], lr=1.0, master_weights="stochastic")
    rows = []
    for _ in range(STEPS):
        w.grad = DTensor.from_local(grad.clone(), w.device_mesh, w.placements, run_check=False, shape=w.shape,
                                    stride=w.stride())
        opt.step()
        if not whole_opt.state:
            whole_opt.state[whole]["sr_seed"] = opt.state[w]["sr_seed"].clone()
        whole.grad = grad.expand(2, -1).clone()
        whole_opt.step()
        rows.append((w.detach().to_local()[0].clone(), whole.detach()[rank].clone()))
    return {"f": grad[0, 0].item() * 2**7, "seed": opt.state[w]["sr_seed"].item(), "rows": rows}


def _case_fp32_grads_of_bf16_dtensors(rank: int, out_dir: str) -> dict:
    """BF16 DTensor parameters accumulating FP32 grads (grad_dtype; plain DTensors, as tensor parallelism has them:
    FSDP2 itself casts its grads, test_grad_dtype.py): each rank's step equals ampkit's step of plain BF16 tensors
    holding its shards with the same FP32 grads, bit for bit; the local shards take the FP32 grads for the step
    only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    full = [torch.randn(8, 6), torch.randn(5)]
    params = [nn.Parameter(distribute_tensor(t.to(torch.bfloat16), mesh, [Shard(0)])) for t in full]
    shadows = [nn.Parameter(p.to_local().detach().clone()) for p in params]
    for p in params + shadows:
        p.grad_dtype = torch.float32
    opt = ampkit.optim.AdamW(params, lr=1e-2, master_weights=True)
    shadow_opt = ampkit.optim.AdamW(shadows, lr=1e-2, master_weights=True)
    for step in range(3):
        torch.manual_seed(10 + step)
        for p, s, t in zip(params, shadows, full):
            p.grad = distribute_tensor(torch.randn(t.shape) * (1 + 2.0 ** -12), mesh, [Shard(0)])
            s.grad = p.grad.to_local().clone()
        opt.step()
        shadow_opt.step()
    for i, (p, s) in enumerate(zip(params, shadows)):
        assert p.grad.dtype == torch.float32 and p.dtype == torch.bfloat16
        assert torch.equal(p.detach().to_local(), s.detach()), f"param {i}"
        assert torch.equal(opt.state[p]["master_param"].to_local(), shadow_opt.state[s]["master_param"]), i
        assert p._local_tensor.grad is None and p._local_tensor.grad_dtype == torch.bfloat16, i
    return {}


def test_fp32_grads_of_bf16_dtensors(tmp_path):
    _run(tmp_path, "_case_fp32_grads_of_bf16_dtensors")


def test_low_precision_params_under_fsdp2(tmp_path):
    results = _run(tmp_path, "_case_low_precision_params")
    # master_weights="stochastic": one seed per parameter, the same on every rank.
    assert results[0]["seeds"] == results[1]["seeds"] and len(results[0]["seeds"]) == 3
    assert all(len(set(seeds)) == 6 for seeds in results[0]["seeds"].values()), "a seed per parameter"
    for step, (a, b) in enumerate(zip(results[0]["replica"], results[1]["replica"])):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"HSDP replicas apart after step {step}"
    # The shards of stochastic rounding: shard 0 rounds as the whole weight does, bit for bit; shard 1 with bits of
    # its own, unlike the same row of the whole weight or rank 0's row (one seed, but a key per shard). Each row
    # unbiased: after n steps its elements have moved down by n * f units on average (the count of an element's
    # moves is Binomial(n, f): over 4096 elements the mean's standard deviation is 0.014 units at n = 4; tolerance
    # 0.1, measured 0.027). An element rounds as another with independent bits with probability f^2 + (1 - f)^2,
    # 0.58 at f = 0.3 (measured after the first step: 0.576 and 0.585; with the same bits, 1).
    shards = [r["shards"] for r in results]
    f = shards[0]["f"]
    assert shards[0]["seed"] == shards[1]["seed"] and 0.25 < f < 0.35
    for step in range(STEPS):
        (row0, whole0), (row1, whole1) = shards[0]["rows"][step], shards[1]["rows"][step]
        assert torch.equal(row0, whole0), f"step {step}"
        for row in (row0, row1):
            moved = ((1.5 - row.double()) * 2**7).mean().item()
            assert abs(moved - (step + 1) * f) <= 0.1, (step, moved, f)
    (row0, _), (row1, whole1) = shards[0]["rows"][0], shards[1]["rows"][0]
    assert (row1 == whole1).double().mean() < 0.7 and (row1 == row0).double().mean() < 0.7


# ---- distributed checkpoints --------------------------------------------------------------------------------------

def _case_checkpoint(rank: int, out_dir: str) -> dict:
    """A torch.optim.AdamW(fused=True) run checkpointed with torch.distributed.checkpoint after 2 steps, resumed
    by ampkit.optim.AdamW, continues as torch's own run bit for bit; ampkit's checkpoint has torch's keys and
    tensor kinds, and resumes ampkit's run bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    half = range(STEPS // 2)
    rest = range(STEPS // 2, STEPS)

    def save(model, opt, path):
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)

    def resume(path, planner=None):
        model = _model()
        opt = ampkit.optim.AdamW(model.parameters(), **kwargs)
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=path, planner=planner)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        return model, opt

    ref_model = _model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), fused=True, **kwargs)
    _train(ref_model, ref_opt, rank, half)
    save(ref_model, ref_opt, os.path.join(out_dir, "torch_ckpt"))

    ours_model = _model()
    ours_opt = ampkit.optim.AdamW(ours_model.parameters(), **kwargs)
    _train(ours_model, ours_opt, rank, half)
    ref_sd = get_optimizer_state_dict(ref_model, ref_opt)
    ours_sd = get_optimizer_state_dict(ours_model, ours_opt)
    assert ref_sd["state"].keys() == ours_sd["state"].keys()
    for fqn, st in ref_sd["state"].items():
        assert {k: type(v) for k, v in ours_sd["state"][fqn].items()} == {k: type(v) for k, v in st.items()}, fqn
    save(ours_model, ours_opt, os.path.join(out_dir, "ampkit_ckpt"))

    # torch's param groups lack ampkit's "master_weights" (left at its default): a partial load
    from_torch = resume(os.path.join(out_dir, "torch_ckpt"), dcp.DefaultLoadPlanner(allow_partial_load=True))
    from_ours = resume(os.path.join(out_dir, "ampkit_ckpt"))
    for m, o in ((ref_model, ref_opt), (ours_model, ours_opt), from_torch, from_ours):
        _train(m, o, rank, rest)
    _check_like(ref_model, ref_opt, *from_torch, exact=True, what="torch checkpoint resumed by ampkit")
    _check_like(ref_model, ref_opt, ours_model, ours_opt, exact=True, what="ampkit uninterrupted")
    _check_like(ref_model, ref_opt, *from_ours, exact=True, what="ampkit checkpoint resumed by ampkit")
    return {}


def test_distributed_checkpoint_round_trips(tmp_path):
    _run(tmp_path, "_case_checkpoint")


# ---- loss scaling -----------------------------------------------------------------------------------------------

def _case_torch_scaler(rank: int, out_dir: str) -> dict:
    """torch.amp.GradScaler drives ampkit.optim.AdamW (grad_scale/found_inf; torch's DTensor all-reduces found_inf
    over the mesh) exactly as torch.optim.AdamW(fused=True), through an Inf in rank 1's shard at step 1."""
    runs = []
    for cls, extra in ((torch.optim.AdamW, dict(fused=True)), (ampkit.optim.AdamW, {})):
        model = _model()
        opt = cls(model.parameters(), lr=1e-2, **extra)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
        history = _train(model, opt, rank, scaler=scaler, inf_at=1)
        runs.append((model, opt, history, scaler.get_scale()))
    _check_like(*runs[0][:2], *runs[1][:2], exact=True, what="torch.amp.GradScaler")
    history = runs[1][2]
    return {"skipped_1": all(torch.equal(a, b) for a, b in zip(history[0], history[1])),
            "moved_2": not all(torch.equal(a, b) for a, b in zip(history[1], history[2])),
            "scale": runs[1][3]}


def test_torch_grad_scaler_drives_ampkit_optimizer(tmp_path):
    results = _run(tmp_path, "_case_torch_scaler")
    # growth_interval=1: 1024 -> 2048, backoff at the overflow -> 1024, then 2048, 4096
    assert [r["scale"] for r in results] == [4096.0, 4096.0]
    assert all(r["skipped_1"] for r in results), "every rank skips the step whose grads overflowed on rank 1"
    assert all(r["moved_2"] for r in results)


def _case_ampkit_scaler(rank: int, out_dir: str) -> dict:
    """ampkit.GradScaler (no process_group: the DTensor grads' mesh decides who must agree) with ampkit.optim.AdamW
    (the fused, sync-free path) and with torch.optim.AdamW (the generic path), against torch.amp.GradScaler with
    the same optimizer."""
    out = {}
    for name, cls, extra in (("fused path", ampkit.optim.AdamW, {}),
                             ("generic path", torch.optim.AdamW, dict(foreach=False))):
        ref_model = _model()
        ref_opt = (torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True) if cls is ampkit.optim.AdamW
                   else torch.optim.AdamW(ref_model.parameters(), lr=1e-2, **extra))
        _train(ref_model, ref_opt, rank, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0), inf_at=1)
        model = _model()
        opt = cls(model.parameters(), lr=1e-2, **extra)
        scaler = ampkit.GradScaler("cpu", init_scale=1024.0, overflow_report=True)
        scaler.name_parameters(model.named_parameters())
        ran = []
        for step in range(STEPS):
            _train(model, opt, rank, range(step, step + 1), scaler=scaler, inf_at=1)
            ran.append(bool(scaler.last_step_ran()))
            if step == 1:
                out[name, "report"] = scaler.overflow_report()
        _check_like(ref_model, ref_opt, model, opt, exact=True, what=name)
        out[name] = (ran, scaler.get_scale(), scaler.stats()["skipped_steps"])
    return out


def test_ampkit_grad_scaler_skips_on_every_rank(tmp_path):
    results = _run(tmp_path, "_case_ampkit_scaler")
    for name in ("fused path", "generic path"):
        assert [r[name] for r in results] == [([True, False, True, True], 512.0, 1)] * 2, name
        assert [r[name, "report"] for r in results] == [[], ["2.weight"]], name


# ---- 8-bit states -------------------------------------------------------------------------------------------------
# Each rank keeps the packed state of its local shard, whose blocks of 256 elements start at the shard's first
# element (NOTE [8-bit states of DTensor parameters] in ampkit/_dtensor.py). The reference is the unsharded run:
# plain parameters holding the whole tensors, stepped with the whole (all-gathered) grads of the sharded run.

BLOCK = 256

# Every local shard's numel is a multiple of 256: weights of 2048 + 2048 elements (shards under 4096 elements, 8-bit
# because the parameter is), 4096 + 4096, 32768 + 32768 and 4096 + 0 (an empty shard); biases of 2048 + 2048
# (8-bit), 256 + 256 and under (FP32: parameters under 4096 elements).
ALIGNED = (8, 512, 16, 4096, 1)
# Blocks straddle the shard boundaries: weights of 2080 + 2080 and 2600 + 2080 elements (uneven rows).
STRADDLING = (8, 520, 9, 1)
# The state entry of each state dtype option.
ENTRY = {"exp_avg_dtype": "exp_avg", "exp_avg_sq_dtype": "exp_avg_sq", "momentum_dtype": "momentum_buffer"}


def test_packed_layout_follows_the_core():
    """The sizes ampkit/_dtensor.py lays 8-bit rows out with are the core's: the bytes of a packed state, and the
    smallest parameter given one."""
    from ampkit import _dtensor
    for n in (0, 1, 255, 256, 257, 2080, 4095, 4096, 70000):
        assert _dtensor.blockwise8_bytes(n) == _packed_bytes(n) == ampkit._C._blockwise8_quantize(
            torch.ones(n), True).numel(), n
    least = _dtensor.BLOCKWISE8_MIN_NUMEL
    for n, dtype in ((least - 1, torch.float32), (least, torch.uint8)):
        (made,) = torch.ops.ampkit.make_optim_state(torch.zeros(n), ["exp_avg"], 0.0, torch.uint8)
        assert made.dtype == dtype, n


def _mlp(widths: tuple, dtype=torch.float32, mesh=None) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    model = nn.Sequential(*layers).to(dtype)
    kwargs = {} if mesh is None else {"mesh": mesh}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _packed_bytes(numel: int) -> int:
    return -(-numel // BLOCK) * (BLOCK + 4)  # the codes of whole blocks, then an FP32 absmax per block


def _first_element(p) -> int:
    """The flat index in the whole parameter of the first element of this rank's shard."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0] * math.prod(p.shape[1:])


def _shard_of(full: torch.Tensor, p) -> torch.Tensor:
    """The elements of the whole tensor ``full`` that this rank's shard of ``p`` holds, flat."""
    start = _first_element(p)
    return full.reshape(-1)[start:start + p.to_local().numel()]


def _blocks_of(state: torch.Tensor, numel: int, first: int, count: int) -> torch.Tensor:
    """Blocks ``first`` to ``first + count`` of the packed state of ``numel`` elements: their codes, then their
    absmaxes (a packed state of those blocks)."""
    blocks = -(-numel // BLOCK)
    codes = state[first * BLOCK:(first + count) * BLOCK]
    absmax = state[blocks * BLOCK + 4 * first:blocks * BLOCK + 4 * (first + count)]
    return torch.cat([codes, absmax])


def _train_unsharded(model, opt, rank: int, make_opt, steps=range(STEPS)) -> tuple:
    """Trains the sharded ``model`` with ``opt`` and, step by step, ``make_opt(params)`` on plain tensors holding
    the whole parameters, given the whole grads of the sharded run."""
    params = list(model.parameters())
    whole = [nn.Parameter(p.detach().full_tensor().clone()) for p in params]
    whole_opt = make_opt(whole)
    for step in steps:
        opt.zero_grad(set_to_none=True)
        _loss(model, rank, step).backward()
        for p, w in zip(params, whole):
            w.grad = p.grad.full_tensor()
        opt.step()
        whole_opt.step()
    return params, whole, whole_opt


def _check_packed_kinds(opt, params, entries, what: str) -> None:
    """8-bit entries of parameters of 4096 elements or more: uint8 DTensors of one row per shard, each row this
    rank's packed state then zeros; every other entry a DTensor of the parameter's layout (step: a plain scalar)."""
    from torch.distributed.tensor import Shard
    for i, p in enumerate(params):
        st = opt.state[p]
        for key, v in st.items():
            if key == "step":
                assert type(v) is torch.Tensor and v.dim() == 0, what
                continue
            assert isinstance(v, DTensor), f"{what}: state[{key!r}] of param {i}"
            if key in entries and p.numel() >= 4096:
                largest = math.ceil(p.shape[0] / WORLD) * math.prod(p.shape[1:])
                assert v.dtype == torch.uint8 and v.placements == (Shard(0),), f"{what}: {key} of param {i}"
                assert tuple(v.shape) == (WORLD, _packed_bytes(largest)), f"{what}: {key} of param {i}: {v.shape}"
                row = v.to_local().reshape(-1)
                assert not row[_packed_bytes(p.to_local().numel()):].any(), f"{what}: padding of param {i}"
            else:
                assert v.dtype != torch.uint8 and v.placements == p.placements and v.shape == p.shape, what


def _packed_state(v, p) -> torch.Tensor:
    return v.to_local().reshape(-1)[:_packed_bytes(p.to_local().numel())]


def _case_8bit_aligned(rank: int, out_dir: str) -> dict:
    """Where every local shard's numel is a multiple of 256, a shard's blocks are blocks of the whole parameter:
    the sharded run equals the unsharded one bit for bit, parameters and packed states."""
    u8, bf16 = torch.uint8, torch.bfloat16
    cases = [
        (torch.float32, ampkit.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, exp_avg_dtype=u8, exp_avg_sq_dtype=u8)),
        (torch.float32, ampkit.optim.Adam, dict(lr=1e-2, amsgrad=True, exp_avg_dtype=u8, exp_avg_sq_dtype=bf16)),
        # dampening: a first step that took the fresh buffer for a loaded one would differ
        (torch.float32, ampkit.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, momentum_dtype=u8)),
        (torch.bfloat16, ampkit.optim.AdamW, dict(lr=1e-2, exp_avg_dtype=u8, exp_avg_sq_dtype=u8)),  # FP32 masters
        # without momentum, SGD keeps no buffer (and no state) for the 8-bit dtype to pack, sharded or not
        (torch.float32, ampkit.optim.SGD, dict(lr=0.05, momentum_dtype=u8)),
    ]
    packed_params = 0
    for dtype, cls, kwargs in cases:
        what = f"{dtype} {cls.__name__} {kwargs}"
        model = _mlp(ALIGNED, dtype)
        opt = cls(model.parameters(), **kwargs)
        params, whole, whole_opt = _train_unsharded(model, opt, rank, lambda ps: cls(ps, **kwargs))
        entries = {ENTRY[k] for k, v in kwargs.items() if v is u8 and kwargs.get("momentum", 1) != 0}
        _check_packed_kinds(opt, params, entries, what)
        for i, (p, w) in enumerate(zip(params, whole)):
            assert p.numel() < 4096 or p.to_local().numel() % BLOCK == 0, "this model's 8-bit shards are aligned"
            assert torch.equal(p.detach().to_local().reshape(-1), _shard_of(w.detach(), p)), f"{what}: param {i}"
            assert set(opt.state[p]) == set(whole_opt.state[w]), what
            for key, v in opt.state[p].items():
                ref = whole_opt.state[w][key]
                if key == "step":
                    assert torch.equal(v, ref), what
                elif v.dtype == torch.uint8:
                    packed_params += 1
                    first, count = _first_element(p) // BLOCK, p.to_local().numel() // BLOCK
                    expected = _blocks_of(ref, w.numel(), first, count)
                    assert torch.equal(_packed_state(v, p), expected), f"{what}: state[{key!r}] of param {i}"
                else:
                    assert torch.equal(v.to_local().reshape(-1), _shard_of(ref, p)), f"{what}: {key} of param {i}"
        del opt, whole_opt
    return {"packed": packed_params}


def _case_8bit_straddling(rank: int, out_dir: str) -> dict:
    """Where a block straddles a shard boundary, each rank quantizes its part with its own absmax: rank 0's whole
    blocks (from element 0) still equal the unsharded run's bit for bit; the rest stays close to it."""
    kwargs = dict(lr=1e-2, weight_decay=0.1, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    model = _mlp(STRADDLING)
    opt = ampkit.optim.AdamW(model.parameters(), **kwargs)
    start = [p.detach().full_tensor().clone() for p in model.parameters()]
    params, whole, whole_opt = _train_unsharded(model, opt, rank, lambda ps: ampkit.optim.AdamW(ps, **kwargs))
    _check_packed_kinds(opt, params, {"exp_avg", "exp_avg_sq"}, "straddling")
    out = {"moved": [], "diff": [], "mean_diff": [], "exact": []}
    for i, (p, w, w0) in enumerate(zip(params, whole, start)):
        local = p.detach().to_local().reshape(-1)
        ref = _shard_of(w.detach(), p)
        if p.numel() < 4096:  # FP32 states: elementwise, bit for bit
            assert torch.equal(local, ref), f"param {i}"
            continue
        assert _first_element(p) % BLOCK != 0 or local.numel() % BLOCK != 0, "this model's blocks straddle"
        out["moved"].append((ref - _shard_of(w0, p)).abs().mean().item())
        out["diff"].append((local - ref).abs().max().item())
        out["mean_diff"].append((local - ref).abs().mean().item())
        if rank == 0:  # blocks 0 .. n // 256 - 1 of the shard are those of the whole parameter
            whole_blocks = local.numel() // BLOCK * BLOCK
            out["exact"].append(torch.equal(local[:whole_blocks], ref[:whole_blocks]))
    return out


@pytest.mark.parametrize("layout", ["aligned", "straddling"])
def test_8bit_states_on_local_shards_match_the_unsharded_run(tmp_path, layout):
    if layout == "aligned":
        results = _run(tmp_path, "_case_8bit_aligned")
        # 4 optimizers, 5 parameters of 4096 elements or more, 2 8-bit moments (SGD: 1; Adam: exp_avg only)
        assert [r["packed"] for r in results] == [5 * (2 + 1 + 1 + 2)] * 2
        return
    results = _run(tmp_path, "_case_8bit_straddling")
    assert results[0]["exact"] == [True, True]
    # Tolerance: the moments of the straddling blocks are quantized with other absmaxes, and the parameters after 4
    # steps of lr 1e-2 differ by at most one lr (measured: 5e-3), 1e-3 on average (measured: 2e-4) while they move
    # by 1.5e-2 to 2.6e-2 on average. (8-bit Adam moves a few elements far, where a small second moment rounds to
    # code 0, in both runs alike: the mean of the movement, not its maximum, is what the differences are set
    # against.) Parameters under 4096 elements (FP32 states) are checked bit for bit above.
    for r in results:
        assert max(r["diff"]) <= 1e-2 and max(r["mean_diff"]) <= 1e-3, r
        assert min(r["moved"]) > 1e-2, r
    assert any(d > 0 for r in results for d in r["diff"]), "straddling blocks change the quantization"


def _one_shard_mesh():
    """A mesh of this rank alone (each rank holds whole parameters): a sharding into one shard."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))["shard"]


def _dcp_save(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)


def _dcp_load(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


EIGHT_BIT = dict(lr=1e-2, weight_decay=0.1, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)


def _case_8bit_checkpoint(rank: int, out_dir: str) -> dict:
    """An 8-bit AdamW run checkpointed with torch.distributed.checkpoint after 2 steps and resumed continues bit
    for bit as the uninterrupted run (every byte of each rank's rows); so does one resumed from state_dict(). A
    state dict of another sharding is refused by load_state_dict before anything changes."""
    half, rest = range(STEPS // 2), range(STEPS // 2, STEPS)
    path = os.path.join(out_dir, "ckpt8")
    model = _mlp(STRADDLING)
    opt = ampkit.optim.AdamW(model.parameters(), **EIGHT_BIT)
    _train(model, opt, rank, half)
    _dcp_save(model, opt, path)
    sd = opt.state_dict()
    saved = {k: v.to_local().clone() for k, v in sd["state"][0].items() if k != "step"}
    from_dcp = _mlp(STRADDLING)
    from_dcp_opt = ampkit.optim.AdamW(from_dcp.parameters(), **EIGHT_BIT)
    _dcp_load(from_dcp, from_dcp_opt, path)
    from_sd = _mlp(STRADDLING)
    for p, q in zip(from_sd.parameters(), model.parameters()):
        p.detach().to_local().copy_(q.detach().to_local())
    from_sd_opt = ampkit.optim.AdamW(from_sd.parameters(), **EIGHT_BIT)
    from_sd_opt.load_state_dict(sd)
    own = opt.state[next(model.parameters())]
    for key, v in from_sd_opt.state[next(from_sd.parameters())].items():
        if key != "step":  # a copy: the bytes as saved, not the saving optimizer's tensors
            assert torch.equal(v.to_local(), saved[key]) and v.to_local().data_ptr() != own[key].to_local().data_ptr()
    runs = [(model, opt), (from_dcp, from_dcp_opt), (from_sd, from_sd_opt)]
    for m, o in runs:
        _train(m, o, rank, rest)
    for what, (m, o) in zip(("dcp", "state_dict"), runs[1:]):
        _check_packed_kinds(o, list(m.parameters()), {"exp_avg", "exp_avg_sq"}, what)
        for i, (p, q) in enumerate(zip(model.parameters(), m.parameters())):
            assert torch.equal(p.detach().to_local(), q.detach().to_local()), f"{what}: param {i}"
            st, st2 = opt.state[p], o.state[q]
            assert st.keys() == st2.keys(), what
            for key in st:
                a, b = (st[key], st2[key]) if key == "step" else (st[key].to_local(), st2[key].to_local())
                assert torch.equal(a, b), f"{what}: state[{key!r}] of param {i}"

    # The state dict of a one-shard run (whole parameters on each rank) into this two-shard optimizer: refused.
    one = _mlp(STRADDLING, mesh=_one_shard_mesh())
    one_opt = ampkit.optim.AdamW(one.parameters(), **EIGHT_BIT)
    _train(one, one_opt, rank, half)
    before = {k: (v if k == "step" else v.to_local()).clone() for k, v in opt.state[next(model.parameters())].items()}
    with pytest.raises(ValueError) as refused:
        opt.load_state_dict(one_opt.state_dict())
    after = opt.state[next(model.parameters())]
    assert all(torch.equal(v, after[k] if k == "step" else after[k].to_local()) for k, v in before.items())
    return {"refused": str(refused.value)}


def _case_8bit_other_world(rank: int, out_dir: str) -> dict:
    """The two-rank 8-bit checkpoint loaded on one rank: DCP refuses the packed states' shapes."""
    from torch.distributed.checkpoint.api import CheckpointException
    model = _mlp(STRADDLING)
    opt = ampkit.optim.AdamW(model.parameters(), **EIGHT_BIT)
    try:
        _dcp_load(model, opt, os.path.join(out_dir, "ckpt8"))
    except CheckpointException as e:  # a BaseException carrying each rank's error
        return {"error": str(e)}
    return {"error": None}


def test_8bit_states_round_trip_distributed_checkpoints(tmp_path):
    results = _run(tmp_path, "_case_8bit_checkpoint")
    # Parameter 0 is the (520, 8) weight: shards of 2080 elements, 8-bit rows of ceil(2080 / 256) * 260 bytes; in
    # one shard of 4160 elements, 17 * 260.
    for r in results:
        msg = r["refused"]
        assert msg.startswith("AdamW.load_state_dict: state[0]['exp_avg']: an 8-bit state of shape (1, 4420)"), msg
        assert "keeps its 8-bit states in shape (2, 2340)" in msg and "another sharding" in msg, msg
    (other,) = _run(tmp_path, "_case_8bit_other_world", world=1)
    msg = other["error"]
    assert msg is not None and "Size mismatch between saved torch.Size([2, 2340]) and current: " in msg, msg
    assert "torch.Size([1, 4420]) for optim.state.0.weight.exp_avg" in msg, msg


# ---- LAMB's clipping ----------------------------------------------------------------------------------------------

def _case_lamb_clipping(rank: int, out_dir: str) -> dict:
    """LAMB with max_grad_norm > 0 clips with the norm of the whole grads, over every rank's shards, the same bits
    on every rank. Without weight decay (trust ratio 1) it matches the unsharded run up to the rounding of that
    norm; with weight decay the trust ratio is each shard's, and the step equals LAMB on the shards given the
    global norm, bit for bit. Over one shard the norm and the step are the unsharded ones, bit for bit."""
    out = {}
    kwargs = dict(lr=1e-2, weight_decay=0.0, max_grad_norm=0.05)
    model = _model()
    opt = ampkit.optim.LAMB(model.parameters(), **kwargs)
    norms, whole_norms, references = [], [], []
    params = list(model.parameters())
    whole = [nn.Parameter(p.detach().full_tensor().clone()) for p in params]
    whole_opt = ampkit.optim.LAMB(whole, **kwargs)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _loss(model, rank, step).backward()
        for p, w in zip(params, whole):
            w.grad = p.grad.full_tensor()
        references.append(math.sqrt(sum(w.grad.double().square().sum().item() for w in whole)))
        opt.step()
        whole_opt.step()
        norms.append(opt.last_grad_norm.item())
        whole_norms.append(whole_opt.last_grad_norm.item())
        for i, (p, w) in enumerate(zip(params, whole)):
            local, ref = p.detach().to_local().reshape(-1), _shard_of(w.detach(), p)
            assert torch.allclose(local.double(), ref.double(), rtol=1e-5, atol=1e-7), f"step {step}: param {i}"
    out["trust 1"] = (norms, whole_norms, references)

    # Weight decay: the trust ratio of each shard; LAMB over plain tensors holding the shards, with the global norm.
    kwargs = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.05)
    model = _model()
    opt = ampkit.optim.LAMB(model.parameters(), **kwargs)
    params, shard_opt, shards = _train_with_shadow_lamb(model, opt, rank, kwargs)
    for i, (p, s) in enumerate(zip(params, shards)):
        assert torch.equal(p.detach().to_local(), s.detach()), f"param {i}"
        for key, v in opt.state[p].items():
            ref = shard_opt.state[s][key]
            assert torch.equal(v if key == "step" else v.to_local(), ref), f"state[{key!r}] of param {i}"
    out["weight decay"] = opt.last_grad_norm.item()

    # One shard: the unsharded norm's bits, and the unsharded step's (trust ratios of whole tensors).
    model = _model(mesh=_one_shard_mesh())
    opt = ampkit.optim.LAMB(model.parameters(), **kwargs)
    params, whole, whole_opt = _train_unsharded(model, opt, rank, lambda ps: ampkit.optim.LAMB(ps, **kwargs))
    assert torch.equal(opt.last_grad_norm, whole_opt.last_grad_norm)
    for i, (p, w) in enumerate(zip(params, whole)):
        assert torch.equal(p.detach().to_local(), w.detach()), f"one shard: param {i}"
    return out


def _train_with_shadow_lamb(model, opt, rank: int, kwargs: dict) -> tuple:
    """As _train_with_shadow, for LAMB: the plain LAMB over the shards clips with the sharded run's global norm."""
    def clip_with_the_sharded_norm(shard_opt):
        shard_opt._global_grad_norm = lambda grad_scale: opt.last_grad_norm
    return _train_with_shadow(model, opt, rank, ampkit.optim.LAMB, kwargs, prepare=clip_with_the_sharded_norm)


def test_lamb_clips_with_the_norm_over_every_shard(tmp_path):
    results = _run(tmp_path, "_case_lamb_clipping")
    norms, whole_norms, references = results[0]["trust 1"]
    assert results[1]["trust 1"][0] == norms, "every rank clips with the same bits"
    assert results[1]["weight decay"] == results[0]["weight decay"]
    assert min(norms) > 0.05, "the grads are clipped at every step"
    # Tolerance: each rank's FP32 norm of its shards, summed in float64, differs from the unsharded norm by the
    # rounding of those norms, a few units in the last place of FP32.
    for norm, whole, ref in zip(norms, whole_norms, references):
        assert abs(norm - whole) <= 4e-7 * whole and abs(norm - ref) <= 4e-7 * ref, (norm, whole, ref)
