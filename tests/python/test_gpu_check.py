"""The GPU check's plan, checked where there is no GPU: `pytest -m cuda` (what scripts/gpu_check.sh runs on the
device) selects exactly the tests that need a device, the suite collects on a host that lacks the optional
test dependencies the GPU host lacks (expecttest, tensorboard), the steps run in their order, and the bench
streams its rows and runs without the comparison libraries."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests" / "python"


def _pytest(args, cwd, extra_path=()):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _blocked_modules(tmp_path: Path) -> Path:
    """A path entry that makes `import expecttest` and `import tensorboard` fail as on a host without them."""
    blocked = tmp_path / "blocked"
    (blocked / "tensorboard").mkdir(parents=True)
    for init in (blocked / "expecttest.py", blocked / "tensorboard" / "__init__.py"):
        name = "expecttest" if init.name == "expecttest.py" else "tensorboard"
        init.write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    return blocked


def test_the_suite_collects_without_expecttest_and_tensorboard(tmp_path):
    r = _pytest(["--collect-only", "-q", "-m", "cuda", str(TESTS)], cwd=ROOT, extra_path=[_blocked_modules(tmp_path)])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    lines = r.stdout.splitlines()
    assert not any(line.startswith("ERROR") for line in lines) and "error" not in lines[-1], out[-4000:]
    selected = [line for line in r.stdout.splitlines() if "::" in line]
    # The device-only module is selected whole; CPU tests are not.
    assert any(line.startswith("tests/python/test_cuda_paths.py::") for line in selected), out[-4000:]
    assert not any(line.startswith("tests/python/test_optim.py::") for line in selected), out[-4000:]
    assert not any("[cpu" in line for line in selected), out[-4000:]


def test_cuda_marker_selects_device_only_tests_and_cuda_parametrizations(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest, torch\n"
        "from conftest import CUDA_ONLY\n"
        "@pytest.mark.parametrize('device', ['cpu', 'cuda'])\n"
        "def test_param(device):\n    pass\n"
        "@pytest.mark.parametrize('device', [torch.device('cuda', 0), torch.device('cpu')])\n"
        "def test_torch_device(device):\n    pass\n"
        "@CUDA_ONLY\n"
        "def test_device_only():\n    pass\n"
        "@pytest.mark.skipif(True, reason='something else')\n"
        "def test_other_skip():\n    pass\n"
        "def test_plain():\n    pass\n")
    r = _pytest(["-p", "conftest", "--collect-only", "-q", "-m", "cuda", "test_sample.py"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    selected = sorted(line.split("::")[1] for line in r.stdout.splitlines() if "::" in line)
    assert selected == ["test_device_only", "test_param[cuda]", "test_torch_device[device0]"], r.stdout


def test_gpu_check_refuses_to_run_without_a_device_unless_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--bogus"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr
    syntax = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    import torch

    if not torch.cuda.is_available():
        r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and "--dry-run" in r.stderr, r.stdout + r.stderr


def test_gpu_check_plan_order_and_the_device_build():
    """build, ctest's cuda label, pytest, the bench, then the demos; the build forces the CUDA kernels on and fails
    unless ampkit reports them compiled; pytest runs each test under a timeout, on xdist's workers when there;
    the bench runs quick, without the compile, streaming its rows."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    steps = [line.split('"')[1].split()[0] for line in script.splitlines() if line.lstrip().startswith('step "')]
    order = list(dict.fromkeys(steps))  # ctest appears twice (dry run, device)
    assert order == ["build", "ctest", "pytest", "bench", "demo"], order
    assert "-DAMPKIT_WITH_CUDA=ON" in script and "info['cuda_compiled']" in script
    assert "-p timeout --timeout=90" in script and "-n \"${PYTEST_WORKERS:-4}\"" in script
    assert "--durations=25" in script
    assert "--quick --no-compile --jsonl" in script


def _bench_run():
    spec = importlib.util.spec_from_file_location("ampkit_bench_run", ROOT / "bench" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_streams_each_row_as_a_json_line_and_needs_no_other_library(monkeypatch):
    """Each row is written and flushed the moment it is built (a bench stopped at its timeout keeps its rows); the
    BF16 and 8-bit moment rows and the fp8_quantize rows run for ampkit alone without torchao or torch-optimi."""
    run = _bench_run()
    for name in ("torchao", "torchao.optim", "optimi"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    stream = io.StringIO()
    monkeypatch.setattr(run, "ROW_STREAM", stream)
    rows = run.bench_fp8_quantize("cpu", True, 1, 1.0)
    assert [json.loads(line)["dtype"] for line in stream.getvalue().splitlines()] == ["bf16>e4m3", "bf16>e4m3+T"]
    rows += run.bench_lean_optimizers("cpu", True, 1, 1.0)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["name"] for line in lines] == [r.name for r in rows]
    assert {"adamw_stochastic_bf16m", "adamw_stochastic_8bit", "adamw_kahan_bf16m"} <= {r.name for r in rows}
    assert all(r.ampkit_ms > 0 for r in rows)
    assert "not installed" in next(r.note for r in rows if r.name == "adamw_stochastic_8bit")
