"""ampviz.lessons.dataflow: the dtypes measured on each arrow of a real step, against the tensors themselves."""

import pytest
import torch
import torch.nn as nn

from ampviz.lessons.dataflow import StepFlow, flow_figure, measure_dtypes


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_autocast_step_keeps_fp32_master_weights(low):
    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    flow = measure_dtypes(model, opt, *batch(), autocast_dtype=low)
    name = str(low).removeprefix("torch.")
    n_params = len(list(model.parameters()))
    assert flow.params == flow.grads == flow.params_after == flow.optimizer_state == "float32"
    assert flow.forward_matmul == flow.backward_matmul == flow.activations == name
    assert flow.casts_in == n_params + 1                  # every parameter and the input batch
    assert flow.casts_back == n_params                    # each parameter's gradient back to fp32
    assert flow.optimizer_ops == "float32" and flow.params_changed
    # oracle: the tensors themselves
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")


def test_pure_half_step_is_16_bit_everywhere():
    model = small_model().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batch()
    flow = measure_dtypes(model, opt, x.half(), y, autocast_dtype=None)
    assert flow.params == flow.grads == flow.params_after == flow.optimizer_state == "float16"
    assert flow.casts_in == 0 and flow.casts_back == 0 and flow.autocast_dtype == "off"
    assert flow.optimizer_ops == "float16"
    assert [r[0] for r in flow.rows()][0].startswith("parameters")


def test_scaler_step_is_measured_and_skips_nothing():
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    flow = measure_dtypes(model, opt, *batch(), autocast_dtype=torch.bfloat16, scaler=scaler)
    assert flow.params_changed and flow.grads == "float32"
    assert scaler.get_scale() == 2.0 ** 8


def test_measure_dtypes_rejects_bad_arguments():
    model = small_model()
    with pytest.raises(ValueError, match="autocast_dtype"):
        measure_dtypes(model, torch.optim.SGD(model.parameters(), lr=0.1), *batch(), autocast_dtype=torch.float64)
    with pytest.raises(TypeError, match="optimizer"):
        measure_dtypes(model, "sgd", *batch())


def test_flow_figure_writes_the_measured_dtypes():
    model = small_model()
    flow = measure_dtypes(model, torch.optim.SGD(model.parameters(), lr=0.1), *batch(), torch.float16)
    fig = flow_figure(flow)
    labels = {a.name: a.text for a in fig.layout.annotations}
    assert "float32" in labels["label:params"] and "float16" in labels["label:forward"]
    assert labels["cast:params->forward"].startswith(f"{flow.casts_in} casts")
    assert len([s for s in fig.layout.shapes if s.name.startswith("box:")]) == 6
    with pytest.raises(TypeError, match="flow"):
        flow_figure({"params": "float32"})
    assert isinstance(flow, StepFlow)
