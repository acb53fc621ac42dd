"""ampkit.distributed.compress_fsdp: FSDP2's gradient reduce-scatter (and HSDP's) sent in BF16/FP16 and summed in
FP32, with the scaler's overflow check carried by the reduction, on Gloo ranks (one thread each; test_fsdp2.py's
model, data and spawn). Two spawns: two ranks run every 1-D case, four ranks (2 replicas x 2 shards) the HSDP ones.

References are computed here from each rank's local (unsharded) gradients, taken from a plain copy of the model
that holds the whole parameters and runs that rank's batch: the parts cast to the wire dtype, their mean taken in
float64 and rounded once to FP32 (the exact value of NOTE [Compressed FSDP reduction]'s FP32 sum: the parts are
BF16/FP16 values and each ``part / 2`` is exact, so the FP32 sum of the halves is the float64 sum rounded once). The
compressed grads must equal them bit for bit. Against the FP32 run (torch's default reduce-scatter, whose mean is
the FP32 rounding of the exact one), each grad may differ by the casts to the wire dtype and two FP32 roundings:
``|compressed - fp32| <= u * (|g_0| + |g_1|) / 2 + tiny + 2**-23 * |fp32|``, with ``u`` the wire dtype's unit
roundoff (2**-8 BF16, 2**-11 FP16) and ``tiny`` half its smallest subnormal (where a part rounds to a subnormal).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import ampkit
import ampkit.distributed
import test_fsdp2
from test_fsdp2 import NEEDS_FSDP2, _loss, _model, _run, _unsharded_model

pytestmark = [NEEDS_FSDP2]
if test_fsdp2.fully_shard is not None:  # (NEEDS_FSDP2 skips every test otherwise)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

STEPS = 3
INIT_SCALE = 1024.0
WHERE = r"ampkit\.distributed\.compress_fsdp: "
# Bytes one rank sends per step on 2 shards: half of each FSDP module's padded gradients, 2 bytes each. Rows are
# padded to a multiple of 2: layer 0 16 x 8 + 16, layer 2 4 x 16 + 4, layer 4 2 x 3 + 2 elements.
SENT_PER_STEP = (16 * 8 + 16 + 4 * 16 + 4 + 2 * 3 + 2) // 2 * 2


# ---- helpers run by the ranks -----------------------------------------------------------------------------------

def _local_grads(model, rank: int, step: int, scale: float = 1.0) -> list:
    """This rank's local (unsharded) gradients at ``model``'s current parameters: a plain copy of the model holding
    the whole parameters runs this rank's batch (loss times ``scale``). All-gathers the parameters."""
    plain = _unsharded_model()
    with torch.no_grad():
        for p, q in zip(plain.parameters(), model.parameters()):
            p.copy_(q.full_tensor())
    (_loss(plain, rank, step) * scale).backward()
    return [p.grad for p in plain.parameters()]


def _reduced(model) -> list:
    """The whole reduced gradients (all-gathered from the shards)."""
    return [p.grad.full_tensor() for p in model.parameters()]


def _shards(model) -> list:
    return [p.detach().to_local().clone() for p in model.parameters()]


def _inject(model, layer: int, index: tuple, value: float):
    """Writes ``value`` at ``index`` of this rank's local gradient of ``model[layer].weight`` in the next backward,
    before FSDP reduces it (a hook on the unsharded parameter, removed once it has run)."""
    handles = []

    def put(grad):
        handles.pop().remove()
        grad = grad.clone()
        grad[index] = value
        return grad

    def pre_forward(module, args):
        handles.pop().remove()
        handles.append(module.weight.register_hook(put))

    handles.append(model[layer].register_forward_pre_hook(pre_forward))


