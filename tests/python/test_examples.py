"""The Python examples run end to end, and resume from a scaler checkpoint written by the C++ example."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPP_EXAMPLE = Path(os.environ.get("AMPKIT_BUILD_DIR", ROOT / "build")) / "examples" / "scaler_loop" / "scaler_loop"


def test_python_scaler_loop_runs():
    out = subprocess.run([sys.executable, str(ROOT / "examples/python/scaler_loop.py")], capture_output=True,
                         text=True, check=True).stdout
    assert "step 30 skipped: True, overflow in ['2.bias']" in out
    assert "'skipped_steps': 1" in out


@pytest.mark.skipif(not CPP_EXAMPLE.exists(), reason="the C++ examples are built by scripts/test.sh first")
def test_checkpoint_from_cpp_resumes_in_python(tmp_path):
    ckpt = tmp_path / "scaler.pt"
    subprocess.run([str(CPP_EXAMPLE), str(ckpt)], check=True, capture_output=True)
    import ampkit
    import torch

    state = ampkit.load_scaler_state(ckpt)
    assert state["steps"] == 60 and state["skipped_steps"] == 1 and state["last_overflow_step"] == 30
    t = torch.amp.GradScaler("cpu")
    t.load_state_dict(state)  # torch's scaler takes the C++ state as is
    assert t.get_scale() == state["scale"]
    out = subprocess.run([sys.executable, str(ROOT / "examples/python/scaler_loop.py"), "--checkpoint", str(ckpt)],
                         capture_output=True, text=True, check=True).stdout
    assert f"resumed scaler state from {ckpt}: scale {state['scale']:.0f}" in out


def test_python_o2_loop_runs_and_keeps_rounded_weights():
    out = subprocess.run([sys.executable, str(ROOT / "examples/python/o2_loop.py")], capture_output=True, text=True,
                         check=True).stdout
    assert "masters torch.float32, weight == master rounded: True" in out
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0]


def test_python_train_demo_runs_side_by_side_with_torch_amp():
    pytest.importorskip("sklearn")
    out = subprocess.run([sys.executable, str(ROOT / "examples/python/train_demo.py"), "--epochs", "4"],
                         capture_output=True, text=True, check=True).stdout
    rows = {line.rsplit(None, 4)[0]: line.split() for line in out.splitlines()[1:4]}
    assert set(rows) == {"torch.amp O1", "ampkit O1", "ampkit O2"}
    for fields in rows.values():
        assert float(fields[-3].rstrip("%")) > 90.0  # test accuracy
