"""Gradient-magnitude histogram on a log2 axis, shaded by what a cast to a format does to it.

The bars are the recorded values (they never move); the shaded regions are where a value ends up
once multiplied by the loss scale ``2**log2_scale`` and cast to the format: flushed to zero,
subnormal, normal, overflow. Raising the scale slides the regions to the left::

    import ampviz, ampviz.histogram as H
    from ampviz.plots import histogram_figure
    counts = H.histogram(torch.randn(10_000) * 1e-6)
    fig = histogram_figure(counts, "fp16", log2_scale=8)      # a plotly Figure
    fig.show()

Exact zeros sit in their own panel on the left (they are zero in every format: no scale helps
them, none hurts them); inf, values above 2**127 and nan sit in a panel on the right.
"""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .. import histogram as H
from ..formats import get_format
from .style import (
    DATA_COLOR,
    REGION_COLORS,
    REGION_LABELS,
    REGION_OPACITY,
    REGIONS,
    ZERO_COLOR,
    apply_layout,
    base_layout,
    log2_ticks,
    percent,
    swatch,
    title_text,
)

__all__ = ["histogram_figure", "region_edges", "histogram_x_range", "set_regions", "set_fractions", "set_counts",
           "set_title", "set_x_range", "binade_positions", "summed_counts", "check_log2_scale", "check_domain",
           "DOMAINS"]

DOMAINS = ("unscaled", "scaled")
_COLS = np.arange(H.BELOW, H.ABOVE)          # columns drawn on the log2 axis: "below" + 253 binades
_X_LIMITS = (-128.0, 130.0)


def binade_positions() -> np.ndarray:
    """log2-axis centre of columns BELOW..254: binade (2**k, 2**(k+1)] at k + 0.5, "below" at -126.5."""
    x = np.empty(_COLS.size)
    x[0] = H.K_MIN - 0.5
    x[1:] = H.binade_exponents() + 0.5
    return x


def _hover_labels() -> np.ndarray:
    lo, hi = H.lower_edges()[_COLS], H.upper_edges()[_COLS]
    labels = [f"(0, 2^-126] ≈ (0, {hi[0]:.1e}]"]
    labels += [f"(2^{k}, 2^{k + 1}] ≈ ({a:.2g}, {b:.2g}]" for k, a, b in zip(H.binade_exponents(), lo[1:], hi[1:])]
    return np.array(labels)


_HOVER = _hover_labels()


def check_log2_scale(log2_scale, name: str = "log2_scale") -> int:
    """An integer log2 loss scale, or a clear error."""
    if isinstance(log2_scale, bool) or not isinstance(log2_scale, (int, float, np.integer, np.floating)) \
            or not float(log2_scale).is_integer():
        raise ValueError(f"{name}: expected an integer (the loss scale is 2**{name}), got {log2_scale!r}")
    return int(log2_scale)


def check_domain(domain: str) -> str:
    if domain not in DOMAINS:
        raise ValueError(f"domain: expected one of {DOMAINS} (the values on the x axis), got {domain!r}")
    return domain


def summed_counts(counts, name: str = "counts") -> np.ndarray:
    """(NBINS,) int64 counts, summing any leading axes (tensors, steps) of ``counts``."""
    return H.as_counts(counts, name).reshape(-1, H.NBINS).sum(axis=0)


def region_edges(format, log2_scale=0) -> dict:
    """log2 of the magnitudes where each region starts and ends, for values multiplied by 2**log2_scale.

    Returns ``{"flushed": (-inf, a), "subnormal": (a, b), "normal": (b, c), "overflow": (c, inf)}``
    with ``a = log2(min_subnormal / 2)`` (ties at a round to zero), ``b = log2(min_normal)`` and
    ``c = log2(overflow_threshold)`` (65520 for fp16), each minus ``log2_scale``.
    """
    fmt, s = get_format(format), check_log2_scale(log2_scale)
    a = fmt.log2_min_subnormal - 1 - s
    b = fmt.emin - s
    c = math.log2(fmt.overflow_threshold) - s
    return {"flushed": (-math.inf, a), "subnormal": (a, b), "normal": (b, c), "overflow": (c, math.inf)}


def histogram_x_range(counts, format, log2_scales=(0,), pad: float = 2.0, reach: float | None = None) -> tuple:
    """An x range (log2 units) holding every non-empty bin and every region edge at all ``log2_scales``.

    ``reach`` (binades): leave out an edge farther than that from the non-empty bins, so that values
    far inside a wide format (bf16's limits sit at 2^-133 and 2^128) are not squeezed into a sliver.
    Without non-empty bins every edge is kept.
    """
    c = summed_counts(counts)
    x = binade_positions()[c[_COLS] > 0]
    points = [x.min() - 0.5, x.max() + 0.5] if x.size else []
    for s in log2_scales:
        e = region_edges(format, s)
        edges = [e["subnormal"][0], e["overflow"][0]]
        if reach is not None and points:
            edges = [v for v in edges if points[0] - reach <= v <= points[1] + reach]
        points += edges
    lo, hi = min(points) - pad, max(points) + pad
    return max(lo, _X_LIMITS[0]), min(hi, _X_LIMITS[1])


