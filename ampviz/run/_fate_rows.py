"""The fate of many histograms at once, each row at its own log2 scale, in one pass over the counts.

``histogram.fate`` judges every row at one scale; a run's rows (rank, step, tensor) each need the
scale that moves them into the asked domain. Because the format's regions are contiguous ranges of
binades, a row's counts per region are differences of its cumulative sum at columns that move with
the row's scale::

    fate = fate_rows(counts.reshape(-1, NBINS), "fp16", log2_scales)    # (n,) per field

Equal to ``histogram.fate(row, format, log2_scale=s)`` for every row (tests/test_run.py checks it).
"""

from __future__ import annotations

import numpy as np

from .. import histogram as H
from ..formats import get_format

_ROWS_AT_ONCE = 1 << 16            # cumulative sums of this many rows at a time: ~130 MB of temporaries


def fate_rows(counts: np.ndarray, format, log2_scales) -> dict:
    """{field: (n,) int64} of ``histogram.Fate`` for (n, NBINS) ``counts``, row i judged at ``log2_scales[i]``."""
    fmt = get_format(format)
    c = np.asarray(counts)
    s = np.broadcast_to(np.asarray(log2_scales, dtype=np.int64), c.shape[:1])
    out = {f: np.empty(c.shape[0], dtype=np.int64) for f in H.Fate.__dataclass_fields__}
    exponents = H.binade_exponents()                                      # (253,) ascending
    for start in range(0, c.shape[0], _ROWS_AT_ONCE):
        part, shift = c[start:start + _ROWS_AT_ONCE], s[start:start + _ROWS_AT_ONCE]
        cum = np.cumsum(part[:, 2:H.ABOVE], axis=1)                      # (rows, 253) binades only
        flushed = _upto(cum, exponents, fmt.log2_min_subnormal - 2, shift)
        subnormal = _upto(cum, exponents, fmt.emin - 1, shift)
        normal = _upto(cum, exponents, fmt.emax, shift)
        total = cum[:, -1]
        fields = {"zero": part[:, H.ZERO], "flushed": flushed, "subnormal": subnormal - flushed,
                  "normal": normal - subnormal, "overflow": total - normal + part[:, H.ABOVE], "nan": part[:, H.NAN]}
        # "below" holds (0, 2**-126]: judged by its upper edge after the shift, as histogram.fate does
        below_top = -126 + shift
        below = part[:, H.BELOW]
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
