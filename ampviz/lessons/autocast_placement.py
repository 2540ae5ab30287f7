"""Where autocast acts in a training step: backward and the optimizer inside or outside the block,
float32 islands, and custom autograd functions with ``torch.amp.custom_fwd`` / ``custom_bwd``.

``placement_step`` runs one real AMP step of a copy of a model (forward and loss always under
autocast; ``inside="backward"`` puts the backward in the block too, ``inside="step"`` also
``scaler.step`` and ``scaler.update``) and returns the weights it produced and how many backward
matrix multiplies ran in each dtype, traced with :class:`~ampviz.lessons.autocast_ops.OpLog`::

    >>> import torch
    >>> from ampviz.examples.models import MLP
    >>> from ampviz.lessons.autocast_placement import placement_step
    >>> _ = torch.manual_seed(0)
    >>> model, x, y = MLP(8, 16, 1, 3), torch.randn(4, 8), torch.randint(0, 3, (4,))
    >>> out = placement_step(model, x, y, dtype=torch.bfloat16, island=True)
    >>> out.backward_mm["float32"] > 0            # the island's backward ran in float32
    True
    >>> placement_step(model, x, y, dtype=torch.bfloat16, island=True, inside="backward").backward_mm["float32"]
    0

``custom_matmul`` builds the same matrix product as a custom ``torch.autograd.Function`` with or
without the ``torch.amp`` decorators, and ``trace_custom_function`` reports the dtypes its forward and
backward ran in (or the error the backward raised). ``PlacementExplorer`` is the widget.

Used by lessons 04 (autocast in practice).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
import torch.nn.functional as F

from ..plots.style import OKABE_ITO, base_layout
from .autocast_ops import OpLog

__all__ = ["OPTIMIZERS", "INSIDE", "CUSTOM_VARIANTS", "PlacementResult", "placement_step", "custom_matmul",
           "trace_custom_function", "PlacementExplorer"]

OPTIMIZERS = ("sgd", "adam", "muon")
INSIDE = ("forward", "backward", "step")       # the last part of the step that runs inside autocast
CUSTOM_VARIANTS = ("plain", "custom_fwd(cast_inputs=float32)", "custom_fwd(cast_inputs=float32) + custom_bwd",
                   "custom_fwd + custom_bwd")


@dataclass
class PlacementResult:
    """One step of :func:`placement_step`."""

    weights: list                 # the parameters after the step (detached copies)
    update: float                 # largest |change| of any parameter in the step
    head_grad: torch.Tensor       # the head's weight gradient (unscaled, fp32)
    backward_mm: dict             # {"float32": n, "16-bit": n}: matrix multiplies in the backward
    skipped: bool                 # the scaler skipped the step


def _optimizers(model, name: str, lr: float) -> list:
    if name == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=lr)]
    if name == "adam":
        return [torch.optim.Adam(model.parameters(), lr=lr)]
    # Muon orthogonalises 2-D updates only; the rest goes to Adam, as Muon's documentation advises
    matrices = [p for p in model.parameters() if p.ndim == 2]
    return [torch.optim.Muon(matrices, lr=lr), torch.optim.Adam([p for p in model.parameters() if p.ndim != 2], lr=lr)]


def placement_step(model, x, y, *, dtype: torch.dtype = torch.float16, optimizer: str = "sgd",
                   inside: str = "forward", island: bool = False, lr: float = 0.02) -> PlacementResult:
    """One AMP step of a deep copy of ``model`` (an ``MLP`` with ``body`` and ``head``).

    Parameters
    ----------
    x, y : one batch (on the model's device).
    dtype : the autocast dtype; float16 steps through a ``GradScaler``, bfloat16 without one.
    optimizer : "sgd", "adam" or "muon" (``torch.optim.Muon`` for the matrices, Adam for the rest).
    inside : "forward" (forward and loss in the block: the recommended step), "backward" (the backward
        too) or "step" (also ``scaler.step`` and ``scaler.update``).
    island : run the head in float32 (``autocast(enabled=False)`` and ``.float()``).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {optimizer!r}")
    if inside not in INSIDE:
        raise ValueError(f"inside: expected one of {INSIDE}, got {inside!r}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype: expected torch.float16 or torch.bfloat16, got {dtype!r}")
    model = copy.deepcopy(model)
    device = x.device.type
    opts = _optimizers(model, optimizer, lr)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    before = [p.detach().clone() for p in model.parameters()]

    def backward(loss):
        with tracer.phase("backward"):
            scaler.scale(loss).backward()

    def step():
        with tracer.phase("optimizer"):
            for opt in opts:
                scaler.unscale_(opt)
            head_grad.append(model.head.weight.grad.detach().clone())
            for opt in opts:
                scaler.step(opt)
            scaler.update()

    head_grad, scale = [], scaler.get_scale()
    with OpLog() as tracer:
        with torch.amp.autocast(device, dtype=dtype):
            features = model.body(x)
            if island:
                with torch.amp.autocast(device, enabled=False):
                    loss = F.cross_entropy(model.head(features.float()), y)
            else:
                loss = F.cross_entropy(model.head(features), y)
            if inside in ("backward", "step"):
                backward(loss)
            if inside == "step":
                step()
        if inside == "forward":
            backward(loss)
        if inside != "step":
            step()
    after = [p.detach().clone() for p in model.parameters()]
    update = max(float((a - b).abs().max()) for a, b in zip(after, before))
    mm = {"float32": tracer.count("mm", "backward", "float32"),
          "16-bit": tracer.count("mm", "backward", str(dtype).removeprefix("torch."))}
    return PlacementResult(after, update, head_grad[0], mm, scaler.is_enabled() and scaler.get_scale() < scale)


def custom_matmul(variant: str, device_type: str = "cpu"):
    """``a @ b`` as a custom autograd Function, decorated as ``variant`` (one of ``CUSTOM_VARIANTS``).

    The forward saves its inputs as it receives them and the backward multiplies them with the
    incoming gradient, as a hand-written Function would.
    """
    if variant not in CUSTOM_VARIANTS:
        raise ValueError(f"variant: expected one of {CUSTOM_VARIANTS}, got {variant!r}")

    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad @ b.t(), a.t() @ grad

    if variant != "plain":
        cast = torch.float32 if "cast_inputs" in variant else None
        forward = torch.amp.custom_fwd(forward, device_type=device_type, cast_inputs=cast)
    if variant.endswith("custom_bwd"):
        backward = torch.amp.custom_bwd(backward, device_type=device_type)
    return type("MatMul", (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                       "backward": staticmethod(backward)})


def trace_custom_function(variant: str, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                          backward_inside: bool = False, seed: int = 0) -> dict:
    """Apply :func:`custom_matmul` to a 16-bit activation and an fp32 weight under autocast.

    Returns the output dtype, the input dtypes of the forward's and the backward's ``mm`` ops, and
    the error the backward raised (None when it ran).
    """
    gen = torch.Generator().manual_seed(seed)
    x, w0 = torch.randn(8, 16, generator=gen).to(device), torch.randn(16, 16, generator=gen).to(device)
    w = torch.randn(16, 16, generator=gen).to(device).requires_grad_()
    fn, error = custom_matmul(variant, torch.device(device).type), None
    with OpLog() as tracer:
        with torch.amp.autocast(torch.device(device).type, dtype=dtype):
            h = x @ w0                                          # a 16-bit activation, (8, 16)
            out = fn.apply(h, w)
            loss = out.float().sum()
            if backward_inside:
                error = _backward(loss, tracer)
        if not backward_inside:
            error = _backward(loss, tracer)
    def mm(phase):
        return [", ".join(r.input_dtypes) for r in tracer.records if r.op == "mm" and r.phase == phase]

    return {"output": str(out.dtype).removeprefix("torch."),
            "forward mm": mm("forward")[1:],                    # the first is h = x @ w0, outside the Function
            "backward mm": mm("backward"), "error": error}


def _backward(loss, tracer):
    try:
        with tracer.phase("backward"):
            loss.backward()
    except RuntimeError as err:
        return str(err).split("\n")[0]
    return None


class PlacementExplorer(widgets.VBox):
    """Choose an optimizer, an autocast dtype, and what runs inside the autocast block; see how far
    each parameter lands from the recommended step (forward and loss inside, the rest outside).

    Public state: ``optimizer``, ``dtype``, ``inside``, ``island``
    (controls), ``figure`` (a FigureWidget: one bar per parameter), ``readout`` (HTML), ``result``
    and ``reference`` (the :class:`PlacementResult` shown and the recommended one), ``changes``
    (largest |difference| per parameter, relative to the reference step's largest update).
    """

    def __init__(self, model, x, y, lr: float = 0.02):
        self._model, self._x, self._y, self._lr, self._cache = model, x, y, lr, {}
        self.names = [n for n, _ in model.named_parameters()]
        self.optimizer = widgets.Dropdown(options=[("SGD", "sgd"), ("Adam", "adam"), ("Muon", "muon")],
                                          value="sgd", description="optimizer")
        self.dtype = widgets.Dropdown(options=[("float16", torch.float16), ("bfloat16", torch.bfloat16)],
                                      value=torch.float16, description="autocast")
        self.inside = widgets.ToggleButtons(options=[("forward + loss", "forward"), ("+ backward", "backward"),
                                                     ("+ step and update", "step")], value="forward",
                                            description="in autocast")
        self.island = widgets.Checkbox(value=False, description="head as a float32 island")
        self.figure = go.FigureWidget(
            data=[go.Bar(x=self.names, y=[0.0] * len(self.names), marker_color=OKABE_ITO["blue"])],
            layout=base_layout("Distance from the recommended step", "largest |difference| per parameter, "
                               "relative to the recommended step's largest update", height=360,
                               yaxis=dict(title="relative difference", rangemode="tozero"), inline_subtitle=True))
        self.readout = widgets.HTML()
        for control in (self.optimizer, self.dtype, self.inside, self.island):
            control.observe(self._update, names="value")
        super().__init__([widgets.HBox([self.optimizer, self.dtype, self.island]), self.inside,
                          self.readout, self.figure])
        self._update()

    def step_for(self, optimizer, dtype, inside, island) -> PlacementResult:
        """The (cached) :func:`placement_step` for one setting."""
        key = (optimizer, dtype, inside, island)
        if key not in self._cache:
            self._cache[key] = placement_step(self._model, self._x, self._y, dtype=dtype, optimizer=optimizer,
                                              inside=inside, island=island, lr=self._lr)
        return self._cache[key]

    def _update(self, change=None):
        setting = (self.optimizer.value, self.dtype.value)
        self.reference = self.step_for(*setting, "forward", self.island.value)
        self.result = self.step_for(*setting, self.inside.value, self.island.value)
        scale = self.reference.update or 1.0
        self.changes = [float((a - b).abs().max()) / scale for a, b in zip(self.result.weights, self.reference.weights)]
        identical = all(torch.equal(a, b) for a, b in zip(self.result.weights, self.reference.weights))
        with self.figure.batch_update():
            self.figure.data[0].y = self.changes
        mm = self.result.backward_mm
        self.readout.value = (f"<b>{'identical to' if identical else 'differs from'} the recommended step</b> · "
                              f"backward matrix multiplies: {mm['float32']} in float32, {mm['16-bit']} in 16 bits"
                              + (" · the scaler skipped this step" if self.result.skipped else ""))
