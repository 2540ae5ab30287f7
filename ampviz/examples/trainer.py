"""A DDP + AMP classification Trainer (train / dev / test), written the way PyTorch documents it.

It is the Trainer of the seed article rebuilt, with its mistakes fixed:

* only the forward pass and the loss run inside ``autocast``; ``backward``, ``scaler.step`` and
  ``scaler.update`` run outside it;
* no ``barrier()`` in the training step: DDP's gradient all-reduce already keeps ranks in step;
  the one barrier is after rank 0's evaluation and checkpoint, so no rank runs ahead of the file;
* gradient accumulation skips the all-reduce with ``no_sync()`` on the micro-batches that do not step;
* ``train(loader, sampler, steps, dev=None)`` (the seed put a required argument after a defaulted one,
  which does not parse), and ``sampler.set_epoch(epoch)`` at every epoch;
* evaluation on rank 0 over the whole dev / test set with the unwrapped module (a padded
  ``DistributedSampler`` would count some examples twice); checkpoints hold ``module.state_dict()``
  and are loaded with ``torch.load(..., weights_only=True, map_location=device)``.

Usage (inside a process group, e.g. under torchrun; see ``ampviz.examples.ddp_amp``)::

    trainer = Trainer(ddp_model, optimizer, scaler, device=device, amp_dtype=torch.float16, accum=2)
    history = trainer.train(loader, sampler, steps=60, dev=(x_dev, y_dev), eval_every=20, checkpoint="best.pt")
    print(trainer.report(x_test, y_test))
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

__all__ = ["Trainer", "load_checkpoint"]


class Trainer:
    """Train a (DDP-wrapped) classifier with autocast, a GradScaler and gradient accumulation.

    Parameters
    ----------
    model : the model, wrapped in ``DistributedDataParallel`` when there are several ranks.
    optimizer, scaler : the optimizer and a ``torch.amp.GradScaler`` (disabled for bf16 / fp32).
    device : the device of this rank.
    amp_dtype : ``torch.float16``, ``torch.bfloat16`` or None (no autocast).
    accum : micro-batches per optimizer step.
    recorder : an ``ampviz.Recorder`` (already entered) to call ``step(loss)`` on, or None.
    progress : show a progress bar (on rank 0 only).
    """

    def __init__(self, model, optimizer, scaler, *, device, amp_dtype=torch.float16, accum: int = 1,
                 recorder=None, progress: bool = True):
        if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
            raise ValueError(f"accum: expected an integer >= 1, got {accum!r}")
        if amp_dtype not in (torch.float16, torch.bfloat16, None):
            raise ValueError(f"amp_dtype: expected torch.float16, torch.bfloat16 or None, got {amp_dtype!r}")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.device, self.amp_dtype, self.accum = torch.device(device), amp_dtype, accum
        self.recorder, self.progress = recorder, progress
        self.is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self.module = model.module if self.is_ddp else model
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def autocast(self):
        return torch.amp.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                  enabled=self.amp_dtype is not None)

    # ------------------------------------------------------------------ training
    def train_step(self, micro_batches) -> torch.Tensor:
        """One optimizer step over ``accum`` micro-batches; returns this rank's mean loss (a tensor)."""
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # all-reduce only in the last backward; earlier ones just accumulate .grad locally
            sync = contextlib.nullcontext() if last or not self.is_ddp else self.model.no_sync()
            with sync:
                with self.autocast():                       # forward and loss only
                    loss = F.cross_entropy(self.model(x.to(self.device)), y.to(self.device)) / len(micro_batches)
                self.scaler.scale(loss).backward()          # outside autocast
            total += loss.detach()
        self.scaler.step(self.optimizer)                    # skipped if any (all-reduced) gradient is inf/nan
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def batches(self, loader, sampler):
        """Groups of ``accum`` micro-batches, epoch after epoch, with ``sampler.set_epoch(epoch)``."""
        epoch = 0
        while True:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)                    # a new shuffle, the same on every rank
            group = []
            for batch in loader:
                group.append(batch)
                if len(group) == self.accum:
                    yield group
                    group = []
            epoch += 1

    def train(self, loader, sampler, steps: int, dev=None, eval_every: int | None = None, checkpoint=None,
              fail_at=None) -> dict:
        """Train for ``steps`` optimizer steps; every ``eval_every`` steps rank 0 evaluates ``dev`` and
        saves ``checkpoint`` when dev accuracy improves. Returns the history (the same on every rank).

        ``fail_at`` is a callable ``(step) -> None`` run before every step (the examples use it to
        make one rank fail on purpose)."""
        history = {"step": [], "loss": [], "dev_step": [], "dev_loss": [], "dev_accuracy": []}
        best = -1.0
        self.model.train()
        bar = tqdm(total=steps, desc="train", disable=not self.progress or self.rank != 0, leave=False)
        for step, group in zip(range(steps), self.batches(loader, sampler)):
            if fail_at is not None:
                fail_at(step)
            loss = self.train_step(group)
            if self.recorder is not None:
                self.recorder.step(loss)
            bar.update(1)
            if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
                mean_loss = self.mean_over_ranks(loss)      # one all-reduce per evaluation, not per step
                history["step"].append(step)
                history["loss"].append(mean_loss)
                if dev is not None and self.rank == 0:
                    dev_loss, dev_acc = self.evaluate(*dev)
                    history["dev_step"].append(step)
                    history["dev_loss"].append(dev_loss)
                    history["dev_accuracy"].append(dev_acc)
                    bar.set_postfix(loss=f"{mean_loss:.3f}", dev_acc=f"{dev_acc:.3f}")
                    if checkpoint is not None and dev_acc > best:
                        best = dev_acc
                        torch.save(self.module.state_dict(), checkpoint)
                if self.world > 1:
                    dist.barrier()                          # the others wait for rank 0's evaluation and file
        bar.close()
        return history

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        """The mean of a scalar over all ranks (an all-reduce; a host sync)."""
        value = value.detach().clone().reshape(1).float()
        if self.world > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return float(value) / self.world

    # ------------------------------------------------------------------ evaluation (call on one rank)
    @torch.no_grad()
    def predict(self, x, batch: int = 512) -> torch.Tensor:
        """Logits of the unwrapped module (no collectives, so rank 0 can call it alone)."""
        was_training = self.module.training
        self.module.eval()
        out = []
        for i in range(0, len(x), batch):
            with self.autocast():
                out.append(self.module(x[i:i + batch].to(self.device)).float())
        self.module.train(was_training)
        return torch.cat(out)

    def evaluate(self, x, y) -> tuple[float, float]:
        """Mean cross-entropy and accuracy on the whole of (x, y)."""
        logits = self.predict(x)
        y = y.to(self.device)
        return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())

    def report(self, x, y, labels=None) -> str:
        """scikit-learn's classification report on (x, y)."""
        from sklearn.metrics import classification_report
        pred = self.predict(x).argmax(1).cpu().numpy()
        names = labels if labels is not None else [str(c) for c in np.unique(y.cpu().numpy())]
        return classification_report(y.cpu().numpy(), pred, target_names=names, digits=3, zero_division=0)


def load_checkpoint(module, path, device) -> None:
    """Load a ``state_dict`` saved by :meth:`Trainer.train` into ``module`` (no pickled code runs)."""
    module.load_state_dict(torch.load(path, map_location=device, weights_only=True))
