"""LAMB: torch.ops.ampkit.lamb_step_ and grad_norm against float64 references of Apex FusedLAMB's formulas (every
dtype, master mode and option, clipping, zero norms, several steps), ampkit.optim.LAMB against the same reference
with param groups and a global norm, against torch.optim.AdamW where the trust ratio is 1, the scaler's skip,
state round trips, determinism, bad input that changes nothing, opcheck."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import ampkit
import ampkit.ops as ops
from ampkit.optim import LAMB
from conftest import DEVICES, bits_equal
from reference import lamb_step

SHAPES = [(7,), (33, 5), (65536 + 9,), (0,), (1,), (8, 8)]


def _state(shapes, dtype, master, device, seed):
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(s, generator=gen) for s in shapes]
    params = [w.to(dtype).to(device) for w in ws]
    masters = [w.to(device) for w in ws] if master == "fp32" else []
    # remainder mode: a zero remainder holds the BF16 weight itself as the master
    remainders = [torch.zeros_like(p, dtype=torch.int16) for p in params] if master == "remainder" else []
    ms = [(torch.randn(s, generator=gen) * 0.01).to(device) for s in shapes]
    vs = [(torch.rand(s, generator=gen) * 1e-4).to(device) for s in shapes]
    steps = [torch.tensor(2.0, device=device) for _ in shapes]
    return params, masters, remainders, ms, vs, steps


def _weights(params, masters, remainders):
    if masters:
        return [m.double() for m in masters]
    if remainders:
        return [ampkit.optim.AdamW.master_from_remainder(p, r).double() for p, r in zip(params, remainders)]
    return [p.double() for p in params]


OPTIONS = [
    dict(),
    dict(adam_w_mode=False),
    dict(weight_decay=0.0),
    dict(weight_decay=0.0, use_nvlamb=True),
    dict(bias_correction=False, grad_averaging=False),
    dict(max_grad_norm=1.0),
    dict(max_grad_norm=1e6),  # above the norm: no clipping
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,master", [(torch.float32, "none"), (torch.float16, "fp32"),
                                          (torch.bfloat16, "fp32"), (torch.bfloat16, "remainder"),
                                          (torch.float16, "none"), (torch.bfloat16, "none")])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_op_matches_a_float64_reference(device, dtype, master, opts):
    params, masters, rems, ms, vs, steps = _state(SHAPES, dtype, master, device, seed=len(str(opts)))
    scale = 512.0
    for it in range(3):
        gen = torch.Generator().manual_seed(100 + it)
        grads = [(torch.randn(s, generator=gen) * 0.05 * scale).to(dtype).to(device) for s in SHAPES]
        w0 = _weights(params, masters, rems)
        expect = lamb_step(w0, grads, ms, vs, [float(s) for s in steps], lr=1e-2, scale=scale, **opts)
        grad_scale = torch.tensor(scale, device=device)
        norm = ops.grad_norm(grads, grad_scale) if opts.get("max_grad_norm") else None
        grads_before = [g.clone() for g in grads]
        kw = {k: v for k, v in opts.items() if k != "weight_decay"}
        ops.lamb_step_(params, grads, masters, rems, ms, vs, steps, lr=1e-2, beta1=0.9, beta2=0.999,
                       weight_decay=opts.get("weight_decay", 0.01), eps=1e-6, grad_norm=norm,
                       grad_scale=grad_scale, **kw)
        assert all(bits_equal(g, b) for g, b in zip(grads, grads_before)), "grads are only read"
        got = _weights(params, masters, rems)
        exact = dtype == torch.float32 or master != "none"
        for i, (w, m, v) in enumerate(expect):
            if not w.numel():
                continue
            # FP32 opmath vs float64: a few ulps of the update; a 16-bit weight without master rounds each step.
            tol = 1e-5 if exact else (4e-3 if dtype == torch.float16 else 2e-2)
            assert torch.allclose(got[i].cpu(), w, rtol=tol, atol=tol * 1e-2), (i, (got[i].cpu() - w).abs().max())
            assert torch.allclose(ms[i].double().cpu(), m, rtol=1e-5, atol=1e-8)
            assert torch.allclose(vs[i].double().cpu(), v, rtol=1e-5, atol=1e-10)
            if masters:
                assert bits_equal(params[i], masters[i].to(dtype)), "the weight is the master rounded"
        # the references' moments become the next step's inputs only through the op's own state
        assert all(float(s) == 3.0 + it for s in steps)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_norms_take_ratio_one(device):
    """A zero weight (||w|| = 0) and a zero update (||u|| = 0) both take trust ratio 1, as Apex."""
    w = [torch.zeros(10, device=device), torch.ones(10, device=device)]
    g = [torch.ones(10, device=device), torch.zeros(10, device=device)]
    m = [torch.zeros(10, device=device) for _ in range(2)]
    v = [torch.zeros(10, device=device) for _ in range(2)]
    steps = [torch.tensor(0.0, device=device) for _ in range(2)]
    expect = lamb_step([x.double().cpu() for x in w], [x.cpu() for x in g], [x.cpu() for x in m],
                      [x.cpu() for x in v], [0.0, 0.0], lr=0.1, weight_decay=0.0, use_nvlamb=True)
    ops.lamb_step_(w, g, [], [], m, v, steps, lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-6,
                   use_nvlamb=True)
    assert torch.allclose(w[0].double().cpu(), expect[0][0], rtol=1e-6)
    # first step: u = 1 / (1 + eps) everywhere, ratio 1 (||w|| = 0): w = -lr * u
    assert torch.allclose(w[0].double().cpu(), torch.full((10,), -0.1 / (1 + 1e-6), dtype=torch.float64), rtol=1e-6)
    assert torch.equal(w[1], torch.ones(10, device=device))  # u = 0: unchanged


@pytest.mark.parametrize("device", DEVICES)
def test_grad_norm_matches_float64_and_is_deterministic(device):
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(n, generator=gen) * 10 ** e for n, e in [(65536 * 3 + 5, 0), (9, 3), (0, 0), (4097, -4)]]
    grads = [base[0].half(), base[1].bfloat16(), base[2], base[3]]
    grads.append(torch.randn(64, 32, generator=gen).t())  # non-contiguous
    grads = [g.to(device) for g in grads]
    expect = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    for scale in (1.0, 1024.0):
        got = ops.grad_norm(grads, torch.tensor(scale, device=device))
        assert got.dtype == torch.float32 and got.dim() == 0 and got.device == grads[0].device
        assert abs(float(got) - expect / scale) <= 1e-6 * expect / scale
    assert torch.equal(ops.grad_norm([]), torch.zeros(()))
    if device == "cpu":
        threads = torch.get_num_threads()
        try:
            results = []
            for n in (1, 2):
                torch.set_num_threads(n)
                results.append(ops.grad_norm(grads))
        finally:
            torch.set_num_threads(threads)
        assert bits_equal(results[0], results[1]), "the summation order does not depend on threads"
    # Inf in the last element of the last chunk shows in the norm.
    grads[0][-1] = math.inf
    assert math.isinf(float(ops.grad_norm(grads)))


def _chunk_sums(g: torch.Tensor) -> list[float]:
    """NOTE [Deterministic norm]'s chunk sums, re-derived: element i of a 65536-element chunk in lane i % 512, the
    lanes summing squares in element order in double, a chunk its 512 lanes in lane order from 0.0."""
    x = g.detach().cpu().double().flatten()
    sums = []
    for c in range(0, x.numel(), 65536):
        chunk = x[c:c + 65536]
        rows = torch.nn.functional.pad(chunk, (0, (-chunk.numel()) % 512)).view(-1, 512)
        lanes = torch.zeros(512, dtype=torch.float64)
        for row in rows:
            lanes = lanes + row * row
        s = 0.0
        for lane in lanes.tolist():
            s += lane
        sums.append(s)
    return sums


@pytest.mark.parametrize("threads", [1, 2])
def test_grad_norm_many_chunks_follow_the_documented_order_bit_for_bit(threads):
    """The CPU loop sums the lanes of up to 8 chunks side by side and leaves out lanes no element reached: the FP32
    norm equals NOTE [Deterministic norm]'s order re-derived, bit for bit, on 1 and 2 threads: 300 chunks (more
    than the 256 finish lanes) of tensors under one row, of a row and a bit, of several chunks, in groups of 8 and a
    partial group. (The FP32 result hides most one-ulp differences of the FP64 sums: test_lane_sums.cpp checks the
    sums themselves.)"""
    gen = torch.Generator().manual_seed(7)
    sizes = [1000 + i % 7 for i in range(250)] + [3, 511, 512, 513, 65536 * 2 + 9] + [1] * 41
    grads = [(torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 6, (n,), generator=gen)).to(dtype)
             for n, dtype in zip(sizes, [torch.float32, torch.bfloat16, torch.float16] * 200)]
    grads = [g.clamp(-6e4, 6e4) if g.dtype == torch.float16 else g for g in grads]
    sums = [s for g in grads for s in _chunk_sums(g)]
    assert len(sums) > 256
    finish = [0.0] * 256
    for r, s in enumerate(sums):
        finish[r % 256] += s
    total = 0.0
    for f in finish:
        total += f
    want = torch.tensor(math.sqrt(total), dtype=torch.float64).float()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = ops.grad_norm(grads)
    finally:
        torch.set_num_threads(before)
    assert bits_equal(got, want), (float(got), float(want))


def _model(dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))
    return net.to(device=device, dtype=dtype)


def _groups(net):
    decay = [p for n, p in net.named_parameters() if n.endswith("weight") and p.dim() > 1]
    no_decay = [p for n, p in net.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def _set_grads(net, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    for p in net.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.device, p.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_optimizer_matches_the_reference_with_groups_and_a_global_norm(device, max_grad_norm):
    net = _model(device=device)
    opt = LAMB(_groups(net), lr=1e-2, max_grad_norm=max_grad_norm)
    ref_w = [p.detach().double().cpu().clone() for p in net.parameters()]
    ref_m = [torch.zeros_like(w) for w in ref_w]
    ref_v = [torch.zeros_like(w) for w in ref_w]
    params = list(net.parameters())
    wd_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for it in range(4):
        _set_grads(net, it)
        grads = [p.grad.cpu() for p in params]
        for i, p in enumerate(params):
            (w, m, v), = lamb_step([ref_w[i]], [grads[i]], [ref_m[i]], [ref_v[i]], [float(it)], lr=1e-2,
                                  weight_decay=wd_of[id(p)], max_grad_norm=max_grad_norm, norm_grads=grads)
            ref_w[i], ref_m[i], ref_v[i] = w, m, v
        opt.step()
        for p, w in zip(params, ref_w):
            assert torch.allclose(p.detach().double().cpu(), w, rtol=1e-5, atol=1e-7)
    if max_grad_norm:
        expect = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        assert abs(float(opt.last_grad_norm) - expect) <= 1e-6 * expect
    else:
        assert opt.last_grad_norm is None


@pytest.mark.parametrize("device", DEVICES)
def test_without_trust_ratio_it_is_adamw(device):
    """weight_decay=0 and no clipping: ratio 1, so LAMB is Adam (torch.optim.AdamW, bias-corrected, eps outside the
    square root); FP32 results agree to rounding."""
    net_a, net_b = _model(device=device), _model(device=device)
    lamb = LAMB(net_a.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.0, max_grad_norm=0.0)
    adamw = torch.optim.AdamW(net_b.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.0)
    for it in range(6):
        for net in (net_a, net_b):
            _set_grads(net, it)
        lamb.step()
        adamw.step()
    for a, b in zip(net_a.parameters(), net_b.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(next(net_a.parameters()), next(_model(device=device).parameters()), atol=1e-3)


@pytest.mark.parametrize("scaler_kind", ["ampkit", "torch"])
def test_scaler_skips_on_overflow_and_unscales_inline(scaler_kind):
    net = _model(torch.float16)
    opt = LAMB(net.parameters(), lr=1e-2, master_weights=True)
    scaler = ampkit.GradScaler("cpu", init_scale=256.0) if scaler_kind == "ampkit" else \
        torch.amp.GradScaler("cpu", init_scale=256.0)
    x = torch.randn(8, 12)
    loss = net(x.half()).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    before = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in net.parameters()]
    loss = net(x.half()).float().square().mean()
    scaler.scale(loss).backward()
    next(net.parameters()).grad[-1, -1] = math.inf
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(weights, net.parameters()))
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v, before["state"][pid][k]), k
    assert scaler.get_scale() == 128.0


def test_master_weights_and_state_round_trip():
    """An FP16 model with FP32 masters: a resumed optimizer continues bit for bit."""
    net = _model(torch.float16)
    opt = LAMB(_groups(net), lr=1e-2, master_weights=True)
    for it in range(3):
        _set_grads(net, it)
        opt.step()
    for p in net.parameters():
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and torch.equal(p, master.half())
        assert opt.state[p]["exp_avg"].dtype == torch.float32
    saved_net = copy.deepcopy(net)
    saved = copy.deepcopy(opt.state_dict())
    other_net = copy.deepcopy(saved_net)
    other = LAMB(_groups(other_net), lr=1e-2, master_weights=True)
    other.load_state_dict(saved)
    for it in range(3, 6):
        _set_grads(net, it)
        _set_grads(other_net, it)
        opt.step()
        other.step()
    assert all(bits_equal(a, b) for a, b in zip(net.parameters(), other_net.parameters()))


def test_bad_input_raises_and_changes_nothing():
    params, masters, rems, ms, vs, steps = _state([(5,), (3,)], torch.float16, "fp32", "cpu", 0)
    grads = [torch.ones(5, dtype=torch.float16), torch.ones(3, dtype=torch.float16)]
    snapshot = [t.clone() for t in params + masters + ms + vs + steps]

    def call(**kw):
        args = dict(params=params, grads=grads, master_params=masters, param_remainders=[], exp_avgs=ms,
                    exp_avg_sqs=vs, state_steps=steps)
        args.update({k: v for k, v in kw.items() if k in args})
        hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-6)
        hp.update({k: v for k, v in kw.items() if k not in args})
        ops.lamb_step_(args["params"], args["grads"], args["master_params"], args["param_remainders"],
                       args["exp_avgs"], args["exp_avg_sqs"], args["state_steps"], **hp)

    cases = [
        (dict(grads=grads[:1]), ValueError, "lamb_step_: grads must have 2 tensors"),
        (dict(exp_avgs=[]), ValueError, "exp_avgs must have 2"),
        (dict(beta1=1.0), ValueError, "beta1 must be in"),
        (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm must be a finite number >= 0"),
        (dict(max_grad_norm=math.inf), ValueError, "max_grad_norm"),
        (dict(grad_norm=torch.tensor(1.0, dtype=torch.float64)), TypeError, "grad_norm must be a Float"),
        (dict(grads=[grads[0].bfloat16(), grads[1]]), TypeError,
         r"grads\[0\] must be Half or Float like params\[0\], but got BFloat16"),
        (dict(exp_avg_sqs=[ms[0], vs[1]]), RuntimeError, "share memory"),
        (dict(grad_scale=torch.ones(2)), RuntimeError, "grad_scale must have exactly one element"),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            call(**kw)
        assert all(torch.equal(a, b) for a, b in zip(params + masters + ms + vs + steps, snapshot)), kw
    with pytest.raises(TypeError, match=r"grad_norm: grads\[1\] must be Half, BFloat16 or Float"):
        ops.grad_norm([torch.ones(2), torch.ones(2, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match="grad_scale must have exactly one element"):
        ops.grad_norm([torch.ones(2)], torch.ones(3))


def test_optimizer_refuses_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="does not support the AMSGrad"):
        LAMB([torch.zeros(2, requires_grad=True)], amsgrad=True)
    with pytest.raises(ValueError, match="Invalid max_grad_norm value: -1.0"):
        LAMB([torch.zeros(2, requires_grad=True)], max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        LAMB([torch.zeros(2, requires_grad=True)], betas=(0.9, 1.5))
    with pytest.raises(TypeError, match="LAMB: adam_w_mode must be True or False"):
        LAMB([torch.zeros(2, requires_grad=True)], adam_w_mode="yes")
    p64 = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    p32 = torch.zeros(3, requires_grad=True)
    opt = LAMB([p32, p64])
    p32.grad = torch.ones(3)
    p64.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="LAMB needs FP16, BF16 or FP32 parameters .* Double parameter"):
        opt.step()
    assert torch.equal(p32, torch.zeros(3)) and not opt.state, "a refused step changes nothing"
    assert LAMB([p32], max_grad_norm=None).param_groups[0]["max_grad_norm"] == 0.0


def test_opcheck_and_meta():
    params, masters, rems, ms, vs, steps = _state([(5,), (4, 3)], torch.bfloat16, "fp32", "cpu", 1)
    grads = [torch.randn_like(p) for p in params]
    torch.library.opcheck(torch.ops.ampkit.lamb_step_.default,
                          (params, grads, masters, [], ms, vs, steps),
                          dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-6, max_grad_norm=1.0,
                               grad_norm=torch.tensor(2.0), grad_scale=torch.tensor(4.0)))
    torch.library.opcheck(torch.ops.ampkit.grad_norm.default, (grads, torch.tensor(2.0)))
    meta = [g.to("meta") for g in grads]
    out = torch.ops.ampkit.grad_norm(meta)
    assert out.device.type == "meta" and out.dim() == 0 and out.dtype == torch.float32
