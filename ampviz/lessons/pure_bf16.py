"""Lesson 07's pure-bf16 run and its fp32-master twin, both recorded live with ``Recorder(..., updates=N)``.

:func:`train_recorded` trains a small LayerNorm network on the digits with Adam, either with every parameter
stored in bf16 (``pure=True``: the optimizer steps bf16 weights) or with fp32 parameters and a bf16 autocast
forward (``pure=False``: fp32 master weights). Both start from the same weights and see the same batches.
:func:`update_shares` reads from the recorded run, per parameter, the share of stepped elements whose gradient was
non-zero but whose weight did not move (stalled), that did not move with a zero gradient, and that moved;
:func:`stall_figure` draws the two runs side by side::

    from ampviz.lessons.data import digits
    from ampviz.lessons.pure_bf16 import stall_figure, train_recorded, update_shares
    runs = {name: train_recorded(digits(), pure=pure)[0] for name, pure in (("pure bf16", True),
                                                                           ("fp32 master", False))}
    stall_figure({name: update_shares(run) for name, run in runs.items()})

Used by lessons 07 (master weights, section 4); ``tests/lessons/test_pure_bf16.py`` runs it over seeds.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import plotly.graph_objects as go
import torch
import torch.nn as nn
import torch.nn.functional as F
from plotly.subplots import make_subplots

import ampviz

from .. import histogram as H
from ..plots.style import OKABE_ITO, REGION_COLORS, ZERO_COLOR, base_layout, percent
from .data import Split

__all__ = ["norm_net", "train_recorded", "update_shares", "moved_elements", "largest_rel_step", "compare",
           "stall_figure", "OUTCOMES", "LR"]

LR = 1e-4                      # Adam's step is at most about lr: far below half a bf16 ulp of a weight near 1 (2**-9)


def norm_net(seed: int = 0, d_in: int = 64, width: int = 64, d_out: int = 10) -> nn.Sequential:
    """``fc`` (Linear) → ``norm`` (LayerNorm, weight 1 and bias 0 at init) → ReLU → ``head`` (Linear), seeded.

    The initial weights are rounded to bf16 (and stored back in fp32), so that the pure-bf16 and the fp32-master
    runs start from exactly the same values.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(OrderedDict(fc=nn.Linear(d_in, width), norm=nn.LayerNorm(width), act=nn.ReLU(),
                                      head=nn.Linear(width, d_out)))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    return model


