"""The weights' updates, measured around the real optimizer step (``Recorder(..., updates=N)``).

On a step due for it (every ``every`` steps, ``step % every == 0``) an optimizer step pre-hook copies each
watched parameter the optimizer will step (one copy in its own dtype: the memory cost, on those steps only),
and the post-hook compares. Per parameter, three things are counted on the device (no host sync: the rows
stay there until ``flush``):

* ``ulp``: a binade histogram of ``|dw| / ulp(w)``, ``w`` the weight before the step and ``ulp`` the spacing
  of the weight's storage dtype at ``w`` (``2**(floor(log2|w|) - p + 1)``, ``p`` its significand bits; the
  subnormal spacing below the smallest normal). Column 0 holds the weights that did not move;
* ``rel``: a binade histogram of ``|dw| / |w|`` (0 where ``w`` and ``dw`` are both 0, inf where only ``w`` is):
  what weights of another dtype would have lost (an update rounds away in bf16 when ``|dw| / |w| <= 2**-9``);
* ``stalled``: elements whose gradient was non-zero but whose weight did not move (``dw == 0`` exactly).

``dw`` is computed in float64 (exact for bf16 / fp16 weights, and for fp32 weights within 2**29 of each other).
A step a GradScaler skipped never reaches the optimizer: it has no update row. A fused optimizer that skips
inside its kernel (``found_inf``) gets an all-zero row, without a host read. Bins as in ``ampviz.histogram``::

    updates = UpdateCapture(params, every=100, device)
    updates.arm(step)                      # at each new step: is it due?
    updates.install(optimizer, handles)    # pre / post step hooks (removed with the handles)
    updates.end_step(step)                 # rec.step(): the row of this step, if one was measured
    updates.flush(); updates.arrays(0)     # to the host (a sync); steps, ulp, rel, stalled from row 0 on
"""

from __future__ import annotations

import numpy as np
import torch

from .._counting import NBINS
from .._counting.ops import fp64_columns

__all__ = ["UpdateCapture", "ulp_exponent"]

_FLUSH_ROWS = 32                 # device rows kept before a copy to the host


