"""Block-scaled casts (MXFP8, MXFP4, NVFP4) done for real, judged by the GEMMs they feed.

:func:`quantize_blocks` casts a 2-D tensor in blocks along its last dimension and divides back (float32):
OCP MX (one power-of-two E8M0 scale per block: the spec's ``2**(floor(log2 amax) - emax)`` or RCEIL's
``amax / max`` rounded up; a real
``torch.float8_e8m0fnu`` cast, elements cast with saturation) for any block size, or NVFP4 (blocks of 16, an
E4M3 block scale under a per-tensor fp32 scale). These mirror the reference casts of ``tests/test_blocks.py``
that ``ampviz.blocks`` is checked against. E2M1 elements are rounded onto the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}
to nearest-even here, since torch 2.13 cannot cast to ``float4_e2m1fn_x2`` on the CPU.

:func:`cast_gemm_errors` blocks each GEMM operand along that GEMM's reduction dimension (``Y = X Wᵀ``: X and W
along ``in``; ``dX = g W``: g along ``out``, W down its columns; ``dW = gᵀ X``: g and X down the batch) and
measures the relative error of ``Y``, ``dX``, ``dW`` against fp32::

    from functools import partial
    from ampviz.lessons.block_scaling import cast_gemm_errors, quantize_blocks
    cast_gemm_errors(ops["head"], partial(quantize_blocks, element="e4m3", block=32))   # MXFP8 E4M3

:class:`BlockSizeExplorer` shows those errors over block sizes 16 ... a whole row, for E4M3 or E2M1 elements,
under either scale rule.

Used by lessons 08b (fp8 scaling).
"""

from __future__ import annotations

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
import torch
import torch.nn.functional as F

from ..blocks import E2M1
from ..formats import FP8_E4M3FN, FP8_E5M2
from ..plots.style import OKABE_ITO, base_layout, title_text
from ..widgets.parts import figure_widget, table_html
from .fp8_scaling import LinearOperands

__all__ = ["ELEMENTS", "BLOCK_SIZES", "RULES", "round_e2m1", "cast_elements", "quantize_blocks", "quantize_nvfp4",
           "mx_fates", "cast_gemm_errors", "block_errors", "block_figure", "BlockSizeExplorer"]

ELEMENTS = {"e4m3": FP8_E4M3FN, "e5m2": FP8_E5M2, "e2m1": E2M1}
BLOCK_SIZES = (("16", 16), ("32", 32), ("64", 64), ("128", 128), ("whole row", None))
RULES = {"ocp": "OCP floor", "rceil": "RCEIL round-up"}                      # the scale rules, named
GEMMS = ("Y", "dX", "dW")


def round_e2m1(q: torch.Tensor) -> torch.Tensor:
    """Round to E2M1 nearest-even without clamping (|q| > 6 may give 8, 12, ...): 1 mantissa bit, emin 0."""
    a = q.abs()
    e = torch.floor(torch.log2(torch.where(a > 0, a, 1.0))).clamp(min=0)   # subnormals share emin = 0
    quantum = torch.exp2(e - 1)
    return torch.copysign(torch.round(a / quantum) * quantum, q)           # torch.round: half to even


def cast_elements(q: torch.Tensor, element: str) -> torch.Tensor:
    """The saturating cast of already-scaled values to ``element`` ("e4m3", "e5m2", "e2m1"), as float32."""
    if element == "e2m1":
        return round_e2m1(q).clamp(-6.0, 6.0)
    fmt = ELEMENTS[element]
    return q.clamp(-fmt.max, fmt.max).to(fmt.dtype).float()


