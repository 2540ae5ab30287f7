"""Loss-scale trace on a log2 axis: skipped steps and growth events marked, optionally a replay.

    from ampviz.plots import scale_trace_figure
    from ampviz.replay import TorchPolicy, replay, trace_from_run, policy_from_run
    trace = trace_from_run(run)
    what_if = replay(TorchPolicy(init_scale=2.0**10), trace)
    scale_trace_figure(run.steps, run.loss_scale[0], run.skipped[0], run.grown[0],
                       replay=what_if, trace=trace)

``trace`` (the per-step largest unscaled |gradient|) adds the ceiling: the largest scale that
would not have overflowed at each step, ``overflow_threshold / max|g|``. A scale above it skips.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from ..formats import get_format
from .style import DATA_COLOR, REGION_COLORS, REPLAY_COLOR, apply_layout, base_layout, log2_ticks

__all__ = ["scale_trace_figure", "set_replay", "set_recorded", "log2_or_none", "TRACES"]

# trace order of every scale-trace figure (names carry counts, so look traces up by index)
TRACES = {n: i for i, n in enumerate(("ceiling", "recorded", "recorded skipped", "recorded grown", "replay",
                                          "replay skipped", "replay grown"))}

_SKIP = REGION_COLORS["overflow"]        # a skipped step is an overflow: same colour as the region
_CEILING = "#BBBBBB"


def log2_or_none(values) -> np.ndarray:
    """log2 of positive finite values; nan elsewhere (drawn as gaps)."""
    v = np.asarray(values, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log2(v)
    return np.where(np.isfinite(out), out, np.nan)


def _check_1d(name: str, values, n: int | None, dtype=float) -> np.ndarray:
    a = np.asarray(values, dtype=dtype)
    if a.ndim != 1 or (n is not None and a.size != n):
        want = f"length {n}" if n is not None else "a 1-D sequence"
        raise ValueError(f"{name}: expected {want} (one value per step), got shape {a.shape}")
    return a


def scale_trace_figure(steps, loss_scale, skipped=None, grown=None, *, replay=None, trace=None,
                       format="fp16", title: str = "Loss scale", height: int = 400) -> go.Figure:
    """The loss scale per step (log2 axis) with skipped steps (×) and growth events (▲).

    Parameters
    ----------
    steps, loss_scale : per-step arrays (the scale each step used); ``loss_scale`` None draws
        no recorded line (a replay of a plain trace).
    skipped, grown : per-step bools (the step was skipped / the scale grew after it).
    replay : an ``ampviz.replay.Replay`` over the same steps, drawn dashed with its own skips.
    trace : per-step largest unscaled |gradient|; draws the no-overflow ceiling for ``format``.
    format : format whose overflow threshold sets the ceiling.

    Returns
    -------
    plotly Figure with traces "recorded", "recorded skipped", "recorded grown", "replay",
    "replay skipped", "replay grown", "ceiling" (empty when not given).
    """
    steps = _check_1d("steps", steps, None)
    n = steps.size
    recorded = loss_scale is not None
    scale = _check_1d("loss_scale", loss_scale, n) if recorded else np.full(n, np.nan)
    skipped = np.zeros(n, bool) if skipped is None else _check_1d("skipped", skipped, n, bool)
    grown = np.zeros(n, bool) if grown is None else _check_1d("grown", grown, n, bool)
    y = log2_or_none(scale)
    fig = go.Figure()
    ceiling = _ceiling(trace, n, format)
    fig.add_trace(go.Scatter(x=steps, y=ceiling, name="ceiling", mode="lines", line=dict(color=_CEILING, width=1),
                             visible=trace is not None,
                             hovertemplate="step %{x}: overflow above 2^%{y:.1f}<extra>ceiling</extra>"))
    fig.add_trace(go.Scatter(x=steps, y=y, name="recorded", mode="lines", line=dict(color=DATA_COLOR, width=2.5,
                             shape="hv"), hovertemplate="step %{x}: 2^%{y:.0f}<extra>recorded</extra>"))
    _add_markers(fig, "recorded", steps, y, skipped, grown, filled=True)
    for name in ("recorded", "recorded skipped", "recorded grown"):
        fig.data[TRACES[name]].visible = recorded
    fig.add_trace(go.Scatter(x=[], y=[], name="replay", mode="lines", hovertemplate="step %{x}: 2^%{y:.1f}"
                             "<extra>replay</extra>", line=dict(color=REPLAY_COLOR, width=2, dash="dash", shape="hv")))
    _add_markers(fig, "replay", [], [], [], [], filled=False)
    for name in ("replay", "replay skipped", "replay grown"):     # shown once a replay is set
        fig.data[TRACES[name]].visible = False
    fig.add_vline(x=0, visible=False, line=dict(color=REPLAY_COLOR, dash="dot", width=1.5), name="replay stop")
    lo, hi = _y_range([y, ceiling] + ([log2_or_none(replay.scale)] if replay is not None else []))
    ticks, text = log2_ticks(lo, hi, decimals=False)
    fig.update_layout(**base_layout(title, _subtitle(format, trace is not None), height=height, inline_subtitle=True,
                                    showlegend=True, legend=dict(x=1.02, y=1.0, yanchor="top"),
                                    margin=dict(l=70, r=20, t=80, b=60)))
    fig.update_xaxes(title_text="optimizer step", ticks="outside")
    fig.update_yaxes(title_text="loss scale (log2)", range=[lo, hi], tickvals=ticks, ticktext=text, ticks="outside")
    if replay is not None:
        set_replay(fig, replay, steps)
    return fig


def _subtitle(format, has_ceiling: bool) -> str:
    text = "× skipped step (gradients overflowed), ▲ scale grew"
    if has_ceiling:
        text += f"; grey: largest scale without {get_format(format).name} overflow"
    return text


def _ceiling(trace, n: int, format) -> np.ndarray:
    if trace is None:
        return np.full(n, np.nan)
    mags = _check_1d("trace", trace, n)
    with np.errstate(divide="ignore"):
        return log2_or_none(get_format(format).overflow_threshold / mags)


def _y_range(series) -> tuple:
    vals = np.concatenate([np.asarray(s, float) for s in series])
    vals = vals[np.isfinite(vals)]
    if vals.size == 0:
        return -1.0, 1.0
    return float(np.floor(vals.min()) - 1), float(np.ceil(vals.max()) + 1)


def _add_markers(fig, which: str, steps, y, skipped, grown, filled: bool) -> None:
    steps, y = np.asarray(steps), np.asarray(y)
    sk, gr = np.asarray(skipped, bool), np.asarray(grown, bool)
    skip_name, grow_name = _marker_names(which, sk, gr)
    (sx, sy), (gx, gy) = _points(steps, y, sk), _points(steps, y, gr)
    fig.add_trace(go.Scatter(x=sx, y=sy, name=skip_name,
                             mode="markers", marker=dict(symbol="x" if filled else "circle-open", size=9, color=_SKIP,
                                                         line=dict(width=1.5, color=_SKIP)),
                             hovertemplate=f"step %{{x}}: skipped<extra>{which}</extra>"))
    fig.add_trace(go.Scatter(x=gx, y=gy, name=grow_name,
                             mode="markers", marker=dict(symbol="triangle-up" if filled else "triangle-up-open",
                                                         size=8, color="#000000"),
                             hovertemplate=f"step %{{x}}: scale grew<extra>{which}</extra>"))


def _points(x, y, mask) -> tuple:
    """Marker positions where ``mask``; one empty point when there are none, so that the legend
    still lists the trace (with its count of 0)."""
    if not np.any(mask):
        return [None], [None]
    return np.asarray(x)[mask], np.asarray(y)[mask]


def _marker_names(which: str, skipped, grown) -> tuple:
    """Legend names carry the counts, so the figure alone says how many steps were skipped."""
    n_grown = int(np.sum(grown))
    return f"{which}: {int(np.sum(skipped))} skipped", f"{which}: {n_grown} growth{'' if n_grown == 1 else 's'}"


def set_recorded(fig, steps, loss_scale, skipped, grown) -> None:
    """Replace the recorded line and its skip / growth markers of a scale-trace figure (in place)."""
    steps = _check_1d("steps", steps, None)
    n = steps.size
    y = log2_or_none(_check_1d("loss_scale", loss_scale, n))
    sk, gr = _check_1d("skipped", skipped, n, bool), _check_1d("grown", grown, n, bool)
    line, skip, grow = (fig.data[TRACES[name]] for name in ("recorded", "recorded skipped", "recorded grown"))
    line.x, line.y = steps, y
    (skip.x, skip.y), (grow.x, grow.y) = _points(steps, y, sk), _points(steps, y, gr)
    skip.name, grow.name = _marker_names("recorded", sk, gr)


def set_replay(fig, replay, steps=None) -> None:
    """Draw ``replay`` (an ``ampviz.replay.Replay``) into a scale-trace figure (in place).

    ``steps`` defaults to the recorded line's steps. A DeepSpeed replay that ends early
    ("loss scale already at minimum") is drawn up to the step where it stopped.
    """
    steps = np.asarray(fig.data[TRACES["recorded"]].x if steps is None else steps)
    k = replay.scale.size
    x, y = steps[:k].astype(np.float64), log2_or_none(replay.scale)      # float64: binary transfer
    sk, gr = np.asarray(replay.skipped, bool), np.asarray(replay.grown, bool)
    line, skip, grow = (fig.data[TRACES[name]] for name in ("replay", "replay skipped", "replay grown"))
    name = getattr(replay.policy, "name", "replay")
    line.x, line.y, line.name = x, y, f"replay ({name})"
    for t in (line, skip, grow):
        t.visible = True
    if replay.crashed_at is not None:
        line.name += f", stops at step {int(steps[replay.crashed_at])}"
    (skip.x, skip.y), (grow.x, grow.y) = _points(x, y, sk), _points(x, y, gr)
    skip.name, grow.name = _marker_names("replay", sk, gr)
    updates = {"shapes[0].visible": replay.crashed_at is not None}    # the "replay stops here" line
    if replay.crashed_at is not None:
        updates["shapes[0].x0"] = updates["shapes[0].x1"] = float(steps[replay.crashed_at])
    lo, hi = fig.layout.yaxis.range
    finite = y[np.isfinite(y)]
    if finite.size and (finite.min() < lo or finite.max() > hi):     # keep the replay on screen
        lo, hi = min(lo, float(np.floor(finite.min()) - 1)), max(hi, float(np.ceil(finite.max()) + 1))
        ticks, text = log2_ticks(lo, hi, decimals=False)
        updates.update({"yaxis.range": [lo, hi], "yaxis.tickvals": ticks, "yaxis.ticktext": text})
    apply_layout(fig, updates)
