"""Block counts on the CPU in two reads of each value: a numba kernel that does what the torch path of
:mod:`~ampviz.blocks.counts` does (the tests hold the two equal), for the ``[fast]`` extra.

Serial and GIL-free, like :mod:`ampviz._counting.cpu_kernels`: numba's parallel runtime shares OpenMP with torch.
``AMPVIZ_COUNTER=torch`` or a missing numba selects the torch path.
"""

from __future__ import annotations

import numpy as np

try:
    from numba import njit
except ImportError:                                   # pragma: no cover - depends on the platform
    njit = None  # type: ignore[assignment]


def available() -> bool:
    return njit is not None


if njit is not None:
    @njit(cache=True, nogil=True, inline="always")
    def _bit_length(n):
        length = 0
        while n:
            n >>= 1
            length += 1
        return length

    @njit(cache=True, nogil=True, inline="always")
    def _floor_log2(bits):                            # of the positive finite fp32 with these bits
        if bits >= 0x800000:
            return (bits >> 23) - 127
        return _bit_length(bits) - 1 - 149

    @njit(cache=True, nogil=True, inline="always")
    def _closed_top(bits):                            # k with 2**k < v <= 2**(k+1)
        if bits >= 0x800000:
            return ((bits - 1) >> 23) - 127
        return _bit_length(bits - 1) - 1 - 149

    @njit(cache=True, nogil=True)
    def _count(blocks, counts, sumsq, consts):
        d_max, tiny_exp, top, zero, nonfinite, poisoned, tiny, offset, n_offset = consts
        n_blocks, n = blocks.shape
        block_exp = np.empty(n_blocks, np.int64)
        kind = np.zeros(n_blocks, np.int64)           # 0 ordinary (or all zero), 1 poisoned, 2 tiny
        tensor_exp = -(1 << 30)
        for b in range(n_blocks):
            amax = 0
            for i in range(n):
                bits = blocks[b, i] & 0x7FFFFFFF
                if bits >= 0x7F800000:
                    kind[b] = 1
                elif bits > amax:
                    amax = bits
            block_exp[b] = _floor_log2(amax) if amax > 0 else 0
            if kind[b] == 0 and amax > 0 and block_exp[b] < tiny_exp:
                kind[b] = 2
            if kind[b] == 0 and amax > 0 and block_exp[b] > tensor_exp:
                tensor_exp = block_exp[b]
        for b in range(n_blocks):
            e, nonzero, square_sum = block_exp[b], 0, 0.0
            for i in range(n):
                bits = blocks[b, i] & 0x7FFFFFFF
                if bits >= 0x7F800000:
                    counts[nonfinite] += 1
                    continue
                if bits == 0:
                    counts[zero] += 1
                    continue
                v = np.float64(np.int32(bits).view(np.float32))
                square = v * v
                if kind[b] != 0:
                    key = poisoned if kind[b] == 1 else tiny
                else:
                    d = e - _closed_top(bits)
                    if d == 0:
                        fraction = bits & 0x7FFFFF
                        key = top + 2 * (fraction >> 18) + (1 if fraction & 0x3FFFF else 0)
                    else:
                        key = min(d, d_max)
                    nonzero += 1
                    square_sum += square
                counts[key] += 1
                sumsq[key] += square
            if kind[b] == 0 and nonzero:
                key = offset + min(max(tensor_exp - e, 0), n_offset - 1)
                counts[key] += nonzero
                sumsq[key] += square_sum
