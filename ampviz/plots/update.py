"""One weight update done in a low-precision format: the grid around ``w``, and which updates survive.

Top panel: the representable values around ``w`` (in units of ulp(w), so every format looks
alike), the zone of ±half an ulp that rounds back to ``w``, the exact ``w + update`` and the
value the format stores. Bottom panel: for this ``w`` and every update size on a log axis, the
share of the requested update that is really applied (0 = lost, 1 = exact); the staircase is
the format's grid seen from ``w``::

    from ampviz.plots.update import update_figure
    update_figure(1.0, 4e-4, "fp16")          # below half an ulp (2**-11): the update is lost
"""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..formats import get_format
from ..rounding import add_in, neighbours
from ._style import OKABE_ITO, REGION_COLORS, base_layout

__all__ = ["update_figure", "set_update", "applied_share", "UPDATE_RANGE", "TRACES"]

UPDATE_RANGE = (-8.0, 0.0)            # log10 of the update sizes on the bottom panel
_GRID_MAX = 40                        # draw grid points when the view spans at most this many ulps
# trace order of every update figure (legend names differ, so look traces up by index)
TRACES = {n: i for i, n in enumerate(("grid", "w", "requested", "stored", "share", "share now"))}
_LOST = REGION_COLORS["flushed"]
_KEPT = OKABE_ITO["bluish_green"]


def applied_share(w, format, log10_updates) -> np.ndarray:
    """``(stored - w) / update`` for each update ``10**u``: 0 where lost, 1 where applied exactly."""
    out = []
    for u in np.asarray(log10_updates, dtype=float):
        r = add_in(w, 10.0 ** u, format)
        out.append(r.applied / r.requested)
    return np.array(out)


def _view(r) -> tuple[float, float]:
    """x range in ulps of w: w, the exact sum and the stored value with a margin."""
    offsets = [0.0, (r.exact - r.w) / r.ulp, (r.stored - r.w) / r.ulp]
    hi = max(max(offsets) + 1.5, 3.5)
    return -2.5, hi


def _grid(r, fmt, lo: float, hi: float):
    """Offsets (in ulps of w) of representable values inside [lo, hi], when there are few enough."""
    if hi - lo > _GRID_MAX:
        return np.array([]), np.array([])
    need = int(math.ceil(max(abs(lo), hi))) + 2
    values = neighbours(r.w, fmt, n=min(need, 64))
    offsets = (values - r.w) / r.ulp
    keep = (offsets >= lo) & (offsets <= hi)
    return offsets[keep], values[keep]


def update_figure(w, update, format="fp16", title: str | None = None) -> go.Figure:
    """The addition ``w + update`` in ``format`` (top) and the applied share of any update (bottom).

    Parameters
    ----------
    w : the weight (any non-zero finite number; rounded to the format).
    update : the requested change ``-lr * grad`` as a positive number.
    format : "fp16", "bf16", "fp32", "fp8_e4m3fn", ... (name, dtype or Format).
    """
    fmt = get_format(format)
    _check(w, update)
    fig = make_subplots(rows=2, cols=1, row_heights=[0.42, 0.58], vertical_spacing=0.2)
    fig.add_scatter(name="grid", mode="markers", showlegend=False, marker=dict(symbol="line-ns", size=22,
                    line=dict(width=2, color="#444444")), hovertemplate="%{customdata}<extra>representable</extra>",
                    row=1, col=1)
    fig.add_scatter(name="w", mode="markers", marker=dict(size=13, color=OKABE_ITO["blue"]), showlegend=True,
                    legendrank=1, legendgroup="a", hovertemplate="w = %{customdata}<extra></extra>", row=1, col=1)
    fig.add_scatter(name="exact w + update", mode="markers", marker=dict(size=13, symbol="x", color="#222222"),
                    showlegend=True, legendrank=2,
                    hovertemplate="exact w + update = %{customdata}<extra></extra>", row=1, col=1)
    fig.add_scatter(name="stored (green: moved, red: lost)", mode="markers",
                    marker=dict(size=18, symbol="circle-open", line=dict(width=3)),
                    showlegend=True, legendrank=3, hovertemplate="stored = %{customdata}<extra></extra>",
                    row=1, col=1)
    xs = np.linspace(*UPDATE_RANGE, 321)
    fig.add_scatter(name="share", x=xs, mode="lines", showlegend=False, line=dict(color=OKABE_ITO["blue"], width=2),
                    hovertemplate="update 1e%{x:.2f}: %{y:.2f} applied<extra></extra>", row=2, col=1)
    fig.add_scatter(name="share now", mode="markers", showlegend=False, marker=dict(size=12, color="#222222"),
                    hovertemplate="this update: %{y:.3f} applied<extra></extra>", row=2, col=1)
    fig.add_shape(name="lost zone", type="rect", xref="x", yref="y domain", y0=0, y1=1, x0=-0.5, x1=0.5,
                  fillcolor=_LOST, opacity=0.14, line_width=0, layer="below")
    fig.add_shape(name="half ulp", type="line", xref="x2", yref="y2 domain", y0=0, y1=1, x0=0, x1=0,
                  line=dict(color=_LOST, dash="dash", width=1.5))
    fig.add_annotation(name="verdict", xref="paper", yref="paper", x=0.0, y=1.07, xanchor="left",
                       yanchor="bottom", showarrow=False, text="", font=dict(size=13))
    fig.update_layout(**base_layout(title or "One optimizer update, stored in a low-precision format",
                                    "top: the grid around w (shaded: rounds back to w) · "
                                    "bottom: share of each update size that is really applied",
                                    height=600, margin=dict(l=80, r=30, t=150, b=70), showlegend=True,
                                    inline_subtitle=True,
                                    legend=dict(orientation="h", x=0.0, xanchor="left", y=1.0, yanchor="bottom")))
    fig.update_yaxes(visible=False, range=[-1, 1], row=1, col=1)
    fig.update_xaxes(title_text="offset from w, in ulps of w", zeroline=False, row=1, col=1)
    ticks = list(range(int(UPDATE_RANGE[0]), int(UPDATE_RANGE[1]) + 1))
    fig.update_xaxes(title_text="requested update (log10 scale)", tickvals=ticks,
                     ticktext=[f"1e{t}" for t in ticks], range=list(UPDATE_RANGE), row=2, col=1)
    fig.update_yaxes(title_text="applied / requested", range=[-0.05, 2.05], row=2, col=1)
    set_update(fig, w, update, fmt)
    return fig


