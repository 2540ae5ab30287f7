"""Per-tensor views: small multiples (one log2 histogram per tensor) and a map of every tensor at once.

    from ampviz.plots import layer_histograms_figure, tensor_map_figure
    row = run.hist_index(100)
    counts = run.counts_at(row)                                   # (T, NBINS), unscaled
    s = int(run.log2_scales()[0, row])
    layer_histograms_figure(counts[:12], run.tensor_names[:12], "fp16", log2_scale=s)
    tensor_map_figure(counts, run.tensor_names, "fp16", log2_scale=s)      # hundreds of tensors

Small multiples share the x axis, so layers compare at a glance; each panel's title gives the
share of its non-zero values flushed to zero and overflowed, and its share of exact zeros. They
suit a few dozen tensors; the tensor map (one heatmap row per tensor, the format's regions shaded
once) stays light with thousands. Tensor names are shown escaped and, when long, shortened in the
middle (the full name is in the hover).
"""

from __future__ import annotations

import html
import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .. import histogram as H
from .._args import check_int
from ..formats import get_format
from .histogram import binade_positions, check_domain, check_log2_scale, histogram_x_range, region_edges
from .style import DATA_COLOR, REGION_COLORS, REGION_OPACITY, REGIONS, base_layout, log2_ticks, percent

__all__ = ["layer_histograms_figure", "tensor_map_figure", "short_name"]

_COLS = np.arange(H.BELOW, H.ABOVE)
_TITLE_PX = 34                    # two lines of 11 px panel titles, and a gap above them
_CHARS_PER_ROW = 132              # characters of a bold 11 px title across a ~1100 px figure


