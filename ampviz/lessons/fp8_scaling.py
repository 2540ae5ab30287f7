"""fp8 scaling judged by the matrix multiplies it feeds: per-tensor or row-wise, e4m3 or e5m2.

fp8 training recipes cast the inputs of each linear layer's three GEMMs -- ``Y = X Wᵀ`` (forward),
``dX = g W`` and ``dW = gᵀ X`` (backward, ``g`` the output gradient) -- each with a scale chosen from
an amax. :func:`quantize` does that cast for real (``(x * scale).to(float8)``, divided back) with one
power-of-two scale per tensor, per row or per column; :func:`gemm_errors` runs the three GEMMs on
cast inputs and measures their relative error against fp32; :func:`dx_row_errors` does it sample by
sample. "Row-wise" means what torchao's rowwise recipe does: each operand is scaled along the GEMM's
reduction dimension, one scale per row of the result it contributes to::

    import torch.nn.functional as F
    from ampviz.lessons.fp8_scaling import capture_linear_operands, gemm_errors
    ops = capture_linear_operands(model, F.cross_entropy, x, y)           # {name: LinearOperands}
    gemm_errors(ops["head"], backward="fp8_e4m3fn", granularity="row")    # {"Y": .., "dX": .., "dW": ..}

The scales are powers of two, the largest with ``amax * scale <= max`` (:func:`amax_scale`), so a scale
only moves the window of representable values: what survives the cast keeps the format's own precision.

Used by lessons 08b (fp8 scaling).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
import torch
import torch.nn as nn

from ..formats import get_format
from ..plots.style import OKABE_ITO, base_layout

__all__ = ["GRANULARITIES", "LinearOperands", "quantize", "amax_scale", "capture_linear_operands", "gemm_errors",
           "dx_row_errors", "row_error_figure", "strategies_figure"]

GRANULARITIES = ("tensor", "row", "column")


def quantize(x: torch.Tensor, format, granularity: str = "tensor") -> torch.Tensor:
    """``x`` cast to ``format`` with power-of-two amax scales and divided back (float32).

    Parameters
    ----------
    x : a 2-D floating-point tensor.
    format : a format with a torch dtype ("fp8_e4m3fn", "fp8_e5m2", "bf16", ...).
    granularity : one scale for the whole tensor ("tensor"), per row ("row") or per column ("column").
        Slices that are all zero keep scale 1.
    """
    fmt = get_format(format)
    if fmt.dtype is None:
        raise ValueError(f"format: {fmt.name} has no torch dtype to cast to")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise TypeError(f"x: expected a 2-D floating-point tensor, got {type(x).__name__}"
                        f"{'' if not isinstance(x, torch.Tensor) else f' of shape {tuple(x.shape)}'}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    x = x.detach().float()
    amax = {"tensor": lambda: x.abs().amax(), "row": lambda: x.abs().amax(dim=1, keepdim=True),
            "column": lambda: x.abs().amax(dim=0, keepdim=True)}[granularity]()
    scale = amax_scale(amax, fmt)
    return (x * scale).to(fmt.dtype).float() / scale


def amax_scale(amax: torch.Tensor, format) -> torch.Tensor:
    """The largest power of two ``s`` with ``amax * s <= format.max`` (1 where ``amax`` is 0), elementwise,
    capped at ``2**126`` so that it stays a finite float32.

    torchao's rowwise recipe rounds its scales ``max / amax`` down to a power of two the same way.
    """
    fmt = get_format(format)
    amax = amax.double()
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    exponent = torch.floor(torch.log2(fmt.max / safe))
    exponent = exponent - (safe * torch.exp2(exponent) > fmt.max).double()    # guard against log2 rounding up
    exponent = exponent.clamp(max=126.0)         # a finite float32 scale (only wide formats such as fp32 reach it)
    return torch.where(amax > 0, torch.exp2(exponent), torch.ones_like(amax)).float()


@dataclass
class LinearOperands:
    """The three GEMM operands of one ``nn.Linear`` for one batch: input ``x`` (batch, in), ``weight``
    (out, in) and output gradient ``grad`` (batch, out), all detached float32."""

    x: torch.Tensor
    weight: torch.Tensor
    grad: torch.Tensor

    def reference(self) -> dict:
        """The three GEMMs in float32: ``Y = x Wᵀ``, ``dX = g W``, ``dW = gᵀ x``."""
        return _gemms(self.x, self.weight, self.grad, self.weight, self.grad, self.x)


def _gemms(x, w, g, w_for_dx, g_for_dw, x_for_dw) -> dict:
    return {"Y": x @ w.T, "dX": g @ w_for_dx, "dW": g_for_dw.T @ x_for_dw}


def capture_linear_operands(model: nn.Module, loss_fn, x, y) -> dict:
    """One fp32 forward and backward; every ``nn.Linear``'s input, weight and output gradient.

    Uses ``torch.autograd.grad``, so ``.grad`` of the parameters is untouched. Returns
    ``{module name: LinearOperands}`` in module order.
    """
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("model: expected at least one nn.Linear")
    inputs, outputs = {}, {}

    def hook(name):
        def record(module, args, out):
            inputs[name], outputs[name] = args[0].detach(), out
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in linears]
    try:
        loss = loss_fn(model(x), y)
    finally:
        for h in handles:
            h.remove()
    grads = torch.autograd.grad(loss, [outputs[n] for n, _ in linears])
    return {n: LinearOperands(inputs[n].reshape(-1, m.in_features).float(), m.weight.detach().float(),
                              g.detach().reshape(-1, m.out_features).float())
            for (n, m), g in zip(linears, grads)}


def _cast_gemms(ops: LinearOperands, forward, backward, granularity: str) -> dict:
    """The three GEMMs on cast operands. Row-wise: each operand scaled along the GEMM's reduction dim."""
    if granularity not in ("tensor", "row"):
        raise ValueError(f"granularity: expected 'tensor' or 'row', got {granularity!r}")
    q = quantize
    if granularity == "tensor":
        x, w, g = q(ops.x, forward), q(ops.weight, forward), q(ops.grad, backward)
        return _gemms(x, w, g, w, g, x)
    return _gemms(q(ops.x, forward, "row"), q(ops.weight, forward, "row"), q(ops.grad, backward, "row"),
                  q(ops.weight, forward, "column"), q(ops.grad, backward, "column"), q(ops.x, forward, "column"))