class _CountAllReduces:
    """Counts the ``dist.all_reduce`` calls made inside the block (the scaler's found_inf collective)."""

    def __enter__(self):
        self.calls, self._real = 0, dist.all_reduce

        def counting(*args, **kwargs):
            self.calls += 1
            return self._real(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


def _scaled_run(model, scaler, rank: int, inject_at: dict) -> dict:
    """AdamW driven by ``scaler`` for STEPS steps; ``inject_at``: step -> (rank, layer, index, value) written into
    that rank's local gradient. Returns per step whether it ran, the scale, the all-reduces of step + update, the
    local shards after it; and step 0's local and reduced grads."""
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2)
    out = {"ran": [], "scale": [], "all_reduces": [], "shards": [_shards(model)]}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        if step == 0:
            out["local"] = _local_grads(model, rank, step, INIT_SCALE)
        if step in inject_at and inject_at[step][0] == rank:
            _inject(model, *inject_at[step][1:])
        scaler.scale(_loss(model, rank, step)).backward()
        if step == 0:
            out["reduced"] = _reduced(model)
        with _CountAllReduces() as counted:
            scaler.step(opt)
            scaler.update()
        out["all_reduces"].append(counted.calls)
        out["ran"].append(bool(scaler.last_step_ran()))
        out["scale"].append(scaler.get_scale())
        out["shards"].append(_shards(model))
    return out


# ---- two ranks --------------------------------------------------------------------------------------------------

def _transport(rank: int, wire: torch.dtype) -> dict:
    """No scaler: STEPS SGD steps with compressed grads, each step's local and reduced grads; the FP32 run's first
    reduced grads."""
    model = _model()
    compression = ampkit.distributed.compress_fsdp(model, dtype=wire)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"local": [], "reduced": []}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out["local"].append(_local_grads(model, rank, step))
        _loss(model, rank, step).backward()
        out["reduced"].append(_reduced(model))
        opt.step()
    out["sent"] = compression.bytes_sent()
    fp32 = _model()
    _loss(fp32, rank, 0).backward()
    out["fp32"] = _reduced(fp32)
    return out


