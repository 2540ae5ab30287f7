"""ampviz.lessons.rounding against real torch arithmetic: fp16 / bf16 additions, running sums, stall points."""

import math

import numpy as np
import pytest
import torch

from ampviz import formats as F
from ampviz.lessons.rounding import (
    add_in,
    compensated_sum,
    lost_fraction,
    neighbours,
    running_sum,
    stall_value,
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_add_in_matches_a_real_addition_in_the_dtype(dtype, rng):
    fmt = F.get_format(dtype)
    w = rng.uniform(-4, 4, 3000) * np.exp2(rng.integers(-12, 8, 3000))
    u = rng.uniform(-1, 1, 3000) * np.exp2(rng.integers(-30, 0, 3000))
    # operands already in the dtype (torch's float64 -> float16 conversion rounds twice, via float32)
    w_t, u_t = torch.tensor(w).float().to(dtype), torch.tensor(u).float().to(dtype)
    real = (w_t + u_t).double().numpy()           # one op in the dtype: a single rounding of the sum
    ours = np.array([add_in(a, b, fmt).stored for a, b in zip(w_t.tolist(), u_t.tolist())])
    assert np.array_equal(real, ours)


def test_an_update_below_half_an_ulp_is_lost_and_above_is_kept():
    ulp = F.FP16.ulp(1.0)
    assert ulp == 2.0 ** -10
    assert add_in(1.0, 0.49 * ulp, "fp16").lost
    assert add_in(1.0, ulp / 2, "fp16").lost                  # tie: 1.0 has an even mantissa
    kept = add_in(1.0, 0.51 * ulp, "fp16")
    assert not kept.lost and kept.stored == 1.0 + ulp and kept.moved_ulps == 1.0
    assert kept.relative_error == pytest.approx(1 / 0.51 - 1)
    assert not add_in(1.0, 0.49 * ulp, "fp32").lost
    assert add_in(1.0, 1e-9, "fp16").update_underflowed       # the update itself flushes to 0


def test_add_in_rejects_bad_input():
    with pytest.raises(ValueError, match="finite"):
        add_in(float("inf"), 1.0, "fp16")
    with pytest.raises(TypeError, match="update"):
        add_in(1.0, "a lot", "fp16")
    with pytest.raises(ValueError, match="unknown format"):
        add_in(1.0, 1.0, "fp12")


@pytest.mark.parametrize("fmt", [F.FP16, F.BF16, F.FP8_E4M3FN])
@pytest.mark.parametrize("w", [1.0, 0.1, -3.0, 2.0 ** -14, 448.0 / 4])
def test_neighbours_are_consecutive_representable_values(fmt, w):
    v = neighbours(w, fmt, n=5)
    assert v.size == 11 and np.all(np.diff(v) > 0) and v[5] == fmt.round(w)
    assert all(fmt.round(x) == x for x in v)
    mids = (v[:-1] + v[1:]) / 2                               # nothing representable in between
    assert all(fmt.round(np.nextafter(m, -np.inf)) in (a, b) for m, a, b in zip(mids, v[:-1], v[1:]))
    with pytest.raises(ValueError, match="n:"):
        neighbours(w, fmt, n=0)


def test_lost_fraction_counts_unmoved_elements_with_a_gradient():
    before = [torch.tensor([1.0, 2.0, 3.0, 4.0])]
    after = [torch.tensor([1.0, 2.5, 3.0, 4.0])]
    grads = [torch.tensor([0.1, 0.1, 0.0, 0.1])]               # element 2 had no gradient: not counted
    assert lost_fraction(before, after, grads) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="shapes"):
        lost_fraction(before, after, [torch.zeros(3)])
    with pytest.raises(ValueError, match="equally long"):
        lost_fraction(before, after, [])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_running_sum_matches_a_loop_in_the_dtype(dtype, rng):
    x = rng.uniform(0, 0.02, 2000)
    s, real = torch.zeros((), dtype=dtype), []
    for v in torch.tensor(x).to(dtype):
        s = s + v
        real.append(float(s))
    assert np.array_equal(running_sum(x, dtype), np.array(real))


def test_running_sum_is_not_torch_sum():
    x = torch.full((5000,), 0.01)
    ours = running_sum(x, "bf16")[-1]
    assert ours == 4.0                                         # stalls: 0.01 < half an ulp of 4 in bf16
    assert float(x.bfloat16().sum()) > 40                      # torch.sum accumulates in fp32 inside


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
@pytest.mark.parametrize("inc", [0.01, 0.1, 2.0 ** -9, 3 * 2.0 ** -12, 1e-4])
def test_stall_value_is_where_a_brute_force_running_sum_stops(fmt, inc):
    sums = running_sum([inc] * 40000, fmt)
    stalled = sums[-1]
    assert sums[-2] == stalled                                 # really stalled within the brute force
    assert stall_value(inc, fmt) == stalled


def test_stall_value_in_fp32_is_fast_and_consistent():
    s = stall_value(0.01, "fp32")
    inc = F.FP32.round(0.01)
    assert F.FP32.round(s + inc) == s and F.FP32.round(F.FP32.next_down(s) + inc) != F.FP32.next_down(s)
    assert math.log2(s) == 18                                   # 0.01 < half an fp32 ulp from 2**18 on
    with pytest.raises(ValueError, match="increment"):
        stall_value(0.0, "fp16")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compensated_sum_collects_updates_a_plain_sum_loses(dtype):
    fmt = F.get_format(dtype)
    update = 0.4 * fmt.ulp(1.0)                                # below half an ulp of 1.0: a plain sum stalls
    assert running_sum([update] * 1000, dtype, start=1.0)[-1] == 1.0
    exact = 1.0 + 1000 * fmt.round(update)
    kept = compensated_sum(1.0, update, 1000, dtype)
    assert abs(kept - exact) <= fmt.ulp(exact)                 # within one ulp of the exact total
    with pytest.raises(ValueError, match="dtype"):
        compensated_sum(1.0, update, 10, torch.float64)
