"""ampviz.lessons.master_weights: the update figure and UpdateExplorer by state, and the training figure."""

import math

import numpy as np
import plotly.io as pio
import pytest

from ampviz import formats as F
from ampviz.lessons.master_weights import TRACES, UpdateExplorer, applied_share, training_figure, update_figure
from ampviz.lessons.rounding import add_in


def test_applied_share_is_zero_below_half_an_ulp_and_tends_to_one():
    share = applied_share(1.0, "fp16", [-4.0, math.log10(0.6 * 2.0 ** -10), 0.0])
    assert share[0] == 0.0                                    # 1e-4 < 2**-11
    assert share[1] == pytest.approx(1 / 0.6)                 # rounded up to one whole ulp
    assert share[2] == pytest.approx(1.0, abs=1e-3)


def test_update_figure_marks_w_the_exact_sum_and_the_stored_value():
    fig = update_figure(1.0, 7e-4, "fp16")
    r = add_in(1.0, 7e-4, "fp16")
    assert fig.data[TRACES["stored"]].x[0] == r.moved_ulps == 1.0
    assert fig.data[TRACES["requested"]].x[0] == pytest.approx((r.exact - 1.0) / r.ulp)
    grid = np.asarray(fig.data[TRACES["grid"]].x)
    assert 0.0 in grid and 1.0 in grid and -0.5 in grid      # below a power of two the grid halves
    zone = next(s for s in fig.layout.shapes if s.name == "lost zone")
    assert (zone.x0, zone.x1) == (-0.25, 0.5)
    with pytest.raises(ValueError, match="w:"):
        update_figure(0.0, 1e-3)
    with pytest.raises(ValueError, match="update"):
        update_figure(1.0, -1e-3)


def test_update_explorer_follows_its_controls():
    w = UpdateExplorer(1.0, 4e-4, "fp16")
    assert w.result.lost and "lost" in w.readout.value
    w.format_dropdown.value = "fp32"
    assert not w.result.lost and w.result.format == "fp32"
    w.format_dropdown.value = "bf16"
    w.update_slider.value = 3e-3                              # below half a bf16 ulp (2**-8) at 1.0
    assert w.result.lost
    w.weight_slider.value = 2.0 ** -4                         # smaller weight: finer grid, kept
    assert not w.result.lost
    r = add_in(w.weight_slider.value, w.update_slider.value, "bf16")
    assert w.result == r
    assert w.figure.data[TRACES["share now"]].y[0] == pytest.approx(r.applied / r.requested)
    assert list(w.figure.data[TRACES["share"]].y) == list(applied_share(r.w, F.BF16, w.figure.data[TRACES["share"]].x))


def test_update_explorer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="format"):
        UpdateExplorer(format="tf32")
    with pytest.raises(ValueError, match="weight"):
        UpdateExplorer(weight=1e6)
    with pytest.raises(ValueError, match="update"):
        UpdateExplorer(update=10.0)


def _markers_inside(fig, share=0.05):
    """w, the exact sum and the stored value lie inside the top panel, at least ``share`` of it from each edge."""
    lo, hi = fig.layout.xaxis.range
    xs = [fig.data[TRACES[n]].x[0] for n in ("w", "requested", "stored")]
    margin = share * (hi - lo)
    return all(lo + margin <= x <= hi - margin for x in xs)


@pytest.mark.parametrize("weight, update, fmt", [(1.0905, 4.47e-4, "fp32"), (1.0, 0.5, "bf16"),
                                                 (2.0 ** -12, 1.0, "fp32"), (1.0, 7e-4, "fp16")])
def test_markers_stay_inside_the_top_panel_at_any_span(weight, update, fmt):
    fig = update_figure(weight, update, fmt)
    assert _markers_inside(fig)                               # the browser pass found them half-clipped at fp32


def test_a_view_too_wide_for_ticks_shows_the_grid_as_a_band_with_a_note():
    w = UpdateExplorer(1.0, 4e-4, "fp16")
    band = next(s for s in w.figure.layout.shapes if s.name == "dense grid")
    note = next(a for a in w.figure.layout.annotations if a.name == "grid note")
    assert len(w.figure.data[TRACES["grid"]].x) > 0 and not band.visible and note.text == ""
    w.format_dropdown.value = "fp32"                          # 4e-4 is ~3,000 fp32 ulps of 1.0
    band = next(s for s in w.figure.layout.shapes if s.name == "dense grid")
    note = next(a for a in w.figure.layout.annotations if a.name == "grid note")
    assert len(w.figure.data[TRACES["grid"]].x) == 0
    assert band.visible and (band.x0, band.x1) == tuple(w.figure.layout.xaxis.range)
    assert "too dense" in note.text and _markers_inside(w.figure)
    assert "error -0.0%" not in w.readout.value and "e-0" in w.readout.value   # a tiny error, shown as such
    w.format_dropdown.value = "bf16"                          # back to a drawable grid: the band goes
    assert len(w.figure.data[TRACES["grid"]].x) > 0
    assert not next(s for s in w.figure.layout.shapes if s.name == "dense grid").visible


def test_the_legend_names_the_colour_the_lost_marker_has():
    fig = update_figure(1.0, 4e-4, "fp16")
    stored = fig.data[TRACES["stored"]]
    assert add_in(1.0, 4e-4, "fp16").lost and stored.marker.color == "#D55E00"
    assert "orange-red: lost" in stored.name


def test_training_figure_draws_each_run_in_three_panels():
    steps = 120
    runs = {name: {"loss": np.linspace(2, 1, steps) + k, "lost": np.full(steps, 0.1 * k),
                   "acc_step": [50, 100], "acc": [0.3, 0.5 - 0.1 * k]} for k, name in enumerate(("a", "b"))}
    fig = training_figure(runs, window=20)
    assert len(fig.data) == 6 and [t.name for t in fig.data if t.showlegend] == ["a", "b"]
    loss_b = next(t for t in fig.data if t.name == "b" and t.xaxis == "x")
    assert len(loss_b.y) == steps - 19 and loss_b.x[0] == 20
    assert math.isclose(loss_b.y[0], np.mean(runs["b"]["loss"][:20]))
    assert fig.layout.template == pio.templates["simple_white"]        # the project's theme
    with pytest.raises(ValueError, match="runs"):
        training_figure({})


def _visible(fig):
    """What a learner sees: every trace's data, the shapes' positions and the annotations' text."""
    traces = tuple((tuple(np.round(np.asarray(t.x, dtype=float), 9)), tuple(np.round(np.asarray(t.y, dtype=float), 9)))
                   for t in fig.data)
    shapes = tuple((s.name, s.x0, s.x1, s.visible) for s in fig.layout.shapes)
    return traces, shapes, tuple(a.text for a in fig.layout.annotations), tuple(fig.layout.xaxis.range)


@pytest.mark.parametrize("control, value", [("format_dropdown", "bf16"), ("format_dropdown", "fp32"),
                                            ("weight_slider", 2.0 ** -4), ("update_slider", 1e-3)])
def test_every_control_changes_the_figure_from_the_first_state(control, value):
    w = UpdateExplorer(1.0, 4e-4, "fp16")
    before, readout = _visible(w.figure), w.readout.value
    getattr(w, control).value = value
    assert _visible(w.figure) != before and w.readout.value != readout
