"""The moments' dtypes (exp_avg_dtype / exp_avg_sq_dtype, SGD's momentum_dtype): BF16 and 8-bit block-wise states
(NOTE [8-bit block-wise states] in kernels/blockwise8.h). The quantizer against torchao's on the same values; each
step against the same step on FP32 states holding the dequantized values (the weights bit for bit, the new states
the quantization of the FP32 step's moments); every master mode; the skip; bit-identical resumption; torch.optim
checkpoints in and out; memory; CPU against CUDA; bad input."""
from __future__ import annotations

import copy

import pytest
import torch

import ampkit
from ampkit import _C
from conftest import CUDA_ONLY, DEVICES
from loops import run_steps, seeded_bf16_grads
from test_optim_lean import assert_cuda_steps_as_cpu

U8, BF16, F32 = torch.uint8, torch.bfloat16, torch.float32
BLOCK = 256


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def codes_and_absmax(state: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    nb = blocks(n)
    return state[:n], state[nb * BLOCK:].view(torch.float32)


# ---- the quantizer --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [1, 255, 256, 4096, 5000])
def test_the_quantizer_gives_torchaos_codes_and_absmaxes(signed, n):
    quant = pytest.importorskip("torchao.optim.quant_utils")
    sub = pytest.importorskip("torchao.optim.subclass_8bit")
    torch.manual_seed(n)
    x = torch.randn(n) * torch.logspace(-6, 2, n)[torch.randperm(n)]  # magnitudes across the map's range
    if not signed:
        x = x.square()
    x[n // 2] = 0.0
    state = _C._blockwise8_quantize(x, signed)
    assert state.dtype == U8 and state.shape == (blocks(n) * (BLOCK + 4),)
    codes, absmax = codes_and_absmax(state, n)
    qmap = torch.tensor(sub.get_qmap_signed() if signed else sub.get_qmap_unsigned(), dtype=torch.float32)
    padded = torch.zeros(blocks(n) * BLOCK)
    padded[:n] = x  # torchao's blocks are whole: zeros change no absmax
    scaled, scale = quant.scale_tensor(padded, BLOCK)
    expected = quant.quantize_8bit_with_qmap(scaled, qmap)[:n]
    assert torch.equal(absmax, scale)
    assert torch.equal(codes, expected)
    assert bool((state[n:blocks(n) * BLOCK] == 0).all())  # the last block's padding
    # Dequantized: map[code] * absmax, within half a map step of the value.
    back = _C._blockwise8_dequantize(state, signed, x)
    idx = torch.arange(n) // BLOCK
    assert torch.equal(back, qmap[codes.long()] * absmax[idx])
    step = (qmap[1:] - qmap[:-1]).max()
    assert bool(((back - x).abs() <= step * absmax[idx]).all())


@pytest.mark.parametrize("signed", [True, False])
def test_the_quantizer_gives_torchaos_codes_on_every_map_boundary(signed):
    # Blocks whose absmax is 1 (so x / absmax is x, exactly): every map value, every midpoint between neighbours
    # (where the final rounding decides), each with its float neighbours, the ends, and values past them. The
    # vectorized quantizer (NOTE [Quantizer search tree]: permutes, two vectors at a time) must give torchao's codes.
    quant = pytest.importorskip("torchao.optim.quant_utils")
    sub = pytest.importorskip("torchao.optim.subclass_8bit")
    qmap = torch.tensor(sub.get_qmap_signed() if signed else sub.get_qmap_unsigned(), dtype=torch.float32)
    points = torch.cat([qmap, (qmap[:-1] + qmap[1:]) / 2, torch.tensor([0.0, -0.0, 1e-30, 1.0, 0.999])])
    lo = points
    hi = points
    values = [points]
    for _ in range(3):
        lo = torch.nextafter(lo, torch.tensor(-float("inf")))
        hi = torch.nextafter(hi, torch.tensor(float("inf")))
        values += [lo, hi]
    x = torch.cat(values).clamp(-1.0 if signed else 0.0, 1.0)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(3))]
    nb = (x.numel() + BLOCK - 2) // (BLOCK - 1)
    body = torch.zeros(nb * BLOCK)
    body[::BLOCK] = 1.0  # each block's first element: its absmax
    body[(torch.arange(body.numel()) % BLOCK != 0).nonzero().squeeze(1)[:x.numel()]] = x
    state = _C._blockwise8_quantize(body, signed)
    codes, absmax = codes_and_absmax(state, body.numel())
    scaled, scale = quant.scale_tensor(body, BLOCK)
    assert torch.equal(absmax, scale) and bool((absmax == 1.0).all())
    assert torch.equal(codes, quant.quantize_8bit_with_qmap(scaled, qmap))


