"""ampkit.integrations.lightning.AmpkitPrecision in a real Lightning Trainer on the CPU: clipping with ampkit's fused
optimizers on unscaled gradients (each run equal bit for bit to the same loop written by hand), BF16 with a scaler,
skipped steps that leave weights and the schedule alone, bitwise resume, O2 ("bf16-true"), the standalone
pytorch_lightning package; skipped batches (training_step returning None) with clipping, bit for bit Lightning's
MixedPrecision; the plugin and its scaler as Lightning's own AMP tests use a MixedPrecision; the overflow report's
parameter names."""
from __future__ import annotations

import warnings

import pytest
import torch

import ampkit

pl = pytest.importorskip("lightning.pytorch")
from ampkit.integrations.lightning import AmpkitPrecision  # noqa: E402
from ampkit.optim.lr_scheduler import SkipAware  # noqa: E402

STEPS = 6


def _data(seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 12, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 1))


class Module(pl.LightningModule):
    def __init__(self, poisoned=(), opt_cls=ampkit.optim.AdamW, batch_dtypes=None, epoch_len=STEPS,
                 one_batch=False):
        super().__init__()
        self.net = _net()
        self.epoch_len = epoch_len
        self.one_batch = one_batch
        self.poisoned = set(poisoned)
        self.opt_cls = opt_cls
        self.batch_dtypes = batch_dtypes
        self.weights_after = []  # the weights after every optimizer step

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.batch_dtypes is not None:
            self.batch_dtypes.append(x.dtype)
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        return loss * float("inf") if self.global_step in self.poisoned else loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.weights_after.append([p.detach().clone() for p in self.parameters()])

    def configure_optimizers(self):
        opt = self.opt_cls(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8**s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        data = [_data()[0]] * self.epoch_len if self.one_batch else _data()[:self.epoch_len]
        return torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)


def _trainer(plugin, **kwargs):
    kwargs = {"max_steps": STEPS, "accelerator": "cpu", "devices": 1, "logger": False,
              "enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False,
              "num_sanity_val_steps": 0, **kwargs}
    return pl.Trainer(plugins=[plugin], **kwargs)


def _fit(module, plugin, ckpt_path=None, **kwargs):
    trainer = _trainer(plugin, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*GPU available but not used.*")
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def _by_hand(dtype, scaler, *, clip=None, poisoned=(), opt_cls=ampkit.optim.AdamW, schedule=True):
    """The same training written out: autocast, scale, backward, unscale_ + clip when clipping, step, update,
    the schedule stepped only after an applied step."""
    net = _net()
    opt = opt_cls(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8**s)
    for i, (x, y) in enumerate(_data()):
        opt.zero_grad()
        with ampkit.autocast("cpu", dtype=dtype, cache_enabled=False):
            loss = torch.nn.functional.mse_loss(net(x).float(), y.float())
        if i in poisoned:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            if clip[0] == "norm":
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip[1])
            else:
                torch.nn.utils.clip_grad_value_(net.parameters(), clip[1])
        scaler.step(opt)
        scaler.update()
        if schedule and bool(scaler.last_step_ran()):
            sched.step()
    return net, sched