def _refusals(rank: int) -> dict:
    """Bad arguments raise before any module changes: the model then reduces as FSDP's default (FP32) does."""
    model = _model()
    bad = [(dict(dtype=torch.float32), ValueError,
            WHERE + r"dtype must be torch\.bfloat16 or torch\.float16, but got torch\.float32"),
           (dict(dtype="bf16"), TypeError, WHERE + r"dtype must be torch\.bfloat16 or torch\.float16, but got str"),
           (dict(scaler=ampkit.GradScaler("cpu", enabled=False)), ValueError,
            WHERE + r"scaler must be an enabled ampkit\.GradScaler .*, but got a disabled one"),
           (dict(scaler=torch.amp.GradScaler("cpu")), TypeError,
            WHERE + r"scaler must be an ampkit\.GradScaler or None, but got torch\.amp\.grad_scaler\.GradScaler")]
    for kwargs, error, message in bad:
        with pytest.raises(error, match=message):
            ampkit.distributed.compress_fsdp(model, **kwargs)
    with pytest.raises(TypeError, match=WHERE + r"modules must be an FSDP module \(torch\.distributed\.fsdp\."
                                                r"fully_shard\), but got Linear"):
        ampkit.distributed.compress_fsdp(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=WHERE + r"modules\[1\] must be an FSDP module .*, but got Linear"):
        ampkit.distributed.compress_fsdp([model, torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=WHERE + r"modules must hold at least one FSDP module, but got an empty list"):
        ampkit.distributed.compress_fsdp([])
    _loss(model, rank, 0).backward()
    untouched = _model()
    _loss(untouched, rank, 0).backward()
    out = {"unchanged": all(torch.equal(p.grad.to_local(), q.grad.to_local())
                            for p, q in zip(model.parameters(), untouched.parameters()))}
    # FSDP sums an FP16 reduce_dtype: refused with a scaler, at the first reduce-scatter, before any collective.
    model = _model(MixedPrecisionPolicy(reduce_dtype=torch.float16))
    scaler = ampkit.GradScaler("cpu", init_scale=INIT_SCALE)
    ampkit.distributed.compress_fsdp(model, scaler, dtype=torch.float16)
    with pytest.raises(ValueError, match=WHERE + r"with a scaler, FSDP's reduce op must be ReduceOp\.AVG, but got "
                                                r"RedOpType\.SUM: .* use reduce_dtype=torch\.float32"):
        scaler.scale(_loss(model, rank, 0)).backward()
    return out


def _case_two_ranks(rank: int, out_dir: str) -> dict:
    out = {wire: _transport(rank, wire) for wire in (torch.bfloat16, torch.float16)}
    # An Inf in rank 1's gradient of rows that rank 0 owns (layer 0's weight, row 0): without a scaler it reaches
    # rank 0 only; with one, every rank skips.
    model = _model()
    ampkit.distributed.compress_fsdp(model)
    if rank == 1:
        _inject(model, 0, (0, 0), math.inf)
    _loss(model, rank, 0).backward()
    out["inf reaches"] = not bool(next(model.parameters()).grad.to_local().isfinite().all())
    inf_on_1 = {1: (1, 0, (0, 0), math.inf)}
    model = _model()
    scaler = ampkit.GradScaler("cpu", init_scale=INIT_SCALE)
    ampkit.distributed.compress_fsdp(model, scaler)
    out["inf"] = _scaled_run(model, scaler, rank, inf_on_1)
    model = _model()  # the same run without compress_fsdp: the scaler all-reduces found_inf over the shards
    out["inf, uncompressed"] = _scaled_run(model, ampkit.GradScaler("cpu", init_scale=INIT_SCALE), rank, inf_on_1)
    # 1e5 (finite in FP32, above FP16's 65504) in rank 0's gradient of rows rank 1 owns (layer 0's weight, row 15).
    big_on_0 = {1: (0, 0, (15, 0), 1e5)}
    for wire in (torch.float16, torch.bfloat16):
        model = _model()
        scaler = ampkit.GradScaler("cpu", init_scale=INIT_SCALE)
        ampkit.distributed.compress_fsdp(model, scaler, dtype=wire)
        out["1e5", wire] = _scaled_run(model, scaler, rank, big_on_0)
    out.update(_refusals(rank))
    return out


def _bound(g0, g1, fp32, wire) -> torch.Tensor:
    """The documented bound on |compressed - fp32| (module docstring)."""
    info = torch.finfo(wire)
    u, tiny = info.eps / 2, info.smallest_normal * info.eps / 2
    return u * (g0.abs() + g1.abs()) / 2 + tiny + 2.0 ** -23 * fp32.abs()


def _reference(locals_: list, wire, scale: float = 1.0) -> list:
    """The mean of the ranks' local grads cast to ``wire``, in float64, rounded once to FP32, unscaled."""
    return [(sum(g[i].to(wire).double() for g in locals_) / len(locals_)).float() / scale
            for i in range(len(locals_[0]))]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("two_ranks"), _case_two_ranks)


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_compressed_grads_are_the_fp32_sum_of_the_compressed_parts(two_ranks, wire):
    runs = [r[wire] for r in two_ranks]
    for step in range(STEPS):
        expected = _reference([r["local"][step] for r in runs], wire)
        for rank, run in enumerate(runs):
            for i, (got, ref) in enumerate(zip(run["reduced"][step], expected)):
                assert got.dtype == torch.float32 and torch.equal(got, ref), f"rank {rank}, step {step}, grad {i}"
    assert [r["sent"] for r in runs] == [STEPS * SENT_PER_STEP] * 2


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_compressed_grads_stay_within_the_wire_rounding_of_the_fp32_run(two_ranks, wire):
    g0, g1 = (r[wire]["local"][0] for r in two_ranks)
    differ = False
    for i, (got, fp32) in enumerate(zip(two_ranks[0][wire]["reduced"][0], two_ranks[0][wire]["fp32"])):
        assert ((got - fp32).abs() <= _bound(g0[i], g1[i], fp32, wire)).all(), f"grad {i}"
        differ |= not torch.equal(got, fp32)
    assert differ, "the compression rounds"


def test_an_inf_in_one_ranks_grads_skips_the_step_on_every_rank(two_ranks):
    assert [r["inf reaches"] for r in two_ranks] == [True, False], "the Inf lies in rows only rank 0 owns"
    for name in ("inf", "inf, uncompressed"):
        runs = [r[name] for r in two_ranks]
        assert [r["ran"] for r in runs] == [[True, False, True]] * 2, name
        assert [r["scale"] for r in runs] == [[INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2]] * 2, name
        for r in runs:
            before, skipped, after = r["shards"][1:]
            assert all(torch.equal(a, b) for a, b in zip(before, skipped)), f"{name}: parameters unchanged"
            assert not all(torch.equal(a, b) for a, b in zip(skipped, after)), f"{name}: the next step moves"
    # The flag travels with the reduced grads: no found_inf all-reduce; with FSDP's reduce-scatter, one per step.
    assert [r["inf"]["all_reduces"] for r in two_ranks] == [[0] * STEPS] * 2
    assert [r["inf, uncompressed"]["all_reduces"] for r in two_ranks] == [[1] * STEPS] * 2
    # Step 0, before the Inf: the grads the optimizer got were unscaled, bit for bit the reference's.
    expected = _reference([r["inf"]["local"] for r in two_ranks], torch.bfloat16, INIT_SCALE)
    for r in two_ranks:
        assert all(torch.equal(got, ref) for got, ref in zip(r["inf"]["reduced"], expected))


