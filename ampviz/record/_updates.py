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

With per-element optimizer state (``state_names(optimizer)``: Adam's ``exp_avg``, ``exp_avg_sq``, SGD's
``momentum_buffer`` ...), each such state tensor of the parameter's shape is copied too and, per state:

* ``state``: a binade histogram of ``|ds| / |s|`` (``s`` the state before the step; as ``rel``);
* ``state stalled``: elements that changed but would not have moved stored in bf16, ``bf16(bf16(s) + ds) ==
  bf16(s)`` (``ds`` below half a bf16 ulp of ``s``). State the step creates is not measured at that step.

Memory, on the steps due only: one copy of each stepped parameter and of each of its measured state tensors, in
their dtypes (fp32 AdamW: 4 + 4 + 4 = 12 bytes per parameter; SGD without momentum: 4), held from the pre-hook
to the post-hook, plus float64 temporaries of one piece (``_CHUNK_CPU`` / ``_CHUNK_DEVICE`` elements) at a time.

``dw`` is computed in float64 (exact for bf16 / fp16 weights, and for fp32 weights within 2**29 of each other),
piece by piece (see ``_CHUNK_CPU``: 2-4x faster than whole tensors on the CPU, and steady on a loaded machine; the
same counts).
A step a GradScaler skipped never reaches the optimizer: it has no update row. A fused optimizer that skips
inside its kernel (``found_inf``) gets an all-zero row, without a host read. Bins as in ``ampviz.histogram``::

    updates = UpdateCapture(params, every=100, device, state_names(optimizer))
    updates.arm(step)                      # at each new step: is it due?
    updates.install(optimizer, handles)    # pre / post step hooks (removed with the handles)
    updates.end_step(step)                 # rec.step(): the row of this step, if one was measured
    updates.flush(); updates.arrays(0)     # to the host (a sync); steps, ulp, rel, stalled (state) from row 0 on
"""

from __future__ import annotations

import numpy as np
import torch

from .._counting import NBINS

__all__ = ["UpdateCapture", "state_names"]

_FLUSH_ROWS = 32                 # device rows kept before a copy to the host
# elements measured at once. On the CPU, fewer than torch's intra-op grain size (32768): each op of a piece runs on
# the calling thread, its float64 temporaries (250 kB) stay in cache, and no op waits at a parallel region's barrier
# for a core another process holds (on a 2-core machine, pieces of 2**16 measured 4.2M weights in 0.06 s idle but
# in 1.7 s (median) once other processes loaded it, these in 0.09 s both ways; ``update_cost.py --piece``). On an
# accelerator, fewer, larger pieces (fewer launches); on both they bound the capture's extra memory.
_CHUNK_CPU = 32_000
_CHUNK_DEVICE = 1 << 22          # 32 MiB per float64 temporary


def _measure(old: torch.Tensor, new: torch.Tensor, grad: torch.Tensor | None, rows: torch.Tensor,
             stalled: torch.Tensor) -> None:
    """Add one parameter's update (``old`` -> ``new``, same dtype) into ``rows`` (2, NBINS: ulp, rel) and the count
    of elements with a non-zero ``grad`` that did not move into ``stalled`` (a 0-d int64), piece by piece.

    ``|dw| / ulp(w0)`` without dividing: the ulp is a power of two, ``2**(e - (p - 1))`` with ``e = floor(log2|w0|)``
    at least ``emin`` (the subnormal spacing; zeros too), read from the float64 exponent field of ``w0`` (every
    bf16, fp16 and fp32 value is a normal float64); the binade of ``dw`` (closed at the top) from its bits,
    ``((bits - 1) >> 52) - 1023``, minus the ulp's exponent is the column (zeros to 0, nan to 256, the rest clamped
    to 1..255). ``|dw| / |w0|``: see ``_rel_into``. About 30 passes over a piece, the float64 buffers reused as
    int64."""
    fi = torch.finfo(old.dtype)
    frac_bits = -int(round(np.log2(fi.eps)))
    field_min = int(round(np.log2(fi.tiny))) + 1023        # emin's float64 exponent field: the subnormal spacing
    old, new = old.reshape(-1), new.reshape(-1)
    grad = grad.reshape(-1) if grad is not None else None
    size = _CHUNK_CPU if old.device.type == "cpu" else _CHUNK_DEVICE
    for start in range(0, old.numel(), size):
        piece = slice(start, start + size)
        w0 = old[piece].to(torch.float64)
        dw = new[piece].to(torch.float64).sub_(w0).abs_()
        zero, nan = dw == 0, dw.isnan()
        a = w0.abs_()
        field = a.view(torch.int64).bitwise_right_shift(52).clamp_(min=field_min)       # ulp exponent + 1023 + p-1
        col = dw.view(torch.int64).sub(1).bitwise_right_shift_(52).sub_(field).add_(128 + frac_bits)
        _count_into(col.clamp_(1, NBINS - 2).masked_fill_(zero, 0).masked_fill_(nan, NBINS - 1), rows[0])
        _rel_into(dw, a, zero, rows[1])
        if grad is not None:
            stalled += zero.logical_and_(grad[piece] != 0).sum()


def _rel_into(d: torch.Tensor, a: torch.Tensor, zero: torch.Tensor, row: torch.Tensor) -> None:
    """Add the binade histogram of ``d / a`` (float64 ``|change|`` and ``|value before|``; ``zero``: ``d == 0``) into
    ``row``: x / 0 is inf, 0 / 0 goes to column 0 (as 0 / a does), inf / inf is nan; columns from the bits of the
    quotient, computed in ``d``'s memory."""
    rel = d.div_(a)
    nan = rel.isnan()
    col = rel.view(torch.int64).sub_(1).bitwise_right_shift_(52).sub_(1023 - 128).clamp_(1, NBINS - 2)
    _count_into(col.masked_fill_(nan, NBINS - 1).masked_fill_(zero, 0), row)


