"""Distributed checkpoints that reshard: a model under FSDP2 with ampkit.optim and ampkit.GradScaler, saved with
torch.distributed.checkpoint (DCP) on N Gloo ranks and loaded on M (2 -> 1, 1 -> 2, 2 -> 4; one thread per rank), or
into a model that is not distributed, through torch's own get_state_dict / set_state_dict (ampkit adds no wrapper).

Six optimizer modes: AdamW with FP32 masters of BF16 parameters, AdamW with BF16 moments, AdamW with Kahan-
compensated BF16 parameters ("kahan": a BF16 state per element besides the moments), AdamW with BF16 parameters and
int16 remainders ("remainder": the exact master in two tensors), AdamW with stochastically rounded BF16 parameters
("stochastic": a seed per parameter, a plain scalar as the step) and SGD with momentum; every run
is driven by an ampkit.GradScaler (an Inf loss at step 1 skips a step and backs the scale off before the checkpoint),
whose state goes into the same checkpoint. The global batch is the same at every world size (each rank takes its
slice), so runs on different numbers of ranks differ only by the reduction of the gradients: FSDP2 reduce-scatters in
the parameters' dtype, BF16 for BF16 parameters. A resumed run's model and optimizer state are made, then poisoned
(NaN) before the load, so that anything the load misses shows.

- Resumed on as many ranks as saved, a run continues bit for bit as the uninterrupted one (parameters, every state
  entry, the scaler).
- Loaded on another number of ranks, or into a model that is not distributed, the state is the saved one bit for bit
  (DCP reshards the DTensor states); the run then continues within RESHARD_TOLERANCE of the uninterrupted one.
- Stochastic rounding keys each shard by its index (NOTE [Stochastic rounding of DTensor parameters] in
  ampkit/_dtensor.py): its seeds load bit for bit everywhere, and a run on another number of ranks rounds with other
  bits from its first step. Each rank's default generator is seeded apart before the first step: the seeds, made
  the same on every rank, must not depend on it.
- 8-bit states are packed per local shard (NOTE [8-bit states of DTensor parameters] in ampkit/_dtensor.py): DCP
  refuses a checkpoint of another number of shards, and the refusal leaves the model, the optimizer and the scaler
  unchanged; the same states loaded into FP32 moments on the sharding they were saved from, and saved again, reshard.

The ranks run in four spawns (1, 2, 4 and 1 ranks: module fixtures, each reading the checkpoints of the one before);
the loads into a model that is not distributed run in this process (DCP loads without a process group).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ampkit
import test_fsdp2
from test_fsdp2 import EIGHT_BIT, NEEDS_FSDP2, STRADDLING, _worker

pytestmark = [NEEDS_FSDP2]
if test_fsdp2.fully_shard is not None:  # (NEEDS_FSDP2 skips every test otherwise)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

BF16 = torch.bfloat16
# Rows 16, 3 and 1: 2 ranks hold 8 + 8, 2 + 1 and 1 + 0 of them; 4 ranks 4 each, 1 + 1 + 1 + 0 and 1 + 0 + 0 + 0.
WIDTHS = (8, 16, 3, 1)
# name -> (parameter dtype, optimizer class, its arguments, the state entries it keeps, the model's widths)
MODES = {
    "fp32 masters": (BF16, "AdamW", dict(lr=1e-2, weight_decay=0.1, master_weights=True),
                     {"step", "exp_avg", "exp_avg_sq", "master_param"}, WIDTHS),
    "bf16 moments": (torch.float32, "AdamW", dict(lr=1e-2, weight_decay=0.1, exp_avg_dtype=BF16,
                                                  exp_avg_sq_dtype=BF16), {"step", "exp_avg", "exp_avg_sq"}, WIDTHS),
    "kahan": (BF16, "AdamW", dict(lr=1e-2, weight_decay=0.1, master_weights="kahan"),
              {"step", "exp_avg", "exp_avg_sq", "kahan_comp"}, WIDTHS),
    "remainder": (BF16, "AdamW", dict(lr=1e-2, weight_decay=0.1, master_weights="remainder"),
                  {"step", "exp_avg", "exp_avg_sq", "param_remainder"}, WIDTHS),
    "stochastic": (BF16, "AdamW", dict(lr=1e-2, weight_decay=0.1, master_weights="stochastic"),
                   {"step", "exp_avg", "exp_avg_sq", "sr_seed"}, WIDTHS),
    "sgd momentum": (torch.float32, "SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
                     {"step", "momentum_buffer"}, WIDTHS),
}
# 8-bit moments on weights of 4160 and 4680 elements (test_fsdp2.py's STRADDLING model), and the same run's states
# as FP32 moments: the mode that reshards them.
EIGHT_BIT_MODES = {
    "8bit": (torch.float32, "AdamW", EIGHT_BIT, {"step", "exp_avg", "exp_avg_sq"}, STRADDLING),
    "8bit as fp32": (torch.float32, "AdamW", dict(lr=1e-2, weight_decay=0.1), {"step", "exp_avg", "exp_avg_sq"},
                     STRADDLING),
}
BATCH = 8  # the global batch of every step, split evenly over 1, 2 or 4 ranks
STEPS = 4  # checkpointed after SAVED_AT steps
SAVED_AT = 2
INF_AT = 1  # the loss is Inf at this step on every rank: the scaler skips it and backs off

# The tolerance of a run resumed on another number of ranks, after STEPS - SAVED_AT = 2 steps, as
# max |resumed - uninterrupted| <= tolerance * max |uninterrupted| over each tensor (the state itself loads bit for
# bit; this is what the grads change). FP32 gradients (FP32 parameters): their reduce-scatter sums the ranks' grads
# in another order, FP32 rounding (measured: 1.4e-7). BF16 gradients (BF16 parameters: FSDP2 reduces in the
# parameters' dtype): each rank's grad is rounded to BF16, then summed and rounded again over another number of ranks,
# about 2^-8 relative and more where the ranks' grads cancel; Adam normalizes that into the update. Measured (2 -> 1,
# 1 -> 2, 2 -> 4, lr 1e-2): FP32 masters, Kahan-compensated weights and the masters of BF16 weights + remainders
# 2.2e-3 (8e-4 absolute, 0.08 lr), BF16 weights 5.2e-3 (one BF16 unit in the last place of the largest: up to 2^-7),
# moments 1.1e-2. ``kahan_comp`` and ``param_remainder`` alone are not compared: the split of a weight between its
# BF16 value and the rest moves by a unit in the last place. Stochastically rounded BF16 weights also round with
# other bits on another number of shards (each shard's key: NOTE [Stochastic rounding of DTensor parameters]), so
# each step may leave an element a unit in the last place further apart: measured 2 to 3 units of an element's last
# place, 1.05e-2 of the largest weight (up to 2^-6 = 1.6e-2 for two units of the largest), moments 1.5e-2.
RESHARD_TOLERANCE = {
    "fp32 grads": {"default": 1e-6},
    "bf16 grads": {"master_param": 5e-3, "compensated weight": 5e-3, "remainder master": 5e-3, "param": 1e-2,
                   "default": 3e-2},
    "stochastic rounding": {"param": 2e-2, "default": 3e-2},
}


# ---- one run ------------------------------------------------------------------------------------------------------

def _mode(mode: str) -> tuple:
    return MODES[mode] if mode in MODES else EIGHT_BIT_MODES[mode]


def _make(mode: str, sharded: bool = True, init_scale: float = 1024.0) -> tuple:
    dtype, cls, kwargs, _, widths = _mode(mode)
    torch.manual_seed(0)
    layers = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    model = nn.Sequential(*layers).to(dtype)
    if sharded:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    torch.manual_seed(100 + (dist.get_rank() if dist.is_initialized() else 0))  # (dropout seeded per rank, say)
    opt = getattr(ampkit.optim, cls)(model.parameters(), **kwargs)
    return model, opt, ampkit.GradScaler("cpu", init_scale=init_scale, growth_interval=1)


def _train(model, opt, scaler, steps) -> None:
    """Steps on this rank's slice of each global batch (a model that is not distributed takes all of it)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    dtype = next(model.parameters()).dtype
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, model[0].in_features, generator=g), torch.randn(BATCH, 1, generator=g)
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        opt.zero_grad(set_to_none=True)
        loss = (model(x[rows].to(dtype)).float() - y[rows]).square().mean()
        if step == INF_AT:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def _save(model, opt, scaler, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict()}, checkpoint_id=path)


