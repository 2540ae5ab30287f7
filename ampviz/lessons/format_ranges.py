"""One histogram, several formats: the same recorded values shaded by each format's regions.

Range versus precision at a glance: the bars never change between panels, only where each format
flushes to zero, goes subnormal and overflows (saturates, for e4m3fn)::

    from ampviz.lessons.format_ranges import format_comparison_figure
    format_comparison_figure(run.counts[0, :, kinds == "activation"],
                             ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"])

Used by lessons 08 (bf16).
"""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .. import histogram as H
from .._args import check_int
from ..formats import get_format
from ..plots.histogram import (
    binade_positions,
    check_domain,
    check_log2_scale,
    histogram_x_range,
    region_edges,
    summed_counts,
)
from ..plots.style import DATA_COLOR, REGION_COLORS, REGION_OPACITY, REGIONS, base_layout, log2_ticks, percent

__all__ = ["format_comparison_figure", "DEFAULT_FORMATS"]

DEFAULT_FORMATS = ("fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")
_COLS = np.arange(H.BELOW, H.ABOVE)


def _title(fmt, fate, s: int) -> str:
    over = "saturate" if fmt.saturates else "overflow"
    scale = f" × 2<sup>{s}</sup>" if s else ""
    return (f"<b>{fmt.name}</b>{scale}: flushed <b>{percent(fate.fraction('flushed'))}</b> · subnormal "
            f"{percent(fate.fraction('subnormal'))} · {over} {percent(fate.fraction('overflow'))}")


def _x_range(c: np.ndarray, x: np.ndarray, fmts, scales, pad: float = 3.0) -> tuple:
    """The non-empty bins and the formats' flush-to-zero and overflow edges near them (log2 units)."""
    filled = x[c[_COLS] > 0]
    if not filled.size:
        return histogram_x_range(c, fmts[0], (scales[0],))
    lo, hi = filled.min() - 0.5, filled.max() + 0.5
    edges = [e for f, s in zip(fmts, scales) for e in (region_edges(f, s)["subnormal"][0],
                                                        region_edges(f, s)["overflow"][0])]
    near = [e for e in edges if lo - 24 <= e <= hi + 24]      # an edge far from every value adds nothing
    return min([lo] + near) - pad, max([hi] + near) + pad


def format_comparison_figure(counts, formats=DEFAULT_FORMATS, log2_scales=None, *, domain: str = "unscaled",
                             cols: int = 2, title: str = "The same gradients against several formats",
                             panel_height: int = 220) -> go.Figure:
    """A grid of panels, one per format, each showing the same histogram with that format's regions.

    Parameters
    ----------
    counts : (..., NBINS) binade counts; leading axes are summed.
    formats : format names, dtypes or Formats, one panel each.
    log2_scales : one integer log2 scale per format (default 0): each panel shows the fate of the
        values times ``2**s`` cast to its format.
    domain : "unscaled" or "scaled": which values are plotted (labelled).
    cols : panels per row.

    Returns
    -------
    plotly Figure: one bar trace per panel (named by the format), four region shapes per panel
    (named ``region:<region>:<format>``), panel titles with the shares of the non-zero values.
    """
    c = summed_counts(counts)
    fmts = [get_format(f) for f in formats]
    if not fmts:
        raise ValueError("formats: expected at least one format")
    scales = [0] * len(fmts) if log2_scales is None else [check_log2_scale(s, "log2_scales") for s in log2_scales]
    if len(scales) != len(fmts):
        raise ValueError(f"log2_scales: expected {len(fmts)} scales (one per format), got {len(scales)}")
    check_int("cols", cols, low=1)
    domain = check_domain(domain)
    rows = math.ceil(len(fmts) / cols)
    fates = [H.fate(c, f, log2_scale=s) for f, s in zip(fmts, scales)]
    fig = make_subplots(rows=rows, cols=cols, shared_xaxes=True, shared_yaxes=True,
                        subplot_titles=[_title(f, fate, s) for f, fate, s in zip(fmts, fates, scales)],
                        vertical_spacing=min(0.16, 0.6 / rows), horizontal_spacing=0.04)
    x = binade_positions()
    lo, hi = _x_range(c, x, fmts, scales)
    for i, (f, s) in enumerate(zip(fmts, scales)):
        r, col = divmod(i, cols)
        fig.add_trace(go.Bar(x=x, y=np.where(c[_COLS] > 0, c[_COLS], np.nan), width=1.0, name=f.name,
                             marker_color=DATA_COLOR,
                             hovertemplate="2^%{x:.1f}: %{y:,} values<extra></extra>"), r + 1, col + 1)
        axis = "" if i == 0 else str(i + 1)
        for region, (a, b) in region_edges(f, s).items():
            fig.add_shape(type="rect", xref=f"x{axis}", yref=f"y{axis} domain", y0=0, y1=1,
                          x0=min(max(a, lo), hi), x1=min(max(b, lo), hi), fillcolor=REGION_COLORS[region],
                          opacity=REGION_OPACITY, line_width=0, layer="below", name=f"region:{region}:{f.name}")
    ticks, text = log2_ticks(lo, hi, max_ticks=9)
    fig.update_xaxes(range=[lo, hi], tickvals=ticks, ticktext=text, ticks="outside")
    fig.update_xaxes(title_text=f"|gradient| ({domain}, log2)", row=rows, showticklabels=True)
    top = math.log10(max(int(c[_COLS].max()), 1)) + 0.3     # decades, from below 1 so single values show
    fig.update_yaxes(type="log", dtick=1, tickformat="~s", range=[-0.3, top])
    fig.update_yaxes(title_text="values", col=1)
    fig.update_annotations(font_size=12)
    zeros = int(c[H.ZERO])
    legend = " · ".join(f"<span style='color:{REGION_COLORS[r]}'>■</span> {r}" for r in REGIONS)
    subtitle = (f"{int(c.sum()):,} values ({percent(zeros / c.sum() if c.sum() else 0)} exact zeros, not drawn); "
                f"shading: {legend}; shares are of the non-zero values")
    fig.update_layout(**base_layout(title, subtitle, height=130 + panel_height * rows, bargap=0, inline_subtitle=True,
                                    margin=dict(l=60, r=20, t=120, b=70)))
    return fig