def short_name(name: str, limit: int) -> str:
    """``name`` escaped for plotly's text, shortened in the middle to ``limit`` characters."""
    name = str(name)
    if len(name) > limit:
        keep = max(limit - 1, 2)
        name = name[:keep // 2] + "…" + name[len(name) - (keep - keep // 2):]
    return html.escape(name)


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
    plotly Figure with one bar trace per tensor (named by the tensor) and four region shapes per panel
    (named ``region:<region>:<tensor>``), all added in one layout update.
    """
    c = H.as_counts(counts, axes=("tensors",))
    names = [str(n) for n in names]
    if len(names) != c.shape[0]:
        raise ValueError(f"names: expected {c.shape[0]} names (one per counts row), got {len(names)}")
    if not names:
        raise ValueError("counts: no tensors to draw (0 rows)")
    check_int("cols", cols, low=1)
    fmt, s, domain = get_format(format), check_log2_scale(log2_scale), check_domain(domain)
    fate = H.fate(c, fmt, log2_scale=s)
    rows = math.ceil(c.shape[0] / cols)
    limit = max(_CHARS_PER_ROW // cols, 12)
    titles = [_panel_title(short_name(n, limit), fate, i, c[i]) for i, n in enumerate(names)]
    height = 120 + panel_height * rows
    plot_height = height - 110 - 60                                     # the margins below
    fig = make_subplots(rows=rows, cols=cols, shared_xaxes=True, subplot_titles=titles,
                        vertical_spacing=min(0.3, _TITLE_PX / plot_height) if rows > 1 else 0.0,
                        horizontal_spacing=0.05)
    lo, hi = histogram_x_range(c, fmt, (s,))
    edges = {r: [min(max(v, lo), hi) for v in edges] for r, edges in region_edges(fmt, s).items()}
    x = binade_positions()
    shapes = []
    for i, name in enumerate(names):
        r, col = divmod(i, cols)
        fig.add_trace(go.Bar(x=x, y=c[i, _COLS], width=1.0, name=name, marker_color=DATA_COLOR,
                             hovertemplate=f"{html.escape(name)}<br>2^%{{x:.1f}}: %{{y:,}}<extra></extra>"),
                      r + 1, col + 1)
        axis = "" if i == 0 else str(i + 1)
        shapes += [dict(type="rect", xref=f"x{axis}", yref=f"y{axis} domain", x0=edges[region][0],
                        x1=edges[region][1], y0=0, y1=1, fillcolor=REGION_COLORS[region], opacity=REGION_OPACITY,
                        line_width=0, layer="below", name=f"region:{region}:{name}") for region in REGIONS]
    fig.update_layout(shapes=shapes)               # one update: add_shape per panel is quadratic in panels
    ticks, text = log2_ticks(lo, hi, max_ticks=8)
    fig.update_xaxes(range=[lo, hi], tickvals=ticks, ticktext=text, ticks="outside")
    for i in range(c.shape[0]):
        if i + cols >= c.shape[0]:       # the lowest panel of its column carries the tick labels
            r, col = divmod(i, cols)
            fig.update_xaxes(showticklabels=True, title_text=f"|gradient| ({domain}, log2)", row=r + 1, col=col + 1)
    fig.update_yaxes(rangemode="tozero", nticks=4)
    for r in range(rows):                # the leftmost panel of each row names the count
        fig.update_yaxes(title_text="values", title_standoff=2, row=r + 1, col=1)
    fig.update_annotations(font_size=11)
    subtitle = (f"shading: the fate of each value × 2<sup>{s}</sup> cast to {fmt.name} (red flush to zero, orange "
                f"subnormal, green normal, purple overflow); titles: shares of non-zero values")
    fig.update_layout(**base_layout(title, subtitle, height=height, bargap=0, inline_subtitle=True,
                                    margin=dict(l=64, r=20, t=110, b=60)))
    return fig


def _panel_title(shown_name: str, fate, i: int, row: np.ndarray) -> str:
    total = int(row.sum())
    zeros = row[H.ZERO] / total if total else 0.0
    return (f"<b>{shown_name}</b><br>flushed {percent(fate.fraction('flushed')[i])} · "
            f"overflow {percent(fate.fraction('overflow')[i])} · zeros {percent(zeros)}")


def tensor_map_figure(counts, names, format="fp16", log2_scale=0, *, domain: str = "unscaled",
                      title: str = "Every tensor", kinds=None) -> go.Figure:
    """One heatmap row per tensor (log10 counts over the log2 axis), the format's regions shaded once.

    Parameters
    ----------
    counts : (T, NBINS) counts, one row per tensor.
    names : T tensor names (rows, in this order from the top; the hover shows the full name).
    format, log2_scale : the format and integer log2 loss scale the shading shows.
    kinds : optional T kinds, shown in the hover.

    Returns
    -------
    plotly Figure: trace 0 the heatmap (z: (T, columns) float32 log10 counts, nan where empty),
    four region shapes named ``region:<region>``.
    """
    c = H.as_counts(counts, axes=("tensors",))
    names = [str(n) for n in names]
    if len(names) != c.shape[0] or not names:
        raise ValueError(f"names: expected {c.shape[0]} names (one per counts row, at least one), got {len(names)}")
    fmt, s, domain = get_format(format), check_log2_scale(log2_scale), check_domain(domain)
    nonempty = np.flatnonzero(c[:, _COLS].any(axis=0))
    first, last = (int(nonempty[0]), int(nonempty[-1])) if nonempty.size else (0, 0)
    cols = np.arange(max(first - 1, 0), min(last + 2, _COLS.size))        # the non-empty binades, padded
    with np.errstate(divide="ignore"):
        z = np.where(c[:, _COLS[cols]] > 0, np.log10(c[:, _COLS[cols]]), np.nan).astype(np.float32)
    # one category per row, unique even when names repeat (a weight and its local gradient): "<index>: <name>"
    labels = [f"{i}: {short_name(n, 80)}" + (f" ({html.escape(str(kinds[i]))})" if kinds is not None else "")
              for i, n in enumerate(names)]
    heat = go.Heatmap(z=z, x=binade_positions()[cols], y=labels, colorscale="Blues", zmin=0, hoverongaps=False,
                      name="counts", colorbar=dict(title=dict(text="log10 values", side="right"), thickness=12),
                      hovertemplate="%{y}<br>|g| ≈ 2^%{x:.1f}<br>10^%{z:.2f} values<extra></extra>")
    fig = go.Figure(heat)
    lo, hi = histogram_x_range(c, fmt, (s,))
    fig.update_layout(shapes=[dict(type="rect", xref="x", yref="paper", x0=min(max(a, lo), hi), x1=min(max(b, lo), hi),
                                   y0=0, y1=1, fillcolor=REGION_COLORS[r], opacity=REGION_OPACITY, line_width=0,
                                   layer="above", name=f"region:{r}") for r, (a, b) in region_edges(fmt, s).items()])
    ticks, text = log2_ticks(lo, hi, max_ticks=10)
    fig.update_xaxes(range=[lo, hi], tickvals=ticks, ticktext=text, ticks="outside",
                     title_text=f"|gradient| ({domain}, log2)")
    show_names = len(names) <= 40              # beyond that the rows are thinner than a label: hover instead
    fig.update_yaxes(autorange="reversed", title_text="tensor (recording order)", ticks="outside" if show_names else "",
                     showticklabels=show_names, type="category")
    subtitle = (f"{len(names)} tensors; shading: the fate of each value × 2<sup>{s}</sup> cast to {fmt.name} (red "
                "flush to zero, orange subnormal, green normal, purple overflow)")
    fig.update_layout(**base_layout(title, subtitle, height=int(min(max(260 + 14 * len(names), 360), 900)),
                                    inline_subtitle=True, margin=dict(l=320 if show_names else 80, r=30, t=100, b=60)))
    return fig
