"""plots.update and widgets.update (UpdateExplorer): state after controls change, against add_in."""

import math

import numpy as np
import pytest

from ampviz import formats as F
from ampviz.plots.update import TRACES, applied_share, update_figure
from ampviz.rounding import add_in
from ampviz.widgets.update import UpdateExplorer


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
