"""The bit layout of one number in a format: sign, exponent and mantissa boxes, each field decoded.

    from ampviz.lessons.bits import bits_figure
    bits_figure(0.1, "fp16")            # 0 01011 1001100110 = +2^-4 × 1.599609375
    bits_figure(fields=(0, 0, 1), format="fp16")     # the smallest subnormal, from raw fields

The figure shows the value the input rounds to in the format (round-to-nearest-even, as a cast).

``DtypeExplorer`` (type a number, pick a format, see its bits and its neighbours) is at the end.

Used by lessons 01 (tensor dtypes).
"""

from __future__ import annotations

import math

import ipywidgets as W
import plotly.graph_objects as go

from ..formats import FORMATS, get_format
from ..plots.style import OKABE_ITO, apply_layout, base_layout, title_text
from ..widgets.parts import error_html, figure_widget, number_text, parse_number, table_html

__all__ = ["bits_figure", "set_bits", "field_values", "bit_cells", "DtypeExplorer"]


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


class DtypeExplorer(W.VBox):
    """Format dropdown, value box and clickable bits, with the value's class, neighbours and ulp.

    Parameters
    ----------
    value : initial number (or text such as "2**-24"); rounded to ``format``.
    format : initial format name (any of ``ampviz.formats.FORMATS``), torch dtype or Format.

    Attributes
    ----------
    format_dropdown, value_box, bit_buttons (list of ToggleButton, sign first), readout (HTML),
    figure (plotly FigureWidget of the bit layout); ``value``, ``fields``, ``format``, ``info``.
    """

    def __init__(self, value=1.0, format="fp16"):
        fmt = get_format(format)
        if fmt.name not in FORMATS:
            raise ValueError(f"format: {fmt.name!r} is not one of {', '.join(FORMATS)}")
        self._fmt = fmt
        self._input = parse_number(value)
        d = fmt.decompose(self._input)
        self._fields = (d.sign, d.exponent, d.mantissa)
        self._syncing = False
        self.format_dropdown = W.Dropdown(options=list(FORMATS), value=fmt.name, description="format")
        self.value_box = W.Text(value=str(value), description="value", continuous_update=False,
                                placeholder="0.1, -3e-8, 2**-24, inf, nan")
        self.readout = W.HTML()
        self.figure = figure_widget(bits_figure(fields=self._fields, format=fmt))
        self._bit_row = W.HBox(layout=W.Layout(flex_flow="row wrap"))
        self._build_buttons()
        self._write_readout()
        self.format_dropdown.observe(self._on_format, "value")
        self.value_box.observe(self._on_text, "value")
        super().__init__([W.HBox([self.format_dropdown, self.value_box]), self._bit_row, self.readout,
                          self.figure])

    # ------------------------------------------------------------------ public state
    @property
    def format(self):
        return self._fmt

    @property
    def fields(self) -> tuple:
        """(sign, exponent, mantissa) raw fields currently shown."""
        return self._fields

    @property
    def value(self) -> float:
        return self._fmt.compose(*self._fields)

    @property
    def info(self) -> dict:
        """value, kind, bits, next_down, next_up, ulp of the current value (plain numbers)."""
        v, fmt = self.value, self._fmt
        finite = math.isfinite(v)
        return {"value": v, "kind": field_values(fmt, *self._fields)["kind"], "bits": self.bit_string,
                "next_down": fmt.next_down(v), "next_up": fmt.next_up(v),
                "ulp": fmt.ulp(v) if finite else math.nan}

    @property
    def bit_string(self) -> str:
        s, e, m = self._fields
        return f"{s} {e:0{self._fmt.exponent_bits}b} {m:0{self._fmt.mantissa_bits}b}"

    def set_value(self, value) -> None:
        """Show ``value`` rounded to the current format (same as typing it in the value box)."""
        x = parse_number(value)                     # raises ValueError for bad input
        text = value if isinstance(value, str) else number_text(x)
        if self.value_box.value == text:
            self._show_input(x)
        else:
            self.value_box.value = text             # the observer shows it

    # ------------------------------------------------------------------ controls
    def _build_buttons(self) -> None:
        """One pool of 32 toggle buttons (the widest format); a format shows the first ``bits`` of them."""
        self._pool = []
        for i in range(max(f.bits for f in FORMATS.values())):
            b = W.ToggleButton(layout=W.Layout(width="26px", padding="0px", margin="0 1px"))
            b.observe(lambda change, i=i: self._on_bit(i, change["new"]), "value")
            self._pool.append(b)
        self._shown = [None] * len(self._pool)      # (digit, field) each button shows now
        self._layout_buttons()

    def _layout_buttons(self) -> None:
        fmt = self._fmt
        self._button_fields = ["sign"] + ["exponent"] * fmt.exponent_bits + ["mantissa"] * fmt.mantissa_bits
        self.bit_buttons = self._pool[:fmt.bits]
        for b, f in zip(self.bit_buttons, self._button_fields):
            b.tooltip = f"{f} bit (click to flip)"
        self._show_bits()
        self._bit_row.children = self.bit_buttons

    def _show_bits(self) -> None:
        """Set the buttons to the current fields, touching only those that change (each change is a message)."""
        self._syncing = True
        try:
            for i, (b, d, f) in enumerate(zip(self.bit_buttons, self.bit_string.replace(" ", ""), self._button_fields)):
                if self._shown[i] != (d, f):
                    b.value, b.description = d == "1", d
                    b.style.button_color = _FIELD_COLORS[f][0 if d == "1" else 1]
                    b.style.text_color = "white" if d == "1" and f != "sign" else "black"
                    self._shown[i] = (d, f)
        finally:
            self._syncing = False

    def _on_bit(self, index: int, on: bool) -> None:
        if self._syncing:
            return
        fmt = self._fmt
        digits = list(self.bit_string.replace(" ", ""))
        digits[index] = "1" if on else "0"
        e_end = 1 + fmt.exponent_bits
        self._fields = (int(digits[0]), int("".join(digits[1:e_end]), 2), int("".join(digits[e_end:]), 2))
        self._input = self.value
        self._syncing = True           # the box shows the composed value; do not re-parse it
        try:
            self.value_box.value = number_text(self._input)
        finally:
            self._syncing = False
        self._refresh(rebuild=False)

    def _on_text(self, change) -> None:
        if self._syncing:
            return
        try:
            x = parse_number(change["new"])
        except (ValueError, OverflowError) as e:
            self.readout.value = error_html(str(e)) + self._readout_html()
            return
        self._show_input(x)

    def _show_input(self, x: float) -> None:
        self._input = x
        d = self._fmt.decompose(x)
        self._fields = (d.sign, d.exponent, d.mantissa)
        self._refresh(rebuild=False)

    def _on_format(self, change) -> None:
        self._fmt = get_format(change["new"])
        d = self._fmt.decompose(self._input)        # the number last typed or composed, re-rounded
        self._fields = (d.sign, d.exponent, d.mantissa)
        self._refresh(rebuild=True)

    # ------------------------------------------------------------------ views
    def _refresh(self, rebuild: bool) -> None:
        if rebuild:
            self._layout_buttons()
        else:
            self._show_bits()
        with self.figure.batch_update():
            set_bits(self.figure, self._fmt, *self._fields)
        self._write_readout()

    def _write_readout(self) -> None:
        self.readout.value = self._readout_html()

    def _readout_html(self) -> str:
        i, fmt = self.info, self._fmt
        rows = [("stored value", f"<b>{number_text(i['value'])}</b>"), ("class", i["kind"]),
                ("bits", i["bits"])]
        if not _same(self._input, i["value"]):
            err = abs(i["value"] - self._input) if math.isfinite(i["value"]) else math.inf
            rel = f" (relative {err / abs(self._input):.2e})" if self._input and math.isfinite(err) else ""
            rows.append(("input", f"{number_text(self._input)} → rounding error {err:.3g}{rel}"))
        rows += [("next down", number_text(i["next_down"])), ("next up", number_text(i["next_up"])),
                 ("ulp (spacing above)", number_text(i["ulp"]))]
        return table_html(rows, title=f"{fmt.name}: {fmt.bits} bits")


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b
