"""The Python examples run end to end, and resume from a scaler checkpoint written by the C++ example."""
from __future__ import annotations

import os
import re
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
    import torch

    import ampkit

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
    rows = {line.rsplit(None, 4)[0]: line.split() for line in out.splitlines()[1:6]}
    assert set(rows) == {"torch.amp O1", "ampkit O1", "ampkit O2", "ampkit O2 FP8", "ampkit O2 8-bit"}
    for fields in rows.values():
        assert float(fields[-3].rstrip("%")) > 90.0  # test accuracy


def test_python_ddp_example_trains_on_two_gloo_ranks():
    out = subprocess.run([sys.executable, str(ROOT / "examples/python/ddp_train.py"), "--steps", "30"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    finals = re.findall(r"rank (\d): first loss ([\d.]+), last loss ([\d.]+), skipped (\d+) of 30 steps, weight "
                        r"checksum ([\d.e+-]+)", out.stdout)
    assert sorted(f[0] for f in finals) == ["0", "1"], out.stdout
    assert finals[0][4] == finals[1][4]  # every rank holds the same weights
    for _, first, last, skipped, _ in finals:
        assert float(last) < 0.7 * float(first) and skipped == "0"


def test_cpp_ddp_demo_trains_as_two_processes(tmp_path):
    exe = CPP_EXAMPLE.parent.parent / "ddp_demo" / "ddp_demo"
    store = tmp_path / "store"
    procs = [subprocess.Popen([str(exe), str(store), str(rank), "2", "--steps", "30"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr
    finals = [re.search(r"first loss ([\d.]+), last loss ([\d.]+), skipped (\d+) of 30 steps, sent (\d+) bytes in "
                        r"(\d+) all-reduces, weight checksum ([\d.e+-]+)", stdout).groups() for stdout, _ in outs]
    assert finals[0][5] == finals[1][5]  # the ranks hold the same weights
    numel = 64 * 256 + 256 + 2 * 256 + 256 * 256 + 256 + 2 * 256 + 256 * 10 + 10
    for first, last, skipped, sent, _, _ in finals:
        assert float(last) < 0.7 * float(first) and skipped == "0"
        assert int(sent) == 30 * numel * 2  # FP16 on the wire


def test_python_bert_lamb_learns_masked_tokens_with_warmup():
    out = subprocess.run([sys.executable, str(ROOT / "examples/python/bert_lamb.py"), "--steps", "60", "--batch", "32"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    steps = [re.fullmatch(r"step (\d+) loss ([\d.]+) masked-acc ([\d.]+) lr ([\d.e+-]+) scale ([\d.e+]+)", line)
             for line in out.stdout.splitlines() if line.startswith("step ")]
    assert steps and all(steps), out.stdout
    lrs = [float(m.group(4)) for m in steps]
    peak = lrs.index(max(lrs))
    assert 0 < peak < len(lrs) // 2 and lrs[0] < 0.1 * lrs[peak]  # warm-up from 5% of the peak...
    assert all(a > b for a, b in zip(lrs[peak:], lrs[peak + 1:])) and lrs[-1] < 0.1 * lrs[peak]  # ...then decay
    assert all(float(m.group(5)) > 0 for m in steps)
    assert re.search(r"^weights torch\.(bfloat16|float16), masters torch\.float32, LayerNorm torch\.float32$",
                     out.stdout, re.M), out.stdout
    final = re.search(r"first loss ([\d.]+), last loss ([\d.]+), held-out loss ([\d.]+), held-out masked-acc "
                      r"([\d.]+) \(unigram baseline ([\d.]+)\), LAMB last_grad_norm ([\d.e+-]+|inf|nan)", out.stdout)
    assert final, out.stdout
    first, last, held_loss, acc, unigram, grad_norm = (float(g) for g in final.groups())
    # The first loss is about ln(103) = 4.6 or more (uniform guesses over the vocabulary); 60 steps take it to ~2.1.
    assert last < 0.6 * first and held_loss < 0.6 * first
    # Chance is 1/100 and always answering the most frequent word scores `unigram` (a few percent); recognising
    # a sentence's topic alone gives ~25%, which 60 steps reach (~0.27 on the held-out batch).
    assert acc > max(0.15, 3 * unigram)
    assert 0 < grad_norm < float("inf")


def _fields(line: str) -> dict:
    return dict(item.split("=", 1) for item in line.split())


@pytest.mark.parametrize("script,args", [
    ("lightning_train.py", ["--precision", "16-mixed", "--steps", "12", "--device", "cpu"]),
    ("lightning_train.py", ["--precision", "bf16-true", "--steps", "8", "--device", "cpu"]),
    ("accelerate_train.py", ["--mixed-precision", "bf16", "--steps", "10", "--cpu"]),
    ("hf_trainer_gpt2.py", ["--steps", "6"]),
])
def test_framework_examples_hold_the_schedule_on_skipped_steps(script, args):
    pytest.importorskip({"lightning_train.py": "lightning", "accelerate_train.py": "accelerate",
                         "hf_trainer_gpt2.py": "transformers"}[script])
    out = subprocess.run([sys.executable, str(ROOT / "examples/python" / script), *args], capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert out.returncode == 0, out.stderr[-3000:]
    fields = _fields(out.stdout.strip().splitlines()[-1])
    steps, skipped = int(fields["steps"]), int(fields["skipped"])
    assert int(fields["schedule_steps"]) == steps - skipped
    if script != "hf_trainer_gpt2.py":  # these two poison one step: it must be skipped, and nothing else NaN
        assert skipped >= 1
        assert fields["final_loss"] != "nan"
