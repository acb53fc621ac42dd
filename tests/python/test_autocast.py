"""ampkit.autocast against torch.autocast (no overrides: same dtypes and values), per-scope overrides (FP32 and low
precision, overloads, nesting, exceptions, two threads), register_autocast for a Python-defined custom op, op_stats,
and decorate's O-levels training a model with LayerNorm and BatchNorm."""
from __future__ import annotations

import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import ampkit
from conftest import CUDA_ONLY, bits_equal

DT = torch.bfloat16


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return dict(a=r(8, 16), b=r(16, 12), c=r(4, 8, 16), d=r(4, 16, 5), w=r(12, 16), bias=r(12), img=r(2, 3, 10, 10),
                k=r(4, 3, 3, 3), v=r(8, 12), t=torch.randint(0, 12, (8,), generator=g), ln_w=r(16), ln_b=r(16))


OPS = {
    "mm": lambda x: torch.mm(x["a"], x["b"]),
    "matmul": lambda x: x["a"] @ x["b"],
    "bmm": lambda x: torch.bmm(x["c"], x["d"]),
    "addmm": lambda x: torch.addmm(x["bias"], x["a"], x["b"]),
    "baddbmm": lambda x: torch.baddbmm(torch.bmm(x["c"], x["d"]), x["c"], x["d"]),
    "linear": lambda x: F.linear(x["a"], x["w"], x["bias"]),
    "conv2d": lambda x: F.conv2d(x["img"], x["k"]),
    "softmax": lambda x: torch.softmax(x["v"], -1),
    "log_softmax": lambda x: F.log_softmax(x["v"], -1),
    "layer_norm": lambda x: F.layer_norm(x["a"], (16,), x["ln_w"], x["ln_b"]),
    "group_norm": lambda x: F.group_norm(x["img"], 3),
    "cross_entropy": lambda x: F.cross_entropy(x["v"], x["t"]),
    "mse_loss": lambda x: F.mse_loss(x["v"], x["v"] * 0.5),
    "sum": lambda x: x["v"].sum(),
    "mean": lambda x: x["v"].mean(1),
    "cat": lambda x: torch.cat([torch.mm(x["a"], x["b"]), x["v"]]),
    "stack": lambda x: torch.stack([torch.mm(x["a"], x["b"]), x["v"]]),
    "relu": lambda x: torch.relu(torch.mm(x["a"], x["b"])),
}


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("input_dtype", [torch.float32, DT])
def test_no_override_matches_torch_autocast(name, input_dtype):
    x = _inputs(input_dtype)
    with torch.autocast("cpu", dtype=DT):
        expected = OPS[name](x)
    with ampkit.autocast("cpu", dtype=DT):
        got = OPS[name](x)
    assert got.dtype == expected.dtype
    assert bits_equal(got, expected)


