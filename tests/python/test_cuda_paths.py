"""The CUDA paths: an O2 step captured in a CUDA graph and replayed, against the same steps run eagerly; the CUDA
scaler's state read back (stats, state_dict, pickling); a list of a thousand tensors. These need a device and are
skipped (and counted as skipped) without one; the kernels themselves also run on every machine through the
emulated build (ctest -L emulated)."""
from __future__ import annotations

import pickle

import torch

import ampkit
from ampkit.optim import _traced
from conftest import CUDA_ONLY, bits_equal
from loops import capture_and_replay

pytestmark = CUDA_ONLY


def _o2_setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    opt = ampkit.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), weight_decay=0.01)
    opt.init_master_params()
    model.half()
    scaler = ampkit.GradScaler("cuda", init_scale=2.0**10, growth_interval=5)
    return model, opt, scaler


def _step(model, opt, scaler, x, y):
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def test_o2_step_captured_in_a_cuda_graph_equals_eager_steps():
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = torch.randn(103, 16, 32, device="cuda", generator=g).half()
    ys = torch.randn(103, 16, 8, device="cuda", generator=g)
    eager, (model, opt, scaler) = capture_and_replay(_o2_setup, _step, xs, ys)
    for a, b in zip(eager[0].parameters(), model.parameters()):
        assert bits_equal(a.detach(), b.detach())
    assert scaler.get_scale() == eager[2].get_scale()


def test_cuda_scaler_state_reads_back():
    model, opt, scaler = _o2_setup()
    x = torch.randn(16, 32, device="cuda").half()
    y = torch.randn(16, 8, device="cuda")
    for i in range(4):
        if i == 1:
            x[0, 0] = float("inf")
        _step(model, opt, scaler, x, y)
        x[0, 0] = 0.0
    stats = scaler.stats()
    assert stats["steps"] == 4 and stats["skipped_steps"] == 1
    state = scaler.state_dict()
    assert isinstance(state["scale"], float) and state["scale"] == scaler.get_scale()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == state


def test_a_thousand_tensor_list_matches_the_cpu():
    torch.manual_seed(3)
    grads = [torch.randn(1 + (i * 37) % 500).to(torch.float16 if i % 2 else torch.bfloat16) * 100 for i in range(1000)]
    grads[-1][-1] = float("nan")
    on_gpu = [g.cuda() for g in grads]
    on_cpu = [g.clone() for g in grads]
    f_gpu = torch.zeros(1, device="cuda")
    f_cpu = torch.zeros(1)
    torch.ops.ampkit.unscale_and_check_(on_gpu, f_gpu, torch.full((1,), 0.125, device="cuda"))
    torch.ops.ampkit.unscale_and_check_(on_cpu, f_cpu, torch.full((1,), 0.125))
    assert f_gpu.item() == f_cpu.item() == 1.0
    for a, b in zip(on_gpu, on_cpu):
        assert bits_equal(a.cpu(), b)


def test_precision_support_without_an_index_reads_the_current_device():
    # torch.device("cuda") means the current device; a report of device 0 would name another GPU on a machine of
    # several (on one GPU every index reads the same device, and the check still runs).
    for index in range(torch.cuda.device_count()):
        with torch.cuda.device(index):
            plain = ampkit.precision_support("cuda")
        assert plain == ampkit.precision_support(f"cuda:{index}")
        assert torch.cuda.get_device_name(index) in plain["reason"]
        major, minor = torch.cuda.get_device_capability(index)
        assert f"compute capability {major}.{minor}" in plain["reason"]


def test_fused_steps_with_tensor_betas_and_a_cpu_tensor_lr_make_no_host_sync():
    # Tensor betas on the GPU are read once (the first step), then only when they change; a CPU tensor lr is read
    # on the host by the op (no host-to-device copy), on the eager path and on the traced one alike.
    torch.manual_seed(5)
    params = [torch.randn(n, device="cuda", requires_grad=True) for n in (7, 1000, 70001)]
    betas = (torch.tensor(0.9, device="cuda"), torch.tensor(0.999, device="cuda"))
    eager = ampkit.optim.AdamW(params, lr=torch.tensor(1e-3), betas=betas)
    traced_params = [p.detach().clone().requires_grad_() for p in params]
    traced = ampkit.optim.AdamW(traced_params, lr=torch.tensor(1e-3))
    for p, q in zip(params, traced_params):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    eager.step()  # reads the betas: one sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            eager.step()
            assert _traced.step(traced) is None  # the compiled step's code, run eagerly: one plan, no break
    finally:
        torch.cuda.set_sync_debug_mode("default")
