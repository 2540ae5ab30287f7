"""A DDP + AMP classification Trainer (train / dev / test), written the way PyTorch documents it.

It rebuilds the DDP + AMP Trainer of *图解分布式训练（五）—— AMP混合精度训练 详细解析* (宁静致远,
AI大模型面试宝典, 2023), with its mistakes fixed:

* only the forward pass and the loss run inside ``autocast``; ``backward``, ``scaler.step`` and
  ``scaler.update`` run outside it;
* no ``barrier()`` in the training step: DDP's gradient all-reduce already keeps ranks in step;
  the one barrier is after rank 0's evaluation and checkpoint, so no rank runs ahead of the file;
* gradient accumulation skips the all-reduce with ``no_sync()`` on the micro-batches that do not step;
* ``train(loader, sampler, steps, dev=None)`` (the article put a required argument after a defaulted
  one, which does not parse), and ``sampler.set_epoch(epoch)`` at every epoch;
* evaluation counts every example once: on rank 0 over the whole dev / test set with the unwrapped
  module (:meth:`Trainer.evaluate`), or shared by all ranks with the ``DistributedSampler``'s padding
  trimmed after an ``all_gather`` (:meth:`Trainer.evaluate_sharded`, for splits too big for one rank);
  checkpoints hold ``module.state_dict()`` and are loaded with
  ``torch.load(..., weights_only=True, map_location=device)``.

Usage (inside a process group, e.g. under torchrun; see ``ampviz.examples.ddp_amp``)::

    trainer = Trainer(ddp_model, optimizer, scaler, device=device, amp_dtype=torch.float16, accum=2)
    history = trainer.train(loader, sampler, steps=60, dev=(x_dev, y_dev), eval_every=20, checkpoint="best.pt")
    print(trainer.report(x_test, y_test))
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from .._args import check_int
from ..record import Recorder
from ..run import Run
from .data import Split

__all__ = ["Trainer", "load_checkpoint", "TrainResult", "train_classifier", "accuracy"]


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
    loss_fn : ``loss_fn(model(x), y)``, the mean loss of a micro-batch (default cross-entropy).
    """

    def __init__(self, model, optimizer, scaler, *, device, amp_dtype=torch.float16, accum: int = 1,
                 recorder=None, progress: bool = True, loss_fn=F.cross_entropy):
        check_int("accum", accum, low=1)
        if amp_dtype not in (torch.float16, torch.bfloat16, None):
            raise ValueError(f"amp_dtype: expected torch.float16, torch.bfloat16 or None, got {amp_dtype!r}")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.device, self.amp_dtype, self.accum = torch.device(device), amp_dtype, accum
        self.recorder, self.progress, self.loss_fn = recorder, progress, loss_fn
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
                    loss = self.loss_fn(self.model(x.to(self.device)), y.to(self.device)) / len(micro_batches)
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

    @torch.no_grad()
    def evaluate_sharded(self, x, y, batch: int = 512) -> tuple[float, float]:
        """Mean cross-entropy and accuracy on the whole of (x, y), the work shared by every rank.

        Call it on **every** rank (it runs collectives). Rank r evaluates the indices a
        ``DistributedSampler(shuffle=False)`` gives it; the sampler pads the split with repeated
        examples so that it divides by the world size. ``all_gather`` collects every rank's
        per-example loss and correctness (equal lengths, thanks to the padding), and the padding
        is trimmed before averaging, so each example counts exactly once and every rank returns
        the numbers :meth:`evaluate` gives on one process.
        """
        from torch.utils.data import DistributedSampler
        n = len(y)
        mine = list(DistributedSampler(range(n), num_replicas=self.world, rank=self.rank, shuffle=False))
        idx = torch.tensor(mine, dtype=torch.long)
        logits = self.predict(x[idx], batch=batch)                          # (len(mine), classes)
        target = y[idx].to(self.device)
        per_example = torch.stack([F.cross_entropy(logits, target, reduction="none"),
                                   (logits.argmax(1) == target).float()], dim=1)   # (len(mine), 2)
        if self.world > 1:
            gathered = [torch.empty_like(per_example) for _ in range(self.world)]
            dist.all_gather(gathered, per_example)
            # rank r holds positions r, r + world, ...: interleave back to sampler order, then trim
            per_example = torch.stack(gathered, dim=1).reshape(-1, 2)
        loss, correct = per_example[:n].mean(dim=0).tolist()                # a host sync
        return loss, correct

    def report(self, x, y, labels=None) -> str:
        """scikit-learn's classification report on (x, y)."""
        from sklearn.metrics import classification_report
        pred = self.predict(x).argmax(1).cpu().numpy()
        names = labels if labels is not None else [str(c) for c in np.unique(y.cpu().numpy())]
        return classification_report(y.cpu().numpy(), pred, target_names=names, digits=3, zero_division=0)


