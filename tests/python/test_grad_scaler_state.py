"""ampkit.GradScaler's state: state_dict swaps with torch.amp.GradScaler, malformed or mismatched states refused with
nothing changed, pickling, and checkpoint files in the C++ format moving to and from torch's scaler."""
from __future__ import annotations

import math
import pickle

import pytest
import torch

import ampkit
from test_grad_scaler import SCALERS, run


@pytest.mark.parametrize("direction", ["torch_to_ampkit", "ampkit_to_torch"])
def test_state_dict_swap_continues_identically(direction):
    src_kind, dst_kind = ("torch", "ampkit") if direction == "torch_to_ampkit" else ("ampkit", "torch")
    _, _, src = run(src_kind, "cpu", "sgd", steps=13)
    state = src.state_dict()
    dst = SCALERS[dst_kind]("cpu")
    dst.load_state_dict(state)
    ref = SCALERS[src_kind]("cpu")
    ref.load_state_dict(state)
    for scaler in (dst, ref):
        assert scaler.get_scale() == src.get_scale()
        assert scaler._get_growth_tracker() == src._get_growth_tracker()
    # Both continue the same way from the loaded state.
    for found in [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]:
        for scaler in (dst, ref):
            p = torch.nn.Parameter(torch.ones(3))
            opt = torch.optim.SGD([p], lr=0.1)
            scaler.scale(p.sum()).backward()
            if found:
                p.grad[0] = math.inf
            scaler.step(opt)
            scaler.update()
        assert dst.get_scale() == ref.get_scale()


def test_malformed_state_dict_raises_and_changes_nothing():
    _, _, scaler = run("ampkit", "cpu", "sgd", steps=7)
    before = scaler.state_dict()
    good = dict(before)
    bad_dicts = [
        ({}, RuntimeError, "The source state dict is empty"),
        ({k: v for k, v in good.items() if k != "_growth_tracker"}, ValueError, "no '_growth_tracker' entry"),
        ({**good, "scale": -1.0}, ValueError, "'scale' must be a finite number > 0"),
        ({**good, "scale": "big"}, TypeError, "'scale' must be a number"),
        ({**good, "growth_interval": 2.5}, ValueError, "'growth_interval' must be an int"),
        ({**good, "_growth_tracker": 10**6}, ValueError, r"'_growth_tracker' must be in \[0, growth_interval\)"),
        ({**good, "hysteresis": 0}, ValueError, "'hysteresis' must be in"),
        ({**good, "min_scale": 10.0, "max_scale": 1.0}, ValueError, "min_scale <= max_scale"),
        ({**good, "steps": 1, "skipped_steps": 5}, ValueError, "cannot exceed 'steps'"),
    ]
    for bad, exc, msg in bad_dicts:
        with pytest.raises(exc, match=msg):
            scaler.load_state_dict(bad)
        assert scaler.state_dict() == before


