"""UpdateExplorer: is ``w + lr * grad`` stored, rounded or lost when the weight lives in fp16 / bf16?

    from ampviz.widgets.update import UpdateExplorer
    UpdateExplorer(1.0, 4e-4, "fp16")        # last expression of a cell: shows the widget

    w = UpdateExplorer(1.0, 4e-4, "fp16")
    w.result.lost                           # True: 4e-4 is below half an fp16 ulp at 1.0
    w.format_dropdown.value = "fp32"        # the same update on an fp32 (master) weight
    w.result.lost                           # False

Each change redoes the addition exactly (both operands rounded to the format, one rounding of
the sum, as a real fp16 / bf16 add does); the "applied share" curve for the current weight and
format is computed once per (weight, format) and cached.
"""

from __future__ import annotations

import ipywidgets as W

from ..formats import get_format
from ..plots.update import TRACES, UPDATE_RANGE, applied_share, set_update, update_figure
from ..rounding import Addition, add_in
from ._common import figure_widget, table_html

__all__ = ["UpdateExplorer", "FORMAT_CHOICES"]

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
    :class:`ampviz.rounding.Addition`).
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
