"""Why the optimizer updates fp32 weights: the update explorer and the training comparison, drawn.

:func:`update_figure` and :class:`UpdateExplorer` show one optimizer update ``w + update`` stored in
a format: the grid of representable values around ``w`` (top) and, for this ``w``, how much of any
update size really arrives (bottom). :func:`training_figure` draws lesson 07's two runs (fp32 master
weights against pure fp16 weights) side by side. The arithmetic is :func:`ampviz.lessons.rounding.add_in`::

    from ampviz.lessons.master_weights import UpdateExplorer
    UpdateExplorer(weight=1.0, update=4e-4, format="fp16")      # lost: 4e-4 < half an fp16 ulp of 1.0

Used by lessons 07 (master weights).
"""

from __future__ import annotations

import math

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..formats import get_format
from ..plots.style import OKABE_ITO, REGION_COLORS, base_layout
from ..widgets.parts import figure_widget, table_html
from .rounding import Addition, add_in, neighbours

__all__ = ["applied_share", "update_figure", "set_update", "UPDATE_RANGE", "TRACES", "UpdateExplorer",
           "FORMAT_CHOICES", "training_figure"]

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


def _view(r: Addition) -> tuple[float, float]:
    """x range in ulps of w: w, the exact sum and the stored value, with a margin that keeps the markers
    inside the plot at any span (a few ulps, or 8% of a wide view)."""
    offsets = [0.0, (r.exact - r.w) / r.ulp, (r.stored - r.w) / r.ulp]
    lo, hi = min(offsets), max(offsets)
    pad = max(1.5, 0.08 * (hi - lo))
    return min(lo - pad, -2.5), max(hi + pad, 3.5)


def _grid(r: Addition, fmt, lo: float, hi: float):
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
    fig.add_scatter(name="stored (green: moved, orange-red: lost)", mode="markers",
                    marker=dict(size=18, symbol="circle-open", line=dict(width=3)),
                    showlegend=True, legendrank=3, hovertemplate="stored = %{customdata}<extra></extra>",
                    row=1, col=1)
    xs = np.linspace(*UPDATE_RANGE, 321)
    fig.add_scatter(name="share", x=xs, mode="lines", showlegend=False, line=dict(color=OKABE_ITO["blue"], width=2),
                    hovertemplate="update 1e%{x:.2f}: %{y:.2f} applied<extra></extra>", row=2, col=1)
    fig.add_scatter(name="share now", mode="markers", showlegend=False, marker=dict(size=12, color="#222222"),
                    cliponaxis=False,                  # whole at either end of the update range
                    hovertemplate="this update: %{y:.3f} applied<extra></extra>", row=2, col=1)
    fig.add_shape(name="lost zone", type="rect", xref="x", yref="y domain", y0=0, y1=1, x0=-0.5, x1=0.5,
                  fillcolor=_LOST, opacity=0.14, line_width=0, layer="below")
    fig.add_shape(name="dense grid", type="rect", xref="x", yref="y", y0=-0.3, y1=0.3, x0=0, x1=0,
                  fillcolor="#444444", opacity=0.12, line_width=0, layer="below", visible=False)
    fig.add_shape(name="half ulp", type="line", xref="x2", yref="y2 domain", y0=0, y1=1, x0=0, x1=0,
                  line=dict(color=_LOST, dash="dash", width=1.5))
    fig.add_annotation(name="verdict", xref="paper", yref="paper", x=0.0, y=1.07, xanchor="left",
                       yanchor="bottom", showarrow=False, text="", font=dict(size=13))
    fig.add_annotation(name="grid note", xref="x domain", yref="y", x=0.5, y=-0.62, showarrow=False, text="",
                       font=dict(size=12, color="#555555"))
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
    fig.update_yaxes(title_text="applied / requested", range=[-0.1, 2.1], row=2, col=1)  # the dot at 0 stays whole
    set_update(fig, w, update, fmt)
    return fig


def set_update(fig, w, update, format, share=None) -> None:
    """Redraw a figure from :func:`update_figure` for new ``w``, ``update``, ``format`` (in place).

    ``share`` may pass a precomputed :func:`applied_share` curve for this ``w`` and format. When the
    view spans more than a few dozen ulps, the grid is drawn as a band with a note (one tick per ulp
    would be a solid bar).
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
    dense = grid_x.size == 0
    for s in fig.layout.shapes:
        if s.name == "half ulp":
            s.x0 = s.x1 = min(max(half, UPDATE_RANGE[0]), UPDATE_RANGE[1])
        elif s.name == "lost zone":
            s.x0, s.x1 = -below, 0.5
        elif s.name == "dense grid":
            s.visible, s.x0, s.x1 = dense, lo, hi
    fig.layout.xaxis.range = [lo, hi]
    verdict = (f"<b style='color:{_LOST}'>lost</b> (rounds back to w)" if r.lost else
               f"<b style='color:{_KEPT}'>applied</b> as {r.moved_ulps:g} ulp (asked {(r.exact - r.w) / r.ulp:.3g})")
    note = (f"one representable value every ulp: about {int(hi - lo):,} in view, too dense to draw one by one; "
            f"the stored value is the one nearest the exact sum" if dense else "")
    for a in fig.layout.annotations:
        if a.name == "verdict":
            a.text = f"{fmt.name}: w = {r.w:.6g}, half ulp = {r.ulp / 2:.3g}; update {r.requested:.3g} → {verdict}"
        elif a.name == "grid note":
            a.text = note


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
                 f"applied, error {100 * r.relative_error:+.3g}% of the request")]
        return table_html(rows, title=f"w + update in {r.format}")


# ---------------------------------------------------------------------------- lesson 07's two training runs
_RUN_COLORS = (OKABE_ITO["blue"], OKABE_ITO["vermillion"], OKABE_ITO["orange"], OKABE_ITO["bluish_green"])


def training_figure(runs: dict, window: int = 50, title: str = "Two training runs") -> go.Figure:
    """Training loss and lost-update share (means of ``window`` steps) and test accuracy, one line per run.

    Parameters
    ----------
    runs : ``{name: {"loss": (steps,), "lost": (steps,), "acc_step": (k,), "acc": (k,)}}``.
    window : steps per moving mean.
    """
    if not runs:
        raise ValueError("runs: expected at least one run")
    fig = make_subplots(rows=1, cols=3, subplot_titles=(f"training loss (mean of {window} steps)", "test accuracy",
                                                        f"updates lost (mean of {window} steps)"))
    kernel = np.ones(window) / window
    for (name, r), color in zip(runs.items(), _RUN_COLORS):
        for key, col in (("loss", 1), ("lost", 3)):
            y = np.convolve(np.asarray(r[key], dtype=float), kernel, mode="valid")
            fig.add_scatter(x=np.arange(window, window + y.size), y=y, name=name, line_color=color,
                            showlegend=col == 1, row=1, col=col)
        fig.add_scatter(x=r["acc_step"], y=r["acc"], name=name, line_color=color, showlegend=False,
                        mode="lines+markers", row=1, col=2)
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    fig.update_yaxes(tickformat=".0%", range=[-0.02, 1.02], row=1, col=3)
    fig.update_xaxes(title_text="step")
    fig.update_layout(**base_layout(title, height=400, showlegend=True, margin=dict(l=60, r=20, t=90, b=90),
                                    legend=dict(orientation="h", y=-0.3)))
    return fig