def _blocks(x: torch.Tensor, block: int | None) -> torch.Tensor:
    """(rows, K) -> (rows, n_blocks, block), the last block zero-padded (padding changes no block's amax)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise TypeError(f"x: expected a 2-D floating-point tensor, got {type(x).__name__}")
    block = x.shape[1] if block is None else block
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block: expected a positive integer or None (a whole row), got {block!r}")
    x = F.pad(x.detach().float(), (0, -x.shape[1] % block))
    return x.view(x.shape[0], -1, block)


def quantize_blocks(x: torch.Tensor, element: str = "e4m3", block: int | None = 32, rule: str = "ocp") -> torch.Tensor:
    """``x`` cast in blocks of ``block`` values along its last dimension (None: a whole row), one power-of-two
    E8M0 scale ``X`` per block, divided back (float32, same shape).

    ``rule`` "ocp": the OCP MX spec's ``X = 2**(floor(log2 amax) - emax)`` (torchao's FLOOR mode), which puts
    the block's amax in ``[2**emax, 2**(emax+1))``, so the largest values can exceed the element's max and
    saturate (E4M3 above 448 = 1.75 * 2**8); "rceil": ``amax / max`` rounded up to a power of two, the smallest
    ``X`` with ``amax / X <= max`` (torchao's RCEIL mode, Transformer Engine's ``MXFP8BlockScaling``; as
    ``fp8_scaling.amax_scale`` per tensor), which never saturates.
    """
    if element not in ELEMENTS:
        raise ValueError(f"element: expected one of {tuple(ELEMENTS)}, got {element!r}")
    if rule not in ("ocp", "rceil"):
        raise ValueError(f"rule: expected 'ocp' or 'rceil', got {rule!r}")
    b = _blocks(x, block)
    amax = b.abs().amax(dim=2, keepdim=True)
    fmt = ELEMENTS[element]
    exponent = (torch.frexp(amax)[1] - 1).float() - fmt.emax
    if rule == "rceil":                     # one binade up where the amax would land above max
        exponent = exponent + (amax > fmt.max * torch.exp2(exponent)).float()
    exponent = torch.where(amax > 0, exponent, -127.0)
    scale = torch.exp2(exponent.clamp(-127, 127)).to(torch.float8_e8m0fnu).float()    # a real E8M0 scale
    out = cast_elements(b / scale, element) * scale
    return out.reshape(x.shape[0], -1)[:, :x.shape[1]]


def mx_fates(x: torch.Tensor, element: str = "e4m3", block: int | None = 32) -> dict:
    """Counts read off real OCP MX casts of ``x`` (blocks along its last dimension): ``{"nonzero", "flushed",
    "saturated"}``. Saturated values are those whose scaled magnitude rounds past the element's max (seen
    without the clamp: E4M3 cast at half the value, E2M1 rounded without clamping; E5M2 gives inf)."""
    b = _blocks(x, block)
    deq = quantize_blocks(b.reshape(-1, b.shape[2]), element, None)       # one block per row: the same scales
    amax = b.abs().amax(dim=2, keepdim=True).reshape(-1, 1)
    scale = torch.exp2((torch.frexp(amax)[1] - 1).float() - ELEMENTS[element].emax)
    q, v = b.reshape(-1, b.shape[2]) / scale, b.reshape(-1, b.shape[2])
    if element == "e4m3":
        over = (q / 2).to(torch.float8_e4m3fn).float().abs() * 2 > 448
    elif element == "e5m2":
        over = torch.isinf(q.to(torch.float8_e5m2).float())
    else:
        over = round_e2m1(q).abs() > 6
    nonzero = v != 0
    return {"nonzero": int(nonzero.sum()), "flushed": int((nonzero & (deq == 0)).sum()),
            "saturated": int((nonzero & over).sum())}


def quantize_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """``x`` cast as NVFP4 along its last dimension: blocks of 16 E2M1 values, each with an E4M3 scale
    ``amax_block / (6 T)`` under a per-tensor fp32 scale ``T = amax / (448 * 6)``; divided back."""
    b = _blocks(x, 16)
    tensor_scale = b.abs().amax() / (448 * 6)
    if tensor_scale == 0:
        return torch.zeros_like(x, dtype=torch.float32)
    block_scale = (b.abs().amax(dim=2, keepdim=True) / (6 * tensor_scale)).to(torch.float8_e4m3fn).float()
    scale = torch.where(block_scale > 0, block_scale * tensor_scale, 1.0)     # all-zero blocks: any scale
    return (cast_elements(b / scale, "e2m1") * scale).reshape(x.shape[0], -1)[:, :x.shape[1]]


def cast_gemm_errors(ops: LinearOperands, cast) -> dict:
    """Relative error ``‖C' − C‖ / ‖C‖`` of ``{"Y", "dX", "dW"}`` when every operand goes through ``cast``
    (a function of a 2-D tensor that blocks along its last dimension) along the GEMM's reduction dimension."""
    x, w, g = ops.x, ops.weight, ops.grad
    cast_t = lambda t: cast(t.T.contiguous()).T                          # noqa: E731  blocks down the columns
    ref = ops.reference()
    got = {"Y": cast(x) @ cast(w).T, "dX": cast(g) @ cast_t(w), "dW": cast_t(g).T @ cast_t(x)}
    return {k: float((got[k] - ref[k]).norm() / ref[k].norm()) if ref[k].norm() > 0 else 0.0 for k in GEMMS}


def block_errors(ops: dict, elements=("e4m3", "e2m1"), rule: str = "ocp") -> dict:
    """``{(element, block label): {layer: {"Y", "dX", "dW"}}}`` for every MX block size of BLOCK_SIZES, plus
    ``(element, "tensor")``: the same power-of-two ``rule`` (see :func:`quantize_blocks`) with one scale for
    the whole tensor."""
    whole = lambda element: lambda t: quantize_blocks(t.reshape(1, -1), element, None, rule).reshape(t.shape)  # noqa: E731
    out = {}
    for element in elements:
        for label, block in BLOCK_SIZES:
            cast = lambda t, b=block, e=element: quantize_blocks(t, e, b, rule)                           # noqa: E731
            out[(element, label)] = {n: cast_gemm_errors(op, cast) for n, op in ops.items()}
        out[(element, "tensor")] = {n: cast_gemm_errors(op, whole(element)) for n, op in ops.items()}
    return out


def _bars(errors: dict, element: str, label: str) -> tuple[list, list, list]:
    layers = list(errors[(element, label)])
    x = [[n for n in layers for _ in GEMMS], [k for _ in layers for k in GEMMS]]
    return x, [errors[(element, label)][n][k] for n in layers for k in GEMMS], \
        [errors[(element, "tensor")][n][k] for n in layers for k in GEMMS]