def _load(model, opt, scaler, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    scaler.load_state_dict(sd["scaler"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _fresh(mode: str, sharded: bool = True) -> tuple:
    """A new run whose scaler starts at another scale and whose optimizer state exists (get_state_dict makes it by
    a step of lr 0 over zero grads), poisoned: NaN in the parameters and every floating state entry, 77 elsewhere."""
    model, opt, scaler = _make(mode, sharded, init_scale=3.0)
    get_state_dict(model, opt)
    with torch.no_grad():
        for p in model.parameters():
            _local(p).fill_(math.nan)
        for st in opt.state.values():
            for v in st.values():
                _local(v).fill_(math.nan if v.is_floating_point() else 77)
    return model, opt, scaler


def _resume(mode: str, path: str, sharded: bool = True) -> tuple:
    run = _fresh(mode, sharded)
    _load(*run, path)
    return run


def _full(model, opt, scaler) -> dict:
    """A copy of the whole state of a run: full tensors (on rank 0; empty dicts on the other ranks) and the scaler's
    state. (A copy: on one rank, or not distributed, the full tensors can be the run's own.) Gloo all-gathers no
    int16 tensor ("RuntimeError: Invalid scalar type"), so the int16 remainders are gathered as BF16 bits."""
    remainders = [(st, st["param_remainder"]) for st in opt.state.values() if "param_remainder" in st]
    for st, remainder in remainders:
        st["param_remainder"] = remainder.view(BF16)
    try:
        options = StateDictOptions(full_state_dict=True, cpu_offload=dist.is_initialized())
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
    finally:
        for st, remainder in remainders:
            st["param_remainder"] = remainder
    for st in optim_sd.get("state", {}).values():
        if "param_remainder" in st:
            st["param_remainder"] = st["param_remainder"].view(torch.int16)
    return copy.deepcopy({"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict()})


def _shards(model, opt, scaler) -> dict:
    """This rank's shards of the parameters and of every state entry (each with its kind: a DTensor of the
    parameter's layout, another DTensor, or a plain tensor), and the scaler's state."""
    params = list(model.parameters())
    states = []
    for p in params:
        st = {}
        for key, v in opt.state[p].items():
            kind = "plain"
            if isinstance(v, DTensor):
                kind = "parameter's layout" if v.placements == p.placements and v.shape == p.shape else "other"
            st[key] = (kind, _local(v).clone())
        states.append(st)
    return {"params": [_local(p.detach()).clone() for p in params], "states": states, "scaler": scaler.state_dict()}


def _same_shards(a: dict, b: dict) -> bool:
    return (a["scaler"] == b["scaler"] and len(a["params"]) == len(b["params"])
            and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
            and all(sa.keys() == sb.keys() and all(sa[k][0] == sb[k][0] and torch.equal(sa[k][1], sb[k][1])
                                                   for k in sa) for sa, sb in zip(a["states"], b["states"])))


# ---- the ranks' cases ---------------------------------------------------------------------------------------------

def _case_save(rank: int, out_dir: str) -> dict:
    """On this world size, each mode trained SAVED_AT steps and saved (the full state written with torch.save by
    rank 0 as well), trained on to STEPS (the uninterrupted run), and resumed from its checkpoint to STEPS. The 8-bit
    run is saved, and its states loaded into FP32 moments (the dtype options left out of the state dict, so that the
    loading optimizer's are kept) and saved again."""
    world = dist.get_world_size()
    out = {"uninterrupted": {}, "shards": {}}
    for mode in MODES:
        path = f"{out_dir}/{mode}-{world}"
        model, opt, scaler = _make(mode)
        _train(model, opt, scaler, range(SAVED_AT))
        _save(model, opt, scaler, path)
        full = _full(model, opt, scaler)
        if rank == 0:
            torch.save(full, f"{path}.pt")
        _train(model, opt, scaler, range(SAVED_AT, STEPS))
        out["uninterrupted"][mode] = _full(model, opt, scaler)
        resumed = _resume(mode, path)
        _train(*resumed, range(SAVED_AT, STEPS))
        out["shards"][mode] = (_shards(model, opt, scaler), _shards(*resumed))
    model, opt, scaler = _make("8bit")
    _train(model, opt, scaler, range(SAVED_AT))
    _save(model, opt, scaler, f"{out_dir}/8bit-{world}")
    sd = opt.state_dict()
    sd["param_groups"] = [{k: v for k, v in g.items() if k not in ("exp_avg_dtype", "exp_avg_sq_dtype")}
                          for g in sd["param_groups"]]
    fp32_opt = ampkit.optim.AdamW(model.parameters(), **EIGHT_BIT_MODES["8bit as fp32"][2])
    fp32_opt.load_state_dict(sd)
    _save(model, fp32_opt, scaler, f"{out_dir}/8bit as fp32-{world}")
    out["8bit as fp32"] = _full(model, fp32_opt, scaler)
    return out


def _case_resume(rank: int, out_dir: str, saved_world: int) -> dict:
    """The checkpoints of ``saved_world`` ranks loaded on this world size: each mode's (its full state as loaded, and
    after training on to STEPS), the 8-bit one (refused by a run one step in: DCP's error, and whether the run is
    unchanged) and the one of the same states as FP32 moments (its full state as loaded)."""
    out = {"loaded": {}, "resumed": {}}
    for mode in MODES:
        resumed = _resume(mode, f"{out_dir}/{mode}-{saved_world}")
        out["loaded"][mode] = _full(*resumed)
        _train(*resumed, range(SAVED_AT, STEPS))
        out["resumed"][mode] = _full(*resumed)
    run = _make("8bit")
    _train(*run, range(1))
    before = _shards(*run)
    out["8bit error"] = None
    try:
        _load(*run, f"{out_dir}/8bit-{saved_world}")
    except CheckpointException as e:  # a BaseException carrying each rank's error
        out["8bit error"] = str(e)
    out["8bit unchanged"] = _same_shards(before, _shards(*run))
    out["8bit as fp32"] = _full(*_resume("8bit as fp32", f"{out_dir}/8bit as fp32-{saved_world}"))
    return out


def _case_resume_and_save(rank: int, out_dir: str) -> dict:
    """The checkpoints of one rank loaded here (1 -> 2), then this world size's own runs and checkpoints."""
    out = _case_resume(rank, out_dir, 1)
    out.update(_case_save(rank, out_dir))
    return out


def _spawn(out_dir, name: str, world: int, case, *args) -> list:
    """Runs ``case(rank, out_dir, *args)`` on ``world`` ranks with test_fsdp2.py's worker; what each rank returned
    (full states on rank 0 only)."""
    store = out_dir / name
    store.mkdir()
    mp.spawn(_worker, args=(str(store / "store"), str(out_dir), case, args, world), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("reshard")


@pytest.fixture(scope="module")
def one_rank(ckpt_dir) -> list:
    return _spawn(ckpt_dir, "one", 1, _case_save)


@pytest.fixture(scope="module")
def two_ranks(ckpt_dir, one_rank) -> list:
    return _spawn(ckpt_dir, "two", 2, _case_resume_and_save)


@pytest.fixture(scope="module")
def four_ranks(ckpt_dir, two_ranks) -> list:
    return _spawn(ckpt_dir, "four", 4, _case_resume, 2)


@pytest.fixture(scope="module")
def one_rank_again(ckpt_dir, two_ranks) -> list:
    return _spawn(ckpt_dir, "one again", 1, _case_resume, 2)


# ---- checks -------------------------------------------------------------------------------------------------------

def _tensors(full: dict) -> dict:
    """name -> tensor of a full state: the parameters, every state entry and the FP32 weight a BF16 parameter stands
    for with its ``kahan_comp`` (parameter + compensation) or its ``param_remainder`` (the exact master)."""
    out = {f"{fqn} param": v for fqn, v in full["model"].items()}
    for fqn, st in full["optim"]["state"].items():
        out.update((f"{fqn} {key}", v) for key, v in st.items())
        if "kahan_comp" in st:
            out[f"{fqn} compensated weight"] = full["model"][fqn].float() + st["kahan_comp"].float()
        if "param_remainder" in st:
            out[f"{fqn} remainder master"] = ampkit.optim.AdamW.master_from_remainder(full["model"][fqn],
                                                                                    st["param_remainder"])
    return out


def _check_same_full(a: dict, b: dict, what: str) -> None:
    """The same parameters, state entries (keys, dtypes, bits), param groups and scaler state."""
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys(), what
    for name, x in ta.items():
        assert x.dtype == tb[name].dtype and torch.equal(x, tb[name]), f"{what}: {name}"
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"], what
    assert a["scaler"] == b["scaler"], what


def _deviations(resumed: dict, ref: dict, mode: str) -> dict:
    """name -> (max |resumed - ref| / max |ref|, its tolerance) of each tensor of a full state but the step counts
    and seeds (checked equal), ``kahan_comp`` and ``param_remainder`` (compared as the FP32 weights they stand
    for)."""
    dtype, _, kwargs, _, _ = _mode(mode)
    tolerance = RESHARD_TOLERANCE["stochastic rounding" if kwargs.get("master_weights") == "stochastic"
                                  else "bf16 grads" if dtype == BF16 else "fp32 grads"]
    a, b = _tensors(resumed), _tensors(ref)
    assert a.keys() == b.keys(), mode
    out = {}
    for name, x in a.items():
        y = b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, f"{mode}: {name}"
        key = name.split(" ", 1)[1]
        if key in ("step", "sr_seed"):
            assert torch.equal(x, y), f"{mode}: {name}"
        elif key not in ("kahan_comp", "param_remainder"):
            largest = y.double().abs().max().item() if y.numel() else 0.0
            diff = (x.double() - y.double()).abs().max().item() if y.numel() else 0.0
            out[name] = (diff / largest if largest else diff, tolerance.get(key, tolerance["default"]))
    return out


def _check_close(resumed: dict, ref: dict, mode: str, what: str) -> float:
    """Within RESHARD_TOLERANCE; the same scaler state. Returns the largest deviation relative to its tolerance."""
    assert resumed["scaler"] == ref["scaler"], f"{what}, {mode}"
    deviations = _deviations(resumed, ref, mode)
    bad = {name: d for name, d in deviations.items() if not d[0] <= d[1]}  # NaN fails
    assert not bad, f"{what}, {mode}: (deviation, tolerance) {bad}"
    return max(d / tol for d, tol in deviations.values())


# ---- tests ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2])
def test_resumed_on_as_many_ranks_continues_bit_for_bit(request, world):
    results = request.getfixturevalue("one_rank" if world == 1 else "two_ranks")
    for rank, result in enumerate(results):
        for mode, (uninterrupted, resumed) in result["shards"].items():
            what = f"rank {rank} of {world}, {mode}"
            assert _same_shards(uninterrupted, resumed), what
            assert resumed["scaler"]["skipped_steps"] == 1 and resumed["scaler"]["steps"] == STEPS, what
            for st in resumed["states"]:
                assert set(st) == MODES[mode][3], what
                # DTensors of the parameter's layout, which DCP reshards; the step a plain scalar, as torch.optim's,
                # and so the seed of stochastic rounding
                assert all(kind == ("plain" if key in ("step", "sr_seed") else "parameter's layout")
                           for key, (kind, _) in st.items()), f"{what}: {st}"


@pytest.mark.parametrize("move", ["2 -> 1", "1 -> 2", "2 -> 4"])
def test_resumed_on_another_number_of_ranks_loads_the_saved_state_and_stays_close(request, ckpt_dir, move):
    saved, loaded = (int(w) for w in move.split(" -> "))
    names = {1: "one_rank", 2: "two_ranks", 4: "four_ranks"}
    saving = request.getfixturevalue(names[saved])[0]
    loading = request.getfixturevalue("one_rank_again" if move == "2 -> 1" else names[loaded])[0]
    worst = {}
    for mode in MODES:
        at_save = torch.load(ckpt_dir / f"{mode}-{saved}.pt", weights_only=True)
        _check_same_full(loading["loaded"][mode], at_save, f"{move}, {mode} as loaded")
        worst[mode] = _check_close(loading["resumed"][mode], saving["uninterrupted"][mode], mode, move)
    # The comparison is not of a run with itself: the grads of another number of ranks differ.
    assert worst["fp32 masters"] > 0 and worst["sgd momentum"] > 0, worst


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP: "assuming ... a single process"
def test_a_model_that_is_not_distributed_loads_the_checkpoint(two_ranks, ckpt_dir):
    """DCP's checkpoint of 2 ranks loaded in this process (no process group) into a plain model: by dcp.load into the
    state dicts of torch's get_state_dict, from the full state dict written by rank 0, and from DCP's
    dcp_to_torch_save of the checkpoint; each the saved state bit for bit, continued alike, within tolerance of the
    uninterrupted run of 2 ranks."""
    assert not dist.is_initialized()
    for mode in MODES:
        path = ckpt_dir / f"{mode}-2"
        at_save = torch.load(f"{path}.pt", weights_only=True)  # tensors, numbers, strings and None only
        dcp_to_torch_save(path, ckpt_dir / f"{mode}-2 converted.pt")
        converted = torch.load(ckpt_dir / f"{mode}-2 converted.pt", weights_only=True)
        runs = [_resume(mode, str(path), sharded=False)]
        for full in (at_save, converted):
            run = _fresh(mode, sharded=False)
            full = copy.deepcopy(full)  # the optimizer may keep the loaded tensors, which training changes
            set_state_dict(run[0], run[1], model_state_dict=full["model"], optim_state_dict=full["optim"])
            run[2].load_state_dict(full["scaler"])
            runs.append(run)
        ends = []
        for how, run in zip(("dcp.load", "full state dict", "dcp_to_torch_save"), runs):
            assert not any(isinstance(p, DTensor) for p in run[0].parameters())
            _check_same_full(_full(*run), at_save, f"{mode} loaded by {how}")
            _train(*run, range(SAVED_AT, STEPS))
            ends.append(_full(*run))
            _check_same_full(ends[-1], ends[0], f"{mode} loaded by {how}, continued")
        _check_close(ends[0], two_ranks[0]["uninterrupted"][mode], mode, "not distributed")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_8bit_states_refuse_another_number_of_shards(ckpt_dir, two_ranks, four_ranks, one_rank_again):
    # Parameter 0 is the (520, 8) weight: 8-bit rows of ceil(4160 / 256) * 260 bytes on one shard, of
    # ceil(2080 / 256) * 260 on two, of ceil(1040 / 256) * 260 on four.
    for move, results, saved, current in (("1 -> 2", two_ranks, "1, 4420", "2, 2340"),
                                          ("2 -> 4", four_ranks, "2, 2340", "4, 1300"),
                                          ("2 -> 1", one_rank_again, "2, 2340", "1, 4420")):
        for rank, r in enumerate(results):
            msg = r["8bit error"]
            assert msg is not None, f"{move}: not refused on rank {rank}"
            assert f"Size mismatch between saved torch.Size([{saved}]) and current: torch.Size([{current}]) " \
                   "for optim.state.0.weight.exp_avg" in msg, f"{move}, rank {rank}: {msg}"
            assert r["8bit unchanged"], f"{move}: rank {rank}'s run changed"
    # Not distributed: DCP refuses the rows, and load_state_dict the full state dict of one, as the whole
    # parameter's 8-bit state.
    model, opt, scaler = _make("8bit", sharded=False)
    _train(model, opt, scaler, range(1))
    before = _shards(model, opt, scaler)
    with pytest.raises(CheckpointException, match=r"Size mismatch between saved torch.Size\(\[2, 2340\]\) and "
                                                  r"current: torch.Size\(\[4420\]\)"):
        _load(model, opt, scaler, str(ckpt_dir / "8bit-2"))
    dcp_to_torch_save(ckpt_dir / "8bit-2", ckpt_dir / "8bit-2.pt")
    full = torch.load(ckpt_dir / "8bit-2.pt", weights_only=True)
    with pytest.raises(ValueError, match=r"state\['0.weight'\]\['exp_avg'\] \(an 8-bit block-wise state\) must be "
                                         r"a 1-D Byte tensor of 4420 bytes .* but has shape \[2, 2340\]"):
        set_state_dict(model, opt, model_state_dict=full["model"], optim_state_dict=full["optim"])
    assert _same_shards(before, _shards(model, opt, scaler))
    # Loaded into FP32 moments where they were saved and saved again, the same states reshard bit for bit.
    as_fp32 = two_ranks[0]["8bit as fp32"]
    for results in (four_ranks, one_rank_again):
        _check_same_full(results[0]["8bit as fp32"], as_fp32, "8-bit states as FP32")
    assert as_fp32["optim"]["param_groups"][0]["exp_avg_dtype"] is None
    moment = as_fp32["optim"]["state"]["0.weight"]["exp_avg"]  # dequantized: FP32 in the parameter's shape
    assert moment.dtype == torch.float32 and moment.shape == (520, 8) and moment.isfinite().all() and moment.any()
