"""Block statistics of the tensors an fp8 / fp4 recipe casts, recorded (``Recorder(..., blocks=...)``).

On a step due for it (every ``every`` steps, ``step % every == 0``) each chosen ``nn.Linear`` (and subclass)
has three tensors counted with :func:`ampviz.blocks.block_counts`, in every chosen layout, each blocked along the
reduction dimension of the GEMM that consumes it:

* ``input``: the input of the forward GEMM ``Y = X Wᵀ``, blocked along its last dim (``in_features``);
* ``weight``: the weight of that GEMM, ``(out, in)``, blocked along ``in_features`` (its last dim), counted once
  per step (at the module's first training forward of the step);
* ``grad_output``: the gradient w.r.t. the output, the ``g`` of ``dX = g W``, blocked along its last dim
  (``out_features``), as the backward computed it (scaled by a GradScaler's loss scale).

Input and weight are counted as the GEMM receives them: under autocast, cast to its dtype (a copy; the
module's tensors are only read). The other blockings of the backward (``W`` down its columns for ``dX``, ``g``
and ``X`` down the tokens for ``dW``) are not recorded. A dimension that is not a multiple of the block is
counted as zero-padded (``pad=True``: the padding is not counted). Micro-batches of one step add up. A weight
FSDP2 has sharded again by the time the forward hook runs is counted as this rank's shard (the ranks' counts add up
to the whole weight's, as with the gradient histograms). Counting makes ``block_counts``' temporaries, one tensor at
a time, on the steps due only. Counts stay
on the device in one row per step, ``(T, L, N_COUNTS)``, copied to the host every ``_FLUSH_ROWS`` rows or when the
Recorder flushes (saves, ``rec.run``, exit)::

    blocks = BlockCapture(modules, spec, device)
    blocks.install(handles)                # forward hooks (removed with the handles)
    blocks.arm(step)                       # at each new step: is it due?
    blocks.end_step(step)                  # rec.step(): the row of this step, if anything was counted
    blocks.flush(); blocks.arrays(0)       # to the host (a sync): block_steps, block_counts, block_sumsq
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.compiler import is_compiling as _traced

from ..blocks import LAYOUTS, BlockLayout, block_counts, get_layout
from ..blocks.counts import N_COUNTS
from ._select import check_filter

__all__ = ["BlockSpec", "BlockCapture", "check_blocks", "BLOCK_EVERY", "BLOCK_KINDS", "linear_modules"]

BLOCK_EVERY = 100                # blocks=True: block statistics every this many steps
BLOCK_KINDS = ("input", "weight", "grad_output")          # the rows of one module, in this order
_FLUSH_ROWS = 8                  # device rows kept before a copy to the host (a row is T x L x 1.7 kB)
_KEYS = ("every", "layouts", "modules")


@dataclass(frozen=True)
class BlockSpec:
    """``blocks=`` checked: every how many steps, in which layouts, on which ``nn.Linear`` modules (a filter on
    their names as ``activations=`` takes: True for all)."""

    every: int = BLOCK_EVERY
    layouts: tuple[BlockLayout, ...] = tuple(LAYOUTS.values())
    modules: Any = True

    def meta(self, filter_text) -> dict:
        return {"every": self.every, "layouts": [layout.name for layout in self.layouts],
                "modules": filter_text(self.modules)}


def check_blocks(value) -> BlockSpec | None:
    """``blocks=`` as a BlockSpec, or None (off) for False / None / 0: True (every 100 steps, every layout), a
    number of steps >= 1, a dict with any of ``every``, ``layouts``, ``modules``, or a BlockSpec."""
    valid = (f"True (every {BLOCK_EVERY} steps, layouts {', '.join(LAYOUTS)}), False, a number of steps >= 1, or "
             f"a dict with any of {', '.join(_KEYS)} (e.g. {{'every': 50, 'layouts': ['mx32', 'nv16']}})")
    if value is None or value is False or (type(value) is int and value == 0):
        return None
    if value is True:
        return BlockSpec()
    if type(value) is int and value > 0:
        return BlockSpec(every=value)
    if isinstance(value, BlockSpec):
        value = {"every": value.every, "layouts": value.layouts, "modules": value.modules}
    if not isinstance(value, dict):
        raise ValueError(f"blocks: expected {valid}, got {value!r}")
    unknown = sorted(str(k) for k in value if k not in _KEYS)
    if unknown:
        raise ValueError(f"blocks: unknown key(s) {unknown} in {value!r}; valid keys: {', '.join(_KEYS)}")
    every = value.get("every", BLOCK_EVERY)
    if type(every) is not int or every < 1:
        raise ValueError(f"blocks: every: expected a number of steps >= 1, got {every!r}")
    layouts = value.get("layouts", tuple(LAYOUTS))
    if isinstance(layouts, (str, BlockLayout)):
        layouts = (layouts,)
    if not isinstance(layouts, (list, tuple)) or not layouts:
        raise ValueError(f"blocks: layouts: expected a layout name or a non-empty list of them (valid: "
                         f"{', '.join(LAYOUTS)} or a BlockLayout), got {layouts!r}")
    try:
        chosen = tuple(get_layout(x) for x in layouts)
    except ValueError as e:
        raise ValueError(f"blocks: {e}") from None
    names = [x.name for x in chosen]
    if len(set(names)) != len(names):
        raise ValueError(f"blocks: layouts: {names} names a layout twice")
    modules = value.get("modules", True)
    if modules is False or modules is None:
        raise ValueError("blocks: modules: expected True, a regex, a list of names or a callable; to record no "
                         "block statistics pass blocks=False")
    check_filter(modules, "blocks: modules")
    return BlockSpec(every=every, layouts=chosen, modules=modules)


def linear_modules(model: nn.Module, named: list) -> list:
    """The (name, module) of ``named`` that count: ``nn.Linear`` and its subclasses, but not an
    ``nn.MultiheadAttention``'s ``out_proj`` (attention uses its weight directly, never calling it)."""
    out_projs = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    return [(n, m) for n, m in named if isinstance(m, nn.Linear) and id(m) not in out_projs]


