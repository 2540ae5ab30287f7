"""OpTraceExplorer: which aten ops a small model's training step runs in which dtype, live.

Pick a model, an autocast dtype (off, bfloat16, float16), a device and a phase; the widget traces
one real forward (under ``torch.autocast``) and backward (outside it) with
:class:`ampviz.optrace.OpTracer` and shows a stacked bar chart of op runs per dtype plus the
aggregated trace table. Traces are computed once per choice and cached, so switching back is instant::

    from ampviz.widgets.optrace import OpTraceExplorer
    OpTraceExplorer()
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from ..optrace import OpTracer, trace_training_step
from ..plots._style import OKABE_ITO, base_layout

__all__ = ["OpTraceExplorer", "default_cases", "trace_table_figure", "CATEGORY_COLORS"]

CATEGORY_COLORS = {"float32": OKABE_ITO["blue"], "bfloat16": OKABE_ITO["orange"],
                   "float16": OKABE_ITO["vermillion"], "cast": OKABE_ITO["bluish_green"],
                   "other": "#8C8C8C"}
_AUTOCAST = {"off": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def trace_table_figure(rows: list[dict], title: str | None = None, subtitle: str | None = None) -> go.Figure:
    """A plotly table of :meth:`OpTracer.table` rows; 16-bit rows tinted orange, casts green."""
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "op" in r for r in rows):
        raise ValueError(f"rows: expected the list of dicts OpTracer.table() returns, got {type(rows).__name__}")
    fill = ["#E3F2EC" if r["cast"] else "#FBE8CF" if r["low_precision"] else "white" for r in rows]
    columns = [[r["phase"] for r in rows], [r["op"] + (f" ({r['variant']})" if r.get("variant") else "")
                                            for r in rows],
               [", ".join(r["inputs"]) or "-" for r in rows], [", ".join(r["outputs"]) or "-" for r in rows],
               [r["count"] for r in rows]]
    table = go.Table(header=dict(values=["phase", "aten op", "floating inputs", "floating outputs", "runs"],
                                 fill_color="#EEEEEE", align="left", font=dict(size=12)),
                     cells=dict(values=columns, fill_color=[fill] * 5, align="left", height=22, font=dict(size=12)),
                     columnwidth=[70, 170, 230, 150, 45])
    layout = base_layout(title, subtitle, height=130 + 23 * len(rows), inline_subtitle=True)
    layout["margin"] = dict(l=10, r=10, t=80 if title else 10, b=10)
    return go.Figure(table, layout=layout)


def _mlp_case(device):
    from ..data import digits
    from ..models import MLP
    data = digits(seed=0)
    torch.manual_seed(0)
    model = MLP(64, 64, depth=2, d_out=10).to(device)
    return model, data.x_train[:64].to(device), data.y_train[:64].to(device)


def _transformer_case(device):
    from ..data import digit_rows
    from ..models import TransformerClassifier
    data = digit_rows(seed=0)
    torch.manual_seed(0)
    model = TransformerClassifier(3 ** 8, 10, d_model=32, heads=2, layers=1, max_len=8).to(device)
    return model, data.x_train[:32].to(device), data.y_train[:32].to(device)


def default_cases() -> dict:
    """``{name: factory(device) -> (model, inputs, targets)}`` for two small models on real data."""
    return {"MLP on digits": _mlp_case, "Transformer on digit rows": _transformer_case}


class OpTraceExplorer(widgets.VBox):
    """Dropdowns for model, autocast dtype, device and phase; a bar chart and table of the trace.

    Public state: ``case``, ``autocast``, ``device``, ``phase``, ``hide_views`` (controls),
    ``figure`` (a FigureWidget, one bar trace per category of ``CATEGORY_COLORS``), ``table``
    and ``readout`` (HTML), ``tracer`` (the :class:`OpTracer` shown).
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
        self.figure = go.FigureWidget(
            data=[go.Bar(name=name, orientation="h", marker_color=color, x=[], y=[])
                  for name, color in CATEGORY_COLORS.items()],
            layout=base_layout("Op runs per dtype", height=420, barmode="stack", showlegend=True,
                               xaxis_title="runs in one step", yaxis=dict(autorange="reversed", automargin=True),
                               legend=dict(orientation="h", y=1.0, yanchor="bottom", x=0, traceorder="normal")))
        self.figure.layout.margin.t = 110
        self.readout, self.table = widgets.HTML(), widgets.HTML()
        for control in (self.case, self.autocast, self.device, self.phase, self.hide_views):
            control.observe(self._update, names="value")
        controls = widgets.HBox([self.case, self.autocast, self.device])
        super().__init__([controls, widgets.HBox([self.phase, self.hide_views]), self.readout, self.figure,
                          self.table])
        self._update()

    def trace_for(self, case: str, autocast: str, device: str) -> OpTracer:
        """The (cached) trace of one training step of ``case`` under ``autocast`` on ``device``."""
        key = (case, autocast, device)
        if key not in self._traces:
            if (case, device) not in self._models:
                self._models[case, device] = self.cases[case](torch.device(device))
            model, inputs, targets = self._models[case, device]
            self._traces[key] = trace_training_step(model, inputs, targets, _AUTOCAST[autocast])
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
        body = "".join(
            f"<tr style='background:{'#FDF1E0' if r['low_precision'] else 'white'}'><td>{r['phase']}</td>"
            f"<td><code>{html.escape(r['op'])}</code></td><td>{', '.join(r['inputs']) or '-'}</td>"
            f"<td>{', '.join(r['outputs']) or '-'}</td><td style='text-align:right'>{r['count']}</td></tr>"
            for r in rows)
        self.table.value = (
            "<div style='max-height:320px;overflow-y:auto'>"
            "<table style='border-collapse:collapse;font-size:12px'><tr><th>phase</th><th>aten op</th>"
            "<th>floating inputs</th><th>floating outputs</th><th>runs</th></tr>"
            f"{body}</table></div>")
