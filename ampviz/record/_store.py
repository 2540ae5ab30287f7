"""Where a Recorder keeps its numbers: a small ring buffer on the device, flushed into bounded host arrays.

Per step the device receives a loss, the scale after ``update()`` and (on recorded steps) a row
of histogram counts; nothing is read back until the ring is full. A flush copies the ring into
preallocated host arrays (the only device->host sync) of at most ``max_bytes``: when they are
full, every other recorded step is dropped in place (decimation): ``flush_counts`` says how many times, and
the recording that owns the store doubles its ``every`` as often (the store keeps no ``every`` of its own). Host
memory therefore stays within ``max_bytes`` for the histograms, plus the ring (at most
``max_bytes / 16``; on the CPU the "device" is the host) and at most 40 bytes per step for the scalars
(16 in an array grown by doubling, 8 for the scheduler's epoch)::

    store = StepStore("cpu", n_tensors=3, flush_every=32, max_bytes=1 << 20)
    counter.target = store.slot()          # the counts row of the current recorded step
    store.put_scalars(loss, scaler)        # every step
    if store.end_row(step, order):         # a recorded step is complete; True: the ring is full
        halvings = store.flush_counts(counter, every)     # decimations done (every doubles that often)
    counter.target = store.slot()          # the row moved: aim the counter again
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .._counting import NBINS, Counter

_MOVE_BYTES = 8 << 20        # decimation moves rows in blocks of at most this size (the only temporary copy)


class StepStore:
    """Device ring + bounded host arrays for per-step scalars and histogram rows."""

    def __init__(self, device: torch.device | str, n_tensors: int, flush_every: int, max_bytes: int) -> None:
        self.n_tensors, self.max_bytes = n_tensors, max_bytes
        # one histogram row on the host: counts (T, NBINS) int64, backward order (T,) int32, its step
        self.row_bytes = n_tensors * (NBINS * 8 + 4) + 8
        self.capacity = max(2, max_bytes // self.row_bytes)
        # rows of the counts ring: the user's flush_every, capped so that the ring stays within max_bytes / 16
        # (on the CPU it is host memory too); the ring is copied to the host when they are all used
        self.ring_rows = max(1, min(flush_every, self.capacity, (max_bytes // 16) // self.row_bytes))
        self.ring = torch.zeros(self.ring_rows, n_tensors, NBINS, dtype=torch.int64, device=device)
        self.ring_order = np.full((self.ring_rows, n_tensors), -1, dtype=np.int32)
        self.ring_steps: list[int] = []
        # (2, S) loss and scale after update(): 16 bytes a step, so a longer ring than the counts'
        self.scalar_len = max(1, min(flush_every, 4096))
        self.scalars = torch.zeros(2, self.scalar_len, dtype=torch.float64, device=device)
        self.scalars_used = 0
        self.host_scalars = np.empty((2, 0), dtype=np.float64)   # (2, capacity): loss, scale after update()
        self.n_steps = 0                                           # steps whose scalars are on the host
        self.scheduler: list[int] = []
        self.skips: list[bool] | None = None          # skipped flags given per step (a framework's own scaler)
        self.n = 0                                  # histogram rows on the host
        self.counts: Any = None                     # allocated at the first flush (pages on first touch)
        self.order: Any = None
        self.steps: Any = None
        self.decimations = 0                        # times every other recorded step was dropped

    def slot(self) -> torch.Tensor:
        """Flat view of the counts row that the current recorded step adds into."""
        return self.ring[len(self.ring_steps)].view(-1)

    # ------------------------------------------------------------------ per step
    def put_scalars(self, loss: Any, scaler: Any, scheduler_epoch: int | None = None, *, scale: float | None = None,
                    skipped: bool | None = None) -> None:
        """Store this step's loss, the scaler's current scale and the scheduler's epoch without a host sync. A
        framework with its own loss scaler (DeepSpeed) gives ``scale`` (after its update) and ``skipped`` instead,
        as host values it already holds: then every step's ``skipped`` must be given."""
        j = self.scalars_used
        if loss is None:
            self.scalars[0, j] = math.nan
        elif isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"loss: expected a scalar, got a tensor of shape {tuple(loss.shape)}")
            self.scalars[0, j].copy_(loss.detach().reshape(()))
        else:
            self.scalars[0, j] = float(loss)
        if skipped is not None:
            if self.skips is None:
                self.skips = []
            self.skips.append(bool(skipped))
        device_scale = getattr(scaler, "_scale", None) if scaler is not None else None
        if scale is not None:
            self.scalars[1, j] = float(scale)
        elif device_scale is not None:
            self.scalars[1, j].copy_(device_scale.reshape(()))      # get_scale() would sync on GPU
        else:
            self.scalars[1, j] = 1.0 if scaler is None else scaler.get_scale()
        if scheduler_epoch is not None:
            self.scheduler.append(int(scheduler_epoch))
        self.scalars_used += 1
        if self.scalars_used == self.scalar_len:
            self.flush_scalars()

    def end_row(self, step: int, order: list[int]) -> bool:
        """The current row is complete (its counts were submitted); ``order`` is its backward order (T,). True when
        that filled the ring: flush it (``flush_counts``) before the next row."""
        i = len(self.ring_steps)
        self.ring_order[i] = order
        self.ring_steps.append(step)
        return len(self.ring_steps) == self.ring_rows

    # ------------------------------------------------------------------ flushes
    def flush_scalars(self) -> None:
        n = self.scalars_used
        if n:
            host = self.scalars[:, :n].cpu().numpy()           # note: a device->host sync, once per flush
            if self.n_steps + n > self.host_scalars.shape[1]:  # grown by doubling: appends cost O(1) each
                grown = np.empty((2, max(2 * self.host_scalars.shape[1], self.n_steps + n, 64)), dtype=np.float64)
                grown[:, :self.n_steps] = self.host_scalars[:, :self.n_steps]
                self.host_scalars = grown
            self.host_scalars[:, self.n_steps:self.n_steps + n] = host
            self.n_steps += n
            self.scalars_used = 0

    def flush_counts(self, counter: Counter, every: int) -> int:
        """Copy the ring's rows to the host (waiting for ``counter``'s counts to land), recorded every ``every``
        steps; returns how many times that decimated the host rows (each time ``every`` doubles). The current
        row may move: aim the counter at ``slot()`` again."""
        counter.wait()
        halvings = 0
        k = len(self.ring_steps)
        if k:
            if self.counts is None:
                # np.empty: the pages are only committed as rows are written
                self.counts = np.empty((self.capacity, self.n_tensors, NBINS), dtype=np.int64)
                self.order = np.empty((self.capacity, self.n_tensors), dtype=np.int32)
                self.steps = np.empty(self.capacity, dtype=np.int64)
            if self.n + k <= self.capacity:                    # one transfer, straight into place
                torch.from_numpy(self.counts[self.n:self.n + k]).copy_(self.ring[:k])   # sync, once per flush
                self.order[self.n:self.n + k] = self.ring_order[:k]
                self.steps[self.n:self.n + k] = self.ring_steps
                self.n += k
            else:
                halvings = self._append_decimating(self.ring[:k].cpu().numpy(), k, every)   # sync, once per flush
            if k < self.ring_rows:              # a snapshot mid-step: keep the step's counts so far
                self.ring[0].copy_(self.ring[k])
                self.ring[1:].zero_()
                self.ring_order[0] = self.ring_order[k]
                self.ring_order[1:] = -1
            else:
                self.ring.zero_()
                self.ring_order.fill(-1)
            self.ring_steps = []
        return halvings

    def _append_decimating(self, rows: np.ndarray, k: int, every: int) -> int:
        halvings = 0                                           # rows now kept every ``every << halvings`` steps
        for j in range(k):
            step = self.ring_steps[j]
            if self.n == self.capacity:
                self._decimate(every << halvings)
                halvings += 1
            if step % (every << halvings):                     # recorded before ``every`` doubled
                continue
            self.counts[self.n], self.order[self.n], self.steps[self.n] = rows[j], self.ring_order[j], step
            self.n += 1
        return halvings

    def _decimate(self, every: int) -> None:
        """Keep every other recorded step (of steps recorded every ``every``), in place."""
        keep = np.flatnonzero((self.steps[:self.n] // every) % 2 == 0)
        if keep.size == self.n:                                # irregular steps: halve by position
            keep = np.arange(0, self.n, 2)
        block = max(1, min(_MOVE_BYTES, self.max_bytes // 32) // self.row_bytes)
        for a in range(0, keep.size, block):                  # sources keep[a:] >= a: never overwritten first
            idx = keep[a:a + block]
            self.counts[a:a + idx.size] = self.counts[idx]
            self.order[a:a + idx.size] = self.order[idx]
            self.steps[a:a + idx.size] = self.steps[idx]
        self.n = keep.size
        self.decimations += 1

    # ------------------------------------------------------------------ the result
    def arrays(self, init_scale: float, skip_by_scale: bool, copy: bool, hist_after: int = -1,
               steps_from: int = 0, rows_from: int = 0) -> dict[str, np.ndarray]:
        """Host arrays of everything flushed so far. ``copy=False`` returns views of the store (for the final
        run: no second copy of the histograms); a snapshot of an open recorder needs ``copy=True``. Only the
        histograms of steps after ``hist_after`` are included (every step's scalars always are). A save of
        what is new asks for the steps from ``steps_from`` and the histogram rows from ``rows_from`` on."""
        a, n = steps_from, self.n_steps
        loss, nxt = self.host_scalars[0, a:n], self.host_scalars[1, a:n]
        previous = init_scale if a == 0 else self.host_scalars[1, a - 1]
        used = np.concatenate([[previous], nxt[:-1]]) if nxt.size else np.zeros(0)
        if copy:
            loss, nxt = loss.copy(), nxt.copy()
        if self.counts is None:
            counts = np.zeros((0, self.n_tensors, NBINS), dtype=np.int64)
            order = np.zeros((0, self.n_tensors), dtype=np.int32)
            steps = np.zeros(0, dtype=np.int64)
        else:
            first = int(np.searchsorted(self.steps[:self.n], hist_after, side="right")) if hist_after >= 0 \
                else min(rows_from, self.n)
            counts, order, steps = (x[first:self.n] for x in (self.counts, self.order, self.steps))
            if copy:
                counts, order, steps = counts.copy(), order.copy(), steps.copy()
        return {"steps": np.arange(a, max(a, n)), "loss": loss, "loss_scale": used, "next_scale": nxt,
                "skipped": (np.asarray(self.skips[a:n], dtype=bool) if self.skips is not None else
                            (nxt < used) if skip_by_scale else np.zeros(nxt.size, dtype=bool)),
                "hist_steps": steps, "counts": counts, "grad_order": order,
                "scheduler_steps": np.asarray(self.scheduler[a:n], dtype=np.int64)}
