"""The dtypes of one real mixed-precision training step, measured: where the fp32 master weights live.

The mixed-precision recipe is a loop: fp32 parameters are cast to 16 bits for the forward and
backward, the gradients come back to fp32, and the optimizer updates the fp32 parameters.
:func:`measure_dtypes` runs one real step of your model and measures the dtype on every arrow of
that loop (parameters, the casts autocast inserts, forward and backward matmuls, activations,
the casts back, ``.grad``, the optimizer's own ops and state, the parameters after the step),
using :class:`ampviz.lessons.autocast_ops.OpLog` and hooks. :func:`flow_figure` draws the loop with the
measured dtypes written on it::

    import torch, torch.nn.functional as F
    from ampviz.lessons.dataflow import measure_dtypes, flow_figure
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    flow = measure_dtypes(model, opt, torch.randn(4, 8), torch.tensor([0, 1, 0, 1]), torch.float16)
    flow.params, flow.forward_matmul, flow.grads, flow.optimizer_state      # fp32, fp16, fp32, fp32
    flow_figure(flow)

With ``autocast_dtype=None`` the same function measures a plain step (e.g. of a ``.half()`` model:
every arrow 16-bit, no master copy anywhere).

Used by lessons 07b (master weights: where they live).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import plotly.graph_objects as go
import torch
import torch.nn.functional as F

from ..plots.style import OKABE_ITO, base_layout
from .autocast_ops import OpLog

__all__ = ["StepFlow", "measure_dtypes", "flow_figure", "DTYPE_COLORS"]

_MATMULS = ("addmm", "mm", "bmm", "matmul", "linear", "baddbmm", "addbmm", "_convolution", "convolution")
DTYPE_COLORS = {"float32": OKABE_ITO["blue"], "float16": OKABE_ITO["vermillion"],
                "bfloat16": OKABE_ITO["orange"], "mixed": "#8C8C8C", "none": "#BBBBBB"}


@dataclass
class StepFlow:
    """Measured dtypes of one training step (strings like "float32"; "mixed" when several).

    ``casts_in`` / ``casts_back`` count the dtype casts of the forward (fp32 -> 16-bit) and of the
    backward (16-bit -> fp32); ``optimizer_ops`` is the most common dtype of the optimizer's
    in-place ops (``optimizer_op_counts`` has them all: a step counter may be fp32 either way);
    ``params_changed`` says whether the optimizer step moved the parameters.
    """

    autocast_dtype: str
    params: str
    casts_in: int
    forward_matmul: str
    activations: str
    loss: str
    backward_matmul: str
    casts_back: int
    grads: str
    optimizer_ops: str
    optimizer_state: str
    params_after: str
    params_changed: bool
    optimizer_op_counts: dict

    def rows(self) -> list[tuple[str, str]]:
        """(arrow, measured) pairs in loop order, for a table."""
        return [("parameters (what the optimizer owns)", self.params),
                ("casts inserted in the forward",
                 f"{self.casts_in} (to {self.autocast_dtype})" if self.casts_in else "none"),
                ("forward matmuls", self.forward_matmul), ("activations (module outputs)", self.activations),
                ("loss", self.loss), ("backward matmuls", self.backward_matmul),
                ("casts back in the backward", f"{self.casts_back} (to float32)" if self.casts_back else "none"),
                ("param.grad", self.grads),
                ("optimizer in-place ops", ", ".join(f"{d} ×{n}" for d, n in self.optimizer_op_counts.items())),
                ("optimizer state", self.optimizer_state), ("parameters after the step", self.params_after)]


def _one(dtypes) -> str:
    """The single dtype name of a collection, "mixed" if several, "none" if empty."""
    names = {str(d).removeprefix("torch.") for d in dtypes if d is not None}
    return names.pop() if len(names) == 1 else ("mixed" if names else "none")


def measure_dtypes(model, optimizer, inputs, targets, autocast_dtype=torch.float16, loss_fn=None,
                 scaler=None) -> StepFlow:
    """Run one real training step and measure the dtype on every arrow of the loop.

    Parameters
    ----------
    model, optimizer : the model and its optimizer (the step really happens).
    inputs, targets : one batch on the model's device.
    autocast_dtype : torch.float16 / torch.bfloat16 for an autocast forward, None for none.
    loss_fn : ``loss_fn(outputs, targets)``; default cross-entropy (computed in fp32 from the outputs).
    scaler : an optional ``torch.amp.GradScaler`` (used as ``scale(loss).backward(); step; update``).
    """
    if autocast_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"autocast_dtype: expected None, torch.float16 or torch.bfloat16, got {autocast_dtype!r}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    loss_fn = loss_fn or (lambda out, y: F.cross_entropy(out.float(), y))
    device_type = inputs.device.type
    before = [p.detach().clone() for p in model.parameters()]
    activation_dtypes = []
    hooks = [m.register_forward_hook(lambda m, i, o: activation_dtypes.append(o.dtype))
             for m in model.modules() if not list(m.children()) and isinstance(m, torch.nn.Module)]
    optimizer.zero_grad(set_to_none=True)
    try:
        with OpLog() as tracer:
            with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16,
                                enabled=autocast_dtype is not None):
                loss = loss_fn(model(inputs), targets)
            with tracer.phase("backward"):
                (scaler.scale(loss) if scaler is not None else loss).backward()
            with tracer.phase("optimizer"):
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
    finally:
        for h in hooks:
            h.remove()
    fwd, bwd = tracer.select("forward"), tracer.select("backward")
    opt_ops = Counter(r.dtype for r in tracer.select("optimizer") if r.mutates and r.dtype)
    state = [v.dtype for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0]
    params = list(model.parameters())
    return StepFlow(
        autocast_dtype=_one([autocast_dtype]) if autocast_dtype is not None else "off",
        params=_one(b.dtype for b in before),
        casts_in=sum(1 for r in fwd if r.is_cast and r.input_dtypes[0] == "float32"),
        forward_matmul=_one(r.dtype for r in fwd if r.op in _MATMULS),
        activations=_one(activation_dtypes), loss=_one([loss.dtype]),
        backward_matmul=_one(r.dtype for r in bwd if r.op in _MATMULS),
        casts_back=sum(1 for r in bwd if r.is_cast and r.output_dtypes[0] == "float32"),
        grads=_one(p.grad.dtype for p in params if p.grad is not None),
        optimizer_ops=opt_ops.most_common(1)[0][0] if opt_ops else "none", optimizer_state=_one(state),
        params_after=_one(p.dtype for p in params),
        params_changed=any(not torch.equal(b, p.detach()) for b, p in zip(before, params)),
        optimizer_op_counts=dict(opt_ops))


# ---------------------------------------------------------------------------- the loop, drawn
_BOXES = {   # name: (x, y, title, field of StepFlow shown as its dtype)
    "params": (0.0, 1.0, "parameters<br>(the optimizer's weights)", "params"),
    "forward": (1.0, 1.0, "forward<br>(matmuls, activations)", "forward_matmul"),
    "loss": (2.0, 1.0, "loss", "loss"),
    "backward": (2.0, 0.0, "backward<br>(matmuls)", "backward_matmul"),
    "grads": (1.0, 0.0, "param.grad", "grads"),
    "optimizer": (0.0, 0.0, "optimizer step<br>(its ops and state)", "optimizer_state"),
}
_ARROWS = (("params", "forward", "casts_in"), ("forward", "loss", None), ("loss", "backward", None),
           ("backward", "grads", "casts_back"), ("grads", "optimizer", None), ("optimizer", "params", None))


def _arrow_text(flow: StepFlow, field) -> str:
    if field == "casts_in":
        return f"{flow.casts_in} casts<br>→ {flow.autocast_dtype}" if flow.casts_in else "no cast"
    if field == "casts_back":
        return f"{flow.casts_back} casts<br>→ float32" if flow.casts_back else "no cast"
    return ""


def flow_figure(flow: StepFlow, title: str | None = None) -> go.Figure:
    """The training loop as six boxes coloured by the dtype measured there, arrows labelled with casts."""
    if not isinstance(flow, StepFlow):
        raise TypeError(f"flow: expected the StepFlow measure_dtypes returns, got {type(flow).__name__}")
    fig = go.Figure()
    w, h = 0.3, 0.26
    for name, (x, y, label, field) in _BOXES.items():
        dtype = getattr(flow, field)
        if name == "forward" and flow.activations != dtype:
            dtype = "mixed"
        color = DTYPE_COLORS.get(dtype, DTYPE_COLORS["mixed"])
        fig.add_shape(type="rect", name=f"box:{name}", x0=x - w, x1=x + w, y0=y - h, y1=y + h,
                      line=dict(color=color, width=3), fillcolor=color, opacity=0.18, layer="below")
        extra = ""
        if name == "optimizer":
            extra = f"<br><span style='font-size:11px'>ops {flow.optimizer_ops}</span>"
        if name == "forward":
            extra = f"<br><span style='font-size:11px'>activations {flow.activations}</span>"
        fig.add_annotation(name=f"label:{name}", x=x, y=y, showarrow=False, font=dict(size=13),
                           text=f"{label}<br><b style='color:{color}'>{getattr(flow, field)}</b>{extra}")
    for a, b, field in _ARROWS:
        (xa, ya, *_), (xb, yb, *_) = _BOXES[a], _BOXES[b]
        dx, dy = xb - xa, yb - ya
        sx, sy = (w + 0.03) * (dx != 0) * (1 if dx > 0 else -1), (h + 0.03) * (dy != 0) * (1 if dy > 0 else -1)
        fig.add_annotation(name=f"arrow:{a}->{b}", x=xb - sx, y=yb - sy, ax=xa + sx, ay=ya + sy, xref="x",
                           yref="y", axref="x", ayref="y", showarrow=True, arrowhead=3, arrowsize=1.3,
                           arrowwidth=2, arrowcolor="#444444", text="")
        text = _arrow_text(flow, field)
        if text:
            fig.add_annotation(name=f"cast:{a}->{b}", x=(xa + xb) / 2 + (0.17 if dy else 0),
                               y=(ya + yb) / 2 + (0.0 if dy else 0.12), text=text, showarrow=False,
                               font=dict(size=12, color=OKABE_ITO["bluish_green"]), bgcolor="white")
    legend = " · ".join(f"<span style='color:{c}'>■</span> {n}" for n, c in DTYPE_COLORS.items()
                        if n in ("float32", "float16", "bfloat16"))
    fig.update_layout(**base_layout(title or "One training step, measured", f"box colour = dtype measured there: "
                                    f"{legend}", height=430, margin=dict(l=20, r=20, t=90, b=20),
                                    inline_subtitle=True))
    fig.update_xaxes(visible=False, range=[-0.45, 2.45])
    fig.update_yaxes(visible=False, range=[-0.35, 1.35])
    return fig