def as_gemm_operand(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the forward GEMM receives it: under autocast (enabled for ``x``'s device) a floating tensor other
    than float64 is cast to the autocast dtype, as autocast's ``linear`` does (a copy; ``x`` is untouched)."""
    device_type = x.device.type
    try:
        on = torch.is_autocast_enabled(device_type)
    except RuntimeError:                                   # a device type autocast does not know
        return x
    if on and x.dtype != torch.float64:
        return x.to(torch.get_autocast_dtype(device_type))
    return x


class BlockCapture:
    """Forward hooks on the chosen modules, counting on the steps due (see the module docstring)."""

    def __init__(self, modules: list, spec: BlockSpec, device: torch.device) -> None:
        self.modules, self.every, self.layouts, self.device = modules, spec.every, spec.layouts, device
        self.module_names = [n for n, _ in modules for _ in BLOCK_KINDS]
        self.kinds = [k for _ in modules for k in BLOCK_KINDS]
        self.armed = False
        self.weights_done: set[int] = set()               # modules whose weight this step has counted
        self.row: tuple[torch.Tensor, torch.Tensor] | None = None       # (T, L, N_COUNTS) int64, float64
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.host_steps: list[int] = []
        self.host_counts: list[np.ndarray] = []
        self.host_sumsq: list[np.ndarray] = []

    def install(self, handles: list, skip=frozenset()) -> None:
        """A forward hook on each chosen module (none on those whose ids are in ``skip``), appended to ``handles``."""
        for i, (_, m) in enumerate(self.modules):
            if id(m) not in skip:
                handles.append(m.register_forward_hook(functools.partial(self._on_forward, i)))

    def arm(self, step: int) -> None:
        """A new step begins: its tensors are counted only if it is due."""
        self.armed = step % self.every == 0
        self.weights_done = set()

    # ------------------------------------------------------------------ hooks: read only, no host sync
    def _on_forward(self, i: int, module, inputs, output) -> None:
        if _traced() or not self.armed:
            return
        # training forwards only: not under no_grad (evaluation), not checkpointing's recomputation in the backward
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        row = len(BLOCK_KINDS) * i
        x = inputs[0] if inputs else None
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            self._add(row, as_gemm_operand(x))
        w: Any = getattr(module, "weight", None)
        if hasattr(w, "to_local"):                         # FSDP2 resharded it already (a DTensor): this rank's shard
            w = w.to_local()
        if i not in self.weights_done and isinstance(w, torch.Tensor) and w.is_floating_point():
            self.weights_done.add(i)
            self._add(row + 1, as_gemm_operand(w))
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._on_grad, row + 2))

    def _on_grad(self, row: int, grad) -> None:
        if grad is not None and grad.is_floating_point():
            self._add(row, grad)

    def _add(self, row: int, x: torch.Tensor) -> None:
        """Add ``x``'s counts in every layout into this step's row, on the device."""
        if x.dim() == 0 or x.numel() == 0:
            return
        if self.row is None:
            shape = (len(self.kinds), len(self.layouts), N_COUNTS)
            self.row = (torch.zeros(shape, dtype=torch.int64, device=self.device),
                        torch.zeros(shape, dtype=torch.float64, device=self.device))
        counts, sumsq = self.row
        with torch.no_grad():
            x = x.detach().float()                         # once for every layout (block_counts counts fp32)
            for j, layout in enumerate(self.layouts):
                c = block_counts(x, layout, dim=-1, pad=True)
                counts[row, j].add_(c.counts.to(self.device, non_blocking=True))
                sumsq[row, j].add_(c.sumsq.to(self.device, non_blocking=True))

    # ------------------------------------------------------------------ rows
    def end_step(self, step: int) -> None:
        """``rec.step()``: the row of this step, if anything was counted, joins the pending rows."""
        if self.row is not None:
            self.pending.append((step, *self.row))
            self.row = None
            if len(self.pending) >= _FLUSH_ROWS:
                self.flush()

    def flush(self) -> None:
        """Copy the pending rows to the host (note: a device->host sync)."""
        for step, counts, sumsq in self.pending:
            self.host_steps.append(step)
            self.host_counts.append(counts.cpu().numpy())
            self.host_sumsq.append(sumsq.cpu().numpy())
        self.pending = []

    @property
    def n_rows(self) -> int:
        return len(self.host_steps)

    def arrays(self, rows_from: int = 0) -> dict[str, np.ndarray]:
        """The host rows from ``rows_from`` on, as a run file stores them (one rank)."""
        empty = (0, len(self.kinds), len(self.layouts), N_COUNTS)
        counts, sumsq = self.host_counts[rows_from:], self.host_sumsq[rows_from:]
        return {"block_steps": np.asarray(self.host_steps[rows_from:], dtype=np.int64),
                "block_counts": np.stack(counts) if counts else np.zeros(empty, dtype=np.int64),
                "block_sumsq": np.stack(sumsq) if sumsq else np.zeros(empty, dtype=np.float64)}

    def meta(self) -> dict:
        """What the file's metadata says about the rows (``meta["blocks"]``)."""
        return {"every": self.every, "modules": self.module_names, "kinds": self.kinds,
                "layouts": [[x.name, x.block_rows, x.block_cols] for x in self.layouts]}
