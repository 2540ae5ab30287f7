"""The binning engine behind ampviz.histogram: bin keys computed on the device, one count per batch.

A key is the histogram column of one value: ``((bits(|x|) - 1) >> 23) + 1`` on the fp32 bit
pattern gives 0 for zeros, 1 for 0 < |x| <= 2**-126, k + 128 for 2**k < |x| <= 2**(k+1),
255 above 2**127 (inf included) and 256 for nan: ``NBINS`` = 257 columns. Keys of many tensors,
offset by ``row * NBINS``, share one flat buffer and one count::

    counts = torch.zeros(2, NBINS, dtype=torch.int64)
    b = Binner("cpu")
    b.target = counts.view(-1)
    b.add(grad_a, 0); b.add(grad_b, 1); b.submit(); b.wait()
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["NBINS", "Binner"]

NBINS = 257


class Binner:
    """Turns tensors into bin keys in a flat buffer and counts them with one bincount.

    ``add(x, row)`` writes the keys of ``x`` (offset by ``row * NBINS``) into the buffer;
    ``submit()`` counts everything buffered into ``target`` (a flat int64 tensor of
    ``rows * NBINS``). On CPU the count runs in a background thread (torch releases the GIL),
    overlapping with the rest of the training step; the key buffers are double-buffered so
    the next tensors never overwrite keys still being counted. On CUDA the count is an
    ``index_add_`` (``torch.bincount`` on CUDA reads its max back to the host: a sync).
    """

    def __init__(self, device, capacity: int = 1 << 22, background: bool | None = None):
        self.device = torch.device(device)
        self.capacity = int(max(capacity, 1 << 12))
        self.background = (self.device.type == "cpu") if background is None else bool(background)
        nbuf = 2 if self.background else 1
        self._bufs = [torch.empty(self.capacity, dtype=torch.int32, device=self.device) for _ in range(nbuf)]
        self._scratch16 = None
        self._pending = [None] * nbuf          # future still reading each buffer
        self._cur, self._fill = 0, 0
        self.target: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ampviz-bincount") if self.background else None

    def add(self, x: torch.Tensor, row: int) -> None:
        """Append the keys of every element of ``x`` to the buffer, for counts row ``row``."""
        if x.is_sparse:
            x = x.coalesce().values()          # only stored values are counted
        flat = x.detach().reshape(-1)
        offset = row * NBINS + 1
        start = 0
        while start < flat.numel():
            if self._fill == self.capacity:
                self.submit()
            n = min(flat.numel() - start, self.capacity - self._fill)
            self._write_keys(flat[start:start + n], offset)
            start += n

    def _write_keys(self, chunk: torch.Tensor, offset: int) -> None:
        buf = self._bufs[self._cur]
        if self._fill == 0 and self._pending[self._cur] is not None:
            self._pending[self._cur].result()      # the count still reading this buffer
            self._pending[self._cur] = None
        n, o = chunk.numel(), self._fill
        keys = buf[o:o + n]
        if chunk.dtype == torch.float32:
            torch.abs(chunk, out=keys.view(torch.float32))
            keys.sub_(1).bitwise_right_shift_(23)
        elif chunk.dtype == torch.bfloat16:        # bf16 is the top half of fp32: work on 2 bytes
            s16 = self._scratch(n)
            torch.bitwise_and(chunk.view(torch.int16), 0x7FFF, out=s16)
            s16.sub_(1).bitwise_right_shift_(7)
            keys.copy_(s16)
        else:                                      # fp16, fp8, fp64: convert to fp32 first
            keys.view(torch.float32).copy_(chunk)  # exact for fp16/fp8; fp64 is rounded
            keys.bitwise_and_(0x7FFFFFFF).sub_(1).bitwise_right_shift_(23)
        keys.add_(offset)
        self._fill += n

    def _scratch(self, n: int) -> torch.Tensor:
        if self._scratch16 is None or self._scratch16.numel() < n:
            self._scratch16 = torch.empty(self.capacity, dtype=torch.int16, device=self.device)
        return self._scratch16[:n]

    def submit(self) -> None:
        """Count the buffered keys into ``target`` (asynchronously on CPU)."""
        if self._fill == 0:
            return
        if self.target is None:
            raise RuntimeError("Binner.submit: no target counts tensor set")
        keys, target = self._bufs[self._cur][:self._fill], self.target
        if self._pool is not None:
            self._pending[self._cur] = self._pool.submit(_count_cpu, keys, target)
            self._cur = (self._cur + 1) % len(self._bufs)
        else:
            _count(keys, target)
        self._fill = 0

    def wait(self) -> None:
        """Block until every submitted count has landed in its target."""
        for i, fut in enumerate(self._pending):
            if fut is not None:
                fut.result()
                self._pending[i] = None

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _count_cpu(keys: torch.Tensor, target: torch.Tensor) -> None:
    target.add_(torch.bincount(keys, minlength=target.numel()))


def _count_index_add(keys: torch.Tensor, target: torch.Tensor) -> None:
    # no bincount on CUDA: it reads the max key back to the host to size its output (a sync)
    target.index_add_(0, keys, torch.ones((), dtype=target.dtype, device=keys.device).expand(keys.numel()))


def _count(keys: torch.Tensor, target: torch.Tensor) -> None:
    (_count_cpu if keys.device.type == "cpu" else _count_index_add)(keys, target)
