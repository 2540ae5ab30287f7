"""ampviz for Hugging Face Accelerate: a Recorder built in one line from an ``Accelerator`` and what it prepared.

::

    from ampviz.integrations.accelerate import Recorder

    accelerator = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    rec = Recorder(accelerator, model, optimizer, path="runs/acc.npz")      # the one line
    with rec:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            rec.step(loss)            # after every optimizer.step() call, as above

It is an ``ampviz.Recorder`` with the scaler taken from ``accelerator.scaler`` (accelerate makes a GradScaler
for fp16 off the CPU) and the prepared model and optimizer unwrapped (DDP, ``AcceleratedOptimizer``).
``rec.step(loss)`` may be called after every ``optimizer.step()``, also under ``accelerator.accumulate``,
where accelerate only really steps on the last micro-batch: a step is recorded when
``accelerator.sync_gradients`` says the optimizer stepped, with the mean of the losses passed since the
last recorded step (the accumulated batch's loss).

Measured with accelerate 1.15 on a CPU: ``mixed_precision="fp16"`` trains in fp32 there (no autocast, no
GradScaler; the Recorder warns), ``"bf16"`` autocasts to bf16 without a scaler.
"""

from __future__ import annotations

import warnings

import torch

from .. import record
from .._warnings import AmpvizWarning
from ._common import FP16_ON_CPU

__all__ = ["Recorder"]


class Recorder(record.Recorder):
    """An ``ampviz.Recorder`` for a training loop driven by ``accelerator`` (accelerate's ``Accelerator``).

    Parameters
    ----------
    accelerator : the ``Accelerator`` that prepared ``model`` and ``optimizer``.
    model, optimizer : as returned by ``accelerator.prepare(...)``.
    options, **kw : every other ``ampviz.Recorder`` option (``path=``, ``weights=``, ``activations=``, ``every=``,
        ...), as an ``ampviz.RecordOptions`` and/or keywords, as for ``ampviz.Recorder``.
    """

    def __init__(self, accelerator, model, optimizer=None, *, options: record.RecordOptions | None = None, **kw):
        if not hasattr(accelerator, "sync_gradients") or not hasattr(accelerator, "scaler"):
            raise TypeError(f"accelerator: expected an accelerate.Accelerator, got {type(accelerator).__name__}")
        if "scaler" in kw:
            raise TypeError("scaler: taken from accelerator.scaler; do not pass it")
        if (accelerator.mixed_precision == "fp16" and accelerator.scaler is None
                and accelerator.device.type == "cpu"):
            warnings.warn(f"Recorder: Accelerator(mixed_precision='fp16') {FP16_ON_CPU}", AmpvizWarning, stacklevel=2)
        super().__init__(model, optimizer, scaler=accelerator.scaler, options=options, **kw)
        self.accelerator = accelerator
        self._loss_sum, self._losses = None, 0

    def step(self, loss=None) -> None:
        """Call after every ``optimizer.step()``; records a step when accelerate's optimizer really stepped
        (``accelerator.sync_gradients``), with the mean of the losses given since the last recorded step."""
        if loss is not None:
            value = loss.detach().reshape(()).float() if isinstance(loss, torch.Tensor) else float(loss)
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value    # on the device: no sync
            self._losses += 1
        if not self.accelerator.sync_gradients:
            return                                    # a micro-batch of an accumulated step
        mean = None if self._loss_sum is None else self._loss_sum / self._losses
        self._loss_sum, self._losses = None, 0
        super().step(mean)
