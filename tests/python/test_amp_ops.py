"""torch.ops.ampkit unscale_and_check_ / check_finite_ / update_scale_: differential tests against torch's own
AMP ops on many random inputs, a float64 reference, poisoned flags, bad input that must change nothing, and
torch.library.opcheck on every op."""
from __future__ import annotations

import math
import os
import random

import pytest
import torch

import ampkit
from ampkit import _native
from conftest import CUDA_ONLY, DEVICES, bits_equal
from reference import reference_unscale

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# Around the CPU vector widths (8/16/32 elements), the CPU work-item size (32768) and the CUDA chunk (65536).
SIZES = [0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 32767, 32768, 32769, 65535, 65536, 65537, 131073]


def torch_accepts(dtype: torch.dtype, device: str) -> bool:
    """Whether torch's own unscale kernel takes this dtype here (2.11's CUDA kernel refuses BF16: #127176)."""
    g = [torch.ones(4, dtype=dtype, device=device)]
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(
            g, torch.zeros(1, device=device), torch.ones(1, device=device))
        return True
    except RuntimeError:
        return False


def random_grads(rng: random.Random, device: str, n_tensors: int, mixed: bool = True) -> list[torch.Tensor]:
    """Random grads of random dtypes, sizes and layouts; values never all zero."""
    grads = []
    base_dtype = rng.choice(DTYPES)
    for _ in range(n_tensors):
        dtype = rng.choice(DTYPES) if mixed else base_dtype
        n = rng.choice(SIZES)
        scale = 10.0 ** rng.uniform(-3, 4)
        layout = rng.choice(["contiguous", "contiguous", "transposed", "strided", "offset"])
        if layout == "transposed" and n >= 4:
            rows = max(1, n // 4)
            g = (torch.randn(4, rows, dtype=torch.float64) * scale).to(device, dtype).t()
        elif layout == "strided":
            g = (torch.randn(2 * n + 1, dtype=torch.float64) * scale).to(device, dtype)[::2]
        elif layout == "offset":
            g = (torch.randn(n + 1, dtype=torch.float64) * scale).to(device, dtype)[1:]
        else:
            g = (torch.randn(n, dtype=torch.float64) * scale).to(device, dtype)
        grads.append(g)
    return grads


def inject_non_finite(rng: random.Random, grads: list[torch.Tensor]) -> None:
    """Writes Inf, -Inf or NaN into the last element of the last tensor, the first of the first, or anywhere."""
    nonempty = [g for g in grads if g.numel() > 0]
    if not nonempty:
        return
    value = rng.choice([math.inf, -math.inf, math.nan])
    where = rng.choice(["last of last", "first", "random"])
    if where == "last of last":
        g, flat_index = nonempty[-1], nonempty[-1].numel() - 1
    elif where == "first":
        g, flat_index = nonempty[0], 0
    else:
        g = rng.choice(nonempty)
        flat_index = rng.randrange(g.numel())
    g[torch.unravel_index(torch.tensor(flat_index), g.shape)] = value


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(60))
def test_unscale_matches_torch_on_random_lists(device, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    grads = random_grads(rng, device, rng.randint(1, 12), mixed=rng.random() < 0.7)
    if rng.random() < 0.5:
        inject_non_finite(rng, grads)
    inv = rng.choice([1.0, 1.0 / 65536, 1.0 / 3, 0.5, 4.0])
    ours = [g.clone() for g in grads]
    found = torch.zeros(1, device=device)
    ampkit.unscale_and_check_(ours, found, torch.full((1,), inv, device=device))

    expect_found = any((~torch.isfinite(g)).any().item() for g in grads if g.numel())
    assert found.item() == (1.0 if expect_found else 0.0)
    for g, o in zip(grads, ours):
        assert bits_equal(o.cpu(), reference_unscale(g.cpu(), inv)), (g.dtype, g.shape, g.stride())

    # The oracle: torch's own kernel, one dtype group at a time where it accepts the dtype.
    for dtype in {g.dtype for g in grads}:
        if not torch_accepts(dtype, device):
            continue
        group = [i for i, g in enumerate(grads) if g.dtype == dtype]
        theirs = [grads[i].clone() for i in group]
        found_t = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_t, torch.full((1,), inv, device=device))
        found_o = torch.zeros(1, device=device)
        mine = [grads[i].clone() for i in group]
        ampkit.unscale_and_check_(mine, found_o, torch.full((1,), inv, device=device))
        assert found_o.item() == found_t.item()
        for a, b in zip(mine, theirs):
            assert bits_equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES[1:])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_in_last_element_of_last_chunk(device, dtype, n, value):
    torch.manual_seed(n)
    grads = [torch.randn(1000, device=device, dtype=dtype), torch.randn(n, device=device, dtype=dtype)]
    grads[-1][-1] = value
    found = torch.zeros(1, device=device)
    ampkit.unscale_and_check_(grads, found, torch.full((1,), 0.5, device=device))
    assert found.item() == 1.0
    found = torch.zeros(1, device=device)
    ampkit.check_finite_(grads, found)
    assert found.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_poisoned_found_inf_is_only_ever_set_to_one(device):
    grads = [torch.randn(5000, device=device, dtype=torch.float16)]
    found = torch.full((1,), 0.25, device=device)  # poison: a value no kernel writes
    ampkit.unscale_and_check_(grads, found, torch.full((1,), 0.5, device=device))
    assert found.item() == 0.25  # finite grads: found_inf untouched
    ampkit.check_finite_(grads, found)
    assert found.item() == 0.25
    grads[0][-1] = math.nan
    ampkit.check_finite_(grads, found)
    assert found.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_inv_scale_one_is_a_pure_check(device):
    g = torch.randn(70000, device=device, dtype=torch.bfloat16)
    g[5] = -0.0
    before = g.clone()
    found = torch.zeros(1, device=device)
    ampkit.unscale_and_check_([g], found, torch.ones(1, device=device))
    assert bits_equal(g, before)
    assert found.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_max_overflowing_after_scaling_matches_torch(device):
    g = torch.tensor([65504.0, -65504.0, 6e-8, -0.0, 1.0], dtype=torch.float16, device=device)
    ours, theirs = g.clone(), g.clone()
    f0, f1 = torch.zeros(1, device=device), torch.zeros(1, device=device)
    ampkit.unscale_and_check_([ours], f0, torch.full((1,), 2.0, device=device))
    torch._amp_foreach_non_finite_check_and_unscale_([theirs], f1, torch.full((1,), 2.0, device=device))
    assert bits_equal(ours, theirs)
    assert f0.item() == f1.item() == 0.0  # the check reads the input, which was finite
    assert math.isinf(ours[0].item())


