"""Counting on the CPU in one pass: numba kernels that read each value once and bump its column.

The torch path (:class:`~ampviz._counting.ops.Binner`) needs four elementwise passes to build keys plus a
``bincount`` that reads them three more times; on a CPU that is memory-bound, and that is the
whole cost of recording. These kernels read the bits of each value once and count it in one of
eight private sub-histograms (so repeated columns do not serialise on one counter). The column of
a value is the formula of :mod:`~ampviz._counting.ops` (fp64 gets its own, exact one)::

    counter = NumbaCounter()
    counter.target = counts.view(-1)        # int64, rows * NBINS, on the CPU
    counter.add(grad, row)                  # counted now, no buffer
    counter.add_many([g1, g2], [0, 1])      # several tensors, split over threads when large

Threads: the kernels are serial and release the GIL; work of many millions of values is split over at
most ``torch.get_num_threads()`` Python threads (the caller's and a small pool). numba's own parallel
runtime is never started: it shares OpenMP with torch and would change ``torch.get_num_threads()``
for the whole process. Counting runs while torch waits for it (inside a hook), so it never uses
more threads than the user gave torch.

When numba cannot be imported, :func:`available` is False and ampviz uses the torch path.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .ops import NBINS, dense_flat, prepare

try:
    from numba import njit
except ImportError:                                   # pragma: no cover - depends on the platform
    njit = None  # type: ignore[assignment]

__all__ = ["available", "NumbaCounter"]

# values each thread must get before a count is split: measured on a 2-core CPU (torch 2.13), splitting a
# transformer's 4.2M weight-gradient values over two threads was slower than one (torch's idle OpenMP threads
# keep spinning on the cores for a while after each op), so only counts of many millions of values are split
_SHARE_MIN = 1 << 22
_MAX_THREADS = 8             # beyond this the memory bus, not the cores, limits counting
_LANES = 8                   # private sub-histograms: a repeated column does not wait for the last add
_PIECE = 1 << 30             # values per kernel call, so a uint32 lane counter (<= _PIECE / _LANES) never wraps


def available() -> bool:
    return njit is not None


if njit is not None:
    # One kernel per kind of bit pattern, each with its column formula inline (no branch per value; numba's
    # cache cannot store kernels that take a function as an argument). Each counts ``bits`` (at most _PIECE
    # values: see _call) into ``out`` (NBINS,) int64 through eight private uint32 sub-histograms.
    @njit(cache=True, nogil=True)
    def _flush(loc, out):
        for j in range(_LANES):
            for b in range(NBINS):
                out[b] += loc[j, b]
                loc[j, b] = 0

    @njit(cache=True, nogil=True)
    def _count_fp32(bits, lut, out):                  # ((bits(|x|) - 1) >> 23) + 1, see ampviz._counting.ops
        loc = np.zeros((_LANES, NBINS), np.uint32)
        n, i = bits.size, 0
        while i + _LANES <= n:                        # eight values in flight, eight private counters
            for j in range(_LANES):
                loc[j, (((bits[i + j] & 0x7FFFFFFF) - 1) >> 23) + 1] += 1
            i += _LANES
        for k in range(i, n):
            loc[0, (((bits[k] & 0x7FFFFFFF) - 1) >> 23) + 1] += 1
        _flush(loc, out)

    @njit(cache=True, nogil=True)
    def _count_bf16(bits, lut, out):                  # bf16 is fp32's top half: the same formula on 16 bits
        loc = np.zeros((_LANES, NBINS), np.uint32)
        n, i = bits.size, 0
        while i + _LANES <= n:
            for j in range(_LANES):
                loc[j, (((bits[i + j] & 0x7FFF) - 1) >> 7) + 1] += 1
            i += _LANES
        for k in range(i, n):
            loc[0, (((bits[k] & 0x7FFF) - 1) >> 7) + 1] += 1
        _flush(loc, out)

    @njit(cache=True, nogil=True)
    def _count_fp16(bits, lut, out):                  # fp16 -> fp32 is exact: a table of its 2**15 magnitudes
        loc = np.zeros((_LANES, NBINS), np.uint32)
        n, i = bits.size, 0
        while i + _LANES <= n:
            for j in range(_LANES):
                loc[j, lut[bits[i + j] & 0x7FFF]] += 1
            i += _LANES
        for k in range(i, n):
            loc[0, lut[bits[k] & 0x7FFF]] += 1
        _flush(loc, out)

    @njit(cache=True, nogil=True, inline="always")
    def _col_fp64(v):                                 # exactly: binade k = ((bits(|x|) - 1) >> 52) - 1023
        a = v & 0x7FFFFFFFFFFFFFFF
        if a == 0:
            return 0
        if a > 0x7FF0000000000000:                    # nan
            return NBINS - 1
        col = ((a - 1) >> 52) - 1023 + 128
        return 1 if col < 2 else (NBINS - 2 if col > NBINS - 3 else col)   # below / above fp32's range

    @njit(cache=True, nogil=True)
    def _count_fp64(bits, lut, out):
        loc = np.zeros((_LANES, NBINS), np.uint32)
        n, i = bits.size, 0
        while i + _LANES <= n:
            for j in range(_LANES):
                loc[j, _col_fp64(bits[i + j])] += 1
            i += _LANES
        for k in range(i, n):
            loc[0, _col_fp64(bits[k])] += 1
        _flush(loc, out)


def _fp16_lut() -> np.ndarray:
    """Column of every fp16 magnitude bit pattern (exact: fp16 -> fp32 is exact)."""
    pats = torch.arange(1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    m = pats.view(torch.int32)
    return (((m - 1) >> 23) + 1).numpy().astype(np.uint16)      # 64 KiB: stays in cache


_LUT16 = _fp16_lut()
_NO_LUT = np.zeros(1, np.uint16)


def _bits(x: torch.Tensor):
    """(bit patterns as a 1-D numpy array, the kernel that counts them, its table) of a CPU tensor: a view
    where its elements are dense."""
    fast = _FAST.get(x.dtype) if type(x) is torch.Tensor and x.is_contiguous() and x.layout == torch.strided else None
    if fast is not None:                          # a plain dense gradient: the common case, fewer checks
        return (x.detach() if x.requires_grad else x).view(fast[0]).numpy().reshape(-1), fast[1], fast[2]
    flat = dense_flat(prepare(x))
    if flat.dtype == torch.float32:
        return flat.view(torch.int32).numpy(), _count_fp32, _NO_LUT
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy(), _count_bf16, _NO_LUT
    if flat.dtype == torch.float16:
        return flat.view(torch.int16).numpy(), _count_fp16, _LUT16
    if flat.dtype == torch.float64:
        return flat.view(torch.int64).numpy(), _count_fp64, _NO_LUT
    return flat.float().view(torch.int32).numpy(), _count_fp32, _NO_LUT     # fp8: exact in fp32


_FAST = {torch.float32: (torch.int32, _count_fp32, _NO_LUT), torch.bfloat16: (torch.int16, _count_bf16, _NO_LUT),
         torch.float16: (torch.int16, _count_fp16, _LUT16)} if njit is not None else {}


class NumbaCounter:
    """Drop-in for ``Binner`` on the CPU: ``add`` counts immediately into ``target``.

    ``threads`` caps the threads one count may use (default: ``torch.get_num_threads()``, read at
    each count, at most 8); a count is split only where each thread gets ``min_share`` values.
    """

    def __init__(self, threads: int | None = None, min_share: int = _SHARE_MIN):
        if njit is None:
            raise RuntimeError("NumbaCounter needs numba")
        self._threads = None if threads is None else max(1, int(threads))
        self.min_share = max(1, int(min_share))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._target: torch.Tensor | None = None
        self._target_np: np.ndarray | None = None

    @property
    def target(self) -> torch.Tensor | None:
        return self._target

    @target.setter
    def target(self, counts: torch.Tensor | None) -> None:
        self._target = counts
        self._target_np = None if counts is None else counts.numpy()

    def threads(self) -> int:
        return self._threads if self._threads is not None else max(1, min(torch.get_num_threads(), _MAX_THREADS))

    def _row(self, row: int) -> np.ndarray:
        if self._target_np is None:
            raise RuntimeError("NumbaCounter: no target counts tensor set")
        return self._target_np[row * NBINS:(row + 1) * NBINS]

    def add(self, x: torch.Tensor, row: int) -> None:
        """Count every element of ``x`` (complex: ``|x|``) into row ``row`` of ``target``."""
        out = self._row(row)
        bits, kernel, lut = _bits(x)
        threads = min(self.threads(), bits.size // self.min_share) if bits.size >= 2 * self.min_share else 1
        if threads > 1:
            self._parallel([(bits[lo:hi], kernel, lut, out) for lo, hi in _spans(bits.size, threads)], threads)
        elif bits.size <= _PIECE:
            kernel(bits, lut, out)
        else:
            _call(kernel, bits, lut, out)

    def add_many(self, tensors: list, rows: list) -> None:
        """Count several tensors, one row each; large totals are split over threads in one hand-off."""
        jobs, total = [], 0
        for x, r in zip(tensors, rows):
            bits, kernel, lut = _bits(x)
            if bits.size:
                jobs.append((bits, kernel, lut, self._row(r)))
                total += bits.size
        threads = min(self.threads(), total // self.min_share) if total >= 2 * self.min_share else 1
        if threads <= 1:
            for bits, kernel, lut, out in jobs:
                if bits.size <= _PIECE:
                    kernel(bits, lut, out)
                else:
                    _call(kernel, bits, lut, out)
            return
        # equal shares of the concatenated values; a tensor cut between two shares is counted in pieces
        pieces, share = [], -(-total // threads)
        pos = 0
        for bits, kernel, lut, out in jobs:
            for lo, hi in _cuts(pos, bits.size, share):
                pieces.append((bits[lo:hi], kernel, lut, out))
            pos += bits.size
        self._parallel(pieces, threads)

    def add_group(self, tensors: list, rows: list, offsets=None) -> None:
        self.add_many(tensors, rows)

    def _parallel(self, pieces: list, threads: int) -> None:
        """Count ``pieces`` (bits, kernel, lut, out row) over ``threads`` threads, the caller's included.

        Pieces that share an out row are counted into private rows and added here, so no two threads
        ever write the same counter.
        """
        uses = Counter(id(p[3]) for p in pieces)
        private, ready = [], []
        for bits, kernel, lut, out in pieces:
            if uses[id(out)] > 1:
                tmp = np.zeros(NBINS, np.int64)
                private.append((tmp, out))
                out = tmp
            ready.append((bits, kernel, lut, out))
        groups = _balance(ready, threads)
        if self._pool is None or self._pool_size < len(groups) - 1:
            self.close()
            self._pool_size = threads - 1
            self._pool = ThreadPoolExecutor(self._pool_size, thread_name_prefix="ampviz-count")
        futures = [self._pool.submit(_count_all, group) for group in groups[1:]]
        _count_all(groups[0])
        for f in futures:
            f.result()
        for tmp, out in private:
            out += tmp

    def submit(self) -> None:
        """Nothing is buffered: counts land during ``add``."""

    def wait(self) -> None:
        """Nothing runs in the background."""

    def close(self) -> None:
        """Stop the counting threads (a later count starts them again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _count_all(pieces) -> None:
    for bits, kernel, lut, out in pieces:
        _call(kernel, bits, lut, out)


def _call(kernel, bits, lut, out) -> None:
    for lo in range(0, bits.size, _PIECE):            # a loop inside the kernel would slow it by half
        kernel(bits[lo:lo + _PIECE], lut, out)


def _spans(n: int, parts: int):
    step = -(-n // parts)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _cuts(pos: int, size: int, share: int):
    """(lo, hi) pieces of a tensor starting at ``pos`` in the concatenation, cut at multiples of ``share``."""
    lo = 0
    while lo < size:
        hi = min(size, (pos + lo) // share * share + share - pos)
        yield lo, hi
        lo = hi


def _balance(pieces: list, threads: int) -> list:
    """Pieces grouped into ``threads`` lists of about equal size (they arrive as contiguous shares)."""
    total = sum(p[0].size for p in pieces)
    share = -(-total // threads)
    groups: list[list] = [[] for _ in range(threads)]
    pos = 0
    for p in pieces:
        groups[min(threads - 1, pos // share)].append(p)
        pos += p[0].size
    return [g for g in groups if g] or [[]]
