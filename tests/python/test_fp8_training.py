"""FP8 layers with the rest of ampkit: decorate (O2) and the master-weight optimizers (FP32 and remainder masters
under FP8 compute), and casts of the model, which leave the FP8 scaling state in FP32."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit
from ampkit import fp8


def _data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 32, generator=g)
    w = torch.randn(32, 16, generator=g) / 4
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(256, 16, generator=g)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def _train(model, opt, steps=60):
    x, y = _data()
    losses = []
    for i in range(steps):
        xb, yb = x[i % 8 * 32:(i % 8 + 1) * 32], y[i % 8 * 32:(i % 8 + 1) * 32]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb.to(torch.bfloat16)).float(), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("master_weights", [True, "remainder"])
@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.DelayedScaling(amax_history_len=8)],
                         ids=["current", "delayed"])
def test_decorate_o2_with_master_weight_optimizer(master_weights, recipe):
    fp8_model = fp8.convert(_model(), recipe)
    opt = ampkit.optim.AdamW(fp8_model.parameters(), lr=3e-3, master_weights=master_weights)
    fp8_model, opt = ampkit.decorate(fp8_model, opt, level="O2", dtype=torch.bfloat16)
    layer = fp8_model[0]
    assert isinstance(layer, fp8.Float8Linear) and layer.weight.dtype == torch.bfloat16
    if isinstance(recipe, fp8.DelayedScaling):
        assert layer.amax_history_input.dtype == layer.scale_input.dtype == torch.float32
    losses = _train(fp8_model, opt)

    bf16_model = _model()
    bf16_opt = ampkit.optim.AdamW(bf16_model.parameters(), lr=3e-3, master_weights=master_weights)
    bf16_model, bf16_opt = ampkit.decorate(bf16_model, bf16_opt, level="O2", dtype=torch.bfloat16)
    bf16_losses = _train(bf16_model, bf16_opt)

    assert losses[-1] < 0.5 * losses[0]
    assert abs(sum(losses[-8:]) / sum(bf16_losses[-8:]) - 1) < 0.05, (losses[-8:], bf16_losses[-8:])
    state = opt.state[layer.weight]
    if master_weights is True:
        master = state["master_param"]
        assert master.dtype == torch.float32 and torch.equal(layer.weight, master.to(torch.bfloat16))
    else:
        restored = ampkit.optim.AdamW.master_from_remainder(layer.weight, state["param_remainder"])
        assert restored.dtype == torch.float32 and torch.equal(restored.to(torch.bfloat16), layer.weight)
    if isinstance(recipe, fp8.DelayedScaling):
        assert layer.scale_input.dtype == torch.float32 and layer.amax_history_grad_output[1:].gt(0).any()


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(),
                                  lambda m: m.to("cpu", torch.float16)], ids=["to_bf16", "half", "double", "to_dev_dt"])
def test_casting_the_model_keeps_the_scaling_state_fp32(cast):
    model = fp8.convert(_model(), fp8.DelayedScaling(amax_history_len=4))
    model(torch.randn(4, 32)).sum().backward()
    history = model[0].amax_history_input.clone()
    history[0] = 1.0 + 2 ** -20  # not a BF16/FP16 value: a round trip through one would change it
    model[0].amax_history_input.copy_(history)
    cast(model)
    assert model[0].weight.dtype != torch.float32
    for name in ("amax_history_input", "amax_history_weight", "amax_history_grad_output", "scale_input",
                 "scale_weight", "scale_grad_output"):
        assert getattr(model[0], name).dtype == torch.float32, name
        assert model[0].state_dict()[name].dtype == torch.float32
    assert torch.equal(model[0].amax_history_input, history)
