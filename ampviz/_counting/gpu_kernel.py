"""Counting on a GPU with a privatised histogram: a Triton kernel that reads each value once.

The torch path (:class:`~ampviz._counting.ops.Binner`) builds a key per value and counts them with an ``index_add_``
into global memory: one int64 atomic per value, and a gradient's values crowd into about ten binades, so
millions of atomics queue on the same few addresses. Here each program walks its share of the tensor
(a grid-stride loop), keeps its own counts (``tl.histogram`` per block, summed in registers), and merges
them into the row once: ``NBINS`` atomics per program instead of one per value. The column of a value is
the formula of :mod:`~ampviz._counting.ops` (exact for fp32, bf16, fp16 and fp8; fp64 and other dtypes go to the
torch path)::

    counter = TritonCounter("cuda")
    counter.target = counts.view(-1)        # int64, rows * NBINS, on the device
    counter.add(grad, row)                  # one kernel launch, asynchronous, no host sync

With ``TRITON_INTERPRET=1`` set before this module is imported, the same kernel runs in Triton's
interpreter on CPU tensors (how the tests check it equals the CPU bins on a machine without a GPU).
When Triton cannot be imported, :func:`available` is False and ampviz counts with the torch path.
"""

from __future__ import annotations

import os
import warnings

import torch

from .._warnings import AmpvizWarning
from .ops import NBINS, Binner, dense_flat, prepare

try:
    import triton
    import triton.language as tl
except ImportError:                                   # pragma: no cover - depends on the platform
    triton = tl = None

__all__ = ["available", "interpreted", "TritonCounter"]

_BLOCK = 4096                 # values per block of one program's loop (16 KiB of fp32)
_BINS = 512                   # tl.histogram's bins: a power of two above NBINS; the last one takes masked lanes
_JUNK = _BINS - 1
_PROGRAMS_PER_SM = 4          # enough programs in flight to hide memory latency; each merges NBINS counts once
# how the kernel reads each dtype: 0 fp32 bits, 1 bf16 bits, 2 converted to fp32 (exact), 3 one byte through a table
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 3}


def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """Whether Triton runs its interpreter (on CPU tensors) instead of compiling for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:
    @triton.jit
    def _histogram_kernel(x_ptr, n, out_ptr, lut_ptr, BLOCK: tl.constexpr, BINS: tl.constexpr, NCOLS: tl.constexpr,
                          KIND: tl.constexpr):
        """Count the ``n`` values at ``x_ptr`` into ``out_ptr[0:NCOLS]`` (int64): per program in registers,
        merged with one atomic per column."""
        pid = tl.program_id(0)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        acc = tl.zeros([BINS], dtype=tl.int32)
        lanes = tl.arange(0, BLOCK)
        for start in range(pid.to(tl.int64) * BLOCK, n, step):
            offs = start + lanes
            inside = offs < n
            if KIND == 3:        # fp8: the column of each of its 128 magnitudes, from a table
                byte = tl.load(x_ptr + offs, mask=inside, other=0).to(tl.int32)
                key = tl.load(lut_ptr + (byte & 0x7F))
            elif KIND == 1:      # bf16 is fp32's top half: ((m16 - 1) >> 7) + 1 on the magnitude bits
                bits = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
                key = (((bits & 0x7FFF) - 1) >> 7) + 1
            else:
                if KIND == 0:
                    value = tl.load(x_ptr + offs, mask=inside, other=0.0)
                else:            # fp16 / fp8 -> fp32 is exact
                    value = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
                bits = value.to(tl.int32, bitcast=True)
                key = (((bits & 0x7FFFFFFF) - 1) >> 23) + 1   # arithmetic shift: zero -> (-1 >> 23) + 1 = 0
            key = tl.where(inside, key, BINS - 1)             # masked lanes land in the junk bin, never counted
            acc += tl.histogram(key, BINS)
        cols = tl.arange(0, BINS)
        tl.atomic_add(out_ptr + cols, acc.to(tl.int64), mask=(cols < NCOLS) & (acc > 0))


def _fp8_columns(dtype) -> torch.Tensor:
    """Column of each of an fp8 format's 128 magnitude bit patterns (int32): exact, fp8 -> fp32 is exact."""
    values = torch.arange(128, dtype=torch.uint8).view(dtype).float()
    return ((values.view(torch.int32) - 1) >> 23) + 1


class TritonCounter:
    """Drop-in for ``Binner`` on a GPU: ``add`` launches one kernel per tensor into ``target`` (no buffer,
    no host sync). Tensors the kernel does not take (fp64, integer) are counted by the torch path."""

    def __init__(self, device, programs: int | None = None):
        if triton is None:
            raise RuntimeError("TritonCounter needs triton")
        self.device = torch.device(device)
        if programs is None:
            sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                   if self.device.type == "cuda" else 8)
            programs = _PROGRAMS_PER_SM * sms
        self.programs = max(1, int(programs))
        self._target: torch.Tensor | None = None
        self._fallback = Binner(self.device, capacity=1 << 16)
        # the fp8 tables (and a placeholder for the other kinds), made here so no hook copies to the device
        self._luts = {dtype: _fp8_columns(dtype).to(self.device) for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}
        self._no_lut = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._launched: set = set()         # kinds whose kernel ran once: a later failure is a real error
        self._broken = False

    @property
    def target(self) -> torch.Tensor | None:
        return self._target

    @target.setter
    def target(self, counts: torch.Tensor | None) -> None:
        self._target = counts
        self._fallback.submit()                       # what was buffered for the old target goes there
        self._fallback.target = counts

    def add(self, x: torch.Tensor, row: int) -> None:
        """Count every element of ``x`` (complex: ``|x|``) into row ``row`` of ``target``."""
        if self._target is None:
            raise RuntimeError("TritonCounter: no target counts tensor set")
        flat = dense_flat(prepare(x))
        kind = None if self._broken else _KINDS.get(flat.dtype)
        if kind is None:
            self._fallback.add(flat, row)
            return
        n = flat.numel()
        if n == 0:
            return
        grid = (min(self.programs, triton.cdiv(n, _BLOCK)),)
        out = self._target[row * NBINS:(row + 1) * NBINS]
        lut = self._luts.get(flat.dtype, self._no_lut)
        try:
            _histogram_kernel[grid](flat.view(torch.uint8) if kind == 3 else flat, n, out, lut,
                                    BLOCK=_BLOCK, BINS=_BINS, NCOLS=NBINS, KIND=kind)
        except Exception as e:            # cannot compile or launch here (no ptxas, an unsupported GPU): torch path
            if kind in self._launched:
                raise                     # it ran before: a real error, not a missing toolchain
            self._broken = True
            warnings.warn(f"ampviz: the Triton counting kernel cannot run on {self.device} "
                          f"({type(e).__name__}: {str(e)[:200]}); counting with torch ops instead (slower, the same "
                          f"counts). AMPVIZ_COUNTER=torch chooses that path from the start", AmpvizWarning,
                          stacklevel=2)
            self._fallback.add(flat, row)
            return
        self._launched.add(kind)

    def add_many(self, tensors: list, rows: list) -> None:
        for x, r in zip(tensors, rows):
            self.add(x, r)

    def add_group(self, tensors: list, rows: list, offsets=None) -> None:
        self.add_many(tensors, rows)

    def submit(self) -> None:
        """Counts land as each kernel runs; only the torch path's buffer is counted here."""
        self._fallback.submit()

    def wait(self) -> None:
        """Nothing to wait for on the host: the kernels run in stream order (``Recorder.wait`` synchronises)."""

    def close(self) -> None:
        self._fallback.close()