def _measure_state(old: torch.Tensor, new: torch.Tensor, row: torch.Tensor, bf16_stalled: torch.Tensor) -> None:
    """Add one optimizer state tensor's change (``old`` -> ``new``) into ``row`` (NBINS: ``|ds| / |s|``) and, into
    ``bf16_stalled`` (0-d int64), the elements that changed but would not have moved in bf16:
    ``bf16(bf16(s) + ds) == bf16(s)`` with ``ds = s1 - s0`` and the sum in fp32, as an optimizer computing in fp32
    and storing bf16 would (``ds`` below half a bf16 ulp of ``s``, ties to even)."""
    old, new = old.reshape(-1), new.reshape(-1)
    size = _CHUNK_CPU if old.device.type == "cpu" else _CHUNK_DEVICE
    for start in range(0, old.numel(), size):
        s0, s1 = old[start:start + size], new[start:start + size]
        as_bf16 = s0.to(torch.bfloat16)
        kept = (as_bf16.float() + (s1.float() - s0.float())).to(torch.bfloat16) == as_bf16     # in fp32, stored bf16
        bf16_stalled += kept.logical_and_(s1 != s0).sum()
        a = s0.to(torch.float64)
        d = s1.to(torch.float64).sub_(a).abs_()
        _rel_into(d, a.abs_(), d == 0, row)


def _count_into(cols: torch.Tensor, row: torch.Tensor) -> None:
    """Add the histogram of the columns ``cols`` (int64) into ``row`` (NBINS int64), on its device: ``index_add_``
    (no host read; bincount reads the columns' max back on CUDA, a sync, and scans min and max on the CPU)."""
    row.index_add_(0, cols, torch.ones((), dtype=row.dtype, device=row.device).expand(cols.numel()))