def test_installed_override_kernels_leave_torch_behaviour_unchanged_outside_overrides():
    """In a fresh process: every op's torch.autocast result before and after ampkit installs its override kernels
    (on every op of the set) must be bit-identical, with FP32 and BF16 inputs."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("autocast_parity_check.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checked 36 results" in done.stdout


def test_torch_compile_traces_ops_that_carry_override_kernels():
    # Ops whose autocast kernel ampkit installed (for an override) still trace under torch.compile, where the
    # kernel is reached with a key set whose highest key is not the autocast key.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    with ampkit.autocast("cpu", dtype=torch.bfloat16, fp32_ops=["linear"]):
        assert model(x).dtype == torch.float32
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, model(x))


def test_forced_fp32_and_forced_low_precision():
    x = _inputs()
    with ampkit.autocast("cpu", dtype=DT, fp32_ops=["linear", "aten::mm"], lowp_ops=["sum"]):
        out = OPS["linear"](x)
        assert out.dtype == torch.float32
        assert bits_equal(out, OPS["linear"](x).float())  # really computed in FP32
        assert torch.mm(x["a"], x["b"]).dtype == torch.float32
        assert x["v"].sum().dtype == DT  # sum is FP32 by default
        assert torch.bmm(x["c"], x["d"]).dtype == DT  # untouched ops keep torch's behaviour
    assert F.linear(x["a"], x["w"]).dtype == torch.float32  # outside autocast


def test_all_overloads_of_a_name():
    a, b = torch.randn(4), torch.randn(4)
    with ampkit.autocast("cpu", dtype=DT, lowp_ops=["add"]):
        assert (a + b).dtype == DT  # add.Tensor
        assert torch.add(a, 1.5).dtype == DT  # add.Scalar


def test_nested_scopes_inner_wins_and_outer_returns():
    x = _inputs()
    with ampkit.autocast("cpu", dtype=DT, fp32_ops=["linear"]):
        assert OPS["linear"](x).dtype == torch.float32
        with ampkit.autocast("cpu", dtype=DT, lowp_ops=["linear"]):
            assert OPS["linear"](x).dtype == DT
        assert OPS["linear"](x).dtype == torch.float32
    with ampkit.autocast("cpu", dtype=DT):
        assert OPS["linear"](x).dtype == DT


def test_exception_inside_the_scope_restores_everything():
    x = _inputs()
    with pytest.raises(ZeroDivisionError):
        with ampkit.autocast("cpu", dtype=DT, fp32_ops=["linear"]):
            1 / 0
    assert not torch.is_autocast_enabled("cpu")
    with ampkit.autocast("cpu", dtype=DT):
        assert OPS["linear"](x).dtype == DT  # the fp32 override is gone
    with pytest.raises(ValueError, match="no operator named 'aten::not_an_op'"):
        with ampkit.autocast("cpu", dtype=DT, fp32_ops=["not_an_op"]):
            pass
    assert not torch.is_autocast_enabled("cpu")


def test_decorator_form():
    @ampkit.autocast("cpu", dtype=DT, fp32_ops=["linear"])
    def f(x):
        return OPS["linear"](x), OPS["mm"](x)

    lin, mm = f(_inputs())
    assert lin.dtype == torch.float32 and mm.dtype == DT


def test_two_threads_each_see_only_their_own_overrides():
    x = _inputs()
    barrier = threading.Barrier(2)
    results = {}

    def worker(name, kwargs):
        with ampkit.autocast("cpu", dtype=DT, **kwargs):
            barrier.wait()
            outs = [OPS["linear"](x).dtype for _ in range(50)]
            barrier.wait()
        results[name] = set(outs)

    t1 = threading.Thread(target=worker, args=("fp32", dict(fp32_ops=["linear"])))
    t2 = threading.Thread(target=worker, args=("plain", {}))
    t1.start(), t2.start()
    t1.join(), t2.join()
    assert results == {"fp32": {torch.float32}, "plain": {DT}}


# A Python-defined custom op that reports the dtype it ran in.
@torch.library.custom_op("ampkit_test::scale_by_two", mutates_args=())
def scale_by_two(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * 2 + y.to(x.dtype)


@scale_by_two.register_fake
def _(x, y):
    return torch.empty_like(x)


@torch.library.custom_op("ampkit_test::plain", mutates_args=())
def plain_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@plain_op.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("policy,expected", [("lowp", DT), ("fp32", torch.float32), ("promote", torch.float32)])
def test_register_autocast_for_a_custom_op(policy, expected):
    ampkit.register_autocast("ampkit_test::scale_by_two", "cpu", policy)
    x32, y16 = torch.randn(4), torch.randn(4).to(DT)
    with torch.autocast("cpu", dtype=DT):
        out = torch.ops.ampkit_test.scale_by_two(x32, y16)
    assert out.dtype == expected
    assert torch.ops.ampkit_test.scale_by_two(x32, y16).dtype == torch.float32  # no autocast: no cast
    with ampkit.autocast("cpu", dtype=DT, fp32_ops=["ampkit_test::scale_by_two"]):
        assert torch.ops.ampkit_test.scale_by_two(y16, y16).dtype == torch.float32  # scope beats the policy


def test_override_a_custom_op_without_a_policy():
    x = torch.randn(4, dtype=DT)
    with ampkit.autocast("cpu", dtype=DT, fp32_ops=["ampkit_test::plain"]):
        assert torch.ops.ampkit_test.plain(x).dtype == torch.float32
    with ampkit.autocast("cpu", dtype=DT):
        assert torch.ops.ampkit_test.plain(x).dtype == DT  # falls through, as before
    with pytest.raises(ValueError, match="policy must be"):
        ampkit.register_autocast("ampkit_test::plain", "cpu", "fast")


def test_op_stats_answer_is_my_model_running_in_low_precision():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with ampkit.op_stats() as stats:
        with ampkit.autocast("cpu", dtype=DT, fp32_ops=["linear"]):
            model(x)
        with ampkit.autocast("cpu", dtype=DT):
            model(x)
    assert stats.counts[("aten::linear", "Float")] == 2
    assert stats.counts[("aten::linear", "BFloat16")] == 2
    assert "aten::linear" in stats.summary()


def test_op_stats_on_integer_ops_tensor_lists_and_boolean_outputs():
    # In a process of its own: reading an op's inputs after it ended crashed the interpreter (GPT-2's forward
    # runs `torch.arange(n) + 0`).
    code = (
        "import torch, ampkit\n"
        "with ampkit.op_stats() as s:\n"
        "    torch.arange(8) + 0\n"
        "    torch.randn(6).split(2)\n"
        "    torch.randn(4, dtype=torch.bfloat16).chunk(2)\n"
        "    torch.randn(4, dtype=torch.float16) > 0\n"
        "for (op, dt), n in sorted(s.counts.items()):\n"
        "    print(op, dt, n)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {tuple(line.split()[:2]): int(line.split()[2]) for line in r.stdout.splitlines()}
    assert rows[("aten::add", "other")] == 1  # integer in, integer out
    assert rows[("aten::split", "Float")] == 1  # a tensor list out
    assert rows[("aten::chunk", "BFloat16")] == 1
    assert rows[("aten::gt", "Half")] == 1  # a boolean output: the input's dtype, read at the op's start


def test_op_stats_counts_forward_ops_unless_backward_is_asked_for():
    model = torch.nn.Linear(16, 4)
    x = torch.randn(8, 16)
    counts = {}
    for backward in (False, True):
        with ampkit.op_stats(backward=backward) as stats:
            with ampkit.autocast("cpu", dtype=DT):
                loss = model(x).float().sum()
            loss.backward()
        counts[backward] = stats.counts
    forward = {op for op, _ in counts[False]}
    assert "aten::linear" in forward and "aten::sum" in forward
    assert not any("Backward" in op or op.startswith("autograd::") for op in forward)
    assert ("aten::mm", "BFloat16") not in counts[False]  # the backward's matmuls are left out
    assert ("aten::mm", "BFloat16") in counts[True]  # the grad of the BF16 linear
    assert all(counts[True].get(key, 0) >= n for key, n in counts[False].items())
    assert sum(counts[True].values()) > sum(counts[False].values())
    with pytest.raises(TypeError, match="ampkit.op_stats: backward must be True or False"):
        ampkit.op_stats(backward="yes")


def _o2_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1))


def test_decorate_o2_trains_with_norms_in_fp32_and_fp32_masters():
    model = _o2_model()
    fp32_weight = model[0].weight.detach().clone()
    opt = ampkit.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = ampkit.decorate(model, opt, level="O2", dtype=DT)
    assert model[0].weight.dtype == DT and model[3].weight.dtype == DT
    assert model[1].weight.dtype == torch.float32 and model[1].running_mean.dtype == torch.float32
    assert model[4].weight.dtype == torch.float32
    assert bits_equal(opt.state[model[0].weight]["master_param"], fp32_weight)  # not the rounded copy
    scaler = ampkit.GradScaler("cpu", scaling=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    y = x[:, :3].sum(1, keepdim=True)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        out = model(x.to(DT))
        assert out.dtype == DT
        loss = F.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 4
    assert bits_equal(model[0].weight.detach(), opt.state[model[0].weight]["master_param"].to(DT))


def test_decorate_o2_casts_a_tied_parameter_once_and_keeps_its_fp32_master():
    """A decoder sharing the embedding's weight: one FP32 master from the FP32 weight, no 'already rounded'
    warning."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(11, 6)
    head = torch.nn.Linear(6, 11)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, torch.nn.Flatten(0), head)
    fp32_weight = emb.weight.detach().clone()
    opt = ampkit.optim.LAMB(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ampkit.decorate(model, opt, level="O2", dtype=DT)
    assert head.weight is emb.weight and emb.weight.dtype == DT
    assert bits_equal(opt.state[emb.weight]["master_param"], fp32_weight)


def test_decorate_levels_and_bad_arguments():
    model = _o2_model()
    assert ampkit.decorate(model, level="O1") is model and model[0].weight.dtype == torch.float32
    ampkit.decorate(model, level="O3", dtype=DT, excluded=["4"])
    assert model[1].weight.dtype == DT and model[4].weight.dtype == torch.float32
    with pytest.raises(ValueError, match="level must be one of"):
        ampkit.decorate(_o2_model(), level="O4")
    with pytest.raises(TypeError, match="pass an ampkit.optim optimizer"):
        m = _o2_model()
        ampkit.decorate(m, torch.optim.AdamW(m.parameters()), level="O2")
    assert set(ampkit.LEVELS) == {"O0", "O1", "O2", "O3"}


@CUDA_ONLY
def test_cuda_overrides_and_parity():
    a, b = torch.randn(32, 32, device="cuda"), torch.randn(32, 32, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        expected = torch.mm(a, b)
    with ampkit.autocast("cuda", dtype=torch.float16, fp32_ops=["mm"], lowp_ops=["sum"]):
        assert torch.mm(a, b).dtype == torch.float32
        assert a.sum().dtype == torch.float16
        assert torch.softmax(a, -1).dtype == torch.float32  # torch's CUDA fp32 list, untouched
    with ampkit.autocast("cuda", dtype=torch.float16):
        got = torch.mm(a, b)
    assert got.dtype == torch.float16 and bits_equal(got, expected)


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_precision_support_on_the_cpu_takes_units_and_a_measured_probe():
    flags = _cpu_flags()
    info = ampkit.precision_support("cpu")
    assert info["fp16"] and info["bf16"] and info["lowp_dtype"] == torch.bfloat16
    ms = info["measured_ms"]
    assert set(ms) == {"float32", "bfloat16", "float16"}
    assert all(t[op] > 0 for t in ms.values() for op in ("conv2d", "linear"))

    def slow(dtype):  # an op 3 times or more slower than in the fastest dtype for it
        return max(ms[dtype][op] / min(t[op] for t in ms.values()) for op in ("conv2d", "linear")) >= 3

    if flags:
        assert info["bf16_fast"] == (bool({"avx512_bf16", "amx_bf16"} & flags) and not slow("bfloat16"))
        assert info["fp16_fast"] == (bool({"avx512_fp16", "amx_fp16"} & flags) and not slow("float16"))
        assert ("no BF16 units" in info["reason"]) == (not {"avx512_bf16", "amx_bf16"} & flags)
    assert info["fast"] == info["bf16_fast"]
    assert info["recommended"] == (torch.bfloat16 if info["fast"] else torch.float32)
    assert ampkit.precision_support("cpu")["measured_ms"] == ms  # measured once per process
    with pytest.raises(ValueError, match="precision_support: device must be a CPU or CUDA device, but got 'tpu'"):
        ampkit.precision_support("tpu")


def test_the_cpu_probe_runs_none_of_the_callers_autograd_hooks():
    """The probe times its own autograd on a thread of its own: a caller's saved-tensor hooks (a non-reentrant
    checkpoint's) never see its tensors, and FP16 autocast entered inside a checkpoint recomputes alike."""
    hooks = _run_fresh(  # the process's first precision_support, under saved-tensor hooks
        "packed = []\n"
        "with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):\n"
        "    ampkit.precision_support('cpu')\n"
        "print(len(packed))\n")
    assert hooks.stdout.splitlines()[0] == "0"
    checkpointed = _run_fresh(  # the process's first probe, from FP16 autocast inside a non-reentrant checkpoint
        "from torch.utils.checkpoint import checkpoint\n"
        "lin = torch.nn.Linear(8, 8)\n"
        "def block(x):\n"
        "    with ampkit.autocast('cpu', dtype=torch.float16):\n"
        "        return lin(x).float().tanh()\n"
        "x = torch.randn(4, 8, requires_grad=True)\n"
        "checkpoint(block, x, use_reentrant=False).sum().backward()\n"
        "print(x.grad.shape)\n")
    assert checkpointed.stdout.splitlines()[0] == "torch.Size([4, 8])"


def test_fp16_is_not_called_fast_where_torchs_own_fp16_convolution_is_slow():
    """Timed here with torch alone: where FP16 conv2d forward and backward is 10 times or more slower than BF16 (a
    CPU with AVX512-FP16 but no fast FP16 convolution kernel in torch), precision_support must not call FP16 fast,
    whatever the instruction flags say, and FP16 autocast must be advised against."""
    import time

    def best(dtype):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 16, 16, 16, generator=g).to(dtype).requires_grad_()
        w = torch.randn(16, 16, 3, 3, generator=g).to(dtype).requires_grad_()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            torch.nn.functional.conv2d(x, w, padding=1).sum().backward()
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    ratio = best(torch.float16) / best(torch.bfloat16)
    info = ampkit.precision_support("cpu")
    advice = ampkit._C.autocast_dtype_advice("cpu", True)
    if ratio >= 10:
        assert not info["fp16_fast"], (ratio, info["measured_ms"])
        assert "conv2d forward and backward runs" in advice and "slower in FP16 than in BF16" in advice, advice
    elif ratio < 1.5:
        assert "conv2d" not in advice
    else:
        pytest.skip(f"FP16 conv2d runs {ratio:.1f}x BF16's time here: between the clear cases")


def test_decorate_without_a_dtype_warns_once_where_low_precision_is_not_faster():
    import sys

    sys.modules["ampkit.autocast"]._warned_slow.discard("cpu")  # (ampkit.autocast the name is the class)
    fast = ampkit.precision_support("cpu")["fast"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ampkit.decorate(torch.nn.Linear(4, 4), level="O2")
        ampkit.decorate(torch.nn.Linear(4, 4), level="O2")
    slow = [w for w in seen if "does not speed up arithmetic" in str(w.message)]
    assert len(slow) == (0 if fast else 1)


def _run_fresh(code: str) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter (the warnings below are said once per process)."""
    r = subprocess.run([sys.executable, "-W", "always", "-c", "import torch, ampkit\n" + code],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


# The start of a fresh process's code that counts binary_cross_entropy's warnings: caught(fn) returns fn()'s result
# and the messages of the warnings it gave that name binary_cross_entropy.
_BCE_WARNINGS = (
    "import warnings, torch.nn.functional as F\n"
    "def caught(fn):\n"
    "    with warnings.catch_warnings(record=True) as w:\n"
    "        warnings.simplefilter('always')\n"
    "        out = fn()\n"
    "    return out, [str(m.message) for m in w if 'binary_cross_entropy' in str(m.message)]\n"
)


def test_binary_cross_entropy_on_low_precision_probabilities_under_cpu_autocast_warns_once_and_keeps_torchs_result():
    r = _run_fresh(
        _BCE_WARNINGS +
        "g = torch.Generator().manual_seed(0)\n"
        "x, y = torch.randn(64, 8, generator=g) * 6, torch.rand(64, 8, generator=g)\n"
        "lin = torch.nn.Linear(8, 8)\n"
        "p32 = torch.sigmoid(x)\n"
        "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "    out32, w32 = caught(lambda: F.binary_cross_entropy(p32, y))\n"  # FP32 probabilities: nothing to say
        "    plow = torch.sigmoid(lin(x))\n"
        "    outlow, wlow = caught(lambda: F.binary_cross_entropy(plow, y))\n"
        "    _, again = caught(lambda: F.binary_cross_entropy(plow, y))\n"
        "_, outside = caught(lambda: F.binary_cross_entropy(plow.float(), y))\n"
        "print(plow.dtype, out32.dtype, outlow.dtype, len(w32), len(wlow), len(again), len(outside))\n"
        "print(torch.equal(outlow, F.binary_cross_entropy(plow.float(), y)))\n"
        "print(wlow[0])\n")
    lines = r.stdout.splitlines()
    assert lines[0] == "torch.bfloat16 torch.float32 torch.float32 0 1 0 0"  # once, on the low-precision input
    assert lines[1] == "True"  # torch's own result: ATen's kernel, FP32
    assert "binary_cross_entropy_with_logits" in lines[2] and "CPU autocast" in lines[2]


def test_binary_cross_entropy_on_a_low_precision_sigmoid_cast_back_warns_once_and_keeps_torchs_result():
    """The O2 form: an FP16/BF16 model's sigmoid, .float(), then binary_cross_entropy outside autocast."""
    r = _run_fresh(
        _BCE_WARNINGS +
        "g = torch.Generator().manual_seed(0)\n"
        "x, y = torch.randn(256, 8, generator=g) * 6, torch.rand(256, 8, generator=g)\n"
        "lin = torch.nn.Linear(8, 8)\n"
        "p32 = torch.sigmoid(lin(x))\n"
        "_, w32 = caught(lambda: F.binary_cross_entropy(p32, y))\n"  # FP32 all along: nothing to say
        "lin16 = torch.nn.Linear(8, 8).half()\n"
        "lin16.load_state_dict(lin.state_dict())\n"
        "p16 = torch.sigmoid(lin16(x.half())).float()\n"
        "out16, w16 = caught(lambda: F.binary_cross_entropy(p16, y))\n"
        "_, again = caught(lambda: F.binary_cross_entropy(p16, y))\n"
        "pbf = torch.sigmoid(lin(x).bfloat16()).float()\n"  # the sigmoid in BF16, cast back: the same mistake
        "_, wbf = caught(lambda: F.binary_cross_entropy(pbf, y))\n"
        "_, nograd = caught(lambda: F.binary_cross_entropy(p16.detach(), y))\n"
        "out16.backward()\n"
        "ref = -(y.double() * p16.detach().double().log().clamp(min=-100)"
        " + (1 - y.double()) * (1 - p16.detach().double()).log().clamp(min=-100)).mean()\n"
        "print(len(w32), len(w16), len(again), len(wbf), len(nograd))\n"
        "print(abs(out16.item() - ref.item()) < 1e-5 * abs(ref.item()), lin16.weight.grad is not None)\n"
        "print(w16[0])\n")
    lines = r.stdout.splitlines()
    assert lines[0] == "0 1 0 0 0"  # once per process, on the cast-back low-precision sigmoid only
    assert lines[1] == "True True"  # torch's own loss and gradients
    assert "sigmoid cast to FP32 afterwards" in lines[2] and "binary_cross_entropy_with_logits" in lines[2]


def test_fp16_autocast_on_the_cpu_warns_once_exactly_where_the_probe_finds_fp16_slow():
    r = _run_fresh(
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(2):\n"
        "        with ampkit.autocast('cpu', dtype=torch.float16):\n"
        "            pass\n"
        "    with ampkit.autocast('cpu', dtype=torch.bfloat16):\n"
        "        pass\n"
        "said = [str(m.message) for m in w if 'FP16 autocast on this CPU' in str(m.message)]\n"
        "ms = ampkit.precision_support('cpu')['measured_ms']\n"
        "slow = max(ms['float16'][op] / ms['bfloat16'][op] for op in ('conv2d', 'linear')) >= 3\n"
        "print(slow, len(said))\n"
        "print(ampkit._C.autocast_dtype_advice('cpu', False) == '')\n")
    slow, said = r.stdout.splitlines()[0].split()
    assert said == ("1" if slow == "True" else "0")
    assert r.stdout.splitlines()[1] == "True"  # BF16 on the CPU: nothing to say


def test_register_autocast_on_an_aten_op_says_it_is_process_wide():
    with pytest.warns(UserWarning, match="changes plain torch.autocast"):
        ampkit.register_autocast("aten::relu", "cpu", "fp32")
    ampkit.register_autocast("aten::relu", "cpu", "promote")  # relu: no cast, as ATen


def test_decorate_owns_only_the_optimizers_parameters_validates_excluded_and_runs_once():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    opt = ampkit.optim.AdamW(model[2].parameters())  # a subset of the model
    with pytest.raises(ValueError, match="excluded names 'nope'"):
        ampkit.decorate(model, opt, excluded=["nope"])
    with pytest.raises(TypeError, match="excluded takes module names"):
        ampkit.decorate(model, opt, excluded=[42])
    assert model[0].weight.dtype == torch.float32 and len(opt.state) == 0  # the failed calls changed nothing
    ampkit.decorate(model, opt, level="O2")
    assert model[0].weight.dtype == torch.bfloat16  # CPU: BF16 when no dtype is given
    assert set(opt.state) == set(model[2].parameters())
    opt.state_dict()  # no state for parameters the optimizer does not own
    with pytest.raises(RuntimeError, match="already decorated"):
        ampkit.decorate(model, opt)


def test_decorate_warns_when_masters_would_copy_rounded_weights():
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt = ampkit.optim.AdamW(model.parameters())
    with pytest.warns(UserWarning, match="copies of rounded weights"):
        ampkit.decorate(model, opt)