def train_recorded(data: Split, pure: bool, seed: int = 0, lr: float = LR, steps: int = 200, updates: int = 5,
                   batch_size: int = 64) -> tuple[ampviz.Run, nn.Module, torch.optim.Adam]:
    """Train :func:`norm_net` with Adam for ``steps`` steps under ``ampviz.Recorder(model, opt, updates=updates)``.

    Parameters
    ----------
    data : the digits (``ampviz.lessons.data.digits``), on the CPU or a GPU.
    pure : True: parameters, gradients and Adam's state in bf16 (``model.to(torch.bfloat16)``); False: fp32
        parameters, forward under ``torch.amp.autocast(..., dtype=torch.bfloat16)`` (fp32 master weights).
    seed : initial weights (``norm_net(seed)``) and batch order (``seed + 1``); the same for both variants.
    lr : Adam's learning rate. updates : measure the applied updates every this many steps.

    Returns
    -------
    (run, model, optimizer): the recorded ``ampviz.Run``, the trained model and its Adam optimizer.
    """
    device = data.x_train.device
    model = norm_net(seed).to(device)
    if pure:
        model = model.to(torch.bfloat16)                  # no fp32 copy anywhere: the optimizer steps bf16 weights
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    order = torch.Generator().manual_seed(seed + 1)       # the same batches for both variants
    rec = ampviz.Recorder(model, opt, activations=False, updates=updates)
    with rec:
        for _ in range(steps):
            idx = torch.randint(0, len(data.x_train), (batch_size,), generator=order).to(device)
            x = data.x_train[idx].to(torch.bfloat16 if pure else torch.float32)
            with torch.amp.autocast(device.type, dtype=torch.bfloat16, enabled=not pure):
                loss = F.cross_entropy(model(x).float(), data.y_train[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec.step(loss)
    return rec.run, model, opt


OUTCOMES = ("stalled", "still, zero gradient", "moved")     # the three fates of a stepped element


def update_shares(run: ampviz.Run) -> dict[str, dict[str, float]]:
    """Per weight tensor, how its stepped elements fared (summed over the measured steps), as shares adding up to 1.

    ``stalled``: gradient non-zero, weight unchanged (``run.update_stalled``); ``still, zero gradient``: unchanged with
    a zero gradient (column 0 of ``run.update_counts``, the elements that did not move, less the stalled ones);
    ``moved``: the rest.
    """
    if run.update_steps is None:
        raise ValueError("run: no updates recorded (Recorder(..., updates=N))")
    out = {}
    for j, t in enumerate(run.tensors_of("weight")):
        counts = run.update_counts[:, :, j]                      # (ranks, measured steps, bins)
        stepped, still = int(counts.sum()), int(counts[..., 0].sum())
        stalled = int(run.update_stalled[:, :, j].sum())
        shares = (stalled, still - stalled, stepped - still)
        out[run.tensor_names[t]] = {k: v / stepped if stepped else 0.0 for k, v in zip(OUTCOMES, shares)}
    return out


def moved_elements(run: ampviz.Run, name: str) -> int:
    """How many elements of parameter ``name`` moved, summed over the measured steps (``|dw| / ulp > 0``: every
    column of ``run.update_counts`` but column 0, the weights that did not move)."""
    j = [run.tensor_names[t] for t in run.tensors_of("weight")].index(name)
    return int(run.update_counts[:, :, j, 1:].sum())


def largest_rel_step(run: ampviz.Run, name: str) -> float:
    """An upper bound on ``|dw| / |w|`` over the measured steps of parameter ``name``: the top edge of the highest
    non-empty binade of ``run.update_rel_counts`` (0.0 when nothing moved)."""
    j = [run.tensor_names[t] for t in run.tensors_of("weight")].index(name)
    counts = run.update_rel_counts[:, :, j].sum(axis=(0, 1))        # (bins,) binade k + column(0): (2**k, 2**(k+1)]
    moved = np.nonzero(counts[1:H.NAN])[0]
    return 0.0 if moved.size == 0 else 2.0 ** (int(moved.max()) + 1 - H.column(0) + 1)


def compare(data: Split, seed: int = 0, lr: float = LR, steps: int = 200, updates: int = 5) -> dict:
    """Both runs of :func:`train_recorded` (same seed) and what lesson 07 asserts about them.

    Returns
    -------
    dict: ``runs`` and ``models`` (``{"pure bf16": ..., "fp32 master": ...}``), ``shares`` (per run,
    :func:`update_shares`), ``reports`` (per run, ``run.diagnose()``), ``norm_moved`` (per run, norm-weight elements
    that moved, from the recording), ``norm_drift`` (per run, the largest ``|w - 1|`` of the trained norm weights, read
    from the model), ``largest_rel_step`` (per run, :func:`largest_rel_step` of the norm weights), ``dtypes`` (per run,
    the dtypes of the parameters and of Adam's state) and ``measured_steps``.
    """
    out: dict = {k: {} for k in ("runs", "models", "shares", "reports", "norm_moved", "norm_drift", "largest_rel_step",
                                 "dtypes")}
    for name, pure in (("pure bf16", True), ("fp32 master", False)):
        run, model, opt = train_recorded(data, pure, seed=seed, lr=lr, steps=steps, updates=updates)
        out["runs"][name], out["models"][name] = run, model
        out["shares"][name] = update_shares(run)
        out["reports"][name] = run.diagnose()
        out["norm_moved"][name] = moved_elements(run, "norm.weight")
        out["norm_drift"][name] = (model.norm.weight.detach().float() - 1).abs().max().item()
        out["largest_rel_step"][name] = largest_rel_step(run, "norm.weight")
        state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]     # exp_avg, exp_avg_sq
        out["dtypes"][name] = {"parameters": {str(p.dtype) for p in model.parameters()},
                               "Adam's state": {str(t.dtype) for t in state}}
    out["measured_steps"] = len(run.update_steps)
    return out


def _order(names: list[str]) -> list[str]:
    """Norm parameters first, then biases, then the other weights (the doctor's order), model order inside each."""
    return sorted(names, key=lambda n: 0 if n.startswith("norm.") else 1 if n.endswith("bias") else 2)


_COLORS = {"stalled": REGION_COLORS["flushed"], "still, zero gradient": ZERO_COLOR, "moved": OKABE_ITO["bluish_green"]}
_LABELS = {"stalled": "did not move, gradient non-zero (stalled)",
           "still, zero gradient": "did not move, gradient zero", "moved": "moved"}


def stall_figure(shares: dict, title: str = "What became of each update, per parameter") -> go.Figure:
    """One panel per run: per parameter (norm first, then biases), stacked bars of its stepped elements that
    stalled, stayed still with a zero gradient, or moved; the stalled share is written beside each bar.

    Parameters
    ----------
    shares : ``{run name: {parameter name: {outcome: share}}}`` (from :func:`update_shares`).
    """
    if not shares:
        raise ValueError("shares: expected at least one run")
    names = _order(list(next(iter(shares.values()))))
    fig = make_subplots(rows=1, cols=len(shares), shared_yaxes=True, horizontal_spacing=0.1,
                        subplot_titles=list(shares))
    for col, (run_name, per_param) in enumerate(shares.items(), start=1):
        for outcome in OUTCOMES:
            fig.add_bar(y=names, x=[per_param[n][outcome] for n in names], name=_LABELS[outcome], orientation="h",
                        marker_color=_COLORS[outcome], legendgroup=outcome, showlegend=col == 1, row=1, col=col,
                        hovertemplate="%{y}: %{x:.2%} " + _LABELS[outcome] + "<extra>" + run_name + "</extra>")
        axis = "x" if col == 1 else f"x{col}"
        for n in names:                                  # the stalled share, written beside each bar
            fig.add_annotation(xref=f"{axis} domain", x=1.01, yref="y", y=n, xanchor="left", showarrow=False,
                               text=percent(per_param[n]["stalled"]), font=dict(color=_COLORS["stalled"], size=12))
        fig.update_xaxes(title_text="share of the elements stepped", tickformat=".0%", range=[0, 1], row=1, col=col)
    fig.update_yaxes(autorange="reversed")               # the first name (a norm parameter) on top
    fig.update_layout(**base_layout(title, "measured by Recorder(..., updates=N) around each measured optimizer "
                                    "step, summed over those steps", height=420, barmode="stack", showlegend=True,
                                    legend=dict(orientation="h", y=-0.28), margin=dict(l=100, r=60, t=100, b=110)))
    return fig
