"""Clipping before and after unscaling: the norm the optimizer really steps with, against max_norm.

    from ampviz.plots.clipping import clipping_figure
    clipping_figure(grads, max_norm=1.0, log2_scale=16)      # grads: the true (unscaled) gradients

Both axes are logarithmic. The right order ("unscale first") follows ``min(||g||, max_norm)``; the
wrong one ("clip first") gives ``min(||g||, max_norm / S)``: the same curve moved left by the loss
scale, so a threshold that should never fire cuts the step to almost nothing.
"""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go

from ..clipping import ORDERS, clipped_norms, total_norm
from ._style import OKABE_ITO, base_layout, percent, title_text

__all__ = ["clipping_figure", "set_clipping", "MAX_NORMS", "TRACES", "ORDER_COLORS"]

MAX_NORMS = np.logspace(-6, 2, 49)              # the thresholds drawn as curves
ORDER_COLORS = {"unscale first": OKABE_ITO["bluish_green"], "clip first": OKABE_ITO["vermillion"]}
TRACES = {n: i for i, n in enumerate(("true norm", "unscale first", "clip first", "unscale first now",
                                          "clip first now"))}


def clipping_figure(grads, max_norm: float = 1.0, log2_scale: int = 16, curves: dict | None = None) -> go.Figure:
    """Applied gradient norm against ``max_norm`` for both orders, with the current threshold marked."""
    norm = total_norm(grads)
    fig = go.Figure()
    fig.add_scatter(name="true norm", x=[MAX_NORMS[0], MAX_NORMS[-1]], y=[norm, norm], mode="lines",
                    line=dict(color="#888888", dash="dot"), hovertemplate="‖g‖ = %{y:.4g}<extra></extra>")
    for order in ORDERS:
        fig.add_scatter(name=f"clip_grad_norm_ {'after' if order == 'unscale first' else 'before'} unscale_",
                        mode="lines", line=dict(color=ORDER_COLORS[order], width=2.5),
                        hovertemplate="max_norm %{x:.3g} → ‖step‖ %{y:.3g}<extra></extra>")
    for order in ORDERS:
        fig.add_scatter(name=f"{order} now", mode="markers", showlegend=False,
                        marker=dict(size=12, color=ORDER_COLORS[order], line=dict(color="white", width=1.5)))
    fig.add_shape(name="max_norm", type="line", xref="x", yref="paper", y0=0, y1=1, x0=max_norm, x1=max_norm,
                  line=dict(color="#222222", width=1, dash="dash"))
    fig.update_layout(**base_layout("The gradient the optimizer steps with, after clipping",
                                    "norm in true (unscaled) units; dashed: max_norm", height=420, showlegend=True,
                                    inline_subtitle=True,
                                    legend=dict(x=0.99, xanchor="right", y=0.02, yanchor="bottom")))
    fig.update_xaxes(type="log", title_text="max_norm", exponentformat="power")
    fig.update_yaxes(type="log", title_text="‖gradient‖ used by the step", exponentformat="power")
    set_clipping(fig, grads, max_norm, log2_scale, curves)
    return fig


def set_clipping(fig, grads, max_norm: float, log2_scale: int, curves: dict | None = None) -> dict:
    """Redraw for a new ``max_norm`` and loss scale (in place); returns ``{order: norm now}``.

    ``curves`` may pass precomputed ``clipped_norms(grads, MAX_NORMS, log2_scale)``.
    """
    curves = curves if curves is not None else clipped_norms(grads, MAX_NORMS, log2_scale)
    now = {order: clipped_norms(grads, [max_norm], log2_scale)[order][0] for order in ORDERS}
    for order in ORDERS:
        fig.data[TRACES[order]].update(x=MAX_NORMS, y=curves[order])
        fig.data[TRACES[f"{order} now"]].update(x=[max_norm], y=[now[order]])
    for s in fig.layout.shapes:
        if s.name == "max_norm":
            s.x0 = s.x1 = max_norm
    low = min(min(v) for v in curves.values())
    norm = fig.data[TRACES["true norm"]].y[0]
    fig.layout.yaxis.range = [math.log10(low) - 0.5, math.log10(max(norm, max_norm)) + 0.5]
    ratio = now["clip first"] / now["unscale first"]
    subtitle = (f"loss scale 2<sup>{log2_scale}</sup> · max_norm {max_norm:.3g}: the wrong "
                f"order keeps {percent(ratio)} of the step the right order takes")
    # the subtitle is the title text's second line (see plots._style.title_text): keep the first
    fig.layout.title.text = title_text((fig.layout.title.text or "").partition("<br>")[0], subtitle)
    return now
