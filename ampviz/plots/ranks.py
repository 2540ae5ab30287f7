"""Per-rank comparison of a DDP run: loss scale, flushed share and largest gradient, one line per rank.

    run = ampviz.Run.load("runs/ddp")                  # a directory of rank files
    from ampviz.plots import rank_comparison_figure
    rank_comparison_figure(run, "fp16", kind="activation")

Under DDP the weight gradients are all-reduced before the optimizer sees them, so every rank
records the same weight histograms and (with one GradScaler per rank fed the same gradients) the
same loss scale; activation gradients come from each rank's own micro-batch and differ. Lines
that should coincide and do not point at a rank that diverged.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .. import histogram as H
from ..formats import get_format
from ..run import Run
from .style import REGION_COLORS, base_layout, log2_ticks

__all__ = ["rank_comparison_figure", "RANK_STYLES"]

# ranks differ by colour and dash; no region colour is used, so a rank never reads as a fate
_WIDTHS = (4.5, 2.5, 1.5, 1.0)      # lines that coincide (they should, for weights) all stay visible
RANK_STYLES = [(c, d) for d in ("solid", "dash", "dot", "dashdot")
               for c in ("#000000", "#0072B2", "#56B4E9", "#8C8C8C")]


def rank_comparison_figure(run: Run, format="fp16", *, tensors=None, kind=None,
                           title: str = "Per-rank comparison", height: int = 640) -> go.Figure:
    """Three stacked panels over steps, one line per rank: loss scale, share of gradient values
    that are exactly zero (fp16 activation gradients that underflowed during the run are zeros),
    largest unscaled |gradient|.

    Parameters
    ----------
    run : an ``ampviz.Run`` with one or more ranks.
    format : format the run computed in (named on the figure).
    tensors, kind : restrict the gradient panels to some tensors (names/indices) or a kind
        ("weight" / "activation"); default all.

    Returns
    -------
    plotly Figure with traces named "rank <r> scale", "rank <r> skipped", "rank <r>" (zeros, the
    legend entry) and "rank <r> max".
    """
    if not isinstance(run, Run):
        raise TypeError(f"run: expected an ampviz.Run, got {type(run).__name__}")
    fmt = get_format(format)
    idx = run.tensor_indices(tensors, kind)
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07)
    for i, rank in enumerate(run.ranks):
        color, dash = RANK_STYLES[i % len(RANK_STYLES)]
        line = dict(color=color, dash=dash, width=_WIDTHS[i % len(_WIDTHS)])
        fig.add_trace(go.Scatter(x=run.steps, y=np.log2(run.loss_scale[i]), name=f"rank {rank} scale", mode="lines",
                                 line=dict(line, shape="hv"), legendgroup=str(rank), showlegend=False), 1, 1)
        sk = run.skipped[i].astype(bool)
        fig.add_trace(go.Scatter(x=run.steps[sk], y=np.log2(run.loss_scale[i][sk]), mode="markers",
                                 name=f"rank {rank} skipped", legendgroup=str(rank), showlegend=False,
                                 marker=dict(symbol="x", size=8, color=REGION_COLORS["overflow"])), 1, 1)
        counts = run.pooled_counts("unscaled", rank=rank, tensors=idx)                 # (H, NBINS)
        total = counts.sum(axis=1)
        zeros = np.divide(counts[:, H.ZERO], total, out=np.zeros(total.shape), where=total > 0)
        fig.add_trace(go.Scatter(x=run.hist_steps, y=100 * zeros, name=f"rank {rank}", mode="lines", line=line,
                                 legendgroup=str(rank), meta=f"rank {rank} zeros"), 2, 1)
        top = H.max_magnitude(counts)
        fig.add_trace(go.Scatter(x=run.hist_steps, y=np.where(np.isfinite(top) & (top > 0), np.log2(top), np.nan),
                                 name=f"rank {rank} max", mode="lines", line=dict(line, shape="hv"),
                                 legendgroup=str(rank), showlegend=False), 3, 1)
    what = kind or ("selected tensors" if tensors is not None else "all tensors")
    fig.update_layout(**base_layout(title, f"{len(run.ranks)} rank(s), {fmt.name}; gradient panels: {what}, "
                                    f"unscaled; × skipped step", height=height, showlegend=True, inline_subtitle=True,
                                    legend=dict(orientation="h", x=1, xanchor="right", y=1.0, yanchor="bottom")))
    _axes(fig, run, fmt)
    return fig


def _axes(fig, run: Run, fmt) -> None:
    scales = np.log2(run.loss_scale[np.isfinite(run.loss_scale) & (run.loss_scale > 0)])
    if scales.size:
        lo, hi = float(np.floor(scales.min()) - 1), float(np.ceil(scales.max()) + 1)
        ticks, text = log2_ticks(lo, hi, max_ticks=6, decimals=False)
        fig.update_yaxes(range=[lo, hi], tickvals=ticks, ticktext=text, row=1, col=1)
    fig.update_yaxes(title_text="loss scale (log2)", row=1, col=1)
    fig.update_yaxes(title_text="zeros (%)", rangemode="tozero", row=2, col=1)
    maxima = [np.asarray(t.y, float) for t in fig.data if (t.name or "").endswith(" max")]
    finite = np.concatenate(maxima)[np.isfinite(np.concatenate(maxima))] if maxima else np.zeros(0)
    if finite.size:
        ticks, text = log2_ticks(float(finite.min()) - 1, float(finite.max()) + 1, max_ticks=5)
        fig.update_yaxes(tickvals=ticks, ticktext=text, row=3, col=1)
    fig.update_yaxes(title_text="max |g| (log2)", row=3, col=1)
    fig.update_xaxes(title_text="optimizer step", row=3, col=1)
