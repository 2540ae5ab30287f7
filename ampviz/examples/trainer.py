"""A DDP + AMP classification Trainer (train / dev / test), written the way PyTorch documents it.

It rebuilds the DDP + AMP Trainer of *图解分布式训练（五）—— AMP混合精度训练 详细解析* (宁静致远,
AI大模型面试宝典, 2023), with its mistakes fixed:

* only the forward pass and the loss run inside ``autocast``; ``backward``, ``scaler.step`` and
  ``scaler.update`` run outside it;
* no ``barrier()`` in the training step: DDP's gradient all-reduce already keeps ranks in step;
  the one barrier is after rank 0's evaluation and checkpoint, so no rank runs ahead of the file;
* gradient accumulation skips the all-reduce with ``no_sync()`` on the micro-batches that do not step;
* ``optimizer.zero_grad()`` after every step (the article never clears the gradients, so each step adds
  to all the previous ones);
* optional clipping after ``scaler.unscale_`` (``max_grad_norm``), and an LR ``scheduler`` that steps
  only when the optimizer did (a step the scaler skipped leaves the schedule where it was);
* resumable checkpoints (:meth:`Trainer.state_dict`: model, optimizer, scaler, scheduler and step),
  written by rank 0 and restored on **every** rank (:meth:`Trainer.resume`);
* ``train(loader, sampler, steps, dev=None)`` (the article put a required argument after a defaulted
  one, which does not parse), and ``sampler.set_epoch(epoch)`` at every epoch;
* evaluation counts every example once: on rank 0 over the whole dev / test set with the unwrapped
  module (:meth:`Trainer.evaluate`), or shared by all ranks with the ``DistributedSampler``'s padding
  trimmed after an ``all_gather`` (:meth:`Trainer.evaluate_sharded`, for splits too big for one rank);
  checkpoints hold ``module.state_dict()`` and are loaded with
  ``torch.load(..., weights_only=True, map_location=device)``.

Usage (inside a process group, e.g. under torchrun; see ``ampviz.examples.ddp_amp``)::

    scheduler = linear_warmup(optimizer, warmup=6, total=60)
    trainer = Trainer(ddp_model, optimizer, scaler, device=device, amp_dtype=torch.float16, accum=2,
                      max_grad_norm=1.0, scheduler=scheduler)
    trainer.resume("state.pt")                    # optional, on every rank: continue a saved run
    history = trainer.train(loader, sampler, steps=60, dev=(x_dev, y_dev), eval_every=20, checkpoint="best.pt",
                            state="state.pt")
    print(trainer.report(x_test, y_test))
"""

from __future__ import annotations

import contextlib
import itertools
import os
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
from .evaluation import Evaluation
from .fixtures import Split

__all__ = ["Trainer", "load_checkpoint", "linear_warmup", "TrainResult", "train_classifier", "accuracy"]