@pytest.mark.parametrize("algorithm,value", [("norm", 0.05), ("value", 0.01)])
def test_fused_optimizer_clips_unscaled_gradients_like_the_loop_by_hand(algorithm, value):
    # Lightning's own MixedPrecision refuses gradient_clip_val for ampkit's (fused) optimizers.
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(Module(), pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=ampkit.GradScaler("cpu")),
             gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    module = Module()
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**10)
    trainer = _fit(module, AmpkitPrecision("16-mixed", device="cpu", scaler=scaler),
                   gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    assert trainer.global_step == STEPS
    ref, _ = _by_hand(torch.float16, ampkit.GradScaler("cpu", init_scale=2.0**10), clip=(algorithm, value))
    for a, b in zip(module.net.parameters(), ref.parameters()):
        assert torch.equal(a, b), (a - b).abs().max()
    # the clipping acted on true gradients: without it the run differs
    unclipped, _ = _by_hand(torch.float16, ampkit.GradScaler("cpu", init_scale=2.0**10))
    assert not all(torch.equal(a, b) for a, b in zip(module.net.parameters(), unclipped.parameters()))


def test_without_clipping_the_fused_step_unscales_inline_and_matches_the_loop_by_hand():
    module = Module()
    _fit(module, AmpkitPrecision("16-mixed", device="cpu", scaler=ampkit.GradScaler("cpu", init_scale=2.0**10)))
    ref, _ = _by_hand(torch.float16, ampkit.GradScaler("cpu", init_scale=2.0**10))
    for a, b in zip(module.net.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scaler_kwargs", [{"scaling": False}, {"init_scale": 2.0**8}], ids=["check-only", "dynamic"])
def test_bf16_takes_an_ampkit_scaler_and_a_skipped_step_changes_nothing_and_does_not_advance_the_schedule(
        scaler_kwargs):
    with pytest.raises(Exception, match="does not use a scaler"):  # Lightning's MixedPrecision refuses any scaler
        pl.plugins.precision.MixedPrecision("bf16-mixed", "cpu", scaler=ampkit.GradScaler("cpu", **scaler_kwargs))
    module = Module(poisoned={2})
    scaler = ampkit.GradScaler("cpu", **scaler_kwargs)
    trainer = _fit(module, AmpkitPrecision("bf16-mixed", device="cpu", scaler=scaler), gradient_clip_val=1.0)
    config = trainer.lr_scheduler_configs[0]
    assert isinstance(config.scheduler, SkipAware)
    assert config.scheduler.skipped_steps == 1 and config.scheduler.last_epoch == STEPS - 1
    assert scaler.stats()["skipped_steps"] == 1
    before, after = module.weights_after[1], module.weights_after[2]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the poisoned step
    assert not all(torch.equal(a, b) for a, b in zip(module.weights_after[2], module.weights_after[3]))
    ref, ref_sched = _by_hand(torch.bfloat16, ampkit.GradScaler("cpu", **scaler_kwargs), clip=("norm", 1.0),
                              poisoned={2})
    assert ref_sched.last_epoch == config.scheduler.last_epoch
    for a, b in zip(module.net.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_a_torch_optimizer_is_unscaled_before_the_hooks_as_lightning_does():
    seen = []

    class Hooked(Module):
        def on_before_optimizer_step(self, optimizer):
            seen.append(torch.cat([p.grad.flatten() for p in self.parameters()]).clone())

    module = Hooked(opt_cls=torch.optim.SGD)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**12)
    _fit(module, AmpkitPrecision("16-mixed", device="cpu", scaler=scaler), max_steps=1)
    # the first step's gradients as the hook saw them, against an FP32 autocast-free float64 reference scaled by
    # nothing: unscaled gradients are O(1), scaled ones 4096 times larger
    net = _net().double()
    x, y = _data()[0]
    torch.nn.functional.mse_loss(net(x.double()), y.double()).backward()
    ref = torch.cat([p.grad.flatten() for p in net.parameters()])
    torch.testing.assert_close(seen[0].double(), ref, rtol=0.05, atol=2e-3)


def test_checkpoint_resume_is_bitwise_and_keeps_the_scalers_state(tmp_path):
    def plugin():
        return AmpkitPrecision("16-mixed", device="cpu",
                               scaler=ampkit.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, hysteresis=2))

    # epochs of 3 batches with a checkpoint at the end of each; global steps 1 and 4 skip. The run resumed from the
    # first epoch's checkpoint must end where the full run ended. One batch repeated: Lightning restarts a resumed
    # epoch's plain DataLoader at its first batch (its own behaviour, not what is tested here).
    full = Module(poisoned={1, 4}, epoch_len=3, one_batch=True)
    full_plugin = plugin()
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1,
                                         save_on_train_epoch_end=True, filename="{epoch}")
    _fit(full, full_plugin, gradient_clip_val=0.5, callbacks=[saver], enable_checkpointing=True)
    assert full_plugin.scaler.stats()["skipped_steps"] == 2
    path = tmp_path / "epoch=0.ckpt"
    saved = torch.load(path, weights_only=False)
    assert saved["AmpkitPrecision"]["hysteresis"] == 2  # ampkit's keys, not only torch's
    resumed = Module(poisoned={1, 4}, epoch_len=3, one_batch=True)
    resumed_plugin = plugin()
    _fit(resumed, resumed_plugin, ckpt_path=path, gradient_clip_val=0.5)
    for a, b in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(a, b)
    assert resumed_plugin.scaler.state_dict() == full_plugin.scaler.state_dict()