def test_fp16_transport_catches_a_value_above_fp16s_range(two_ranks):
    fp16, bf16 = ([r["1e5", wire] for r in two_ranks] for wire in (torch.float16, torch.bfloat16))
    assert [r["ran"] for r in fp16] == [[True, False, True]] * 2
    assert [r["scale"] for r in fp16] == [[INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2]] * 2
    assert [r["ran"] for r in bf16] == [[True, True, True]] * 2, "BF16 holds 1e5"


def test_bad_arguments_are_refused_before_anything_changes(two_ranks):
    assert [r["unchanged"] for r in two_ranks] == [True, True]


# ---- HSDP: 2 replicas x 2 shards ----------------------------------------------------------------------------------

def _case_hsdp(rank: int, out_dir: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    # FP32 accumulation on the shard leg, FSDP's FP32 all-reduce across replicas. An Inf in rank 3's gradient of
    # rows that rank 2 owns in their shard group reaches ranks 0 and 1 through that all-reduce.
    model = _model(MixedPrecisionPolicy(reduce_dtype=torch.float32), mesh=mesh)
    out["placements"] = [str(p.placements) for p in model.parameters()]
    scaler = ampkit.GradScaler("cpu", init_scale=INIT_SCALE)
    compression = ampkit.distributed.compress_fsdp(model, scaler)
    out["fp32 reduce"] = _scaled_run(model, scaler, rank, {1: (3, 0, (0, 0), math.inf)})
    out["sent"] = compression.bytes_sent()
    # Both legs in BF16: FSDP casts the grads, the shard leg adds in FP32, Gloo adds the replicas in BF16.
    model = _model(MixedPrecisionPolicy(reduce_dtype=torch.bfloat16), mesh=mesh)
    scaler = ampkit.GradScaler("cpu", init_scale=INIT_SCALE)
    ampkit.distributed.compress_fsdp(model, scaler)
    out["bf16 reduce"] = _scaled_run(model, scaler, rank, {})
    return out


def test_hsdp_reduces_both_legs_and_skips_on_every_rank(tmp_path):
    results = _run(tmp_path, _case_hsdp, world=4)
    assert results[0]["placements"][0] == "(Replicate(), Shard(dim=0))"
    bf16 = torch.bfloat16
    # Shard groups {0, 1} and {2, 3}; FSDP's all-reduce averages the two groups' results.
    fp32_reduce, bf16_reduce = [], []
    for group in ((0, 1), (2, 3)):
        fp32_reduce.append(_reference([results[r]["fp32 reduce"]["local"] for r in group], bf16))
        bf16_reduce.append([g.to(bf16).double() for g in
                            _reference([results[r]["bf16 reduce"]["local"] for r in group], bf16)])
    expected = {"fp32 reduce": [((a.double() + b.double()) / 2).float() / INIT_SCALE
                                for a, b in zip(*fp32_reduce)],
                # Gloo's BF16 average: the sum rounded to BF16, halved (exactly)
                "bf16 reduce": [((a + b).to(bf16).double() / 2).float() / INIT_SCALE for a, b in zip(*bf16_reduce)]}
    for name, ref in expected.items():
        for rank, r in enumerate(results):
            assert all(torch.equal(got, want) for got, want in zip(r[name]["reduced"], ref)), f"{name}: rank {rank}"
    runs = [r["fp32 reduce"] for r in results]
    assert [r["ran"] for r in runs] == [[True, False, True]] * 4
    assert [r["scale"] for r in runs] == [[INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2]] * 4
    assert all(torch.equal(a, b) for r in runs for a, b in zip(r["shards"][1], r["shards"][2]))
    assert [r["all_reduces"] for r in runs] == [[0] * STEPS] * 4
    assert [r["bf16 reduce"]["ran"] for r in results] == [[True] * STEPS] * 4
    assert [r["sent"] for r in results] == [STEPS * SENT_PER_STEP] * 4