def test_the_quantizer_keeps_nan_visible_and_clips_a_zero_block():
    x = torch.zeros(512)
    x[300] = float("nan")
    state = _C._blockwise8_quantize(x, True)
    back = _C._blockwise8_dequantize(state, True, x)
    assert bool((back[:256] == 0).all()) and codes_and_absmax(state, 512)[1][0] == torch.tensor(1e-12)
    assert bool(back[256:].isnan().all())


# ---- each step against the FP32-state step ---------------------------------------------------------------------

SIZES = (5, 4096, 5000, 70_001)  # FP32 (small), whole blocks, a partial last block, several CPU work items
CASES = [
    (ampkit.optim.AdamW, dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8)),
    (ampkit.optim.AdamW, dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)),
    (ampkit.optim.AdamW, dict(exp_avg_dtype=U8, exp_avg_sq_dtype=BF16)),
    (ampkit.optim.Adam, dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=U8, weight_decay=0.01, amsgrad=True)),
    (ampkit.optim.SGD, dict(momentum=0.9, momentum_dtype=U8)),
    (ampkit.optim.SGD, dict(momentum=0.9, nesterov=True, momentum_dtype=BF16)),
]
MODES = [(torch.float32, None), (torch.bfloat16, None), (torch.float16, True), (torch.bfloat16, False),
         (torch.bfloat16, "remainder"), (torch.bfloat16, "kahan"), (torch.bfloat16, "stochastic")]
MOMENTS = {"exp_avg": True, "exp_avg_sq": False, "momentum_buffer": True}  # name: signed map


def fp32_options(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if not k.endswith("_dtype")}


def wanted(kwargs: dict, name: str, n: int) -> torch.dtype:
    d = kwargs.get("exp_avg_sq_dtype" if name == "exp_avg_sq" else
                   "momentum_dtype" if name == "momentum_buffer" else "exp_avg_dtype") or F32
    return F32 if d == U8 and n < 4096 else d


@pytest.mark.parametrize("cls,kwargs", CASES)
@pytest.mark.parametrize("dtype,mode", MODES)
def test_a_step_on_lean_states_is_the_fp32_step_on_their_values(cls, kwargs, dtype, mode):
    torch.manual_seed(1)
    weights = [torch.randn(n).to(dtype) for n in SIZES]
    lean = [torch.nn.Parameter(w.clone()) for w in weights]
    ref = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = cls(lean, lr=1e-2, master_weights=mode, **kwargs)
    ref_opt = cls(ref, lr=1e-2, master_weights=mode, **fp32_options(kwargs))
    scale = torch.tensor(64.0)
    for step in range(4):
        grads = [(torch.randn(n) * (1 + step)).to(dtype) for n in SIZES]
        for a, b, g in zip(lean, ref, grads):
            a.grad, b.grad = g.clone(), g.clone()
        for o, ps in ((opt, lean), (ref_opt, ref)):
            if step == 0:
                torch.manual_seed(99)  # the same stochastic rounding seeds for both
            if step == 2:  # one step through the scaler's unscale in registers
                o.grad_scale, o.found_inf = scale, torch.zeros(())
                for p in ps:
                    p.grad.mul_(64)
            o.step()
            o.__dict__.pop("grad_scale", None)
            o.__dict__.pop("found_inf", None)
        for a, b in zip(lean, ref):
            assert same_bits(a.detach(), b.detach()), (step, a.numel())
            sa, sb = opt.state[a], ref_opt.state[b]
            for name, value in sa.items():
                if name not in MOMENTS:
                    assert same_bits(value, sb[name]), name
                    continue
                want = wanted(kwargs, name, a.numel())
                assert value.dtype == want, (name, a.numel())
                if want == U8:
                    assert same_bits(value, _C._blockwise8_quantize(sb[name], MOMENTS[name]))
                    sb[name].copy_(_C._blockwise8_dequantize(value, MOMENTS[name], b))
                else:
                    assert same_bits(value, sb[name].to(want))
                    sb[name].copy_(value)  # the reference continues from the lean state's values


