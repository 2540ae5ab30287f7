"""Shared look of every ampviz figure: colour-blind-safe palette, log2 ticks, base layout.

Colours come from the Okabe–Ito palette, which stays distinguishable under the common colour
vision deficiencies. A value's fate always has the same colour, in every figure::

    >>> from ampviz.plots.style import REGION_COLORS, log2_ticks
    >>> REGION_COLORS["flushed"]
    '#D55E00'
    >>> log2_ticks(-25, -23)[1][0]
    '2<sup>-25</sup><br>3e-8'
"""

from __future__ import annotations

import math
import re

__all__ = ["OKABE_ITO", "REGIONS", "REGION_COLORS", "REGION_LABELS", "DATA_COLOR", "ZERO_COLOR",
           "log2_ticks", "short_number", "pow2_text", "base_layout", "swatch", "percent", "apply_layout",
           "title_text", "retitle"]

OKABE_ITO = {"black": "#000000", "orange": "#E69F00", "sky_blue": "#56B4E9", "bluish_green": "#009E73",
             "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00", "reddish_purple": "#CC79A7"}

# the fate of a non-zero value after scaling and a cast (same order and names as histogram.Fate)
REGIONS = ("flushed", "subnormal", "normal", "overflow")
REGION_COLORS = {"flushed": OKABE_ITO["vermillion"], "subnormal": OKABE_ITO["orange"],
                 "normal": OKABE_ITO["bluish_green"], "overflow": OKABE_ITO["reddish_purple"]}
REGION_LABELS = {"flushed": "flush to zero", "subnormal": "subnormal", "normal": "normal",
                 "overflow": "overflow"}
REGION_OPACITY = 0.16
DATA_COLOR = OKABE_ITO["blue"]        # bars and recorded traces: dark, readable over any shading
REPLAY_COLOR = OKABE_ITO["sky_blue"]
ZERO_COLOR = "#8C8C8C"                # exact zeros: zero in every format, so no region colour
_ELEMENT_PATH = re.compile(r"^(shapes|annotations)\[(\d+)\]\.(\w+)$")     # "shapes[3].x0"
FONT = dict(family="Inter, Helvetica Neue, Arial, sans-serif", size=13, color="#222222")


def short_number(v: float) -> str:
    """A compact decimal for a power of two: 1024, 0.25, 6e-8, 7e+4."""
    if v == 0 or not math.isfinite(v):
        return str(v)
    if 2.0 ** -3 <= abs(v) <= 2.0 ** 13:
        return f"{v:g}"
    mantissa, exponent = f"{v:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def pow2_text(k: float) -> str:
    """'2<sup>k</sup>' for an integer (or near-integer) exponent, 2^k.kk otherwise."""
    if float(k).is_integer():
        return f"2<sup>{int(k)}</sup>"
    return f"2<sup>{k:.2f}</sup>"


def log2_ticks(lo: float, hi: float, max_ticks: int = 11, decimals: bool = True):
    """Tick positions (integer log2 values) and labels ``2^k`` (with ``≈`` decimal below) for [lo, hi].

    The step is the smallest of 1, 2, 4, 8, 16, 32 giving at most ``max_ticks`` ticks, and ticks
    sit on multiples of the step so that labels do not jump as a range moves.
    """
    span = max(hi - lo, 1.0)
    step = next((s for s in (1, 2, 4, 8, 16, 32, 64) if span / s <= max_ticks), 64)
    first = math.ceil(lo / step) * step
    vals = list(range(int(first), int(math.floor(hi)) + 1, step))
    text = [pow2_text(k) + (f"<br>{short_number(2.0 ** k)}" if decimals else "") for k in vals]
    return vals, text


def percent(fraction: float) -> str:
    """A fraction as a percentage that never shows a non-zero share as 0% (or a partial one as 100%)."""
    p = 100.0 * float(fraction)
    if p == 0 or p == 100:
        return f"{p:.0f}%"
    if p < 0.1:
        return "<0.1%"
    if p > 99.9:
        return ">99.9%"
    return f"{p:.1f}%"


def swatch(color: str) -> str:
    """A coloured square for legends written in annotation text."""
    return f'<span style="color:{color}">■</span>'


def title_text(title: str, subtitle: str | None = None) -> str:
    """A title with its subtitle as a smaller grey second line, in one text.

    Plotly's ``title.subtitle`` is placed from the title's measured size; in a FigureWidget first
    drawn off-screen (JupyterLab renders cells below the fold lazily) it lands above the title.
    One text with a line break has no such failure.
    """
    return title if not subtitle else f"{title}<br><span style='font-size:12px;color:#555555'>{subtitle}</span>"


def retitle(text: str, title: str) -> str:
    """``text`` (a :func:`title_text`) with its first line replaced by ``title``, its subtitle kept."""
    _, sep, rest = (text or "").partition("<br>")
    return title + sep + rest


def base_layout(title: str | None = None, subtitle: str | None = None, height: int = 420,
                inline_subtitle: bool = False, **kw) -> dict:
    """Layout shared by every figure: white background, no grid clutter, readable font.

    ``inline_subtitle`` puts the subtitle into the title text (see :func:`title_text`) instead of
    plotly's ``title.subtitle``; ampviz's own widget figures use it.
    """
    layout = dict(template="simple_white", font=FONT, height=height, margin=dict(l=70, r=30, t=90, b=70),
                  hoverlabel=dict(font_size=12), showlegend=False)
    if title is not None and inline_subtitle:
        layout["title"] = dict(text=title_text(title, subtitle), x=0.01, xanchor="left", font=dict(size=16))
    elif title is not None:
        layout["title"] = dict(text=title, x=0.01, xanchor="left", font=dict(size=16),
                               subtitle=dict(text=subtitle or "", font=dict(size=12, color="#555555")))
    layout.update(kw)
    return layout


def apply_layout(fig, updates: dict) -> None:
    """Apply many layout changes (``{"shapes[0].x0": 1.0, "title.text": ...}``) in one relayout.

    Changes to elements of ``shapes`` and ``annotations`` are sent as whole new lists: plotly
    parses every ``"shapes[i].prop"`` path on its own, which on a FigureWidget costs about a
    millisecond each, while replacing a short list costs about that once. The browser gets one
    message either way.
    """
    if not updates:
        return
    arrays, rest = {}, {}
    for key, value in updates.items():
        m = _ELEMENT_PATH.match(key)
        if m:
            arrays.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = value
        else:
            rest[key] = value
    for name, changes in arrays.items():
        items = [dict(item.to_plotly_json()) for item in fig.layout[name]]
        for i, props in changes.items():
            items[i].update(props)
        rest[name] = items
    fig.plotly_relayout(rest)