def set_update(fig, w, update, format, share=None) -> None:
    """Redraw a figure from :func:`update_figure` for new ``w``, ``update``, ``format`` (in place).

    ``share`` may pass a precomputed :func:`applied_share` curve for this ``w`` and format.
    """
    fmt = get_format(format)
    _check(w, update)
    r = add_in(w, update, fmt)
    lo, hi = _view(r)
    grid_x, grid_v = _grid(r, fmt, lo, hi)
    tr = {name: fig.data[i] for name, i in TRACES.items()}
    tr["grid"].update(x=grid_x, y=np.zeros(grid_x.size), customdata=[repr(float(v)) for v in grid_v])
    tr["w"].update(x=[0.0], y=[0.0], customdata=[repr(r.w)])
    tr["requested"].update(x=[(r.exact - r.w) / r.ulp], y=[0.0], customdata=[repr(r.exact)])
    color = _LOST if r.lost else _KEPT
    tr["stored"].update(x=[(r.stored - r.w) / r.ulp], y=[0.0], customdata=[repr(r.stored)], marker_color=color)
    if share is None:
        share = applied_share(r.w, fmt, tr["share"].x)
    tr["share"].update(y=share)
    tr["share now"].update(x=[math.log10(update)], y=[r.applied / r.requested])
    half = math.log10(r.ulp / 2)
    below = (r.w - fmt.next_down(r.w)) / r.ulp / 2       # a quarter ulp when w is a power of two
    for s in fig.layout.shapes:
        if s.name == "half ulp":
            s.x0 = s.x1 = min(max(half, UPDATE_RANGE[0]), UPDATE_RANGE[1])
        elif s.name == "lost zone":
            s.x0, s.x1 = -below, 0.5
    fig.layout.xaxis.range = [lo, hi]
    verdict = (f"<b style='color:{_LOST}'>lost</b> (rounds back to w)" if r.lost else
               f"<b style='color:{_KEPT}'>applied</b> as {r.moved_ulps:g} ulp (asked {(r.exact - r.w) / r.ulp:.3g})")
    for a in fig.layout.annotations:
        if a.name == "verdict":
            a.text = f"{fmt.name}: w = {r.w:.6g}, half ulp = {r.ulp / 2:.3g}; update {r.requested:.3g} → {verdict}"


def _check(w, update) -> None:
    for name, v in (("w", w), ("update", update)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not math.isfinite(v):
            raise ValueError(f"{name}: expected a finite number, got {v!r}")
    if w == 0:
        raise ValueError("w: expected a non-zero weight (the grid is drawn in ulps of |w|), got 0")
    if not update > 0:
        raise ValueError(f"update: expected a positive update size, got {update!r}")
