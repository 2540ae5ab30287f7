"""Where autocast acts in a step: real steps traced op by op, custom Functions, and the explorer's state."""

import pytest
import torch

from ampviz.lessons.autocast_code import (
    CUSTOM_VARIANTS,
    VARIANTS,
    autocast_in_threads,
    custom_matmul,
    parallel_apply_autocast_call,
    trace_custom_function,
)
from ampviz.lessons.autocast_placement import PlacementExplorer, placement_step
from ampviz.lessons.data import digits
from ampviz.lessons.models import MLP


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


def test_custom_fwd_without_custom_bwd_leaves_the_backward_without_autocast():
    """Lesson 04b's exercise: custom_fwd alone records the forward's autocast state but nothing restores it in the
    backward, which then fails outside the block as the plain Function does."""
    alone = trace_custom_function("custom_fwd")
    assert alone["output"] == "bfloat16" and alone["error"] and "same dtype" in alone["error"]
    assert trace_custom_function("custom_fwd", backward_inside=True)["error"] is None
    assert "custom_fwd" in VARIANTS and "custom_fwd" not in CUSTOM_VARIANTS


def test_bad_arguments_are_named(batch):
    with pytest.raises(ValueError, match="optimizer"):
        placement_step(*batch, optimizer="lion")
    with pytest.raises(ValueError, match="inside"):
        placement_step(*batch, inside="optimizer")
    with pytest.raises(ValueError, match="dtype"):
        placement_step(*batch, dtype=torch.float32)
    with pytest.raises(ValueError, match="variant"):
        trace_custom_function("custom_bwd")


def test_placement_step_returns_every_unscaled_gradient(batch):
    model, x, y = batch
    result = placement_step(model, x, y, island=True)
    assert [g.shape for g in result.grads] == [p.shape for p in model.parameters()]
    assert all(g.dtype == torch.float32 for g in result.grads) and torch.equal(result.grads[-2], result.head_grad)
    ref = model.__class__(64, 32, depth=2, d_out=10)
    ref.load_state_dict(model.state_dict())
    import torch.nn.functional as F
    F.cross_entropy(ref(x), y).backward()            # fp32 gradients: the unscaled fp16 ones are near them
    for g, p in zip(result.grads, ref.parameters()):     # (a scaled gradient would be 2^16 times too large)
        assert (g - p.grad).abs().max() < 0.15 * p.grad.abs().max()


def visible(explorer):
    return [(tuple(bar.y), tuple(bar.text)) for bar in explorer.figure.data], explorer.readout.value


def test_explorer_starts_on_a_difference_and_every_control_changes_the_figure(batch):
    """The browser pass found the old explorer empty at first and 8 of 9 single changes doing nothing."""
    explorer = PlacementExplorer(*batch, lr=0.02)
    assert max(explorer.changes["backward"]) > 0                   # the island's backward: not empty at first
    first = visible(explorer)
    for control, value in ((explorer.optimizer, "adam"), (explorer.optimizer, "muon"),
                           (explorer.dtype, torch.bfloat16), (explorer.island, False)):
        start = control.value
        control.value = value
        assert visible(explorer)[0] != first[0], (control.description, value)    # the bars themselves moved
        control.value = start
        assert visible(explorer) == first
    assert [list(bar.y) for bar in explorer.figure.data] == [
        [max(c, explorer.Y_RANGE[0]) for c in explorer.changes[k]] for k in explorer.MISPLACED]


def test_explorer_axis_is_fixed_so_sizes_stay_comparable(batch):
    explorer = PlacementExplorer(*batch, lr=0.02)
    axis = explorer.figure.layout.yaxis
    assert axis.type == "log" and tuple(axis.range) == (-8.0, 1.0)
    explorer.optimizer.value = "adam"                               # differences near 2 lr: same axis
    assert tuple(explorer.figure.layout.yaxis.range) == (-8.0, 1.0)
    assert max(explorer.changes["backward"]) > 0.1
    explorer.island.value = False                                   # nothing differs on the CPU: all at "0"
    if x_is_cpu(batch):
        assert set(explorer.figure.data[0].text) == {"0"} and set(explorer.figure.data[1].text) == {"0"}
    explorer.optimizer.value = "muon"                               # Muon's products: only the step moves them
    assert set(explorer.figure.data[0].text) == {"0"} and max(explorer.changes["step"]) > 0


def x_is_cpu(batch):
    return batch[1].device.type == "cpu"


