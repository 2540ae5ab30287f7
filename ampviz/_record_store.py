"""Where a Recorder keeps its numbers: a small ring buffer on the device, flushed to host arrays.

Per step the device receives a loss, the scale after ``update()`` and (on recorded steps) a row
of histogram counts; nothing is read back until the ring is full. A flush copies the ring to
the host in one transfer (the only device->host sync) and appends it to growing numpy chunks.
When the chunks would exceed ``max_bytes``, every other recorded step is dropped (decimation).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from ._binning import NBINS
from ._warnings import AmpvizWarning


class StepStore:
    """Device ring + host chunks for per-step scalars and histogram rows."""

    def __init__(self, device, n_tensors: int, flush_every: int, max_bytes: int, every: int):
        self.n_tensors, self.flush_every, self.max_bytes, self.every = n_tensors, flush_every, max_bytes, every
        # (flush_every, T, NBINS) counts on the device; (2, flush_every) loss and scale after update()
        self.ring = torch.zeros(flush_every, n_tensors, NBINS, dtype=torch.int64, device=device)
        self.scalars = torch.zeros(2, flush_every, dtype=torch.float64, device=device)
        self.rows_used, self.row_steps, self.scalars_used = 0, [], 0
        self.host = {"loss": [], "next_scale": [], "hist_steps": [], "counts": []}
        self.decimations = 0

    def slot(self) -> torch.Tensor:
        """Flat view of the counts row that the current recorded step adds into."""
        return self.ring[self.rows_used].view(-1)

    def put_scalars(self, loss, scaler) -> None:
        """Store this step's loss and the scaler's current scale without a host sync."""
        j = self.scalars_used
        if loss is None:
            self.scalars[0, j] = math.nan
        elif isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"loss: expected a scalar, got a tensor of shape {tuple(loss.shape)}")
            self.scalars[0, j].copy_(loss.detach().reshape(()))
        else:
            self.scalars[0, j] = float(loss)
        scale = getattr(scaler, "_scale", None) if scaler is not None else None
        if scale is not None:
            self.scalars[1, j].copy_(scale.reshape(()))      # get_scale() would sync on GPU
        else:
            self.scalars[1, j] = 1.0 if scaler is None else scaler.get_scale()
        self.scalars_used += 1
        if self.scalars_used == self.flush_every:
            self.flush_scalars()

    def end_row(self, step: int, binner) -> None:
        """The current row is complete (its counts were submitted); move to the next."""
        self.row_steps.append(step)
        self.rows_used += 1
        if self.rows_used == self.flush_every:
            self.flush_counts(binner)

    def flush_scalars(self) -> None:
        n = self.scalars_used
        if n:
            host = self.scalars[:, :n].cpu().numpy()           # note: a device->host sync, once per flush
            self.host["loss"].append(host[0].copy())
            self.host["next_scale"].append(host[1].copy())
            self.scalars_used = 0

    def flush_counts(self, binner) -> None:
        binner.wait()
        n = self.rows_used
        if n:
            self.host["counts"].append(self.ring[:n].cpu().numpy().copy())   # sync, once per flush
            self.host["hist_steps"].extend(self.row_steps)
            self.ring.zero_()
            self.rows_used, self.row_steps = 0, []
            self._maybe_decimate()
        binner.target = self.slot()

    def _maybe_decimate(self) -> None:
        row_bytes = self.n_tensors * NBINS * 8
        while len(self.host["hist_steps"]) * row_bytes > self.max_bytes and len(self.host["hist_steps"]) > 1:
            counts = np.concatenate(self.host["counts"])
            steps = np.asarray(self.host["hist_steps"])
            keep = (steps // self.every) % 2 == 0
            self.host["counts"], self.host["hist_steps"] = [counts[keep]], steps[keep].tolist()
            self.every *= 2
            self.decimations += 1
            warnings.warn(f"Recorder: histograms reached max_bytes={self.max_bytes}; keeping every "
                          f"{self.every}th step from now on", AmpvizWarning, stacklevel=6)

    def arrays(self, init_scale: float, skip_by_scale: bool) -> dict:
        """Host arrays of everything flushed so far (steps, loss, scales, skipped, counts)."""
        nxt = np.concatenate(self.host["next_scale"]) if self.host["next_scale"] else np.zeros(0)
        used = np.concatenate([[init_scale], nxt[:-1]]) if nxt.size else np.zeros(0)
        loss = np.concatenate(self.host["loss"]) if self.host["loss"] else np.zeros(0)
        counts = (np.concatenate(self.host["counts"]) if self.host["counts"]
                  else np.zeros((0, self.n_tensors, NBINS), dtype=np.int64))
        return {"steps": np.arange(nxt.size), "loss": loss, "loss_scale": used, "next_scale": nxt,
                "skipped": (nxt < used) if skip_by_scale else np.zeros(nxt.size, dtype=bool),
                "hist_steps": np.asarray(self.host["hist_steps"], dtype=np.int64), "counts": counts}