def test_a_run_started_with_lightnings_mixed_precision_resumes_with_ampkits_scaler(tmp_path):
    module = Module(opt_cls=torch.optim.AdamW)
    trainer = _fit(module, pl.plugins.precision.MixedPrecision(
        "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**9, growth_interval=1)), max_steps=3)
    path = tmp_path / "torch_amp.ckpt"
    trainer.save_checkpoint(path)
    plugin = AmpkitPrecision("16-mixed", device="cpu", scaler=ampkit.GradScaler("cpu"))
    _fit(Module(opt_cls=torch.optim.AdamW), plugin, ckpt_path=path, max_steps=4)
    # 2^9 grown at each of the first three steps, then once more after the resumed step
    assert plugin.scaler.get_scale() == 2.0**13


def test_bf16_true_is_o2_masters_from_the_fp32_weights_and_bf16_batches():
    dtypes = []
    initial = [p.detach().clone() for p in _net().parameters()]

    class Checked(Module):
        def on_train_start(self):
            opt = self.trainer.optimizers[0]
            self.masters = [opt.state[p]["master_param"].clone() for p in self.net.parameters()
                            if p.dtype == torch.bfloat16]
            self.dtypes = [p.dtype for p in self.net.parameters()]

    module = Checked(batch_dtypes=dtypes)
    _fit(module, AmpkitPrecision("bf16-true", device="cpu"), max_steps=2)
    assert module.dtype == torch.bfloat16
    linear_weights = [initial[0], initial[1], initial[4], initial[5]]  # the LayerNorm (2, 3) stays FP32
    assert [m.dtype for m in module.masters] == [torch.float32] * 4
    assert all(torch.equal(m, w) for m, w in zip(module.masters, linear_weights))  # not rounded copies
    assert module.dtypes == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16,
                             torch.bfloat16]
    assert dtypes == [torch.bfloat16] * 2


def test_the_plugin_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match=r"AmpkitPrecision: precision must be one of .* but got '32'"):
        AmpkitPrecision("32", device="cpu")
    with pytest.raises(TypeError, match="scaler must be an ampkit.GradScaler or None, but got GradScaler"):
        AmpkitPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(Exception, match=r"keeps the FP32 masters in one ampkit.optim optimizer.*\['SGD'\]"):
        _fit(Module(opt_cls=torch.optim.SGD), AmpkitPrecision("bf16-true", device="cpu"), max_steps=1)


def test_the_standalone_pytorch_lightning_package_gets_its_own_plugin():
    ptl = pytest.importorskip("pytorch_lightning")
    from ampkit.integrations.pytorch_lightning import AmpkitPrecision as PTLPrecision

    assert issubclass(PTLPrecision, ptl.plugins.precision.Precision)
    assert not issubclass(PTLPrecision, pl.plugins.precision.Precision)

    class PTLModule(ptl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y.float())

        def configure_optimizers(self):
            return ampkit.optim.AdamW(self.parameters(), lr=0.05)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_data(), batch_size=None, shuffle=False)

    module = PTLModule()
    trainer = ptl.Trainer(plugins=[PTLPrecision("16-mixed", device="cpu",
                                                scaler=ampkit.GradScaler("cpu", init_scale=2.0**10))],
                          max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, gradient_clip_val=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    ref, _ = _by_hand(torch.float16, ampkit.GradScaler("cpu", init_scale=2.0**10), clip=("norm", 0.05),
                      schedule=False)
    assert trainer.global_step == STEPS
    for a, b in zip(module.net.parameters(), ref.parameters()):
        assert torch.equal(a, b)


# ---- skipped batches, Lightning's MixedPrecision contract, the overflow report's names -------------------------


class Skipping(Module):
    """training_step returns None on the batches in ``skipped`` (Lightning's way to skip one: no backward)."""

    def __init__(self, skipped, **kwargs):
        super().__init__(opt_cls=kwargs.pop("opt_cls", torch.optim.AdamW), **kwargs)
        self.skipped = set(skipped)

    def training_step(self, batch, batch_idx):
        return None if batch_idx in self.skipped else super().training_step(batch, batch_idx)


class CountingScaler(ampkit.GradScaler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"unscale_": 0, "step": 0, "update": 0}

    def unscale_(self, optimizer):
        self.calls["unscale_"] += 1
        return super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        self.calls["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.calls["update"] += 1
        return super().update(new_scale)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_skipped_batches_with_clipping_leave_the_scaler_alone_as_lightnings_mixed_precision_does(precision):
    skipped = {1, 3}
    fp16 = precision == "16-mixed"
    theirs = Skipping(skipped)
    their_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if fp16 else None
    _fit(theirs, pl.plugins.precision.MixedPrecision(precision, "cpu", scaler=their_scaler), gradient_clip_val=0.5)
    ours = Skipping(skipped)
    scaler = (CountingScaler("cpu", init_scale=2.0**10, growth_interval=2) if fp16
              else CountingScaler("cpu", scaling=False))
    _fit(ours, AmpkitPrecision(precision, device="cpu", scaler=scaler), gradient_clip_val=0.5)
    # one unscale, step and update per batch that ran a backward
    ran = STEPS - len(skipped)
    assert scaler.calls == {"unscale_": ran, "step": ran, "update": ran}
    assert scaler.stats()["steps"] == ran and scaler.stats()["skipped_steps"] == 0
    for i in skipped:  # a skipped batch changes no weight
        assert all(torch.equal(a, b) for a, b in zip(ours.weights_after[i - 1], ours.weights_after[i]))
    # the run is Lightning's own, bit for bit
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b), (a - b).abs().max()
    if fp16:
        theirs_sd = their_scaler.state_dict()
        assert {k: scaler.state_dict()[k] for k in theirs_sd} == theirs_sd


def test_a_skipped_batch_with_clipping_then_an_overflow_is_skipped_by_the_next_step():
    # the batch after a skipped one is checked for Inf/NaN (its grads were unscaled and checked, not left as a
    # scaled step): its poisoned step changes nothing and backs the scale off
    class Poisoned(Skipping):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if batch_idx == 2 else loss

    module = Poisoned({1})
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**10)
    _fit(module, AmpkitPrecision("16-mixed", device="cpu", scaler=scaler), gradient_clip_val=0.5)
    assert scaler.stats()["skipped_steps"] == 1 and scaler.get_scale() == 2.0**9
    for i in (1, 2):  # the skipped batch, then the poisoned one
        assert all(torch.equal(a, b) for a, b in zip(module.weights_after[i - 1], module.weights_after[i]))


