"""The bit layout of one number in a format: sign, exponent and mantissa boxes, each field decoded.

    from ampviz.plots import bits_figure
    bits_figure(0.1, "fp16")            # 0 01011 1001100110 = +2^-4 × 1.599609375
    bits_figure(fields=(0, 0, 1), format="fp16")     # the smallest subnormal, from raw fields

The figure shows the value the input rounds to in the format (round-to-nearest-even, as a cast).
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from ..formats import get_format
from ._style import OKABE_ITO, apply_layout, base_layout, title_text

__all__ = ["bits_figure", "set_bits", "field_values", "bit_cells"]

# (colour of a 1 bit, colour of a 0 bit) per field; 0 bits are a pale tint so the field stays visible
_FIELD_COLORS = {"sign": (OKABE_ITO["yellow"], "#FBF8D6"), "exponent": (OKABE_ITO["blue"], "#D5E3EF"),
                 "mantissa": (OKABE_ITO["sky_blue"], "#E4F2FB")}
_FIELDS = ("sign", "exponent", "mantissa")


def _colorscale() -> list:
    """Discrete colour scale for cell codes 0..5: (field index * 2 + bit)."""
    colors = [c for f in _FIELDS for c in reversed(_FIELD_COLORS[f])]   # sign0, sign1, exp0, exp1, ...
    scale = []
    for i, c in enumerate(colors):
        scale += [[i / 6, c], [(i + 1) / 6, c]]
    return scale


def field_values(format, sign: int, exponent: int, mantissa: int) -> dict:
    """Decoded meaning of raw fields: the value and a human-readable line per field."""
    fmt = get_format(format)
    value = fmt.compose(sign, exponent, mantissa)
    all_ones = (1 << fmt.exponent_bits) - 1
    m = fmt.mantissa_bits
    if math.isnan(value) or math.isinf(value):
        exp_text = f"{exponent:0{fmt.exponent_bits}b} = {exponent}: special"
        man_text = "0 → inf" if math.isinf(value) else f"{mantissa} ≠ 0 → nan"
        kind = "nan" if math.isnan(value) else "inf"
    elif exponent == 0:
        exp_text = f"0 → subnormal: 2<sup>{fmt.emin}</sup> (= 1 − bias {fmt.bias})"
        man_text = f"0 + {mantissa}/2<sup>{m}</sup> = {mantissa / 2 ** m!r}"
        kind = "zero" if mantissa == 0 else "subnormal"
    else:
        exp_text = f"{exponent} − bias {fmt.bias} = {exponent - fmt.bias} → 2<sup>{exponent - fmt.bias}</sup>"
        man_text = f"1 + {mantissa}/2<sup>{m}</sup> = {1 + mantissa / 2 ** m!r}"
        kind = "normal"
    if exponent == all_ones and not fmt.has_inf and not math.isnan(value):
        exp_text += " (e4m3fn: still finite)"
    return {"value": value, "kind": kind, "sign": "− (1)" if sign else "+ (0)", "exponent": exp_text,
            "mantissa": man_text}


def bit_cells(format, sign: int, exponent: int, mantissa: int):
    """(codes, digits): per bit, left to right, the colour code (field*2 + bit) and '0'/'1'."""
    fmt = get_format(format)
    digits = f"{sign}{exponent:0{fmt.exponent_bits}b}{mantissa:0{fmt.mantissa_bits}b}"
    fields = [0] + [1] * fmt.exponent_bits + [2] * fmt.mantissa_bits
    return [f * 2 + int(d) for f, d in zip(fields, digits)], list(digits)


def bits_figure(value=1.0, format="fp16", *, fields=None, height: int = 300) -> go.Figure:
    """Boxes for every bit of ``value`` rounded to ``format``, the fields labelled and decoded.

    Parameters
    ----------
    value : the number to show (rounded to the format first).
    format : format name, torch dtype or Format.
    fields : optional (sign, exponent, mantissa) raw fields, used instead of ``value``
        (shows patterns such as a particular nan that no value maps to).

    Returns
    -------
    plotly Figure: one heatmap trace "bits" (``z`` colour codes, ``text`` the digits), annotations
    "label:<field>", "decode:<field>" and "result".
    """
    fmt = get_format(format)
    sign, exponent, mantissa = _fields_of(fmt, value, fields)
    fig = go.Figure(go.Heatmap(z=[[0]], text=[["0"]], name="bits", colorscale=_colorscale(), zmin=-0.5,
                               zmax=5.5, showscale=False, xgap=3, ygap=0, texttemplate="%{text}",
                               textfont=dict(size=15), hoverinfo="skip"))
    for f in _FIELDS:
        fig.add_annotation(name=f"label:{f}", y=0.62, yanchor="bottom", showarrow=False, font=dict(size=13))
        fig.add_annotation(name=f"decode:{f}", y=-0.62, yanchor="top", showarrow=False, font=dict(size=12),
                           align="left")
    for f in _FIELDS:     # an outline per field groups its bits (pale 0 bits alone look alike)
        fig.add_shape(type="rect", name=f"field:{f}", y0=-0.56, y1=0.56, fillcolor="rgba(0,0,0,0)",
                      line=dict(color=_FIELD_COLORS[f][0], width=2.5))
    fig.add_annotation(name="result", xref="paper", x=0.0, xanchor="left", y=-1.5, yanchor="top",
                       showarrow=False, font=dict(size=15))
    fig.update_layout(**base_layout(*_titles(fmt), height=height, inline_subtitle=True,
                                    margin=dict(l=20, r=20, t=70, b=20)))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False, range=[-2.3, 1.3])
    set_bits(fig, fmt, sign, exponent, mantissa)
    return fig


def _fields_of(fmt, value, fields):
    if fields is not None:
        try:
            sign, exponent, mantissa = (int(v) for v in fields)
        except (TypeError, ValueError):
            raise ValueError(f"fields: expected (sign, exponent, mantissa) integers, got {fields!r}") from None
        fmt.compose(sign, exponent, mantissa)       # validates the field ranges
        return sign, exponent, mantissa
    d = fmt.decompose(value)
    return d.sign, d.exponent, d.mantissa


def set_bits(fig, format, sign: int, exponent: int, mantissa: int) -> None:
    """Show the raw fields (sign, exponent, mantissa) of ``format`` in a bits figure (in place)."""
    fmt = get_format(format)
    codes, digits = bit_cells(fmt, sign, exponent, mantissa)
    n = len(codes)
    heat = fig.data[0]
    heat.z, heat.text, heat.x = [codes], [digits], list(range(n))
    title, subtitle = _titles(fmt)
    d = {"title.text": title_text(title, subtitle), "xaxis.range": [-0.6, n - 0.4]}
    spans = {"sign": (0, 0), "exponent": (1, fmt.exponent_bits), "mantissa": (fmt.exponent_bits + 1, n - 1)}
    widths = {"sign": 1, "exponent": fmt.exponent_bits, "mantissa": fmt.mantissa_bits}
    decoded = field_values(fmt, sign, exponent, mantissa)
    for i, shape in enumerate(fig.layout.shapes):
        if (shape.name or "").startswith("field:"):
            a, b = spans[shape.name[6:]]
            d[f"shapes[{i}].x0"], d[f"shapes[{i}].x1"] = a - 0.5, b + 0.5
    for i, ann in enumerate(fig.layout.annotations):
        kind, _, field = (ann.name or "").partition(":")
        if kind in ("label", "decode"):
            a, b = spans[field]
            # the one-bit sign field is narrow: anchor its text left so it does not spill over the exponent
            d[f"annotations[{i}].x"], d[f"annotations[{i}].xanchor"] = \
                (a - 0.45, "left") if field == "sign" else ((a + b) / 2, "center")
            d[f"annotations[{i}].text"] = (f"<b>{field}</b> ({widths[field]} bit{'s' if widths[field] > 1 else ''})"
                                           if kind == "label" else _decode_text(field, decoded))
        elif kind == "result":
            d[f"annotations[{i}].text"] = _result_text(fmt, sign, exponent, mantissa, decoded)
    apply_layout(fig, d)


def _titles(fmt) -> tuple:
    return (f"{fmt.name}: bit layout",
            f"{fmt.bits} bits: 1 sign, {fmt.exponent_bits} exponent (bias {fmt.bias}), {fmt.mantissa_bits} mantissa;"
            f" max {fmt.max:g}, min normal 2<sup>{fmt.emin}</sup>, min subnormal 2<sup>{fmt.log2_min_subnormal}</sup>")


def _decode_text(field: str, decoded: dict) -> str:
    # the sign's text sits under one narrow box: keep it to the symbol
    return decoded["sign"][0] if field == "sign" else decoded[field]


def _result_text(fmt, sign, exponent, mantissa, decoded) -> str:
    v, kind = decoded["value"], decoded["kind"]
    s = "−" if sign else "+"
    if kind in ("nan", "inf", "zero"):
        return f"= {s if kind != 'nan' else ''}{kind if kind != 'zero' else '0'}   <i>({kind})</i>"
    power = fmt.emin if kind == "subnormal" else exponent - fmt.bias
    lead = 0 if kind == "subnormal" else 1
    frac = lead + mantissa / 2 ** fmt.mantissa_bits
    return f"= {s}2<sup>{power}</sup> × {frac!r} = <b>{v!r}</b>   <i>({kind})</i>"
