"""Step × binade heatmap of gradient magnitudes, with the format's limits drawn as lines.

    from ampviz.plots import heatmap_figure
    counts = run.counts_in("unscaled")[0].sum(axis=1)           # (steps, NBINS): all tensors
    log2s = run.scale_log2_at_hist()[0]                         # the scale each step used
    heatmap_figure(counts, run.hist_steps, "fp16", log2_scale=log2s)

In the unscaled domain the limits move with the loss scale (a value x is flushed when
``|x| * scale`` is, so the fp16 flush line sits at ``2**-25 / scale``); in the scaled domain
(``log2_scale=0``) they are straight. Colour is log10 of the count; empty cells stay white.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from .. import histogram as H
from ..formats import get_format
from .histogram import binade_positions, check_domain, region_edges
from .style import REGION_COLORS, apply_layout, base_layout, log2_ticks, title_text

__all__ = ["heatmap_figure", "heatmap_matrix", "heatmap_rows", "heatmap_z", "set_heatmap", "set_limit_lines",
           "set_line_legend", "set_cursor", "LIMIT_LINES"]

_COLS = np.arange(H.BELOW, H.ABOVE)
# (trace name, region whose lower edge the line is, region whose colour it takes, dash, legend text)
LIMIT_LINES = (("flush", "subnormal", "flushed", "dash", "flush to zero below"),
               ("normal", "normal", "subnormal", "dot", "subnormal below"),
               ("overflow", "overflow", "overflow", "solid", "overflow above"))
MAX_COLUMNS = 250           # heatmap columns drawn at most (longer runs: each column sums a window)
_COLORSCALE = "Blues"       # sequential, single hue: readable with any colour vision, lines stay visible


def heatmap_rows(counts, pad: int = 1) -> tuple:
    """(first, last) column of ``counts`` (H, NBINS) to draw: the non-empty binades, padded.

    Only these rows are sent to the browser; the y axis may extend further (to the limit lines).
    """
    nonempty = np.flatnonzero((np.asarray(counts)[:, _COLS] > 0).any(axis=0)) + H.BELOW
    if nonempty.size == 0:
        return H.column(-1), H.column(0)
    return max(int(nonempty[0]) - pad, H.BELOW), min(int(nonempty[-1]) + pad, H.ABOVE - 1)


def _y_range(rows: tuple, log2s, format, pad: float = 2.0) -> tuple:
    """The y axis: the drawn rows and every limit line position, padded."""
    y = binade_positions()[[rows[0] - H.BELOW, rows[1] - H.BELOW]]
    points = [y[0] - 0.5, y[1] + 0.5]
    for s in (int(np.min(log2s)), int(np.max(log2s))):
        e = region_edges(format, s)
        points += [e["subnormal"][0], e["overflow"][0]]
    return max(min(points) - pad, H.K_MIN - 2.0), min(max(points) + pad, H.K_MAX + 2.0)


def heatmap_matrix(counts, rows: tuple, max_columns: int = MAX_COLUMNS) -> tuple:
    """(z, columns): float32 log10 counts (bins, columns) for binade columns ``rows[0]..rows[1]``,
    nan where empty, and the row index of ``counts`` where each heatmap column starts.

    Runs longer than ``max_columns`` steps are drawn with each column summing a window of
    consecutive steps: a plot is a few hundred pixels wide anyway, and a FigureWidget sends a 2-D
    array as nested lists, so its size is the cost of every update.
    """
    c = np.asarray(counts)[:, rows[0]:rows[1] + 1]
    window = max(1, -(-c.shape[0] // int(max_columns)))
    starts = np.arange(0, c.shape[0], window)
    if window > 1:
        c = np.add.reduceat(c, starts, axis=0)
    c = c.T.astype(np.float32)
    with np.errstate(divide="ignore"):
        return np.where(c > 0, np.log10(c), np.nan).astype(np.float32), starts


def heatmap_z(z) -> np.ndarray:
    """A heatmap matrix as the front end receives it: log10 counts to 3 decimals, None where empty
    (an object array: plotly sends it with one ``tolist``).

    A FigureWidget sends a 2-D array as nested JSON lists, and JSON has no NaN ("Out of range float
    values are not JSON compliant"); None is plotly's gap. Three decimals of log10 are 0.1% of a
    count, finer than any colour step, and keep each message a third of the size.
    """
    z = np.asarray(z, dtype=np.float64)
    return np.where(np.isnan(z), None, np.round(z, 3))


def heatmap_figure(counts, steps, format="fp16", log2_scale=0, *, domain: str = "unscaled",
                   title: str = "Gradient magnitudes per step", height: int = 420) -> go.Figure:
    """Heatmap of ``counts`` (steps, NBINS) over steps × log2 magnitude, with the format's limits.

    Parameters
    ----------
    counts : (H, NBINS) counts, one histogram row per step (sum tensors first).
    steps : (H,) step numbers of the rows.
    format : format whose limits are drawn.
    log2_scale : integer or (H,) integers: the loss scale each value is multiplied by before the
        cast (the recorded scale per step for unscaled values, 0 for scaled ones).
    domain : "unscaled" or "scaled", the label of the y axis.

    Returns
    -------
    plotly Figure: trace 0 the heatmap of log10 counts, traces 1-3 the limit lines (flush,
    normal, overflow: ``LIMIT_LINES`` order, ``meta`` holds the short name), and a vertical
    shape "cursor" (hidden until set).
    """
    c, steps, log2s = _check(counts, steps, log2_scale)
    fig = go.Figure(go.Heatmap(name="counts", colorscale=_COLORSCALE, zmin=0, hoverongaps=False,
                               colorbar=dict(title=dict(text="values", side="right"), thickness=12),
                               hovertemplate="step %{x}<br>|g| ≈ 2^%{y:.1f}<br>10^%{z:.2f} values<extra></extra>"))
    for name, _, color, dash, label in LIMIT_LINES:      # names are legend text
        fig.add_trace(go.Scatter(name=label, mode="lines", meta=name,
                                 line=dict(color=REGION_COLORS[color], width=2, shape="hv", dash=dash),
                                 hovertemplate=f"step %{{x}}: {label} 2^%{{y:.2f}}<extra></extra>"))
    fig.add_vline(x=float(steps[0]), name="cursor", visible=False, line=dict(color="#000000", width=1, dash="dot"))
    fig.update_layout(**base_layout(title, _subtitle(format, domain), height=height, showlegend=True,
                                    inline_subtitle=True,
                                    legend=dict(orientation="h", x=1.0, xanchor="right", y=1.0, yanchor="bottom"),
                                    margin=dict(l=80, r=30, t=105, b=60)))
    fig.update_xaxes(title_text="optimizer step", ticks="outside")
    fig.update_yaxes(ticks="outside")
    set_heatmap(fig, c, steps, format, log2s, domain)
    return fig


def _subtitle(format, domain: str, window: int = 1) -> str:
    text = f"lines: {get_format(format).name} limits for the {domain} values"
    return text + (f"; each column sums {window} steps" if window > 1 else "")


def _check(counts, steps, log2_scale):
    c = H.as_counts(counts, axes=("steps",))    # sum the tensors first
    steps = np.asarray(steps)
    if steps.shape != (c.shape[0],):
        raise ValueError(f"steps: expected {c.shape[0]} step numbers (one per counts row), got shape {steps.shape}")
    log2s = np.broadcast_to(np.asarray(log2_scale), steps.shape)
    if not np.all(np.mod(log2s, 1) == 0):
        raise ValueError("log2_scale: expected integers (the loss scale is a power of two)")
    return c, steps, log2s.astype(np.int64)


def set_heatmap(fig, counts, steps, format, log2_scale, domain: str = "unscaled", matrix=None, rows=None,
                title: str | None = None) -> None:
    """Redraw a heatmap figure for new counts / scales / format (in place).

    ``matrix`` (the pair from :func:`heatmap_matrix`, its z optionally already :func:`heatmap_z`) and
    ``rows`` (:func:`heatmap_rows`) may be passed precomputed, which is what widgets do to keep updates
    fast. ``title`` replaces the title (default: keep it). The figure's z is :func:`heatmap_z` of the matrix.
    """
    c, steps, log2s = _check(counts, steps, log2_scale)
    rows = heatmap_rows(c) if rows is None else rows
    z, starts = heatmap_matrix(c, rows) if matrix is None else matrix
    zmax = np.nanmax(z, initial=-1.0) if z.dtype != object else np.max(z, initial=-1.0, where=z != None)  # noqa: E711
    z = z if z.dtype == object else heatmap_z(z)
    k = np.arange(rows[0], rows[1] + 1) - 128                          # binade exponent of each row
    y = np.where(k == H.BELOW - 128, H.K_MIN - 0.5, k + 0.5)
    heat = fig.data[0]
    # a window of steps is drawn at its mean step (float64: sent to the browser as a binary buffer)
    ends = np.append(starts[1:], steps.size)
    x = np.add.reduceat(steps.astype(np.float64), starts) / (ends - starts)
    heat.x, heat.y, heat.z = x, y, z
    window = int(ends[0] - starts[0])
    heat.hovertemplate = (f"step %{{x:.0f}}{f' (sum of {window} steps)' if window > 1 else ''}<br>"
                          "|g| ≈ 2^%{y:.1f}<br>10^%{z:.2f} values<extra></extra>")
    top = float(np.ceil(zmax)) if zmax >= 0 else 1.0
    if heat.zmax != max(top, 1.0):           # colour bar ticks: one per decade of counts
        heat.zmax = max(top, 1.0)
        decades = list(range(0, int(heat.zmax) + 1))
        heat.colorbar.tickvals, heat.colorbar.ticktext = decades, [f"{10 ** v:,}" for v in decades]
    lo, hi = _y_range(rows, log2s, format)
    ticks, text = log2_ticks(lo, hi, 8)
    apply_layout(fig, {"yaxis.range": [lo, hi], "yaxis.tickvals": ticks, "yaxis.ticktext": text,
                       "yaxis.title.text": f"|gradient| ({check_domain(domain)}, log2)",
                       "title.text": title_text(title if title is not None else fig.layout.title.text.split("<br>")[0],
                                                _subtitle(format, domain, window))})
    set_limit_lines(fig, steps, format, log2s)
    set_line_legend(fig, format, log2s, (lo, hi))


def set_limit_lines(fig, steps, format, log2_scale) -> None:
    """Move the limit lines to ``format`` at the per-step scales (in place)."""
    steps = np.asarray(steps)
    log2s = np.broadcast_to(np.asarray(log2_scale), steps.shape)
    edges0 = region_edges(format, 0)
    for trace, (_, region, *_) in zip(fig.data[1:1 + len(LIMIT_LINES)], LIMIT_LINES):
        trace.x, trace.y = steps.astype(np.float64), (edges0[region][0] - log2s).astype(np.float64)


def set_line_legend(fig, format, log2_scale, y_range) -> None:
    """Legend entries only for the limit lines that reach into ``y_range`` (lo, hi) of the y axis: a line
    wholly outside it is not drawn, so its legend entry would name a line no one can find (in place; the
    positions are computed, not read back from the figure, so this works inside ``batch_update``)."""
    lo, hi = y_range
    log2s = np.asarray(log2_scale, dtype=np.float64)
    edges0 = region_edges(format, 0)
    for trace, (_, region, *_) in zip(fig.data[1:1 + len(LIMIT_LINES)], LIMIT_LINES):
        y = edges0[region][0] - log2s
        shown = bool(np.any((y >= lo) & (y <= hi)))
        if trace.showlegend is not shown:
            trace.showlegend = shown


def set_cursor(fig, step, updates: dict | None = None) -> None:
    """Show the dotted vertical cursor at ``step`` (in place, or added to ``updates``)."""
    d = {"shapes[0].x0": float(step), "shapes[0].x1": float(step), "shapes[0].visible": True}
    if updates is None:
        apply_layout(fig, d)
    else:
        updates.update(d)