def test_the_plugin_is_a_mixed_precision_with_a_torch_amp_grad_scaler():
    MixedPrecision = pl.plugins.precision.MixedPrecision
    seen = {}

    class Checked(Module):
        def configure_optimizers(self):  # where Lightning's own AMP tests look at the plugin and its scaler
            plugin = self.trainer.precision_plugin
            seen["plugin"] = isinstance(plugin, MixedPrecision)
            seen["scaler"] = isinstance(plugin.scaler, torch.amp.GradScaler)
            return super().configure_optimizers()

    _fit(Checked(), AmpkitPrecision("16-mixed", device="cpu"), max_steps=1)
    assert seen == {"plugin": True, "scaler": True}
    # Lightning's ThroughputMonitor reads the compute dtype of a MixedPrecision from its precision
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

    assert _plugin_to_compute_dtype(AmpkitPrecision("bf16-mixed", device="cpu")) == torch.bfloat16
    assert _plugin_to_compute_dtype(AmpkitPrecision("16-mixed", device="cpu")) == torch.float16


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-true"])
def test_autocast_context_manager_is_mixed_precisions_without_the_cast_cache(precision):
    plugin = AmpkitPrecision(precision, device="cpu")
    mixed = precision.endswith("-mixed")
    layer = torch.nn.Linear(2, 1)
    x = torch.randn(1, 2)
    assert isinstance(plugin.autocast_context_manager(), torch.autocast)
    with plugin.autocast_context_manager():
        assert torch.is_autocast_enabled("cpu") == mixed
        assert not torch.is_autocast_cache_enabled()
        assert layer(x).dtype == (plugin.dtype if mixed else torch.float32)
    # a no_grad forward inside the step's context does not leave a cast without grad for the next one
    with plugin.forward_context():
        with torch.no_grad():
            layer(x)
        loss = layer(x).float().mean()
    loss.backward()
    assert layer.weight.grad is not None


def test_the_grads_lightning_hooks_see_are_unscaled_and_the_stage_is_torchs(tmp_path):
    """Lightning's own check in on_before_optimizer_step: the scaler's _per_optimizer_states says UNSCALED, the grads
    are the scaled ones divided by the scale, and configure_gradient_clipping clips them."""
    def run(plugin):
        records = []

        class Hooked(Module):
            def on_after_backward(self):
                scale = self.trainer.precision_plugin.scaler.get_scale()
                self.expected = [p.grad / scale for p in self.parameters()]

            def on_before_optimizer_step(self, optimizer):
                state = self.trainer.precision_plugin.scaler._per_optimizer_states[id(optimizer)]
                records.append((state["stage"].name, sorted(str(d) for d in state["found_inf_per_device"])))
                for p, e in zip(self.parameters(), self.expected):
                    torch.testing.assert_close(p.grad, e)

        module = Hooked(opt_cls=torch.optim.SGD)
        _fit(module, plugin, gradient_clip_val=1e-3, gradient_clip_algorithm="value", max_steps=3)
        return module, records

    ours, our_records = run(AmpkitPrecision("16-mixed", device="cpu", scaler=ampkit.GradScaler("cpu", init_scale=1e3)))
    theirs, their_records = run(pl.plugins.precision.MixedPrecision(
        "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1e3)))
    assert our_records == their_records == [("UNSCALED", ["cpu"])] * 3
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_the_overflow_report_names_the_lightning_modules_parameters():
    reports = []

    class Poisoned(Module):
        def on_after_backward(self):
            if self.global_step == 2:
                self.net[3].bias.grad[0] = float("inf")

        def on_train_batch_end(self, outputs, batch, batch_idx):
            reports.append(self.trainer.precision_plugin.scaler.overflow_report())

    scaler = ampkit.GradScaler("cpu", init_scale=2.0**10, overflow_report=True)
    _fit(Poisoned(), AmpkitPrecision("16-mixed", device="cpu", scaler=scaler), max_steps=4)
    assert reports == [[], [], ["net.3.bias"], []]
