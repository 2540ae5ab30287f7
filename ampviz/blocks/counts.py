"""Counts of every value's binade distance from its block's maximum, on the tensor's device, with no host sync.

For a value ``v`` in a block whose largest finite magnitude is ``amax``::

    d = floor(log2 amax) - k(v),   k(v): the binade 2**k < |v| <= 2**(k+1)  (closed at the top, as in histogram.py)

``floor(log2 amax)`` is the exponent OCP MX puts in the shared scale; closing binades at the top makes the flush
edge of a power-of-two scale a binade edge (a tie at half the smallest subnormal rounds to 0), so the fate of a
value under an MX cast depends on ``d`` alone. ``d >= 0``; ``d = 0`` holds the values in ``(2**E, 2**(E+1))``
(``E = floor(log2 amax)``; an exact ``2**E`` has ``d = 1``). Counted per tensor (all int64 unless said)::

    d        (65,)  d = 0 ... 63, and d >= 64 in the last bin
    top      (64,)  the d = 0 values by mantissa m = |v| / 2**E: bin 2j holds m == 1 + j/32 exactly, bin 2j+1
                    holds 1 + j/32 < m < 1 + (j+1)/32: enough to split saturation from rounding exactly for
                    every element format with at most 4 mantissa bits (E4M3: m > 1.8125, E5M2: m >= 1.875,
                    E2M1: m >= 1.75)
    special  (4,)   zeros; inf/nan; finite non-zero values sharing a block with an inf/nan ("poisoned": an MX
                    scale is then NaN); non-zero values in blocks with amax < 2**TINY_EXPONENT (counted apart:
                    there the E8M0 scale would leave its range, and fp32 arithmetic on scales loses exactness)
    offset   (33,)  the d-counted values by floor(log2 tensor amax) - floor(log2 block amax): 0 ... 31, >= 32
                    (NVFP4's E4M3 block scale is exact only within 2**14 of the tensor's amax)

and alongside, in float64, the sum of ``v**2`` over the values of each bin (``sumsq``), from which the what-ifs
compute squared-norm shares. Example::

    >>> import torch
    >>> from ampviz.blocks import block_counts
    >>> c = block_counts(torch.tensor([[3.0, 1.0, 0.0, 0.25] * 8]), "mx32")
    >>> c.d[:5].tolist(), int(c.zero)       # amax 3: E = 1. 3 is in (2, 4]: d = 0; 1 in (1/2, 1]: d = 2; 1/4: d = 4
    ([8, 0, 8, 0, 8], 8)

On the CPU a numba kernel (:mod:`~ampviz.blocks._cpu_kernel`, the ``[fast]`` extra) counts in two reads of each
value; elsewhere, or with ``AMPVIZ_COUNTER=torch``, torch ops do (``index_add_``, no host sync). Inputs are
counted as fp32 (fp16, bf16 and fp8 are exact in fp32; fp64 is rounded to fp32 first, as torchao's
casts take bf16 or fp32). Complex tensors are counted by ``|z|``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import _cpu_kernel
from .layouts import BlockLayout, get_layout

__all__ = ["BlockCounts", "block_counts", "D_MAX", "TINY_EXPONENT", "N_D", "N_TOP", "N_OFFSET"]

D_MAX = 64                   # d >= D_MAX share the last d bin (every MX element format flushes from d = 33 on)
TINY_EXPONENT = -112         # blocks with amax < 2**-112 are counted apart (E8M0's 2**-127 minus E5M2's emax 15)
N_D, N_TOP, N_SPECIAL, N_OFFSET = D_MAX + 1, 64, 4, 33
_TOP, _SPECIAL = N_D, N_D + N_TOP
_ZERO, _NONFINITE, _POISONED, _TINY = (_SPECIAL + i for i in range(4))
_OFFSET = _SPECIAL + N_SPECIAL
N_COUNTS = _OFFSET + N_OFFSET


@dataclass
class BlockCounts:
    """Block statistics of one tensor (or several, added): int64 ``counts`` and float64 ``sumsq`` of
    ``N_COUNTS`` entries each, on the device the tensor was on. The named views below slice them."""

    counts: torch.Tensor
    sumsq: torch.Tensor
    layout: BlockLayout

    def __add__(self, other: BlockCounts) -> BlockCounts:
        if not isinstance(other, BlockCounts) or other.layout != self.layout:
            raise ValueError(f"other: can only add BlockCounts of the same layout ({self.layout.name}), got "
                             f"{getattr(getattr(other, 'layout', None), 'name', type(other).__name__)}")
        return BlockCounts(self.counts + other.counts.to(self.counts.device),
                           self.sumsq + other.sumsq.to(self.sumsq.device), self.layout)

    def cpu(self) -> BlockCounts:
        """A host copy (note: a device-to-host sync point)."""
        return BlockCounts(self.counts.cpu(), self.sumsq.cpu(), self.layout)

    d = property(lambda self: self.counts[:N_D], doc="(65,) values by d; the last bin is d >= 64")
    top = property(lambda self: self.counts[_TOP:_SPECIAL], doc="(64,) the d = 0 values by mantissa")
    zero = property(lambda self: self.counts[_ZERO], doc="exact zeros")
    nonfinite = property(lambda self: self.counts[_NONFINITE], doc="inf and nan")
    poisoned = property(lambda self: self.counts[_POISONED], doc="finite non-zero values in blocks with inf/nan")
    tiny = property(lambda self: self.counts[_TINY], doc="non-zero values in blocks with amax < 2**TINY_EXPONENT")
    offset = property(lambda self: self.counts[_OFFSET:], doc="(33,) d-counted values by block offset below "
                                                              "the tensor's amax binade")


def block_counts(x: torch.Tensor, layout, dim: int = -1, pad: bool = False) -> BlockCounts:
    """Count ``x``'s values by binade distance from their block's maximum (see the module docstring).

    Parameters
    ----------
    x : a floating-point (or complex) tensor of at least one dimension.
    layout : a :class:`BlockLayout` or its name ("mx32", "nv16", "row", "tile1x128", "tile128x128").
    dim : the blocked dimension (the reduction dimension of the GEMM the tensor feeds; default the last).
    pad : count a partial last block as zero-padded instead of raising (see :mod:`~ampviz.blocks.layouts`).

    Returns
    -------
    BlockCounts on ``x``'s device. Nothing is read back to the host.
    """
    layout = get_layout(layout)
    if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"x: expected a floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an integer, got {dim!r}")
    row_blocks, col_blocks = layout.blocks_of(x.shape, dim, pad)
    if x.numel() == 0:
        return BlockCounts(torch.zeros(N_COUNTS, dtype=torch.int64, device=x.device),
                           torch.zeros(N_COUNTS, dtype=torch.float64, device=x.device), layout)
    x = x.detach()
    x = (x.abs() if x.is_complex() else x).float().movedim(dim, -1)
    cols = x.shape[-1]
    bc = layout.block_cols or cols
    m = x.reshape(-1, cols)                                                  # (rows, K)
    padding = row_blocks * layout.block_rows * col_blocks * bc - m.numel()
    if padding:
        m = F.pad(m, (0, col_blocks * bc - cols, 0, row_blocks * layout.block_rows - m.shape[0]))
    blocks = (m.view(row_blocks, layout.block_rows, col_blocks, bc).permute(0, 2, 1, 3)
              .reshape(row_blocks * col_blocks, layout.block_rows * bc))     # (blocks, elements per block)
    if blocks.device.type == "cpu" and _cpu_kernel.available() and os.environ.get("AMPVIZ_COUNTER") != "torch":
        return _count_blocks_numba(blocks, padding, layout)
    return _count_blocks(blocks, padding, layout)


def _count_blocks_numba(blocks: torch.Tensor, padding: int, layout: BlockLayout) -> BlockCounts:
    """The numba kernel's counts, equal to :func:`_count_blocks`'s (sums of squares up to their order)."""
    counts = np.zeros(N_COUNTS, dtype=np.int64)
    sumsq = np.zeros(N_COUNTS, dtype=np.float64)
    consts = np.array([D_MAX, TINY_EXPONENT, _TOP, _ZERO, _NONFINITE, _POISONED, _TINY, _OFFSET, N_OFFSET])
    _cpu_kernel._count(blocks.contiguous().view(torch.int32).numpy(), counts, sumsq, consts)
    counts[0] = counts[_TOP:_SPECIAL].sum()
    sumsq[0] = sumsq[_TOP:_SPECIAL].sum()
    counts[_ZERO] -= padding
    return BlockCounts(torch.from_numpy(counts), torch.from_numpy(sumsq), layout)


def _count_blocks(blocks: torch.Tensor, padding: int, layout: BlockLayout) -> BlockCounts:
    bits = blocks.view(torch.int32) & 0x7FFFFFFF                             # |v| as fp32 bits, (blocks, n)
    finite = bits < 0x7F800000
    bits = torch.where(finite, bits, 0)
    poisoned_block = ~finite.all(dim=1)                                      # (blocks,)
    amax = bits.amax(dim=1).view(torch.float32)                              # largest finite |v|: bits are monotone
    a = bits.view(torch.float32)
    mantissa, exponent = torch.frexp(a)                                      # a = mantissa * 2**exponent, exact
    k = exponent - 1 - (mantissa == 0.5).to(exponent.dtype)                  # 2**k < a <= 2**(k+1)
    block_exp = torch.frexp(amax)[1] - 1                                     # floor(log2 amax), (blocks,)
    tiny_block = (block_exp < TINY_EXPONENT) & (amax > 0)
    ordinary_block = ~poisoned_block & ~tiny_block
    nonzero = bits > 0
    d = block_exp[:, None] - k
    # d = 0 values go straight to their mantissa bin (2j: m == 1 + j/32, 2j+1: inside); d[0] is their sum
    fraction = bits & 0x7FFFFF
    top_key = _TOP + 2 * (fraction >> 18) + ((fraction & 0x3FFFF) != 0).to(fraction.dtype)
    key = torch.where(d == 0, top_key, d.clamp(max=D_MAX))
    key = torch.where(nonzero & ordinary_block[:, None], key, _ZERO)
    special = torch.where(poisoned_block, _POISONED, _TINY)                    # (blocks,)
    key = torch.where(nonzero & ~ordinary_block[:, None], special[:, None], key)
    key = torch.where(finite, key, _NONFINITE)
    square = a.double().square()                                             # (blocks, n), 0 where not finite
    # per block: the block's offset below the tensor's amax binade, weighted by its counted values
    tensor_exp = torch.where(ordinary_block & (amax > 0), block_exp, -(1 << 30)).amax()
    offset_key = _OFFSET + (tensor_exp - block_exp).clamp(0, N_OFFSET - 1)
    offset_key = torch.where(ordinary_block & (amax > 0), offset_key, N_COUNTS)   # N_COUNTS: dropped
    counts = torch.zeros(N_COUNTS + 1, dtype=torch.int64, device=a.device)
    sumsq = torch.zeros(N_COUNTS + 1, dtype=torch.float64, device=a.device)
    # index_add_, not bincount: bincount reads its input's max back to the host on CUDA (a sync)
    key = key.reshape(-1).long()
    counts.index_add_(0, key, torch.ones_like(key))
    sumsq.index_add_(0, key, square.reshape(-1))
    offset_key = offset_key.long()
    counts.index_add_(0, offset_key, nonzero.sum(dim=1))
    sumsq.index_add_(0, offset_key, square.sum(dim=1))
    counts[0] = counts[_TOP:_SPECIAL].sum()
    sumsq[0] = sumsq[_TOP:_SPECIAL].sum()
    counts[_ZERO] -= padding                                                # the padding is not the tensor's
    return BlockCounts(counts[:N_COUNTS], sumsq[:N_COUNTS], layout)