class Trainer(Evaluation):
    """Train a (DDP-wrapped) classifier with autocast, a GradScaler and gradient accumulation.

    Evaluation (``predict``, ``evaluate``, ``evaluate_sharded``, ``report``) comes from
    :class:`ampviz.examples.evaluation.Evaluation`.

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
    max_grad_norm : clip the gradients' total norm to this, after ``scaler.unscale_`` (None: no clipping).
    scheduler : an LR scheduler, stepped after every optimizer step that the scaler did not skip.

    ``step`` counts the optimizer steps taken so far (skipped ones included); a resumed run continues from it.
    """

    def __init__(self, model, optimizer, scaler, *, device, amp_dtype=torch.float16, accum: int = 1,
                 recorder=None, progress: bool = True, loss_fn=F.cross_entropy, max_grad_norm: float | None = None,
                 scheduler=None):
        check_int("accum", accum, low=1)
        if amp_dtype not in (torch.float16, torch.bfloat16, None):
            raise ValueError(f"amp_dtype: expected torch.float16, torch.bfloat16 or None, got {amp_dtype!r}")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm: expected a positive number or None, got {max_grad_norm!r}")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.max_grad_norm, self.scheduler, self.step = max_grad_norm, scheduler, 0
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
        if self.max_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)            # the true gradients: a norm in their units (lesson 09)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        scale = self.scaler.get_scale() if self.scheduler is not None else None    # a host sync
        self.scaler.step(self.optimizer)                    # skipped if any (all-reduced) gradient is inf/nan
        self.scaler.update()
        if self.scheduler is not None and not self.scaler.get_scale() < scale:
            self.scheduler.step()                           # a skipped step (the scale went down) is not counted
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total

    def batches(self, loader, sampler, start: int = 0):
        """Groups of ``accum`` micro-batches, epoch after epoch, with ``sampler.set_epoch(epoch)``.

        ``start`` optimizer steps are skipped first (a resumed run): with a sampler whose order
        depends only on its epoch (``DistributedSampler``), the groups are those the run would have had."""
        epoch = offset = 0
        if start:                                           # an epoch's leftover micro-batches are dropped
            epoch, done = divmod(start, len(loader) // self.accum)
            offset = done * self.accum
        while True:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)                    # a new shuffle, the same on every rank
            group = []
            for batch in itertools.islice(loader, offset, None):
                group.append(batch)
                if len(group) == self.accum:
                    yield group
                    group = []
            epoch, offset = epoch + 1, 0

    def train(self, loader, sampler, steps: int, dev=None, eval_every: int | None = None, checkpoint=None,
              fail_at=None, state=None) -> dict:
        """Train until ``steps`` optimizer steps are done (from :attr:`step`, so a resumed run continues);
        every ``eval_every`` steps rank 0 evaluates ``dev``, saves ``checkpoint`` (the module's weights)
        when dev accuracy improves and ``state`` (:meth:`state_dict`, to resume from), then every rank
        waits at one barrier. Returns the history (the same on every rank).

        ``fail_at`` is a callable ``(step) -> None`` run before every step (the examples use it to
        make one rank fail on purpose)."""
        history = {"step": [], "loss": [], "dev_step": [], "dev_loss": [], "dev_accuracy": []}
        best = -1.0
        self.model.train()
        bar = tqdm(total=steps, initial=self.step, desc="train", disable=not self.progress or self.rank != 0,
                   leave=False)
        for step, group in zip(range(self.step, steps), self.batches(loader, sampler, start=self.step)):
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
                if self.rank == 0:
                    if dev is not None:
                        dev_loss, dev_acc = self.evaluate(*dev)
                        history["dev_step"].append(step)
                        history["dev_loss"].append(dev_loss)
                        history["dev_accuracy"].append(dev_acc)
                        bar.set_postfix(loss=f"{mean_loss:.3f}", dev_acc=f"{dev_acc:.3f}")
                        if checkpoint is not None and dev_acc > best:
                            best = dev_acc
                            _save(self.module.state_dict(), checkpoint)
                    if state is not None:
                        _save(self.state_dict(), state)
                if self.world > 1:
                    dist.barrier()                          # the others wait for rank 0's evaluation and files
        bar.close()
        return history

    # ------------------------------------------------------------------ checkpoints that resume a run
    def state_dict(self) -> dict:
        """What a resumed run needs: the step, the module's weights, the optimizer's, scaler's and
        scheduler's states. Tensors, numbers and containers only, so it loads with ``weights_only=True``."""
        state = {"step": self.step, "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scaler": self.scaler.state_dict()}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`. Call it on **every** rank: DDP broadcasts weights only in its
        constructor, and nothing ever synchronises optimizer, scaler or scheduler states. The optimizer
        adopts the tensors of ``state`` (no copy) and training then changes them: load a fresh ``state``
        for every restore."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state["scaler"]:                                 # empty when the scaler was disabled (bf16, fp32)
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])

    def resume(self, path) -> None:
        """Load a state saved by :meth:`train` (``state=``) on this rank: no pickled code runs, tensors
        land on this rank's device."""
        self.load_state_dict(torch.load(path, map_location=self.device, weights_only=True))

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        """The mean of a scalar over all ranks (an all-reduce; a host sync)."""
        value = value.detach().clone().reshape(1).float()
        if self.world > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return float(value) / self.world



def _save(obj, path) -> None:
    """``torch.save`` to a temporary file, then rename: a reader sees the old file or the whole new one."""
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def linear_warmup(optimizer, warmup: int, total: int):
    """The BERT schedule: the learning rate rises linearly over ``warmup`` steps, then falls linearly
    to 0 at step ``total`` (a ``LambdaLR``; its state_dict loads with ``weights_only=True``)."""
    check_int("warmup", warmup, low=0)
    check_int("total", total, low=1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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
    data : an :class:`ampviz.lessons.data.Split`.
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