def test_dataparallel_replicas_get_the_enabled_flag_but_not_the_dtype():
    call = parallel_apply_autocast_call()
    assert "enabled=" in call and "dtype" not in call, call
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    default = torch.get_autocast_dtype("cpu")
    other = torch.float16 if default == torch.bfloat16 else torch.bfloat16
    seen = autocast_in_threads(layer, x, other)
    assert seen == {"caller": other, "new thread": torch.float32, "new thread + the caller's enabled flag": default}
    assert not torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == default


def test_explorer_state_follows_its_controls(batch):
    explorer = PlacementExplorer(*batch, lr=0.02, island=False)
    assert explorer.changes == {k: [0.0] * len(explorer.names) for k in explorer.MISPLACED}
    explorer.optimizer.value = "muon"
    assert max(explorer.changes["step"]) > 0 and explorer.changes["backward"] == [0.0] * len(explorer.names)
    explorer.island.value = True
    assert explorer.results["backward"].backward_mm["float32"] == 0 and explorer.reference.backward_mm["float32"] == 2
    assert "recommended 2, backward inside 0, all inside 0" in explorer.readout.value


def test_adam_moves_a_weight_whose_gradient_flips_by_its_first_step_formula(batch):
    """The old lesson asserted only moved > 0.5 lr for "almost twice lr"; the formula pins every flipped weight."""
    from ampviz.lessons.autocast_placement import adam_first_step_moves
    from ampviz.lessons.data import digits
    model, _, _ = batch
    d = digits(seed=0)
    batches = [(d.x_train[32 * k:32 * (k + 1)], d.y_train[32 * k:32 * (k + 1)]) for k in range(5)]
    moves = adam_first_step_moves(model, batches, dtype=torch.bfloat16, lr=0.02)
    assert moves["flipped"].numel() > 0 and torch.allclose(moves["flipped"], moves["predicted"], rtol=1e-3)
    assert moves["flipped"].max() <= 2.0 and moves["kept"].numel() > 1000 and moves["kept"].max() < 0.01


def test_the_engine_sums_a_gradient_to_its_input_shape_then_casts_it_to_its_dtype():
    from ampviz.lessons.autocast_placement import engine_reduces_then_casts
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        assert engine_reduces_then_casts(dtype) == [("sum", ("float32",), ("float32",)),
                                                    ("_to_copy", ("float32",), (name,))]


def test_explorer_computes_every_first_move_before_its_figure(batch, monkeypatch):
    """A figure's model has 2 s to load plotly's module once its comm opens (anywidget), so the steps a learner's
    first change needs are computed before the figure exists; one control change then runs no step."""
    import plotly.graph_objects as go

    import ampviz.lessons.autocast_placement as placement
    events, step, figure = [], placement.placement_step, go.FigureWidget

    def stepped(*args, **kwargs):
        events.append("step")
        return step(*args, **kwargs)

    def built(*args, **kwargs):
        events.append("figure")
        return figure(*args, **kwargs)

    monkeypatch.setattr(placement, "placement_step", stepped)
    monkeypatch.setattr(placement.go, "FigureWidget", built)
    explorer = PlacementExplorer(*batch, lr=0.02)
    assert len(explorer.first_moves()) == 5 and events == ["step"] * 15 + ["figure"]
    assert explorer.steps_computed == 15
    for control, value in ((explorer.optimizer, "adam"), (explorer.optimizer, "muon"),
                           (explorer.dtype, torch.bfloat16), (explorer.island, False)):
        start = control.value
        control.value = value
        control.value = start
    assert events.count("step") == 15 == explorer.steps_computed


def test_cast_inputs_casts_only_inside_an_autocast_block():
    """Lesson 04b said cast_inputs casts the inputs to float32; it does so only where autocast is enabled."""
    fn = custom_matmul("custom_fwd(cast_inputs=float32)")
    h = torch.randn(4, 4).to(torch.bfloat16)
    assert fn.apply(h, h).dtype == torch.bfloat16
    with torch.amp.autocast("cpu", dtype=torch.bfloat16):
        assert fn.apply(h, h).dtype == torch.float32


def test_a_forward_that_carries_its_own_autocast_keeps_its_dtype_in_every_thread():
    """Lesson 04b's fix for DataParallel's replicas (dtype not inherited): autocast on the model's forward."""
    class SelfCast(torch.nn.Linear):
        @torch.autocast("cpu", dtype=torch.float16)
        def forward(self, x):
            return super().forward(x)

    x = torch.randn(4, 8)
    assert autocast_in_threads(torch.nn.Linear(8, 3), x, torch.float16)["new thread + the caller's enabled flag"] \
        == torch.bfloat16
    assert set(autocast_in_threads(SelfCast(8, 3), x, torch.float16).values()) == {torch.float16}
