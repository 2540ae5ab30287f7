"""ampviz.formats against torch: limits from finfo, rounding against real casts, bit fields
against the actual bit patterns torch stores."""

import math

import numpy as np
import pytest
import torch

from ampviz import formats as F

TORCH_FORMATS = [F.FP32, F.FP16, F.BF16, F.FP8_E4M3FN, F.FP8_E5M2]
INT_VIEW = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=lambda f: f.name)
def test_limits_come_from_finfo(fmt):
    fi = torch.finfo(fmt.dtype)
    assert (fmt.max, fmt.min_normal, fmt.eps, fmt.bits) == (fi.max, fi.tiny, fi.eps, fi.bits)
    assert fmt.min_subnormal == fi.tiny * fi.eps
    assert fmt.min_normal == 2.0 ** fmt.emin and fmt.min_subnormal == 2.0 ** fmt.log2_min_subnormal


def test_known_limits_of_fp16_and_fp8():
    assert (F.FP16.max, F.FP16.emin, F.FP16.log2_min_subnormal) == (65504.0, -14, -24)
    assert (F.FP8_E4M3FN.max, F.FP8_E4M3FN.emin, F.FP8_E4M3FN.log2_min_subnormal) == (448.0, -6, -9)
    assert (F.FP8_E5M2.max, F.BF16.log2_min_subnormal) == (57344.0, -133)
    assert F.FP16.overflow_threshold == 65520.0


def test_tf32_is_derived_from_its_bit_widths():
    t = F.TF32
    assert (t.exponent_bits, t.mantissa_bits, t.bits) == (8, 10, 19)
    assert t.min_normal == F.FP32.min_normal and t.eps == F.FP16.eps
    assert t.max == (2 - 2.0 ** -10) * 2.0 ** 127 and t.min_subnormal == 2.0 ** -136


def _wide_fp32_sample(rng, n=20000):
    mags = np.exp2(rng.uniform(-152, 130, n))
    with np.errstate(over="ignore"):            # values above fp32 max become inf, on purpose
        vals = (mags * rng.choice([-1, 1], n)).astype(np.float32)
    special = np.array([0, -0.0, np.inf, -np.inf, np.nan, 65519, 65520, 65504, 2 ** -25, 2 ** -24,
                        1.5 * 2 ** -25, 464, 465, 448, 480, 61440, 57344, 1 + 2 ** -11, 2049], np.float32)
    return np.concatenate([vals, special])


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=lambda f: f.name)
def test_scalar_rounding_matches_torch_casts(fmt, rng):
    vals = _wide_fp32_sample(rng, 4000)
    cast = torch.from_numpy(vals).to(fmt.dtype).double().numpy()
    mine = np.array([fmt.round(float(v)) for v in vals])
    np.testing.assert_array_equal(mine, cast)   # nan == nan in assert_array_equal


@pytest.mark.parametrize("fmt", TORCH_FORMATS + [F.TF32], ids=lambda f: f.name)
def test_tensor_rounding_matches_scalar_rounding(fmt, rng):
    vals = _wide_fp32_sample(rng, 4000)
    tensor = fmt.round(torch.from_numpy(vals)).double().numpy()
    scalar = np.array([fmt.round(float(v)) for v in vals])
    np.testing.assert_array_equal(tensor, scalar)


def test_the_classic_fp16_demonstrations():
    assert F.FP16.round(70000.0) == math.inf
    assert F.FP16.round(1e-8) == 0.0
    assert F.FP16.round(2048 + 1) == 2048 and F.FP16.round(1 + 2 ** -11) == 1
    assert F.FP16.round(2.0 ** -25) == 0.0 and F.FP16.round(1.0001 * 2 ** -25) == 2.0 ** -24
    assert F.FP8_E4M3FN.round(1000.0) == 448.0        # torch saturates e4m3fn
    assert F.BF16.round(70000.0) == 70144.0            # bf16 keeps the range, loses digits


