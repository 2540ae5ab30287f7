"""Floating-point number formats used in mixed precision, with their limits taken from torch.

Every limit comes from ``torch.finfo`` (or, for TF32, which has no torch dtype, from its
8 exponent and 10 mantissa bits), so nothing here is typed in by hand::

    >>> from ampviz.formats import FP16
    >>> FP16.max, FP16.min_normal, FP16.min_subnormal
    (65504.0, 6.103515625e-05, 5.960464477539063e-08)
    >>> FP16.round(70000.0), FP16.round(1e-8), FP16.classify(1e-6)
    (inf, 0.0, 'subnormal')
    >>> FP16.decompose(1.0).bits
    '0 01111 0000000000'

Rounding is round-to-nearest-even, exactly as ``Tensor.to(dtype)`` does it, including the
edge cases: in FP16, 2**-25 rounds to 0 and 65520 rounds to inf. PyTorch saturates casts to
float8 e4m3fn (it has no inf), so ``FP8_E4M3FN.round(1000.0) == 448.0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "Format", "Bits", "FP32", "TF32", "FP16", "BF16", "FP8_E4M3FN", "FP8_E5M2",
    "FORMATS", "get_format",
]

CLASSES = ("zero", "subnormal", "normal", "inf", "nan")


class Bits(NamedTuple):
    """The fields of one number in a format (after rounding to it)."""

    value: float          # the representable value the input rounds to
    sign: int             # 0 or 1
    exponent: int         # biased exponent field
    mantissa: int         # mantissa (fraction) field, without the implicit leading 1
    kind: str             # one of "zero", "subnormal", "normal", "inf", "nan"
    bits: str             # "s eeeee mmmmmmmmmm", fields separated by spaces


@dataclass(frozen=True)
class Format:
    """A binary floating-point format: its widths and limits.

    Parameters
    ----------
    name : short name used throughout ampviz ("fp16", "bf16", ...).
    dtype : the torch dtype, or None for TF32 (a compute mode, not a storage type).
    exponent_bits, mantissa_bits : field widths; ``bits = 1 + exponent_bits + mantissa_bits``.
    max, min_normal, min_subnormal, eps : limits (``min_subnormal = min_normal * eps``).
    has_inf : False for float8 e4m3fn, whose all-ones exponent still encodes finite values.
    saturates : True when torch casts clamp overflow to ``max`` instead of producing inf/nan.
    """

    name: str
    dtype: torch.dtype | None
    exponent_bits: int
    mantissa_bits: int
    max: float
    min_normal: float
    min_subnormal: float
    eps: float
    has_inf: bool = True
    saturates: bool = False

    # ---------------------------------------------------------------- derived facts
    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return (1 << (self.exponent_bits - 1)) - 1

    @property
    def emin(self) -> int:
        """log2 of the smallest normal number."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest binade: max lies in [2**emax, 2**(emax+1))."""
        return math.frexp(self.max)[1] - 1

    @property
    def log2_min_subnormal(self) -> int:
        return self.emin - self.mantissa_bits

    @property
    def overflow_threshold(self) -> float:
        """Smallest magnitude that does not round to a finite value <= max.

        Halfway between max and the next binade step rounds to even; max has an odd mantissa
        in the IEEE-like formats (so the tie overflows) and an even one in e4m3fn (so it does not).
        """
        half_ulp = math.ldexp(1.0, self.emax - self.mantissa_bits - 1)
        return self.max + half_ulp

    @property
    def overflow_tie_rounds_down(self) -> bool:
        """True when |x| == overflow_threshold still rounds to max (mantissa of max is even)."""
        return self._fields(self.max)[2] % 2 == 0

    def describe(self) -> str:
        return (f"{self.name}: {self.bits} bits (1 sign, {self.exponent_bits} exponent, "
                f"{self.mantissa_bits} mantissa); max {self.max:.6g}, min normal 2^{self.emin}, "
                f"min subnormal 2^{self.log2_min_subnormal}, eps 2^{-self.mantissa_bits}")

    # ---------------------------------------------------------------- scalars
    def round(self, x):
        """Round ``x`` (a Python number or a tensor) to this format, nearest-even.

        Tensors are cast with torch (``x.float().to(dtype)``; TF32 by bit arithmetic) and come
        back as float32; Python numbers are rounded exactly in Python and come back as float.
        """
        if isinstance(x, torch.Tensor):
            return self._round_tensor(x)
        x = _as_float(x, "x")
        if math.isnan(x):
            return math.nan
        if math.isinf(x):
            return x if self.has_inf else (math.copysign(self.max, x) if self.saturates else math.nan)
        a = abs(x)
        if a == 0.0:
            return x
        quantum = max(math.frexp(a)[1] - 1, self.emin) - self.mantissa_bits
        y = math.ldexp(round(math.ldexp(a, -quantum)), quantum)  # round() is half-to-even
        if y > self.max:
            if self.has_inf:
                y = math.inf
            else:
                y = self.max if self.saturates else math.nan
        return math.copysign(y, x)

    def classify(self, x) -> str:
        """"zero", "subnormal", "normal", "inf" or "nan" for ``x`` after rounding to this format."""
        return self.decompose(x).kind

    def decompose(self, x) -> Bits:
        """Round ``x`` to this format and return its sign, exponent and mantissa fields."""
        v = self.round(_as_float(x, "x"))
        sign, exponent, mantissa, kind = self._fields(v)
        m = self.mantissa_bits
        bit_string = f"{sign} {exponent:0{self.exponent_bits}b} {mantissa:0{m}b}"
        return Bits(v, sign, exponent, mantissa, kind, bit_string)

    def compose(self, sign: int, exponent: int, mantissa: int) -> float:
        """The value with these raw fields (the inverse of :meth:`decompose`)."""
        _check_field("sign", sign, 1)
        _check_field("exponent", exponent, (1 << self.exponent_bits) - 1)
        _check_field("mantissa", mantissa, (1 << self.mantissa_bits) - 1)
        all_ones = (1 << self.exponent_bits) - 1
        top_mantissa = (1 << self.mantissa_bits) - 1
        if exponent == all_ones and self.has_inf:
            v = math.inf if mantissa == 0 else math.nan
        elif exponent == all_ones and mantissa == top_mantissa:   # e4m3fn's only NaN
            v = math.nan
        elif exponent == 0:
            v = math.ldexp(mantissa, self.emin - self.mantissa_bits)
        else:
            v = math.ldexp((1 << self.mantissa_bits) + mantissa, exponent - self.bias - self.mantissa_bits)
        return -v if sign else v

    def next_up(self, x) -> float:
        """The next representable value above ``x`` (after rounding ``x``)."""
        return self._step(x, +1)

    def next_down(self, x) -> float:
        """The next representable value below ``x`` (after rounding ``x``)."""
        return self._step(x, -1)

    def ulp(self, x) -> float:
        """Spacing between ``|x|`` (rounded) and the next representable magnitude above it."""
        a = abs(self.round(_as_float(x, "x")))
        if math.isinf(a) or math.isnan(a):
            return math.nan
        e = max(math.frexp(a)[1] - 1, self.emin) if a else self.emin
        return math.ldexp(1.0, e - self.mantissa_bits)

    # ---------------------------------------------------------------- internals
    def _fields(self, v: float):
        sign = 1 if math.copysign(1.0, v) < 0 else 0
        all_ones = (1 << self.exponent_bits) - 1
        if math.isnan(v):
            mantissa = (1 << self.mantissa_bits) - 1 if not self.has_inf else 1 << (self.mantissa_bits - 1)
            return 0, all_ones, mantissa, "nan"
        if math.isinf(v):
            return sign, all_ones, 0, "inf"
        a = abs(v)
        if a == 0.0:
            return sign, 0, 0, "zero"
        if a < self.min_normal:
            return sign, 0, int(math.ldexp(a, self.mantissa_bits - self.emin)), "subnormal"
        e = math.frexp(a)[1] - 1
        mantissa = int(math.ldexp(a, self.mantissa_bits - e)) - (1 << self.mantissa_bits)
        return sign, e + self.bias, mantissa, "normal"

    def _step(self, x, direction: int) -> float:
        v = self.round(_as_float(x, "x"))
        if math.isnan(v):
            return math.nan
        if math.isinf(v):                        # inf steps back to +-max, or stays
            return v if (v > 0) == (direction > 0) else math.copysign(self.max, v)
        if v == 0.0:
            return direction * self.min_subnormal
        a = abs(v)
        if (v > 0) == (direction > 0):           # away from zero
            if a == self.max:
                return math.copysign(math.inf, v) if self.has_inf else math.nan
            return math.copysign(a + self.ulp(a), v)
        e = math.frexp(a)[1] - 1                 # towards zero: the spacing just below a
        if a == math.ldexp(1.0, e) and e > self.emin:
            e -= 1
        return math.copysign(a - math.ldexp(1.0, max(e, self.emin) - self.mantissa_bits), v)

    def _round_tensor(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            raise TypeError(f"round: x must be a floating-point tensor, got dtype {x.dtype}")
        x = x.float()
        if self.dtype is not None:
            return x.to(self.dtype).float()
        return _round_tf32(x)


def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to TF32 (10 mantissa bits), nearest-even, by bit arithmetic."""
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0xFFF + lsb) >> 13) << 13
    finite = torch.isfinite(x)
    out = torch.where(finite, rounded, bits).to(torch.int32)   # inf/nan keep their bits
    out = out.view(torch.float32).clone()
    # a carry out of the largest binade must become inf, not a wrapped pattern
    out = torch.where(finite & (out.abs() > TF32.max), torch.copysign(torch.tensor(math.inf), x), out)
    return out


def _as_float(x, name: str) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name}: expected a single number, got a tensor of shape {tuple(x.shape)}")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        try:
            return float(x)  # numpy scalars, strings like "1e-8"
        except (TypeError, ValueError):
            raise TypeError(f"{name}: expected a number, got {x!r}") from None
    return float(x)


def _check_field(name: str, value: int, top: int) -> None:
    if not isinstance(value, int) or not 0 <= value <= top:
        raise ValueError(f"{name}: expected an integer in [0, {top}], got {value!r}")


def _from_finfo(name: str, dtype: torch.dtype, exponent_bits: int, **kw) -> Format:
    fi = torch.finfo(dtype)
    mantissa_bits = -int(math.log2(fi.eps))
    assert fi.bits == 1 + exponent_bits + mantissa_bits, (name, fi.bits)
    return Format(name, dtype, exponent_bits, mantissa_bits, float(fi.max), float(fi.tiny),
                  float(fi.tiny) * float(fi.eps), float(fi.eps), **kw)


def _tf32() -> Format:
    exponent_bits, mantissa_bits = 8, 10      # TF32: fp32's exponent, fp16's mantissa
    bias = (1 << (exponent_bits - 1)) - 1
    emax = (1 << exponent_bits) - 2 - bias
    eps = math.ldexp(1.0, -mantissa_bits)
    min_normal = math.ldexp(1.0, 1 - bias)
    return Format("tf32", None, exponent_bits, mantissa_bits, (2.0 - eps) * math.ldexp(1.0, emax),
                  min_normal, min_normal * eps, eps)


FP32 = _from_finfo("fp32", torch.float32, 8)
TF32 = _tf32()
FP16 = _from_finfo("fp16", torch.float16, 5)
BF16 = _from_finfo("bf16", torch.bfloat16, 8)
FP8_E4M3FN = _from_finfo("fp8_e4m3fn", torch.float8_e4m3fn, 4, has_inf=False, saturates=True)
FP8_E5M2 = _from_finfo("fp8_e5m2", torch.float8_e5m2, 5)

FORMATS: dict[str, Format] = {f.name: f for f in (FP32, TF32, FP16, BF16, FP8_E4M3FN, FP8_E5M2)}
_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
            "e4m3": "fp8_e4m3fn", "e4m3fn": "fp8_e4m3fn", "float8_e4m3fn": "fp8_e4m3fn",
            "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2", "tensorfloat32": "tf32"}


def get_format(spec) -> Format:
    """Look up a format by name ("fp16", "bf16", ...), torch dtype, or pass a Format through."""
    if isinstance(spec, Format):
        return spec
    if isinstance(spec, torch.dtype):
        for f in FORMATS.values():
            if f.dtype == spec:
                return f
        raise ValueError(f"format: torch dtype {spec} is not a floating-point format ampviz knows; "
                         f"valid: {', '.join(str(f.dtype) for f in FORMATS.values() if f.dtype)}")
    if isinstance(spec, str):
        key = spec.lower().replace("torch.", "").replace("-", "_")
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
    raise ValueError(f"format: unknown format {spec!r}; valid names: {', '.join(FORMATS)}")
