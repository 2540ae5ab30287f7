"""What a block-scaled cast does to counted values: shares flushed, saturated and kept, squared norm flushed, and
the relative RMS error, from :class:`~ampviz.blocks.counts.BlockCounts`.

Recipes (element format, scale rule, layouts)::

    mxfp8_e4m3, mxfp8_e5m2, mxfp4   OCP MX, blocks of 32 ("mx32"): X = 2**(floor(log2 amax) - emax_elem) in E8M0
                                    (E4M3 emax 8, E5M2 15, E2M1 2); element = saturating RNE cast of v / X
    nvfp4                           blocks of 16 ("nv16"), E2M1 elements; tensor scale T = amax_tensor / (448 * 6)
                                    in fp32, block scale s = e4m3(amax_block / (6 T)); element = RNE(v / (s T)),
                                    clamped to +-6
    rowwise_fp8, tile_fp8           E4M3 with an fp32 scale 448 / amax per row ("row") or per tile ("tile1x128",
                                    "tile128x128"); element = saturating cast of v * 448 / amax

Exact and bounded. For the MX recipes the scaled value ``|v / X|`` lies in ``(2**(emax-d), 2**(emax-d+1)]``, so
a value flushes iff ``d >= emax - log2(min_subnormal) + 2`` (E4M3: 19, E5M2: 33, E2M1: 5) and only ``d = 0``
values saturate, split exactly by the mantissa bins: the counts flushed and saturated are **exact** (values in
blocks below 2**-112 excepted: reported as ``unsure``), and so is the squared norm flushed (up to float64 sums).
The rounding error of kept values is not in binade counts: ``rms_error`` is an interval whose lower end counts
the flushed values' exact error and, for MX, the least error of the saturated ones (``1 - max / |q|`` at their
mantissa bin's lower edge), and whose upper end bounds every kept value's relative error (half an ulp,
2**-(m+1), in the normal range; ``min_subnormal / 2 / |q|`` below it; ``1 - max / |q|`` when saturated).

Where the scale is not a power of two, ``|v| / amax`` is known only to within ``(2**(-d-1), 2**(-d+1)]``, and the
scale itself is rounded (NVFP4's E4M3 block scale: relative error <= 2**-4, so amax maps into
[6 / (1 + 2**-4), 6 / (1 - 2**-4)]; fp32 scales: 2**-20 of slack); the counts become **bounds** (``lo <= real
<= hi``): NVFP4 flushes all of d >= 6 and none of d <= 3, row-wise / tiled fp8 all of d >= 20 and none of
d <= 17; neither saturates. NVFP4's bound needs the block scale in E4M3's normal range: it holds for blocks
whose amax binade is at most 13 below the tensor's (``offset <= 13``); the values of farther blocks (``unsure``)
widen the bounds by their count and squared norm. Poisoned values (in a block with inf/nan) become nan under MX
and are reported apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..formats import FP8_E4M3FN, FP8_E5M2, Format
from .counts import _NONFINITE, _OFFSET, _POISONED, _TINY, _TOP, _ZERO, D_MAX, N_D, N_OFFSET, N_TOP, BlockCounts

__all__ = ["E2M1", "Recipe", "RECIPES", "get_recipe", "WhatIf", "what_if"]

# E2M1 (fp4): 1 sign, 2 exponent, 1 mantissa bit; values 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf or nan
E2M1 = Format("fp4_e2m1", None, 2, 1, 6.0, 1.0, 0.5, 0.5, has_inf=False, saturates=True)
_SLACK = 2.0 ** -20              # relative slack for fp32 arithmetic on non-power-of-two scales


@dataclass(frozen=True)
class Recipe:
    """A block-scaled cast: element format, scale rule ("mx", "nvfp4" or "amax") and the layouts it uses."""

    name: str
    element: Format
    scale: str
    layouts: tuple[str, ...]


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("mxfp8_e4m3", FP8_E4M3FN, "mx", ("mx32",)),
    Recipe("mxfp8_e5m2", FP8_E5M2, "mx", ("mx32",)),
    Recipe("mxfp4", E2M1, "mx", ("mx32",)),
    Recipe("nvfp4", E2M1, "nvfp4", ("nv16",)),
    Recipe("rowwise_fp8", FP8_E4M3FN, "amax", ("row",)),
    Recipe("tile_fp8", FP8_E4M3FN, "amax", ("tile1x128", "tile128x128")),
)}


def get_recipe(spec) -> Recipe:
    """A recipe by name ("mxfp8_e4m3", "mxfp4", "nvfp4", ...; "-" for "_" is fine) or a Recipe passed through."""
    if isinstance(spec, Recipe):
        return spec
    key = spec.lower().replace("-", "_") if isinstance(spec, str) else None
    if key not in RECIPES:
        raise ValueError(f"recipe: unknown recipe {spec!r}; valid: {', '.join(RECIPES)}")
    return RECIPES[key]


@dataclass(frozen=True)
class WhatIf:
    """The fate of the counted values under a recipe. Counts are value counts; pairs are ``(lo, hi)`` bounds,
    equal where ``exact``. ``nonzero`` (the denominator of :meth:`share`) is the finite non-zero values outside
    poisoned blocks; ``norm_lost`` and ``rms_error`` are relative to those values' squared norm / norm."""

    recipe: str
    nonzero: int
    zero: int
    nonfinite: int
    poisoned: int
    unsure: int
    flushed: tuple[int, int]
    saturated: tuple[int, int]
    norm_lost: tuple[float, float]
    rms_error: tuple[float, float]

    @property
    def exact(self) -> bool:
        """True when the flushed and saturated counts (and so the squared norm flushed) are exact."""
        return self.flushed[0] == self.flushed[1] and self.saturated[0] == self.saturated[1]

    @property
    def kept(self) -> tuple[int, int]:
        return (self.nonzero - self.flushed[1] - self.saturated[1], self.nonzero - self.flushed[0] - self.saturated[0])

    def share(self, field: str) -> tuple[float, float]:
        """``(lo, hi)`` of "flushed", "saturated" or "kept" as a share of ``nonzero`` (0 when there are none)."""
        lo, hi = getattr(self, field)
        return (lo / self.nonzero, hi / self.nonzero) if self.nonzero else (0.0, 0.0)


