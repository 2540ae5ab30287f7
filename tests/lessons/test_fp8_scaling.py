"""ampviz.lessons.fp8_scaling against real fp8 casts and against autograd's own GEMMs."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampviz.formats import FP8_E4M3FN, FP8_E5M2, get_format
from ampviz.lessons.fp8_scaling import (
    LinearOperands,
    amax_scale,
    capture_linear_operands,
    dx_row_errors,
    gemm_errors,
    quantize,
    row_error_figure,
    strategies_figure,
)


def spread_rows(seed=0, rows=64, cols=32, spread=30):
    """Gaussian rows whose magnitudes spread over ``spread`` binades (like a trained model's output gradient)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    return x * torch.exp2(-torch.linspace(0, spread, rows))[:, None]


@pytest.mark.parametrize("fmt", [FP8_E4M3FN, FP8_E5M2])
def test_amax_scale_is_the_largest_power_of_two_that_fits(fmt):
    amax = torch.tensor([1.0, 1.5, 2.0, 3e-7, fmt.max, 7e3, 0.0])
    s = amax_scale(amax, fmt)
    assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))          # powers of two
    fits = amax * s <= fmt.max
    doubled_overflows = (amax * 2 * s > fmt.max) | (amax == 0)
    assert fits.all() and doubled_overflows.all() and s[-1] == 1.0


@pytest.mark.parametrize("fmt", ["fp8_e4m3fn", "fp8_e5m2"])
def test_per_tensor_quantize_is_a_real_cast_at_the_amax_scale(fmt):
    x = spread_rows(spread=10)
    s = amax_scale(x.abs().amax(), fmt)
    real = (x * s).to(get_format(fmt).dtype).float() / s                     # the oracle: torch's own cast
    assert torch.equal(quantize(x, fmt), real)


@pytest.mark.parametrize("fmt", [FP8_E4M3FN, FP8_E5M2])
def test_row_wise_scales_keep_every_row_within_the_format_precision(fmt):
    x = spread_rows(spread=40)                                  # 40 binades: more than either format spans
    per_tensor, row_wise = quantize(x, fmt), quantize(x, fmt, "row")
    assert (per_tensor[-1] == 0).all()                          # the smallest row is flushed whole ...
    scaled_amax = x.abs().amax(dim=1) * amax_scale(x.abs().amax(dim=1), fmt)
    assert torch.all((scaled_amax > fmt.max / 2) & (scaled_amax <= fmt.max))  # ... each row lands at the top
    normal = (x * amax_scale(x.abs().amax(dim=1, keepdim=True), fmt)).abs() >= fmt.min_normal
    rel = ((row_wise - x).abs() / x.abs())[normal]
    assert rel.max() <= fmt.eps / 2 * (1 + 1e-6)                # round to nearest: at most half an ulp
    cols = quantize(x.T, fmt, "column")
    assert torch.equal(cols, row_wise.T)


def small_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 4))


def test_captured_operands_reproduce_autograd_s_own_gemms():
    net = small_net()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 6, generator=g, requires_grad=True)
    y = torch.randint(0, 4, (20,), generator=g)
    ops = capture_linear_operands(net, F.cross_entropy, x, y)
    assert list(ops) == ["0", "2"] and all(p.grad is None for p in net.parameters())
    F.cross_entropy(net(x), y).backward()                       # the oracle: a real backward
    for name, ref in ((n, ops[n].reference()) for n in ops):
        layer = net[int(name)]
        torch.testing.assert_close(ref["dW"], layer.weight.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(ref["Y"] + layer.bias.detach(), layer(ops[name].x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ops["0"].reference()["dX"], x.grad, rtol=1e-5, atol=1e-7)


def test_gemm_errors_vanish_without_a_cast_and_favour_e4m3_per_tensor():
    ops = capture_linear_operands(small_net(), F.cross_entropy, torch.randn(64, 6), torch.randint(0, 4, (64,)))
    exact = gemm_errors(ops["2"], forward="fp32", backward="fp32")
    assert max(exact.values()) < 1e-6
    e4 = gemm_errors(ops["2"], backward="fp8_e4m3fn")
    e5 = gemm_errors(ops["2"], backward="fp8_e5m2")
    assert e4["Y"] == e5["Y"]                                   # the forward does not involve the gradient
    assert e4["dX"] < e5["dX"] and e4["dW"] < e5["dW"]          # one more mantissa bit, nothing flushed here
    with pytest.raises(ValueError, match="granularity"):
        gemm_errors(ops["2"], granularity="column")


def test_row_errors_show_whole_samples_lost_per_tensor_and_kept_row_wise():
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    g = spread_rows(rows=32, cols=16, spread=40)
    ops_like = LinearOperands(torch.randn(32, 8), w, g)
    per_tensor = dx_row_errors(ops_like, backward="fp8_e4m3fn")
    row_wise = dx_row_errors(ops_like, backward="fp8_e4m3fn", granularity="row")
    assert per_tensor.size == row_wise.size == 32
    assert (per_tensor >= 0.99).sum() > 0 and row_wise.max() < 0.1
    fig = row_error_figure({("tensor", "fp8_e4m3fn"): per_tensor, ("row", "fp8_e4m3fn"): row_wise})
    assert [t.name for t in fig.data] == ["per-tensor scale, g in fp8_e4m3fn", "row-wise scale, g in fp8_e4m3fn"]
    assert np.all(np.diff(fig.data[1].y) <= 0)                  # sorted from worst to best


def test_quantize_rejects_bad_input():
    with pytest.raises(TypeError, match="x: expected a 2-D"):
        quantize(torch.ones(3), "fp8_e4m3fn")
    with pytest.raises(ValueError, match="granularity"):
        quantize(torch.ones(2, 2), "fp8_e4m3fn", "block")
    with pytest.raises(ValueError, match="tf32 has no torch dtype"):
        quantize(torch.ones(2, 2), "tf32")


def test_strategies_figure_groups_bars_by_format_with_a_titled_legend():
    shares = {("fp8_e4m3fn", "none"): [0.5, 0.6], ("fp8_e4m3fn", "per-tensor"): [0.1, 0.2],
              ("fp8_e5m2", "none"): [0.3, 0.4], ("fp8_e5m2", "per-tensor"): [0.0, 0.1]}
    fig = strategies_figure(shares, ["body.0", "head"])
    assert len(fig.data) == 4 and fig.layout.legend.title.text == "scale"
    assert [t.name for t in fig.data if t.showlegend] == ["none", "per-tensor"]
    assert list(fig.data[3].x[1]) == ["body.0", "head"] and list(fig.data[3].y) == [0.0, 0.1]