def _overflow_label(fmt) -> str:
    return f"saturate to {fmt.max:g}" if fmt.saturates else REGION_LABELS["overflow"]


def histogram_figure(counts, format="fp16", log2_scale=0, *, domain: str = "unscaled",
                     title: str = "Gradient magnitudes", x_range=None, log_y: bool = False,
                     height: int = 440) -> go.Figure:
    """Histogram of magnitudes on a log2 axis with the format's regions shaded and their shares.

    Parameters
    ----------
    counts : (..., NBINS) binade counts from :mod:`ampviz.histogram`; leading axes are summed.
    format : a format name ("fp16", "bf16", "fp8_e4m3fn", ...), torch dtype or Format.
    log2_scale : integer; the shading shows the fate of each plotted value times ``2**log2_scale``
        (use 0 when the plotted values are already scaled).
    domain : "unscaled" or "scaled": which values the x axis shows (labelled on the figure).
    title : figure title; the format and scale are appended.
    x_range : (lo, hi) in log2 units; default: all non-empty bins and the region edges.
    log_y : log-scale count axis (useful when a few bins dwarf the rest).

    Returns
    -------
    plotly.graph_objects.Figure with traces "zero", "binades", "nonfinite", shapes "region:<name>"
    and annotations "fraction:<name>" (region shares of the non-zero values).
    """
    fmt, s, domain = get_format(format), check_log2_scale(log2_scale), check_domain(domain)
    c = summed_counts(counts).astype(np.float64)      # as set_counts sends them: a binary buffer
    lo, hi = histogram_x_range(c, fmt, (s,)) if x_range is None else _check_range(x_range)
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, column_widths=[0.06, 0.84, 0.10],
                        horizontal_spacing=0.012)
    fig.add_trace(go.Bar(x=["exact 0"], y=[c[H.ZERO]], name="zero", marker_color=ZERO_COLOR,
                         hovertemplate="exact zeros: %{y:,}<extra></extra>"), 1, 1)
    fig.add_trace(go.Bar(x=binade_positions(), y=c[_COLS], width=1.0, name="binades", customdata=_HOVER,
                         marker=dict(color=DATA_COLOR, line=dict(width=0.5, color="white")),
                         hovertemplate="%{customdata}<br>%{y:,} values<extra></extra>"), 1, 2)
    fig.add_trace(go.Bar(x=["inf", "nan"], y=[c[H.ABOVE], c[H.NAN]], name="nonfinite", marker_color="#000000",
                         customdata=["inf or |x| > 2^127", "nan"],
                         hovertemplate="%{customdata}: %{y:,}<extra></extra>"), 1, 3)
    for r in REGIONS:
        fig.add_shape(type="rect", name=f"region:{r}", xref="x2", yref="y2 domain", x0=lo, x1=lo, y0=0, y1=1,
                      fillcolor=REGION_COLORS[r], opacity=REGION_OPACITY, line_width=0, layer="below")
    for i, r in enumerate(REGIONS):
        fig.add_annotation(name=f"fraction:{r}", text="", xref="paper", yref="paper", x=0.07 + 0.22 * i,
                           y=1.0, xanchor="left", yanchor="bottom", showarrow=False, font=dict(size=13))
    ticks, text = _main_ticks(lo, hi)
    fig.update_layout(**base_layout(_title(title, fmt, s, domain), _subtitle(fmt, s, domain), height=height,
                                    inline_subtitle=True, bargap=0, margin=dict(l=70, r=20, t=100, b=80)))
    fig.update_xaxes(range=[lo, hi], tickvals=ticks, ticktext=text, ticks="outside", row=1, col=2,
                     title_text=f"|gradient| ({domain}, log2 scale)")
    fig.update_yaxes(title_text="values (count)", row=1, col=1)
    if log_y:      # decades only, starting below 1 so that bins holding a single value still show
        top = math.log10(max(int(c.max()), 1)) + 0.3
        fig.update_yaxes(type="log", dtick=1, tickformat="~s", range=[-0.3, top])
    fig.update_xaxes(tickangle=0, row=1, col=1)
    fig.update_xaxes(tickangle=0, row=1, col=3)
    set_regions(fig, fmt, s)
    set_fractions(fig, H.fate(c, fmt, log2_scale=s), fmt)
    return fig


