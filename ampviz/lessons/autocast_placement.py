"""Where autocast acts in a training step: backward and the optimizer inside or outside the block, and
float32 islands.

``placement_step`` runs one real AMP step of a copy of a model (forward and loss always under
autocast; ``inside="backward"`` puts the backward in the block too, ``inside="step"`` also
``scaler.step`` and ``scaler.update``) and returns the weights it produced and how many backward
matrix multiplies ran in each dtype, traced with :class:`~ampviz.lessons.autocast_ops.OpLog`::

    >>> import torch
    >>> from ampviz.lessons.models import MLP
    >>> from ampviz.lessons.autocast_placement import placement_step
    >>> _ = torch.manual_seed(0)
    >>> model, x, y = MLP(8, 16, 1, 3), torch.randn(4, 8), torch.randint(0, 3, (4,))
    >>> out = placement_step(model, x, y, dtype=torch.bfloat16, island=True)
    >>> out.backward_mm["float32"] > 0            # the island's backward ran in float32
    True
    >>> placement_step(model, x, y, dtype=torch.bfloat16, island=True, inside="backward").backward_mm["float32"]
    0

``adam_first_step_moves`` measures how far Adam's first step moves each weight when the backward is misplaced,
``engine_reduces_then_casts`` shows what the autograd engine does with a float32 gradient for a 16-bit input,
and ``PlacementExplorer`` is the widget. (Custom Functions and threads: :mod:`ampviz.lessons.autocast_code`.)

Used by lessons 04 (autocast in practice).
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
import torch.nn.functional as F

from ..plots.style import OKABE_ITO, base_layout
from .autocast_ops import OpLog

__all__ = ["OPTIMIZERS", "INSIDE", "PlacementResult", "placement_step", "adam_first_step_moves",
           "engine_reduces_then_casts", "PlacementExplorer"]

OPTIMIZERS = ("sgd", "adam", "muon")
INSIDE = ("forward", "backward", "step")       # the last part of the step that runs inside autocast


@dataclass
class PlacementResult:
    """One step of :func:`placement_step`."""

    weights: list                 # the parameters after the step (detached copies)
    update: float                 # largest |change| of any parameter in the step
    head_grad: torch.Tensor       # the head's weight gradient (unscaled, fp32)
    grads: list                   # every parameter's gradient (unscaled, fp32), in parameter order
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
            grads.extend(p.grad.detach().clone() for p in model.parameters())
            for opt in opts:
                scaler.step(opt)
            scaler.update()

    grads, scale = [], scaler.get_scale()
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
    head = [n for n, _ in model.named_parameters()].index("head.weight")
    return PlacementResult(after, update, grads[head], grads, mm, scaler.is_enabled() and scaler.get_scale() < scale)


def adam_first_step_moves(model, batches, *, dtype: torch.dtype, lr: float) -> dict:
    """Adam's first step with the head as a float32 island, recommended (backward outside) against the backward
    inside the block, on each ``(x, y)`` of ``batches``: how far each weight lands from where the recommended step
    put it, in units of ``lr``.

    Adam's first step moves a weight by ``lr * g / (|g| + eps)``: about ``lr`` whatever the size of ``g``.

    Returns
    -------
    dict of 1-D tensors: "flipped" (moves of the weights whose gradient changed sign), "predicted" (for those
    weights, ``|g|/(|g|+eps) + |g'|/(|g'|+eps)`` from the two gradients), "kept" (moves of the weights whose
    gradient kept its sign, both gradients above ``1e-6``).
    """
    eps = inspect.signature(torch.optim.Adam).parameters["eps"].default
    out = {"flipped": [], "predicted": [], "kept": []}
    for x, y in batches:
        a, b = (placement_step(model, x, y, dtype=dtype, optimizer="adam", island=True, inside=inside, lr=lr)
                for inside in ("forward", "backward"))
        for g, h, w, v in zip(a.grads, b.grads, a.weights, b.weights):
            moved, flip = (w - v).abs() / lr, g * h < 0
            out["flipped"].append(moved[flip])
            out["predicted"].append((g.abs() / (g.abs() + eps) + h.abs() / (h.abs() + eps))[flip])
            out["kept"].append(moved[~flip & (g.abs() > 1e-6) & (h.abs() > 1e-6)])
    return {k: torch.cat(v) for k, v in out.items()}


class _Float32BatchGradient(torch.autograd.Function):
    """Broadcasts a bias-shaped input over a batch; its backward hands back a float32, batch-shaped gradient."""

    @staticmethod
    def forward(ctx, bias):
        return bias.expand(4, *bias.shape).clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.float()


def engine_reduces_then_casts(dtype: torch.dtype = torch.bfloat16) -> list[tuple]:
    """What the autograd engine does with a float32, batch-shaped gradient handed back for a 16-bit, bias-shaped
    input (the state CUDA autocast's float32 ``sum`` would leave a bias gradient in): it sums the gradient to the
    input's shape, then casts it to the input's dtype.

    Returns
    -------
    The engine's ops on that gradient, in order, as ``(op, input dtypes, output dtypes)``.
    """
    bias = torch.randn(3, dtype=dtype, requires_grad=True)
    with OpLog() as tracer:
        out = _Float32BatchGradient.apply(bias)
        with tracer.phase("backward"):
            out.backward(torch.ones_like(out))
    after = [r for r in tracer.select("backward") if r.op in ("sum", "_to_copy") and r.input_dtypes == ("float32",)]
    return [(r.op, r.input_dtypes, r.output_dtypes) for r in after]


def _short(value: float) -> str:
    """A bar label: "0", "0.5", "1.9" or "1.3e-4" (short enough for two bars side by side)."""
    if value == 0 or value >= 0.01:
        return f"{value:.2g}"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


class PlacementExplorer(widgets.VBox):
    """Choose an optimizer, an autocast dtype and whether the head is a float32 island; see, per parameter, how
    far each misplaced step (the backward inside the block; also ``scaler.step`` and ``update`` inside) lands
    from the recommended one (forward and loss inside, the rest outside).

    The y axis is logarithmic and fixed (``Y_RANGE``, relative to the recommended step's largest update), so a
    difference of 1e-4 and one of 2 look as different as they are; a parameter that came out bit-for-bit
    identical is drawn at the floor with the label "0". The steps of the first setting and of every setting one
    control away (:meth:`first_moves`) are computed before the figure is built.

    Public state: ``optimizer``, ``dtype``, ``island`` (controls), ``figure`` (a FigureWidget: one bar trace
    per misplaced step, one bar per parameter), ``readout`` (HTML), ``steps_computed``, ``reference`` and
    ``results`` (the :class:`PlacementResult` of the recommended step and of each misplaced one), ``changes``
    (per misplaced step, the largest |difference| per parameter relative to the reference step's largest update).
    """

    MISPLACED = {"backward": "backward inside", "step": "backward, step and update inside"}
    Y_RANGE = (1e-8, 10.0)

    def __init__(self, model, x, y, lr: float, island: bool = True):
        self._model, self._x, self._y, self._lr, self._cache = model, x, y, lr, {}
        self.names = [n for n, _ in model.named_parameters()]
        self.optimizer = widgets.Dropdown(options=[("SGD", "sgd"), ("Adam", "adam"), ("Muon", "muon")],
                                          value="sgd", description="optimizer")
        self.dtype = widgets.Dropdown(options=[("float16", torch.float16), ("bfloat16", torch.bfloat16)],
                                      value=torch.float16, description="autocast")
        self.island = widgets.Checkbox(value=island, description="head as a float32 island")
        # The first setting and every setting one control away, before the figure exists: once its comm opens the
        # browser has 2 s to load plotly's module (anywidget), and a busy kernel makes a blank chart likelier
        for optimizer, dtype, on in self.first_moves():
            for inside in INSIDE:
                self.step_for(optimizer, dtype, inside, on)
        colors = (OKABE_ITO["blue"], OKABE_ITO["orange"])
        lo, hi = (math.log10(v) for v in self.Y_RANGE)
        self.figure = go.FigureWidget(
            data=[go.Bar(name=label, x=self.names, y=[self.Y_RANGE[0]] * len(self.names), marker_color=color,
                         text=[""] * len(self.names), textposition="outside", cliponaxis=False,
                         textfont=dict(size=10))
                  for label, color in zip(self.MISPLACED.values(), colors)],
            layout=base_layout("Distance from the recommended step", "largest |difference| per parameter, relative "
                               "to the recommended step's largest update; 0: bit-for-bit identical", height=400,
                               barmode="group", showlegend=True, inline_subtitle=True,
                               yaxis=dict(title="relative difference", type="log", range=[lo, hi],
                                          dtick=1, exponentformat="power"),
                               legend=dict(orientation="h", y=1.0, yanchor="bottom", x=0)))
        self.figure.layout.margin.t = 120
        self.readout = widgets.HTML()
        for control in (self.optimizer, self.dtype, self.island):
            control.observe(self._update, names="value")
        super().__init__([widgets.HBox([self.optimizer, self.dtype, self.island]), self.readout, self.figure])
        self._update()

    def first_moves(self) -> list[tuple]:
        """The current (optimizer, dtype, island) setting and each setting that one control change reaches."""
        optimizer, dtype, island = self.optimizer.value, self.dtype.value, self.island.value
        return ([(optimizer, dtype, island)] + [(o, dtype, island) for o in OPTIMIZERS if o != optimizer]
                + [(optimizer, d, island) for d in (torch.float16, torch.bfloat16) if d != dtype]
                + [(optimizer, dtype, not island)])

    @property
    def steps_computed(self) -> int:
        """How many steps have been run so far (each setting once; a control change to a computed one runs none)."""
        return len(self._cache)

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
        self.results = {inside: self.step_for(*setting, inside, self.island.value) for inside in self.MISPLACED}
        scale = self.reference.update or 1.0
        self.changes = {inside: [float((a - b).abs().max()) / scale for a, b in zip(r.weights, self.reference.weights)]
                        for inside, r in self.results.items()}
        with self.figure.batch_update():
            for bar, changes in zip(self.figure.data, self.changes.values()):
                bar.y = [max(c, self.Y_RANGE[0]) for c in changes]
                bar.text = [_short(c) for c in changes]
        mm = [self.reference.backward_mm["float32"]] + [r.backward_mm["float32"] for r in self.results.values()]
        skipped = [name for name, r in [("recommended", self.reference), *self.results.items()] if r.skipped]
        self.readout.value = (
            f"recommended step: largest update <b>{self.reference.update:.2e}</b> (lr {self._lr:g}) · "
            f"backward matrix multiplies in float32: recommended {mm[0]}, backward inside {mm[1]}, "
            f"all inside {mm[2]}" + (f" · the scaler skipped: {', '.join(skipped)}" if skipped else ""))