class UpdateCapture:
    """Copies before, counts after the optimizer step, on the steps due (see the module docstring)."""

    def __init__(self, params: list, every: int, device: torch.device, state_names: tuple[str, ...] = ()) -> None:
        self.params, self.every, self.device = params, int(every), device
        self.state_names = tuple(state_names)             # the optimizer state measured (S), see state_names()
        self.row_of = {id(p): i for i, (_, p) in enumerate(params)}
        self.armed = False
        self.before: dict[int, torch.Tensor] = {}        # row -> copy of the weight before the step
        self.row: torch.Tensor | None = None              # (2, T_w, NBINS) of the current step: ulp, rel
        self.stalled_row: torch.Tensor | None = None      # (T_w,)
        self.state_before: dict[int, dict[int, torch.Tensor]] = {}    # row -> state index -> copy before the step
        self.state_row: torch.Tensor | None = None        # (S, T_w, NBINS + 1): |ds| / |s|, then bf16-stalled
        self.done: set[int] = set()
        self.pending: list[tuple] = []                    # (step, counts, stalled, state) on the device
        self.host_steps: list[int] = []
        self.host_counts: list[np.ndarray] = []           # (2, T_w, NBINS) each
        self.host_stalled: list[np.ndarray] = []
        self.host_state: list[np.ndarray] = []            # (S, T_w, NBINS + 1) each
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
        self.state_before.clear()
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
            state = optimizer.state.get(p, {}) if self.state_names else {}
            copies = {k: v.detach().clone() for k, v in enumerate(state.get(n) for n in self.state_names)
                      if _measurable(v, p)}                # and each state tensor of its shape, in its dtype
            if copies:
                self.state_before[i] = copies
                nbytes += sum(c.numel() * c.element_size() for c in copies.values())
        self.copy_bytes = max(self.copy_bytes, nbytes)
        return None

    def _after(self, optimizer, args, kwargs) -> None:
        if not self.before or torch.compiler.is_compiling():
            return
        if self.row is None:
            self.row = torch.zeros(2, len(self.params), NBINS, dtype=torch.int64, device=self.device)
            self.stalled_row = torch.zeros(len(self.params), dtype=torch.int64, device=self.device)
        assert self.stalled_row is not None
        if self.state_row is None and self.state_names:
            self.state_row = torch.zeros(len(self.state_names), len(self.params), NBINS + 1, dtype=torch.int64,
                                         device=self.device)
        found = getattr(optimizer, "found_inf", None)     # a fused optimizer skips inside its kernel
        keep = (found == 0).to(torch.int64) if isinstance(found, torch.Tensor) else None
        for i in self._rows(optimizer):
            old = self.before.pop(i, None)
            if old is None:
                continue
            self.done.add(i)
            p = self.params[i][1]
            g = p.grad
            g = g if g is not None and g.layout == torch.strided and g.shape == p.shape else None
            with torch.no_grad():
                _measure(old, p.detach(), g, self.row[:, i], self.stalled_row[i])
            del old
            self._after_state(optimizer, i, p)
            if keep is not None:
                self.row[:, i].mul_(keep.to(self.row.device))
                self.stalled_row[i].mul_(keep.to(self.row.device))
                if self.state_row is not None:
                    self.state_row[:, i].mul_(keep.to(self.row.device))

    def _after_state(self, optimizer, i: int, p: torch.Tensor) -> None:
        """The state tensors copied before the step, against what the step left (one dropped or replaced by another
        shape is not measured)."""
        copies = self.state_before.pop(i, {})
        if not copies:
            return
        assert self.state_row is not None
        state = optimizer.state.get(p, {})
        with torch.no_grad():
            for k, old in copies.items():
                new = state.get(self.state_names[k])
                if _measurable(new, p) and new.dtype == old.dtype:
                    _measure_state(old, new.detach(), self.state_row[k, i, :NBINS], self.state_row[k, i, NBINS])

    # ------------------------------------------------------------------ rows
    def end_step(self, step: int) -> None:
        """``rec.step()``: the row of this step, if any update was measured, joins the pending rows."""
        self.before.clear()                               # a pre-hook whose step raised: its copies go
        self.state_before.clear()
        if self.row is not None:
            assert self.stalled_row is not None
            self.pending.append((step, self.row, self.stalled_row, self.state_row))
            self.row = self.stalled_row = self.state_row = None
            if len(self.pending) >= _FLUSH_ROWS:
                self.flush()

    def flush(self) -> None:
        """Copy the pending rows to the host (a device->host sync)."""
        for step, counts, stalled, state in self.pending:
            self.host_steps.append(step)
            self.host_counts.append(counts.cpu().numpy())
            self.host_stalled.append(stalled.cpu().numpy())
            if state is not None:
                self.host_state.append(state.cpu().numpy())
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
        out = {"update_steps": np.asarray(self.host_steps[rows_from:], dtype=np.int64),
               "update_counts": np.ascontiguousarray(counts[:, 0]),
               "update_rel_counts": np.ascontiguousarray(counts[:, 1]), "update_stalled": stalled}
        if self.state_names:
            S = len(self.state_names)
            state = (np.stack(self.host_state[rows_from:]) if len(self.host_state) > rows_from
                     else np.zeros((0, S, T, NBINS + 1), dtype=np.int64))          # (U, S, T_w, NBINS + 1)
            state = state.transpose(0, 2, 1, 3)                                         # (U, T_w, S, NBINS + 1)
            out["state_counts"] = np.ascontiguousarray(state[..., :NBINS])
            out["state_stalled"] = np.ascontiguousarray(state[..., NBINS])
        return out


def _measurable(state, p: torch.Tensor) -> bool:
    """A state tensor the capture measures: dense, floating, of the parameter's shape (not a step count)."""
    return (isinstance(state, torch.Tensor) and state.layout == torch.strided and state.is_floating_point()
            and state.shape == p.shape)


_STATE_OF = {"Adam": ("exp_avg", "exp_avg_sq"), "AdamW": ("exp_avg", "exp_avg_sq"), "NAdam": ("exp_avg", "exp_avg_sq"),
             "RAdam": ("exp_avg", "exp_avg_sq"), "Adamax": ("exp_avg", "exp_inf"), "Adagrad": ("sum",),
             "Adadelta": ("square_avg", "acc_delta"), "RMSprop": ("square_avg",), "SGD": ()}


def state_names(optimizer) -> tuple[str, ...]:
    """The per-element state tensors of ``optimizer`` the capture measures, fixed for the recording: torch.optim's
    (by class and options: SGD's ``momentum_buffer`` only with momentum, ``max_exp_avg_sq`` with amsgrad, RMSprop's
    ``momentum_buffer`` / ``grad_avg`` with momentum / centered), then any other parameter-shaped entry already in
    ``optimizer.state`` (a resumed optimizer). () without an optimizer."""
    if optimizer is None:
        return ()
    groups = optimizer.param_groups
    names = list(_STATE_OF.get(type(optimizer).__name__, ()))
    if any(g.get("amsgrad") for g in groups) and "exp_avg_sq" in names:
        names.append("max_exp_avg_sq")
    if type(optimizer).__name__ in ("SGD", "RMSprop") and any(g.get("momentum") for g in groups):
        names.append("momentum_buffer")
    if type(optimizer).__name__ == "RMSprop" and any(g.get("centered") for g in groups):
        names.append("grad_avg")
    for p, state in list(optimizer.state.items()):
        names += sorted(n for n, v in state.items() if n not in names and isinstance(p, torch.Tensor)
                        and _measurable(v, p))
    return tuple(names)
