"""FP32 gradients of FP16/BF16 parameters (torch's ``Tensor.grad_dtype``; NOTE [FP32 grads of low-precision params]
in kernels/common.h): every fused step reads them as FP32, so a low-precision parameter with a FP32 master steps
bit for bit as the FP32 path on the same master and grads, in every optimizer and state mode; the lean weight modes
round the FP32 path's exact update; the scaler finds, unscales and skips on them as torch.amp does; bad grad dtypes
are refused before anything changes. Under FSDP2, torch 2.13 casts the reduced grad to the sharded parameter's
dtype whatever its grad_dtype (the piece torch lacks, pinned below); FP32 sharded grads of BF16 compute are what
FSDP2 offers, and ampkit steps them (test_fsdp2.py)."""
from __future__ import annotations

import pytest
import torch

import ampkit
from conftest import DEVICES, bits_equal
from factories import grads_for, make_params
from loops import step_in_lockstep
from test_optim_lean import bf16_down_up

SHAPES = [(64, 33), (33,), (7, 5, 3), (1,), (0,), (4097,), (300,)]
LOW = [torch.bfloat16, torch.float16]

# (optimizer, options): every algorithm and its options that read the grad differently.
ALGORITHMS = {
    "AdamW": (ampkit.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Adam-amsgrad-maximize": (ampkit.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
    "SGD-nesterov": (ampkit.optim.SGD, dict(lr=5e-2, momentum=0.9, nesterov=True, weight_decay=1e-4)),
    "SGD-plain": (ampkit.optim.SGD, dict(lr=5e-2)),
    "LAMB-clipped": (ampkit.optim.LAMB, dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)),
}
STATES = {
    "fp32": {},
    "bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "8bit": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
}


def low_precision_twin(params32: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The FP32 params cast to ``dtype``, each accumulating FP32 grads (``grad_dtype``)."""
    out = []
    for p in params32:
        q = p.detach().to(dtype).requires_grad_()
        q.grad_dtype = torch.float32
        out.append(q)
    return out


def fp32_and_low(seed: int, dtype: torch.dtype, device: str = "cpu") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """FP32 params holding values of ``dtype`` (the FP32 run), and their exact ``dtype`` twins with FP32 grads."""
    params32 = [p.detach().to(dtype).float().requires_grad_()
                for p in make_params(device, shapes=SHAPES, seed=seed)]
    return params32, low_precision_twin(params32, dtype)


def state_options(name: str, states: str) -> dict | None:
    """The state-dtype options of a case (SGD: its momentum buffer's; LAMB keeps FP32 moments: None)."""
    extra = STATES[states]
    if not extra:
        return {}
    if name.startswith("LAMB") or name == "SGD-plain":
        return None
    if name.startswith("SGD"):
        return dict(momentum_dtype=extra["exp_avg_dtype"])
    return extra


def poisoned_grads(params, step):
    """Step ``step``'s FP32 grads, with values a BF16/FP16 grad could not hold (so that a step that rounded them
    first would differ)."""
    grads = grads_for(params, step, dtype=torch.float32)
    return [g * (1 + 2.0 ** -12) + 2.0 ** -20 for g in grads]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,states", [(name, states) for name in ALGORITHMS for states in STATES
                                         if state_options(name, states) is not None])
def test_fp32_grads_with_a_master_step_bit_for_bit_as_the_fp32_path(name, states, dtype, device):
    # On CUDA too: both paths take the same kernels' formulas per element (no scalar tail there).
    cls, options = ALGORITHMS[name]
    extra = state_options(name, states)
    params32, low = fp32_and_low(1, dtype, device)
    ref = cls(params32, **options, **extra)
    opt = cls(low, **options, **extra, master_weights=True)
    for step in range(3):
        step_in_lockstep([(params32, ref), (low, opt)], range(step, step + 1), grads=poisoned_grads)
        for p32, p in zip(params32, low):
            assert p.grad.dtype == torch.float32
            assert bits_equal(opt.state[p]["master_param"], p32.detach()), (name, step, p.shape)
            assert bits_equal(p.detach(), p32.detach().to(dtype)), (name, step, p.shape)
            for key, value in ref.state[p32].items():
                assert bits_equal(opt.state[p][key], value), (name, step, key)
    # The grads' FP32 bits reached the step: rounding them to the parameter's dtype first gives other masters.
    rounded = fp32_and_low(1, dtype, device)[1]
    opt_rounded = cls(rounded, **options, **extra, master_weights=True)
    for step in range(3):
        for p, g in zip(rounded, poisoned_grads(rounded, step)):
            p.grad = g.to(dtype).float()
        opt_rounded.step()
    differ = [not bits_equal(opt.state[p]["master_param"], opt_rounded.state[q]["master_param"])
              for p, q in zip(low, rounded) if p.numel() > 0]
    assert any(differ)


