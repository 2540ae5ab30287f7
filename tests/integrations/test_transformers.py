"""AmpvizCallback in a real transformers Trainer (a small random-init BERT from a config), against oracles
that observe the same Trainer independently: its own logged loss, gradients captured at
``on_pre_optimizer_step`` and activation gradients from tensor hooks, binned with numpy.frexp."""

import warnings

import numpy as np
import pytest
import torch
from _oracles import (
    binned,
    compiled_with_and_without,
    needs_cxx,
    params_equal,
    read_tensorboard,
    restored_determinism,
    tensorboard_row,
    with_graph_breaks,
)

import ampviz
import ampviz.doctor
import ampviz.histogram as H

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from ampviz.integrations.transformers import AmpvizCallback  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=16, num_labels=3)


def bert(seed=0):
    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(**CONFIG))


def dataset(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 64, (12,), generator=g), "labels": int(torch.randint(0, 3, (), generator=g))}
            for _ in range(n)]


def train(tmp_path, callbacks=(), model=None, scaler=None, **overrides):
    """A real Trainer on the CPU. ``scaler``: accelerate's fp16 path as it runs on a GPU (fp16 autocast and
    this GradScaler), which accelerate 1.15 never enables on a CPU by itself."""
    args = dict(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4, logging_steps=1,
                report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    args.update(overrides)
    model = model if model is not None else bert()
    trainer = Trainer(model=model, args=TrainingArguments(**args), train_dataset=dataset(), callbacks=list(callbacks))
    if scaler is not None:
        assert trainer.args.fp16 and trainer.accelerator.mixed_precision == "fp16"
        trainer.accelerator.native_amp, trainer.accelerator.scaler = True, scaler
    trainer.train()
    return trainer, model


class Oracle(TrainerCallback):
    """Observes the same Trainer: gradients as the optimizer receives them, chosen activation gradients,
    the scale after every step and accelerate's own skipped flag."""

    def __init__(self, modules):
        self.modules, self.grads, self.acts, self.scales, self.accelerate_skipped = modules, [], [], [], []
        self._act = {}

    def on_train_begin(self, args, state, control, model=None, **kw):
        for name in self.modules:
            model.get_submodule(name).register_forward_hook(self._forward(name))
        self.model_losses, self._losses = [], []           # the loss each micro-batch's forward returned
        model.register_forward_hook(lambda m, i, out: self._losses.append(out.loss.item()) if m.training else None)

    def _forward(self, name):
        def hook(module, inputs, output):
            if module.training:
                output.register_hook(lambda g: self._act.setdefault(name, []).append(g.detach().clone()))
        return hook

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        # after clipping (which unscales under a GradScaler): what the optimizer receives
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        self.acts.append(self._act)
        self.model_losses.append(self._losses)
        self._act, self._losses = {}, []
        self.scales.append(optimizer.scaler.get_scale() if optimizer.scaler is not None else 1.0)
        self.accelerate_skipped.append(optimizer.step_was_skipped)


MODULES = ["bert.encoder.layer.0.intermediate.dense", "classifier"]


def assert_matches_oracle(run, oracle, trainer):
    assert run.n_steps == trainer.state.global_step == len(oracle.grads)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    np.testing.assert_allclose(run.loss[0], logged, rtol=1e-6)                 # the Trainer's own per-step loss
    assert np.isfinite(run.loss[0]).all()
    for step, (grads, acts) in enumerate(zip(oracle.grads, oracle.acts)):
        for name, grad in grads.items():
            np.testing.assert_array_equal(run.histogram(step, name), binned(grad), err_msg=f"{name} step {step}")
        for name in MODULES:                                                   # every micro-batch of the step
            np.testing.assert_array_equal(run.histogram(step, name, domain="scaled"), binned(*acts[name]))


def test_records_the_trainer_with_accumulation_against_an_oracle(tmp_path):
    oracle, callback = Oracle(MODULES), AmpvizCallback(path=tmp_path / "hf.npz")
    trainer, _ = train(tmp_path, [callback, oracle], gradient_accumulation_steps=3, bf16=True)
    run = callback.run
    assert_matches_oracle(run, oracle, trainer)
    assert run.tensor_dtypes[run.tensor_index("classifier")] == "torch.bfloat16"    # bf16 autocast on the CPU
    # transformers 5.24 divides by the accumulation steps only for models without loss kwargs; BERT's
    # classifier takes **kwargs but ignores num_items_in_batch, so its step loss is the micro-batches' sum
    # (docs/integrations.md cites this test: the README BERT's losses are near 2 ln 3)
    assert trainer.model_accepts_loss_kwargs
    np.testing.assert_allclose(run.loss[0], [sum(losses) for losses in oracle.model_losses], rtol=1e-5)
    per_step = run.counts.sum(axis=-1)[0, :, run.tensor_index("classifier")]
    assert (per_step == 3 * 4 * 3).all()                   # 3 micro-batches x 4 examples x 3 labels per step
    again = ampviz.Run.load(tmp_path / "hf.npz")
    np.testing.assert_array_equal(again.counts, run.counts)


def test_fp16_with_the_trainers_grad_scaler_records_scale_and_skips(tmp_path):
    oracle, callback = Oracle(MODULES), AmpvizCallback()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 19)               # high enough to overflow at first
    trainer, _ = train(tmp_path, [callback, oracle], scaler=scaler, fp16=True, gradient_accumulation_steps=2,
                       max_steps=6)
    run = callback.run
    assert_matches_oracle(run, oracle, trainer)
    np.testing.assert_array_equal(run.next_scale[0], oracle.scales)
    skipped = np.array(oracle.scales) < np.concatenate([[2.0 ** 19], oracle.scales[:-1]])
    assert skipped.any() and not skipped.all()
    np.testing.assert_array_equal(run.skipped[0], skipped)
    act = run.tensor_index("classifier")
    assert run.tensor_dtypes[act] == "torch.float16"
    assert run.counts[0, skipped][:, act, H.ABOVE].sum() > 0                 # the overflow that caused the skips
    # transformers 5.24's default optimizer is fused AdamW: its step runs on skipped steps too, so
    # accelerate's step_was_skipped (the Trainer's optimizer_step_was_skipped) never says so, and the LR
    # scheduler steps on skipped steps (docs/integrations.md cites this test)
    assert trainer.args.optim == "adamw_torch_fused" and not any(oracle.accelerate_skipped)
    assert run.scheduler_steps[0].tolist() == list(range(1, 7))             # it stepped on every step, skipped too
    assert "scheduler_on_skipped" in [f["check"] for f in ampviz.doctor.diagnose(run)["findings"]]


