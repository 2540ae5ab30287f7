"""The Recorder: watch a training loop and record gradient histograms and the loss-scale trace.

It only observes. Add it around an unchanged loop::

    rec = ampviz.Recorder(model, optimizer, scaler=scaler)     # activations=True, every=1
    with rec:                                  # hooks installed here, removed on exit
        for x, y in loader:
            with torch.amp.autocast(device_type, dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()      # activation-gradient hooks fire here
            scaler.step(optimizer)             # weight gradients are read just before the step
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            rec.step(loss)                     # once per optimizer step, after scaler.update()
    run = rec.run                              # an ampviz.Run

What is stored, and in which domain:

* weight gradients, one histogram per parameter, **unscaled**: read in an optimizer step
  pre-hook, i.e. as the optimizer sees them (after ``GradScaler.unscale_``, after every
  accumulated micro-batch, after DDP's all-reduce, after any clipping). A step the scaler skips
  never reaches the optimizer; its gradients (unscaled in place by ``scaler.step``, containing the
  inf/nan) are read at ``rec.step()`` from references kept when autograd last accumulated them,
  so zeroing with ``set_to_none=True`` before ``rec.step()`` is fine.
* activation gradients, the gradient w.r.t. each chosen module's output, **scaled**: exactly as
  the backward computed them (in fp16 under fp16 autocast, multiplied by the loss scale).
  A forward hook attaches a tensor hook to the output; micro-batches of one step add up.
* per step: the loss you pass, the loss scale the step used, the scale after ``update()``,
  and whether the step was skipped (the scale went down).

``Run.counts_in("unscaled" | "scaled")`` gives either view of both kinds.

Cost: keys and counts stay on the device; there is no host sync per tensor. The counts are
copied to the host once every ``flush_every`` recorded steps. Memory stays bounded on long runs
by **decimation**: when the host store would exceed ``max_bytes``, every other recorded step is
dropped and ``every`` doubles (``run.meta["decimated"]`` says how often).
"""

from __future__ import annotations

import functools
import math
import re
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import __version__
from . import histogram as H
from ._warnings import AmpvizWarning
from .run import Run

__all__ = ["Recorder"]