def block_figure(errors: dict, element: str = "e4m3", label: str = "32", rule: str = "ocp") -> go.Figure:
    """Grouped bars: each GEMM's relative error with one MX scale per block of ``label`` values, against one
    scale per tensor (same rule, same element format); ``errors`` is :func:`block_errors`' for ``rule``."""
    x, now, tensor = _bars(errors, element, label)
    fig = go.Figure()
    fig.add_bar(x=x, y=tensor, name="one scale per tensor", marker_color="#BBBBBB",
                hovertemplate="%{x}: %{y:.2%}<extra>per tensor</extra>")
    fig.add_bar(x=x, y=now, name="one scale per block", marker_color=OKABE_ITO["blue"],
                hovertemplate="%{x}: %{y:.2%}<extra>per block</extra>")
    fig.update_layout(**base_layout("GEMM error with a power-of-two scale per block", "", height=440,
                                    inline_subtitle=True, showlegend=True, barmode="group",
                                    legend=dict(orientation="h", x=0.0, y=-0.2, yanchor="top"),
                                    margin=dict(l=70, r=30, t=90, b=110)))
    fig.update_yaxes(type="log", title_text="relative error ‖C′ − C‖ / ‖C‖", exponentformat="power")
    set_blocks(fig, errors, element, label, rule)
    return fig


def set_blocks(fig, errors: dict, element: str, label: str, rule: str = "ocp") -> None:
    """Redraw ``fig`` (in place) for an element format, a block size and a scale rule (``errors`` for it)."""
    x, now, tensor = _bars(errors, element, label)
    fig.data[0].update(x=x, y=tensor)
    fig.data[1].update(x=x, y=now)
    values = [v for v in now + tensor if v > 0]
    lo, hi = np.log10(min(values)), np.log10(max(values))
    fig.layout.yaxis.range = [lo - 0.3, hi + 0.3]
    blocks = "row" if label == "whole row" else f"{label} values"
    fig.layout.title.text = title_text((fig.layout.title.text or "").partition("<br>")[0],
                                       f"{element.upper()} elements, one E8M0 scale per {blocks} ({RULES[rule]}) "
                                       "along each GEMM's reduction dimension")


class BlockSizeExplorer(W.VBox):
    """A block-size slider (16, 32, 64, 128, a whole row), an element dropdown (E4M3, E2M1) and a scale-rule
    dropdown (OCP floor, RCEIL) over the GEMM errors of the layers in ``ops`` ({name: LinearOperands}); all
    precomputed, so the controls only index.

    Attributes: element_dropdown, block_slider, rule_dropdown, readout (HTML), figure (FigureWidget),
    errors ({rule: block_errors(ops, rule=rule)}).
    """

    def __init__(self, ops: dict, element: str = "e4m3", block: str = "32", rule: str = "ocp"):
        if element not in ("e4m3", "e2m1"):
            raise ValueError(f"element: expected 'e4m3' or 'e2m1', got {element!r}")
        if block not in dict(BLOCK_SIZES):
            raise ValueError(f"block: expected one of {[b for b, _ in BLOCK_SIZES]}, got {block!r}")
        if rule not in RULES:
            raise ValueError(f"rule: expected one of {tuple(RULES)}, got {rule!r}")
        self.errors = {r: block_errors(ops, rule=r) for r in RULES}
        self.element_dropdown = W.Dropdown(options=[("E4M3 (MXFP8)", "e4m3"), ("E2M1 (MXFP4)", "e2m1")],
                                           value=element, description="elements")
        self.block_slider = W.SelectionSlider(options=[b for b, _ in BLOCK_SIZES], value=block,
                                              description="block size")
        self.rule_dropdown = W.Dropdown(options=[("OCP floor (spec)", "ocp"), ("RCEIL (TE, torchao)", "rceil")],
                                        value=rule, description="scale rule")
        self.readout = W.HTML(self._readout_html())
        self.figure = figure_widget(block_figure(self.errors[rule], element, block, rule))
        for control in (self.element_dropdown, self.block_slider, self.rule_dropdown):
            control.observe(self._on_change, "value")
        super().__init__([W.HBox([self.element_dropdown, self.block_slider, self.rule_dropdown]), self.readout,
                          self.figure])

    def _on_change(self, change=None) -> None:
        with self.figure.batch_update():
            set_blocks(self.figure, self.errors[self.rule_dropdown.value], self.element_dropdown.value,
                       self.block_slider.value, self.rule_dropdown.value)
        self.readout.value = self._readout_html()

    def _readout_html(self) -> str:
        element, label = self.element_dropdown.value, self.block_slider.value
        errors = self.errors[self.rule_dropdown.value]
        now, tensor = errors[(element, label)], errors[(element, "tensor")]
        rows = [(f"{n} {k}", f"{now[n][k]:.2%} (per tensor {tensor[n][k]:.2%})") for n in now for k in GEMMS]
        return table_html(rows, title=f"{element.upper()}, blocks of {label}: relative GEMM error")
