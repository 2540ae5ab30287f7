"""ScaleExplorer: slide the loss scale over a recorded histogram and watch what a cast keeps.

    from ampviz.widgets import ScaleExplorer
    ScaleExplorer(run)                              # every tensor, every recorded step, pooled
    ScaleExplorer(run, step=0, kind="activation")   # one step, activation gradients only
    ScaleExplorer(torch.randn(10_000) * 1e-6)       # raw values

    w = ScaleExplorer(run)
    w.slider.value = 12                             # loss scale 2**12
    w.fractions["flushed"]                          # share of non-zero values flushed to zero

The bars show the values unscaled and stay put; the shaded regions show where each value lands
once multiplied by the loss scale and cast to the format. Shares for every slider position are
computed once, up front, so moving the slider only indexes a table.

Caveat for runs: activation gradients were recorded as the backward computed them, already in
fp16 at the run's own loss scale, so values that flushed during the run appear here as exact
zeros; no slider position can bring them back.
"""

from __future__ import annotations

import ipywidgets as W
import numpy as np

from .. import histogram as H
from ..formats import FORMATS, get_format
from ..plots.histogram import (
    check_domain,
    check_log2_scale,
    histogram_figure,
    histogram_x_range,
    set_fractions,
    set_regions,
    set_title,
    set_x_range,
)
from ..plots.style import REGION_LABELS, REGIONS, apply_layout, percent
from ..run import Run
from .parts import figure_widget, pow2_label, table_html

__all__ = ["ScaleExplorer", "as_counts_source"]


class ScaleExplorer(W.VBox):
    """A log2 loss-scale slider over a histogram, with live flushed / subnormal / overflow shares.

    Parameters
    ----------
    source : an ``ampviz.Run``, integer counts ``(..., NBINS)`` (leading axes summed) or a
        floating-point tensor / array of raw values.
    format : initial format (``format_dropdown`` offers every format in ``ampviz.formats``).
    step, tensor, kind, rank : narrow a Run: one histogram step (default: all pooled), a tensor
        name/index or list of them, "weight" / "activation", a rank (default: the first).
    log2_range : (lo, hi) integer slider bounds; the loss scale runs from 2**lo to 2**hi.
    log2_scale : initial slider position (default: a Run's median recorded scale, else 0).
    domain : label of the plotted values for counts/tensors ("unscaled" or "scaled"); Runs are
        always shown unscaled.
    title : figure title.

    Attributes
    ----------
    slider (IntSlider, log2 of the loss scale), format_dropdown, scale_label, readout (HTML),
    figure (FigureWidget), counts (the NBINS histogram shown), fractions (dict of the shares now).
    """

    def __init__(self, source, format="fp16", *, step=None, tensor=None, kind=None, rank=None,
                 log2_range=(0, 32), log2_scale=None, domain: str = "unscaled",
                 title: str = "Gradient magnitudes"):
        self.counts, what, run = as_counts_source(source, step=step, tensor=tensor, kind=kind, rank=rank)
        self._domain = "unscaled" if run is not None else check_domain(domain)
        lo, hi = _check_range(log2_range)
        s0 = _initial_scale(run, step, log2_scale, lo, hi)
        fmt = get_format(format)
        self._title = f"{title} ({what})"
        self._tables: dict = {}
        self.slider = W.IntSlider(value=s0, min=lo, max=hi, step=1, description="log2 scale",
                                  continuous_update=True, style={"description_width": "initial"})
        self.format_dropdown = W.Dropdown(options=list(FORMATS), value=fmt.name, description="format")
        self.scale_label = W.Label(pow2_label(s0))
        self.readout = W.HTML()
        fig = histogram_figure(self.counts, fmt, s0, domain=self._domain, title=self._title,
                               x_range=self._x_range(fmt))
        self.figure = figure_widget(fig)
        self.fractions = self._shares(fmt, s0)
        self.readout.value = self._readout_html(fmt, s0)
        self.slider.observe(self._on_change, "value")
        self.format_dropdown.observe(self._on_format, "value")
        super().__init__([W.HBox([self.format_dropdown, self.slider, self.scale_label]), self.figure,
                          self.readout])

    @property
    def format(self):
        return get_format(self.format_dropdown.value)

    # ------------------------------------------------------------------ precomputed tables
    def _table(self, fmt) -> dict:
        """Counts per region for every slider position of ``fmt``: computed once per format."""
        if fmt.name not in self._tables:
            positions = range(self.slider.min, self.slider.max + 1)
            self._tables[fmt.name] = H.fate_table(self.counts, fmt, positions)     # arrays (positions,)
        return self._tables[fmt.name]

    def _shares(self, fmt, s: int) -> dict:
        t, i = self._table(fmt), s - self.slider.min
        nonzero = sum(float(t[r][i]) for r in REGIONS)
        return {r: (float(t[r][i]) / nonzero if nonzero else 0.0) for r in REGIONS}

    def _x_range(self, fmt) -> tuple:
        return histogram_x_range(self.counts, fmt, (self.slider.min, self.slider.max))

    # ------------------------------------------------------------------ updates
    def _on_change(self, change=None) -> None:
        fmt, s = self.format, self.slider.value
        self.fractions = self._shares(fmt, s)
        updates: dict = {}                  # every layout change in one relayout message
        set_regions(self.figure, fmt, s, updates=updates)
        set_fractions(self.figure, self.fractions, fmt, updates=updates)
        set_title(self.figure, self._title, fmt, s, self._domain, updates=updates)
        with self.figure.batch_update():
            apply_layout(self.figure, updates)
        self.scale_label.value = pow2_label(s)
        self.readout.value = self._readout_html(fmt, s)

    def _on_format(self, change) -> None:
        with self.figure.batch_update():
            set_x_range(self.figure, self._x_range(self.format))   # limits move with the format
        self._on_change()

    def _readout_html(self, fmt, s: int) -> str:
        t, i = self._table(fmt), s - self.slider.min
        total = int(self.counts.sum())
        rows = [("loss scale", pow2_label(s))]
        for r in REGIONS:
            label = f"saturate to {fmt.max:g}" if r == "overflow" and fmt.saturates else REGION_LABELS[r]
            rows.append((label, f"{int(t[r][i]):,} ({percent(self.fractions[r])} of non-zero)"))
        zeros, nans = int(self.counts[H.ZERO]), int(self.counts[H.NAN])
        rows.append(("exact zeros", f"{zeros:,} ({percent(zeros / total if total else 0)} of all values)"))
        if nans:
            rows.append(("nan", f"{nans:,}"))
        return table_html(rows, title=f"{total:,} values, {self._domain}, cast to {fmt.name} after × 2^{s}")


