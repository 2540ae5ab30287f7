"""Stacked bars of a training step's memory by category (weights, gradients, optimizer state,
16-bit weight copies, saved activations), one bar per configuration::

    from ampviz.memory import measure_step
    from ampviz.plots.memory import memory_figure
    fig = memory_figure({"fp32": measure_step(model, x, y, loss_fn),
                         "autocast bf16": measure_step(model, x, y, loss_fn, autocast_dtype=torch.bfloat16)})

:func:`set_memory` updates an existing figure (or ``FigureWidget``) in place.
"""

from __future__ import annotations

import plotly.graph_objects as go

from ..memory import CATEGORIES
from ._style import OKABE_ITO, base_layout, title_text

__all__ = ["memory_figure", "set_memory", "CATEGORY_COLORS", "CATEGORY_LABELS", "MIB"]

MIB = 2 ** 20
CATEGORY_COLORS = {"weights": OKABE_ITO["blue"], "gradients": OKABE_ITO["sky_blue"],
                   "optimizer_state": OKABE_ITO["bluish_green"], "weight_copies": OKABE_ITO["orange"],
                   "activations": OKABE_ITO["vermillion"]}
CATEGORY_LABELS = {"weights": "weights", "gradients": "gradients", "optimizer_state": "Adam state",
                   "weight_copies": "16-bit weight copies", "activations": "saved activations"}


def _check(breakdowns) -> dict:
    if not isinstance(breakdowns, dict) or not breakdowns:
        raise ValueError(f"breakdowns: expected a non-empty dict label -> MemoryBreakdown, got {breakdowns!r}")
    return breakdowns


def memory_figure(breakdowns: dict, title: str = "Memory of one training step, counted from the tensors",
                  subtitle: str | None = None) -> go.Figure:
    """One stacked bar per entry of ``breakdowns`` (label -> :class:`ampviz.memory.MemoryBreakdown`), in MiB."""
    _check(breakdowns)
    fig = go.Figure()
    labels = list(breakdowns)
    for c in CATEGORIES:
        fig.add_bar(x=labels, y=[getattr(b, c) / MIB for b in breakdowns.values()], name=CATEGORY_LABELS[c],
                    marker_color=CATEGORY_COLORS[c],
                    hovertemplate=f"{CATEGORY_LABELS[c]}: %{{y:.3f}} MiB<extra>%{{x}}</extra>")
    fig.add_scatter(x=labels, y=[b.total / MIB for b in breakdowns.values()], mode="text",
                    text=_total_text(breakdowns), textposition="top center", showlegend=False, hoverinfo="skip")
    fig.update_layout(**base_layout(title, subtitle or _dtype_text(breakdowns),
                                    height=440, showlegend=True, barmode="stack", inline_subtitle=True,
                                    legend=dict(traceorder="reversed")))
    fig.update_yaxes(title="MiB", rangemode="tozero")
    _fit_y(fig, breakdowns)
    return fig


def set_memory(fig, breakdowns: dict) -> None:
    """Replace the bar heights of a figure made by :func:`memory_figure` (same labels or new ones)."""
    _check(breakdowns)
    labels = list(breakdowns)
    for trace, c in zip(fig.data, CATEGORIES):
        trace.x = labels
        trace.y = [getattr(b, c) / MIB for b in breakdowns.values()]
    fig.data[len(CATEGORIES)].x = labels
    fig.data[len(CATEGORIES)].y = [b.total / MIB for b in breakdowns.values()]
    fig.data[len(CATEGORIES)].text = _total_text(breakdowns)
    # the subtitle is the title text's second line (see plots._style.title_text): keep the first
    fig.layout.title.text = title_text((fig.layout.title.text or "").partition("<br>")[0], _dtype_text(breakdowns))
    _fit_y(fig, breakdowns)


def _dtype_text(breakdowns) -> str:
    """Subtitle naming the dtypes actually found, e.g. 'weights, gradients, Adam state: float32 in every bar'."""
    parts = []
    for c in ("weights", "gradients", "optimizer_state"):
        found = sorted({d for b in breakdowns.values() for d in b.dtypes.get(c, [])})
        parts.append((CATEGORY_LABELS[c], "/".join(found) or "none"))
    if len({p[1] for p in parts}) == 1:
        return f"weights, gradients, Adam state: {parts[0][1]} in every bar"
    return "; ".join(f"{label}: {d}" for label, d in parts)


def _total_text(breakdowns) -> list[str]:
    first = next(iter(breakdowns.values())).total
    return [f"{b.total / MIB:.2f} MiB" + ("" if i == 0 else f" ({b.total / first:.2f}x)")
            for i, b in enumerate(breakdowns.values())]


def _fit_y(fig, breakdowns) -> None:
    top = max(b.total for b in breakdowns.values()) / MIB
    fig.update_yaxes(range=[0, top * 1.15 if top > 0 else 1])