@pytest.mark.parametrize("name", ["AdamW", "SGD-nesterov", "LAMB-clipped"])
def test_fp32_grads_with_a_remainder_step_as_the_fp32_path(name):
    # BF16 weight + int16 remainder: the exact FP32 master in two halves.
    cls, options = ALGORITHMS[name]
    params32, low = fp32_and_low(2, torch.bfloat16)
    ref = cls(params32, **options)
    opt = cls(low, **options, master_weights="remainder")
    for step in range(3):
        step_in_lockstep([(params32, ref), (low, opt)], range(step, step + 1), grads=poisoned_grads)
        for p32, p in zip(params32, low):
            master = cls.master_from_remainder(p.detach(), opt.state[p]["param_remainder"])
            assert bits_equal(master, p32.detach()), (name, step, p.shape)


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
@pytest.mark.parametrize("name", ["AdamW", "SGD-nesterov", "LAMB-clipped"])
def test_fp32_grads_of_lean_bf16_weights_round_the_fp32_paths_update(name, mode):
    # One step from the same BF16 weights: the FP32 path's exact update w_new, then the mode's rounding of it.
    cls, options = ALGORITHMS[name]
    params32, low = fp32_and_low(3, torch.bfloat16)
    ref = cls(params32, **options)
    opt = cls(low, **options, master_weights=mode)
    before = [p.detach().clone() for p in low]
    step_in_lockstep([(params32, ref), (low, opt)], range(1), grads=poisoned_grads)
    moved = 0
    for p32, p, w0 in zip(params32, low, before):
        w_new = p32.detach()
        got = p.detach().float()
        if mode == "kahan":
            # w' = nearest(w + u), c' = nearest(u - (w' - w)), u = w_new - w (the compensation starts at 0).
            u = w_new - w0.float()
            assert bits_equal(p.detach(), (w0.float() + u).to(torch.bfloat16))
            assert bits_equal(opt.state[p]["kahan_comp"], (u - (got - w0.float())).to(torch.bfloat16))
        else:
            # Rounded up or down to a BF16 neighbour of the exact update, nothing else.
            lo, hi = bf16_down_up(w_new.double())
            assert bool(((got.double() == lo) | (got.double() == hi)).all()), (name, p.shape)
        moved += int((got != w0.float()).sum())
    assert moved > 0


def test_the_scaler_finds_unscales_and_skips_fp32_grads_of_bf16_params_as_torch_amp():
    # A BF16 model whose params accumulate FP32 grads, ampkit's scaler and AdamW (FP32 masters), against torch's
    # GradScaler and fused AdamW on FP32 copies fed the same FP32 grads; an Inf in the last element of the last
    # grad at step 2 skips both; unscale_ then clipping on step 3 (the scaler's unscale of FP32 grads).
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).to(torch.bfloat16)
    for p in model.parameters():
        p.grad_dtype = torch.float32
    twin = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2, master_weights=True)
    torch_opt = torch.optim.AdamW(twin, lr=1e-2, fused=True)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    x = torch.randn(64, 16)
    scales = []
    for step in range(5):
        opt.zero_grad()
        loss = model(x.bfloat16()).float().square().mean()
        scaler.scale(loss).backward()
        torch_scaler.scale(loss.detach())  # makes torch's scale tensor on first use
        grads = [p.grad for p in model.parameters()]
        assert all(g.dtype == torch.float32 for g in grads)
        if step == 2:
            grads[-1].view(-1)[-1] = float("inf")
        for t, g in zip(twin, grads):
            t.grad = g.clone()
        if step == 3:
            scaler.unscale_(opt)
            torch_scaler.unscale_(torch_opt)
            for t, p in zip(twin, model.parameters()):
                assert bits_equal(p.grad, t.grad)
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
            torch.nn.utils.clip_grad_norm_(twin, 0.5)
        scaler.step(opt)
        torch_scaler.step(torch_opt)
        scaler.update()
        torch_scaler.update()
        assert scaler.get_scale() == torch_scaler.get_scale()
        for t, p in zip(twin, model.parameters()):
            assert bits_equal(opt.state[p]["master_param"], t.detach()), step
            assert bits_equal(p.detach(), t.detach().bfloat16()), step
        scales.append(scaler.get_scale())
    assert scales == [2.0 ** 10, 2.0 ** 11, 2.0 ** 10, 2.0 ** 10, 2.0 ** 11]  # grown, halved by the Inf, grown


def test_fp32_grads_in_another_layout_than_the_param_stay_fp32():
    # A grad whose strides differ from its parameter's is staged in the parameter's layout for the kernels: in FP32,
    # and stored back unscaled in FP32 (a staging copy in BF16 would round both).
    torch.manual_seed(5)
    p = torch.randn(33, 16).to(torch.bfloat16).t().detach().requires_grad_()  # strides (1, 16)
    p.grad_dtype = torch.float32
    p32 = p.detach().float().requires_grad_()
    assert p.stride() == p32.stride() == (1, 16)
    opt = ampkit.optim.AdamW([p], lr=1e-2, master_weights=True)
    ref = ampkit.optim.AdamW([p32], lr=1e-2)
    scaler = ampkit.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    for step in range(3):
        g = torch.randn(16, 33) * (1 + 2.0 ** -12)  # contiguous: another layout than the parameter's
        scaler.scale(torch.ones(()))
        p.grad = g * 1024.0
        p32.grad = g.clone()
        scaler.step(opt)
        scaler.update()
        ref.step()
        assert bits_equal(opt.state[p]["master_param"], p32.detach()), step
        assert p.grad.dtype == torch.float32 and bits_equal(p.grad, g), step  # unscaled (1024 is a power of 2)