@pytest.mark.parametrize("device", DEVICES)
def test_check_finite_never_writes(device):
    torch.manual_seed(0)
    ts = [torch.randn(100003, device=device, dtype=d) for d in DTYPES] + [
        torch.randn(64, 64, device=device).t()[::2]]
    before = [t.clone() for t in ts]
    found = torch.zeros(1, device=device)
    ampkit.check_finite_(ts, found)
    assert found.item() == 0.0
    for a, b in zip(ts, before):
        assert bits_equal(a, b)


def test_many_tensors_and_empty_list():
    torch.manual_seed(1)
    grads = [torch.randn(1 + i % 97, dtype=DTYPES[i % 4]) for i in range(3000)]
    ours = [g.clone() for g in grads]
    found = torch.zeros(1)
    ampkit.unscale_and_check_(ours, found, torch.full((1,), 0.125))
    assert found.item() == 0.0
    for g, o in zip(grads, ours):
        assert bits_equal(o, reference_unscale(g, 0.125))
    found = torch.zeros(1)
    ampkit.unscale_and_check_([], found, torch.full((1,), 0.125))
    assert found.item() == 0.0


@CUDA_ONLY
def test_cuda_bf16_and_mixed_dtypes_in_one_call():
    torch.manual_seed(2)
    grads = [torch.randn(100000, device="cuda", dtype=d) * 100 for d in DTYPES]
    ours = [g.clone() for g in grads]
    found = torch.zeros(1, device="cuda")
    ampkit.unscale_and_check_(ours, found, torch.full((1,), 1 / 1024, device="cuda"))
    cpu = [g.cpu() for g in grads]
    found_cpu = torch.zeros(1)
    ampkit.unscale_and_check_(cpu, found_cpu, torch.full((1,), 1 / 1024))
    for a, b in zip(ours, cpu):
        assert bits_equal(a.cpu(), b)


