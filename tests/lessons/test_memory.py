"""Memory accounting against oracles: bytes counted by hand, autograd's own saved tensors, real Adam
state; the memory figure's bars against the breakdowns; MemoryExplorer's state after slider moves."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampviz.lessons.memory import (
    CATEGORIES,
    MIB,
    SavedTensorLog,
    measure_memory,
    memory_figure,
    set_memory,
    tensor_bytes,
)
from ampviz.lessons.models import MLP


def batch(n=64, d_in=16, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g)


def test_tensor_bytes_counts_elements_times_element_size():
    ts = [torch.zeros(3, 5), torch.zeros(7, dtype=torch.bfloat16), None, torch.zeros(2, dtype=torch.int64)]
    assert tensor_bytes(ts) == 3 * 5 * 4 + 7 * 2 + 2 * 8


def test_saved_storages_are_counted_once_and_by_kind():
    a = torch.randn(4, 5, requires_grad=True)
    with SavedTensorLog(inputs=a) as log:
        b = a.exp()          # exp saves its result (a new 4x5 fp32 storage)
        c = b * b            # mul saves both operands: the same storage again, counted once
        c.sum().backward()
    assert [e.kind for e in log.entries] == ["activation"]
    assert log.bytes() == log.bytes("activation") == 4 * 5 * 4
    assert log.bytes_by_dtype() == {"float32": 80}
    assert torch.allclose(a.grad, 2 * torch.exp(2 * a.detach()))   # the log changed nothing


def test_linear_saves_its_parameter_and_input_without_extra_memory():
    layer = nn.Linear(8, 3)
    x = torch.randn(5, 8, requires_grad=True)
    with SavedTensorLog(layer, inputs=x) as log:
        layer(x).sum().backward()
    kinds = sorted(e.kind for e in log.entries)
    assert kinds == ["input", "parameter"]
    assert [e.name for e in log.entries if e.kind == "parameter"] == ["weight"]
    assert log.bytes("activation") == 0


def test_autocast_weight_copies_are_recognised_and_exactly_sized():
    model = MLP(16, 32, depth=2, d_out=10)
    x, y = batch()
    with SavedTensorLog(model, inputs=(x, y)) as log:
        with torch.amp.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(model(x), y).backward()
    copies = {e.name: e for e in log.entries if e.kind == "weight_copy"}
    # the first layer's weight is not needed for backward (x does not require grad)
    assert set(copies) == {"body.2.weight", "head.weight"}
    for name, e in copies.items():
        p = dict(model.named_parameters())[name]
        assert e.dtype is torch.bfloat16 and e.nbytes == p.numel() * 2


def test_log_rejects_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        SavedTensorLog(model="mlp")
    with pytest.raises(TypeError, match="inputs"):
        SavedTensorLog(inputs=[1, 2])
    with pytest.raises(ValueError, match="kind"):
        SavedTensorLog().bytes("weights")


def test_measure_memory_counts_fp32_state_and_halves_saved_activations():
    torch.manual_seed(0)
    width, depth, n = 256, 3, 256
    model = MLP(16, width, depth, 10)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(n)
    fp32 = measure_memory(model, x, y, F.cross_entropy)
    amp = measure_memory(model, x, y, F.cross_entropy, autocast_dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(before)
    for b in (fp32, amp):
        assert b.weights == b.gradients == 4 * n_params
        assert b.dtypes["weights"] == b.dtypes["gradients"] == b.dtypes["optimizer_state"] == ["float32"]
        # Adam keeps exp_avg and exp_avg_sq per parameter, plus a scalar fp32 step per parameter
        assert b.optimizer_state == 2 * 4 * n_params + 4 * n_tensors
        assert b.total == sum(b.as_dict()[c] for c in CATEGORIES)
    assert fp32.weight_copies == 0 and fp32.dtypes["activations"] == ["float32"]
    weights_saved = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)) - 16 * width
    assert amp.weight_copies == 2 * weights_saved
    # ReLU outputs dominate: depth x (n, width) fp32 saved, each once; autocast saves them in bf16
    assert fp32.activations >= depth * n * width * 4
    assert amp.dtypes["activations"][0] == "bfloat16"
    assert 0.45 < amp.activations / fp32.activations < 0.6
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))   # the caller's model untouched
    assert fp32.peak_step_bytes is None                                          # CPU: no allocator counters


def test_measure_memory_rejects_bad_arguments():
    x, y = batch()
    with pytest.raises(TypeError, match="model"):
        measure_memory("mlp", x, y, F.cross_entropy)
    with pytest.raises(ValueError, match="autocast_dtype"):
        measure_memory(MLP(16, 8, 1, 10), x, y, F.cross_entropy, autocast_dtype=torch.float64)


@pytest.mark.gpu
def test_measure_memory_reads_cuda_peak_memory():
    x, y = batch(1024)
    model = MLP(16, 1024, 4, 10)
    fp32 = measure_memory(model, x.cuda(), y.cuda(), F.cross_entropy)
    amp = measure_memory(model, x.cuda(), y.cuda(), F.cross_entropy, autocast_dtype=torch.float16)
    assert fp32.peak_step_bytes >= fp32.activations and amp.peak_step_bytes > 0
    assert amp.gradients == fp32.gradients


def fake(**kw):
    from ampviz.lessons.memory import MemoryBreakdown
    base = dict(weights=MIB, gradients=MIB, optimizer_state=2 * MIB, weight_copies=0, activations=4 * MIB,
                dtypes={"weights": ["float32"], "gradients": ["float32"], "optimizer_state": ["float32"]})
    base.update(kw)
    return MemoryBreakdown(**base)


def test_memory_figure_bars_are_the_breakdowns_in_mib_and_update_in_place():
    fig = memory_figure({"fp32": fake(), "amp": fake(weight_copies=MIB // 2, activations=2 * MIB)})
    bars = {t.name: list(t.y) for t in fig.data if t.type == "bar"}
    assert bars["saved activations"] == [4.0, 2.0] and bars["16-bit weight copies"] == [0.0, 0.5]
    assert list(fig.data[-1].text) == ["8.00 MiB", "6.50 MiB (0.81x)"]
    assert "float32 in every bar" in fig.layout.title.text
    set_memory(fig, {"a": fake(activations=0), "b": fake(gradients=2 * MIB, dtypes={"gradients": ["bfloat16"]})})
    assert list(fig.data[0].x) == ["a", "b"] and list(fig.data[1].y) == [1.0, 2.0]
    assert "bfloat16" in fig.layout.title.text
    with pytest.raises(ValueError, match="breakdowns"):
        memory_figure({})


def test_memory_explorer_measures_each_setting_and_updates_in_place():
    from ampviz.lessons.memory import MemoryExplorer
    w = MemoryExplorer(device="cpu", width=64, depth=1, batch=16)
    fig_id = id(w.figure)
    first = list(w.figure.data[0].y)            # weights
    w.depth.value = 2
    result = w.breakdowns()
    assert id(w.figure) == fig_id
    assert list(w.figure.data[0].y) == [result["fp32"].weights / MIB, result["autocast bfloat16"].weights / MIB]
    assert w.figure.data[0].y[0] > first[0]    # one more 64x64 layer
    w.batch.value = 1024
    acts = list(w.figure.data[4].y)
    result = w.breakdowns(64, 2, 1024)
    assert acts == [result["fp32"].activations / MIB, result["autocast bfloat16"].activations / MIB]
    assert acts[1] < acts[0]                    # bf16 activations
    assert "unchanged" in w.readout.value and "float32 gradients" in w.readout.value
    assert w.breakdowns(64, 2, 16) is w.breakdowns(64, 2, 16)   # cached
    with pytest.raises(ValueError, match="width"):
        MemoryExplorer(device="cpu", width=100)
