"""Cached views of a Run for figures and widgets: per-tensor counts in a domain, computed once, on demand.

``Run.counts_in`` converts every tensor of every rank at once (a copy of the whole counts array:
2,000 steps × 50 tensors is 200 MB); widgets need one tensor or one selection at a time, so they
convert lazily and keep the result.
"""

from __future__ import annotations

import warnings

import numpy as np

from .. import histogram as H
from .._warnings import AmpvizWarning
from ..run import Run

__all__ = ["RunView", "as_counts_source"]


class RunView:
    """Lazily converted, cached counts of a :class:`~ampviz.run.Run`."""

    def __init__(self, run: Run):
        if not isinstance(run, Run):
            raise TypeError(f"run: expected an ampviz.Run, got {type(run).__name__}")
        if run.hist_steps.size == 0:
            raise ValueError("run: has no histogram steps (recorded with no steps, or every > steps)")
        self.run = run
        self._cache: dict = {}
        log2s = run.scale_log2_at_hist()                                   # (R, H)
        if not np.all(np.mod(log2s, 1) == 0):
            warnings.warn("loss scales that are not powers of two: shifting by the nearest power of two",
                          AmpvizWarning, stacklevel=3)
        self.log2_scales = np.rint(log2s).astype(np.int64)                 # (R, H)
        domains = run.meta.get("domains", {})
        self.stored = [domains.get(k, "unscaled") for k in run.tensor_kinds]

    def tensor_counts(self, rank: int, tensor: int, domain: str = "unscaled") -> np.ndarray:
        """(H, NBINS) counts of one tensor (by index) of one rank (by index) in ``domain``."""
        key = ("t", rank, tensor, domain)
        if key not in self._cache:
            c = self.run.counts[rank, :, tensor]
            have = self.stored[tensor]
            if have != domain:
                sign = -1 if domain == "unscaled" else 1
                c = H.shift(c, sign * self.log2_scales[rank])
            self._cache[key] = c
        return self._cache[key]

    def selection_counts(self, rank: int, tensors, domain: str = "unscaled") -> np.ndarray:
        """(H, NBINS) counts summed over ``tensors`` (indices), cached per selection.

        Shifting is linear, so the tensors stored in the other domain are summed first and
        shifted once, whatever their number.
        """
        tensors = tuple(int(t) for t in tensors)
        key = ("s", rank, tensors, domain)
        if key not in self._cache:
            if not tensors:
                raise ValueError("tensors: the selection is empty")
            if len(tensors) == 1:
                self._cache[key] = self.tensor_counts(rank, tensors[0], domain)
                return self._cache[key]
            counts = self.run.counts[rank]                                        # (H, T, NBINS)
            same = [t for t in tensors if self.stored[t] == domain]
            other = [t for t in tensors if self.stored[t] != domain]
            total = counts[:, same].sum(axis=1) if same else np.zeros((counts.shape[0], H.NBINS), np.int64)
            if other:
                sign = -1 if domain == "unscaled" else 1
                total = total + H.shift(counts[:, other].sum(axis=1), sign * self.log2_scales[rank])
            self._cache[key] = total
        return self._cache[key]

    def tensors_of(self, tensor=None, kind=None) -> list:
        """Indices selected by a tensor name/index (or list of them) and/or a kind."""
        run = self.run
        if tensor is None:
            idx = list(range(len(run.tensor_names)))
        elif isinstance(tensor, (list, tuple)):
            idx = [run.tensor_index(t) for t in tensor]
        else:
            idx = [run.tensor_index(tensor)]
        if kind is not None:
            kinds = sorted(set(run.tensor_kinds))
            if kind not in kinds:
                raise ValueError(f"kind: expected one of {kinds} or None, got {kind!r}")
            idx = [i for i in idx if run.tensor_kinds[i] == kind]
            if not idx:
                raise ValueError(f"kind: no {kind} tensor among the selected tensors {tensor!r}")
        return idx


def as_counts_source(source, *, step=None, tensor=None, kind=None, rank=None):
    """Resolve a ScaleExplorer source into (counts (NBINS,), description, run or None).

    ``source`` is a Run (narrowed by step / tensor / kind / rank; all histogram steps pooled when
    ``step`` is None), an integer counts array (..., NBINS), or a floating-point tensor/array of
    raw values (histogrammed here).
    """
    import torch
    if isinstance(source, Run):
        view = RunView(source)
        r = source.rank_index(source.ranks[0] if rank is None else rank)
        idx = view.tensors_of(tensor, kind)
        counts = view.selection_counts(r, idx, "unscaled")
        if len(idx) == 1:
            who = f"{source.tensor_names[idx[0]]}"
        else:
            who = f"{len(idx)} {kind + ' ' if kind else ''}tensors"
        if step is None:
            return counts.sum(axis=0), f"{who}, all {source.hist_steps.size} recorded steps", source
        return counts[source.hist_index(step)], f"{who}, step {step}", source
    for name, value in (("step", step), ("tensor", tensor), ("kind", kind), ("rank", rank)):
        if value is not None:
            raise ValueError(f"{name}: only applies when the source is an ampviz.Run, got {name}={value!r}")
    if isinstance(source, torch.Tensor) and source.is_floating_point():
        return H.histogram(source.detach()).cpu().numpy(), f"a tensor of {source.numel():,} values", None
    arr = np.asarray(source) if not isinstance(source, torch.Tensor) else source.cpu().numpy()
    if arr.dtype.kind == "f":
        return H.histogram(torch.from_numpy(np.ascontiguousarray(arr))).numpy(), f"{arr.size:,} values", None
    if arr.dtype.kind in "iu" and arr.ndim >= 1 and arr.shape[-1] == H.NBINS:
        return arr.reshape(-1, H.NBINS).sum(axis=0), "recorded counts", None
    raise TypeError(f"source: expected an ampviz.Run, integer counts (..., {H.NBINS}) or a floating-point "
                    f"tensor of values; got {type(source).__name__} with dtype {arr.dtype} and shape {arr.shape}")