def test_fp16_on_a_cpu_trains_in_fp32_and_the_callback_says_so(tmp_path):
    # transformers 5.24 with accelerate 1.15: on a CPU, fp16=True trains in fp32, without autocast or GradScaler
    # (docs/integrations.md cites this test)
    callback = AmpvizCallback()
    with pytest.warns(ampviz.AmpvizWarning, match="fp32"):
        trainer, _ = train(tmp_path, [callback], fp16=True, max_steps=2)
    assert trainer.accelerator.scaler is None and not trainer.accelerator.native_amp
    run = callback.run
    assert run.tensor_dtypes[run.tensor_index("classifier")] == "torch.float32"
    assert (run.loss_scale == 1).all()


def test_fused_optimizer_without_clipping_records_unscaled_gradients(tmp_path):
    # max_grad_norm=0 and the default fused AdamW: transformers 5.24 still unscales before every step (it logs the
    # gradient norm, computed with accelerate's clip_grad_norm_(inf), which calls GradScaler.unscale_), so the
    # optimizer receives unscaled gradients; the Recorder's own unscaling of a fused optimizer's gradients
    # (tests/test_record.py) is not needed here and must not divide twice
    oracle, callback = Oracle(MODULES), AmpvizCallback()
    trainer, _ = train(tmp_path, [callback, oracle], scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 10),
                       fp16=True, max_grad_norm=0.0, max_steps=2)
    assert trainer.optimizer.optimizer.defaults["fused"]
    for step, grads in enumerate(oracle.grads):
        for name, grad in grads.items():
            np.testing.assert_array_equal(callback.run.histogram(step, name), binned(grad),
                                          err_msg=f"{name} step {step}")