def set_title(fig, title: str, format, log2_scale, domain: str = "unscaled", updates: dict | None = None) -> None:
    """Rewrite a histogram figure's title and subtitle for ``format`` at ``2**log2_scale`` (in place)."""
    fmt, s = get_format(format), check_log2_scale(log2_scale)
    d = {} if updates is None else updates
    d["title.text"] = title_text(_title(title, fmt, s, check_domain(domain)), _subtitle(fmt, s, domain))
    d["xaxis2.title.text"] = f"|gradient| ({domain}, log2 scale)"
    if updates is None:
        apply_layout(fig, d)


def set_x_range(fig, x_range, updates: dict | None = None) -> None:
    """Set the log2 axis range of a histogram figure and its ticks (in place)."""
    lo, hi = _check_range(x_range)
    ticks, text = _main_ticks(lo, hi)
    d = {} if updates is None else updates
    d.update({"xaxis2.range": [lo, hi], "xaxis2.tickvals": ticks, "xaxis2.ticktext": text})
    if updates is None:
        apply_layout(fig, d)


def _main_ticks(lo: float, hi: float) -> tuple:
    """log2 ticks of the main panel, none in its leftmost 6%: a label there runs into "exact 0"."""
    ticks, text = log2_ticks(lo, hi)
    keep = [i for i, v in enumerate(ticks) if v >= lo + 0.06 * (hi - lo)]
    return [ticks[i] for i in keep], [text[i] for i in keep]


def _title(title: str, fmt, s: int, domain: str = "unscaled") -> str:
    if domain == "scaled" and s == 0:        # the values already carry the recorded loss scale
        return f"{title} vs {fmt.name}, as scaled in the run"
    if domain == "scaled":
        return f"{title} vs {fmt.name}, as scaled in the run × 2<sup>{s}</sup> more"
    return f"{title} vs {fmt.name} at loss scale 2<sup>{s}</sup>"


def _subtitle(fmt, s: int, domain: str) -> str:
    return (f"shading: the fate of each {domain} value × 2<sup>{s}</sup> cast to {fmt.name};"
            f" shares are of the non-zero values")


def _check_range(x_range) -> tuple:
    try:
        lo, hi = (float(v) for v in x_range)
    except (TypeError, ValueError):
        raise ValueError(f"x_range: expected (lo, hi) in log2 units, got {x_range!r}") from None
    if not lo < hi:
        raise ValueError(f"x_range: expected lo < hi, got {x_range!r}")
    return lo, hi


def _named(items, prefix: str) -> dict:
    return {it.name[len(prefix):]: i for i, it in enumerate(items) if (it.name or "").startswith(prefix)}


def set_regions(fig, format, log2_scale, xref: str = "x2", updates: dict | None = None) -> None:
    """Move the shaded regions of a histogram figure to ``format`` at ``2**log2_scale`` (in place).

    Regions are clipped to the x axis range so that no shape stretches to infinity. With
    ``updates`` (a dict), the layout changes are added to it instead of applied (see
    :func:`~ampviz.plots.style.apply_layout`: one relayout for many changes is much faster).
    """
    d = {} if updates is None else updates
    lo, hi = d.get(f"{xref.replace('x', 'xaxis')}.range") or fig.layout[xref.replace("x", "xaxis")].range
    edges = region_edges(format, log2_scale)
    for r, i in _named(fig.layout.shapes, "region:").items():
        if fig.layout.shapes[i].xref == xref:
            a, b = edges[r]
            d[f"shapes[{i}].x0"], d[f"shapes[{i}].x1"] = min(max(a, lo), hi), min(max(b, lo), hi)
    if updates is None:
        apply_layout(fig, d)


def set_fractions(fig, fate, format, updates: dict | None = None) -> None:
    """Write each region's share of the non-zero values into the figure's header (in place).

    ``fate`` is a :class:`ampviz.histogram.Fate` for one histogram, or a dict region -> fraction.
    """
    fmt = get_format(format)
    fractions = fate if isinstance(fate, dict) else {r: float(fate.fraction(r)) for r in REGIONS}
    labels = dict(REGION_LABELS, overflow=_overflow_label(fmt))
    d = {} if updates is None else updates
    for r, i in _named(fig.layout.annotations, "fraction:").items():
        d[f"annotations[{i}].text"] = f"{swatch(REGION_COLORS[r])} {labels[r]} <b>{percent(fractions[r])}</b>"
    if updates is None:
        apply_layout(fig, d)


def set_counts(fig, counts) -> None:
    """Replace the bar heights of a histogram figure with ``counts`` (NBINS,) (in place)."""
    c = summed_counts(counts).astype(np.float64)     # float64 travels to the browser as a binary buffer
    names = {t.name: t for t in fig.data}
    names["zero"].y = [c[H.ZERO]]
    names["binades"].y = c[_COLS]
    names["nonfinite"].y = [c[H.ABOVE], c[H.NAN]]
