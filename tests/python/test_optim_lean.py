"""master_weights="stochastic" and "kahan": BF16 weights without an FP32 master (kernels/stochastic_rounding.h).
Stochastic rounding checked for bias and for its probabilities, both modes against float64 references of their
formulas, the stagnation of plain BF16 weights that both cure, the device-side skip, bit-identical resumption from
a state_dict, CPU against CUDA, and bad input."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import ampkit
from conftest import CUDA_ONLY
from loops import run_steps, seeded_bf16_grads

LEAN = ["stochastic", "kahan"]
ULP_BELOW_1 = 2.0 ** -8  # BF16's unit in the last place in [0.5, 1)


def bf16_down_up(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The BF16 neighbours of float64 values (below or equal, above or equal), as float64."""
    f = x.float()  # exact for the values the tests use (FP32 results)
    bits = f.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    trunc = ((bits >> 16) << 16).to(torch.int32).view(torch.float32).double()  # towards zero
    up = (((bits >> 16) + 1) << 16).to(torch.int32).view(torch.float32).double()
    exact = (bits & 0xFFFF) == 0
    away = torch.where(exact, trunc, up)
    lo = torch.where(f >= 0, trunc, away)
    hi = torch.where(f >= 0, away, trunc)
    return lo, hi


def rn_bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> BF16 round to nearest even, through FP32 only where that is exact (the tests' values are)."""
    return x.float().to(torch.bfloat16).double()


# ---- stochastic rounding ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fraction", [1 / 16, 0.25, 0.5, 0.8125])
def test_stochastic_rounding_rounds_up_with_probability_the_distance_and_is_unbiased(fraction):
    # SGD with lr 1: w' = 1 - g exactly in FP32, a fraction of the way from 1 to the next BF16 value 1 + 2^-7.
    torch.manual_seed(0)
    n = 200_000
    ulp = 2.0 ** -7
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = ampkit.optim.SGD([p], lr=1.0, master_weights="stochastic")
    p.grad = torch.full((n,), -fraction * ulp, dtype=torch.bfloat16)
    target = 1.0 + fraction * ulp
    opt.step()
    w = p.detach().double()
    assert bool(((w == 1.0) | (w == 1.0 + ulp)).all())  # only the two neighbours
    up = float((w != 1.0).double().mean())
    sigma = math.sqrt(fraction * (1 - fraction) / n)
    assert abs(up - fraction) < 5 * sigma, (up, fraction)
    assert abs(float(w.mean()) - target) < 5 * sigma * ulp


def test_stochastic_rounding_is_reproducible_and_differs_across_steps_and_seeds():
    def run(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = ampkit.optim.SGD([p], lr=1.0, master_weights="stochastic")
        out = []
        for _ in range(3):
            p.grad = torch.full_like(p, -2.0 ** -9)
            opt.step()
            out.append(p.detach().clone())
            with torch.no_grad():
                p.fill_(1.0)
        return out

    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])  # the step is part of the counter
    assert not torch.equal(a[0], c[0])  # so is the seed


# ---- each mode against a float64 reference of its formula -------------------------------------------------------

