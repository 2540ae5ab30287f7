"""Log every aten op a piece of PyTorch code runs, with the dtypes it ran in (forward and backward).

The tracer is a ``TorchDispatchMode``: it sits below autograd and below autocast in PyTorch's
dispatcher, so it sees each op *after* autocast has cast its inputs (``linear`` arrives as
``_to_copy`` casts plus ``t`` and ``addmm``), and it sees the backward ops the autograd engine
runs. It stores plain records (no plotting here)::

    >>> import torch
    >>> from ampviz.lessons.autocast_ops import OpLog
    >>> lin, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    >>> with OpLog() as tracer:
    ...     with torch.autocast("cpu", dtype=torch.bfloat16):
    ...         loss = lin(x).float().sum()
    ...     loss.backward()
    >>> tracer.count("addmm", phase="forward", dtype="bfloat16")
    1
    >>> lin.weight.grad.dtype                    # the parameter's gradient comes back fp32
    torch.float32

The table of a trace (``op_table``) and the widget (``AutocastExplorer``: pick a model and an autocast
dtype, see every op's dtype) are at the end; the op lists themselves (PyTorch's documented ones, the
installed torch's) are in :mod:`ampviz.lessons.autocast_lists`.

Used by lessons 03 (autocast), 04 and 04b (autocast in practice, in your own code) and 07b (master weights:
where they live).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..plots.style import OKABE_ITO, base_layout
from .tables import Table

__all__ = ["OpRecord", "OpLog", "log_ops", "log_training_step", "LOW_PRECISION", "AutocastExplorer",
           "default_cases", "op_table", "CATEGORY_COLORS"]


LOW_PRECISION = ("float16", "bfloat16")
PHASES = ("forward", "backward", "optimizer")
# Ops that only move metadata or autograd bookkeeping; tables can hide them.
BOOKKEEPING = ("detach", "alias", "lift_fresh")
# The autograd node being executed (None outside backward); older torch lacks it, and then only
# OpLog.phase() labels the backward.
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)


@dataclass(frozen=True)
class OpRecord:
    """One aten op as it ran: its name, phase and the dtypes of its floating-point tensors."""

    op: str                         # overload packet name, e.g. "addmm", "_to_copy"
    overload: str                   # "default", "out", "Tensor", ...
    phase: str                      # "forward", "backward" or "optimizer"
    input_dtypes: tuple[str, ...]   # floating-point tensor inputs, e.g. ("bfloat16", "bfloat16")
    output_dtypes: tuple[str, ...]  # floating-point tensor outputs
    mutates: bool                   # in-place or out= variant (writes into an existing tensor)
    is_view: bool                   # returns a view: no arithmetic happens

    @property
    def dtype(self) -> str | None:
        """The dtype the op ran in: its first floating output, else its first floating input."""
        for group in (self.output_dtypes, self.input_dtypes):
            if group:
                return group[0]
        return None

    @property
    def low_precision(self) -> bool:
        return self.dtype in LOW_PRECISION

    @property
    def variant(self) -> str:
        """ "out=" for an out= call, "in-place" for another mutating op, else "" (autocast skips both)."""
        if self.overload.startswith("out") or self.overload.endswith("_out"):
            return "out="
        return "in-place" if self.mutates else ""

    @property
    def is_cast(self) -> bool:
        """A dtype conversion (what autocast inserts before an op on its lists)."""
        return (self.op in ("_to_copy", "to", "_to_copy_out") and bool(self.input_dtypes)
                and bool(self.output_dtypes) and self.input_dtypes[0] != self.output_dtypes[0])


def _float_dtypes(tree) -> tuple[str, ...]:
    leaves, _ = tree_flatten(tree)
    return tuple(str(t.dtype).removeprefix("torch.") for t in leaves
                 if isinstance(t, torch.Tensor) and t.is_floating_point())


class OpLog(TorchDispatchMode):
    """Context manager recording every aten op run inside it (see the module docstring).

    The phase of an op is "backward" when the autograd engine is executing a node while it runs
    (``torch._C._current_autograd_node``), otherwise the phase set with :meth:`phase` (default
    "forward"; label an optimizer step with ``with tracer.phase("optimizer"): opt.step()``).
    Use one tracer around both the forward and ``loss.backward()``.
    """

    def __init__(self):
        super().__init__()
        self.records: list[OpRecord] = []
        self._phase = "forward"

    @contextlib.contextmanager
    def phase(self, name: str):
        """Label the ops run inside this block ``name`` ("forward", "backward" or "optimizer")."""
        if name not in PHASES:
            raise ValueError(f"phase: expected one of {PHASES}, got {name!r}")
        previous, self._phase = self._phase, name
        try:
            yield self
        finally:
            self._phase = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        in_backward = _current_autograd_node() is not None
        schema = func._schema
        self.records.append(OpRecord(
            op=func.overloadpacket.__name__, overload=func._overloadname,
            phase="backward" if in_backward else self._phase,
            input_dtypes=_float_dtypes((args, kwargs)), output_dtypes=_float_dtypes(out),
            mutates=schema.is_mutable, is_view=bool(getattr(func, "is_view", False))))
        return out

    def __len__(self) -> int:
        return len(self.records)

    def select(self, phase: str | None = None, hide: tuple[str, ...] = (), hide_views: bool = False):
        """Records of one phase (or all), without the ops named in ``hide`` (and views)."""
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase: expected one of {PHASES} or None, got {phase!r}")
        return [r for r in self.records if (phase is None or r.phase == phase) and r.op not in hide
                and not (hide_views and r.is_view)]

    def count(self, op: str, phase: str | None = None, dtype: str | None = None) -> int:
        """How many times ``op`` ran (in ``phase``, in ``dtype``, when given)."""
        return sum(1 for r in self.select(phase) if r.op == op and (dtype is None or r.dtype == dtype))

    def table(self, phase: str | None = None, hide: tuple[str, ...] = BOOKKEEPING,
              hide_views: bool = False) -> list[dict]:
        """One row per distinct (phase, op, input dtypes, output dtypes), in order of first appearance.

        Returns
        -------
        list of dict with keys ``phase``, ``op``, ``variant`` ("out=", "in-place" or ""),
        ``inputs``, ``outputs`` (dtype tuples),
        ``dtype`` (what it ran in), ``low_precision``, ``cast`` and ``count``.
        """
        counts = Counter()
        first: dict[tuple, OpRecord] = {}
        for r in self.select(phase, hide, hide_views):
            key = (r.phase, r.op, r.variant, r.input_dtypes, r.output_dtypes)
            counts[key] += 1
            first.setdefault(key, r)
        return [dict(phase=k[0], op=k[1], variant=k[2], inputs=k[3], outputs=k[4], dtype=r.dtype,
                     low_precision=r.low_precision, cast=r.is_cast, count=counts[k])
                for k, r in first.items()]

    def dtype_counts(self, phase: str | None = None, hide: tuple[str, ...] = BOOKKEEPING,
                     hide_views: bool = False) -> dict[str, Counter]:
        """``{op: Counter({dtype: runs})}`` in order of first appearance (casts count as "cast")."""
        result: dict[str, Counter] = {}
        for r in self.select(phase, hide, hide_views):
            result.setdefault(r.op, Counter())["cast" if r.is_cast else str(r.dtype)] += 1
        return result

    def low_precision_fraction(self, phase: str | None = None, hide_views: bool = True) -> float:
        """Fraction of the traced ops (casts and bookkeeping excluded) that ran in 16 bits."""
        rows = [r for r in self.select(phase, BOOKKEEPING, hide_views) if not r.is_cast and r.dtype]
        return sum(r.low_precision for r in rows) / len(rows) if rows else 0.0


def log_ops(fn, *args, **kwargs) -> OpLog:
    """Run ``fn(*args, **kwargs)`` under a fresh :class:`OpLog`; the result is ``tracer.result``."""
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    with OpLog() as tracer:
        tracer.result = fn(*args, **kwargs)
    return tracer


def log_training_step(model, inputs, targets, autocast_dtype: torch.dtype | None, loss_fn=None) -> OpLog:
    """Trace one forward (under autocast to ``autocast_dtype``; None = off) and its backward.

    The forward and the loss run inside ``torch.autocast(inputs.device.type, ...)``, the backward
    outside it, as PyTorch recommends. The model's ``.grad`` are reset first and left filled in;
    no optimizer step is taken. ``tracer.result`` is the loss.
    """
    if autocast_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError("autocast_dtype: expected None, torch.float16 or torch.bfloat16, "
                         f"got {autocast_dtype!r}")
    loss_fn = loss_fn or torch.nn.functional.cross_entropy
    model.zero_grad(set_to_none=True)
    with OpLog() as tracer:
        with torch.autocast(inputs.device.type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            loss = loss_fn(model(inputs), targets)
        with tracer.phase("backward"):     # also labels the implicit ones_like(loss) seed
            loss.backward()
    tracer.result = loss.detach()
    return tracer


CATEGORY_COLORS = {"float32": OKABE_ITO["blue"], "bfloat16": OKABE_ITO["orange"],
                   "float16": OKABE_ITO["vermillion"], "cast": OKABE_ITO["bluish_green"],
                   "other": "#8C8C8C"}
_AUTOCAST = {"off": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def op_table(rows: list[dict], title: str | None = None, note: str | None = None) -> Table:
    """A :class:`~ampviz.lessons.tables.Table` of :meth:`OpLog.table` rows: 16-bit rows tinted orange, casts
    green (the colours of the explorer's bars)."""
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "op" in r for r in rows):
        raise ValueError(f"rows: expected the list of dicts OpLog.table() returns, got {type(rows).__name__}")
    cells = [(r["phase"], r["op"] + (f" ({r['variant']})" if r.get("variant") else ""),
              ", ".join(r["inputs"]) or "-", ", ".join(r["outputs"]) or "-", r["count"]) for r in rows]
    tints = ["cast" if r["cast"] else "16-bit" if r["low_precision"] else None for r in rows]
    return Table(["phase", "aten op", "floating inputs", "floating outputs", "runs"], cells, title=title,
                 note=note, tints=tints, code=(1,))