# ---- bad input ----------------------------------------------------------------------------------------------

def _state(*ts):
    return [t.clone() for t in ts]


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda g: ([g[0], g[1]], torch.zeros(1, dtype=torch.float64), torch.ones(1)), "found_inf must be a Float"),
        (lambda g: ([g[0], g[1]], torch.zeros(2), torch.ones(1)), "found_inf must have exactly one element"),
        (lambda g: ([g[0], g[1]], torch.zeros(1), torch.ones(1, dtype=torch.float16)), "inv_scale must be a Float"),
        (lambda g: ([g[0], g[1], torch.ones(3, dtype=torch.int64)], torch.zeros(1), torch.ones(1)),
         r"grads\[2\] must be Half, BFloat16, Float or Double"),
        (lambda g: ([g[0], g[1], torch.eye(3).to_sparse()], torch.zeros(1), torch.ones(1)),
         r"grads\[2\] must be a strided"),
        (lambda g: ([g[0], g[1], torch.ones(1).expand(5)], torch.zeros(1), torch.ones(1)),
         r"grads\[2\] is written in place"),
    ],
)
def test_unscale_bad_input_raises_and_changes_nothing(make_args, message):
    g = [torch.randn(100), torch.randn(50, dtype=torch.float16)]
    before = _state(*g)
    grads, found, inv = make_args(g)
    found_before = found.clone()
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        ampkit.unscale_and_check_(grads, found, inv)
    for a, b in zip(g, before):
        assert bits_equal(a, b)
    assert bits_equal(found, found_before)


@CUDA_ONLY
def test_unscale_mixed_devices_raise_and_change_nothing():
    g = [torch.randn(100, device="cuda"), torch.randn(100)]
    before = _state(*g)
    found = torch.zeros(1, device="cuda")
    with pytest.raises(RuntimeError, match=r"grads\[1\] must be on cuda:0"):
        ampkit.unscale_and_check_(g, found, torch.ones(1, device="cuda"))
    with pytest.raises(RuntimeError, match=r"inv_scale must be on the device of found_inf \(cuda:0\)"):
        ampkit.unscale_and_check_(g[:1], found, torch.ones(1))
    assert all(bits_equal(a.cpu(), b.cpu()) for a, b in zip(g, before))
    assert found.item() == 0.0


# ---- update_scale_ ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interval,growth,backoff", [(1, 2.0, 0.5), (3, 2.0, 0.5), (7, 1.5, 0.25), (2000, 2.0, 0.5)])
def test_update_scale_step_for_step_like_torch(device, interval, growth, backoff):
    torch.manual_seed(interval)
    scale = torch.full((1,), 2.0**16, device=device)
    tracker = torch.zeros(1, dtype=torch.int32, device=device)
    t_scale, t_tracker = scale.clone(), tracker.clone()
    overflow = torch.rand(2500) < 0.05
    for o in overflow.tolist():
        found = torch.full((1,), float(o), device=device)
        assert ampkit.update_scale_(scale, tracker, found, growth, backoff, interval) is None
        torch._amp_update_scale_(t_scale, t_tracker, found, growth, backoff, interval)
        assert scale.item() == t_scale.item() and tracker.item() == t_tracker.item()


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_never_grows_past_fp32_max(device):
    scale = torch.full((1,), 2.0**127, device=device)
    tracker = torch.zeros(1, dtype=torch.int32, device=device)
    ampkit.update_scale_(scale, tracker, torch.zeros(1, device=device), 2.0, 0.5, 1)
    assert scale.item() == 2.0**127 and tracker.item() == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tracker=torch.zeros(1, dtype=torch.int64)), "growth_tracker must be a Int"),
        (dict(scale=torch.ones(1, dtype=torch.float64)), "scale must be a Float"),
        (dict(interval=0), "growth_interval must be in"),
        (dict(growth=float("nan")), "growth_factor must be a finite number > 0"),
        (dict(backoff=-0.5), "backoff_factor must be a finite number > 0"),
    ],
)
def test_update_scale_bad_input_raises_and_changes_nothing(kwargs, message):
    scale = kwargs.get("scale", torch.full((1,), 1024.0))
    tracker = kwargs.get("tracker", torch.full((1,), 5, dtype=torch.int32))
    before = _state(scale, tracker)
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        ampkit.update_scale_(scale, tracker, torch.zeros(1), kwargs.get("growth", 2.0), kwargs.get("backoff", 0.5),
                             kwargs.get("interval", 10))
    assert bits_equal(scale, before[0]) and bits_equal(tracker, before[1])


