"""Counting with torch ops (any device): bin keys computed on the device, one count per batch.

A key is the histogram column of one value: ``((bits(|x|) - 1) >> 23) + 1`` on the fp32 bit
pattern gives 0 for zeros, 1 for 0 < |x| <= 2**-126, k + 128 for 2**k < |x| <= 2**(k+1),
255 above 2**127 (inf included) and 256 for nan: ``NBINS`` = 257 columns. fp16, bf16 and fp8 are
exact in fp32; fp64 gets its own exact key from its 64 bits (values below fp32's range go to
column 1, above it to 255). A complex tensor is counted by ``|z|``. Keys of many tensors, offset by
``row * NBINS``, share one flat buffer and one count::

    counts = torch.zeros(2, NBINS, dtype=torch.int64)
    b = Binner("cpu")
    b.target = counts.view(-1)
    b.add(grad_a, 0); b.add(grad_b, 1); b.submit(); b.wait()
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["NBINS", "Binner", "group_offsets", "prepare", "dense_flat", "fp64_columns"]

NBINS = 257
_SMALL = 1 << 16          # tensors below this many elements are keyed together (per-op overhead dominates)


def prepare(x: torch.Tensor) -> torch.Tensor:
    """The values a histogram counts: detached; a sparse tensor's stored values; a DTensor's local
    shard (FSDP2: counts of the shards add up over ranks to the full tensor's); ``|z|`` of a complex one."""
    if type(x) is not torch.Tensor and hasattr(x, "to_local"):
        x = x.to_local()
    x = x.detach()
    if x.is_sparse:
        x = x.coalesce().values()          # only stored values are counted
    if x.is_complex():
        x = x.abs()                        # magnitudes: |3e-30 + 4j| = 4
    return x


def dense_flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 1-D tensor, a view whenever its elements fill a block of memory in any order
    (a transposed gradient, say): a histogram does not care about the order."""
    if x.is_contiguous():
        return x.view(-1)
    dims = sorted((s, n) for s, n in zip(x.stride(), x.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return x.reshape(-1)           # overlapping or gapped: a copy
        expected *= size
    return x.as_strided((x.numel(),), (1,))


class Binner:
    """Turns tensors into bin keys in a flat buffer and counts them with one bincount.

    ``add(x, row)`` writes the keys of ``x`` (offset by ``row * NBINS``) into the buffer;
    ``add_group`` does the same for many small tensors at once; ``submit()`` counts everything
    buffered into ``target`` (a flat int64 tensor of ``rows * NBINS``). The buffer grows up to
    ``max_capacity`` keys, so a training step needs one count; beyond that it is counted in pieces.
    On CPU the count is split across threads (``torch.bincount`` itself is single-threaded and
    releases the GIL). On CUDA it is an ``index_add_``, since ``torch.bincount`` on CUDA reads its
    max back to the host (a sync); the keys and the count then run asynchronously on the device.
    """

    def __init__(self, device, capacity: int = 1 << 20, max_capacity: int = 1 << 25, threads: int | None = None):
        self.device = torch.device(device)
        self.max_capacity = int(max(max_capacity, 1 << 12))
        self.capacity = int(min(max(capacity, 1 << 12), self.max_capacity))
        self._buf = torch.empty(self.capacity, dtype=torch.int32, device=self.device)
        self._fill = 0
        self.target: torch.Tensor | None = None
        self.threads = max(1, torch.get_num_threads() if threads is None else int(threads))
        self._pool: ThreadPoolExecutor | None = None
        self._offsets: dict = {}          # group offsets per (row, size) layout: the same every step

    def add(self, x: torch.Tensor, row: int) -> None:
        """Append the keys of every element of ``x`` (complex: ``|x|``) to the buffer, for counts row ``row``."""
        flat = dense_flat(prepare(x))
        start = 0
        while start < flat.numel():
            n = self._reserve(flat.numel() - start)
            self._write_keys(flat[start:start + n], self._keys(n), row * NBINS + 1)
            start += n

    def add_many(self, tensors: list, rows: list) -> None:
        """Append the keys of several tensors, one row each; small dense float32 ones in one set of ops."""
        small = [(t, r) for t, r in zip(tensors, rows)
                 if t.numel() < _SMALL and type(t) is torch.Tensor and t.dtype == torch.float32
                 and t.layout == torch.strided and t.device == self.device]
        if len(small) < 2:
            small = []
        grouped = {id(t) for t, _ in small}
        for t, r in zip(tensors, rows):
            if id(t) not in grouped:
                self.add(t, r)
        if small:
            key = tuple((r, t.numel()) for t, r in small)
            offsets = self._offsets.get(key)
            if offsets is None:
                if len(self._offsets) > 64:
                    self._offsets.clear()
                offsets = self._offsets[key] = group_offsets([n for _, n in key], [r for r, _ in key], self.device)
            self.add_group([t for t, _ in small], [r for _, r in small], offsets)

    def add_group(self, tensors: list, rows: list, offsets: torch.Tensor) -> None:
        """Append the keys of several float32 tensors at once (one set of ops instead of one per tensor).

        ``offsets`` holds, per element of the concatenated tensors, ``row * NBINS + 1`` for their
        ``rows`` (see :func:`group_offsets`); tensors must be dense float32 on this device.
        """
        n = offsets.numel()
        if self._reserve(n) < n:
            raise ValueError(f"add_group: {n} elements exceed max_capacity={self.max_capacity}")
        keys = self._keys(n)
        torch.cat([t.detach().reshape(-1) for t in tensors], out=keys.view(torch.float32))
        keys.bitwise_and_(0x7FFFFFFF).sub_(1).bitwise_right_shift_(23).add_(offsets)
        self._fill += n

    def _reserve(self, n: int) -> int:
        """Make room for up to ``n`` keys (growing, or counting what is buffered); how many fit."""
        if self._fill + n > self.capacity and self.capacity < self.max_capacity:
            bigger = torch.empty(min(max(2 * self.capacity, self._fill + n), self.max_capacity),
                                 dtype=torch.int32, device=self.device)
            bigger[:self._fill].copy_(self._buf[:self._fill])
            self._buf, self.capacity = bigger, bigger.numel()
        if self._fill == self.capacity:
            self.submit()
        return min(n, self.capacity - self._fill)

    def _keys(self, n: int) -> torch.Tensor:
        return self._buf[self._fill:self._fill + n]

    def _write_keys(self, chunk: torch.Tensor, keys: torch.Tensor, offset: int) -> None:
        if chunk.dtype == torch.float32:
            torch.abs(chunk, out=keys.view(torch.float32))
            keys.sub_(1).bitwise_right_shift_(23)
        elif chunk.dtype == torch.bfloat16:        # bf16 is fp32's top half: (m16 - 1) >> 7, same key
            torch.bitwise_and(chunk.view(torch.int16), 0x7FFF, out=keys)   # reads 2 bytes, stores 4
            keys.sub_(1).bitwise_right_shift_(7)
        elif chunk.dtype == torch.float64:         # exact, from the 64 bits (no rounding to fp32)
            keys.copy_(fp64_columns(chunk).sub_(1))
        else:                                      # fp16, fp8: exact in fp32
            keys.view(torch.float32).copy_(chunk)
            keys.bitwise_and_(0x7FFFFFFF).sub_(1).bitwise_right_shift_(23)
        keys.add_(offset)
        self._fill += chunk.numel()

    def submit(self) -> None:
        """Count the buffered keys into ``target``."""
        if self._fill == 0:
            return
        if self.target is None:
            raise RuntimeError("Binner.submit: no target counts tensor set")
        keys = self._buf[:self._fill]
        if keys.device.type != "cpu":
            _count_index_add(keys, self.target)
        elif self.threads > 1 and keys.numel() >= _PARALLEL_MIN:
            self._count_parallel(keys)
        else:
            _count_cpu(keys, self.target)
        self._fill = 0

    def _count_parallel(self, keys: torch.Tensor) -> None:
        target = self.target
        assert target is not None, "count: the counter has no target"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="ampviz-count")
        parts = keys.tensor_split(self.threads)
        m = target.numel()
        futures = [self._pool.submit(torch.bincount, p, None, m) for p in parts[1:]]
        target.add_(torch.bincount(parts[0], minlength=m))
        for f in futures:
            target.add_(f.result())

    def wait(self) -> None:
        """Kept for callers that time the capture: counting is synchronous on CPU."""

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


_PARALLEL_MIN = 1 << 18      # below this many keys one thread counts faster than a hand-off


def group_offsets(sizes, rows, device) -> torch.Tensor:
    """Per-element ``row * NBINS + 1`` for tensors of ``sizes`` counted into ``rows`` (int32)."""
    per_row = torch.tensor([r * NBINS + 1 for r in rows], dtype=torch.int32)
    return torch.repeat_interleave(per_row, torch.tensor(list(sizes))).to(device)


def _count_cpu(keys: torch.Tensor, target: torch.Tensor) -> None:
    target.add_(torch.bincount(keys, minlength=target.numel()))


def _count_index_add(keys: torch.Tensor, target: torch.Tensor) -> None:
    # no bincount on CUDA: it reads the max key back to the host to size its output (a sync)
    target.index_add_(0, keys, torch.ones((), dtype=target.dtype, device=keys.device).expand(keys.numel()))


def fp64_columns(x: torch.Tensor) -> torch.Tensor:
    """Column of every fp64 value: binade k = ((bits(|x|) - 1) >> 52) - 1023, clamped to "below" / "above"."""
    a = x.view(torch.int64).bitwise_and(0x7FFFFFFFFFFFFFFF)
    col = a.sub(1).bitwise_right_shift_(52).sub_(1023 - 128).clamp_(1, NBINS - 2)
    col.masked_fill_(a == 0, 0)
    return col.masked_fill_(a > 0x7FF0000000000000, NBINS - 1)