def adamw_reference(w, g, m, v, step, *, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step in float64 on the BF16 weight's value; returns (w_new, m, v)."""
    w, g, m, v = w.double(), g.double(), m.double(), v.double()
    w = w * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    return w - lr / bc1 * m / (v.sqrt() / math.sqrt(bc2) + eps), m, v


@pytest.mark.parametrize("mode", LEAN)
def test_an_adamw_step_in_each_lean_mode_follows_its_float64_formula(mode):
    torch.manual_seed(3)
    n = 4099
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    p = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16))
    opt = ampkit.optim.AdamW([p], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                             weight_decay=hp["weight_decay"], master_weights=mode)
    for step in (1, 2, 3):
        p.grad = torch.randn(n).to(torch.bfloat16)
        w0 = p.detach().double()
        st = opt.state.get(p, {})
        m0 = st["exp_avg"].clone() if st else torch.zeros(n)
        v0 = st["exp_avg_sq"].clone() if st else torch.zeros(n)
        c0 = st["kahan_comp"].double() if st and mode == "kahan" else torch.zeros(n, dtype=torch.float64)
        w_new, m_ref, v_ref = adamw_reference(w0, p.grad, m0, v0, step, **hp)
        opt.step()
        st = opt.state[p]
        assert float(st["step"]) == step
        # FP32 moments: a few roundings of quantities of the grads' size (|g| ~ 1).
        torch.testing.assert_close(st["exp_avg"].double(), m_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(st["exp_avg_sq"].double(), v_ref, rtol=1e-6, atol=1e-7)
        w = p.detach().double()
        # The kernel's FP32 update differs from float64's by a few FP32 roundings of the weight (the decay, the sums)
        # and of the update.
        slack = w0.abs() * 2.0 ** -21 + (w_new - w0).abs() * 1e-5 + 1e-30
        if mode == "stochastic":
            assert "sr_seed" in st and st["sr_seed"].dtype == torch.int64
            lo, hi = bf16_down_up(w_new)
            lo_s, _ = bf16_down_up(w_new - slack)
            _, hi_s = bf16_down_up(w_new + slack)
            assert bool(((w == lo) | (w == hi) | (w == lo_s) | (w == hi_s)).all())
        else:
            c = st["kahan_comp"]
            assert c.dtype == torch.bfloat16 and c.shape == p.shape
            u = c0 + (w_new - w0)
            # w' = bf16(w + u) and c' = bf16(u - (w' - w)): weight + compensation hold w + u but for c's rounding.
            assert ((w - rn_bf16(w0 + u)).abs() <= bf16_ulp(w0 + u)).all()
            held = w + c.double()
            bound = c.double().abs() * 2.0 ** -8 + slack * 2 + 1e-30
            assert bool(((held - (w0 + u)).abs() <= bound).all())
            assert bool((c.double().abs() <= bf16_ulp(w)).all())  # the compensation stays below one unit


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """BF16's unit in the last place at |x| (float64)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126)))
    return torch.pow(2.0, e - 7)


# ---- stagnation -------------------------------------------------------------------------------------------------

def stagnation_run(cls, mode, n=512, steps=2000):
    """A BF16 weight at 1.0 given `steps` updates of -1e-4 each: SGD with lr 1e-4 and grad 1, or AdamW with lr 1e-4,
    a constant grad (m^ / sqrt(v^) = 1) and eps 0."""
    torch.manual_seed(4)
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    if cls is ampkit.optim.SGD:
        opt = cls([p], lr=1e-4, master_weights=mode)
    else:
        opt = cls([p], lr=1e-4, eps=0.0, weight_decay=0.0, master_weights=mode)
    p.grad = torch.ones(n, dtype=torch.bfloat16)
    for _ in range(steps):
        opt.step()
    st = opt.state.get(p, {})
    held = p.detach().double()  # what the optimizer holds of the weight
    if mode is True:
        held = st["master_param"].double()
    elif mode == "kahan":
        held = held + st["kahan_comp"].double()
    return p.detach().double(), held


@pytest.mark.parametrize("cls", [ampkit.optim.SGD, ampkit.optim.AdamW])
def test_stagnation_plain_bf16_stays_stochastic_drifts_kahan_and_masters_track(cls):
    expected = 1.0 - 2000 * 1e-4  # 0.8
    plain, _ = stagnation_run(cls, False)
    assert bool((plain == 1.0).all())  # each update is below half a unit: rounded away, forever

    n = 4096
    sr, _ = stagnation_run(cls, "stochastic", n=n)
    # Each element is an independent unbiased walk on the grid of step 2^-8 (all of it in [0.5, 1)): each update
    # moves it down one unit with probability q = 1e-4 / 2^-8, so after 2000 its spread is sqrt(2000 q (1 - q))
    # units and the mean of n elements is within 5 of its standard deviations of 0.8.
    q = 1e-4 / ULP_BELOW_1
    spread = math.sqrt(2000 * q * (1 - q)) * ULP_BELOW_1  # ~0.028
    assert abs(float(sr.mean()) - expected) < 5 * spread / math.sqrt(n), float(sr.mean())
    assert 0.9 * spread < float(sr.std()) < 1.1 * spread, float(sr.std())

    for mode in ("kahan", True):
        w, held = stagnation_run(cls, mode)
        assert bool(((w - expected).abs() <= ULP_BELOW_1).all()), (mode, float(w.min()), float(w.max()))
        # What the optimizer holds: an FP32 master within 2000 FP32 roundings (half a unit, 2^-25, each) of 0.8;
        # weight + Kahan compensation within one BF16 unit too, not much closer: the compensation is itself BF16,
        # and with one update repeated its rounding errors (up to 2^-18 each) do not cancel (measured: 0.8012 with
        # SGD; the FP32 master 0.79997).
        bound = 2000 * 2.0 ** -25 if mode is True else ULP_BELOW_1
        assert bool(((held - expected).abs() < bound).all()), (mode, float(held.min()), float(held.max()))


# ---- the device-side skip writes nothing ------------------------------------------------------------------------

def state_bits(opt, params) -> list[dict]:
    return [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in params]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def make_lean(cls, mode, sizes=(5, 33, 1000), device="cpu", *, seed: int, **kwargs):
    """BF16 parameters of the given sizes drawn after torch.manual_seed(seed), and their optimizer in `mode`."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, device=device).to(torch.bfloat16)) for n in sizes]
    return params, cls(params, lr=1e-2, master_weights=mode, **kwargs)


OPTIMIZERS = [(ampkit.optim.AdamW, {}), (ampkit.optim.Adam, dict(weight_decay=0.01)),
              (ampkit.optim.SGD, dict(momentum=0.9)), (ampkit.optim.SGD, {})]


def each_optimizer_in_each_lean_mode(test):
    """Parametrizes ``test(cls, kwargs, mode)`` over OPTIMIZERS and LEAN."""
    return pytest.mark.parametrize("cls,kwargs", OPTIMIZERS)(pytest.mark.parametrize("mode", LEAN)(test))


@each_optimizer_in_each_lean_mode
def test_a_skipped_step_writes_nothing_and_the_next_step_rounds_as_without_it(cls, kwargs, mode):
    params, opt = make_lean(cls, mode, seed=5, **kwargs)
    scaler = ampkit.GradScaler("cpu", init_scale=256.0)

    def step(nan: bool) -> None:
        opt.zero_grad()
        scaler.scale(sum((p.float() * torch.linspace(-1, 1, p.numel())).sum() for p in params)).backward()
        if nan:
            params[1].grad[3] = float("nan")
        scaler.step(opt)
        scaler.update()

    for _ in range(2):
        step(False)
    before_params = [p.detach().clone() for p in params]
    before_state = state_bits(opt, params)
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = cls(twin_params, lr=1e-2, master_weights=mode, **kwargs)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    step(True)
    assert all(same_bits(p.detach(), b) for p, b in zip(params, before_params))
    for after, before in zip(state_bits(opt, params), before_state):
        assert after.keys() == before.keys()
        assert all(same_bits(after[k], before[k]) for k in before), [k for k in before
                                                                     if not same_bits(after[k], before[k])]
    # The next clean step equals the twin's step from the same state: the skip left the counter where it was.
    scale = float(scaler.get_scale())
    for ps, o in ((params, opt), (twin_params, twin)):
        o.zero_grad()
        (sum((p.float() * torch.linspace(-1, 1, p.numel())).sum() for p in ps) * scale).backward()
        o.grad_scale = torch.tensor(scale)
        o.found_inf = torch.zeros(())
        o.step()
    assert all(same_bits(p.detach(), q.detach()) for p, q in zip(params, twin_params))


# ---- state_dict: bit-identical resumption -----------------------------------------------------------------------

@each_optimizer_in_each_lean_mode
def test_resuming_from_a_state_dict_is_bit_identical(cls, kwargs, mode):
    sizes = (7, 64, 1031)
    grads = seeded_bf16_grads(6, sizes, 10)

    params, opt = make_lean(cls, mode, sizes, seed=7, **kwargs)
    start = [p.detach().clone() for p in params]
    run_steps(params, opt, grads)

    first, opt1 = make_lean(cls, mode, sizes, seed=7, **kwargs)
    run_steps(first, opt1, grads[:5])
    saved = copy.deepcopy(opt1.state_dict())
    saved_weights = [p.detach().clone() for p in first]
    torch.manual_seed(123)  # another generator state: the seeds come from the state dict, not from it
    resumed = [torch.nn.Parameter(w.clone()) for w in saved_weights]
    opt2 = cls(resumed, lr=1e-2, master_weights=mode, **kwargs)
    opt2.load_state_dict(saved)
    for p in resumed:
        st = opt2.state[p]
        assert ("sr_seed" in st) == (mode == "stochastic") and ("kahan_comp" in st) == (mode == "kahan")
        if mode == "kahan":
            assert st["kahan_comp"].dtype == torch.bfloat16  # not cast to FP32 on load
        else:
            assert st["sr_seed"].dtype == torch.int64
    run_steps(resumed, opt2, grads[5:])
    assert not all(same_bits(p.detach(), s) for p, s in zip(params, start))
    assert all(same_bits(p.detach(), q.detach()) for p, q in zip(params, resumed))
    for a, b in zip(state_bits(opt, params), state_bits(opt2, resumed)):
        assert a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)


