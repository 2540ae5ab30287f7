"""Counting on the CPU in one pass: numba kernels that read each value once and bump its column.

The torch path (``ampviz._binning.Binner``) needs four elementwise passes to build keys plus a
``bincount`` that reads them three more times; on a CPU that is memory-bound, and that is the
whole cost of recording. These kernels read the bits of each value once and count it in a
private sub-histogram (four per thread, so repeated columns do not serialise on one counter).
The column of a value is the same formula as the torch path (see ``ampviz/_binner.py``)::

    counter = NumbaCounter()
    counter.target = counts.view(-1)        # int64, rows * NBINS, on the CPU
    counter.add(grad, row)                  # counted now, no buffer

When numba cannot be imported, :func:`available` is False and ampviz uses the torch path.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ._binning import NBINS

try:
    from numba import get_num_threads, njit, prange
except ImportError:                                   # pragma: no cover - depends on the platform
    njit = None

__all__ = ["available", "NumbaCounter", "make_counter"]

_PARALLEL_MIN = 1 << 20      # below this many values one thread is as fast as a parallel region
_LANES = 4                   # sub-histograms per thread: breaks the dependency on a repeated column


def available() -> bool:
    return njit is not None


if njit is not None:
    @njit(cache=True, nogil=True)
    def _col32(v):
        return (((v & 0x7FFFFFFF) - 1) >> 23) + 1

    @njit(cache=True, nogil=True)
    def _col_bf16(v):
        return (((v & 0x7FFF) - 1) >> 7) + 1

    @njit(cache=True, nogil=True)
    def _col(v, kind, lut):
        if kind == 0:
            return _col32(v)
        if kind == 1:
            return _col_bf16(v)
        return lut[v & 0x7FFF]

    @njit(cache=True, nogil=True)
    def _count_range(bits, lo, hi, kind, lut, loc):
        """Count bits[lo:hi] into loc (LANES, NBINS); kind 0 fp32, 1 bf16, 2 fp16 (via lut)."""
        i = lo
        while i + _LANES <= hi:             # four values in flight, four private counters
            for j in range(_LANES):
                loc[j, _col(bits[i + j], kind, lut)] += 1
            i += _LANES
        while i < hi:
            loc[0, _col(bits[i], kind, lut)] += 1
            i += 1

    @njit(cache=True, nogil=True)
    def _hist_serial(bits, kind, lut, out):
        loc = np.zeros((_LANES, NBINS), np.int64)
        _count_range(bits, 0, bits.size, kind, lut, loc)
        for j in range(_LANES):
            for b in range(NBINS):
                out[b] += loc[j, b]

    @njit(parallel=True, cache=True, nogil=True)
    def _hist_parallel(bits, kind, lut, out, nt):
        n = bits.size
        loc = np.zeros((nt, _LANES, NBINS), np.int64)
        chunk = (n + nt - 1) // nt
        for t in prange(nt):
            _count_range(bits, t * chunk, min(n, (t + 1) * chunk), kind, lut, loc[t])
        for t in range(nt):
            for j in range(_LANES):
                for b in range(NBINS):
                    out[b] += loc[t, j, b]


def _fp16_lut() -> np.ndarray:
    """Column of every fp16 magnitude bit pattern (exact: fp16 -> fp32 is exact)."""
    pats = torch.arange(1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    m = pats.view(torch.int32)
    return (((m - 1) >> 23) + 1).numpy().astype(np.int64)


_LUT16 = _fp16_lut()
_NO_LUT = np.zeros(1, np.int64)


class NumbaCounter:
    """Drop-in for ``Binner`` on the CPU: ``add`` counts immediately into ``target``."""

    def __init__(self, threads: int | None = None):
        if njit is None:
            raise RuntimeError("NumbaCounter needs numba")
        self.threads = max(1, min(get_num_threads(), 8) if threads is None else int(threads))
        self.target: torch.Tensor | None = None

    def add(self, x: torch.Tensor, row: int) -> None:
        """Count every element of ``x`` into row ``row`` of ``target``."""
        if self.target is None:
            raise RuntimeError("NumbaCounter.add: no target counts tensor set")
        if x.is_sparse:
            x = x.coalesce().values()          # only stored values are counted
        flat = x.detach().reshape(-1)
        if flat.dtype == torch.float32:
            bits, kind, lut = flat.view(torch.int32).numpy(), 0, _NO_LUT
        elif flat.dtype == torch.bfloat16:
            bits, kind, lut = flat.view(torch.int16).numpy(), 1, _NO_LUT
        elif flat.dtype == torch.float16:
            bits, kind, lut = flat.view(torch.int16).numpy(), 2, _LUT16
        else:                                  # fp64 (rounded), fp8 (exact): via fp32
            bits, kind, lut = flat.float().view(torch.int32).numpy(), 0, _NO_LUT
        out = self.target.numpy()[row * NBINS:(row + 1) * NBINS]
        # numba's default thread pool must not be entered from two threads at once: only the main
        # thread (where CPU backward hooks run) uses it
        if bits.size >= _PARALLEL_MIN and self.threads > 1 and threading.current_thread() is threading.main_thread():
            _hist_parallel(bits, kind, lut, out, self.threads)
        elif bits.size:
            _hist_serial(bits, kind, lut, out)

    def add_group(self, tensors: list, rows: list, offsets=None) -> None:
        """Count several tensors (one row each); ``offsets`` is for the torch path and unused here."""
        for t, r in zip(tensors, rows):
            self.add(t, r)

    def submit(self) -> None:
        """Nothing is buffered: counts land during ``add``."""

    def wait(self) -> None:
        """Nothing runs in the background."""

    def close(self) -> None:
        """Nothing to release."""


def make_counter(device, capacity: int = 1 << 20):
    """The fastest counter for ``device``: numba on the CPU when available, else the torch path."""
    from ._binning import Binner
    device = torch.device(device)
    if device.type == "cpu" and available():
        return NumbaCounter()
    return Binner(device, capacity=capacity)
