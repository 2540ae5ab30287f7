"""AmpvizCallback in a real lightning.Trainer, against oracles that observe the same Trainer independently:
the module's own losses, gradients captured at ``on_before_optimizer_step`` (after the closure's backward,
what the optimizer receives when nothing is clipped) and activation gradients from tensor hooks, binned with
numpy.frexp."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _oracles import (
    binned,
    compiled_with_and_without,
    needs_cxx,
    params_equal,
    wandb_history,
    wandb_row,
    with_graph_breaks,
)

import ampviz

L = pytest.importorskip("lightning")
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from ampviz.integrations.lightning import AmpvizCallback  # noqa: E402


class Classifier(L.LightningModule):
    def __init__(self, seed=0, fail_at=None):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.LayerNorm(32),
                                       torch.nn.Linear(32, 5))
        self.losses, self.fail_at = [], fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("planted failure")
        x, y = batch
        loss = F.cross_entropy(self.net(x).float(), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader(n=48, batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 5, (n,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch)


PRECISIONS = {"16-mixed": lambda: dict(plugins=[MixedPrecision("16-mixed", "cpu",
                                                               torch.amp.GradScaler("cpu", init_scale=2.0 ** 20))]),
              "bf16-mixed": lambda: dict(precision="bf16-mixed"),
              "32-true": lambda: dict(precision="32-true")}


def fit(callbacks=(), precision="16-mixed", module=None, max_steps=6, **kwargs):
    module = module if module is not None else Classifier()
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, callbacks=list(callbacks), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        **PRECISIONS[precision](), **kwargs)
    trainer.fit(module, loader())
    return trainer, module


class Oracle(L.Callback):
    def __init__(self, module_name):
        self.module_name, self.grads, self.acts, self.scales, self._act = module_name, [], [], [], []

    def on_train_start(self, trainer, pl_module):
        def forward(module, inputs, output):
            output.register_hook(lambda g: self._act.append(g.detach().clone()))
        pl_module.get_submodule(self.module_name).register_forward_hook(forward)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})
        self.acts.append(self._act)
        self._act = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = trainer.precision_plugin.scaler if hasattr(trainer.precision_plugin, "scaler") else None
        if len(self.scales) < len(self.grads):
            self.scales.append(scaler.get_scale() if scaler is not None else 1.0)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_records_lightning_with_accumulation_against_an_oracle(precision):
    oracle, callback = Oracle("net.0"), AmpvizCallback()
    trainer, module = fit([callback, oracle], precision, accumulate_grad_batches=3)
    run = callback.run
    assert run.n_steps == trainer.global_step == len(oracle.grads) == 6
    expected_loss = torch.stack(module.losses).reshape(6, 3).sum(dim=1) / 3       # the accumulated batch's mean
    np.testing.assert_allclose(run.loss[0], expected_loss.numpy(), rtol=1e-6)
    for step, grads in enumerate(oracle.grads):
        for name, grad in grads.items():
            np.testing.assert_array_equal(run.histogram(step, name), binned(grad), err_msg=f"{name} step {step}")
        np.testing.assert_array_equal(run.histogram(step, "net.0", domain="scaled"), binned(*oracle.acts[step]))
    np.testing.assert_array_equal(run.next_scale[0], oracle.scales)
    if precision == "16-mixed":
        assert run.skipped[0].any() and not run.skipped[0].all()               # init scale 2^20 overflows at first
        assert run.tensor_dtypes[run.tensor_index("net.0")] == "torch.float16"
    else:
        assert not run.skipped[0].any() and (run.loss_scale[0] == 1).all()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_training_is_bit_identical_with_and_without_the_callback(precision):
    _, plain = fit([], precision, accumulate_grad_batches=2, gradient_clip_val=0.5)
    callback = AmpvizCallback()
    _, recorded = fit([callback], precision, accumulate_grad_batches=2, gradient_clip_val=0.5)
    assert callback.run.n_steps == 6
    assert params_equal(plain, recorded)


def test_a_failing_fit_removes_the_hooks_and_saves_what_was_recorded(tmp_path):
    module = Classifier(fail_at=5)
    callback = AmpvizCallback(path=tmp_path / "pl.npz")
    with pytest.raises(RuntimeError, match="planted failure"):
        fit([callback], "16-mixed", module=module)
    assert all(not m._forward_hooks for m in module.modules())
    saved = ampviz.Run.load(tmp_path / "pl.npz")
    assert saved.n_steps == 5 and callback.recorder is None


class FusedClassifier(Classifier):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def test_a_fused_optimizers_gradients_are_recorded_unscaled_under_a_grad_scaler():
    # Lightning skips unscale_ for a fused optimizer (its kernel unscales): the gradients it is handed are scaled
    oracle, callback = Oracle("net.0"), AmpvizCallback()
    fit([callback, oracle], "16-mixed", module=FusedClassifier())
    run = callback.run
    used = [2.0 ** 20] + oracle.scales[:-1]                      # the scale each step's gradients carry
    assert run.skipped[0].any() and not run.skipped[0].all()
    np.testing.assert_array_equal(run.loss_scale[0], used)
    for step, grads in enumerate(oracle.grads):
        for name, grad in grads.items():
            np.testing.assert_array_equal(run.histogram(step, name), binned(grad / used[step]),
                                          err_msg=f"{name} step {step}")


def test_16_mixed_on_the_cpu_is_bf16_unless_the_plugin_is_given():
    # Lightning 2.6: precision="16-mixed" on a CPU becomes "bf16-mixed", without a GradScaler; the plugin
    # MixedPrecision("16-mixed", "cpu") keeps fp16 with one (PRECISIONS above; docs/integrations.md cites this test)
    with pytest.warns(UserWarning, match="bf16-mixed"):
        trainer = L.Trainer(accelerator="cpu", precision="16-mixed", logger=False)
    assert trainer.precision_plugin.precision == "bf16-mixed" and trainer.precision_plugin.scaler is None


def test_local_weights_are_refused_at_construction():
    # hooks receive the LightningModule; local (pre-all-reduce) gradients need the DDP wrapper's backward
    with pytest.raises(ValueError, match="local_weights=True cannot be recorded from a callback"):
        AmpvizCallback(local_weights=True)


def test_live_wandb_export_from_the_callback(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                        "WANDB_CONFIG_DIR": str(tmp_path / "config"), "WANDB_CACHE_DIR": str(tmp_path / "cache"),
                        "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(name, value)
    wandb.teardown()                               # W&B reads its settings once per process
    try:
        callback = AmpvizCallback(wandb=True, export_every=2, activations=False)
        fit([callback], "16-mixed", max_steps=5)
        rows = wandb_history(tmp_path)
    finally:
        wandb.teardown()
    run = callback.run
    assert [row["ampviz/step"] for row in rows] == run.steps.tolist()
    for row, step in zip(rows, run.steps.tolist()):
        for t, name in enumerate(run.tensor_names):
            np.testing.assert_array_equal(wandb_row(row, "ampviz", "weight", name), run.counts[0, step, t])


class ForwardClassifier(Classifier):
    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).float(), y)


@pytest.mark.slow
@needs_cxx
def test_a_compiled_module_given_to_fit_adds_no_graph_break_and_changes_nothing():
    # trainer.fit(torch.compile(module)) unwraps the module and compiles its forward in place: the callback sees
    # the plain module, whose submodules run inside the compiled forward
    def compiled(callbacks):
        return with_graph_breaks(lambda: fit(callbacks, "bf16-mixed", module=torch.compile(ForwardClassifier()),
                                             max_steps=3)[1])

    run = compiled_with_and_without(compiled, AmpvizCallback(), "runs under torch.compile")
    assert run.n_steps == 3 and set(run.tensor_kinds) == {"weight"} and "_orig_mod" not in "".join(run.tensor_names)