def test_bytes_per_parameter_of_each_state_dtype():
    n = 1 << 16

    def state_bytes(**kwargs) -> float:
        p = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
        opt = ampkit.optim.AdamW([p], master_weights="stochastic", **kwargs)
        p.grad = torch.ones_like(p)
        opt.step()
        return sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k != "step"
                   and k != "sr_seed") / n

    assert state_bytes() == 8.0
    assert state_bytes(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16) == 4.0
    assert state_bytes(exp_avg_dtype=U8, exp_avg_sq_dtype=U8) == 2 * (BLOCK + 4) / BLOCK  # 2.03125


# ---- the skip, resumption, checkpoints --------------------------------------------------------------------------

@pytest.mark.parametrize("cls,kwargs", CASES[:1] + CASES[4:5])
@pytest.mark.parametrize("mode", [None, "stochastic"])
def test_a_skipped_step_writes_nothing(cls, kwargs, mode):
    torch.manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in SIZES]
    opt = cls(params, lr=1e-2, master_weights=mode, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.ones(())
    opt.step()
    assert all(same_bits(p.detach(), b) for p, b in zip(params, before))
    for p, st in zip(params, states):
        assert all(same_bits(opt.state[p][k], v) for k, v in st.items())


@pytest.mark.parametrize("cls,kwargs", CASES)
@pytest.mark.parametrize("mode", [None, "kahan", "stochastic"])
def test_resuming_from_a_state_dict_is_bit_identical(cls, kwargs, mode):
    grads = seeded_bf16_grads(3, SIZES, 6)
    weights = [torch.randn(n).to(torch.bfloat16) for n in SIZES]

    torch.manual_seed(4)
    whole = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = cls(whole, lr=1e-2, master_weights=mode, **kwargs)
    run_steps(whole, opt, grads)
    torch.manual_seed(4)
    first = [torch.nn.Parameter(w.clone()) for w in weights]
    opt1 = cls(first, lr=1e-2, master_weights=mode, **kwargs)
    run_steps(first, opt1, grads[:3])
    saved = copy.deepcopy(opt1.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = cls(resumed, lr=1e-2, master_weights=mode, **kwargs)
    opt2.load_state_dict(saved)
    run_steps(resumed, opt2, grads[3:])
    assert all(same_bits(a.detach(), b.detach()) for a, b in zip(whole, resumed))
    for a, b in zip(whole, resumed):
        sa, sb = opt.state[a], opt2.state[b]
        assert sa.keys() == sb.keys() and all(same_bits(sa[k], sb[k]) for k in sa)


def test_a_torch_checkpoint_loads_into_lean_states_and_lean_states_load_back_into_fp32():
    torch.manual_seed(5)
    sizes = (100, 8192)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    torch_opt = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        torch_opt.step()
    saved = torch_opt.state_dict()
    lean = ampkit.optim.AdamW(params, lr=1e-3, exp_avg_dtype=U8, exp_avg_sq_dtype=BF16)
    lean.load_state_dict(copy.deepcopy(saved))
    assert lean.param_groups[0]["exp_avg_dtype"] == U8  # the option the torch checkpoint lacks is kept
    small, big = (lean.state[p] for p in params)
    ref_small, ref_big = (saved["state"][i] for i in range(2))
    assert small["exp_avg"].dtype == F32 and torch.equal(small["exp_avg"], ref_small["exp_avg"])
    assert same_bits(big["exp_avg"], _C._blockwise8_quantize(ref_big["exp_avg"], True))
    assert same_bits(big["exp_avg_sq"], ref_big["exp_avg_sq"].to(BF16))
    # And back: an ampkit 8-bit checkpoint into FP32 states gets the dequantized values.
    back = ampkit.optim.AdamW(params, lr=1e-3)
    lean_saved = lean.state_dict()
    back.load_state_dict(copy.deepcopy(lean_saved))
    assert back.param_groups[0]["exp_avg_dtype"] == U8  # ampkit's checkpoint carries the option ...
    back.param_groups[0]["exp_avg_dtype"] = None
    back.param_groups[0]["exp_avg_sq_dtype"] = None
    back.load_state_dict({**lean_saved, "param_groups": [
        {k: v for k, v in g.items() if not k.endswith("_dtype")} for g in lean_saved["param_groups"]]})
    st = back.state[params[1]]
    assert st["exp_avg"].dtype == F32 and st["exp_avg"].shape == params[1].shape
    assert torch.equal(st["exp_avg"], _C._blockwise8_dequantize(big["exp_avg"], True, params[1]))
    assert torch.equal(st["exp_avg_sq"], big["exp_avg_sq"].float())


def test_state_dicts_name_the_state_dtypes_and_load_names_or_dtypes():
    """state_dict() writes the state dtype options by name (NOTE [State dtype options in state dicts]), which
    torch.distributed.checkpoint's full state dicts need (a torch.dtype there raised "Unexpected value type <class
    'torch.dtype'>"); load_state_dict takes a name or a torch.dtype and refuses a name of no dtype before anything
    changes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2, exp_avg_dtype=BF16, exp_avg_sq_dtype=U8)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert (sd["param_groups"][0]["exp_avg_dtype"], sd["param_groups"][0]["exp_avg_sq_dtype"]) == ("bfloat16", "uint8")
    assert opt.param_groups[0]["exp_avg_dtype"] is BF16  # the group keeps the dtype
    if torch.distributed.is_available():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        assert full["param_groups"][0]["exp_avg_dtype"] == "bfloat16"
        assert torch.equal(full["state"]["weight"]["exp_avg"], opt.state[model.weight]["exp_avg"])
    # (the name or dtype saved, the group's option after the load, exp_avg's dtype: FP32 under 4096 elements for U8)
    for value, dtype, moment in (("bfloat16", BF16, BF16), ("torch.bfloat16", BF16, BF16), ("uint8", U8, F32),
                                 (BF16, BF16, BF16), (None, None, F32)):
        other = ampkit.optim.AdamW(model.parameters())
        other.load_state_dict({**sd, "param_groups": [dict(sd["param_groups"][0], exp_avg_dtype=value)]})
        assert other.param_groups[0]["exp_avg_dtype"] is dtype and other.param_groups[0]["exp_avg_sq_dtype"] is U8
        assert other.state[model.weight]["exp_avg"].dtype == moment, value
    sgd = ampkit.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, momentum_dtype=BF16)
    sgd.step()
    assert sgd.state_dict()["param_groups"][0]["momentum_dtype"] == "bfloat16"
    options = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    before = {p: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    with pytest.raises(ValueError, match=r"AdamW.load_state_dict: param_groups\[0\]\['exp_avg_sq_dtype'\] must name a "
                                         r"torch.dtype .* but got 'bf16'"):
        opt.load_state_dict({**sd, "param_groups": [dict(sd["param_groups"][0], exp_avg_sq_dtype="bf16")]})
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == options
    assert all(st.keys() == before[p].keys() and all(same_bits(v, before[p][k]) for k, v in st.items())
               for p, st in opt.state.items())


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_bad_state_dtypes_raise_and_change_nothing():
    p = torch.nn.Parameter(torch.randn(8))
    with pytest.raises(ValueError, match=r"AdamW: exp_avg_dtype must be torch.float32, torch.bfloat16 or "
                                         r"torch.uint8 .*torch.float16"):
        ampkit.optim.AdamW([p], exp_avg_dtype=torch.float16)
    with pytest.raises(TypeError, match=r"AdamW: exp_avg_sq_dtype must be a torch.dtype .* str 'bf16'"):
        ampkit.optim.AdamW([p], exp_avg_sq_dtype="bf16")
    with pytest.raises(ValueError, match=r"SGD: momentum_dtype must be .*torch.int32"):
        ampkit.optim.SGD([p], momentum=0.9, momentum_dtype=torch.int32)
    opt = ampkit.optim.AdamW([p], exp_avg_dtype=U8)
    p.grad = torch.randn_like(p)
    opt.param_groups[0]["exp_avg_dtype"] = torch.float64
    before = p.detach().clone()
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        opt.step()
    assert torch.equal(p, before) and not opt.state


def test_lean_states_on_a_sparse_grad_or_fp64_parameter_raise_before_writing():
    emb = torch.nn.Embedding(5000, 2, sparse=True)
    ok = torch.nn.Parameter(torch.randn(4))
    opt = ampkit.optim.SGD([ok, emb.weight], lr=0.1, momentum=0.9, momentum_dtype=U8)
    emb(torch.tensor([1, 2])).sum().backward()
    ok.grad = torch.ones_like(ok)
    before = ok.detach().clone()
    with pytest.raises(ValueError, match=r"SGD: momentum_dtype=torch.uint8 needs .* has a sparse grad"):
        opt.step()
    assert torch.equal(ok, before) and not opt.state
    p64 = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    p64.grad = torch.ones_like(p64)
    with pytest.raises(ValueError, match=r"Adam: exp_avg_sq_dtype=torch.bfloat16 needs .*Double"):
        ampkit.optim.Adam([p64], exp_avg_sq_dtype=BF16).step()


def test_a_loaded_8bit_state_of_the_wrong_size_is_refused_and_changes_nothing():
    p = torch.nn.Parameter(torch.randn(5000))
    opt = ampkit.optim.AdamW([p], exp_avg_dtype=U8, exp_avg_sq_dtype=U8)
    p.grad = torch.randn_like(p)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    before = {k: v.clone() for k, v in opt.state[p].items()}
    bad = copy.deepcopy(saved)
    bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"][:-4]
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] \(an 8-bit block-wise state\) must be a 1-D "
                                         r"Byte tensor of 5200 bytes"):
        opt.load_state_dict(bad)
    assert all(same_bits(opt.state[p][k], v) for k, v in before.items())


def test_the_ops_refuse_malformed_lean_states_before_writing():
    p = [torch.randn(300), torch.randn(5000)]
    g = [torch.randn_like(t) for t in p]
    steps = [torch.zeros(()) for _ in p]
    m = [torch.zeros(300), torch.zeros(5199, dtype=U8)]
    v = [torch.zeros(300), torch.zeros(5200, dtype=U8)]
    before = [t.clone() for t in p]
    with pytest.raises(ValueError, match=r"adamw_step_: exp_avgs\[1\] \(an 8-bit block-wise state of params\[1\], "
                                         r"5000 elements\) must be a contiguous 1-D Byte tensor of 5200 bytes"):
        torch.ops.ampkit.adamw_step_(p, g, [], [], m, v, [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
                                     weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                                     decoupled_weight_decay=True)
    with pytest.raises(TypeError, match=r"adamw_step_: exp_avg_sqs\[0\] must be Float, BFloat16 or Byte"):
        torch.ops.ampkit.adamw_step_(p, g, [], [], [torch.zeros(300), torch.zeros(5200, dtype=U8)],
                                     [torch.zeros(300, dtype=torch.int32), v[1]], [], steps, lr=1e-3, beta1=0.9,
                                     beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                                     decoupled_weight_decay=True)
    with pytest.raises(TypeError, match=r"lamb_step_: exp_avgs\[0\] must be Float, but got BFloat16"):
        torch.ops.ampkit.lamb_step_(p, g, [], [], [t.to(BF16) for t in p], [torch.zeros_like(t) for t in p], steps,
                                    lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(p, before)) and all(float(s) == 0 for s in steps)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_an_8bit_state_off_a_4_byte_boundary_is_refused_before_writing(device, offset):
    # The absmaxes are read as floats: a byte view off a 4-byte boundary faults on a GPU, so every device refuses it
    # (the Meta kernel by the view's storage offset).
    torch.manual_seed(5)
    n, nbytes = 5000, 5200
    p = [torch.randn(300, device=device), torch.randn(5000, device=device)]
    g = [torch.randn_like(t) for t in p]
    steps = [torch.zeros((), device=device) for _ in p]
    state = _C._blockwise8_quantize(torch.randn(n), True).to(device)
    buf = torch.zeros(nbytes + offset, dtype=U8, device=device)
    buf[offset:].copy_(state)
    shifted = buf[offset:]
    assert shifted.is_contiguous() and shifted.numel() == nbytes
    aligned = [torch.zeros(300, device=device), _C._blockwise8_quantize(torch.rand(n), False).to(device)]
    snapshot = [t.clone() for t in p + g + steps + aligned + [buf]]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
              decoupled_weight_decay=True)
    with pytest.raises(ValueError, match=rf"adamw_step_: exp_avgs\[1\] \(an 8-bit block-wise state\) must have a "
                                         rf"4-byte aligned data pointer .* but its data pointer mod 4 is {offset}"):
        torch.ops.ampkit.adamw_step_(p, g, [], [], [torch.zeros(300, device=device), shifted], aligned, [], steps,
                                     **kw)
    with pytest.raises(ValueError, match=rf"adamw_step_: exp_avg_sqs\[1\] .* data pointer mod 4 is {offset}"):
        torch.ops.ampkit.adamw_step_(p, g, [], [], aligned, [torch.zeros(300, device=device), shifted], [], steps,
                                     **kw)
    with pytest.raises(ValueError, match=rf"sgd_step_: momentum_buffers\[1\] .* data pointer mod 4 is {offset}"):
        torch.ops.ampkit.sgd_step_(p, g, [], [], [torch.zeros(300, device=device), shifted], steps, lr=0.1,
                                   momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
    if device != "meta":
        after = p + g + steps + aligned + [buf]
        assert all(same_bits(a, b) for a, b in zip(after, snapshot))
    # The same bytes at an aligned address step.
    torch.ops.ampkit.adamw_step_(p, g, [], [], [torch.zeros(300, device=device), shifted.clone()], aligned, [],
                                 steps, **kw)


def test_opcheck_the_fused_steps_with_lean_states():
    torch.manual_seed(6)
    p = [torch.randn(n).to(torch.bfloat16) for n in (3, 4100)]
    g = [torch.randn_like(t) for t in p]
    m = [torch.zeros(3, dtype=BF16), torch.zeros(_C._blockwise8_quantize(torch.zeros(4100), True).numel(), dtype=U8)]
    v = [torch.zeros(3), torch.zeros(4100, dtype=BF16)]
    steps = [torch.zeros(()) for _ in p]
    torch.library.opcheck(torch.ops.ampkit.adamw_step_.default, (p, g, [], [], m, v, [], steps),
                          dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
                               maximize=False, decoupled_weight_decay=True))
    torch.library.opcheck(torch.ops.ampkit.make_optim_state.default, (p[1], ["exp_avg", "exp_avg_sq"]),
                          dict(exp_avg_dtype=U8, exp_avg_sq_dtype=BF16))


def test_a_compiled_step_creates_and_updates_the_same_lean_states():
    torch.manual_seed(7)
    weights = [torch.randn(n).to(torch.bfloat16) for n in (5, 5000)]
    eager = [torch.nn.Parameter(w.clone()) for w in weights]
    compiled = [torch.nn.Parameter(w.clone()) for w in weights]
    kwargs = dict(lr=1e-2, master_weights="kahan", exp_avg_dtype=U8, exp_avg_sq_dtype=BF16)
    opt_e = ampkit.optim.AdamW(eager, **kwargs)
    opt_c = ampkit.optim.AdamW(compiled, **kwargs)
    step = torch.compile(opt_c.step, backend="aot_eager", fullgraph=True)
    for _ in range(3):
        for a, b in zip(eager, compiled):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_e.step()
        step()
    assert all(same_bits(a.detach(), b.detach()) for a, b in zip(eager, compiled))
    for a, b in zip(eager, compiled):
        assert all(same_bits(opt_e.state[a][k], opt_c.state[b][k]) for k in opt_e.state[a])


# ---- CPU against CUDA ---------------------------------------------------------------------------------------------

@CUDA_ONLY
@pytest.mark.parametrize("cls,kwargs", CASES)
@pytest.mark.parametrize("mode", [None, "remainder", "kahan", "stochastic"])
def test_cuda_steps_lean_states_as_the_cpu(cls, kwargs, mode):
    sizes = (8, 4096, 5008, 70_000)  # multiples of 8: no element takes the CPU's scalar-tail formula
    grads = seeded_bf16_grads(8, sizes, 4)
    cpu = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in sizes]
    cpu_opt = cls(cpu, lr=1e-2, master_weights=mode, **kwargs)
    assert_cuda_steps_as_cpu(cpu, cpu_opt, lambda ps: cls(ps, lr=1e-2, master_weights=mode, **kwargs), grads)


# ---- the plain BF16 guard -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,kwargs", [(ampkit.optim.AdamW, {}), (ampkit.optim.SGD, dict(momentum=0.9))])
def test_plain_bf16_warns_once_where_lr_cannot_move_the_weights(cls, kwargs, recwarn):
    # |w| in [1, 2): half a BF16 unit in the last place is 2^-8. Adam's first update is lr per element; SGD's lr*|g|.
    p = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    opt = cls([p], lr=1e-3, master_weights=False, **kwargs)
    p.grad = torch.ones_like(p)
    with pytest.warns(UserWarning, match=rf"{cls.__name__}: master_weights=False keeps BF16 weights without a "
                                         r"master, and an update of lr 0.001 leaves 100% of the nonzero weights of "
                                         r"the group holding the BFloat16 parameter of shape \[1000\] where they are"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones_like(p))  # the stagnation it warns of
    recwarn.clear()
    opt.step()  # once: the states exist now
    assert not [w for w in recwarn if "BF16 weights without a master" in str(w.message)]
    # An lr that moves the weights, or a master mode, does not warn.
    for lr, mode in ((1e-1, False), (1e-3, None), (1e-3, "stochastic")):
        q = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
        q.grad = torch.ones_like(q)
        cls([q], lr=lr, master_weights=mode, **kwargs).step()
    assert not [w for w in recwarn if "BF16 weights without a master" in str(w.message)]
