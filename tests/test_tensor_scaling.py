"""ampviz.tensor_scaling: amax scales, per-row fates and strategy comparison, against real fp8 casts."""

import math

import numpy as np
import pytest
import torch

from ampviz import formats as F
from ampviz import histogram as H
from ampviz import tensor_scaling as TS


def spread_values(n=20000, lo=-30, hi=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp2(torch.randint(lo, hi, (n,), generator=g).float())


@pytest.mark.parametrize("fmt", [F.FP8_E4M3FN, F.FP8_E5M2, F.FP16])
def test_amax_scale_is_the_largest_power_of_two_that_does_not_overflow(fmt):
    x = spread_values()
    s = int(TS.amax_log2_scales(H.histogram(x).numpy(), fmt))
    amax = float(x.abs().max())
    assert amax * 2.0 ** s <= fmt.max                       # safe for the real largest value
    assert H.max_magnitude(H.histogram(x).numpy()) * 2.0 ** (s + 1) > fmt.max   # one more would not be
    out = H.cast_counts(x, fmt, 2.0 ** s)
    assert out["overflow"] == 0
    assert TS.amax_log2_scales(np.zeros(H.NBINS, dtype=np.int64), fmt) == 0


@pytest.mark.parametrize("fmt", [F.FP8_E4M3FN, F.FP8_E5M2, F.FP16])
@pytest.mark.parametrize("log2_scale", [-4, 0, 7, 15])
def test_scaled_fate_predicts_a_real_cast(fmt, log2_scale):
    x = spread_values(seed=log2_scale + 50)
    pred = TS.scaled_fate(H.histogram(x).numpy(), fmt, log2_scale)
    real = H.cast_counts(x, fmt, 2.0 ** log2_scale)
    assert int(pred.flushed) == real["flushed"] and int(pred.zero) == real["zero"]
    # fate's documented binade-edge sets: [overflow_threshold, 2**(emax+1)] counts as normal, and
    # [min_normal - min_subnormal/2, min_normal] as subnormal; every other value is predicted exactly
    a = x.abs().double() * 2.0 ** log2_scale
    top_edge = ((a >= fmt.overflow_threshold) & (a <= 2.0 ** (fmt.emax + 1))).sum().item()
    low_edge = ((a >= fmt.min_normal - fmt.min_subnormal / 2) & (a <= fmt.min_normal)).sum().item()
    assert 0 <= real["overflow"] - int(pred.overflow) <= top_edge
    assert abs(int(pred.subnormal) - real["subnormal"]) <= low_edge


def test_e4m3fn_saturates_and_is_counted_as_overflow():
    x = torch.tensor([100.0, 460.0, 464.0, 470.0, 1000.0, 1e-4])
    out = H.cast_counts(x, "fp8_e4m3fn")
    assert float(torch.tensor(1000.0).to(torch.float8_e4m3fn).float()) == 448.0   # torch saturates
    assert out["overflow"] == 2                 # 470 and 1000; 464 is a tie that rounds to 448
    assert out["flushed"] == 1                  # 1e-4 < 2**-10 (half of e4m3fn's smallest subnormal)


def test_relative_error_reflects_mantissa_bits():
    x = spread_values(lo=-6, hi=0)
    e4 = H.cast_counts(x, "fp8_e4m3fn", 2.0 ** int(TS.amax_log2_scales(H.histogram(x).numpy(), "fp8_e4m3fn")))
    e5 = H.cast_counts(x, "fp8_e5m2", 2.0 ** int(TS.amax_log2_scales(H.histogram(x).numpy(), "fp8_e5m2")))
    assert e4["relative_error"] < 2.0 ** -4 and e5["relative_error"] < 2.0 ** -3     # half an ulp, relative
    assert e4["relative_error"] < e5["relative_error"]


def test_compare_scalings_orders_the_strategies():
    # three "tensors" whose magnitudes sit at very different heights
    rows = [H.histogram(spread_values(seed=i, lo=-12 - 10 * i, hi=-10 * i)).numpy() for i in range(3)]
    counts = np.stack([np.stack(rows)] * 2)                  # (steps=2, tensors=3, NBINS)
    table = TS.compare_scalings(counts, "fp8_e4m3fn")
    none, shared, per = (table[k]["flushed"] for k in TS.STRATEGIES)
    assert np.all(per <= shared + 1e-12) and np.all(shared <= none + 1e-12)
    assert per[2] < shared[2] - 0.1                          # the smallest tensor gains most from its own scale
    assert all(np.all(table[k]["overflow"] == 0) for k in ("shared", "per-tensor"))
    assert table["per-tensor"]["log2_scale"].shape == (2, 3)
    assert np.all(table["shared"]["log2_scale"] == table["per-tensor"]["log2_scale"].min(axis=1, keepdims=True))


def test_bad_input_is_rejected_with_the_argument_named():
    with pytest.raises(ValueError, match="counts"):
        TS.compare_scalings(np.zeros((2, 3, 4)), "fp8_e5m2")
    with pytest.raises(ValueError, match="margin"):
        TS.amax_log2_scales(np.zeros(H.NBINS), "fp8_e5m2", margin=-1)
    with pytest.raises(ValueError, match="scale"):
        H.cast_counts(torch.ones(3), "fp8_e5m2", scale=0.0)
    with pytest.raises(ValueError, match="tf32"):
        H.cast_counts(torch.ones(3), "tf32")
    inf_row = H.histogram(torch.tensor([1.0, math.inf])).numpy()
    with pytest.raises(ValueError, match="inf"):
        TS.amax_log2_scales(inf_row, "fp8_e5m2")
