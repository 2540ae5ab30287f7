"""What rounding does to a weight update and to a running sum held in a low-precision format.

An optimizer step computes ``w + update``; when ``w`` is stored in fp16 or bf16 the exact sum is
rounded back to the format, and an update no larger than half the spacing (ulp) around ``w`` is
rounded away: the weight does not move. A long running sum kept in the format stalls the same
way once the sum is large enough. Every result here is a single round-to-nearest-even of the
exact sum (what ``torch`` does for one fp16/bf16 addition), computed with
:meth:`ampviz.formats.Format.round`::

    >>> from ampviz.lessons.rounding import add_in
    >>> r = add_in(1.0, 4e-4, "fp16")        # half an fp16 ulp at 1.0 is 2**-11 ~ 4.9e-4
    >>> r.stored, r.lost
    (1.0, True)
    >>> add_in(1.0, 4e-4, "fp32").lost
    False
    >>> from ampviz.lessons.rounding import running_sum
    >>> float(running_sum([0.01] * 1000, "bf16")[-1])  # stalls at 4 (exact sum ~ 10)
    4.0

The figure (``update_figure``) and ``UpdateExplorer`` (a weight, an update, a format: is the update
applied?) follow the computation.

Used by lessons 07 (master weights) and 08 (bf16 and fp8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .._args import check_int
from ..formats import _as_float, get_format
from ..plots.style import OKABE_ITO, REGION_COLORS, base_layout
from ..widgets.parts import figure_widget, table_html

__all__ = ["Addition", "add_in", "neighbours", "lost_fraction", "running_sum", "stall_value", "update_figure",
           "set_update", "applied_share", "UPDATE_RANGE", "TRACES", "UpdateExplorer", "FORMAT_CHOICES"]


@dataclass(frozen=True)
class Addition:
    """One addition ``w + update`` done in a format (both operands rounded to it first).

    ``requested`` is the update as asked for, ``w`` and ``update`` the operands after rounding to
    the format, ``exact`` their exact sum, ``stored`` the sum rounded to the format, ``ulp`` the
    spacing above ``|w|``; ``applied`` is the change the weight really sees (``stored - w``) and
    ``moved_ulps`` that change in units of ``ulp``.
    """

    format: str
    requested: float
    w: float
    update: float
    exact: float
    stored: float
    ulp: float

    @property
    def applied(self) -> float:
        return self.stored - self.w

    @property
    def lost(self) -> bool:
        """The weight did not move although the requested update was not zero."""
        return self.stored == self.w and self.update != 0.0

    @property
    def update_underflowed(self) -> bool:
        """The update itself rounded to zero in the format (before any addition)."""
        return self.update == 0.0

    @property
    def moved_ulps(self) -> float:
        return self.applied / self.ulp if self.ulp else math.nan

    @property
    def relative_error(self) -> float:
        """(applied - requested) / requested: -1 when the update is lost, 0 when applied exactly."""
        return (self.applied - self.requested) / self.requested if self.requested else math.nan


def add_in(w, update, format) -> Addition:
    """``w + update`` computed in ``format``: round both operands, add exactly, round once.

    Parameters
    ----------
    w, update : numbers (Python, numpy or one-element tensors).
    format : a format name ("fp16", "bf16", "fp32", ...), torch dtype or Format.

    Returns
    -------
    Addition
    """
    fmt = get_format(format)
    w_in, u_in = _as_float(w, "w"), _as_float(update, "update")
    if not (math.isfinite(w_in) and math.isfinite(u_in)):
        raise ValueError(f"w, update: expected finite numbers, got w={w_in!r}, update={u_in!r}")
    w_r, u_r = fmt.round(w_in), fmt.round(u_in)
    exact = w_r + u_r                     # exact in float64: both have at most 24 significant bits
    return Addition(fmt.name, u_in, w_r, u_r, exact, fmt.round(exact), fmt.ulp(w_r))


def neighbours(w, format, n: int = 4) -> np.ndarray:
    """The ``2n + 1`` representable values centred on ``w`` rounded to ``format`` (ascending)."""
    fmt = get_format(format)
    check_int("n", n, 1, 64)
    centre = fmt.round(_as_float(w, "w"))
    if not math.isfinite(centre):
        raise ValueError(f"w: {w!r} is not finite in {fmt.name}")
    below, above, v = [], [], centre
    for _ in range(n):
        v = fmt.next_down(v)
        below.append(v)
    v = centre
    for _ in range(n):
        v = fmt.next_up(v)
        above.append(v)
    return np.array(below[::-1] + [centre] + above)


def lost_fraction(before, after, grads) -> float:
    """Share of the elements with a non-zero gradient whose value did not change in a step.

    Parameters
    ----------
    before, after : sequences of tensors (parameters before and after ``optimizer.step()``).
    grads : the gradients the step used, same shapes.
    """
    before, after, grads = list(before), list(after), list(grads)
    if not (len(before) == len(after) == len(grads)) or not before:
        raise ValueError(f"before, after, grads: expected equally long non-empty sequences, got lengths "
                         f"{len(before)}, {len(after)}, {len(grads)}")
    moved_to_check, unchanged = 0, 0
    for i, (b, a, g) in enumerate(zip(before, after, grads)):
        if not (b.shape == a.shape == g.shape):
            raise ValueError(f"tensor {i}: shapes differ: before {tuple(b.shape)}, after {tuple(a.shape)}, "
                             f"grad {tuple(g.shape)}")
        asked = g != 0
        moved_to_check += int(asked.sum())           # note: a host sync per tensor (lesson use only)
        unchanged += int((asked & (a == b)).sum())
    return unchanged / moved_to_check if moved_to_check else 0.0


def running_sum(increments, format, start: float = 0.0) -> np.ndarray:
    """Partial sums ``s_k = round(s_{k-1} + round(x_k))``, every one rounded to ``format``.

    This is a running total kept in the format, as a low-precision accumulator or a weight
    receiving one update per step. (``torch.sum`` of a bf16 tensor is *not* this: it accumulates
    in float32 internally and rounds only the result.)
    """
    fmt = get_format(format)
    if isinstance(increments, torch.Tensor):
        increments = increments.detach().double().cpu().numpy()
    x = np.asarray(increments, dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("increments: expected at least one value")
    if not np.all(np.isfinite(x)):
        raise ValueError("increments: expected finite values")
    unique, inverse = np.unique(x, return_inverse=True)
    rounded = np.array([fmt.round(float(v)) for v in unique])[inverse]      # each increment, in the format
    out = np.empty(x.size)
    s = fmt.round(_as_float(start, "start"))
    for k, v in enumerate(rounded.tolist()):
        s = fmt.round(s + v)
        out[k] = s
    return out


def stall_value(increment, format) -> float:
    """The running sum at which adding ``increment`` (> 0) no longer changes it, in ``format``.

    Found by walking the representable values upward from 0 the way a running sum does, one
    binade at a time (so fp32 is as quick as fp16).
    """
    fmt = get_format(format)
    inc = fmt.round(_as_float(increment, "increment"))
    if not inc > 0 or not math.isfinite(inc):
        raise ValueError(f"increment: expected a positive number representable in {fmt.name} "
                         f"(it rounds to {inc!r})")
    s = 0.0
    while True:
        nxt = fmt.round(s + inc)
        if nxt == s or math.isinf(nxt):
            return s
        step, step_after = nxt - s, fmt.round(nxt + inc) - nxt
        if step == step_after:           # constant from here to the end of the binade: jump there
            top = math.ldexp(1.0, math.frexp(nxt)[1])
            nxt += max(int((top - nxt) // step) - 1, 0) * step
        s = nxt


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


FORMAT_CHOICES = ("fp16", "bf16", "fp32", "fp8_e4m3fn", "fp8_e5m2")


class UpdateExplorer(W.VBox):
    """Sliders for the weight and the update size, a format dropdown, the grid around the weight.

    Parameters
    ----------
    weight : initial weight value (positive; the slider moves it by powers of two, 2**-12 .. 2**12).
    update : initial update size ``lr * |grad|`` (the slider spans 1e-8 .. 1).
    format : initial format, one of ``FORMAT_CHOICES``.

    Attributes
    ----------
    weight_slider (FloatLogSlider, base 2), update_slider (FloatLogSlider, base 10),
    format_dropdown, readout (HTML), figure (FigureWidget), result (the current
    :class:`ampviz.lessons.rounding.Addition`).
    """

    def __init__(self, weight: float = 1.0, update: float = 4e-4, format="fp16"):
        fmt = get_format(format)
        if fmt.name not in FORMAT_CHOICES:
            raise ValueError(f"format: expected one of {FORMAT_CHOICES}, got {fmt.name!r}")
        if not 2.0 ** -12 <= weight <= 2.0 ** 12:
            raise ValueError(f"weight: expected a value in [2**-12, 2**12], got {weight!r}")
        if not 10.0 ** UPDATE_RANGE[0] <= update <= 10.0 ** UPDATE_RANGE[1]:
            raise ValueError(f"update: expected a value in [1e-8, 1], got {update!r}")
        self._shares: dict = {}
        self.weight_slider = W.FloatLogSlider(value=weight, base=2, min=-12, max=12, step=0.125,
                                              description="weight w", readout_format=".4g",
                                              style={"description_width": "initial"})
        self.update_slider = W.FloatLogSlider(value=update, base=10, min=UPDATE_RANGE[0], max=UPDATE_RANGE[1],
                                              step=0.05, description="update lr·|g|", readout_format=".3g",
                                              style={"description_width": "initial"})
        self.format_dropdown = W.Dropdown(options=list(FORMAT_CHOICES), value=fmt.name, description="weights in")
        self.readout = W.HTML()
        self.result: Addition = add_in(weight, update, fmt)
        fig = update_figure(weight, update, fmt)
        self._shares[(self.result.w, fmt.name)] = fig.data[TRACES["share"]].y
        self.figure = figure_widget(fig)
        self.readout.value = self._readout_html()
        for control in (self.weight_slider, self.update_slider, self.format_dropdown):
            control.observe(self._on_change, "value")
        super().__init__([W.HBox([self.format_dropdown, self.weight_slider, self.update_slider]),
                          self.readout, self.figure])

    @property
    def format(self):
        return get_format(self.format_dropdown.value)

    def _share(self, w: float, fmt):
        key = (w, fmt.name)
        if key not in self._shares:
            self._shares[key] = applied_share(w, fmt, self.figure.data[TRACES["share"]].x)
        return self._shares[key]

    def _on_change(self, change=None) -> None:
        fmt, w, u = self.format, self.weight_slider.value, self.update_slider.value
        self.result = add_in(w, u, fmt)
        with self.figure.batch_update():
            set_update(self.figure, w, u, fmt, share=self._share(self.result.w, fmt))
        self.readout.value = self._readout_html()

    def _readout_html(self) -> str:
        r = self.result
        rows = [("w (in the format)", repr(r.w)), ("ulp(w)", f"{r.ulp:.6g}"),
                ("half ulp: updates up to this are lost", f"{r.ulp / 2:.6g}"),
                ("requested update", f"{r.requested:.6g}"), ("update in the format", repr(r.update)),
                ("stored w + update", repr(r.stored)), ("applied change", f"{r.applied:.6g}"),
                ("verdict", "<b>lost</b> (w did not move)" if r.lost else
                 f"applied, error {100 * r.relative_error:+.1f}% of the request")]
        return table_html(rows, title=f"w + update in {r.format}")
