"""DtypeExplorer: pick a format, type a number or click its bits, see what the format stores.

    from ampviz.widgets import DtypeExplorer
    DtypeExplorer(0.1, "fp16")         # last expression of a cell: shows the widget

    w = DtypeExplorer(0.1, "fp16")
    w.value_box.value = "2**-24"        # as if typed: the smallest fp16 subnormal
    w.bit_buttons[-1].value = False     # as if clicked: clears the last mantissa bit -> 0.0
    w.value, w.info["kind"]             # (0.0, 'zero')

The bits are the state: clicking a bit composes a new value from the raw fields (so any pattern,
every nan included, can be reached); typing a value rounds it to the format (nearest-even, as a
cast does) and shows the rounding error.
"""

from __future__ import annotations

import math

import ipywidgets as W

from ..formats import FORMATS, get_format
from ..plots.bits import _FIELD_COLORS, bits_figure, field_values, set_bits
from ._common import error_html, figure_widget, number_text, parse_number, table_html

__all__ = ["DtypeExplorer"]


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