@pytest.mark.parametrize("fmt", [F.FP16, F.BF16, F.FP8_E4M3FN, F.FP8_E5M2], ids=lambda f: f.name)
def test_decompose_matches_torch_bit_patterns_for_every_pattern(fmt):
    n = 1 << fmt.bits
    pats = torch.arange(n, dtype=torch.int64)
    view = INT_VIEW[fmt.bits]
    values = (pats.to(torch.uint8) if fmt.bits == 8 else pats.to(torch.int32).to(view)).view(fmt.dtype).double()
    step = 1 if fmt.bits == 8 else 7          # every 8-bit pattern, every 7th 16-bit one
    m = fmt.mantissa_bits
    for p in range(0, n, step):
        v = float(values[p])
        b = fmt.decompose(v)
        if math.isnan(v):
            assert b.kind == "nan" and math.isnan(fmt.compose(b.sign, b.exponent, b.mantissa))
            continue
        assert (b.sign << (fmt.bits - 1)) | (b.exponent << m) | b.mantissa == p, (fmt.name, p, v, b)
        assert fmt.compose(b.sign, b.exponent, b.mantissa) == v


def test_fp32_bits_match_struct(rng):
    for v in _wide_fp32_sample(rng, 500):
        if np.isnan(v):
            continue
        b = F.FP32.decompose(float(v))
        raw = int(np.array([v], np.float32).view(np.uint32)[0])
        assert (b.sign << 31) | (b.exponent << 23) | b.mantissa == raw


def test_classify_and_bit_string():
    assert [F.FP16.classify(x) for x in (0.0, 1e-6, 1.0, 1e6, math.nan)] == \
        ["zero", "subnormal", "normal", "inf", "nan"]
    assert F.FP16.decompose(-2.0).bits == "1 10000 0000000000"
    assert F.BF16.decompose(1.0).bits == "0 01111111 0000000"


@pytest.mark.parametrize("fmt", [F.FP16, F.BF16, F.FP8_E5M2], ids=lambda f: f.name)
def test_neighbours_are_adjacent_bit_patterns(fmt, rng):
    view = INT_VIEW[fmt.bits]
    for v in [1.0, 2.0, 3.0, fmt.min_normal, fmt.min_subnormal, 1000.0, fmt.max / 2, 0.1]:
        v = fmt.round(v)
        p = int(torch.tensor(v, dtype=fmt.dtype).view(view if fmt.bits > 8 else torch.uint8))
        up = torch.tensor(p + 1, dtype=torch.int32).to(view if fmt.bits > 8 else torch.uint8)
        dn = torch.tensor(p - 1, dtype=torch.int32).to(view if fmt.bits > 8 else torch.uint8)
        assert fmt.next_up(v) == float(up.view(fmt.dtype)), (fmt.name, v)
        assert fmt.next_down(v) == float(dn.view(fmt.dtype)), (fmt.name, v)
        assert fmt.ulp(v) == fmt.next_up(v) - v
    assert F.FP16.next_up(65504.0) == math.inf and F.FP16.next_down(math.inf) == 65504.0
    assert F.FP16.next_up(0.0) == 2.0 ** -24


def test_get_format_by_name_dtype_and_errors():
    assert F.get_format("half") is F.FP16 and F.get_format(torch.bfloat16) is F.BF16
    assert F.get_format("e4m3") is F.FP8_E4M3FN and F.get_format(F.TF32) is F.TF32
    with pytest.raises(ValueError, match="unknown format 'fp12'.*fp16"):
        F.get_format("fp12")
    with pytest.raises(ValueError, match="torch.int32"):
        F.get_format(torch.int32)


def test_bad_inputs_name_the_argument():
    with pytest.raises(TypeError, match="x: expected a number"):
        F.FP16.round(object())
    with pytest.raises(ValueError, match=r"mantissa: expected an integer in \[0, 1023\], got 5000"):
        F.FP16.compose(0, 1, 5000)
    with pytest.raises(TypeError, match="floating-point tensor"):
        F.FP16.round(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="single number"):
        F.FP16.decompose(torch.ones(3))