@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.bfloat16, torch.float64), (torch.bfloat16, torch.float16),
                                                    (torch.float32, torch.bfloat16)])
def test_a_grad_of_another_dtype_is_refused_and_nothing_changes(param_dtype, grad_dtype):
    p = torch.randn(40).to(param_dtype).requires_grad_()
    p.grad_dtype = None  # any grad dtype
    p.grad = torch.randn(40).to(grad_dtype)
    opt = ampkit.optim.AdamW([p], lr=1e-2)
    before = p.detach().clone()
    grad = p.grad.clone()
    with pytest.raises((TypeError, ValueError, RuntimeError)) as info:
        opt.step()
    names = {torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16"}
    assert "grads[0]" in str(info.value) and f"but got {names[grad_dtype]}" in str(info.value), str(info.value)
    assert bits_equal(p.detach(), before) and bits_equal(p.grad, grad)
    assert not opt.state[p] or int(opt.state[p]["step"]) == 0


def test_a_grad_of_another_dtype_on_a_param_with_gaps_is_refused_and_nothing_changes():
    # Parameters with gaps in memory take torch's single-tensor formulas, which mix no dtypes.
    p = torch.randn(8, 12).to(torch.bfloat16)[:, ::2].detach().requires_grad_()
    p.grad_dtype = torch.float32
    p.grad = torch.randn(8, 6)
    q = torch.randn(5).to(torch.bfloat16).requires_grad_()  # a parameter the step would take, listed first
    q.grad = torch.randn(5).to(torch.bfloat16)
    opt = ampkit.optim.AdamW([q, p], lr=1e-2, master_weights=False)
    before = [t.detach().clone() for t in (q, p)]
    with pytest.raises(TypeError, match=r"AdamW: a BFloat16 parameter of shape \[8, 6\] has a Float grad, which only "
                                        r"the fused kernels take .* but it has gaps in memory"):
        opt.step()
    assert all(bits_equal(t.detach(), b) for t, b in zip((q, p), before))
    assert not opt.state[q] and not opt.state[p]


def test_the_op_names_the_grad_dtype_it_takes():
    p = torch.randn(8, dtype=torch.bfloat16)
    g = torch.randn(8, dtype=torch.float64)
    m, v = torch.zeros(8), torch.zeros(8)
    step = torch.zeros(())
    with pytest.raises(TypeError, match=r"ampkit::adamw_step_: grads\[0\] must be BFloat16 or Float like params\[0\], "
                                        r"but got Double"):
        torch.ops.ampkit.adamw_step_([p], [g], [torch.zeros(8)], [], [m], [v], [], [step], lr=1e-3, beta1=0.9,
                                     beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                                     decoupled_weight_decay=True)
    assert m.count_nonzero() == 0 and step.item() == 0


TORCH_2_13 = pytest.mark.skipif(not torch.__version__.startswith("2.13."),
                                reason="pins a behaviour of torch 2.13, the pinned version")


@TORCH_2_13
def test_fsdp2_in_torch_2_13_casts_the_reduced_grad_to_the_sharded_params_dtype():
    """The piece torch lacks: FSDP2 casts the reduce-scatter output to the sharded parameter's dtype, so a BF16
    sharded parameter cannot take FP32 grads (``grad_dtype``) from it. When torch changes this, this test fails,
    and ampkit's fused steps already take the FP32 grads it would give."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=0, world_size=1)
        m = torch.nn.Linear(8, 4).to(torch.bfloat16)
        fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        for p in m.parameters():
            p.grad_dtype = torch.float32
        try:
            m(torch.randn(3, 8)).float().sum().backward()
            print("grads", sorted({str(p.grad.to_local().dtype) for p in m.parameters()}))
        except RuntimeError as e:
            print("refused:", "grad_dtype" in str(e))
        dist.destroy_process_group()
    """)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PORT": str(port)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: True" in out.stdout, out.stdout


@TORCH_2_13
def test_torch_compile_in_torch_2_13_cannot_trace_a_grad_of_another_dtype():
    """The other piece torch lacks: Dynamo refuses (or fails on) a parameter whose grad has another dtype, for torch's
    own optimizers as for ampkit's, so such steps run eagerly. When torch changes this, this test fails."""
    p = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)
    p.grad_dtype = torch.float32
    p.grad = torch.randn(16)
    step = torch.compile(torch.optim.SGD([p], lr=0.1).step, backend="eager")
    with pytest.raises(Exception, match="grad_dtype|dtype mismatch"):
        step()