# ---- bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", LEAN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cls", [ampkit.optim.AdamW, ampkit.optim.Adam, ampkit.optim.SGD])
def test_a_lean_mode_on_a_non_bf16_parameter_raises_and_changes_nothing(mode, dtype, cls):
    torch.manual_seed(8)
    good = torch.nn.Parameter(torch.randn(16).to(torch.bfloat16))
    bad = torch.nn.Parameter(torch.randn(16).to(dtype))
    opt = cls([good, bad], lr=0.1, master_weights=mode)
    good.grad = torch.randn(16).to(torch.bfloat16)
    bad.grad = torch.randn(16).to(dtype)
    before = (good.detach().clone(), bad.detach().clone())
    name = cls.__name__
    with pytest.raises(ValueError, match=rf"{name}: master_weights='{mode}' needs BFloat16 parameters.*but got a "
                                         rf"{str(dtype).split('.')[-1].capitalize()}|{name}.*{mode}.*"):
        opt.step()
    assert same_bits(good.detach(), before[0]) and same_bits(bad.detach(), before[1])
    assert len(opt.state) == 0


def test_lean_modes_refused_where_they_do_not_apply():
    p = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
    with pytest.raises(ValueError, match="master_weights must be None, True, False or one of"):
        ampkit.optim.AdamW([p], master_weights="stochastik")
    with pytest.raises(ValueError, match="LAMB: master_weights must be"):
        ampkit.optim.LAMB([p], master_weights="kahn")


