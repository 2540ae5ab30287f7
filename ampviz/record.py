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
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import __version__
from ._args import check_int
from ._binning import group_offsets
from ._binning_numba import make_counter
from ._record_store import StepStore
from ._record_targets import dist_info, first_grad_tensor, is_ddp, select
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
    """

    def __init__(self, model, optimizer=None, scaler=None, *, weights=True, activations=True, local_weights=False,
                 every: int = 1, flush_every: int = 32, max_bytes: int = 256 << 20, path=None,
                 enabled: bool = True):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler: expected a torch.amp.GradScaler or None, got {type(scaler).__name__}")
        for name, value in (("every", every), ("flush_every", flush_every), ("max_bytes", max_bytes)):
            check_int(name, value, low=1)
        self.enabled = bool(enabled)
        self._ddp = model if is_ddp(model) else None
        if local_weights and self._ddp is None:
            raise ValueError("local_weights: True needs a DistributedDataParallel model (local and reduced "
                             "gradients only differ under DDP)")
        self.model = model.module if self._ddp is not None else model
        self.optimizer, self.every, self.flush_every, self.max_bytes = optimizer, every, flush_every, max_bytes
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.path = Path(path) if path is not None else None
        self._params = select(self.model.named_parameters(), weights, "weights",
                               default=lambda n, p: p.requires_grad)
        self._modules = select(self.model.named_modules(), activations, "activations",
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

    def wait(self) -> None:
        """Block until the counts of every recorded step so far have landed (on the GPU they are
        computed asynchronously). Useful for timing; never needed for correctness."""
        if self.enabled and self._open:
            self._binner.wait()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

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
        self._world, self._rank = dist_info()
        numel = sum(p.numel() for _, p in self._params)
        self._binner = make_counter(self.device, capacity=numel + (1 << 16))
        self._store = StepStore(self.device, len(self.tensor_names), self.flush_every, self.max_bytes, self.every)
        self._step = 0
        self._row_of = {id(p): i for i, (_, p) in enumerate(self._params)}
        self._opt_plans: dict[int, tuple] = {}
        self._grad_refs = [None] * len(self._params)
        self._weights_done = np.zeros(len(self._params), dtype=bool)
        self._capturing = True
        self._binner.target = self._store.slot()
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
        out = first_grad_tensor(output)
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
        plan = self._opt_plans.get(id(optimizer))
        if plan is None:
            plan = self._opt_plans[id(optimizer)] = self._plan(optimizer)
        big, small, offsets = plan
        if small:
            grads = [self._params[i][1].grad for i in small]
            if all(_groupable(g) for g in grads) and not self._weights_done[small].any():
                self._binner.add_group(grads, small, offsets)     # many small tensors: one set of ops
                self._weights_done[small] = True
            else:
                big = big + small
        for i in big:
            if not self._weights_done[i]:
                g = self._params[i][1].grad
                if g is not None:
                    self._binner.add(g, i)
                self._weights_done[i] = True

    def _plan(self, optimizer):
        """(big rows, small rows, offsets of the small rows' elements) for this optimizer's parameters."""
        rows = [self._row_of[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in self._row_of]
        params = [self._params[i][1] for i in rows]
        small = [i for i, p in zip(rows, params) if p.numel() < _SMALL and p.device == self.device]
        big = [i for i in rows if i not in set(small)]
        if len(small) < 2:
            return rows, [], None
        sizes = [self._params[i][1].numel() for i in small]
        return big, small, group_offsets(sizes, small, self.device)

    # ------------------------------------------------------------------ per step
    def step(self, loss=None) -> None:
        """Mark the end of one optimizer step (call it after ``scaler.update()``)."""
        if not self.enabled:
            return
        if not self._open:
            raise RuntimeError("Recorder.step() called outside `with recorder:`")
        self._store.put_scalars(loss, self.scaler)
        if self._capturing:
            self._finish_histograms()
        self._step += 1
        self.every = self._store.every                     # decimation may have doubled it
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
        self._store.end_row(self._step, self._binner)
        self._binner.target = self._store.slot()

    def _flush(self) -> None:
        self._store.flush_counts(self._binner)
        self._store.flush_scalars()

    # ------------------------------------------------------------------ the run
    def _build_run(self) -> Run:
        skip_by_scale = self.scaler is not None and self.scaler.get_backoff_factor() < 1
        a = self._store.arrays(self._prev_scale, skip_by_scale)
        per_rank = {k: a[k][None] for k in ("loss", "loss_scale", "next_scale", "skipped", "counts")}
        return Run(a["steps"], hist_steps=a["hist_steps"], tensor_names=list(self.tensor_names),
                   tensor_kinds=list(self.tensor_kinds), tensor_dtypes=list(self._dtypes), meta=self._meta(),
                   **per_rank)

    def _meta(self) -> dict:
        sc = self.scaler
        return {"ampviz_version": __version__, "torch_version": torch.__version__, "device": str(self.device),
                "world_size": self._world, "ranks": [self._rank], "every": self.every,
                "decimated": self._store.decimations, "created": self._created,
                "domains": {"weight": "unscaled", "activation": "scaled", "weight_local": "scaled"},
                "scaler": None if sc is None else {
                    "init_scale": self._prev_scale, "growth_factor": sc.get_growth_factor(),
                    "backoff_factor": sc.get_backoff_factor(), "growth_interval": sc.get_growth_interval()}}

    def _save(self, run: Run) -> None:
        if self._world > 1 and self.path.suffix != ".npz":
            run.save(self.path / f"rank{self._rank}.npz")
        else:
            run.save(self.path)


_SMALL = 1 << 16          # parameters below this many elements are keyed together (per-op overhead dominates)


def _groupable(g) -> bool:
    return g is not None and g.dtype == torch.float32 and g.layout == torch.strided
