"""Widgets by their state after controls change: figure data, labels, readouts (no browser)."""

import json
import warnings

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

from ampviz import histogram as H
from ampviz.plots.histogram import region_edges
from ampviz.plots.style import percent
from ampviz.run import Run
from ampviz.widgets import RunDashboard, ScaleExplorer, ScalerPlayground


def make_run(steps=8, log2_scales=(16, 16, 15, 15, 15, 15, 16, 16), seed=0, rank=0):
    """Two tensors: a weight gradient stored unscaled, an activation gradient stored scaled."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((1, steps, 2, H.NBINS), dtype=np.int64)
    scale = np.exp2(np.asarray(log2_scales, dtype=float))[None]
    for h in range(steps):
        w = np.exp2(rng.uniform(-34, -6, 400))
        a = np.exp2(rng.uniform(-40, -10, 600)) * scale[0, h]
        a[:50] = 0.0
        counts[0, h, 0] = H.histogram(torch.from_numpy(w).float()).numpy()
        counts[0, h, 1] = H.histogram(torch.from_numpy(a).float()).numpy()
    nxt = np.concatenate([scale[:, 1:], scale[:, -1:]], axis=1)
    return Run(np.arange(steps), rng.random((1, steps)), scale, nxt, nxt < scale, np.arange(steps), counts,
               ["fc.weight", "fc"], ["weight", "activation"], ["torch.float32", "torch.float16"],
               {"world_size": 2 if rank else 1, "ranks": [rank], "every": 1,
                "domains": {"weight": "unscaled", "activation": "scaled"}})


def figure_state(figure_widget) -> dict:
    """The figure as plain data, without the per-widget trace uids."""
    d = json.loads(go.Figure(figure_widget).to_json())
    for trace in d["data"]:
        trace.pop("uid", None)
    return d


def named(items, name):
    [item] = [x for x in items if x.name == name]
    return item


def test_scale_explorer_bars_are_the_runs_unscaled_counts():
    run = make_run()
    w = ScaleExplorer(run)
    expected = run.counts_in("unscaled")[0].sum(axis=(0, 1))
    np.testing.assert_array_equal(w.counts, expected)
    np.testing.assert_array_equal(named(w.figure.data, "binades").y, expected[H.BELOW:H.ABOVE])
    assert w.slider.value == 15                          # the run's median scale
    w1 = ScaleExplorer(run, step=3, tensor="fc")
    np.testing.assert_array_equal(w1.counts, run.counts_in("unscaled")[0, 3, 1])
    w2 = ScaleExplorer(run, kind="weight")
    np.testing.assert_array_equal(w2.counts, run.counts[0, :, 0].sum(axis=0))


@pytest.mark.parametrize("fmt", ["fp16", "fp8_e5m2"])
def test_moving_the_slider_moves_regions_and_updates_shares(fmt):
    run = make_run()
    w = ScaleExplorer(run, fmt)
    w.format_dropdown.value = fmt
    lo, hi = w.figure.layout.xaxis2.range
    overflow = []
    for s in (0, 9, 24, 32):
        w.slider.value = s
        fate = H.fate(w.counts, fmt, log2_scale=s)
        for r, (a, b) in region_edges(fmt, s).items():
            shape = named(w.figure.layout.shapes, f"region:{r}")
            assert (shape.x0, shape.x1) == (min(max(a, lo), hi), min(max(b, lo), hi))
            assert w.fractions[r] == pytest.approx(float(fate.fraction(r)), abs=1e-15)
            label = named(w.figure.layout.annotations, f"fraction:{r}").text
            assert label.endswith(f"<b>{percent(w.fractions[r])}</b>")
            assert f"{int(getattr(fate, r)):,} ({percent(w.fractions[r])}" in w.readout.value
        assert f"2<sup>{s}</sup>" in w.figure.layout.title.text and w.scale_label.value.startswith(f"2^{s} ")
        overflow.append(w.fractions["overflow"])
    assert overflow[0] == 0 and overflow[-1] > 0.2 and overflow == sorted(overflow)


def test_scale_explorer_is_built_with_its_final_initial_state():
    """A FigureWidget saves only the figure it was created with: the initial figure must already
    be the state the controls describe, identical to reaching it by moving the slider."""
    counts = make_run().counts_in("unscaled")[0].sum(axis=(0, 1))
    direct = ScaleExplorer(counts, log2_scale=11)
    moved = ScaleExplorer(counts, log2_scale=3)
    moved.slider.value = 11
    assert figure_state(direct.figure) == figure_state(moved.figure)
    assert direct.readout.value == moved.readout.value


def test_scale_explorer_from_a_raw_tensor_matches_a_real_cast():
    x = torch.from_numpy(np.exp2(np.random.default_rng(5).uniform(-34, -10, 20000))).float()
    w = ScaleExplorer(x, log2_scale=0)
    for s in (0, 5, 10):
        w.slider.value = s
        assert w.fractions["flushed"] == pytest.approx(float(((x * 2.0 ** s).half() == 0).double().mean()))


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(source=np.zeros(5, dtype=np.int64)), TypeError, "source: expected an ampviz.Run"),
    (dict(step=2), ValueError, "step: only applies when the source is an ampviz.Run"),
    (dict(log2_range=(5, 5)), ValueError, "log2_range: expected -126 <= lo < hi <= 126"),
    (dict(log2_scale=40), ValueError, "log2_scale: 40 is outside log2_range"),
    (dict(format="fp12"), ValueError, "unknown format"),
    (dict(domain="weird"), ValueError, "domain: expected one of"),
])
def test_scale_explorer_rejects_bad_arguments(kwargs, err, match):
    args = dict(source=H.histogram(torch.ones(4)).numpy()) | kwargs
    with pytest.raises(err, match=match):
        ScaleExplorer(args.pop("source"), **args)


def test_scale_explorer_run_selection_errors():
    run = make_run()
    with pytest.raises(KeyError, match="step: 99 has no histogram"):
        ScaleExplorer(run, step=99)
    with pytest.raises(KeyError, match="tensor: no tensor named 'nope'"):
        ScaleExplorer(run, tensor="nope")
    with pytest.raises(ValueError, match="kind: expected one of"):
        ScaleExplorer(run, kind="bias")


# ---------------------------------------------------------------------------- ScalerPlayground
def overflow_trace(n=300, seed=0):
    """Per-step maxima whose ceiling wanders between 2**19 and 2**23, with two forward overflows."""
    t = np.exp2(np.random.default_rng(seed).uniform(-7, -3, n))
    t[[40, 41]] = np.inf
    return t


def test_playground_replays_the_policy_the_controls_describe():
    from ampviz.plots.scale_trace import TRACES
    from ampviz.replay import DeepSpeedPolicy, MegatronPolicy, StaticPolicy, TorchPolicy, replay
    trace = overflow_trace()
    w = ScalerPlayground(trace)
    assert w.replay.scale.tolist() == replay(TorchPolicy(), trace).scale.tolist()
    w.init_slider.value, w.interval_slider.value = 20, 10
    expected = replay(TorchPolicy(2.0 ** 20, growth_interval=10), trace)
    np.testing.assert_array_equal(w.replay.scale, expected.scale)
    np.testing.assert_array_equal(w.figure.data[TRACES["replay"]].y, np.log2(expected.scale))
    assert list(w.figure.data[TRACES["replay skipped"]].x) == list(np.nonzero(expected.skipped)[0])
    assert w.figure.data[TRACES["replay skipped"]].name == f"replay: {expected.n_skipped} skipped"
    assert f"<b>{expected.n_skipped}</b> of 300 steps skipped" in w.readout.value
    # a greyed-out control says why (the browser review found the hysteresis slider disabled without a word)
    assert "hysteresis: not used by the PyTorch GradScaler policy" in w.readout.value
    w.policy_dropdown.value = "deepspeed"
    w.hysteresis_slider.value = 3
    ds = replay(DeepSpeedPolicy(2.0 ** 20, scale_factor=2.0, scale_window=10, hysteresis=3), trace)
    np.testing.assert_array_equal(w.replay.scale, ds.scale)
    assert w.backoff_slider.disabled and not w.hysteresis_slider.disabled
    w.policy_dropdown.value = "megatron"
    w.backoff_slider.value = 0.25
    mg = replay(MegatronPolicy(2.0 ** 20, growth_factor=2.0, backoff_factor=0.25, growth_interval=10, hysteresis=3),
                trace)
    np.testing.assert_array_equal(w.replay.scale, mg.scale)
    w.policy_dropdown.value = "static"
    assert w.replay.scale.tolist() == replay(StaticPolicy(2.0 ** 20), trace).scale.tolist()
    assert all(c.disabled for c in (w.growth_slider, w.backoff_slider, w.interval_slider, w.hysteresis_slider))
    assert "growth_factor, backoff_factor, growth_interval, hysteresis: not used by the static policy" \
        in w.readout.value


def test_playground_reports_where_deepspeed_stops():
    w = ScalerPlayground(overflow_trace(), policy="deepspeed")
    w.init_slider.value = 0                              # init_scale 1 = DeepSpeed's default min_scale
    assert w.replay.crashed_at == 41                     # hysteresis 2: the second overflow at the minimum ends it
    assert "DeepSpeed stops" in w.readout.value and "step 41" in w.readout.value


def test_playground_over_a_run_draws_the_recorded_trace():
    from ampviz.plots.scale_trace import TRACES
    run = make_run()
    w = ScalerPlayground(run)
    np.testing.assert_array_equal(w.figure.data[TRACES["recorded"]].y, np.log2(run.loss_scale[0]))
    assert w.recorded_skipped == int(run.skipped.sum())
    assert f"{w.recorded_skipped} of {run.n_steps} steps skipped" in w.readout.value


def test_playground_starts_from_the_runs_gradscaler_and_reproduces_it():
    from test_replay_trace import record_fp16_run
    run = record_fp16_run(steps=40)
    w = ScalerPlayground(run)
    sc = run.meta["scaler"]
    assert 2.0 ** w.init_slider.value == sc["init_scale"] and w.interval_slider.value == sc["growth_interval"]
    np.testing.assert_array_equal(w.replay.scale, run.loss_scale[0])
    assert w.replay.n_skipped == w.recorded_skipped > 0


def deepspeed_meta(run, **ds):
    """``run`` as if recorded from a DeepSpeed engine (``ampviz.integrations.deepspeed``) with these settings."""
    meta = dict(run.meta, deepspeed={"stage": 2, "dtype": "fp16", "weights": "partition", **ds})
    return Run(run.steps, run.loss, run.loss_scale, run.next_scale, run.grown, run.hist_steps, run.counts,
               run.tensor_names, run.tensor_kinds, run.tensor_dtypes, meta)


def test_playground_starts_from_a_deepspeed_runs_own_scaler():
    from ampviz.replay import DeepSpeedPolicy, StaticPolicy, TorchPolicy, policy_from_run
    base = make_run()
    run = deepspeed_meta(base, dynamic_loss_scale=True, init_scale=2.0 ** 16, scale_window=5, min_loss_scale=4.0,
                         hysteresis=3, scale_factor=2.0, consecutive_hysteresis=True, raise_error_at_min_scale=False)
    w = ScalerPlayground(run)
    assert w.policy_dropdown.value == "deepspeed"
    assert w.current_policy() == policy_from_run(run) == DeepSpeedPolicy(
        2.0 ** 16, 2.0, scale_window=5, min_scale=4.0, hysteresis=3, consecutive_hysteresis=True,
        raise_error_at_min_scale=False)
    # a static DeepSpeed loss scale: the static policy at that scale
    static = deepspeed_meta(base, dynamic_loss_scale=False, init_scale=2.0 ** 10)
    w = ScalerPlayground(static)
    assert w.policy_dropdown.value == "static" and w.current_policy() == StaticPolicy(2.0 ** 10)
    # no loss scaler (a bf16 DeepSpeed run): GradScaler's defaults, as for a plain trace; a policy given wins
    bf16 = deepspeed_meta(base, dtype="bf16")
    assert ScalerPlayground(bf16).current_policy() == TorchPolicy()
    assert ScalerPlayground(run, policy="pytorch").current_policy() == TorchPolicy(2.0 ** 16, growth_interval=5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(source=np.zeros((2, 3))), "source: expected an ampviz.Run or a non-empty 1-D trace"),
    (dict(policy="apex"), "policy: expected one of"),
    (dict(format="fp8_e4m3fn"), "format: fp8_e4m3fn has no inf"),
    (dict(rank=1), "rank, tensors: only apply when the source is an ampviz.Run"),
])
def test_playground_rejects_bad_arguments(kwargs, match):
    args = dict(source=overflow_trace()) | kwargs
    with pytest.raises(ValueError, match=match):
        ScalerPlayground(args.pop("source"), **args)


# ---------------------------------------------------------------------------- RunDashboard
def test_dashboard_step_slider_shows_that_steps_histogram_at_its_recorded_scale():
    run = make_run()
    d = RunDashboard(run)
    unscaled = run.counts_in("unscaled")[0]
    for step in (0, 3, 7):
        d.step_slider.value = step
        s = int(np.log2(run.loss_scale[0, step]))
        expected = unscaled[step].sum(axis=0)
        np.testing.assert_array_equal(d.counts, expected)
        np.testing.assert_array_equal(named(d.histogram.data, "binades").y, expected[H.BELOW:H.ABOVE])
        fate = H.fate(expected, "fp16", log2_scale=s)
        lo, hi = d.histogram.layout.xaxis2.range
        for r, (a, b) in region_edges("fp16", s).items():
            shape = named(d.histogram.layout.shapes, f"region:{r}")
            assert (shape.x0, shape.x1) == (min(max(a, lo), hi), min(max(b, lo), hi))
            assert d.fractions[r] == pytest.approx(float(fate.fraction(r)), abs=1e-15)
        assert d.histogram.layout.title.text.startswith(f"Step {step} vs fp16 at loss scale 2<sup>{s}</sup>")
        assert d.heatmap.layout.shapes[0].x0 == step and d.trace.layout.shapes[-1].x0 == step
        assert f"2^{s} = {2 ** s:,}" in d.readout.value


def test_dashboard_selectors_change_what_is_shown():
    run = make_run()
    d = RunDashboard(run, step=2)
    d.kind_buttons.value = "activation"
    assert list(d.tensor_dropdown.options) == ["all tensors", "fc"]
    np.testing.assert_array_equal(d.counts, run.counts_in("unscaled")[0, 2, 1])
    assert d.heatmap.layout.title.text.startswith("all activation tensors, rank 0<br>")
    d.kind_buttons.value = "all"
    d.tensor_dropdown.value = "fc.weight"
    np.testing.assert_array_equal(d.counts, run.counts[0, 2, 0])
    d.domain_buttons.value = "scaled"                       # values move, limits stay put
    np.testing.assert_array_equal(d.counts, run.counts_in("scaled")[0, 2, 0])
    assert named(d.histogram.layout.shapes, "region:overflow").x0 == region_edges("fp16", 0)["overflow"][0]
    assert "scaled" in d.histogram.layout.xaxis2.title.text and "scaled" in d.heatmap.layout.yaxis.title.text
    heat_z = np.asarray(d.heatmap.data[0].z, dtype=float)
    assert np.nansum(10 ** heat_z) == pytest.approx(run.counts[0, :, 0, H.BELOW:H.ABOVE].sum(), rel=2e-3)


def test_dashboard_rank_selector_redraws_that_ranks_trace():
    from ampviz.plots.scale_trace import TRACES
    run = Run.merge([make_run(rank=0), make_run(rank=1, seed=1, log2_scales=(12,) * 8)])
    d = RunDashboard(run)
    d.rank_dropdown.value = 1
    np.testing.assert_array_equal(d.trace.data[TRACES["recorded"]].y, np.log2(run.loss_scale[1]))
    np.testing.assert_array_equal(d.counts, run.counts_in("unscaled")[1, 0].sum(axis=0))
    assert d.trace.layout.title.text.startswith("Loss scale, rank 1<br>")


def test_dashboard_is_built_with_its_final_initial_state():
    run = make_run()
    direct = RunDashboard(run, step=5, kind="activation")
    moved = RunDashboard(run)
    moved.kind_buttons.value = "activation"
    moved.step_slider.value = 5
    for a, b in ((direct.histogram, moved.histogram), (direct.heatmap, moved.heatmap), (direct.trace, moved.trace)):
        assert figure_state(a) == figure_state(b)


def bf16_run(steps=8):
    """A bf16 run as the Recorder saves one: no loss scaler (scale 1 at every step), values in 2^-30..2^-2."""
    run = make_run(steps, log2_scales=(0,) * steps)
    run.meta["scaler"] = None
    return run


def test_dashboard_of_a_bf16_run_shows_its_values_not_the_whole_bf16_range():
    run = bf16_run()
    d = RunDashboard(run, "bf16")
    lo, hi = d.histogram.layout.xaxis2.range
    values = np.flatnonzero(run.counts[..., H.BELOW:H.ABOVE].sum(axis=(0, 1, 2))) + H.BELOW - 128   # binades held
    assert lo <= values.min() and hi >= values.max() + 1
    assert hi - lo < values.max() - values.min() + 10          # not 2^-136..2^130: the values fill the panel
    assert tuple(d.heatmap.layout.yaxis.range) == (lo, hi)      # the heatmap shows the same binades
    assert "smallest subnormal 2<sup>-133</sup>" in d.readout.value and "largest value 3.39e+38" in d.readout.value
    d.step_slider.value = 5                                     # the step still moves the histogram
    np.testing.assert_array_equal(d.counts, run.counts[0, 5].sum(axis=0))
    # bf16's limits (2^-133, 2^-126, 2^128) lie off this axis: the legend names none of their lines
    assert [t.meta for t in d.heatmap.data[1:] if t.showlegend is not False] == []
    fp16 = RunDashboard(make_run(), "fp16")                     # fp16's lines cross its axis: all named
    assert [t.meta for t in fp16.heatmap.data[1:] if t.showlegend is not False] == ["flush", "normal", "overflow"]


def test_dashboard_keeps_fp16_limits_near_the_values_on_its_axes():
    d = RunDashboard(make_run(), "fp16")
    lo, hi = d.histogram.layout.xaxis2.range
    for s in (15, 16):                                          # the run's scales: both limits, at both
        edges = region_edges("fp16", s)
        assert lo < edges["subnormal"][0] and edges["overflow"][0] < hi
    assert "off the axes" not in d.readout.value


def test_dashboard_of_a_run_without_a_loss_scaler_has_no_scale_panel_and_one_domain():
    d = RunDashboard(bf16_run(), "bf16")
    assert d.trace is None and len(d.children) == 5             # selectors, slider, heatmap, histogram, readout
    assert d.domain_buttons.disabled                           # scaled and unscaled values are the same
    assert "no loss scaler" in d.readout.value
    with_scaler = RunDashboard(make_run())
    assert with_scaler.trace in with_scaler.children and not with_scaler.domain_buttons.disabled


def test_dashboard_toggle_buttons_fit_their_labels_beside_their_description():
    # checked in JupyterLab 4.6 + Chromium: a fixed 96px cut "weight_local" to "weight_lo…", and ipywidgets 8
    # renders ToggleButtons as a block, which put "kind" and "values" on a line above their buttons
    d = RunDashboard(make_run())
    for buttons in (d.kind_buttons, d.domain_buttons):
        assert buttons.style.button_width in ("auto", "")      # sized by the browser to each label
        assert buttons.layout.display == "flex" and buttons.style.description_width == "initial"


def test_dashboard_rejects_bad_arguments():
    run = make_run()
    with pytest.raises(ValueError, match="kind: expected one of"):
        RunDashboard(run, kind="bias")
    with pytest.raises(ValueError, match="tensor: 'fc.weight' is not a activation tensor"):
        RunDashboard(run, tensor="fc.weight", kind="activation")
    with pytest.raises(KeyError, match="step: 50 has no histogram"):
        RunDashboard(run, step=50)
    with pytest.raises(ValueError, match="domain: expected one of"):
        RunDashboard(run, domain="raw")
    with pytest.raises(TypeError, match="run: expected an ampviz.Run"):
        RunDashboard(np.zeros(3))


@pytest.fixture
def sent_messages(monkeypatch):
    """Every comm message the widgets send, each packed by jupyter_client's own packer: it refuses NaN
    ("Out of range float values are not JSON compliant"), warns and falls back (deprecated since 7)."""
    import comm
    from jupyter_client.session import json_packer
    sent = []

    class Recording(comm.base_comm.BaseComm):
        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                json_packer(data)
            sent.append(msg_type)
    monkeypatch.setattr(comm, "create_comm", lambda **kw: Recording(**kw))
    return sent


def test_every_widget_message_is_strict_json(sent_messages):
    run = Run.merge([make_run(rank=0), make_run(rank=1, seed=1, log2_scales=(12,) * 8)])
    d = RunDashboard(run)                      # the heatmap has empty cells: sent as None, not NaN
    assert any(v is None for row in d.heatmap.data[0].z for v in row)
    for control, value in ((d.kind_buttons, "activation"), (d.rank_dropdown, 1), (d.domain_buttons, "scaled"),
                           (d.step_slider, 5), (d.kind_buttons, "all"), (d.tensor_dropdown, "fc.weight")):
        control.value = value
    w = ScaleExplorer(run)
    w.slider.value, w.format_dropdown.value = 3, "bf16"
    p = ScalerPlayground(run)
    p.policy_dropdown.value, p.init_slider.value = "deepspeed", 30
    assert sent_messages.count("comm_open") >= 3 and "comm_msg" in sent_messages
