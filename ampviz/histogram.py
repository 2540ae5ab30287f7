"""Gradient-magnitude histograms by binade, and what casting them to a format at a loss scale does.

Bins (one row of ``NBINS`` = 257 counts per tensor)::

    column 0          exact zeros (+0 and -0)
    column 1          0 < |x| <= 2**-126          ("below": fp32/bf16 subnormals)
    column k + 128    2**k < |x| <= 2**(k+1)      for k = -126 ... 126 (one binade each)
    column 255        |x| > 2**127, including inf ("above")
    column 256        nan

Binades are closed at the top, so an exact power of two counts in the binade below it. That
convention makes flush-to-zero predictions exact: an fp16 cast sends |x| <= 2**-25 to zero
(2**-25 itself is a tie that rounds to even, i.e. to 0), which is exactly the binades up to 2**-25.

Keys are computed from the bits on the tensor's own device: ``((bits(|x|) - 1) >> 23) + 1`` is
the column above for every fp32 value (zero gives -1 + 1 = 0; nan patterns, which lie above inf,
give 256), fp16 and bf16 are exact in fp32, and all tensors of a step share one ``bincount``
into a preallocated counts buffer. No ``.item()``, no host copy per tensor::

    >>> import torch, ampviz.histogram as H
    >>> h = H.histogram(torch.tensor([0.0, 1e-8, 3.0, float("inf")]))
    >>> int(h[H.ZERO]), int(h[H.column(1)]), int(h[H.ABOVE])     # 3.0 is in (2, 4]
    (1, 1, 1)
    >>> int(H.fate(h.numpy(), "fp16", scale=1.0).flushed)               # 1e-8 -> 0 in fp16
    1
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ._counting import NBINS, make_counter
from .formats import Format, get_format

__all__ = [
    "NBINS", "ZERO", "BELOW", "ABOVE", "NAN", "K_MIN", "K_MAX", "column", "binade_exponents",
    "lower_edges", "upper_edges", "histogram", "histograms", "Fate", "fate", "fate_table", "fate_rows", "cast_counts",
    "max_magnitude", "shift", "bin_labels", "as_counts",
]

ZERO, BELOW, ABOVE, NAN = 0, 1, 255, 256
K_MIN, K_MAX = -126, 126          # binade exponents with a column of their own
_K_OFFSET = 128                   # column = k + 128


def column(k: int) -> int:
    """Column of the binade (2**k, 2**(k+1)]."""
    if not K_MIN <= k <= K_MAX:
        raise ValueError(f"k: binade exponent must be in [{K_MIN}, {K_MAX}], got {k}")
    return k + _K_OFFSET


def binade_exponents() -> np.ndarray:
    """k for the binade columns 2..254, in column order."""
    return np.arange(K_MIN, K_MAX + 1)


def lower_edges() -> np.ndarray:
    """Lower edge (exclusive) of each column's magnitude range; nan for the nan column."""
    lo = np.empty(NBINS)
    lo[ZERO], lo[BELOW], lo[ABOVE], lo[NAN] = 0.0, 0.0, 2.0 ** 127, np.nan
    lo[2:ABOVE] = np.ldexp(1.0, binade_exponents())
    return lo


def upper_edges() -> np.ndarray:
    """Upper edge (inclusive) of each column's magnitude range; inf for "above", nan for nan."""
    hi = np.empty(NBINS)
    hi[ZERO], hi[BELOW], hi[ABOVE], hi[NAN] = 0.0, 2.0 ** -126, np.inf, np.nan
    hi[2:ABOVE] = np.ldexp(1.0, binade_exponents() + 1)
    return hi


def bin_labels() -> list[str]:
    """Short human labels, one per column ("0", "<=2^-126", "(2^-24,2^-23]", ">2^127", "nan")."""
    labels = ["0", "<=2^-126"] + [f"(2^{k},2^{k + 1}]" for k in binade_exponents()]
    return labels + [">2^127", "nan"]


