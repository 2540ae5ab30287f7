"""Per-layer small multiples: one log2 histogram per tensor, shaded by the format's regions.

    from ampviz.plots import layer_histograms_figure
    step = run.hist_index(100)
    layer_histograms_figure(run.counts_in("unscaled")[0, step], run.tensor_names, "fp16",
                            log2_scale=int(run.scale_log2_at_hist()[0, step]))

All panels share the x axis, so layers compare at a glance; each panel's title gives the share
of its non-zero values flushed to zero and overflowed, and its share of exact zeros.
"""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .. import histogram as H
from .._args import check_int
from ..formats import get_format
from .histogram import binade_positions, check_domain, check_log2_scale, histogram_x_range, region_edges
from .style import DATA_COLOR, REGION_COLORS, REGION_OPACITY, REGIONS, base_layout, log2_ticks, percent

__all__ = ["layer_histograms_figure"]

_COLS = np.arange(H.BELOW, H.ABOVE)


def layer_histograms_figure(counts, names, format="fp16", log2_scale=0, *, domain: str = "unscaled", cols: int = 3,
                            title: str = "Gradient magnitudes per tensor", panel_height: int = 170) -> go.Figure:
    """A grid of histograms, one per tensor, sharing a log2 x axis.

    Parameters
    ----------
    counts : (T, NBINS) counts, one row per tensor.
    names : T tensor names (panel titles).
    format, log2_scale : the format and integer log2 loss scale the shading shows.
    domain : "unscaled" or "scaled": which values are plotted (labelled).
    cols : panels per row.

    Returns
    -------
    plotly Figure with one bar trace per tensor (named by the tensor) and four region shapes per panel.
    """
    c = H.as_counts(counts, axes=("tensors",))
    names = [str(n) for n in names]
    if len(names) != c.shape[0]:
        raise ValueError(f"names: expected {c.shape[0]} names (one per counts row), got {len(names)}")
    check_int("cols", cols, low=1)
    fmt, s, domain = get_format(format), check_log2_scale(log2_scale), check_domain(domain)
    fate = H.fate(c, fmt, log2_scale=s)
    rows = math.ceil(c.shape[0] / cols)
    titles = [_panel_title(n, fate, i, c[i]) for i, n in enumerate(names)]
    fig = make_subplots(rows=rows, cols=cols, shared_xaxes=True, subplot_titles=titles,
                        vertical_spacing=min(0.12, 0.5 / rows), horizontal_spacing=0.05)
    lo, hi = histogram_x_range(c, fmt, (s,))
    edges = region_edges(fmt, s)
    x = binade_positions()
    for i, name in enumerate(names):
        r, col = divmod(i, cols)
        fig.add_trace(go.Bar(x=x, y=c[i, _COLS], width=1.0, name=name, marker_color=DATA_COLOR,
                             hovertemplate=f"{name}<br>2^%{{x:.1f}}: %{{y:,}}<extra></extra>"), r + 1, col + 1)
        axis = "" if i == 0 else str(i + 1)
        for region in REGIONS:
            a, b = (min(max(v, lo), hi) for v in edges[region])
            fig.add_shape(type="rect", xref=f"x{axis}", yref=f"y{axis} domain", x0=a, x1=b, y0=0, y1=1,
                          fillcolor=REGION_COLORS[region], opacity=REGION_OPACITY, line_width=0, layer="below",
                          name=f"region:{region}:{name}")
    ticks, text = log2_ticks(lo, hi, max_ticks=8)
    fig.update_xaxes(range=[lo, hi], tickvals=ticks, ticktext=text, ticks="outside")
    for i in range(c.shape[0]):
        if i + cols >= c.shape[0]:       # the lowest panel of its column carries the tick labels
            r, col = divmod(i, cols)
            fig.update_xaxes(showticklabels=True, title_text=f"|gradient| ({domain}, log2)", row=r + 1, col=col + 1)
    fig.update_yaxes(rangemode="tozero", nticks=4)
    fig.update_annotations(font_size=11)
    subtitle = (f"shading: the fate of each value × 2<sup>{s}</sup> cast to {fmt.name} (red flush to zero, orange "
                f"subnormal, green normal, purple overflow); titles: shares of non-zero values")
    fig.update_layout(**base_layout(title, subtitle, height=120 + panel_height * rows, bargap=0, inline_subtitle=True,
                                    margin=dict(l=50, r=20, t=110, b=60)))
    return fig


def _panel_title(name: str, fate, i: int, row: np.ndarray) -> str:
    total = int(row.sum())
    zeros = row[H.ZERO] / total if total else 0.0
    return (f"<b>{name}</b>  flushed {percent(fate.fraction('flushed')[i])} · "
            f"overflow {percent(fate.fraction('overflow')[i])} · zeros {percent(zeros)}")