def load_checkpoint(module, path, device) -> None:
    """Load a ``state_dict`` saved by :meth:`Trainer.train` into ``module`` (no pickled code runs)."""
    module.load_state_dict(torch.load(path, map_location=device, weights_only=True))


@dataclass
class TrainResult:
    """What :func:`train_classifier` returns."""

    run: Run | None               # the recorded run (None with ``record=False``)
    losses: np.ndarray            # (steps,) training loss of each step's batch
    weights_changed: np.ndarray   # (steps,) bool: the optimizer step changed some parameter
    test_accuracy: float          # accuracy on the test split after training (nan for regression)
    seconds: float                # wall time of the loop
    model: torch.nn.Module

    @property
    def skipped(self) -> np.ndarray:
        """(steps,) bool: the scaler skipped the step (the scale went down), from the run."""
        if self.run is None:
            raise ValueError("skipped: this result was trained with record=False")
        return self.run.skipped[0]


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Classification accuracy in fp32 (a host sync)."""
    return float((model(x).argmax(-1) == y).float().mean())


def train_classifier(model: torch.nn.Module, data: Split, *, steps: int, batch_size: int = 256,
                     lr: float = 1e-2, amp_dtype: torch.dtype | None = None,
                     scaler: torch.amp.GradScaler | None = None, seed: int = 1, record: bool = True,
                     every: int = 1, activations=True, loss_fn=F.cross_entropy,
                     progress: bool = False) -> TrainResult:
    """Train ``model`` with Adam on random batches of ``data``, optionally under autocast and a scaler.

    Parameters
    ----------
    model : the model, already on its device (the data is moved there).
    data : an :class:`ampviz.examples.data.Split`.
    steps, batch_size, lr : optimizer steps, batch size, Adam learning rate.
    amp_dtype : None (fp32), ``torch.float16`` or ``torch.bfloat16`` for the autocast region.
    scaler : a ``torch.amp.GradScaler``; None means ``GradScaler(enabled=False)``, i.e. no scaling
        (its ``scale``/``step``/``update`` then pass through).
    seed : seeds the batch order (the model's own seed is set where it is built).
    record : record the run with :class:`ampviz.Recorder` (``every``, ``activations`` passed on).
    loss_fn : ``loss_fn(model(x), y)``; mean cross-entropy by default (give your own, e.g. an MSE,
        for a regression Split, whose ``n_classes`` is 0: its test accuracy is then nan).
    progress : show a tqdm bar.

    Returns
    -------
    TrainResult
    """
    for name, value in (("steps", steps), ("batch_size", batch_size), ("every", every)):
        check_int(name, value, low=1)
    if amp_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"amp_dtype: expected None, torch.float16 or torch.bfloat16, got {amp_dtype!r}")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler: expected a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    device = next(model.parameters()).device
    data = data.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = scaler if scaler is not None else torch.amp.GradScaler(device.type, enabled=False)
    batches = torch.Generator().manual_seed(seed)
    recorder = Recorder(model, optimizer, scaler=scaler, every=every, activations=activations,
                        enabled=record)
    trainer = Trainer(model, optimizer, scaler, device=device, amp_dtype=amp_dtype, progress=False, loss_fn=loss_fn)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    losses = torch.zeros(steps, dtype=torch.float32, device=device)
    changed = torch.zeros(steps, dtype=torch.bool, device=device)
    start = time.perf_counter()
    with recorder:
        for step in tqdm(range(steps), disable=not progress, desc="training", unit="step"):
            idx = torch.randint(0, len(data.x_train), (batch_size,), generator=batches).to(device)
            loss = trainer.train_step([(data.x_train[idx], data.y_train[idx])])    # one micro-batch per step
            recorder.step(loss)
            losses[step] = loss
            changed[step] = _changed_and_copy(params, before)
    seconds = time.perf_counter() - start
    test_accuracy = accuracy(model, data.x_test, data.y_test) if data.n_classes else float("nan")
    return TrainResult(recorder.run if record else None, losses.cpu().numpy(), changed.cpu().numpy(),
                       test_accuracy, seconds, model)


def _changed_and_copy(params, before) -> torch.Tensor:
    """True when any parameter differs from its copy in ``before``; then refresh the copies."""
    diff = torch.zeros((), dtype=torch.bool, device=params[0].device)
    for p, b in zip(params, before):
        diff |= (p.detach() != b).any()       # stays on the device: no host sync per step
        b.copy_(p.detach())
    return diff
