"""ampviz for Hugging Face transformers: a ``TrainerCallback`` that records what the ``Trainer`` trains.

::

    from transformers import Trainer
    from ampviz.integrations.transformers import AmpvizCallback

    callback = AmpvizCallback(path="runs/hf.npz", every=10)        # any other ampviz.Recorder option too
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    callback.run                                                  # the ampviz.Run, also saved at path

It finds by itself, from what the Trainer hands every callback at ``on_train_begin``:

* the **model** (``model=``), hooked as a plain ``Recorder`` would hook it;
* the **optimizer**: accelerate's ``AcceleratedOptimizer`` wraps the torch optimizer; the Recorder hooks
  the torch one, whose ``step`` the wrapper (and GradScaler) call;
* the **GradScaler**: ``AcceleratedOptimizer.scaler`` (accelerate makes one for fp16 off the CPU);
* the **LR scheduler** (``lr_scheduler=``): its step count is recorded, so ``ampviz doctor`` can tell
  whether it stepped on skipped steps;
* the **loss of each optimizer step**: the Trainer's ``tr_loss_step`` summed over the step's micro-batches,
  i.e. what it logs with ``logging_steps=1`` (it divides each micro-batch's loss by
  ``gradient_accumulation_steps``), except that ampviz keeps inf/nan where the Trainer's
  ``logging_nan_inf_filter`` replaces them. It is read without a host sync: a hook on the loss the model
  returns receives d(backpropagated loss)/d(loss) = c * S (c the Trainer's factor, S the loss scale), so
  ``loss * grad / S`` is the micro-batch's ``c * loss``. A custom ``compute_loss`` that does not
  backpropagate through the model's own ``loss`` output records no loss (one warning).

Measured with transformers 5.24 and accelerate 1.15 on a CPU (``tests/integrations/test_transformers.py``):

* ``fp16=True`` on a CPU trains in **fp32**: accelerate enables fp16 autocast and a GradScaler only off the
  CPU, so there are neither (this callback warns). ``bf16=True`` autocasts to bf16 on a CPU, without a scaler.
* The default optimizer is ``adamw_torch_fused``. With a GradScaler its ``step`` runs even on a step the
  scaler skips (the fused kernel skips the update itself), so ``accelerator.optimizer_step_was_skipped`` stays
  False and the LR scheduler steps on skipped steps. ampviz's ``skipped`` comes from the scale going down.

With ``TrainingArguments(torch_compile=True)`` accelerate compiles a wrapper around the model that callbacks
never see; the callback tells the Recorder so (``compiled_by=``): weight gradients are recorded, activation
capture is off (a warning; naming modules in ``activations=``, or any ``outputs=``, is an error), no graph
break is added and training is unchanged (compared with ``full_determinism=True``: on a CPU the compiled embedding
backward uses atomic adds, so two compiled runs can differ without ampviz).

With ``TrainingArguments(deepspeed=<config>)`` the Trainer trains through a ``DeepSpeedEngine``
(``trainer.deepspeed``, ``trainer.model_wrapped``) that it never hands to callbacks; the callback finds it at
``on_train_begin`` (the engine whose ``module`` is the model) and records with
``ampviz.integrations.deepspeed.Recorder(engine)``: weight rows from this rank's ZeRO partitions (the ranks' counts
add up to the full gradients), loss scale and skipped steps from the engine (``callback.engine``). Tested with a
bf16 ZeRO 2 config on 2 CPU ranks (``tests/integrations/test_transformers_deepspeed.py``).

Callbacks get the model, not the DDP wrapper (``trainer.model_wrapped``), so ``local_weights=True`` is refused.

If ``trainer.train()`` raises, the Trainer calls no callback: call ``callback.close()`` (in a ``finally:``)
to remove the hooks and save what was recorded. Each ``train()`` call starts a new recording.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping

import torch

from .._extras import MissingExtra
from ._common import FP16_ON_CPU, Session

try:
    from transformers import TrainerCallback
except ImportError:                                    # pragma: no cover - depends on the environment
    raise MissingExtra("ampviz.integrations.transformers needs transformers, which is not installed: "
                       "pip install transformers") from None

__all__ = ["AmpvizCallback"]


class AmpvizCallback(TrainerCallback):
    """Record the Trainer's run with an ``ampviz.Recorder``: gradients, loss scale, skipped steps, loss.

    Parameters
    ----------
    path : where the run is saved at the end of training, or None (as ``ampviz.Recorder``'s ``path``: under
        DDP each rank writes its own file).
    tensorboard : a log directory to export to live (see ``ampviz.export``), or None.
    wandb : True to export live to the active W&B run (``report_to="wandb"`` starts one), a W&B run, or False.
    export_every : optimizer steps between live exports (default: the Trainer's ``logging_steps``).
    domain : what the export writes: "recorded" (default), "unscaled" or "scaled".
    **recorder_options : ``ampviz.Recorder``'s options (``weights=``, ``every=``, ...), checked here into one
        ``ampviz.RecordOptions`` that every recording of this callback uses.
    """

    def __init__(self, path=None, *, tensorboard=None, wandb=False, export_every=None, domain="recorded",
                 **recorder_options):
        self._session = Session("AmpvizCallback", path, recorder_options, tensorboard, wandb, export_every, domain)
        self._loss_hook = None
        self._scaler = None
        self._engine = self._source = None       # the DeepSpeed engine (TrainingArguments(deepspeed=...)), its reader
        self._terms = 0                 # micro-batch losses added in the current optimizer step

    @property
    def run(self):
        """The ``ampviz.Run`` of the last finished ``train()`` (None before)."""
        return self._session.run

    @property
    def engine(self):
        """The DeepSpeed engine recorded, under ``TrainingArguments(deepspeed=...)``, else None."""
        return self._engine

    @property
    def recorder(self):
        """The open ``ampviz.Recorder`` during training, else None."""
        return self._session.recorder

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self._engine = _deepspeed_engine(args, model, optimizer)
        self._scaler = None if self._engine is not None else getattr(optimizer, "scaler", None)
        if args.fp16 and self._scaler is None and self._engine is None and args.device.type == "cpu":
            self._session.warn_once("fp16", f"TrainingArguments(fp16=True) {FP16_ON_CPU}")
        # torch_compile=True: accelerate compiles a wrapper the callbacks never see, around this same model
        recorder = self._session.start(
            model, optimizer, self._scaler, lr_scheduler, default_export_every=max(int(state.logging_steps), 1),
            compiled_by="TrainingArguments(torch_compile=True)" if args.torch_compile else None, engine=self._engine)
        self._source = getattr(recorder, "_framework", None) if self._engine is not None else None
        self._loss_hook = model.register_forward_hook(self._on_forward)
        self._terms = 0

    def on_step_end(self, args, state, control, **kwargs):
        # after the optimizer step and scaler.update() (AcceleratedOptimizer.step does both), once per step
        if not self._session.open:
            return
        if self._terms == 0:
            self._session.warn_once("loss", "no loss reached the backward pass through the model's `loss` output "
                                    "(a custom compute_loss or compute_loss_func?): the run's loss is nan")
        self._session.step()
        self._terms = 0

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Remove every hook and save / export what was recorded (done at the end of ``train()``)."""
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        self._session.close()

    # ------------------------------------------------------------------ the loss of a step
    def _on_forward(self, module, args, output):
        if not module.training or not torch.is_grad_enabled():
            return                                             # evaluation, prediction
        loss = output.get("loss") if isinstance(output, Mapping) else None
        if loss is None and isinstance(output, (tuple, list)) and output:
            loss = output[0] if isinstance(output[0], torch.Tensor) and output[0].ndim == 0 else None
        if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1:
            # a copy of the value: the Trainer multiplies this very tensor in place (`loss *= num_processes` when it
            # averages tokens across ranks), after which the hook still receives d/d(loss before the multiplication)
            loss.register_hook(functools.partial(self._on_loss_grad, loss.detach().clone()))

    def _on_loss_grad(self, value, grad):
        # grad = c * S: the Trainer's factor times the loss scale of this backward (device tensors, no sync)
        if self._source is not None:                          # DeepSpeed: its scale, a host number (1 in bf16)
            scale = self._source.scale()
            scale = None if scale == 1.0 else scale
        else:
            scale = getattr(self._scaler, "_scale", None) if self._scaler is not None else None
        share = value.float() * grad.float()
        self._session.add_loss(share / scale if scale is not None else share)
        self._terms += 1


def _deepspeed_engine(args, model, optimizer):
    """The ``DeepSpeedEngine`` training ``model`` when the Trainer runs DeepSpeed (``TrainingArguments(deepspeed=
    ...)``, or an accelerate launch with a DeepSpeed plugin), else None.

    The Trainer hands callbacks ``model`` (the engine's ``module``) and ``optimizer`` (accelerate's
    ``DeepSpeedOptimizerWrapper`` around ``engine.optimizer``), never the engine (``trainer.model_wrapped``), and
    nothing they hold refers back to it: it is found among the live objects, the engine whose ``module`` is
    ``model`` (once, at the start of training)."""
    if getattr(args, "deepspeed_plugin", None) is None and not getattr(args, "deepspeed", None):
        return None
    if "deepspeed" not in sys.modules:
        return None
    import gc

    from .deepspeed import is_engine
    inner = getattr(optimizer, "optimizer", None)
    found, kinds = [], {}
    for obj in gc.get_objects():
        kind = type(obj)
        known = kinds.get(kind)
        if known is None:
            known = kinds[kind] = is_engine(obj)
        if known and getattr(obj, "module", None) is model:
            found.append(obj)
    if not found:
        raise RuntimeError("AmpvizCallback: the Trainer runs DeepSpeed, but no DeepSpeedEngine holding the model "
                           "was found at on_train_begin; record it with ampviz.integrations.deepspeed.Recorder("
                           "trainer.model_wrapped) in your own loop")
    # a second train() makes a new engine around the same model: the one whose optimizer the Trainer steps
    for engine in reversed(found):
        if inner is None or getattr(engine, "optimizer", None) is inner:
            return engine
    return found[-1]
