"""RunDashboard: browse a recorded run by step, tensor, kind and rank: heatmap, histogram, scale trace.

    from ampviz.widgets import RunDashboard
    RunDashboard(run)                          # last expression of a cell

    d = RunDashboard(run, "fp16")
    d.kind_buttons.value = "activation"
    d.tensor_dropdown.value = "0"              # one tensor (the options follow the kind)
    d.step_slider.value = 120                  # a recorded step
    d.fractions["flushed"]                     # share of that step's non-zero values flushed

Everything a control indexes is cached the first time it is needed: the selection's (steps,
bins) counts and its heatmap matrix, per rank and domain. Moving the step slider only picks a
row and rewrites one histogram, two cursors and the readout.

In the unscaled domain the format's limits follow the loss scale each step used; in the scaled
domain the values move instead and the limits stay put. Activation gradients were recorded as
computed (fp16, at the run's scale): what flushed during the run is already an exact zero.

The axes hold the recorded values and every format limit within ``REACH`` binades of them; a limit
farther away (bf16's flush and overflow edges, 2^-133 and 2^128, for a typical bf16 run) is named in
the readout instead of squeezing the values into a sliver. A run without a loss scaler (bf16, fp32)
has no loss-scale panel and one domain (scaled and unscaled values are the same).
"""

from __future__ import annotations

import ipywidgets as W
import numpy as np

from .. import histogram as H
from ..formats import get_format
from ..plots.heatmap import (
    heatmap_figure,
    heatmap_matrix,
    heatmap_rows,
    heatmap_z,
    set_cursor,
    set_heatmap,
    set_line_legend,
)
from ..plots.histogram import (
    check_domain,
    histogram_figure,
    histogram_x_range,
    region_edges,
    set_counts,
    set_fractions,
    set_regions,
    set_title,
    set_x_range,
)
from ..plots.scale_trace import scale_trace_figure, set_recorded
from ..plots.style import REGIONS, apply_layout, log2_ticks, pow2_text, retitle
from ..run import Run
from .parts import figure_widget, pow2_label, table_html

__all__ = ["RunDashboard", "ALL_TENSORS", "REACH"]

ALL_TENSORS = "all tensors"
REACH = 24          # binades: a format limit farther than this from the recorded values stays off the axes


