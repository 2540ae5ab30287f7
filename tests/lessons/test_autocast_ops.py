"""The op tracer against PyTorch's own behaviour: the dtype each op's output really has, the number
of Linear layers in a model, and the parameters' gradient dtypes."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampviz.lessons.autocast_ops import OpLog, log_ops, log_training_step, op_table
from ampviz.lessons.models import MLP


@pytest.fixture
def mlp_batch():
    torch.manual_seed(0)
    return MLP(12, 16, depth=3, d_out=5), torch.randn(8, 12), torch.randint(0, 5, (8,))


def n_linear(model):
    return sum(isinstance(m, nn.Linear) for m in model.modules())


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_every_linear_layer_runs_one_low_precision_addmm_and_params_stay_fp32(mlp_batch, low):
    model, x, y = mlp_batch
    tracer = log_training_step(model, x, y, low)
    name = str(low).removeprefix("torch.")
    assert n_linear(model) == 4
    # a missed op would break this count: one addmm per Linear layer, all in the low dtype
    assert tracer.count("addmm", phase="forward") == tracer.count("addmm", "forward", name) == n_linear(model)
    # forward casts: each fp32 parameter and the fp32 input batch down, the logits up to fp32 for
    # cross_entropy; the backward of each parameter's cast brings its gradient back to fp32
    n_params = len(list(model.parameters()))
    down = [r for r in tracer.select("forward") if r.is_cast and r.input_dtypes == ("float32",)]
    up = [r for r in tracer.select("forward") if r.is_cast and r.output_dtypes == ("float32",)]
    assert len(down) == n_params + 1 and len(up) == 1
    back = [r for r in tracer.select("backward") if r.is_cast and r.output_dtypes == ("float32",)]
    assert len(back) == n_params
    # backward matmuls reuse the forward's dtype although backward ran outside autocast
    n_mm = tracer.count("mm", "backward")
    assert n_mm > 0 and tracer.count("mm", "backward", name) == n_mm
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    assert tracer.result.dtype == torch.float32      # cross_entropy is on the CPU float32 list


def test_without_autocast_everything_runs_in_fp32(mlp_batch):
    model, x, y = mlp_batch
    tracer = log_training_step(model, x, y, None)
    assert len(tracer) > 0 and {r.dtype for r in tracer.records if r.dtype} == {"float32"}
    assert not any(r.is_cast for r in tracer.records)
    assert tracer.count("addmm", "forward") == n_linear(model)
    assert tracer.low_precision_fraction() == 0.0


def test_phases_are_detected_and_can_be_labelled():
    w = torch.randn(3, 3, requires_grad=True)
    with OpLog() as tracer:
        loss = (w * 2).sum()
        loss.backward()
    assert [(r.op, r.phase) for r in tracer.records[:2]] == [("mul", "forward"), ("sum", "forward")]
    assert ("mul", "backward") in [(r.op, r.phase) for r in tracer.records]   # MulBackward0
    with OpLog() as tracer, tracer.phase("backward"):
        torch.ones(2) + 1
    assert {r.phase for r in tracer.records} == {"backward"}
    with pytest.raises(ValueError, match="phase: expected one of"):
        with tracer.phase("sideways"):
            pass
    with pytest.raises(ValueError, match="phase"):
        tracer.select("sideways")


def test_cpu_lists_fp32_op_stays_fp32_and_unlisted_softmax_follows_its_input():
    x, w = torch.randn(4, 6), torch.randn(6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = F.linear(x, w)
        tracer = log_ops(lambda: (torch.softmax(h, -1), F.mse_loss(h, x), h.prod()))
    soft, mse, prod = tracer.result
    assert h.dtype == soft.dtype == torch.bfloat16                   # softmax: not on any CPU list
    assert mse.dtype == prod.dtype == torch.float32                  # on the CPU float32 list
    assert tracer.count("_softmax", dtype="bfloat16") == 1
    assert tracer.count("mse_loss", dtype="float32") == 1 and tracer.count("prod", dtype="float32") == 1


def test_in_place_and_out_variants_are_not_autocast():
    a, b, c = torch.randn(3, 3), torch.randn(3, 3), torch.randn(3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tracer = log_ops(lambda: (a.addmm(b, c), a.clone().addmm_(b, c),
                                    torch.mm(b, c, out=torch.empty(3, 3))))
    out_of_place, in_place, with_out = tracer.result
    assert out_of_place.dtype == torch.bfloat16 and in_place.dtype == with_out.dtype == torch.float32
    mutating = [r for r in tracer.records if r.mutates]
    assert {(r.op, r.overload, r.variant) for r in mutating} == {("addmm_", "default", "in-place"),
                                                                  ("mm", "out", "out=")}
    assert all(r.dtype == "float32" for r in mutating)


def test_table_aggregates_every_record():
    model = MLP(12, 16, depth=2, d_out=5)
    tracer = log_training_step(model, torch.randn(8, 12), torch.randint(0, 5, (8,)), torch.bfloat16)
    rows = tracer.table(hide=())
    assert sum(r["count"] for r in rows) == len(tracer)
    addmm = [r for r in rows if r["op"] == "addmm"]
    assert addmm == [dict(phase="forward", op="addmm", variant="", inputs=("bfloat16",) * 3, outputs=("bfloat16",),
                          dtype="bfloat16", low_precision=True, cast=False, count=3)]
    counts = tracer.dtype_counts("forward")
    assert counts["addmm"] == {"bfloat16": 3} and counts["_to_copy"]["cast"] == 8  # 6 params + input + logits
    assert "detach" not in counts


def test_op_table_keeps_every_name_whole_and_tints_casts_and_16_bit_rows():
    model = MLP(12, 16, depth=2, d_out=5)
    tracer = log_training_step(model, torch.randn(8, 12), torch.randint(0, 5, (8,)), torch.bfloat16)
    rows = tracer.table()
    table = op_table(rows, title="step")
    assert table.column("aten op") == [r["op"] for r in rows]           # whole names, nothing cut
    assert table.tints == ["cast" if r["cast"] else "16-bit" if r["low_precision"] else None for r in rows]
    html = table._repr_html_()
    assert "padding:3px 12px 3px 0" in html and "<code>_log_softmax</code>" in html
    with pytest.raises(ValueError, match="rows: expected the list of dicts"):
        op_table("addmm")


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="fn: expected a callable"):
        log_ops(42)
    with pytest.raises(ValueError, match="autocast_dtype"):
        log_training_step(MLP(2, 2, 1, 2), torch.randn(1, 2), torch.zeros(1, dtype=torch.long),
                            torch.float64)


@pytest.mark.gpu
def test_cuda_softmax_is_autocast_to_fp32():
    x = torch.randn(4, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        tracer = log_ops(lambda: F.linear(x, x).softmax(-1))
    assert tracer.result.dtype == torch.float32
    assert tracer.count("_softmax", dtype="float32") == 1


# --- the widget ------------------------------------------------------------------------------

def test_op_trace_explorer_updates_from_its_controls():
    from ampviz.lessons.autocast_ops import AutocastExplorer
    w = AutocastExplorer(device="cpu")
    assert w.autocast.value == "bfloat16" and w.phase.value == "forward"
    bars = {b.name: b for b in w.figure.data}
    ops = list(bars["bfloat16"].y)
    assert bars["bfloat16"].x[ops.index("addmm")] == 3          # MLP depth 2: three Linear layers
    assert bars["cast"].x[ops.index("_to_copy")] == 8           # 6 parameters, the input, the logits
    assert "float32" in w.readout.value and "16 bits" in w.readout.value
    w.autocast.value = "off"
    bars = {b.name: b for b in w.figure.data}
    assert sum(bars["bfloat16"].x) == 0 and sum(bars["cast"].x) == 0 and sum(bars["float32"].x) > 0
    w.autocast.value = "float16"
    w.phase.value = "backward"
    bars = {b.name: b for b in w.figure.data}
    assert w.tracer.count("mm", "backward", "float16") > 0
    assert bars["float16"].x[list(bars["float16"].y).index("mm")] == w.tracer.count("mm", "backward")
    assert "<code>mm</code>" in w.table.value and "forward" not in w.table.value
    # padded cells (the browser pass read "backwardones_like" from an unpadded table); casts tinted green
    assert "padding:3px 12px 3px 0" in w.table.value and "background:#DDF1E8" in w.table.value
    w.case.value = "Transformer on digit rows"
    assert "native_layer_norm_backward" in list(w.figure.data[0].y)
    n_before = len(w.figure.data[0].y)
    w.hide_views.value = False
    assert len(w.figure.data[0].y) > n_before
    with pytest.raises(ValueError, match="device: expected one of"):
        AutocastExplorer(device="meta")


def test_op_trace_explorer_shows_no_device_menu_with_a_single_device():
    from ampviz.lessons.autocast_ops import AutocastExplorer
    w = AutocastExplorer(device="cpu")
    shown = [c for box in w.children if hasattr(box, "children") for c in box.children]
    assert (w.device in shown) == torch.cuda.is_available()      # a one-entry menu would change nothing


def test_op_trace_explorer_traces_everything_before_its_figure_and_then_only_indexes(monkeypatch):
    """The browser pass saw the explorer's chart blank: anywidget gives a figure's model 2 s to load plotly's
    module after its comm opens, then drops every update. So no trace may run once the figure exists."""
    import plotly.graph_objects as go

    import ampviz.lessons.autocast_ops as ops
    events, trace, figure = [], ops.log_training_step, go.FigureWidget

    def traced(*args, **kwargs):
        events.append("trace")
        return trace(*args, **kwargs)

    def built(*args, **kwargs):
        events.append("figure")
        return figure(*args, **kwargs)

    monkeypatch.setattr(ops, "log_training_step", traced)
    monkeypatch.setattr(ops.go, "FigureWidget", built)
    w = ops.AutocastExplorer(device="cpu")
    assert events == ["trace"] * (len(w.cases) * 3) + ["figure"], events
    for case in w.cases:
        for autocast in ("off", "float16", "bfloat16"):
            w.case.value, w.autocast.value = case, autocast
            for phase in ("backward", "both", "forward"):
                w.phase.value = phase
    assert events.count("trace") == len(w.cases) * 3 and w.figure.layout.title.text.startswith(w.case.value)
