"""The spacing figure's staircase against real neighbours found with torch.nextafter."""

import math

import pytest
import torch

from ampviz.formats import BF16, FP16, FP32
from ampviz.lessons.spacing import spacing_figure, spacing_steps


@pytest.mark.parametrize("fmt", [FP16, BF16, FP32])
def test_each_step_is_the_gap_to_the_next_representable_number(fmt):
    x, y = spacing_steps(fmt, -30, 20)
    for k, log2_ulp in zip(x[:-1], y[:-1]):
        v = torch.tensor(2.0 ** k, dtype=fmt.dtype)
        gap = (torch.nextafter(v, torch.tensor(math.inf, dtype=fmt.dtype)) - v).item()
        assert log2_ulp == math.log2(gap), (fmt.name, k)


def test_fp16_staircase_starts_at_the_smallest_subnormal_flattens_and_stops_at_max():
    x, y = spacing_steps(FP16, -40, 40)
    assert x[0] == -24 and x[-1] == pytest.approx(math.log2(65504))
    subnormal = y[x < -14]
    assert set(subnormal) == {-24}                      # evenly spaced below 2**-14
    normal = y[(x >= -14)][:-1]
    assert list(normal) == [k - 10 for k in range(-14, 16)]   # ten mantissa bits: ulp = 2**(k-10)


def test_figure_has_a_line_per_format_and_marks_named_in_the_legend():
    fig = spacing_figure(["fp32", "fp16"], lo=-26, hi=18, marks=[("fp16", 2048.0), ("fp16", 2.0 ** -20)])
    lines = [t for t in fig.data if t.mode == "lines"]
    assert [t.name for t in lines] == ["fp32", "fp16"]
    marks = [t for t in fig.data if t.mode == "markers" and t.showlegend is not False]
    assert [(m.x[0], m.y[0]) for m in marks] == [(11.0, 1.0), (-20.0, -24.0)]
    assert [m.name for m in marks] == ["fp16: ulp(2048) = 2", "fp16: ulp(2^-20) = 2^-24"]
    assert len({m.marker.symbol for m in marks}) == 2          # told apart by shape, not only by colour
    assert not fig.layout.annotations                          # no label drawn over a staircase


def test_legend_sits_below_the_lowest_staircase():
    """The legend's corner (bottom right) holds no line: every staircase there lies above it."""
    fig = spacing_figure(["fp32", "bf16", "fp16", "fp8_e5m2", "fp8_e4m3fn"], lo=-26, hi=18)
    assert (fig.layout.legend.xanchor, fig.layout.legend.yanchor) == ("right", "bottom")
    ylo = fig.layout.yaxis.range[0]
    x, y = spacing_steps(FP32, -26, 18)
    right = x >= 4                                     # the legend's left edge, about 2^4 on this axis
    assert (y[right] - ylo > 20).all()                 # far above the bottom, where the legend sits


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="lo, hi"):
        spacing_steps("fp16", 5, 5)
    with pytest.raises(ValueError, match="marks"):
        spacing_figure(marks=[("fp16", 1e6)])
    with pytest.raises(ValueError, match="format"):
        spacing_figure(["fp12"])