class RunDashboard(W.VBox):
    """Step slider, tensor / kind / rank / domain selectors over a heatmap, a histogram and the scale trace.

    Parameters
    ----------
    run : an ``ampviz.Run``.
    format : format whose limits are drawn.
    domain : "unscaled" (limits follow the loss scale) or "scaled" (values follow it).
    step, tensor, kind, rank : initial selection (default: first recorded step, all tensors,
        all kinds, first rank).

    Attributes
    ----------
    step_slider, tensor_dropdown, kind_buttons, rank_dropdown, domain_buttons, readout (HTML);
    heatmap, histogram, trace (FigureWidgets; ``trace`` is None for a run without a loss scaler);
    counts (histogram shown), fractions (its shares).
    """

    def __init__(self, run, format="fp16", *, domain: str = "unscaled", step=None, tensor=None, kind=None,
                 rank=None):
        if not isinstance(run, Run):
            raise TypeError(f"run: expected an ampviz.Run, got {type(run).__name__}")
        if run.hist_steps.size == 0:
            raise ValueError("run: has no histogram steps (recorded with no steps, or every > steps)")
        self.run, self.format = run, get_format(format)
        self.has_scaler = bool(run.meta.get("scaler")) or not np.all(run.loss_scale == 1)
        self._cache: dict = {}
        self._build_controls(check_domain(domain), step, tensor, kind, rank)
        self._build_figures()
        self.readout = W.HTML(self._readout_html())
        for control in (self.kind_buttons, self.tensor_dropdown, self.rank_dropdown, self.domain_buttons):
            control.observe(self._on_selection, "value")
        self.step_slider.observe(self._on_step, "value")
        selectors = W.VBox([W.HBox([self.kind_buttons, self.domain_buttons]),
                            W.HBox([self.tensor_dropdown, self.rank_dropdown])])
        trace = [self.trace] if self.trace is not None else []
        super().__init__([selectors, self.step_slider, self.heatmap, self.histogram, self.readout] + trace)

    # ------------------------------------------------------------------ controls
    def _build_controls(self, domain, step, tensor, kind, rank) -> None:
        run = self.run
        kinds = sorted(set(run.tensor_kinds))
        if kind is not None and kind not in kinds:
            raise ValueError(f"kind: expected one of {kinds} or None, got {kind!r}")
        # each button as wide as its label ("weight_local" was cut at a fixed 96px); display flex puts the
        # description beside the buttons (ipywidgets 8 renders ToggleButtons as a block: label above)
        buttons = {"style": {"button_width": "auto", "description_width": "initial"},
                   "layout": W.Layout(width="auto", display="flex", align_items="center")}
        self.kind_buttons = W.ToggleButtons(options=["all"] + kinds, value=kind or "all", description="kind", **buttons)
        names = self._names_for(kind or "all")
        tensor = ALL_TENSORS if tensor is None else run.tensor_names[run.tensor_index(tensor)]
        if tensor not in names:
            raise ValueError(f"tensor: {tensor!r} is not a {kind} tensor; {kind} tensors: {names[1:6]} ...")
        self.tensor_dropdown = W.Dropdown(options=names, value=tensor, description="tensor")
        self.rank_dropdown = W.Dropdown(options=run.ranks, value=run.ranks[0] if rank is None else rank,
                                        description="rank")
        run.rank_index(self.rank_dropdown.value)
        self.domain_buttons = W.ToggleButtons(options=["unscaled", "scaled"], value=domain, description="values",
                                              **buttons)
        self.domain_buttons.layout.margin = "0 0 0 24px"      # apart from the kind buttons on the same row
        if not self.has_scaler:                                # loss scale 1: both domains are the same values
            self.domain_buttons.disabled = True
            self.domain_buttons.tooltips = ["no loss scaler in this run: scaled = unscaled"] * 2
        steps = [int(s) for s in run.hist_steps]
        start = steps[0] if step is None else int(step)
        run.hist_index(start)                                  # a clear KeyError for a step without histograms
        self.step_slider = W.SelectionSlider(options=steps, value=start, description="step",
                                             continuous_update=True, layout=W.Layout(width="90%"))

    def _names_for(self, kind: str) -> list:
        run = self.run
        return [ALL_TENSORS] + [n for n, k in zip(run.tensor_names, run.tensor_kinds) if kind in ("all", k)]

    # ------------------------------------------------------------------ cached data
    @property
    def selection(self) -> list:
        """Indices of the tensors shown (the kind and tensor selectors combined)."""
        kind = None if self.kind_buttons.value == "all" else self.kind_buttons.value
        tensor = None if self.tensor_dropdown.value == ALL_TENSORS else self.tensor_dropdown.value
        return self.run.tensor_indices(tensor, kind)

    def _data(self) -> dict:
        """Counts (H, NBINS), per-step log2 shifts of the limits, heatmap rows/matrix and x range."""
        r = self.run.rank_index(self.rank_dropdown.value)
        domain, sel = self.domain_buttons.value, tuple(self.selection)
        key = (r, domain, sel)
        if key not in self._cache:
            counts = self.run.pooled_counts(domain, rank=self.rank_dropdown.value, tensors=sel)
            log2s = self.run.log2_scales()[r] if domain == "unscaled" else np.zeros(counts.shape[0], np.int64)
            rows = heatmap_rows(counts)
            self._cache[key] = {"counts": counts, "log2s": log2s, "rows": rows,
                                "matrix": _as_sent(heatmap_matrix(counts, rows)),
                                "x_range": histogram_x_range(counts, self.format, (log2s.min(), log2s.max()),
                                                             reach=REACH)}
        return self._cache[key]

    # ------------------------------------------------------------------ figures
    def _build_figures(self) -> None:
        d, i = self._data(), self._row()
        self.counts, s = d["counts"][i], int(d["log2s"][i])
        heat = heatmap_figure(d["counts"], self.run.hist_steps, self.format, d["log2s"],
                              domain=self.domain_buttons.value, title=self._what())
        set_cursor(heat, self.step_slider.value)
        _set_y_range(heat, d["x_range"], self.format, d["log2s"])
        hist = histogram_figure(self.counts, self.format, s, domain=self.domain_buttons.value,
                                title=self._hist_title(), x_range=d["x_range"], height=400)
        self.fractions = _shares(H.fate(self.counts, self.format, log2_scale=s))
        self.heatmap, self.histogram = figure_widget(heat), figure_widget(hist)
        self.trace = figure_widget(self._trace_figure()) if self.has_scaler else None

    def _trace_figure(self):
        r = self.run.rank_index(self.rank_dropdown.value)
        trace = scale_trace_figure(self.run.steps, self.run.loss_scale[r], self.run.skipped[r], self.run.grown[r],
                                   title=f"Loss scale, rank {self.rank_dropdown.value}", height=320)
        trace.add_vline(x=float(self.step_slider.value), name="cursor", line=dict(color="#000000", width=1,
                        dash="dot"))
        self._trace_cursor = len(trace.layout.shapes) - 1
        return trace

    def _row(self) -> int:
        return self.run.hist_index(self.step_slider.value)

    def _what(self) -> str:
        kind, tensor = self.kind_buttons.value, self.tensor_dropdown.value
        if tensor != ALL_TENSORS:
            who = f"tensor {tensor} ({self.run.tensor_kinds[self.run.tensor_index(tensor)]})"
        else:
            who = "all tensors" if kind == "all" else f"all {kind} tensors"
        return f"{who}, rank {self.rank_dropdown.value}"

    def _hist_title(self) -> str:
        return f"Step {self.step_slider.value}"

    # ------------------------------------------------------------------ updates
    def _on_step(self, change=None) -> None:
        d, i = self._data(), self._row()
        self.counts, s = d["counts"][i], int(d["log2s"][i])
        fate = H.fate(self.counts, self.format, log2_scale=s)
        self.fractions = _shares(fate)
        hist: dict = {}                           # layout changes, one relayout message per figure
        set_regions(self.histogram, self.format, s, updates=hist)
        set_fractions(self.histogram, fate, self.format, updates=hist)
        set_title(self.histogram, self._hist_title(), self.format, s, self.domain_buttons.value, updates=hist)
        with self.histogram.batch_update():
            set_counts(self.histogram, self.counts)
            apply_layout(self.histogram, hist)
        with self.heatmap.batch_update():
            set_cursor(self.heatmap, self.step_slider.value)
        x = float(self.step_slider.value)
        if self.trace is not None:
            with self.trace.batch_update():
                apply_layout(self.trace, {f"shapes[{self._trace_cursor}].x0": x,
                                          f"shapes[{self._trace_cursor}].x1": x})
        self.readout.value = self._readout_html()

    def _on_selection(self, change) -> None:
        if change["owner"] is self.kind_buttons:          # the tensor list follows the kind
            names = self._names_for(self.kind_buttons.value)
            keep = self.tensor_dropdown.value if self.tensor_dropdown.value in names else ALL_TENSORS
            with self.tensor_dropdown.hold_trait_notifications():
                self.tensor_dropdown.options = names
                self.tensor_dropdown.value = keep
        d, r = self._data(), self.run.rank_index(self.rank_dropdown.value)
        with self.heatmap.batch_update():
            set_heatmap(self.heatmap, d["counts"], self.run.hist_steps, self.format, d["log2s"],
                        self.domain_buttons.value, matrix=d["matrix"], rows=d["rows"], title=self._what())
            _set_y_range(self.heatmap, d["x_range"], self.format, d["log2s"])
        with self.histogram.batch_update():
            set_x_range(self.histogram, d["x_range"])        # before the regions, which clip to it
        if change["owner"] is self.rank_dropdown and self.trace is not None:
            with self.trace.batch_update():
                set_recorded(self.trace, self.run.steps, self.run.loss_scale[r], self.run.skipped[r],
                             self.run.grown[r])
                self.trace.layout.title.text = retitle(self.trace.layout.title.text,
                                                       f"Loss scale, rank {self.rank_dropdown.value}")
        self._on_step()

    def _readout_html(self) -> str:
        run, r = self.run, self.run.rank_index(self.rank_dropdown.value)
        pos = int(np.searchsorted(run.steps, self.step_slider.value))
        total = int(self.counts.sum())
        scale = pow2_label(int(round(np.log2(run.loss_scale[r, pos]))))
        rows = [("step", str(self.step_slider.value)), ("loss", f"{float(run.loss[r, pos]):.5g}"),
                ("loss scale", scale if self.has_scaler else "1 (no loss scaler in this run)"),
                ("skipped", "yes" if run.skipped[r, pos] else "no"), ("values", f"{total:,}"),
                ("exact zeros", f"{int(self.counts[H.ZERO]):,}")]
        rows += [(name, f"{100 * self.fractions[name]:.3g}% of non-zero") for name in REGIONS]
        off = self._limits_off_axes()
        if off:
            rows.append(("off the axes", off))
        return table_html(rows, title=self._what())

    def _limits_off_axes(self) -> str:
        """The format limits (for the values shown at this step) beyond the axes, in words; '' if none."""
        d = self._data()
        s, (lo, hi) = int(d["log2s"][self._row()]), d["x_range"]
        e, fmt = region_edges(self.format, s), self.format
        off = ([f"smallest subnormal {pow2_text(fmt.log2_min_subnormal - s)}"] if e["subnormal"][0] < lo else []) \
            + ([f"largest value {fmt.max * 2.0 ** -s:.3g}"] if e["overflow"][0] > hi else [])
        return f"{fmt.name}'s " + " and ".join(off) if off else ""


def _set_y_range(fig, y_range, format, log2s) -> None:
    """The heatmap's log2 axis: the histogram's x range, so both panels show the same binades; the legend
    names only the limit lines inside it."""
    lo, hi = y_range
    ticks, text = log2_ticks(lo, hi, 8)
    apply_layout(fig, {"yaxis.range": [lo, hi], "yaxis.tickvals": ticks, "yaxis.ticktext": text})
    set_line_legend(fig, format, log2s, y_range)


def _as_sent(matrix) -> tuple:
    """(z as the front end receives it, column starts): converted once per selection, not per update."""
    z, starts = matrix
    return heatmap_z(z), starts


def _shares(fate) -> dict:
    return {r: float(fate.fraction(r)) for r in REGIONS}
