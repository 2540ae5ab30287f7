"""Per-tensor scaling for fp8: choose a scale from each tensor's amax, and see what it saves.

fp8 e4m3 spans about 18 binades (2**-9 .. 448), e5m2 about 32 (2**-16 .. 57344); a layer's
gradients spread over more than that, and different layers sit at different heights. fp8
training therefore multiplies each tensor by its own scale before the cast, chosen from its
largest magnitude (amax) so that amax lands just below the format's max. Here the scale is the
largest power of two with ``amax * scale <= max`` (Transformer Engine uses ``max / amax``, not
rounded; powers of two keep the histogram predictions of :func:`ampviz.histogram.fate` exact)::

    import ampviz.tensor_scaling as TS
    counts = run.counts[0]                                  # (steps, tensors, NBINS)
    table = TS.compare_scalings(counts, "fp8_e4m3fn")       # flushed / saturated shares per tensor
    table["per-tensor"]["flushed"]                          # (tensors,) with a scale per tensor

:func:`ampviz.histogram.cast_counts` is the oracle: a real ``(x * scale).to(float8)`` cast, counted.
"""

from __future__ import annotations

import math

import numpy as np

from . import histogram as H
from ._args import check_int
from .formats import get_format

__all__ = ["amax_log2_scales", "scaled_fate", "compare_scalings", "STRATEGIES"]

STRATEGIES = ("none", "shared", "per-tensor")


def amax_log2_scales(counts, format, margin: int = 0) -> np.ndarray:
    """For each histogram row, the largest integer ``s`` with ``amax * 2**s <= format.max / 2**margin``.

    ``amax`` is the row's upper bound from its highest non-empty binade (so the scale is safe even
    for the row's largest value). Rows with nothing but zeros get scale 0.
    """
    fmt = get_format(format)
    check_int("margin", margin, low=0)
    amax = H.max_magnitude(H.as_counts(counts))                   # a power of two (a binade's top edge)
    if np.any(~np.isfinite(amax)):
        raise ValueError("counts: rows holding inf/nan or values above 2**127 have no finite amax scale")
    top = math.floor(math.log2(fmt.max)) - margin             # 2**top <= max
    with np.errstate(divide="ignore"):
        s = np.where(amax > 0, top - np.log2(np.where(amax > 0, amax, 1.0)), 0.0)
    return s.astype(np.int64)


def scaled_fate(counts, format, log2_scales) -> H.Fate:
    """:func:`ampviz.histogram.fate` with one power-of-two scale per row (``log2_scales`` broadcast)."""
    c = H.as_counts(counts)
    return H.fate(H.shift(c, np.broadcast_to(np.asarray(log2_scales), c.shape[:-1])), format, 1.0)


def compare_scalings(counts, format, margin: int = 0) -> dict:
    """Shares of non-zero values flushed and saturated/overflowed under three scaling strategies.

    Parameters
    ----------
    counts : (steps, tensors, NBINS) histograms (e.g. ``run.counts[rank]``), or (tensors, NBINS).
    format : the fp8 (or any) format to cast to.
    margin : binades of headroom below ``format.max`` for the amax scales.

    Returns
    -------
    ``{"none" | "shared" | "per-tensor": {"flushed": (tensors,), "overflow": (tensors,),
    "log2_scale": (steps, tensors)}}`` where "none" casts as is, "shared" uses one scale per step
    from the largest amax over all tensors, "per-tensor" a scale per tensor and step. Shares pool
    all steps of a tensor.
    """
    c = H.as_counts(counts)
    if c.ndim == 2:
        c = c[None]
    if c.ndim != 3:
        raise ValueError(f"counts: expected shape (steps, tensors, {H.NBINS}) or (tensors, {H.NBINS}), got {c.shape}")
    per_tensor = amax_log2_scales(c, format, margin)                        # (steps, tensors)
    shared = amax_log2_scales(c.sum(axis=1), format, margin)[:, None]       # (steps, 1): the largest amax
    scales = {"none": np.zeros_like(per_tensor), "shared": np.broadcast_to(shared, per_tensor.shape),
              "per-tensor": per_tensor}
    out = {}
    for name, s in scales.items():
        f = scaled_fate(c, format, s)
        nonzero = f.nonzero.sum(axis=0).astype(float)                       # (tensors,)
        out[name] = {"flushed": _share(f.flushed, nonzero), "overflow": _share(f.overflow, nonzero),
                     "log2_scale": np.array(s)}
    return out


def _share(counts: np.ndarray, nonzero: np.ndarray) -> np.ndarray:
    """Pooled over steps (axis 0), as a share of the non-zero values; 0 where there are none."""
    return np.divide(counts.sum(axis=0), nonzero, out=np.zeros_like(nonzero), where=nonzero > 0)