def gemm_errors(ops: LinearOperands, forward="fp8_e4m3fn", backward="fp8_e5m2", granularity: str = "tensor") -> dict:
    """Relative error ``‖C' − C‖ / ‖C‖`` (Frobenius) of each GEMM with cast inputs: ``{"Y", "dX", "dW"}``.

    ``forward`` is the format of ``x`` and the weight, ``backward`` that of the output gradient;
    ``granularity`` "tensor" (one scale per operand) or "row" (row-wise, as above).
    """
    ref, cast = ops.reference(), _cast_gemms(ops, forward, backward, granularity)
    return {k: float((cast[k] - ref[k]).norm() / ref[k].norm()) if ref[k].norm() > 0 else 0.0 for k in ref}


def dx_row_errors(ops: LinearOperands, forward="fp8_e4m3fn", backward="fp8_e5m2",
                  granularity: str = "tensor") -> np.ndarray:
    """Relative error of ``dX`` sample by sample (one value per row whose true ``dX`` is non-zero)."""
    ref, cast = ops.reference()["dX"], _cast_gemms(ops, forward, backward, granularity)["dX"]
    norms = ref.norm(dim=1)
    keep = norms > 0
    return ((cast - ref).norm(dim=1)[keep] / norms[keep]).cpu().numpy()


_COLORS = {("tensor", "fp8_e4m3fn"): OKABE_ITO["vermillion"], ("tensor", "fp8_e5m2"): OKABE_ITO["orange"],
           ("row", "fp8_e4m3fn"): OKABE_ITO["blue"], ("row", "fp8_e5m2"): OKABE_ITO["sky_blue"]}


def row_error_figure(errors: dict, title: str = "Per-sample error of dX = g W") -> go.Figure:
    """Sorted per-sample errors, one line per ``(granularity, backward format)`` key of ``errors``."""
    if not errors:
        raise ValueError("errors: expected at least one curve")
    fig = go.Figure()
    for (granularity, fmt), values in errors.items():
        v = np.sort(np.asarray(values, dtype=float))[::-1]
        fig.add_scatter(x=np.arange(1, v.size + 1), y=np.maximum(v, 1e-6), mode="lines",
                        name=f"{'per-tensor' if granularity == 'tensor' else 'row-wise'} scale, g in {fmt}",
                        line=dict(color=_COLORS.get((granularity, fmt), "#444444"),
                                  width=5 if granularity == "tensor" else 2.5,     # wide below, so a match shows
                                  dash="solid" if fmt == "fp8_e4m3fn" else "dash"))
    fig.add_hline(y=1.0, line=dict(color="#888888", dash="dot", width=1))
    fig.add_annotation(x=1.0, xref="x domain", y=0.0, yref="y", yanchor="bottom", xanchor="right", showarrow=False,
                       text="100%: the sample's gradient is lost", font=dict(size=12, color="#555555"))
    fig.update_layout(**base_layout(title, "samples sorted from worst to best; error = ‖row error‖ / ‖row‖",
                                    height=460, showlegend=True, margin=dict(l=70, r=30, t=90, b=120),
                                    legend=dict(orientation="h", x=0.0, y=-0.22, yanchor="top")))
    fig.update_xaxes(title_text="sample (sorted)")
    fig.update_yaxes(title_text="relative error of the sample's dX", type="log", dtick=1, exponentformat="power",
                     range=[-3, 0.3])
    return fig


def strategies_figure(flushed: dict, names, title: str = "What a scale per tensor saves") -> go.Figure:
    """Grouped bars: share of non-zero values flushed, per tensor, for each ``(format, strategy)`` key."""
    strategy_colors = {"none": OKABE_ITO["vermillion"], "shared": OKABE_ITO["orange"],
                       "per-tensor": OKABE_ITO["bluish_green"]}
    formats = list(dict.fromkeys(f for f, _ in flushed))
    fig = go.Figure()
    for (fmt, strategy), shares in flushed.items():
        fig.add_bar(x=[[fmt] * len(names), list(names)], y=list(shares), name=strategy, legendgroup=strategy,
                    showlegend=fmt == formats[0], marker_color=strategy_colors.get(strategy, "#444444"))
    fig.update_layout(**base_layout(title, "share of each tensor's non-zero values that a cast flushes to zero",
                                    height=420, showlegend=True, barmode="group",
                                    legend=dict(title_text="scale", orientation="h", y=-0.25)))
    fig.update_yaxes(tickformat=".0%", title_text="flushed to zero")
    return fig
