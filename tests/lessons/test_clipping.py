"""ampviz.lessons.clipping, plots.clipping and ClipOrderExplorer against a real GradScaler step."""

import math

import pytest
import torch
import torch.nn as nn

from ampviz.lessons.clipping import (
    MAX_NORMS,
    ORDERS,
    TRACES,
    ClipOrderExplorer,
    clipped_norm,
    clipped_norms,
    clipping_figure,
    total_norm,
)


def grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 8, generator=g) * 0.1, torch.randn(16, generator=g) * 0.1]


def test_total_norm_is_clip_grad_norm_s_norm():
    gs = grads()
    p = [torch.zeros_like(g, requires_grad=True) for g in gs]
    for q, g in zip(p, gs):
        q.grad = g.clone()
    assert total_norm(gs) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(p, 1e9)), rel=1e-6)


def test_wrong_order_divides_the_threshold_by_the_scale():
    gs = grads()
    n = total_norm(gs)
    max_norm = n / 4                                              # the right order clips to a quarter
    right = clipped_norm(gs, max_norm, 16, "unscale first")
    wrong = clipped_norm(gs, max_norm, 16, "clip first")
    assert right == pytest.approx(max_norm, rel=1e-5)
    assert wrong == pytest.approx(max_norm / 2 ** 16, rel=1e-5)
    big = clipped_norms(gs, [10 * n], 16)                         # a threshold that should never fire...
    assert big["unscale first"][0] == pytest.approx(n, rel=1e-6)
    assert big["clip first"][0] == pytest.approx(10 * n / 2 ** 16, rel=1e-5)   # ...fires anyway


def test_replay_matches_a_real_scaler_step():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for order in ORDERS:
        m = nn.Linear(8, 4)
        m.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
        true = [p.grad / 2 ** 10 for p in m.parameters()]
        if order == "unscale first":
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        scaler.step(opt)                                          # unscales .grad in place if needed
        used = total_norm([p.grad for p in m.parameters()])       # what the optimizer stepped with
        assert used == pytest.approx(clipped_norm(true, 0.05, 10, order), rel=1e-5)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_norm"):
        clipped_norm(grads(), 0.0, 16, "clip first")
    with pytest.raises(ValueError, match="log2_scale"):
        clipped_norm(grads(), 1.0, 16.5, "clip first")
    with pytest.raises(ValueError, match="order"):
        clipped_norm(grads(), 1.0, 16, "whenever")
    with pytest.raises(TypeError, match="grads"):
        total_norm([])


def test_figure_and_widget_follow_the_controls():
    gs = grads()
    fig = clipping_figure(gs, 0.1, 12)
    assert list(fig.data[TRACES["clip first"]].x) == list(MAX_NORMS)
    assert fig.data[TRACES["clip first now"]].y[0] == pytest.approx(clipped_norm(gs, 0.1, 12, "clip first"))
    w = ClipOrderExplorer(gs, max_norm=0.1, log2_scale=12)
    assert w.norms["clip first"] == pytest.approx(min(w.true_norm, 0.1 / 2 ** 12), rel=1e-5)
    w.scale_slider.value = 0                                      # no scaling: both orders agree
    assert w.norms["clip first"] == pytest.approx(w.norms["unscale first"], rel=1e-6)
    w.norm_slider.value = 10.0
    assert w.norms["unscale first"] == pytest.approx(w.true_norm, rel=1e-6)
    assert "wrong / right" in w.readout.value
    assert math.isclose(w.figure.layout.shapes[0].x0, 10.0, rel_tol=1e-9)
    with pytest.raises(ValueError, match="log2_scale"):
        ClipOrderExplorer(gs, log2_scale=40)


def test_no_line_hugs_the_edges_of_the_plot():
    gs = grads()
    for max_norm, log2_scale in ((0.1, 16), (1e-6, 24), (100.0, 0)):
        fig = clipping_figure(gs, max_norm, log2_scale)
        lo, hi = fig.layout.yaxis.range
        ys = [math.log10(y) for t in fig.data for y in t.y if y and y > 0]
        margin = 0.08 * (hi - lo)                                 # the browser pass saw the true norm on the top edge
        assert lo + margin <= min(ys) and max(ys) <= hi - margin


@pytest.mark.parametrize("control, value", [("norm_slider", 1.0), ("scale_slider", 4)])
def test_every_control_changes_the_figure_from_the_first_state(control, value):
    w = ClipOrderExplorer(grads(), max_norm=0.1, log2_scale=16)
    before = [tuple(t.y) for t in w.figure.data] + [w.figure.layout.shapes[0].x0, w.readout.value]
    getattr(w, control).value = value
    assert [tuple(t.y) for t in w.figure.data] + [w.figure.layout.shapes[0].x0, w.readout.value] != before
