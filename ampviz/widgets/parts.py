"""Small helpers shared by the widgets: number parsing and formatting, readout tables, figure widgets."""

from __future__ import annotations

import html
import math
import re

import plotly.graph_objects as go

__all__ = ["parse_number", "number_text", "table_html", "error_html", "figure_widget", "pow2_label"]

_POW2 = re.compile(r"^\s*([+-]?)\s*2\s*(?:\*\*|\^)\s*\(?\s*([+-]?\d+)\s*\)?\s*$")


def parse_number(text) -> float:
    """A float from user text: '0.1', '-1e-8', 'inf', 'nan', '-0', or a power of two '2**-24' / '2^-24'."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    if not isinstance(text, str):
        raise ValueError(f"value: expected a number or text such as '0.1', '2**-24', 'inf'; got {text!r}")
    m = _POW2.match(text)
    if m:
        v = math.ldexp(1.0, int(m.group(2)))   # may be 0.0 or raise OverflowError for huge exponents
        return -v if m.group(1) == "-" else v
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"value: {text!r} is not a number; try '0.1', '-3e-8', '2**-24', 'inf' or 'nan'") from None


def number_text(v: float) -> str:
    """Exact shortest text of a float (``repr``), or a dash for nan neighbours/spacings."""
    if v is None:
        return "—"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return repr(float(v))


def pow2_label(k: int) -> str:
    """'2^k = value' for slider readouts."""
    v = 2.0 ** k
    return f"2^{k} = {v:,.0f}" if 0 <= k <= 40 else f"2^{k} ≈ {v:.3g}"


def table_html(rows, title: str | None = None) -> str:
    """A compact two-column HTML table from (label, value-html) rows; labels are escaped."""
    head = f"<div style='font-weight:600;margin-bottom:4px'>{html.escape(title)}</div>" if title else ""
    cells = "".join(f"<tr><td style='padding:1px 12px 1px 0;color:#555'>{html.escape(k)}</td>"
                    f"<td style='padding:1px 0;font-family:monospace'>{v}</td></tr>" for k, v in rows)
    return f"{head}<table style='border-collapse:collapse;font-size:13px'>{cells}</table>"


def error_html(message: str) -> str:
    return f"<div style='color:#B2182B;font-size:13px'>⚠ {html.escape(message)}</div>"


def figure_widget(fig: go.Figure) -> go.FigureWidget:
    """A FigureWidget of a figure already built with its initial data.

    Built from the final initial state on purpose: a FigureWidget saves (and Voilà shows) only
    the figure it was created with, so nothing may be changed between creation and display.
    """
    return go.FigureWidget(fig)