def test_the_op_refuses_mixed_or_malformed_companions_before_writing():
    torch.manual_seed(9)
    p = [torch.randn(8).to(torch.bfloat16) for _ in range(2)]
    g = [torch.randn(8).to(torch.bfloat16) for _ in range(2)]
    m = [torch.zeros(8) for _ in range(2)]
    v = [torch.zeros(8) for _ in range(2)]
    steps = [torch.zeros(()) for _ in range(2)]
    before = [t.clone() for t in p]
    op = torch.ops.ampkit.adamw_step_
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
              decoupled_weight_decay=True)
    with pytest.raises(TypeError, match=r"param_remainders\[1\] must be Long like param_remainders\[0\]"):
        op(p, g, [], [torch.tensor(1), torch.zeros(8, dtype=torch.bfloat16)], m, v, [], steps, **kw)
    with pytest.raises(RuntimeError, match=r"param_remainders\[1\] must be a one-element"):
        op(p, g, [], [torch.tensor(1), torch.tensor([1, 2])], m, v, [], steps, **kw)
    with pytest.raises(TypeError, match=r"param_remainders\[1\] must be BFloat16"):
        op(p, g, [], [torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8)], m, v, [], steps, **kw)
    with pytest.raises(TypeError, match=r"lamb_step_: param_remainders\[0\] must be Short \(remainders\), "
                                        r"BFloat16 \(Kahan compensations\) or Long"):
        torch.ops.ampkit.lamb_step_(p, g, [], [torch.zeros(8, dtype=torch.int32)] * 2, m, v, steps, lr=1e-3,
                                    beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-6)
    assert all(same_bits(a, b) for a, b in zip(p, before))
    assert all(float(s) == 0 for s in steps)


