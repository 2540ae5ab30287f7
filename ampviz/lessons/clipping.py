"""Gradient clipping under a loss scale: what ``clip_grad_norm_`` does before and after ``unscale_``.

With a ``GradScaler`` the gradients in ``.grad`` after ``backward()`` are multiplied by the loss
scale ``S``. Clipping them there compares ``S * ||g||`` with ``max_norm``, so the clip fires far too
early and, once ``scaler.step`` divides by ``S``, the optimizer receives a gradient of norm
``max_norm / S``. Calling ``scaler.unscale_(optimizer)`` first makes the clip act on the true
gradient. :func:`clipped_norm` replays both orders on real gradients with the real
``torch.nn.utils.clip_grad_norm_``::

    >>> import torch
    >>> from ampviz.lessons.clipping import clipped_norm
    >>> g = [torch.full((4,), 0.5)]                          # true norm 1.0
    >>> round(clipped_norm(g, max_norm=0.5, log2_scale=16, order="unscale first"), 6)
    0.5
    >>> clipped_norm(g, max_norm=0.5, log2_scale=16, order="clip first") * 2**16     # 0.5 / 2**16
    0.5

(``clip_grad_norm_`` divides by ``norm + 1e-6``, so a clipped norm is a hair below ``max_norm``.)

The figure (``clipping_figure``) and ``ClipOrderExplorer`` (max_norm and loss-scale sliders over
both orders) follow the computation.

Used by lessons 09 (clipping and accumulation).
"""

from __future__ import annotations

import math

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
import torch

from .._args import check_int
from ..plots.style import OKABE_ITO, base_layout, percent, title_text
from ..widgets.parts import figure_widget, pow2_label, table_html

__all__ = ["ORDERS", "clipped_norm", "clipped_norms", "total_norm", "clipping_figure", "set_clipping", "MAX_NORMS",
           "TRACES", "ORDER_COLORS", "ClipOrderExplorer"]


ORDERS = ("unscale first", "clip first")


