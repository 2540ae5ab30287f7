"""plots.formats: one histogram against several formats, panel by panel."""

import numpy as np
import pytest
import torch

from ampviz import histogram as H
from ampviz.lessons.format_ranges import format_comparison_figure


def test_each_panel_shows_the_same_bars_and_its_own_regions():
    x = torch.randn(5000) * torch.exp2(torch.randint(-30, 0, (5000,)).float())
    counts = H.histogram(x).numpy()
    fig = format_comparison_figure(counts, ["fp16", "bf16", "fp8_e4m3fn"], log2_scales=[0, 0, 5])
    assert [t.name for t in fig.data] == ["fp16", "bf16", "fp8_e4m3fn"]
    assert all(np.array_equal(np.nan_to_num(t.y), np.nan_to_num(fig.data[0].y)) for t in fig.data)
    titles = [a.text for a in fig.layout.annotations]
    f16 = H.fate(counts, "fp16", 1.0)
    assert "bf16</b>: flushed <b>0%" in titles[1]
    assert f"{100 * float(f16.fraction('flushed')):.1f}%" in titles[0]
    assert "× 2<sup>5</sup>" in titles[2] and "saturate" in titles[2]
    flush = {s.name: s for s in fig.layout.shapes if s.name.startswith("region:flushed:")}
    assert set(flush) == {"region:flushed:fp16", "region:flushed:bf16", "region:flushed:fp8_e4m3fn"}


def test_bad_arguments_are_named():
    counts = np.zeros(H.NBINS, dtype=np.int64)
    with pytest.raises(ValueError, match="log2_scales"):
        format_comparison_figure(counts, ["fp16", "bf16"], log2_scales=[0])
    with pytest.raises(ValueError, match="cols"):
        format_comparison_figure(counts, ["fp16"], cols=0)
    with pytest.raises(ValueError, match="formats"):
        format_comparison_figure(counts, [])