@pytest.mark.parametrize("mode", LEAN)
def test_opcheck_the_fused_steps_with_lean_companions(mode):
    torch.manual_seed(10)
    p = [torch.randn(n).to(torch.bfloat16) for n in (3, 17)]
    g = [torch.randn_like(t) for t in p]
    comp = [torch.zeros_like(t) for t in p] if mode == "kahan" else [torch.tensor(i + 5) for i in range(2)]
    m = [torch.zeros(t.shape) for t in p]
    v = [torch.zeros(t.shape) for t in p]
    steps = [torch.zeros(()) for _ in p]
    torch.library.opcheck(torch.ops.ampkit.adamw_step_.default,
                          (p, g, [], comp, m, v, [], steps),
                          dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
                               maximize=False, decoupled_weight_decay=True))
    torch.library.opcheck(torch.ops.ampkit.sgd_step_.default, (p, g, [], comp, m, steps),
                          dict(lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                               maximize=False))


# ---- CPU against CUDA ---------------------------------------------------------------------------------------------

@CUDA_ONLY
@each_optimizer_in_each_lean_mode
def test_cuda_rounds_every_element_as_the_cpu(cls, kwargs, mode):
    # Sizes that are multiples of 8: no element takes the CPU's scalar-tail formula (NOTE [torch's scalar tail]).
    sizes = (8, 1024, 70_000)
    grads = seeded_bf16_grads(11, sizes, 4)
    cpu, cpu_opt = make_lean(cls, mode, sizes, seed=12, **kwargs)
    assert_cuda_steps_as_cpu(cpu, cpu_opt, lambda ps: cls(ps, lr=1e-2, master_weights=mode, **kwargs), grads)


def assert_cuda_steps_as_cpu(cpu: list, cpu_opt, make_cuda_opt, grads: list) -> None:
    """One CPU step (it creates the state: seeds, compensations, 8-bit blocks), then that state handed to a CUDA
    optimizer through state_dict(); then both step on the same grads: every weight and state entry the same bits."""
    for a, g in zip(cpu, grads[0]):
        a.grad = g.clone()
    cpu_opt.step()
    cuda = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    cuda_opt = make_cuda_opt(cuda)
    cuda_opt.load_state_dict(copy.deepcopy(cpu_opt.state_dict()))
    for gs in grads[1:]:
        for a, b, g in zip(cpu, cuda, gs):
            a.grad, b.grad = g.clone(), g.cuda()
        cpu_opt.step()
        cuda_opt.step()
    assert all(same_bits(a.detach(), b.detach().cpu()) for a, b in zip(cpu, cuda))
    for a, b in zip(cpu, cuda):
        assert cpu_opt.state[a].keys() == cuda_opt.state[b].keys()
        assert all(same_bits(cpu_opt.state[a][k], cuda_opt.state[b][k].cpu()) for k in cpu_opt.state[a])