@pytest.mark.parametrize("precision", ["bf16", "fp16-scaler"])
def test_training_is_bit_identical_with_and_without_the_callback(tmp_path, precision):
    def once(callbacks):
        kwargs = dict(gradient_accumulation_steps=2, max_steps=5)
        if precision == "bf16":
            kwargs["bf16"] = True
        else:
            kwargs.update(fp16=True, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 20))
        return train(tmp_path, callbacks, **kwargs)[1]
    plain = once([])
    callback = AmpvizCallback()
    recorded = once([callback])
    assert callback.run.n_steps == 5
    assert params_equal(plain, recorded)


def test_hooks_are_removed_and_eval_does_not_count(tmp_path):
    model = bert()
    before = {n: (dict(m._forward_hooks), dict(m._backward_hooks)) for n, m in model.named_modules()}
    callback = AmpvizCallback()
    trainer, _ = train(tmp_path, [callback], model=model, max_steps=2)
    assert {n: (dict(m._forward_hooks), dict(m._backward_hooks)) for n, m in model.named_modules()} == before
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters()
               if getattr(p, "_post_accumulate_grad_hooks", None) is not None)
    trainer.evaluate(dataset(8, seed=1))                       # after training: nothing recorded, nothing raised
    assert callback.run.n_steps == 2 and callback.recorder is None


def test_live_tensorboard_export_from_the_callback(tmp_path):
    callback = AmpvizCallback(tensorboard=tmp_path / "tb", export_every=2)
    train(tmp_path, [callback], max_steps=5)
    run, acc = callback.run, read_tensorboard(tmp_path / "tb")
    assert [e.step for e in acc.Scalars("ampviz/loss")] == run.steps.tolist()
    name = "classifier.weight"
    for step in run.hist_steps.tolist():
        np.testing.assert_array_equal(tensorboard_row(acc, "ampviz", "weight", name, step), run.histogram(step, name))


def test_recorder_options_are_checked_at_construction():
    with pytest.raises(TypeError, match="evry"):
        AmpvizCallback(evry=2)
    with pytest.raises(ValueError, match="export_every"):
        AmpvizCallback(export_every=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AmpvizCallback(every=2, activations=False)              # valid options: no warning, no error
    # the Trainer hands callbacks self.model, never the DDP wrapper (model_wrapped) whose backward local_weights hooks
    with pytest.raises(ValueError, match="local_weights=True cannot be recorded from a callback.*DataParallel"):
        AmpvizCallback(local_weights=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 AMP through the Trainer's GradScaler needs CUDA")
def test_real_fp16_on_a_gpu(tmp_path):
    oracle, callback = Oracle(MODULES), AmpvizCallback()
    trainer, _ = train(tmp_path, [callback, oracle], use_cpu=False, fp16=True, gradient_accumulation_steps=2,
                       max_steps=6)
    assert isinstance(trainer.accelerator.scaler, torch.amp.GradScaler)
    assert_matches_oracle(callback.run, oracle, trainer)
    np.testing.assert_array_equal(callback.run.next_scale[0], oracle.scales)


@pytest.mark.slow
@needs_cxx
def test_torch_compile_true_adds_no_graph_break_and_changes_nothing(tmp_path):
    # accelerate compiles a wrapper the callback never sees: hooks on the model's modules would run inside the
    # compiled graph (32 graph breaks on this BERT before the callback knew), so activation capture is off.
    # full_determinism: on a CPU inductor (torch 2.13) compiles the embeddings' backward to atomic adds from two
    # threads (TORCH_LOGS=output_code shows 3 atomic_add_vec kernels for this BERT), whose
    # order follows thread timing, so two runs WITHOUT ampviz can end with different weights (CI saw it once, and a
    # callback that only spins 5 ms per step does it too); deterministic algorithms make the compiled run repeatable
    def compiled(callbacks):
        return with_graph_breaks(lambda: train(tmp_path, callbacks, torch_compile=True, max_steps=3,
                                               full_determinism=True)[0].model)

    with restored_determinism():
        run = compiled_with_and_without(compiled, AmpvizCallback(), "torch_compile=True")
    assert run.n_steps == 3 and set(run.tensor_kinds) == {"weight"} and (run.counts[0].sum(axis=-1) > 0).all()
    with pytest.raises(ValueError, match="activations='classifier' with TrainingArguments"):
        train(tmp_path, [AmpvizCallback(activations="classifier")], torch_compile=True, max_steps=1)