class Recorder:
    """Record gradient-magnitude histograms and the loss-scale trace of a training loop.

    Parameters
    ----------
    model : the ``nn.Module`` being trained (a DDP wrapper is unwrapped).
    optimizer : its optimizer (recommended). Without it a global optimizer hook is used, which
        fires for any optimizer that steps the model's parameters.
    scaler : the ``torch.amp.GradScaler`` in use, or None (bf16 / fp32 training).
    weights : record weight gradients: True (all trainable parameters), False, a regex on the
        parameter name, a list of names, or a callable ``(name, param) -> bool``.
    local_weights : under DDP, also record each rank's *local* weight gradients, before the
        all-reduce (kind "weight_local", named "<param> [local]", scaled as computed). They are read
        in the backward pass that all-reduces, i.e. the micro-batch outside ``no_sync()``; use
        ``no_sync()`` on the others, or each backward is counted.
    activations : record activation gradients: True (every leaf module that has parameters),
        False, a regex on module names, a list of names, or a callable ``(name, module) -> bool``.
    every : record histograms every ``every`` optimizer steps (scalars are kept for every step).
    flush_every : recorded steps buffered on the device between host copies.
    max_bytes : bound on the host memory of the histograms (decimation beyond it).
    path : if given, the run is saved there (atomically) on exit, also when the loop raises;
        under DDP with several ranks it is a directory receiving ``rank{r}.npz``.
    enabled : False makes the recorder a no-op (no hooks), like ``autocast(enabled=False)``.
    background : count on a background thread (default: on CPU). Overlaps the count with the
        optimizer step; results are identical either way.
    """

    def __init__(self, model, optimizer=None, scaler=None, *, weights=True, activations=True, local_weights=False,
                 every: int = 1, flush_every: int = 32, max_bytes: int = 256 << 20, path=None,
                 enabled: bool = True, background: bool | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler: expected a torch.amp.GradScaler or None, got {type(scaler).__name__}")
        for name, value, low in (("every", every, 1), ("flush_every", flush_every, 1), ("max_bytes", max_bytes, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        self.enabled = bool(enabled)
        self._ddp = model if _is_ddp(model) else None
        if local_weights and self._ddp is None:
            raise ValueError("local_weights: True needs a DistributedDataParallel model (local and reduced "
                             "gradients only differ under DDP)")
        self.model = model.module if self._ddp is not None else model
        self.optimizer, self.every, self.flush_every, self.max_bytes = optimizer, every, flush_every, max_bytes
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.path = Path(path) if path is not None else None
        self._background = background
        self._params = _select(self.model.named_parameters(), weights, "weights",
                               default=lambda n, p: p.requires_grad)
        self._modules = _select(self.model.named_modules(), activations, "activations",
                                default=lambda n, m: n != "" and not list(m.children())
                                and any(True for _ in m.parameters(recurse=False)))
        self._local = bool(local_weights)
        nl = len(self._params) if self._local else 0
        self.tensor_names = ([n for n, _ in self._params] + [n for n, _ in self._modules]
                             + [f"{n} [local]" for n, _ in self._params][:nl])
        self.tensor_kinds = ["weight"] * len(self._params) + ["activation"] * len(self._modules) + ["weight_local"] * nl
        self._dtypes = ([str(p.dtype) for _, p in self._params] + [""] * len(self._modules)
                        + [str(p.dtype) for _, p in self._params][:nl])
        self._handles, self._open, self._closed, self._run = [], False, False, None

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Recorder:
        if self._open:
            raise RuntimeError("Recorder is already open")
        if self._closed:
            raise RuntimeError("Recorder was closed; create a new one to record again")
        self._open = True
        if self.enabled:
            self._setup()
            self._install_hooks()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        return False

    def close(self) -> None:
        """Remove every hook, flush what was recorded, build ``self.run`` and save it if ``path``."""
        if self._closed:
            return
        self._closed, self._open = True, False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if not self.enabled:
            return
        try:
            self._flush()
        finally:
            self._binner.close()
            self._grad_refs = [None] * len(self._params)
        self._run = self._build_run()
        if self.path is not None:
            self._save(self._run)

    @property
    def run(self) -> Run:
        """The recorded run (a snapshot if the recorder is still open)."""
        if not self.enabled:
            raise RuntimeError("Recorder(enabled=False) records nothing")
        if self._run is not None:
            return self._run
        if not self._open:
            raise RuntimeError("Recorder has not been entered yet")
        self._flush()
        return self._build_run()

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        first = next(self.model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._world, self._rank = _dist_info()
        T = len(self.tensor_names)
        numel = sum(p.numel() for _, p in self._params)
        self._binner = H.Binner(self.device, capacity=min(max(numel, 1 << 16), 1 << 24), background=self._background)
        # (flush_every, T, NBINS) counts ring on the device; one host copy per flush
        self._ring = torch.zeros(self.flush_every, T, H.NBINS, dtype=torch.int64, device=self.device)
        self._ring_used, self._ring_steps = 0, []
        # (2, flush_every) per-step scalars on the device: loss, scale after update()
        self._scal = torch.zeros(2, self.flush_every, dtype=torch.float64, device=self.device)
        self._scal_used = 0
        self._host = {"loss": [], "next_scale": [], "hist_steps": [], "counts": []}
        self._step = 0
        self._row_of = {id(p): i for i, (_, p) in enumerate(self._params)}
        self._opt_rows: dict[int, list] = {}
        self._grad_refs = [None] * len(self._params)
        self._weights_done = np.zeros(len(self._params), dtype=bool)
        self._capturing = True
        self._binner.target = self._ring[0].view(-1)
        self._decimations = 0
        self._prev_scale = self._read_init_scale()
        self._created = time.time()

    def _read_init_scale(self) -> float:
        if self.scaler is None:
            return 1.0
        return float(self.scaler.get_scale())        # one host read, at entry only

    def _install_hooks(self) -> None:
        nw = len(self._params)
        for i, (_, module) in enumerate(self._modules):
            self._handles.append(module.register_forward_hook(functools.partial(self._on_forward, nw + i)))
        for i, (_, p) in enumerate(self._params):
            self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_accumulated, i)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._on_optimizer_step))
        elif self._params:
            self._handles.append(register_optimizer_step_pre_hook(self._on_optimizer_step))

    # ------------------------------------------------------------------ hooks (hot path: no host syncs)
    def _on_forward(self, row, module, inputs, output):
        if not self._capturing:
            return
        out = _first_grad_tensor(output)
        if out is not None:
            out.register_hook(functools.partial(self._on_activation_grad, row))

    def _on_activation_grad(self, row, grad):
        if grad is not None:
            self._binner.add(grad, row)
            self._dtypes[row] = str(grad.dtype)

    def _on_accumulated(self, i, param):
        if self._capturing:
            self._grad_refs[i] = param.grad       # a reference, no copy: read at rec.step() if needed
            if self._local and self._ddp.require_backward_grad_sync:   # this backward all-reduces
                self._binner.add(param.grad, len(self._params) + len(self._modules) + i)   # still local

    def _on_optimizer_step(self, optimizer, args, kwargs):
        if not self._capturing:
            return
        rows = self._opt_rows.get(id(optimizer))
        if rows is None:
            rows = [self._row_of[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in self._row_of]
            self._opt_rows[id(optimizer)] = rows
        for i in rows:
            if not self._weights_done[i]:
                g = self._params[i][1].grad
                if g is not None:
                    self._binner.add(g, i)
                self._weights_done[i] = True

    # ------------------------------------------------------------------ per step
    def step(self, loss=None) -> None:
        """Mark the end of one optimizer step (call it after ``scaler.update()``)."""
        if not self.enabled:
            return
        if not self._open:
            raise RuntimeError("Recorder.step() called outside `with recorder:`")
        j = self._scal_used
        if loss is None:
            self._scal[0, j] = math.nan
        elif isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"loss: expected a scalar, got a tensor of shape {tuple(loss.shape)}")
            self._scal[0, j].copy_(loss.detach().reshape(()))
        else:
            self._scal[0, j] = float(loss)
        if self.scaler is not None:
            scale = getattr(self.scaler, "_scale", None)   # device tensor; get_scale() would sync
            if scale is not None:
                self._scal[1, j].copy_(scale.reshape(()))
            else:
                self._scal[1, j] = self.scaler.get_scale()
        else:
            self._scal[1, j] = 1.0
        self._scal_used += 1
        if self._capturing:
            self._finish_histograms()
        self._step += 1
        if self._scal_used == self.flush_every:
            self._flush_scalars()
        self._capturing = self._step % self.every == 0

    def _finish_histograms(self) -> None:
        for i, done in enumerate(self._weights_done):
            if not done:                           # skipped step, or no optimizer hook fired
                g = self._grad_refs[i] if self._grad_refs[i] is not None else self._params[i][1].grad
                if g is not None:
                    self._binner.add(g, i)
        self._weights_done[:] = False
        self._grad_refs = [None] * len(self._params)
        self._binner.submit()
        self._ring_steps.append(self._step)
        self._ring_used += 1
        if self._ring_used == self.flush_every:
            self._flush_counts()
        self._binner.target = self._ring[self._ring_used].view(-1)

    # ------------------------------------------------------------------ flushing (host copies)
    def _flush(self) -> None:
        self._flush_counts()
        self._flush_scalars()

    def _flush_scalars(self) -> None:
        n = self._scal_used
        if n == 0:
            return
        host = self._scal[:, :n].cpu().numpy()          # note: a device->host sync, once per flush
        self._host["loss"].append(host[0].copy())
        self._host["next_scale"].append(host[1].copy())
        self._scal_used = 0

    def _flush_counts(self) -> None:
        self._binner.wait()
        n = self._ring_used
        if n == 0:
            return
        self._host["counts"].append(self._ring[:n].cpu().numpy().copy())   # sync, once per flush
        self._host["hist_steps"].extend(self._ring_steps)
        self._ring.zero_()
        self._ring_used, self._ring_steps = 0, []
        self._binner.target = self._ring[0].view(-1)
        self._maybe_decimate()

    def _maybe_decimate(self) -> None:
        row_bytes = len(self.tensor_names) * H.NBINS * 8
        while len(self._host["hist_steps"]) * row_bytes > self.max_bytes and len(self._host["hist_steps"]) > 1:
            counts = np.concatenate(self._host["counts"])
            steps = np.asarray(self._host["hist_steps"])
            keep = (steps // self.every) % 2 == 0
            self._host["counts"], self._host["hist_steps"] = [counts[keep]], steps[keep].tolist()
            self.every *= 2
            self._decimations += 1
            self._capturing = self._step % self.every == 0
            warnings.warn(f"Recorder: histograms reached max_bytes={self.max_bytes}; keeping every "
                          f"{self.every}th step from now on", AmpvizWarning, stacklevel=4)

    # ------------------------------------------------------------------ the run
    def _build_run(self) -> Run:
        T = len(self.tensor_names)
        nxt = np.concatenate(self._host["next_scale"]) if self._host["next_scale"] else np.zeros(0)
        used = np.concatenate([[self._prev_scale], nxt[:-1]]) if nxt.size else np.zeros(0)
        loss = np.concatenate(self._host["loss"]) if self._host["loss"] else np.zeros(0)
        if self.scaler is not None and self.scaler.get_backoff_factor() < 1:
            skipped = nxt < used
        else:
            skipped = np.zeros(nxt.size, dtype=bool)
        counts = (np.concatenate(self._host["counts"]) if self._host["counts"]
                  else np.zeros((0, T, H.NBINS), dtype=np.int64))
        return Run(np.arange(nxt.size), loss[None], used[None], nxt[None], skipped[None],
                   np.asarray(self._host["hist_steps"], dtype=np.int64), counts[None],
                   list(self.tensor_names), list(self.tensor_kinds), list(self._dtypes), self._meta())

    def _meta(self) -> dict:
        sc = self.scaler
        return {"ampviz_version": __version__, "torch_version": torch.__version__, "device": str(self.device),
                "world_size": self._world, "ranks": [self._rank], "every": self.every,
                "decimated": self._decimations, "created": self._created,
                "domains": {"weight": "unscaled", "activation": "scaled", "weight_local": "scaled"},
                "scaler": None if sc is None else {
                    "init_scale": self._prev_scale, "growth_factor": sc.get_growth_factor(),
                    "backoff_factor": sc.get_backoff_factor(), "growth_interval": sc.get_growth_interval()}}

    def _save(self, run: Run) -> None:
        if self._world > 1 and self.path.suffix != ".npz":
            run.save(self.path / f"rank{self._rank}.npz")
        else:
            run.save(self.path)


# ---------------------------------------------------------------------- helpers
def _is_ddp(model) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def _dist_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def _first_grad_tensor(output):
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad and output.is_floating_point() else None
    if isinstance(output, (tuple, list)):
        for o in output:
            t = _first_grad_tensor(o)
            if t is not None:
                return t
    return None


def _select(named, spec, argname: str, default) -> list:
    """Apply a True / False / regex / list-of-names / callable filter to named parameters or modules."""
    items = list(named)
    if spec is False or spec is None:
        return []
    if spec is True:
        return [(n, x) for n, x in items if default(n, x)]
    if isinstance(spec, str):
        try:
            pattern = re.compile(spec)
        except re.error as e:
            raise ValueError(f"{argname}: invalid regular expression {spec!r}: {e}") from None
        chosen = [(n, x) for n, x in items if n and pattern.search(n)]
    elif callable(spec):
        chosen = [(n, x) for n, x in items if spec(n, x)]
    elif isinstance(spec, (list, tuple, set)):
        names = {n for n, _ in items}
        unknown = [s for s in spec if s not in names]
        if unknown:
            raise ValueError(f"{argname}: no such names {unknown[:5]}; known: {sorted(names)[:8]} ...")
        chosen = [(n, x) for n, x in items if n in set(spec)]
    else:
        raise TypeError(f"{argname}: expected True, False, a regex string, a list of names or a callable, "
                        f"got {type(spec).__name__}")
    if not chosen:
        raise ValueError(f"{argname}: the filter {spec!r} matches nothing in the model")
    return chosen