@pytest.mark.parametrize("mode", LEAN)
def test_init_master_params_gives_lean_groups_no_master(mode):
    # The O2 flow (init_master_params, then the cast) keeps no FP32 copy in a group that keeps none.
    lean = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
    other = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
    opt = ampkit.optim.AdamW([{"params": [lean], "master_weights": mode}, {"params": [other]}], lr=1e-2)
    opt.init_master_params()
    assert "master_param" not in opt.state.get(lean, {})
    assert "master_param" in opt.state[other]
    lean.grad, other.grad = torch.randn(8).to(torch.bfloat16), torch.randn(8).to(torch.bfloat16)
    opt.step()
    assert "master_param" not in opt.state[lean]
    assert ("sr_seed" if mode == "stochastic" else "kahan_comp") in opt.state[lean]


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_decorate_o2_picks_a_lean_mode_per_group(mode):
    """decorate(level="O2") with a lean group casts its weights and gives them no FP32 master (4 bytes per
    parameter no step would read); the other group keeps its master from the FP32 weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    fp32_weight = model[2].weight.detach().clone()
    opt = ampkit.optim.AdamW([{"params": model[0].parameters(), "master_weights": mode},
                              {"params": list(model[1].parameters()) + list(model[2].parameters())}], lr=1e-2)
    model, opt = ampkit.decorate(model, opt, level="O2", dtype=torch.bfloat16)
    assert model[0].weight.dtype == model[2].weight.dtype == torch.bfloat16
    assert "master_param" not in opt.state[model[0].weight]
    assert torch.equal(opt.state[model[2].weight]["master_param"], fp32_weight)
    before = model[0].weight.detach().clone()
    model(torch.randn(8, 16, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    state = opt.state[model[0].weight]
    assert "master_param" not in state and ("sr_seed" if mode == "stochastic" else "kahan_comp") in state
    assert not torch.equal(model[0].weight, before)


# ---- LAMB --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", LEAN)
def test_lamb_writes_each_lean_mode_from_its_fp32_update(mode):
    # An FP32 LAMB run from the same (BF16-valued) weights computes the lean step's FP32 update w_new, norms and
    # trust ratio included (the same formulas and summation order); the lean step must store exactly its mode's
    # rounding of w_new. Each step restarts the reference from the lean weights.
    torch.manual_seed(13)
    sizes = (7, 300, 5000)
    lean = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in sizes]
    ref = [torch.nn.Parameter(p.detach().float()) for p in lean]
    opt = ampkit.optim.LAMB(lean, lr=1e-2, master_weights=mode)
    ref_opt = ampkit.optim.LAMB(ref, lr=1e-2)
    moved = 0
    for _ in range(3):
        for a, b in zip(lean, ref):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.float()
        w0 = [p.detach().float() for p in lean]
        comps = [opt.state[p]["kahan_comp"].float() if p in opt.state and mode == "kahan" else torch.zeros(p.shape)
                 for p in lean]
        opt.step()
        ref_opt.step()
        for a, b, w, c in zip(lean, ref, w0, comps):
            w_new = b.detach()
            got = a.detach()
            if mode == "kahan":
                u = c + (w_new - w)
                expected = (w + u).to(torch.bfloat16)
                assert same_bits(got, expected)
                assert same_bits(opt.state[a]["kahan_comp"], (u - (expected.float() - w)).to(torch.bfloat16))
            else:
                lo, hi = bf16_down_up(w_new.double())
                assert bool(((got.double() == lo) | (got.double() == hi)).all())
            moved += int((got.float() != w).sum())
            with torch.no_grad():
                b.copy_(got.float())
    assert moved > 0
    assert ("sr_seed" in opt.state[lean[0]]) == (mode == "stochastic")
