"""FP32 steps of ampkit.optim against torch.optim's fused CPU kernels, bit for bit: every element, including the
last numel % 8 (AVX2 and AVX-512: ampkit.build_info()["cpu_optim_tail_width"]) that torch's kernels run through
their scalar tail, the unscaled grads that a step under a grad scale writes back, and every hyper-parameter branch
(lerp from the grad for beta1 <= 0.5, coupled/decoupled decay, amsgrad, maximize, nesterov, dampening, tensor lr).
On an AVX-512 machine the module also runs again under torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2)."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

import ampkit
from conftest import bits_equal
from factories import make_params

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="bit-identity with torch's fused CPU kernels holds for its AVX2/AVX-512 kernels")

# Sizes around torch's vector width (8 or 16 floats), the CPU loops' 16/32-element steps and their 32768-element
# work items, so that vector bodies, scalar tails and work-item edges all meet.
SIZES = [1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 32768 + 19, 70000 + 5]


def _params(seed: int) -> list[torch.Tensor]:
    return make_params(seed=seed, shapes=[(n,) for n in SIZES] + [(3, 5, 7)])


def _run(ref_cls, ours_cls, kwargs, steps, scale=None, write_unscaled_grads=True, seed=0):
    ref_params, ours_params = _params(seed), _params(seed)
    ref = ref_cls(ref_params, fused=True, **kwargs)
    ours = ours_cls(ours_params, write_unscaled_grads=write_unscaled_grads, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for a, b in zip(ref_params, ours_params):
            g = torch.randn(a.shape, generator=gen)
            if scale is not None:
                g = g * scale
            a.grad, b.grad = g.clone(), g.clone()
        if scale is not None:
            for opt in (ref, ours):
                opt.grad_scale = torch.tensor(scale)
                opt.found_inf = torch.tensor(0.0)
        ref.step()
        ours.step()
    return ref, ours, ref_params, ours_params


def _assert_same(ref, ours, ref_params, ours_params, keys):
    for i, (a, b) in enumerate(zip(ref_params, ours_params)):
        assert bits_equal(a.detach(), b.detach()), f"param {i} ({a.numel()} elements)"
        for key in keys:
            assert bits_equal(ref.state[a][key], ours.state[b][key]), f"{key} of param {i} ({a.numel()} elements)"


ADAM_CASES = [dict(lr=lr, betas=betas, weight_decay=wd, amsgrad=ams, maximize=mx)
              for lr, betas, wd, ams, mx in itertools.product(
                  [1e-2, torch.tensor(3e-3)], [(0.9, 0.999), (0.3, 0.5)], [0.0, 0.1], [False, True], [False, True])
              if not (ams and mx and wd == 0.0)]


@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
@pytest.mark.parametrize("kwargs", ADAM_CASES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_adam_fp32_steps_are_bit_identical_to_torch_fused(cls, kwargs):
    ref, ours, rp, op = _run(getattr(torch.optim, cls), getattr(ampkit.optim, cls), kwargs, steps=3)
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if kwargs["amsgrad"] else [])
    _assert_same(ref, ours, rp, op, keys)


SGD_CASES = [dict(lr=0.05, momentum=0.0), dict(lr=0.05, momentum=0.0, weight_decay=0.1, maximize=True),
             dict(lr=0.05, momentum=0.9), dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
             dict(lr=torch.tensor(0.02), momentum=0.9, nesterov=True, weight_decay=0.01),
             dict(lr=0.05, momentum=0.5, dampening=0.5, maximize=True)]


@pytest.mark.parametrize("kwargs", SGD_CASES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_sgd_fp32_steps_are_bit_identical_to_torch_fused(kwargs):
    ref, ours, rp, op = _run(torch.optim.SGD, ampkit.optim.SGD, kwargs, steps=3)
    _assert_same(ref, ours, rp, op, ["momentum_buffer"] if kwargs["momentum"] else [])


@pytest.mark.parametrize("cls,kwargs", [("AdamW", dict(lr=1e-2, amsgrad=True)), ("Adam", dict(weight_decay=0.1)),
                                        ("SGD", dict(lr=0.05, momentum=0.9))])
def test_steps_under_a_grad_scale_write_the_unscaled_grads_back_as_torch(cls, kwargs):
    ref, ours, rp, op = _run(getattr(torch.optim, cls), getattr(ampkit.optim, cls), kwargs, steps=2,
                             scale=1024.0)
    for i, (a, b) in enumerate(zip(rp, op)):
        assert bits_equal(a.detach(), b.detach()), f"param {i}"
        assert bits_equal(a.grad, b.grad), f"grad {i}"


@pytest.mark.parametrize("cls", ["AdamW", "SGD"])
def test_write_unscaled_grads_false_leaves_the_grads_scaled_and_the_step_unchanged(cls):
    kwargs = dict(lr=0.05, momentum=0.9) if cls == "SGD" else dict(lr=1e-2)
    ref, ours, rp, op = _run(getattr(torch.optim, cls), getattr(ampkit.optim, cls), kwargs, steps=1, scale=512.0,
                             write_unscaled_grads=False)
    for a, b in zip(rp, op):
        assert bits_equal(a.detach(), b.detach())
        assert bits_equal(b.grad, a.grad * 512.0)  # torch's grad is unscaled; ours is as the backward left it


def test_write_unscaled_grads_must_be_a_bool():
    with pytest.raises(TypeError, match=r"AdamW: write_unscaled_grads must be True or False, but got 1"):
        ampkit.optim.AdamW([torch.zeros(2, requires_grad=True)], write_unscaled_grads=1)


def test_the_op_writes_unscaled_grads_back_only_when_asked():
    p = torch.randn(37)
    g = torch.randn(37) * 256.0
    for write in (True, False):
        grads = [g.clone()]
        torch.ops.ampkit.sgd_step_([p.clone()], grads, [], [], [], [], lr=0.1, momentum=0.0, dampening=0.0,
                                   weight_decay=0.0, nesterov=False, maximize=False,
                                   grad_scale=torch.tensor(256.0), write_unscaled_grads=write)
        assert bits_equal(grads[0], g / 256.0 if write else g)


def test_a_staged_grad_of_another_layout_gets_the_unscaled_values_too():
    # (torch's own fused kernel reads such a grad in the wrong element order, so the reference is the formula.)
    p0 = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    q = p0.clone().requires_grad_()
    ours = ampkit.optim.SGD([q], lr=0.1)
    g = torch.randn(2, 3, 4, 5) * 64.0  # contiguous grad for a channels_last parameter
    q.grad = g.clone()
    ours.grad_scale, ours.found_inf = torch.tensor(64.0), torch.tensor(0.0)
    ours.step()
    assert bits_equal(q.grad, g / 64.0)
    assert bits_equal(q.detach(), torch.addcmul(p0, g / 64.0, torch.tensor(-0.1)))


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512" or "ATEN_CPU_CAPABILITY" in os.environ,
                    reason="an AVX-512 machine runs this module a second time under torch's AVX2 kernels")
def test_the_module_also_holds_under_torchs_avx2_kernels():
    # torch and ampkit pick their CPU loops per process: a child process with torch's AVX2 kernels (where the
    # scalar tail is the last numel % 8 elements, as under AVX-512) must match bit for bit too.
    assert ampkit.build_info()["cpu_optim_tail_width"] == 8
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          env=env, cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
