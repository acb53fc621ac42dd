"""ampkit.optim against torch.optim on PyTorch's own optimizer database (torch.testing._internal.common_optimizers:
each OptimizerInfo's optim_inputs_func and optim_error_inputs_func for Adam, AdamW and SGD), plus the drop-in
behaviours a user swapping the import relies on: resuming torch checkpoints (old ones included), the fallback to
torch's own implementation for what the fused kernels do not take (FP64, complex, sparse grads, differentiable),
and torch's argument errors."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit
from conftest import bits_equal
from factories import grads_for, make_params

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")
OptimizerErrorEnum = common_optimizers.OptimizerErrorEnum

NAMES = ("Adam", "AdamW", "SGD")
INFOS = [info for info in common_optimizers.optim_db if info.optim_cls.__name__ in NAMES]


def _inputs():
    """Every input torch lists for the CPU, plus its CUDA-only ones that torch.optim also accepts on the CPU."""
    out = []
    for info in INFOS:
        seen = set()
        for device in ("cpu", "cuda"):
            for oi in info.optim_inputs_func(device=device):
                key = repr(sorted(oi.kwargs.items(), key=lambda kv: kv[0]))
                if key in seen:
                    continue
                seen.add(key)
                out.append(pytest.param(info, oi.kwargs, id=f"{info.optim_cls.__name__}-{oi.desc}-{device}"))
    return out


SHAPES = [(7, 5), (5,), (3, 2, 4), (1,)]


def _params():
    return make_params(shapes=SHAPES)


def _grads(params, step):
    return grads_for(params, step, first_seed=100)


def _run(cls, kwargs, params, steps, start=0, optimizer=None):
    opt = optimizer or cls(params, **copy.deepcopy(kwargs))
    for step in range(start, start + steps):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    return opt


@pytest.mark.parametrize("info,kwargs", _inputs())
def test_torch_db_inputs_match_torch_optim_and_resume_its_checkpoints(info, kwargs):
    ours_cls = getattr(ampkit.optim, info.optim_cls.__name__)
    ref_params = _params()
    try:
        ref = _run(info.optim_cls, kwargs, ref_params, 4)
    except Exception as e:  # an input torch refuses on the CPU: ampkit must refuse it with the same type
        with pytest.raises(type(e)):
            _run(ours_cls, kwargs, _params(), 4)
        return
    ours_params = _params()
    _run(ours_cls, kwargs, ours_params, 4)
    for a, b in zip(ours_params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Where torch's fused CPU kernel takes the input, FP32 results are its bits exactly.
    fused_kwargs = {k: v for k, v in kwargs.items() if k not in ("foreach", "fused")}
    fused_params = _params()
    try:
        _run(info.optim_cls, dict(fused_kwargs, fused=True), fused_params, 4)
    except Exception:  # an input torch's fused kernel does not take (differentiable, capturable on the CPU)
        fused_params = None
    if fused_params is not None and not kwargs.get("differentiable"):
        for a, b in zip(_run(ours_cls, fused_kwargs, _params(), 4).param_groups[0]["params"], fused_params):
            assert bits_equal(a.detach(), b.detach())
    # A torch checkpoint resumed by ampkit continues as torch continues.
    resumed_params = [p.detach().clone().requires_grad_() for p in ref_params]
    resumed = ours_cls(resumed_params, **copy.deepcopy(kwargs))
    resumed.load_state_dict(ref.state_dict())
    _run(None, kwargs, resumed_params, 3, start=4, optimizer=resumed)
    _run(None, kwargs, ref_params, 3, start=4, optimizer=ref)
    for a, b in zip(resumed_params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("info,kwargs", _inputs())
def test_torch_db_inputs_never_write_into_the_grads(info, kwargs):
    # As torch's optimizers (fused ones included): a step without a grad scale leaves every grad and its version
    # alone; a version bump on a grad autograd saved would make a later backward through it raise.
    ours_cls = getattr(ampkit.optim, info.optim_cls.__name__)
    params = _params()
    try:
        opt = ours_cls(params, **copy.deepcopy(kwargs))
    except Exception:
        return  # an input refused at construction (test above)
    for step in range(3):
        grads = _grads(params, step)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        versions = [p.grad._version for p in params]
        try:
            opt.step()
        except Exception:
            return  # an input refused at the step, as torch refuses it (test above)
        assert [p.grad._version for p in params] == versions
        assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))


def _error_inputs():
    out = []
    for info in INFOS:
        for ei in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
            out.append(pytest.param(info, ei, id=f"{info.optim_cls.__name__}-{ei.optimizer_error_input.desc}"))
    return out


@pytest.mark.parametrize("info,ei", _error_inputs())
def test_torch_db_error_inputs_raise_as_torch_does(info, ei):
    ours_cls = getattr(ampkit.optim, info.optim_cls.__name__)
    oi = ei.optimizer_error_input
    expect = pytest.warns if issubclass(ei.error_type, Warning) else pytest.raises
    with expect(ei.error_type, match=ei.error_regex):
        opt = ours_cls(oi.params, **oi.kwargs)
        if ei.error_on == OptimizerErrorEnum.STEP_ERROR:
            opt.step()


# ---- checkpoints from torch.optim, old and new ---------------------------------------------------------------

def test_sgd_resumes_torch_momentum():
    p = torch.zeros(1, requires_grad=True)
    ref = torch.optim.SGD([p], lr=1.0, momentum=0.9)
    p.grad = torch.ones(1)
    ref.step()
    q = p.detach().clone().requires_grad_()
    ours = ampkit.optim.SGD([q], lr=1.0, momentum=0.9)
    ours.load_state_dict(ref.state_dict())
    p.grad = torch.ones(1)
    q.grad = torch.ones(1)
    ref.step()
    ours.step()
    assert p.item() == pytest.approx(-2.9) and bits_equal(q.detach(), p.detach())


def test_sgd_without_momentum_keeps_no_per_parameter_state():
    p = torch.zeros(3, requires_grad=True)
    opt = ampkit.optim.SGD([p], lr=0.5)
    p.grad = torch.ones(3)
    opt.step()
    assert len(opt.state) == 0 and torch.equal(p.detach(), torch.full((3,), -0.5))


@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
def test_state_dicts_of_older_torch_load_and_step(cls):
    p = torch.randn(6, requires_grad=True)
    ref = getattr(torch.optim, cls)([p], weight_decay=0.1)
    p.grad = torch.randn(6)
    ref.step()
    sd = copy.deepcopy(ref.state_dict())
    for group in sd["param_groups"]:
        for key in ("maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"):
            group.pop(key, None)
    sd["state"][0]["step"] = 1.0  # a Python number, as torch < 1.12 saved it
    q = p.detach().clone().requires_grad_()
    ours = getattr(ampkit.optim, cls)([q], weight_decay=0.1)
    ours.load_state_dict(sd)
    assert torch.is_tensor(ours.state[q]["step"]) and ours.state[q]["step"].item() == 1.0
    assert ours.param_groups[0]["decoupled_weight_decay"] == (cls == "AdamW")
    g = torch.randn(6)
    p.grad, q.grad = g.clone(), g.clone()
    ref.step()
    ours.step()
    torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


def test_adamw_loading_an_adam_state_dict_keeps_decoupled_decay():
    sd = torch.optim.Adam([torch.zeros(3, requires_grad=True)], weight_decay=0.1).state_dict()
    ours = ampkit.optim.AdamW([torch.zeros(3, requires_grad=True)])
    ours.load_state_dict(sd)
    assert ours.param_groups[0]["decoupled_weight_decay"] is True


# ---- what the fused kernels do not take: torch's own implementation, bit for bit ---------------------------------

FALLBACKS = [
    ("fp64", lambda: [torch.randn(4, 3, dtype=torch.float64, requires_grad=True)], None),
    ("complex64", lambda: [torch.randn(4, 3, dtype=torch.complex64, requires_grad=True)], None),
    ("complex128", lambda: [torch.randn(5, dtype=torch.complex128, requires_grad=True)], None),
]


@pytest.mark.parametrize("name,make,_", FALLBACKS, ids=[f[0] for f in FALLBACKS])
@pytest.mark.parametrize("cls,kwargs", [
    ("Adam", dict(weight_decay=0.1, amsgrad=True)), ("AdamW", {}), ("SGD", dict(momentum=0.9, nesterov=True)),
    ("Adam", dict(lr=torch.tensor(0.01), maximize=True, weight_decay=0.1)),
    ("AdamW", dict(lr=torch.tensor([0.02]), amsgrad=True)),
    ("SGD", dict(lr=torch.tensor(0.05), momentum=0.9, dampening=0.1, weight_decay=0.01, maximize=True))],
    ids=["Adam-l2-amsgrad", "AdamW", "SGD-nesterov", "Adam-tensor-lr-maximize", "AdamW-tensor-lr-amsgrad",
         "SGD-tensor-lr-dampening-maximize"])
def test_parameters_the_kernels_do_not_take_follow_torch_bit_for_bit(name, make, _, cls, kwargs):
    torch.manual_seed(0)
    ref_params = make()
    ours_params = [p.detach().clone().requires_grad_() for p in ref_params]
    ref = getattr(torch.optim, cls)(ref_params, foreach=False, **kwargs)
    ours = getattr(ampkit.optim, cls)(ours_params, **kwargs)
    for _step in range(4):
        for a, b in zip(ref_params, ours_params):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    for a, b in zip(ref_params, ours_params):
        assert torch.equal(a, b)
        assert a.dtype == b.dtype


def test_sgd_sparse_gradients_follow_torch():
    torch.manual_seed(1)
    a = torch.randn(6, 3, requires_grad=True)
    b = a.detach().clone().requires_grad_()
    ref, ours = torch.optim.SGD([a], lr=0.1), ampkit.optim.SGD([b], lr=0.1)
    for _ in range(3):
        g = torch.randn(6, 3).to_sparse()
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    assert torch.equal(a, b)


def test_differentiable_steps_follow_torch_and_carry_gradients():
    def run(cls):
        w0 = torch.randn(4, requires_grad=True, generator=torch.Generator().manual_seed(2))
        w = w0.clone()  # a non-leaf, as differentiable optimizers need
        opt = cls([w], lr=0.1, momentum=0.9, differentiable=True)
        w.grad = torch.ones(4)
        opt.step()
        w.sum().backward()
        return w.detach(), w0.grad
    (wa, ga), (wb, gb) = run(torch.optim.SGD), run(ampkit.optim.SGD)
    assert torch.equal(wa, wb) and torch.equal(ga, gb)


def test_non_dense_and_restrided_parameters_are_accepted():
    torch.manual_seed(3)
    base = torch.randn(4, 6)
    a = torch.nn.Parameter(base[:, ::2])  # non-dense: torch's own implementation
    b = torch.nn.Parameter(base.clone()[:, ::2])
    c = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last).requires_grad_()
    ref = torch.optim.Adam([a, c.detach().clone().requires_grad_()], foreach=False)
    ours = ampkit.optim.Adam([b, c])
    for _ in range(3):
        ga, gc = torch.randn(4, 3), torch.randn(2, 3, 4, 5)  # contiguous grad for a channels_last param
        a.grad, b.grad = ga.clone(), ga.clone()
        ref.param_groups[0]["params"][1].grad = gc.clone()
        c.grad = gc.clone()
        ref.step()
        ours.step()
    assert torch.equal(a, b)
    torch.testing.assert_close(c, ref.param_groups[0]["params"][1], rtol=1e-6, atol=1e-7)


def test_master_weights_on_a_complex_parameter_is_a_clear_error():
    p = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    opt = ampkit.optim.AdamW([p], master_weights=True)
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="master_weights=True needs FP16, BF16 or FP32 parameters"):
        opt.step()


# ---- torch's argument semantics ------------------------------------------------------------------------------

def test_fused_and_foreach_together_and_capturable_on_the_cpu_raise_as_torch():
    for cls in ("Adam", "AdamW", "SGD"):
        with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together."):
            getattr(ampkit.optim, cls)([torch.zeros(2, requires_grad=True)], fused=True, foreach=True)
    p = torch.zeros(2, requires_grad=True)
    opt = ampkit.optim.Adam([p], capturable=True)
    p.grad = torch.ones(2)
    with pytest.raises(AssertionError, match="If capturable=True, params and state_steps must be on supported"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(2)) and len(opt.state) == 0


def test_tensor_betas_give_the_float_betas_result():
    a, b = torch.randn(5, requires_grad=True), None
    b = a.detach().clone().requires_grad_()
    oa = ampkit.optim.Adam([a], betas=(torch.tensor(0.9), torch.tensor(0.99)))
    ob = ampkit.optim.Adam([b], betas=(0.9, 0.99))
    for _ in range(3):
        g = torch.randn(5)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)


class _ScalarReads(TorchDispatchMode):
    """Counts the host reads (aten._local_scalar_dense: .item(), float()) of the given tensors."""

    def __init__(self, watched):
        super().__init__()
        self.watched = watched
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and any(args[0] is t for t in self.watched):
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_tensor_betas_are_read_on_the_host_once_per_change():
    # On a GPU every read of a tensor beta is a host sync: a step reads them only when they changed.
    a = torch.randn(5, requires_grad=True)
    b = a.detach().clone().requires_grad_()
    betas = (torch.tensor(0.9), torch.tensor(0.99))
    oa = ampkit.optim.Adam([a], betas=betas)
    ob = ampkit.optim.Adam([b], betas=(0.9, 0.99))
    reads = []
    for step in range(6):
        if step == 3:  # a schedule writes a beta in place: the next step reads it, once
            betas[1].fill_(0.95)
            ob.param_groups[0]["betas"] = (0.9, float(torch.tensor(0.95)))
        g = torch.randn(5)
        a.grad, b.grad = g.clone(), g.clone()
        with _ScalarReads(oa.param_groups[0]["betas"]) as mode:
            oa.step()
        ob.step()
        reads.append(mode.reads)
        assert torch.equal(a, b), step
    assert reads == [0, 0, 0, 1, 0, 0]  # the constructor's checks read both; then only the one written


def test_the_deprecated_grad_scaler_handshake_passes_the_scaler_with_torchs_warning():
    seen = {}

    class Legacy(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            seen["scaler"] = grad_scaler
            grad_scaler.unscale_(self)  # the optimizer does the scaler's work itself in this handshake
            return "stepped"

    p = torch.zeros(2, requires_grad=True)
    opt = Legacy([p], lr=0.1)
    scaler = ampkit.GradScaler("cpu")
    scaler.scale(p.sum()).backward()
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        assert scaler.step(opt) == "stepped"
    assert seen["scaler"] is scaler
    scaler.update()


def test_errors_of_the_single_tensor_path_are_raised_before_anything_is_written():
    a = torch.nn.Parameter(torch.ones(3))
    p = torch.nn.Parameter(torch.ones(4, 2))
    opt = ampkit.optim.SGD([a, p], lr=0.1, momentum=0.9, weight_decay=0.1)
    a.grad, p.grad = torch.ones(3), torch.ones(4, 2).to_sparse()
    with pytest.raises(RuntimeError, match=r"add\(sparse, dense\) is not supported"):  # torch.optim.SGD's error
        opt.step()
    assert torch.equal(a.detach(), torch.ones(3)) and len(opt.state) == 0
    # An explicit master for a parameter the kernels do not take (gaps in memory) is refused, not ignored.
    w = torch.nn.Parameter(torch.randn(4, 6).to(torch.bfloat16)[:, ::2])
    w.grad = torch.ones_like(w)
    opt = ampkit.optim.AdamW([w], master_weights=True)
    with pytest.raises(ValueError, match="master_weights=True needs a parameter dense in memory"):
        opt.step()
    # A torch-format state missing its moments is refused at load (it would fail half-way through a step).
    q = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = ampkit.optim.AdamW([q])
    sd = opt.state_dict()
    sd["state"] = {0: {"step": torch.tensor(3.0)}}
    with pytest.raises(ValueError, match="partial state"):
        opt.load_state_dict(sd)
    assert len(opt.state) == 0