def _mlp_case(device):
    from .data import digits
    from .models import MLP
    data = digits(seed=0)
    torch.manual_seed(0)
    model = MLP(64, 64, depth=2, d_out=10).to(device)
    return model, data.x_train[:64].to(device), data.y_train[:64].to(device)


def _transformer_case(device):
    from .data import digit_rows
    from .models import TransformerClassifier
    data = digit_rows(seed=0)
    torch.manual_seed(0)
    model = TransformerClassifier(3 ** 8, 10, d_model=32, heads=2, layers=1, max_len=8).to(device)
    return model, data.x_train[:32].to(device), data.y_train[:32].to(device)


def default_cases() -> dict:
    """``{name: factory(device) -> (model, inputs, targets)}`` for two small models on real data."""
    return {"MLP on digits": _mlp_case, "Transformer on digit rows": _transformer_case}


class AutocastExplorer(widgets.VBox):
    """Dropdowns for model, autocast dtype, device and phase; a bar chart and table of the trace. Every trace of
    the chosen device is computed before the figure is built (a control only indexes them).

    Public state: ``case``, ``autocast``, ``device`` (shown only when there is a GPU), ``phase``,
    ``hide_views`` (controls),
    ``figure`` (a FigureWidget, one bar trace per category of ``CATEGORY_COLORS``), ``table``
    and ``readout`` (HTML), ``tracer`` (the :class:`OpLog` shown).
    """

    def __init__(self, cases: dict | None = None, device: str | torch.device | None = None):
        self.cases = cases or default_cases()
        if not self.cases or not all(callable(f) for f in self.cases.values()):
            raise ValueError(f"cases: expected a non-empty dict of name -> factory(device), got {cases!r}")
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        device = torch.device(device or devices[-1]).type
        if device not in devices:
            raise ValueError(f"device: expected one of {devices}, got {device!r}")
        self._models, self._traces, self._dtypes = {}, {}, {}
        low = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
        self.case = widgets.Dropdown(options=list(self.cases), description="model")
        self.autocast = widgets.Dropdown(options=[("off (float32)", "off"), ("bfloat16", "bfloat16"),
                                                  ("float16", "float16")], value=low, description="autocast")
        self.device = widgets.Dropdown(options=devices, value=device, description="device")
        self.phase = widgets.ToggleButtons(options=["forward", "backward", "both"], value="forward")
        self.hide_views = widgets.Checkbox(value=True, description="hide view ops (no arithmetic)")
        # Every trace of this device first, the figure last: when the figure's comm opens, the browser imports
        # plotly's 5 MB module and anywidget gives it 2 s, after which the figure ignores every update (a blank
        # chart); heavy work in the kernel then only makes that likelier. The controls then index, never trace.
        for case in self.cases:
            for autocast in _AUTOCAST:
                self.trace_for(case, autocast, device)
        self.readout, self.table = widgets.HTML(), widgets.HTML()
        self.figure = go.FigureWidget(
            data=[go.Bar(name=name, orientation="h", marker_color=color, x=[], y=[])
                  for name, color in CATEGORY_COLORS.items()],
            layout=base_layout("Op runs per dtype", height=420, barmode="stack", showlegend=True,
                               xaxis_title="runs in one step", yaxis=dict(autorange="reversed", automargin=True),
                               legend=dict(orientation="h", y=1.0, yanchor="bottom", x=0, traceorder="normal")))
        self.figure.layout.margin.t = 110
        for control in (self.case, self.autocast, self.device, self.phase, self.hide_views):
            control.observe(self._update, names="value")
        # a device menu with one entry would be a control that changes nothing: show it only with a GPU
        controls = widgets.HBox([self.case, self.autocast] + ([self.device] if len(devices) > 1 else []))
        super().__init__([controls, widgets.HBox([self.phase, self.hide_views]), self.readout, self.figure,
                          self.table])
        self._update()

    def trace_for(self, case: str, autocast: str, device: str) -> OpLog:
        """The (cached) trace of one training step of ``case`` under ``autocast`` on ``device``."""
        key = (case, autocast, device)
        if key not in self._traces:
            if (case, device) not in self._models:
                self._models[case, device] = self.cases[case](torch.device(device))
            model, inputs, targets = self._models[case, device]
            self._traces[key] = log_training_step(model, inputs, targets, _AUTOCAST[autocast])
            self._dtypes[key] = (sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}),
                                 sorted({str(p.grad.dtype).removeprefix("torch.") for p in model.parameters()
                                         if p.grad is not None}))
        return self._traces[key]

    def _update(self, change=None):
        self.tracer = self.trace_for(self.case.value, self.autocast.value, self.device.value)
        phase = None if self.phase.value == "both" else self.phase.value
        counts = self.tracer.dtype_counts(phase, hide_views=self.hide_views.value)
        ops = sorted(counts, key=lambda op: -sum(counts[op].values()))   # most frequent first
        with self.figure.batch_update():
            for bar in self.figure.data:
                if bar.name == "other":
                    xs = [sum(n for c, n in counts[op].items() if c not in CATEGORY_COLORS) for op in ops]
                else:
                    xs = [counts[op].get(bar.name, 0) for op in ops]
                bar.x, bar.y, bar.showlegend = xs, ops, sum(xs) > 0
            self.figure.layout.height = max(300, 160 + 22 * len(ops))
            self.figure.layout.title.text = (f"{self.case.value} · autocast {self.autocast.value} · "
                                             f"{self.device.value} · {self.phase.value}")
        self._fill_text(phase)

    def _fill_text(self, phase):
        fraction = self.tracer.low_precision_fraction(phase)
        params, grads = self._dtypes[self.case.value, self.autocast.value, self.device.value]
        rows = self.tracer.table(phase, hide_views=self.hide_views.value)
        casts = sum(r["count"] for r in rows if r["cast"])
        self.readout.value = (
            f"<b>{len(self.tracer.select(phase))}</b> aten ops traced; <b>{100 * fraction:.0f}%</b> of the "
            f"arithmetic ops ran in 16 bits; <b>{casts}</b> casts. Parameters: {', '.join(params)}; "
            f"gradients: {', '.join(grads)}.")
        table = op_table(rows, note="orange: ran in 16 bits · green: a cast · white: float32")
        self.table.value = f"<div style='max-height:320px;overflow-y:auto'>{table._repr_html_()}</div>"
