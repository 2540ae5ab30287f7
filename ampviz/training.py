"""Small, deterministic training runs for the lessons, recorded with :class:`ampviz.Recorder`.

The loop in :func:`train_classifier` is the ordinary AMP loop a user writes (autocast around the
forward, ``scaler.scale(loss).backward()``, ``scaler.step``, ``scaler.update``); ampviz only
watches it. One function serves fp32, bf16 and fp16 runs with or without loss scaling, so a
lesson compares them by changing arguments, not code::

    import torch, ampviz
    from ampviz.training import sigmoid_mlp, train_classifier
    data = ampviz.data.digits()
    fp16 = train_classifier(sigmoid_mlp(seed=0), data, steps=200, amp_dtype=torch.float16,
                            scaler=torch.amp.GradScaler("cpu", growth_interval=20))
    fp16.run.skipped.sum(), fp16.test_accuracy, fp16.weights_changed[fp16.run.skipped[0]].any()

The deep sigmoid MLP has vanishing gradients on purpose: its first layers' gradients are small
enough for fp16 to flush them to zero, which makes loss scaling visibly matter on a CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .data import Split
from .models import MLP
from .record import Recorder
from .run import Run

__all__ = ["TrainResult", "train_classifier", "sigmoid_mlp", "relu_mlp", "static_scaler", "accuracy"]


def sigmoid_mlp(seed: int = 0, depth: int = 6, width: int = 64, d_in: int = 64, d_out: int = 10,
                device=None) -> MLP:
    """The vanishing-gradient network of lessons 04/05: ``depth`` sigmoid layers of ``width`` units."""
    torch.manual_seed(seed)
    return MLP(d_in, width, depth, d_out, act="sigmoid").to(device or "cpu")


def relu_mlp(seed: int = 0, depth: int = 3, width: int = 128, d_in: int = 64, d_out: int = 10,
             device=None) -> MLP:
    """An ordinary ReLU MLP (milder, realistic underflow late in training)."""
    torch.manual_seed(seed)
    return MLP(d_in, width, depth, d_out, act="relu").to(device or "cpu")


def static_scaler(device, scale: float = 2.0 ** 12) -> torch.amp.GradScaler:
    """A GradScaler used as a static loss scale: its growth interval is beyond any run's length.

    It still checks for inf/nan and would skip (and halve the scale) on an overflow, so a run
    that used it was truly static only if ``run.skipped`` is all False: check it.
    """
    if not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    device = torch.device(device)
    return torch.amp.GradScaler(device.type, init_scale=float(scale), growth_interval=2 ** 30)


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
    data : an :class:`ampviz.data.Split`.
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
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
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
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    losses = torch.zeros(steps, dtype=torch.float32, device=device)
    changed = torch.zeros(steps, dtype=torch.bool, device=device)
    start = time.perf_counter()
    with recorder:
        for step in tqdm(range(steps), disable=not progress, desc="training", unit="step"):
            idx = torch.randint(0, len(data.x_train), (batch_size,), generator=batches).to(device)
            with torch.amp.autocast(device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                loss = loss_fn(model(data.x_train[idx]), data.y_train[idx])
            scaler.scale(loss).backward()
            scaler.step(optimizer)          # skipped when the unscaled gradients hold inf/nan
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            recorder.step(loss)
            losses[step] = loss.detach()
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
