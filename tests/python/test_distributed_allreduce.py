"""ampkit::distributed::GradientAllReduce (the C++ all-reduce LibTorch programs use, through its Python binding)
on real Gloo ranks: the same weights as DDP with ampkit's unscale hooks, bit for bit, with and without compression and
overlap; buckets, gradient accumulation, parameters without grads, Inf on one rank, and bad arguments."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ampkit
import ampkit.distributed
from test_distributed_ddp import _batch, _init, _model, _spawn


def _run(rank, world, store, results, mode, compression, overlap):
    _init(rank, world, store)
    try:
        model = _model()
        opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = ampkit.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
        if mode == "ddp":
            net = DDP(model)
            hook = {"fp16": ampkit.distributed.fp16_compress_unscale_hook,
                    "bf16": ampkit.distributed.bf16_compress_unscale_hook}
            if compression is not None:
                net.register_comm_hook(scaler, hook[compression])
            sync = None
        else:
            net = model
            # small buckets: several all-reduces per step
            sync = ampkit.distributed.GradientAllReduce(model.parameters(), compression=compression,
                                                        bucket_cap_mb=2e-3, overlap=overlap, scaler=scaler)
        skipped = []
        for step in range(4):
            x, y = _batch(step, rank, world)
            if step == 2 and rank == 1:
                x = x.clone()
                x[0, 0] = math.inf
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(net(x), y)).backward()
            if sync is not None:
                sync.synchronize()
            scaler.step(opt)
            scaler.update()
            skipped.append(bool(not scaler.last_step_ran().item()))
        results[rank] = ([p.detach().clone() for p in model.parameters()], skipped,
                         None if sync is None else (sync.bucket_indices(), sync.bytes_reduced()))
    finally:
        # The DDP reducer first (see the finally of examples/python/ddp_train.py).
        model = net = None  # noqa: F841
        dist.destroy_process_group()


@pytest.mark.parametrize("compression,overlap", [("fp16", True), ("bf16", False), (None, True)])
def test_cxx_all_reduce_gives_ddp_with_ampkits_hooks_bit_for_bit(tmp_path, compression, overlap):
    ours = _spawn(_run, 2, tmp_path, "allreduce", compression, overlap)
    (tmp_path / "ddp").mkdir()
    ddp = _spawn(_run, 2, tmp_path / "ddp", "ddp", compression, overlap)
    for rank in (0, 1):
        params, skipped, (buckets, nbytes) = ours[rank]
        assert all(torch.equal(a, b) for a, b in zip(params, ddp[rank][0]))
        assert skipped == ddp[rank][1] == [False, False, True, False]  # Inf on rank 1 at step 2: both skip
        assert len(buckets) > 1 and sorted(i for b in buckets for i in b) == [0, 1, 2, 3]
        assert buckets[0][0] == 3  # reverse order: the last parameter's grad is ready first
        wire = 2 if compression else 4
        numel = sum(p.numel() for p in params)
        assert nbytes == 4 * numel * wire  # 4 steps, every parameter once per step


def _accumulate(rank, world, store, results):
    _init(rank, world, store)
    try:
        model = _model()
        unused = torch.nn.Parameter(torch.zeros(3))  # never gets a grad on rank 0; rank 1 gives it one
        params = list(model.parameters()) + [unused]
        # One bucket per parameter: `unused` (last, so first out) is ready on rank 1 only, yet both ranks must
        # pair the same buckets.
        sync = ampkit.distributed.GradientAllReduce(params, bucket_cap_mb=1e-5)
        assert len(sync.bucket_indices()) == len(params)
        sync.set_require_sync(False)
        for micro in range(2):  # local accumulation, no all-reduce
            x, y = _batch(micro, rank, world)
            torch.nn.functional.mse_loss(model(x), y).backward()
        local = [p.grad.clone() for p in model.parameters()]
        sync.set_require_sync(True)
        x, y = _batch(2, rank, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if rank == 1:
            loss = loss + unused.sum()
        loss.backward()
        sync.synchronize()
        results[rank] = (local, [p.grad.clone() for p in params], sync.bytes_reduced())
    finally:
        # The DDP reducer first (see the finally of examples/python/ddp_train.py).
        model = net = None  # noqa: F841
        dist.destroy_process_group()


def test_accumulation_without_sync_and_a_parameter_without_grad_on_one_rank(tmp_path):
    results = _spawn(_accumulate, 2, tmp_path)
    # Reference: every rank's three micro-batches summed, averaged over the ranks.
    model = _model()
    for rank in (0, 1):
        for micro in range(3):
            x, y = _batch(micro, rank, 2)
            (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
    for rank in (0, 1):
        _, grads, nbytes = results[rank]
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-7)
        assert torch.equal(grads[-1], torch.full((3,), 0.5))  # rank 1's ones, averaged with rank 0's zeros
        assert nbytes == 4 * sum(g.numel() for g in grads)  # one round: the accumulated backwards sent nothing
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def _bad(rank, world, store, results):
    _init(rank, world, store)
    try:
        p = torch.nn.Parameter(torch.ones(3))
        errors = []
        for kwargs, exc in [(dict(params=[p, p]), ValueError), (dict(params=[torch.ones(3)]), ValueError),
                            (dict(params=[p], compression="int8"), ValueError),
                            (dict(params=[p], bucket_cap_mb=0), ValueError),
                            (dict(params=[p], scaler=torch.amp.GradScaler("cpu")), TypeError)]:
            try:
                ampkit.distributed.GradientAllReduce(**kwargs)
                errors.append(f"{kwargs}: no error")
            except exc as e:
                errors.append(str(e))
        sync = ampkit.distributed.GradientAllReduce([p])  # noqa: F841  (its hooks live as long as it does)
        (p * 2).sum().backward()
        try:
            (p * 2).sum().backward()
            errors.append("second backward: no error")
        except RuntimeError as e:
            errors.append(str(e))
        results[rank] = errors
    finally:
        # The DDP reducer first (see the finally of examples/python/ddp_train.py).
        model = net = None  # noqa: F841
        dist.destroy_process_group()


def test_bad_arguments_are_refused_with_clear_errors(tmp_path):
    errors = _spawn(_bad, 2, tmp_path)[0]
    assert "params[0] and params[1] are the same tensor" in errors[0]
    assert "params[0] must be a leaf tensor that requires grad" in errors[1]
    assert "compression must be None, 'fp16' or 'bf16', but got 'int8'" in errors[2]
    assert "bucket_cap_mb must be a positive number" in errors[3]
    assert "scaler must be an ampkit.GradScaler" in errors[4]
    assert "a second backward reached parameter 0 before synchronize()" in errors[5]