def histograms(tensors, device=None) -> torch.Tensor:
    """Histogram each tensor; returns an int64 tensor (len(tensors), NBINS) on their device.

    Complex tensors are counted by ``|z|``, as the Recorder counts complex gradients; fp64 values beyond
    fp32's range land in the "below" / "above" columns (exactly: fp64 is binned from its own bits)."""
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            raise TypeError(f"tensors[{i}]: expected a floating-point or complex tensor, got "
                            f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
    device = torch.device(device) if device is not None else (tensors[0].device if tensors else "cpu")
    counts = torch.zeros(len(tensors), NBINS, dtype=torch.int64, device=device)
    total = sum(t.numel() for t in tensors)
    binner = make_counter(device, capacity=min(max(total, 1), 1 << 24))
    binner.target = counts.view(-1)
    for i, t in enumerate(tensors):
        binner.add(t.to(device), i)
    binner.submit()
    return counts


def histogram(x: torch.Tensor) -> torch.Tensor:
    """Histogram of ``|x|`` by binade: an int64 tensor of NBINS counts on ``x``'s device."""
    return histograms([x])[0]


# ---------------------------------------------------------------------------- casting predictions
@dataclass
class Fate:
    """What a cast to ``format`` at loss scale ``scale`` does to the counted values.

    Each field has the shape of the counts minus their last axis. ``zero`` and ``nan`` were
    already zero / nan before the cast; ``flushed`` are non-zero values that become 0;
    ``overflow`` become inf (or saturate to max, for e4m3fn).
    """

    zero: np.ndarray
    flushed: np.ndarray
    subnormal: np.ndarray
    normal: np.ndarray
    overflow: np.ndarray
    nan: np.ndarray

    @property
    def nonzero(self):
        """Values that were non-zero and not nan before the cast."""
        return self.flushed + self.subnormal + self.normal + self.overflow

    def fraction(self, field: str):
        """``field`` as a fraction of the non-zero values (0 where there are none)."""
        num = np.asarray(getattr(self, field), dtype=float)
        den = np.asarray(self.nonzero, dtype=float)
        return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def _scale_log2(scale=None, log2_scale=None) -> int:
    if log2_scale is None:
        if scale is None:
            scale = 1.0
        if not isinstance(scale, (int, float, np.floating, np.integer)) or not scale > 0 or math.isinf(scale):
            raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
        m, e = math.frexp(float(scale))
        if m != 0.5:
            raise ValueError(f"scale: binade histograms predict casts exactly only for powers of two; "
                             f"got {scale!r} (nearest: 2**{round(math.log2(scale))})")
        return e - 1
    if int(log2_scale) != log2_scale:
        raise ValueError(f"log2_scale: expected an integer, got {log2_scale!r}")
    return int(log2_scale)


def _category_of_binades(fmt: Format, s: int) -> np.ndarray:
    """For each column 0..NBINS-1: 0 zero, 1 flushed, 2 subnormal, 3 normal, 4 overflow, 5 nan."""
    k = np.arange(NBINS) - _K_OFFSET + s          # binade exponent after scaling, per column
    cat = np.select([k <= fmt.log2_min_subnormal - 2, k <= fmt.emin - 1, k <= fmt.emax],
                    [1, 2, 3], default=4)
    # "below" holds (0, 2**-126]: judged by its upper edge (exact unless s > ~100)
    below_top = -126 + s
    cat[BELOW] = 1 if below_top <= fmt.log2_min_subnormal - 1 else (2 if below_top <= fmt.emin else 3)
    cat[ZERO], cat[ABOVE], cat[NAN] = 0, 4, 5
    return cat


def fate(counts, format, scale=None, *, log2_scale=None) -> Fate:
    """Predict the fate of histogrammed values when multiplied by ``scale`` and cast to ``format``.

    Parameters
    ----------
    counts : array (..., NBINS) of bin counts (numpy or torch).
    format : a :class:`~ampviz.formats.Format`, its name, or a torch dtype.
    scale : a power of two (the loss scale); or give ``log2_scale`` as an integer.

    Returns
    -------
    Fate with arrays of counts of shape ``counts.shape[:-1]``.

    Exactness: for a power-of-two scale, ``zero``, ``flushed``, ``nan`` and the boundary between
    flushed and subnormal are exact (ties at min_subnormal/2 included). Two edge sets are
    approximate, because a binade is not split: (1) |x*S| in [min_normal - min_subnormal/2,
    min_normal] is counted subnormal but rounds up to min_normal (fp16: [2**-14 - 2**-25, 2**-14]);
    (2) |x*S| in [overflow_threshold, 2**(emax+1)] is counted normal but overflows (fp16:
    [65520, 65536]; e4m3fn: (464, 512], which saturates to 448). Values below 2**-126 are judged
    by 2**-126, values above 2**127 always count as overflow.
    """
    fmt = get_format(format)
    s = _scale_log2(scale, log2_scale)
    c = as_counts(counts)
    cat = _category_of_binades(fmt, s)
    parts = [c[..., cat == i].sum(axis=-1) for i in range(6)]
    return Fate(*parts)


def cast_counts(tensors, format, scale: float = 1.0) -> dict:
    """What a real cast ``(x * scale).to(format.dtype)`` does to the values of ``tensors``, counted.

    The oracle for :func:`fate`. ``tensors`` is a tensor or a list of them; the product is formed in
    float64 and rounded to float32 first, as an fp32 ``x * scale`` is. Returns counts ``zero``
    (already 0), ``nan`` (already nan), ``flushed`` (non-zero, became 0), ``overflow`` (became inf,
    or, for a saturating format such as e4m3fn, was clamped to ``max`` from beyond the rounding
    edge), ``subnormal`` and ``normal`` (the rest, by the magnitude after the cast), and
    ``relative_error``: the mean of ``|x' - x| / |x|`` over the normal values, ``x'`` being the cast
    value divided by the scale again (the format's precision).
    """
    fmt = get_format(format)
    if fmt.dtype is None:
        raise ValueError(f"format: {fmt.name} has no torch dtype to cast to")
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
        raise TypeError("tensors: expected a floating-point tensor or a non-empty list of them")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    v = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    nan = torch.isnan(v)
    scaled = (v * scale).float()
    cast = scaled.to(fmt.dtype).double()
    nonzero = (v != 0) & ~nan
    flushed = nonzero & (cast == 0)
    if fmt.saturates:      # e4m3fn: no inf, torch clamps to max; beyond the rounding edge is an overflow
        a, edge = scaled.double().abs(), fmt.overflow_threshold
        over = nonzero & ((a > edge) | ((a == edge) & (not fmt.overflow_tie_rounds_down)))
    else:
        over = nonzero & torch.isinf(cast)
    kept = nonzero & ~flushed & ~over
    normal = kept & (cast.abs() >= fmt.min_normal)
    err = ((cast / scale - v).abs() / v.abs())[normal]
    return {"zero": int(((v == 0)).sum()), "nan": int(nan.sum()), "flushed": int(flushed.sum()),
            "subnormal": int((kept & ~normal).sum()), "normal": int(normal.sum()), "overflow": int(over.sum()),
            "relative_error": float(err.mean()) if err.numel() else 0.0}


def fate_table(counts, format, log2_scales) -> dict[str, np.ndarray]:
    """:func:`fate` for many integer log2 scales at once: arrays of shape (len(log2_scales), ...)."""
    fmt = get_format(format)
    c = as_counts(counts)
    rows = c.reshape(-1, NBINS)
    out: dict[str, list] = {f: [] for f in ("zero", "flushed", "subnormal", "normal", "overflow", "nan")}
    for s in [_scale_log2(log2_scale=s) for s in log2_scales]:
        fields = fate_rows(rows, fmt, s)
        for name in out:
            out[name].append(fields[name].reshape(c.shape[:-1]))
    return {name: np.stack(v) for name, v in out.items()}


_ROWS_AT_ONCE = 1 << 16            # fate_rows: cumulative sums of this many rows at a time, ~130 MB of temporaries


def fate_rows(counts: np.ndarray, format, log2_scales) -> dict:
    """{field: (n,) int64} of :class:`Fate` for (n, NBINS) ``counts``, row i judged at ``log2_scales[i]``
    (integers), in one pass: a format's regions are contiguous ranges of binades, so a row's counts per region
    are differences of its cumulative sum at columns that move with the row's scale. Equal to
    ``fate(row, format, log2_scale=s)`` for every row (tests/test_run.py checks it); :func:`fate_table` and
    ``Run.fate_in`` use it."""
    fmt = get_format(format)
    c = np.asarray(counts)
    s = np.broadcast_to(np.asarray(log2_scales, dtype=np.int64), c.shape[:1])
    out = {f: np.empty(c.shape[0], dtype=np.int64) for f in Fate.__dataclass_fields__}
    exponents = binade_exponents()                                      # (253,) ascending
    for start in range(0, c.shape[0], _ROWS_AT_ONCE):
        part, shift = c[start:start + _ROWS_AT_ONCE], s[start:start + _ROWS_AT_ONCE]
        cum = np.cumsum(part[:, 2:ABOVE], axis=1)                      # (rows, 253) binades only
        flushed = _upto(cum, exponents, fmt.log2_min_subnormal - 2, shift)
        subnormal = _upto(cum, exponents, fmt.emin - 1, shift)
        normal = _upto(cum, exponents, fmt.emax, shift)
        total = cum[:, -1]
        fields = {"zero": part[:, ZERO], "flushed": flushed, "subnormal": subnormal - flushed,
                  "normal": normal - subnormal, "overflow": total - normal + part[:, ABOVE], "nan": part[:, NAN]}
        # "below" holds (0, 2**-126]: judged by its upper edge after the shift, as histogram.fate does
        below_top = -126 + shift
        below = part[:, BELOW]
        fields["flushed"] = fields["flushed"] + np.where(below_top <= fmt.log2_min_subnormal - 1, below, 0)
        fields["subnormal"] = fields["subnormal"] + np.where(
            (below_top > fmt.log2_min_subnormal - 1) & (below_top <= fmt.emin), below, 0)
        fields["normal"] = fields["normal"] + np.where(below_top > fmt.emin, below, 0)
        for f, v in fields.items():
            out[f][start:start + part.shape[0]] = v
    return out


def _upto(cum: np.ndarray, exponents: np.ndarray, top: int, shift: np.ndarray) -> np.ndarray:
    """(rows,) values in the binades whose exponent after each row's shift is <= ``top``."""
    n = np.searchsorted(exponents, top - shift, side="right")
    return np.where(n > 0, cum[np.arange(cum.shape[0]), np.maximum(n - 1, 0)], 0)


def max_magnitude(counts) -> np.ndarray:
    """Upper bound of the largest |x| counted: the top edge of the highest non-empty column.

    inf when anything is above 2**127, inf or nan; 0 when everything is zero.
    """
    c = as_counts(counts)
    nonempty = c > 0
    nonfinite = nonempty[..., ABOVE] | nonempty[..., NAN]
    idx = np.where(nonempty[..., :ABOVE], np.arange(ABOVE), -1).max(axis=-1)
    top = np.where(idx >= 0, upper_edges()[np.maximum(idx, 0)], 0.0)
    return np.where(nonfinite, np.inf, top)


def shift(counts, log2_scale) -> np.ndarray:
    """Counts of the values multiplied by ``2**log2_scale`` (binade columns move; specials stay).

    Values pushed below 2**-126 join "below", above 2**127 join "above". ``log2_scale`` may be an
    array broadcastable against ``counts.shape[:-1]`` (one shift per row, e.g. per step).
    """
    c = as_counts(counts)
    s = np.broadcast_to(np.asarray(log2_scale), c.shape[:-1]).reshape(-1)
    if not np.all(np.mod(s, 1) == 0):
        raise ValueError("log2_scale: expected integers (only power-of-two scales shift exactly)")
    rows = c.reshape(-1, NBINS)
    out = np.empty_like(rows)
    for v in np.unique(s):
        mask = s == v
        out[mask] = _shift_rows(rows[mask], int(v))
    return out.reshape(c.shape)


def _shift_rows(c: np.ndarray, s: int) -> np.ndarray:
    out = np.zeros_like(c)
    special = [ZERO, BELOW, ABOVE, NAN]
    out[:, special] = c[:, special]
    src = c[:, 2:ABOVE]                     # the 253 binade columns
    n = src.shape[1]
    keep = max(n - abs(s), 0)
    if s >= 0:
        out[:, 2 + s:2 + s + keep] += src[:, :keep]
        out[:, ABOVE] += src[:, keep:].sum(axis=1)
    else:
        out[:, 2:2 + keep] += src[:, n - keep:]
        out[:, BELOW] += src[:, :n - keep].sum(axis=1)
    return out


def as_counts(counts, name: str = "counts", axes: tuple | None = None) -> np.ndarray:
    """``counts`` as a numpy array checked to be histogram counts: last axis of NBINS bins, numbers
    that are finite (integers, or floats such as averaged counts), and exactly the leading ``axes``
    if given (their names, e.g. ``("steps",)``, for the error message).

    A torch tensor is copied to the host (one device->host copy per call).
    """
    if isinstance(counts, torch.Tensor):
        counts = counts.detach().cpu().numpy()   # note: a device->host copy (one per call)
    c = np.asarray(counts)
    if axes is not None and (c.ndim != len(axes) + 1 or c.shape[-1] != NBINS):
        raise ValueError(f"{name}: expected shape ({', '.join(axes)}, {NBINS}), got {c.shape}")
    if c.ndim == 0 or c.shape[-1] != NBINS:
        raise ValueError(f"{name}: expected an array whose last axis has {NBINS} bins (see ampviz.histogram), "
                         f"got shape {c.shape}")
    if c.dtype.kind not in "iuf" or (c.dtype.kind == "f" and not np.all(np.isfinite(c))):
        raise ValueError(f"{name}: expected finite numeric counts, got dtype {c.dtype}")
    return c
