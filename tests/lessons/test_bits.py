"""ampviz.lessons.bits: the bit-layout figure and DtypeExplorer, against Format.decompose (no browser)."""

import math

import pytest

from ampviz import formats as F
from ampviz.lessons.bits import DtypeExplorer, bits_figure


def named(items, name):
    [item] = [x for x in items if x.name == name]
    return item


# ---------------------------------------------------------------------------- bit layout
@pytest.mark.parametrize("value,fmt", [(0.1, "fp16"), (-3e-8, "fp16"), (1.0, "fp32"), (300.0, "fp8_e4m3fn"),
                                       (float("inf"), "bf16"), (1e-40, "bf16"), (0.0, "fp8_e5m2")])
def test_bits_figure_shows_the_decomposition(value, fmt):
    f = F.get_format(fmt)
    d = f.decompose(value)
    fig = bits_figure(value, fmt)
    heat = fig.data[0]
    assert "".join(heat.text[0]) == d.bits.replace(" ", "")
    fields = [0] + [1] * f.exponent_bits + [2] * f.mantissa_bits
    assert list(heat.z[0]) == [2 * k + int(b) for k, b in zip(fields, d.bits.replace(" ", ""))]
    result = named(fig.layout.annotations, "result").text
    assert f"({d.kind})" in result
    if d.kind in ("normal", "subnormal"):
        assert f"<b>{d.value!r}</b>" in result
    label = named(fig.layout.annotations, "label:mantissa").text
    assert f"({f.mantissa_bits} bits)" in label


def test_bits_figure_from_raw_fields_reaches_any_nan_and_checks_ranges():
    fig = bits_figure(fields=(1, 31, 5), format="fp16")
    assert "".join(fig.data[0].text[0]) == "1111110000000101"
    assert "nan" in named(fig.layout.annotations, "result").text
    with pytest.raises(ValueError, match=r"mantissa: expected an integer in \[0, 1023\]"):
        bits_figure(fields=(0, 1, 1024), format="fp16")


# ---------------------------------------------------------------------------- DtypeExplorer
def test_dtype_explorer_initial_state_matches_decompose():
    w = DtypeExplorer(0.1, "fp16")
    d = F.FP16.decompose(0.1)
    assert w.value == d.value and w.bit_string == d.bits and w.info["kind"] == "normal"
    assert "".join(b.description for b in w.bit_buttons) == d.bits.replace(" ", "")
    assert [b.value for b in w.bit_buttons] == [c == "1" for c in d.bits.replace(" ", "")]
    assert "".join(w.figure.data[0].text[0]) == d.bits.replace(" ", "")
    assert "rounding error" in w.readout.value           # 0.1 is not representable in fp16


def test_clicking_a_bit_gives_the_composed_value():
    w = DtypeExplorer(1.0, "fp16")
    w.bit_buttons[-1].value = True                       # lowest mantissa bit: 1 + 2**-10
    assert w.value == F.FP16.compose(0, 15, 1) == 1 + 2 ** -10
    assert w.value_box.value == repr(1 + 2 ** -10)
    assert "".join(w.figure.data[0].text[0])[-1] == "1"
    w.bit_buttons[0].value = True                        # sign
    assert w.value == -(1 + 2 ** -10)
    for b in w.bit_buttons[1:6]:                         # exponent all ones, mantissa non-zero: nan
        b.value = True
    assert math.isnan(w.value) and w.info["kind"] == "nan"
    assert w.fields == (1, 31, 1)                        # the clicked pattern stays, not a canonical nan


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp32"])
def test_value_box_round_trips_and_readouts_agree_with_format(fmt, rng):
    f = F.get_format(fmt)
    w = DtypeExplorer(0.0, fmt)
    for _ in range(25):
        sign, e, m = int(rng.integers(2)), int(rng.integers((1 << f.exponent_bits) - 1)), \
            int(rng.integers(1 << f.mantissa_bits))
        v = f.compose(sign, e, m)
        if math.isnan(v):
            continue
        w.value_box.value = repr(v)
        assert w.value == v and w.fields == (sign, e, m)
        assert w.info["next_up"] == f.next_up(v) and w.info["next_down"] == f.next_down(v)
        assert w.info["ulp"] == f.ulp(v)
        for key in ("next_up", "next_down", "ulp"):
            assert repr(w.info[key]) in w.readout.value
        assert "rounding error" not in w.readout.value   # representable: stored exactly


def test_value_box_accepts_powers_of_two_and_reports_bad_text():
    w = DtypeExplorer(1.0, "fp16")
    w.value_box.value = "2**-24"
    assert w.value == F.FP16.min_subnormal and w.info["kind"] == "subnormal"
    w.value_box.value = "1e-8"                           # flushes to zero in fp16
    assert w.value == 0.0 and "rounding error 1e-08" in w.readout.value
    before = w.fields
    w.value_box.value = "abc"
    assert w.fields == before and "is not a number" in w.readout.value
    with pytest.raises(ValueError, match="is not a number"):
        w.set_value("abc")


def test_changing_format_rerounds_the_input_and_rebuilds_the_bits():
    w = DtypeExplorer(70000.0, "fp16")
    assert math.isinf(w.value)
    w.format_dropdown.value = "bf16"
    assert w.value == F.BF16.round(70000.0) and len(w.bit_buttons) == 16
    assert w.bit_string == F.BF16.decompose(70000.0).bits
    w.format_dropdown.value = "fp8_e4m3fn"
    assert w.value == 448.0 and len(w.bit_buttons) == 8 and len(w.figure.data[0].z[0]) == 8


def test_dtype_explorer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown format 'fp7'"):
        DtypeExplorer(1.0, "fp7")
    with pytest.raises(ValueError, match="value: 'x' is not a number"):
        DtypeExplorer("x", "fp16")


# ---------------------------------------------------------------------------- ScaleExplorer