def total_norm(grads) -> float:
    """The L2 norm of all gradients together (what ``clip_grad_norm_`` computes)."""
    grads = _check_grads(grads)
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def clipped_norm(grads, max_norm: float, log2_scale: int, order: str) -> float:
    """Norm, in true (unscaled) units, of the gradient the optimizer steps with after clipping.

    Parameters
    ----------
    grads : the true gradients (a tensor or a list of tensors), e.g. read after ``unscale_``.
    max_norm : ``clip_grad_norm_``'s threshold.
    log2_scale : the loss scale is ``2**log2_scale`` (as GradScaler's default scales are).
    order : "unscale first" (``scaler.unscale_`` then clip: right) or "clip first" (clip the scaled
        gradients, let ``scaler.step`` unscale them afterwards: wrong).
    """
    grads = _check_grads(grads)
    if not (isinstance(max_norm, (int, float)) and max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"max_norm: expected a positive finite number, got {max_norm!r}")
    check_int("log2_scale", log2_scale, -60, 60)
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    scale = 2.0 ** log2_scale
    holders = []
    for g in grads:                          # stand-in parameters whose .grad is as backward left it
        p = torch.zeros_like(g, dtype=torch.float32, requires_grad=True)
        p.grad = g.detach().float() * scale
        holders.append(p)
    if order == "unscale first":
        for p in holders:
            p.grad.mul_(1.0 / scale)         # what scaler.unscale_ does
        torch.nn.utils.clip_grad_norm_(holders, max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(holders, max_norm)
        for p in holders:
            p.grad.mul_(1.0 / scale)         # what scaler.step does when unscale_ was not called
    return total_norm([p.grad for p in holders])


def clipped_norms(grads, max_norms, log2_scale: int) -> dict:
    """:func:`clipped_norm` for every ``max_norm`` and both orders: ``{order: [norm, ...]}``."""
    return {order: [clipped_norm(grads, float(m), log2_scale, order) for m in max_norms] for order in ORDERS}


def _check_grads(grads) -> list:
    if isinstance(grads, torch.Tensor):
        grads = [grads]
    grads = [g for g in grads if g is not None]
    if not grads or not all(isinstance(g, torch.Tensor) and g.is_floating_point() for g in grads):
        raise TypeError("grads: expected a floating-point tensor or a non-empty list of them")
    return grads


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
    lo, hi = math.log10(low), math.log10(max(norm, max_norm))
    pad = max(0.5, 0.1 * (hi - lo))                      # a tenth of the view: no line hugs an edge
    fig.layout.yaxis.range = [lo - pad, hi + pad]
    ratio = now["clip first"] / now["unscale first"]
    subtitle = (f"loss scale 2<sup>{log2_scale}</sup> · max_norm {max_norm:.3g}: the wrong "
                f"order keeps {percent(ratio)} of the step the right order takes")
    # the subtitle is the title text's second line (see plots._style.title_text): keep the first
    fig.layout.title.text = title_text((fig.layout.title.text or "").partition("<br>")[0], subtitle)
    return now


class ClipOrderExplorer(W.VBox):
    """Sliders for ``max_norm`` (log scale) and the loss scale (log2); both orders drawn and read out.

    Parameters
    ----------
    grads : the true gradients (a tensor or a list of tensors).
    max_norm : initial clipping threshold (1e-6 .. 100).
    log2_scale : initial loss scale exponent (0 .. 24).

    Attributes
    ----------
    norm_slider (FloatLogSlider), scale_slider (IntSlider), readout (HTML), figure (FigureWidget),
    norms (dict order -> the applied norm now), true_norm.
    """

    def __init__(self, grads, max_norm: float = 1.0, log2_scale: int = 16):
        self.grads = [g.detach().float().clone() for g in ([grads] if hasattr(grads, "dim") else grads)]
        self.true_norm = total_norm(self.grads)
        if not 1e-6 <= max_norm <= 100:
            raise ValueError(f"max_norm: expected a value in [1e-6, 100], got {max_norm!r}")
        check_int("log2_scale", log2_scale, 0, 24)
        self._curves: dict = {}
        self.norm_slider = W.FloatLogSlider(value=max_norm, base=10, min=-6, max=2, step=0.05,
                                            description="max_norm", readout_format=".3g")
        self.scale_slider = W.IntSlider(value=log2_scale, min=0, max=24, description="log2 scale")
        self.scale_label = W.Label(pow2_label(log2_scale))
        self.readout = W.HTML()
        fig = clipping_figure(self.grads, max_norm, log2_scale, curves=self._curve(log2_scale))
        self.figure = figure_widget(fig)
        self.norms = {order: clipped_norms(self.grads, [max_norm], log2_scale)[order][0] for order in ORDERS}
        self.readout.value = self._readout_html()
        self.norm_slider.observe(self._on_change, "value")
        self.scale_slider.observe(self._on_change, "value")
        super().__init__([W.HBox([self.norm_slider, self.scale_slider, self.scale_label]), self.readout,
                          self.figure])

    def _curve(self, log2_scale: int) -> dict:
        if log2_scale not in self._curves:
            self._curves[log2_scale] = clipped_norms(self.grads, MAX_NORMS, log2_scale)
        return self._curves[log2_scale]

    def _on_change(self, change=None) -> None:
        m, s = self.norm_slider.value, self.scale_slider.value
        with self.figure.batch_update():
            self.norms = set_clipping(self.figure, self.grads, m, s, curves=self._curve(s))
        self.scale_label.value = pow2_label(s)
        self.readout.value = self._readout_html()

    def _readout_html(self) -> str:
        right, wrong = self.norms["unscale first"], self.norms["clip first"]
        rows = [("true gradient norm ‖g‖", f"{self.true_norm:.4g}"),
                ("scaled norm the clip sees if called first", f"{self.true_norm * 2.0 ** self.scale_slider.value:.4g}"),
                ("step norm, unscale_ then clip (right)", f"{right:.4g}"),
                ("step norm, clip then step unscales (wrong)", f"{wrong:.4g}"),
                ("wrong / right", f"{wrong / right:.3g}")]
        return table_html(rows, title=f"clip_grad_norm_(max_norm={self.norm_slider.value:.3g}) at loss scale "
                                      f"2^{self.scale_slider.value}")
