"""Where autocast acts in a step: real steps traced op by op, custom Functions, and the explorer's state."""

import pytest
import torch

from ampviz.examples.data import digits
from ampviz.examples.models import MLP
from ampviz.lessons.autocast_placement import (
    CUSTOM_VARIANTS,
    PlacementExplorer,
    placement_step,
    trace_custom_function,
)


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(0)
    d = digits(seed=0)
    return MLP(64, 32, depth=2, d_out=10), d.x_train[:32], d.y_train[:32]


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.weights, b.weights))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_in_place_optimizers_and_the_backward_change_nothing_without_an_island_on_cpu(batch, optimizer):
    ref = placement_step(*batch, optimizer=optimizer)
    assert ref.update > 0 and ref.backward_mm == {"float32": 0, "16-bit": 5}
    for inside in ("backward", "step"):
        assert same(placement_step(*batch, optimizer=optimizer, inside=inside), ref)


def test_a_backward_inside_autocast_casts_the_float32_islands_backward_down(batch):
    outside = placement_step(*batch, island=True)
    inside = placement_step(*batch, island=True, inside="backward")
    assert outside.backward_mm == {"float32": 2, "16-bit": 3} and inside.backward_mm == {"float32": 0, "16-bit": 5}
    assert not torch.equal(outside.head_grad, inside.head_grad) and not same(outside, inside)


def test_muon_inside_fp16_autocast_changes_the_weights_and_bf16_does_not_on_cpu(batch):
    fp16 = [placement_step(*batch, optimizer="muon", inside=i) for i in ("backward", "step")]
    assert not same(*fp16)                          # its Newton-Schulz matmuls were cast to fp16
    bf16 = [placement_step(*batch, optimizer="muon", dtype=torch.bfloat16, inside=i) for i in ("backward", "step")]
    assert same(*bf16)                              # Muon computes them in bf16 anyway


def test_custom_function_decorators_decide_the_dtypes_of_forward_and_backward():
    plain = trace_custom_function("plain")
    assert plain["error"] and "same dtype" in plain["error"]   # fp32 saved weight meets a 16-bit gradient
    assert trace_custom_function("plain", backward_inside=True)["error"] is None
    cast = trace_custom_function("custom_fwd(cast_inputs=float32)", backward_inside=True)
    assert cast["output"] == "float32" and cast["forward mm"] == ["float32, float32"]
    assert cast["backward mm"] == ["bfloat16, bfloat16"] * 2    # autocast reached the backward
    both = trace_custom_function("custom_fwd(cast_inputs=float32) + custom_bwd", backward_inside=True)
    assert both["backward mm"] == ["float32, float32"] * 2      # custom_bwd: the forward's autocast state
    kept = trace_custom_function("custom_fwd + custom_bwd")
    assert kept["error"] is None and kept["backward mm"] == ["bfloat16, bfloat16"] * 2
    assert len(CUSTOM_VARIANTS) == 4


def test_bad_arguments_are_named(batch):
    with pytest.raises(ValueError, match="optimizer"):
        placement_step(*batch, optimizer="lion")
    with pytest.raises(ValueError, match="inside"):
        placement_step(*batch, inside="optimizer")
    with pytest.raises(ValueError, match="dtype"):
        placement_step(*batch, dtype=torch.float32)
    with pytest.raises(ValueError, match="variant"):
        trace_custom_function("custom_bwd")


def test_explorer_state_follows_its_controls(batch):
    explorer = PlacementExplorer(*batch)
    assert explorer.changes == [0.0] * len(explorer.names) and "identical" in explorer.readout.value
    explorer.optimizer.value = "muon"
    explorer.inside.value = "step"
    assert max(explorer.changes) > 0 and "differs" in explorer.readout.value
    assert list(explorer.figure.data[0].y) == explorer.changes
    explorer.island.value = True
    explorer.inside.value = "backward"
    assert explorer.result.backward_mm["float32"] == 0 and explorer.reference.backward_mm["float32"] == 2