def what_if(counts: BlockCounts, recipe) -> WhatIf:
    """The fate of the values counted in ``counts`` when cast with ``recipe`` (see the module docstring).

    Parameters
    ----------
    counts : :class:`BlockCounts` from :func:`~ampviz.blocks.block_counts` (any device: copied to the host
        here, a sync point), in a layout the recipe uses.
    recipe : a :class:`Recipe` or its name.
    """
    recipe = get_recipe(recipe)
    if not isinstance(counts, BlockCounts):
        raise TypeError(f"counts: expected BlockCounts from block_counts(), got {type(counts).__name__}")
    if counts.layout.name not in recipe.layouts:
        raise ValueError(f"counts: {recipe.name} casts blocks of layout {' or '.join(recipe.layouts)}; these counts "
                         f"are {counts.layout.name!r} (count with block_counts(x, {recipe.layouts[0]!r}))")
    c = counts.counts.cpu().numpy()            # note: a device-to-host sync point when counts live on a GPU
    s = counts.sumsq.cpu().numpy()
    fmt = recipe.element
    if recipe.scale == "mx":
        per_d = _mx_bins(fmt)
        unsure, unsure_sq = 0, 0.0
    else:
        a_lo, a_hi = (448 * (1 - _SLACK), 448 * (1 + _SLACK)) if recipe.scale == "amax" else \
                     (6 / (1 + 2.0 ** -4) * (1 - _SLACK), 6 / (1 - 2.0 ** -4) * (1 + _SLACK))
        per_d = _amax_bins(fmt, a_lo, a_hi)
        far = slice(_OFFSET + 14, _OFFSET + N_OFFSET) if recipe.scale == "nvfp4" else slice(0, 0)
        unsure, unsure_sq = int(c[far].sum()), float(s[far].sum())
    return _combine(recipe, c, s, per_d, unsure, unsure_sq)


def _mx_bins(fmt: Format) -> dict:
    """Per d bin: (surely flushed, maybe flushed, relative error bound); the d = 0 saturation is split by _top."""
    flush_from = fmt.emax - fmt.log2_min_subnormal + 2
    sure, bound = np.zeros(N_D, bool), np.zeros(N_D)
    for d in range(N_D):
        top = fmt.emax - d + 1                           # |q| in (2**(top-1), 2**top]
        sure[d] = d >= flush_from
        bound[d] = 1.0 if sure[d] else _kept_bound(fmt, 2.0 ** (top - 1))
    return {"flush_lo": sure, "flush_hi": sure, "bound": bound, "exact_top": True}


