"""ampviz for Lightning: a ``Callback`` that records what ``lightning.Trainer`` trains.

::

    import lightning as L
    from ampviz.integrations.lightning import AmpvizCallback

    callback = AmpvizCallback(path="runs/pl.npz", every=10)       # any other ampviz.Recorder option too
    trainer = L.Trainer(precision="bf16-mixed", accumulate_grad_batches=4, callbacks=[callback])
    trainer.fit(module, loader)
    callback.run                                                 # the ampviz.Run, also saved at path

What it reads (at ``on_train_start``): the LightningModule, its optimizer (``trainer.optimizers``; with
several, every optimizer that steps the module's parameters), and the GradScaler of the precision plugin
(``trainer.precision_plugin.scaler``: "16-mixed" has one, "bf16-mixed" and "32-true" have none), and its LR
scheduler when there is one (its step count is recorded: ``ampviz doctor`` tells whether it stepped on
skipped steps).

One optimizer step is recorded per step Lightning takes: ``on_before_optimizer_step`` marks that the
current batch steps, ``on_train_batch_end`` (after the step and ``scaler.update()``) records it. The loss
of the step is the sum over its batches of ``outputs["loss"]``, which Lightning has already divided by
``accumulate_grad_batches``: the mean loss of the accumulated batch, as it was backpropagated.

Measured with lightning 2.6.6 on a CPU: ``precision="16-mixed"`` with ``accelerator="cpu"`` is replaced by
"bf16-mixed" (with a warning); ``plugins=[MixedPrecision("16-mixed", "cpu")]`` runs fp16 autocast with a
``GradScaler("cpu")``. Without a scaler, Lightning calls ``optimizer.step(closure)``: the closure runs the
forward and backward inside the step, which the Recorder handles.

The hooks are removed and the run saved at ``on_train_end``, and also when training raises
(``on_exception``). Each ``fit()`` starts a new recording.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .._extras import MissingExtra
from ._common import Session

try:
    from lightning.pytorch import Callback
except ImportError:                                    # pragma: no cover - depends on the environment
    raise MissingExtra("ampviz.integrations.lightning needs lightning, which is not installed: "
                       "pip install lightning") from None

__all__ = ["AmpvizCallback"]


class AmpvizCallback(Callback):
    """Record a Lightning run with an ``ampviz.Recorder``: gradients, loss scale, skipped steps, loss.

    Parameters
    ----------
    path : where the run is saved at the end of training, or None (as ``ampviz.Recorder``'s ``path``: under
        DDP each rank writes its own file).
    tensorboard : a log directory to export to live (see ``ampviz.export``), or None.
    wandb : True to export live to the active W&B run (``WandbLogger`` starts one), a W&B run, or False.
    export_every : optimizer steps between live exports (default: the Trainer's ``log_every_n_steps``).
    domain : what the export writes: "recorded" (default), "unscaled" or "scaled".
    **recorder_options : ``ampviz.Recorder``'s options (``weights=``, ``every=``, ...), checked here into one
        ``ampviz.RecordOptions`` that every recording of this callback uses.
    """

    def __init__(self, path=None, *, tensorboard=None, wandb=False, export_every=None, domain="recorded",
                 **recorder_options):
        self._session = Session("AmpvizCallback", path, recorder_options, tensorboard, wandb, export_every, domain)
        self._stepped = False

    @property
    def run(self):
        """The ``ampviz.Run`` of the last finished ``fit()`` (None before)."""
        return self._session.run

    @property
    def recorder(self):
        """The open ``ampviz.Recorder`` during training, else None."""
        return self._session.recorder

    def on_train_start(self, trainer, pl_module):
        optimizers = trainer.optimizers
        optimizer = optimizers[0] if len(optimizers) == 1 else None       # None: the Recorder's global hook
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        configs = trainer.lr_scheduler_configs
        scheduler = configs[0].scheduler if len(configs) == 1 else None
        self._session.start(pl_module, optimizer, scaler, scheduler,
                            default_export_every=max(trainer.log_every_n_steps, 1))
        self._stepped = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._stepped = True                 # this batch ends an optimizer step (also one the scaler skips)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self._session.open:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        self._session.add_loss(loss if isinstance(loss, torch.Tensor) else None)
        if self._stepped:
            self._session.step()
            self._stepped = False

    def on_train_end(self, trainer, pl_module):
        self._session.close()

    def on_exception(self, trainer, pl_module, exception):
        self._session.close()                # hooks removed, what was recorded saved

    def teardown(self, trainer, pl_module, stage):
        self._session.close()
