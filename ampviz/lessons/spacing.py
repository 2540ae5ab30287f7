"""Spacing between neighbouring representable numbers (one ulp) against magnitude, per format.

Every number comes from :meth:`ampviz.formats.Format.ulp`, itself derived from ``torch.finfo``.
On log2 axes each format is a staircase: the spacing doubles at every power of two (a fixed
number of mantissa bits per binade), flattens below the smallest normal number (subnormals are
evenly spaced), and stops at the format's largest finite value::

    from ampviz.lessons.spacing import spacing_figure
    fig = spacing_figure(["fp32", "bf16", "fp16"], marks=[("fp16", 2048.0), ("fp16", 1.0)])
    fig.show()

Used by lessons 01 (tensor dtypes) and 08 (bf16 and fp8); 02 and 02b take their colours from FORMAT_COLORS.
"""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go

from ..formats import get_format
from ..plots.style import OKABE_ITO, base_layout, log2_ticks

__all__ = ["spacing_figure", "spacing_steps", "FORMAT_COLORS"]

FORMAT_COLORS = {"fp32": OKABE_ITO["blue"], "tf32": OKABE_ITO["sky_blue"], "bf16": OKABE_ITO["bluish_green"],
                 "fp16": OKABE_ITO["vermillion"], "fp8_e4m3fn": OKABE_ITO["reddish_purple"],
                 "fp8_e5m2": OKABE_ITO["orange"]}

_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star")   # one per mark, named in the legend


def _color(f) -> str:
    return FORMAT_COLORS.get(f.name, OKABE_ITO["black"])


def _short(v: float) -> str:
    """A power of two as 2^k when it is not a small integer, other numbers as %g."""
    m, e = math.frexp(abs(v))
    if m == 0.5 and not 1 <= abs(v) <= 65536:
        return ("-" if v < 0 else "") + f"2^{e - 1}"
    return f"{v:g}"


def spacing_steps(fmt, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Staircase of log2(ulp) over log2|x| in [lo, hi], clipped to the format's finite range.

    Returns ``(log2_x, log2_ulp)`` with one point at the start of every binade plus one at the
    end, for drawing with ``line_shape="hv"``. Below the smallest subnormal nothing is drawn.
    """
    f = get_format(fmt)
    if not (isinstance(lo, int) and isinstance(hi, int) and lo < hi):
        raise ValueError(f"lo, hi: expected integers with lo < hi, got lo={lo!r}, hi={hi!r}")
    start = max(lo, f.log2_min_subnormal)
    stop = min(hi, f.emax + 1)
    if start >= stop:
        return np.empty(0), np.empty(0)
    ks = np.arange(start, stop)
    ulps = np.array([math.log2(f.ulp(math.ldexp(1.0, int(k)))) for k in ks])
    end = math.log2(f.max) if stop == f.emax + 1 else float(stop)
    return np.append(ks.astype(float), end), np.append(ulps, ulps[-1])


def spacing_figure(formats=("fp32", "bf16", "fp16"), lo: int = -26, hi: int = 18, marks=(),
                   title: str | None = None) -> go.Figure:
    """Plot the spacing of each format against |x| on log2 axes.

    Parameters
    ----------
    formats : format names, dtypes or Formats.
    lo, hi : log2 range of |x| shown.
    marks : ``(format, value)`` pairs drawn as points, each named in the legend with its spacing.
    title : figure title (a default says what is shown).
    """
    fig = go.Figure()
    y_all = []
    for spec in formats:
        f = get_format(spec)
        x, y = spacing_steps(f, lo, hi)
        y_all.extend(y)
        fig.add_scatter(x=x, y=y, mode="lines", line_shape="hv", name=f.name,
                        line=dict(color=_color(f), width=2.5),
                        hovertemplate=f"{f.name}<br>|x| from 2^%{{x:.0f}}<br>ulp = 2^%{{y:.0f}}<extra></extra>")
        if f.emax + 1 <= hi:            # the staircase ends at the largest finite value
            fig.add_scatter(x=[x[-1]], y=[y[-1]], mode="markers", showlegend=False,
                            marker=dict(symbol="line-ns", size=14, line=dict(width=3, color=_color(f))),
                            hovertemplate=f"{f.name} max = {f.max:g}; above it: overflow<extra></extra>")
    for i, (spec, value) in enumerate(marks):
        f = get_format(spec)
        ulp = f.ulp(value)
        if not math.isfinite(ulp) or value == 0:
            raise ValueError(f"marks: value {value!r} has no finite spacing in {f.name}")
        # labelled in the legend, not on the plot, where a label would hide a staircase
        fig.add_scatter(x=[math.log2(abs(value))], y=[math.log2(ulp)], mode="markers",
                        name=f"{f.name}: ulp({_short(value)}) = {_short(ulp)}",
                        marker=dict(size=11, color=_color(f), symbol=_SYMBOLS[i % len(_SYMBOLS)],
                                    line=dict(color="black", width=1)),
                        hovertemplate=f"{f.name}: x = {value:g}, ulp = {ulp:g}<extra></extra>")
    xt, xl = log2_ticks(lo, hi, max_ticks=12)
    ylo, yhi = (math.floor(min(y_all)), math.ceil(max(y_all))) if y_all else (lo, hi)
    yt, yl = log2_ticks(ylo, yhi, max_ticks=8, decimals=False)   # 2^k only: decimals crowd a tall axis
    fig.update_layout(**base_layout(title or "Spacing between neighbours (ulp) grows with |x|",
                                    "log2 axes; subnormals are evenly spaced, so the staircase flattens at the left",
                                    height=460, showlegend=True,
                                    # bottom right: below the lowest staircase (the finest format) nothing is drawn
                                    legend=dict(x=0.99, xanchor="right", y=0.02, yanchor="bottom",
                                                bgcolor="rgba(255,255,255,0.85)"),
                                    inline_subtitle=True))
    fig.update_xaxes(title="|x|", tickvals=xt, ticktext=xl, range=[lo - 0.5, hi + 0.5])
    # two binades of margin: a line's end tick (14 px tall) and a mark (11 px) stay whole at the top and bottom
    fig.update_yaxes(title="ulp(x): gap to the next number up", tickvals=yt, ticktext=yl,
                     range=[ylo - 2, yhi + 2])
    return fig