def _amax_bins(fmt: Format, a_lo: float, a_hi: float) -> dict:
    """As _mx_bins, for a scale that maps the block's amax into [a_lo, a_hi]: |v| / amax in (2**(-d-1), 2**(-d+1)]
    (at most 1; d >= D_MAX: (0, 2**(1-D_MAX)])."""
    edge = fmt.min_subnormal / 2                         # a tie at it rounds to 0 (min_subnormal's mantissa is odd)
    lo, hi, bound = np.zeros(N_D, bool), np.zeros(N_D, bool), np.zeros(N_D)
    for d in range(N_D):
        q_lo = 0.0 if d == D_MAX else 2.0 ** (-d - 1) * a_lo
        q_hi = min(2.0 ** (1 - d), 1.0) * a_hi
        assert q_hi < fmt.overflow_threshold, (fmt.name, d)   # these recipes never saturate (module docstring)
        lo[d], hi[d] = q_hi <= edge, q_lo < edge            # |q| > q_lo: at q_lo == edge it is kept
        bound[d] = 1.0 if hi[d] else min(1.0, _kept_bound(fmt, q_lo) + 2 * _SLACK)
    return {"flush_lo": lo, "flush_hi": hi, "bound": bound, "exact_top": False}


def _kept_bound(fmt: Format, q_low: float) -> float:
    """Bound on |RNE(q) - q| / |q| for a kept value with |q| > q_low (no saturation)."""
    half_ulp = 2.0 ** (-fmt.mantissa_bits - 1)
    return min(1.0, max(half_ulp, fmt.min_subnormal / 2 / q_low) if q_low < fmt.min_normal else half_ulp)


def _top_saturation(fmt: Format) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the 64 mantissa bins of d = 0 (m = |v| / 2**E; |q| = m * 2**emax): saturated (bool), the relative
    error bound of each bin's values, and the least relative error of a saturated bin's values (0 elsewhere:
    a kept value's rounding error is not in the counts)."""
    t = fmt.overflow_threshold / 2.0 ** fmt.emax          # saturated iff m > t, or m == t when the tie rounds up
    assert (t * 32) == int(t * 32), fmt.name             # a bin edge: the split is exact
    j = np.arange(N_TOP) // 2
    sat, bound, least = np.zeros(N_TOP, bool), np.zeros(N_TOP), np.zeros(N_TOP)
    for b in range(N_TOP):
        m = 1 + j[b] / 32
        sat[b] = (m > t or (m == t and not fmt.overflow_tie_rounds_down)) if b % 2 == 0 else m >= t
        top_m = m if b % 2 == 0 else m + 1 / 32
        bound[b] = 1 - fmt.max / (top_m * 2.0 ** fmt.emax) if sat[b] else 2.0 ** (-fmt.mantissa_bits - 1)
        if sat[b]:                                       # clamped to max: error 1 - max / |q|, least at the bin's
            least[b] = max(0.0, 1 - fmt.max / (m * 2.0 ** fmt.emax))   # lower edge (exact for even bins)
    return sat, bound, least


def _combine(recipe: Recipe, c: np.ndarray, s: np.ndarray, per_d: dict, far: int, far_sq: float) -> WhatIf:
    """``far``: values counted by d whose bins' verdicts may not hold for them (NVFP4's far blocks); the tiny
    blocks' values are not counted by d at all: either may go any way."""
    d_counts, d_sq = c[:N_D], s[:N_D]
    tiny, tiny_sq = int(c[_TINY]), float(s[_TINY])
    unsure, unsure_sq = far + tiny, far_sq + tiny_sq
    nonzero = int(d_counts.sum()) + tiny
    total_sq = float(d_sq.sum()) + tiny_sq
    f_lo, f_hi = int(d_counts[per_d["flush_lo"]].sum()), int(d_counts[per_d["flush_hi"]].sum())
    sq_lo, sq_hi = float(d_sq[per_d["flush_lo"]].sum()), float(d_sq[per_d["flush_hi"]].sum())
    err_hi = float((per_d["bound"] ** 2 * d_sq).sum())
    sat, sat_lo_sq = 0, 0.0
    if per_d["exact_top"]:
        top_sat, top_bound, top_least = _top_saturation(recipe.element)
        top_c, top_sq = c[_TOP:_TOP + N_TOP], s[_TOP:_TOP + N_TOP]
        sat = int(top_c[top_sat].sum())
        err_hi += float((top_bound ** 2 * top_sq).sum()) - per_d["bound"][0] ** 2 * d_sq[0]
        sat_lo_sq = float((top_least ** 2 * top_sq).sum())
    flushed = (max(f_lo - far, 0), min(f_hi + unsure, nonzero))
    saturated = (max(sat - far, 0), min(sat + unsure, nonzero))
    share = (lambda v: min(max(v / total_sq, 0.0), 1.0)) if total_sq > 0 else (lambda v: 0.0)
    norm_lost = (share(sq_lo - far_sq), share(sq_hi + unsure_sq))
    rms = (math.sqrt(share(sq_lo - far_sq + sat_lo_sq)), math.sqrt(share(err_hi + unsure_sq)))
    return WhatIf(recipe.name, nonzero, int(c[_ZERO]), int(c[_NONFINITE]), int(c[_POISONED]), unsure, flushed,
                  saturated, norm_lost, rms)