# ---- dispatcher integration -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_op(device):
    torch.manual_seed(3)
    grads = [torch.randn(40, device=device, dtype=torch.float16), torch.randn(3, 5, device=device)]
    found = torch.zeros(1, device=device)
    inv = torch.full((1,), 0.5, device=device)
    torch.library.opcheck(torch.ops.ampkit.unscale_and_check_.default, (grads, found, inv))
    torch.library.opcheck(torch.ops.ampkit.check_finite_.default, (grads, found))
    scale = torch.full((1,), 1024.0, device=device)
    tracker = torch.zeros(1, dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.ampkit.update_scale_.default, (scale, tracker, found, 2.0, 0.5, 3))


def test_meta_kernels_trace_with_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        g = [torch.empty(10, dtype=torch.bfloat16)]
        ampkit.unscale_and_check_(g, torch.zeros(1), torch.ones(1))
        with pytest.raises((RuntimeError, TypeError), match="found_inf must be a Float"):
            ampkit.unscale_and_check_(g, torch.zeros(1, dtype=torch.float16), torch.ones(1))


def test_build_info_and_cmake_prefix_path():
    info = ampkit.build_info()
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert info["cpu_isa"] in ("avx512", "avx2", "default")
    assert os.path.isfile(os.path.join(ampkit.cmake_prefix_path, "lib", "cmake", "ampkit", "ampkitConfig.cmake"))
    assert os.path.isfile(os.path.join(ampkit.cmake_prefix_path, "include", "ampkit", "ampkit.h"))


def _adamw(params, grads, masters, exp_avgs, exp_avg_sqs, steps, **kw):
    torch.ops.ampkit.adamw_step_(params, grads, masters, [], exp_avgs, exp_avg_sqs, [], steps, lr=1e-3, beta1=0.9,
                                 beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                                 decoupled_weight_decay=True, **kw)


def test_ops_refuse_aliased_outputs_and_change_nothing():
    p = torch.randn(8)
    g = torch.randn(8)
    m, v, m2, v2 = (torch.zeros(8) for _ in range(4))
    s, s2 = torch.zeros(1), torch.zeros(1)
    before = p.clone()
    with pytest.raises(RuntimeError, match=r"adamw_step_: params\[0\] and params\[1\] share memory"):
        _adamw([p, p], [g, g.clone()], [], [m, m2], [v, v2], [s, s2])
    with pytest.raises(RuntimeError, match=r"adamw_step_: grads\[0\] and grads\[1\] share memory"):
        _adamw([p, p.clone()], [g, g], [], [m, m2], [v, v2], [s, s2])  # grads are stored back unscaled
    with pytest.raises(RuntimeError, match="share memory"):  # a moment aliasing another one
        _adamw([p], [g], [], [m], [m], [s])
    half = torch.randn(8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="share memory"):  # a master aliasing a moment
        torch.ops.ampkit.adamw_step_([half], [half.clone()], [m], [], [m], [v], [], [s], lr=1e-3, beta1=0.9,
                                     beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
                                     decoupled_weight_decay=True)
    assert torch.equal(p, before) and torch.equal(m, torch.zeros(8)) and s.item() == 0.0
    buf = torch.randn(10)
    keep = buf.clone()
    with pytest.raises(RuntimeError, match=r"grads\[0\] and grads\[1\] share memory"):
        torch.ops.ampkit.unscale_and_check_([buf[:6], buf[4:]], torch.zeros(1), torch.full((1,), 0.5))
    assert torch.equal(buf, keep)
    both = torch.tensor([0.0, 0.5])
    with pytest.raises(RuntimeError, match="found_inf and inv_scale share memory|inv_scale and found_inf share"):
        torch.ops.ampkit.unscale_and_check_([torch.randn(4)], both[:1], both[:1])