def ulp_exponent(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log2 of the spacing of ``dtype`` at each value of ``w`` (float64), as int64: ``floor(log2|w|) - (p - 1)``,
    at least the subnormal spacing ``emin - (p - 1)``; zeros get the subnormal spacing. From the float64 exponent
    field (every bf16, fp16 and fp32 value is a normal float64; zero's field gives -1023, below any ``emin``)."""
    fi = torch.finfo(dtype)
    frac_bits = -int(round(np.log2(fi.eps)))               # p - 1: 7 for bf16, 10 for fp16, 23 for fp32
    emin = int(round(np.log2(fi.tiny)))                    # -126 for bf16 and fp32, -14 for fp16
    e = w.view(torch.int64).bitwise_right_shift(52).bitwise_and_(0x7FF).sub_(1023)     # floor(log2|w|)
    return e.clamp_(min=emin).sub_(frac_bits)


def ulp_columns(dw: torch.Tensor, ulp_exp: torch.Tensor) -> torch.Tensor:
    """Binade column of ``dw / 2**ulp_exp`` (``dw`` float64 >= 0 or nan) without dividing: dividing by a power of
    two moves the binade by exactly ``ulp_exp``. The binade of ``dw`` (closed at the top) from its bits:
    ``((bits - 1) >> 52) - 1023``; zeros to column 0, nan to 256, the rest clamped to 1..255."""
    col = dw.view(torch.int64).sub(1).bitwise_right_shift_(52).sub_(ulp_exp).add_(128 - 1023).clamp_(1, NBINS - 2)
    return col.masked_fill_(dw == 0, 0).masked_fill_(dw.isnan(), NBINS - 1)


def _count_into(values: torch.Tensor, row: torch.Tensor, cols: torch.Tensor | None = None) -> None:
    """Add the binade histogram of float64 ``values`` (>= 0 or nan; or their ``cols``) into ``row`` (NBINS int64),
    on its device."""
    if cols is None:
        cols = fp64_columns(values.reshape(-1).contiguous())
    if cols.device.type == "cpu":
        row.add_(torch.bincount(cols, minlength=NBINS))
    else:                                                  # no bincount on CUDA: it reads its max back (a sync)
        row.index_add_(0, cols, torch.ones((), dtype=row.dtype, device=row.device).expand(cols.numel()))


class UpdateCapture:
    """Copies before, counts after the optimizer step, on the steps due (see the module docstring)."""

    def __init__(self, params: list, every: int, device: torch.device) -> None:
        self.params, self.every, self.device = params, int(every), device
        self.row_of = {id(p): i for i, (_, p) in enumerate(params)}
        self.armed = False
        self.before: dict[int, torch.Tensor] = {}        # row -> copy of the weight before the step
        self.row: torch.Tensor | None = None              # (2, T_w, NBINS) of the current step: ulp, rel
        self.stalled_row: torch.Tensor | None = None      # (T_w,)
        self.done: set[int] = set()
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []    # (step, counts, stalled) on the device
        self.host_steps: list[int] = []
        self.host_counts: list[np.ndarray] = []           # (2, T_w, NBINS) each
        self.host_stalled: list[np.ndarray] = []
        self.copy_bytes = 0                               # bytes of the largest set of copies held at once

    # ------------------------------------------------------------------ hooks
    def install(self, optimizer, handles: list) -> None:
        """The optimizer's step pre- and post-hooks (global ones without an optimizer), appended to ``handles``."""
        if optimizer is not None:
            handles.append(optimizer.register_step_pre_hook(self._before))
            handles.append(optimizer.register_step_post_hook(self._after))
        else:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
            handles.append(register_optimizer_step_pre_hook(self._before))
            handles.append(register_optimizer_step_post_hook(self._after))

    def arm(self, step: int) -> None:
        """A new step begins: copies are taken in it only if it is due."""
        self.armed = self.every > 0 and step % self.every == 0
        self.before.clear()
        self.done = set()

    def _rows(self, optimizer) -> list[int]:
        return [self.row_of[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in self.row_of]

    def _before(self, optimizer, args, kwargs):
        if not self.armed or torch.compiler.is_compiling():
            return None
        nbytes = 0
        for i in self._rows(optimizer):
            p = self.params[i][1]
            if i in self.done or i in self.before or p.grad is None:
                continue
            self.before[i] = p.detach().clone()          # the copy: one per stepped parameter, in its dtype
            nbytes += p.numel() * p.element_size()
        self.copy_bytes = max(self.copy_bytes, nbytes)
        return None

    def _after(self, optimizer, args, kwargs) -> None:
        if not self.before or torch.compiler.is_compiling():
            return
        if self.row is None:
            self.row = torch.zeros(2, len(self.params), NBINS, dtype=torch.int64, device=self.device)
            self.stalled_row = torch.zeros(len(self.params), dtype=torch.int64, device=self.device)
        assert self.stalled_row is not None
        found = getattr(optimizer, "found_inf", None)     # a fused optimizer skips inside its kernel
        keep = (found == 0).to(torch.int64) if isinstance(found, torch.Tensor) else None
        for i in self._rows(optimizer):
            old = self.before.pop(i, None)
            if old is None:
                continue
            self.done.add(i)
            p = self.params[i][1]
            with torch.no_grad():
                w0 = old.to(torch.float64).reshape(-1)
                dw = p.detach().to(torch.float64).reshape(-1).sub_(w0).abs_()
                del old
                _count_into(dw, self.row[0, i], ulp_columns(dw, ulp_exponent(w0, p.dtype)))
                a = w0.abs_()
                rel = torch.where((a == 0) & (dw == 0), 0.0, dw / a)      # x / 0: inf; 0 / 0: 0
                _count_into(rel, self.row[1, i])
                g = p.grad
                stalled = (dw == 0) & (g.reshape(-1) != 0) if g is not None and g.layout == torch.strided else None
                if stalled is not None:
                    self.stalled_row[i] += stalled.sum()
                if keep is not None:
                    self.row[:, i].mul_(keep.to(self.row.device))
                    self.stalled_row[i].mul_(keep.to(self.row.device))

    # ------------------------------------------------------------------ rows
    def end_step(self, step: int) -> None:
        """``rec.step()``: the row of this step, if any update was measured, joins the pending rows."""
        self.before.clear()                               # a pre-hook whose step raised: its copies go
        if self.row is not None:
            assert self.stalled_row is not None
            self.pending.append((step, self.row, self.stalled_row))
            self.row = self.stalled_row = None
            if len(self.pending) >= _FLUSH_ROWS:
                self.flush()

    def flush(self) -> None:
        """Copy the pending rows to the host (a device->host sync)."""
        for step, counts, stalled in self.pending:
            self.host_steps.append(step)
            self.host_counts.append(counts.cpu().numpy())
            self.host_stalled.append(stalled.cpu().numpy())
        self.pending = []

    @property
    def n_rows(self) -> int:
        return len(self.host_steps)

    def arrays(self, rows_from: int = 0) -> dict[str, np.ndarray]:
        """The host rows from ``rows_from`` on, as a run file stores them (one rank)."""
        T = len(self.params)
        counts = (np.stack(self.host_counts[rows_from:]) if len(self.host_counts) > rows_from
                  else np.zeros((0, 2, T, NBINS), dtype=np.int64))
        stalled = (np.stack(self.host_stalled[rows_from:]) if len(self.host_stalled) > rows_from
                   else np.zeros((0, T), dtype=np.int64))
        return {"update_steps": np.asarray(self.host_steps[rows_from:], dtype=np.int64),
                "update_counts": np.ascontiguousarray(counts[:, 0]),
                "update_rel_counts": np.ascontiguousarray(counts[:, 1]), "update_stalled": stalled}
