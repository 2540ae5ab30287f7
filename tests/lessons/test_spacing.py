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


def test_figure_has_a_line_per_format_and_labelled_marks():
    fig = spacing_figure(["fp32", "fp16"], lo=-26, hi=18, marks=[("fp16", 2048.0)])
    lines = [t for t in fig.data if t.mode == "lines"]
    assert [t.name for t in lines] == ["fp32", "fp16"]
    [mark] = [t for t in fig.data if t.mode == "markers" and t.marker.size == 10]
    assert (mark.x[0], mark.y[0]) == (11.0, 1.0)
    assert fig.layout.annotations[0].text == "fp16: ulp(2048) = 2"


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="lo, hi"):
        spacing_steps("fp16", 5, 5)
    with pytest.raises(ValueError, match="marks"):
        spacing_figure(marks=[("fp16", 1e6)])
    with pytest.raises(ValueError, match="format"):
        spacing_figure(["fp12"])