def test_interleaved_views_of_one_buffer_are_distinct_tensors():
    buf = torch.randn(4, 6)
    ref = buf.clone()
    found = torch.zeros(1)
    torch.ops.ampkit.unscale_and_check_([buf[:, ::2], buf[:, 1::2]], found, torch.full((1,), 0.5))
    assert torch.equal(buf, ref * 0.5) and found.item() == 0.0


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make,what", [
    (lambda: torch.eye(3).to_sparse_csr(), "layout SparseCsr"),
    (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), "a quantized tensor"),
    (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), "a nested tensor"),
])
def test_non_strided_layouts_get_an_error_that_names_the_argument(make, what):
    good = torch.randn(2)
    keep = good.clone()
    with pytest.raises(RuntimeError, match=rf"ampkit::unscale_and_check_: grads\[1\] must be a strided .*{what}"):
        torch.ops.ampkit.unscale_and_check_([good, make()], torch.zeros(1), torch.full((1,), 0.5))
    assert torch.equal(good, keep)


def test_import_refuses_a_torch_other_than_the_one_ampkit_was_built_for():
    assert _native.BUILT_TORCH.split("+")[0] == torch.__version__.split("+")[0]
    with pytest.raises(ImportError, match=r"built against torch 2\.13\.0, but torch 2\.11\.0\+cu130 is running"):
        _native.check_torch_version("2.11.0+cu130", "2.13.0")
    _native.check_torch_version("2.13.0+cu130", "2.13.0")  # local build tags do not matter


def test_ampkit_ops_update_scale_matches_torch_and_goes_through_torch_ops():
    # ampkit.ops.update_scale_ is torch.ops.ampkit.update_scale_: the same bits as torch._amp_update_scale_ over a
    # random overflow sequence, the schema's errors naming the argument, the kernel's own checks, and tensor
    # subclasses / torch function modes / torch.compile reaching the op.
    gen = torch.Generator().manual_seed(5)
    ours, theirs = torch.full((1,), 2.0 ** 16), torch.full((1,), 2.0 ** 16)
    ours_t, theirs_t = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    for _ in range(200):
        found = (torch.rand(1, generator=gen) < 0.15).float()
        ampkit.ops.update_scale_(ours, ours_t, found, 2.0, 0.5, 5)
        torch._amp_update_scale_(theirs, theirs_t, found, 2.0, 0.5, 5)
        assert bits_equal(ours, theirs) and torch.equal(ours_t, theirs_t)
    found = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"update_scale_\(\) Expected a value of type 'Tensor' for argument "
                                           r"'found_inf' but instead found type 'str'"):
        ampkit.ops.update_scale_(ours, ours_t, "0", 2.0, 0.5, 5)
    with pytest.raises(RuntimeError, match=r"Expected a value of type 'float' for argument 'backoff_factor'"):
        ampkit.ops.update_scale_(ours, ours_t, found, 2.0, None, 5)
    before = ours.clone()
    with pytest.raises(TypeError, match=r"ampkit::update_scale_: growth_tracker must be a Int tensor"):
        ampkit.ops.update_scale_(ours, ours_t.float(), found, 2.0, 0.5, 5)
    assert bits_equal(ours, before)

    class Sub(torch.Tensor):
        pass

    sub = torch.full((1,), 8.0).as_subclass(Sub)
    ampkit.ops.update_scale_(sub, torch.zeros(1, dtype=torch.int32), torch.ones(1), 2.0, 0.5, 5)
    assert type(sub) is Sub and sub.item() == 4.0

    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Mode():
        ampkit.ops.update_scale_(ours, ours_t, found, 2.0, 0.5, 5)
    assert "ampkit.update_scale_" in seen

    scale, tracker = torch.full((1,), 4.0), torch.zeros(1, dtype=torch.int32)
    compiled = torch.compile(lambda s, t, f: ampkit.ops.update_scale_(s, t, f, 2.0, 0.5, 1), fullgraph=True,
                             backend="eager")
    compiled(scale, tracker, torch.zeros(1))
    assert scale.item() == 8.0