def _check_range(log2_range) -> tuple:
    try:
        lo, hi = (check_log2_scale(v, "log2_range") for v in log2_range)
    except TypeError:
        raise ValueError(f"log2_range: expected (lo, hi) integers, got {log2_range!r}") from None
    if not lo < hi or lo < -126 or hi > 126:
        raise ValueError(f"log2_range: expected -126 <= lo < hi <= 126, got {log2_range!r}")
    return lo, hi


def _initial_scale(run, step, log2_scale, lo: int, hi: int) -> int:
    """The scale the run used (at ``step``, or its median), clipped to the slider; else 0."""
    if log2_scale is None:
        s = 0
        if run is not None and run.loss_scale.size:
            scales = run.loss_scale[0] if step is None else run.loss_scale[0, np.searchsorted(run.steps, step)]
            s = int(np.median(np.rint(np.log2(scales))))
        return min(max(s, lo), hi)
    s = check_log2_scale(log2_scale)
    if not lo <= s <= hi:
        raise ValueError(f"log2_scale: {s} is outside log2_range ({lo}, {hi})")
    return s


def as_counts_source(source, *, step=None, tensor=None, kind=None, rank=None):
    """Resolve a ScaleExplorer source into (counts (NBINS,), description, run or None).

    ``source`` is a Run (narrowed by step / tensor / kind / rank; all histogram steps pooled when
    ``step`` is None), an integer counts array (..., NBINS), or a floating-point tensor/array of
    raw values (histogrammed here).
    """
    import torch
    if isinstance(source, Run):
        if source.hist_steps.size == 0:
            raise ValueError("source: the run has no histogram steps (recorded with no steps, or every > steps)")
        r = source.rank_index(source.ranks[0] if rank is None else rank)
        idx = source.tensor_indices(tensor, kind)
        counts = source.pooled_counts("unscaled", rank=source.ranks[r], tensors=idx)
        if len(idx) == 1:
            who = f"{source.tensor_names[idx[0]]}"
        else:
            who = f"{len(idx)} {kind + ' ' if kind else ''}tensors"
        if step is None:
            return counts.sum(axis=0), f"{who}, all {source.hist_steps.size} recorded steps", source
        return counts[source.hist_index(step)], f"{who}, step {step}", source
    for name, value in (("step", step), ("tensor", tensor), ("kind", kind), ("rank", rank)):
        if value is not None:
            raise ValueError(f"{name}: only applies when the source is an ampviz.Run, got {name}={value!r}")
    if isinstance(source, torch.Tensor) and source.is_floating_point():
        return H.histogram(source.detach()).cpu().numpy(), f"a tensor of {source.numel():,} values", None
    arr = np.asarray(source) if not isinstance(source, torch.Tensor) else source.cpu().numpy()
    if arr.dtype.kind == "f":
        return H.histogram(torch.from_numpy(np.ascontiguousarray(arr))).numpy(), f"{arr.size:,} values", None
    if arr.dtype.kind in "iu" and arr.ndim >= 1 and arr.shape[-1] == H.NBINS:
        return arr.reshape(-1, H.NBINS).sum(axis=0), "recorded counts", None
    raise TypeError(f"source: expected an ampviz.Run, integer counts (..., {H.NBINS}) or a floating-point "
                    f"tensor of values; got {type(source).__name__} with dtype {arr.dtype} and shape {arr.shape}")