def test_scaling_is_in_the_state_and_a_state_of_the_other_kind_is_refused_unchanged(tmp_path):
    _, _, fixed = run("ampkit", "cpu", "sgd", steps=7, scaling=False)
    _, _, scaling = run("ampkit", "cpu", "sgd", steps=7)
    fixed_state, scaling_state = fixed.state_dict(), scaling.state_dict()
    assert fixed_state["scaling"] is False and scaling_state["scaling"] is True
    assert fixed_state["skipped_steps"] == 2 and scaling.get_scale() != 1.0
    # A scale-1 checkpoint into a scaling scaler would otherwise go on at scale 1, silently.
    with pytest.raises(ValueError, match=r"'scaling' must equal this scaler's \(scaling=True\), but the state has "
                                         r"scaling=False: its scale is fixed at 1"):
        scaling.load_state_dict(fixed_state)
    assert scaling.state_dict() == scaling_state
    fixed.save(tmp_path / "fixed.pt")  # the C++ checkpoint format carries it too
    with pytest.raises(ValueError, match=r"the state has scaling=False"):
        scaling.load(tmp_path / "fixed.pt")
    assert scaling.state_dict() == scaling_state
    with pytest.raises(ValueError, match=r"'scaling' must equal this scaler's \(scaling=False\), but the state has "
                                         r"scaling=True: it scales the loss; build the scaler with scaling=True"):
        fixed.load_state_dict(scaling_state)
    assert fixed.state_dict() == fixed_state
    with pytest.raises(ValueError, match="'scaling' must be a bool, but got Int"):
        fixed.load_state_dict({**fixed_state, "scaling": 0})
    assert fixed.state_dict() == fixed_state
    # Same kind loads (a pickle too); states without the key (torch's, ampkit's before it) load as before.
    again = ampkit.GradScaler("cpu", scaling=False)
    again.load(tmp_path / "fixed.pt")
    assert again.state_dict() == fixed_state
    assert pickle.loads(pickle.dumps(fixed)).state_dict() == fixed_state
    older = {k: v for k, v in fixed_state.items() if k != "scaling"}
    takes_older = ampkit.GradScaler("cpu", init_scale=8.0)
    takes_older.load_state_dict(older)
    assert takes_older.get_scale() == 1.0 and takes_older.stats()["skipped_steps"] == 2
    torch.amp.GradScaler("cpu").load_state_dict(fixed_state)  # torch's scaler takes it (its keys are there)


def test_pickle_round_trip_and_mid_iteration_refusal():
    _, _, scaler = run("ampkit", "cpu", "sgd", steps=9)
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()
    p = torch.nn.Parameter(torch.ones(2))
    scaler.scale(p.sum()).backward()
    scaler.unscale_(torch.optim.SGD([p], lr=1.0))
    with pytest.raises(AssertionError, match="may only be pickled"):
        pickle.dumps(scaler)


def test_checkpoint_files_move_between_cpp_format_and_torch(tmp_path):
    _, _, scaler = run("ampkit", "cpu", "sgd", steps=12)
    path = tmp_path / "scaler.pt"
    scaler.save(path)  # the format of C++ torch::save(scaler, path)
    state = ampkit.load_scaler_state(path)
    assert state == scaler.state_dict()
    t = torch.amp.GradScaler("cpu")
    t.load_state_dict(state)
    assert t.get_scale() == scaler.get_scale() and t._get_growth_tracker() == scaler._get_growth_tracker()
    ampkit.save_scaler_state(t.state_dict(), tmp_path / "from_torch.pt")
    back = ampkit.GradScaler("cpu")
    back.load(tmp_path / "from_torch.pt")
    assert back.get_scale() == t.get_scale() and back._get_growth_tracker() == t._get_growth_tracker()


@pytest.mark.parametrize("bad,match", [
    (dict(scale=1.0), "must lie in \\[min_scale, max_scale\\]"),
    (dict(scale=1e9), "must lie in \\[min_scale, max_scale\\]"),
    (dict(scale=1e39), "that a float32 holds"),
    (dict(growth_factor=1.0), "'growth_factor' must be a finite number > 1"),
    (dict(backoff_factor=1.5), "'backoff_factor' must be in \\(0, 1\\)"),
    (dict(growth_interval=0), "'growth_interval' must be in"),
])
def test_scaler_load_state_dict_rejects_what_the_constructor_rejects_and_changes_nothing(bad, match):
    scaler = ampkit.GradScaler("cpu", init_scale=64.0, min_scale=2.0, max_scale=1e6, growth_interval=9)
    state = dict(scaler.state_dict(), **bad)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=match):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


def test_a_fixed_scale_scaler_refuses_a_scaled_state():
    scaled = ampkit.GradScaler("cpu").state_dict()
    fixed = ampkit.GradScaler("cpu", scaling=False)
    with pytest.raises(ValueError, match="scaling=False"):
        fixed.load_state_dict(scaled)
    assert fixed.get_scale() == 1.0
