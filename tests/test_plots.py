"""Figure builders: their data against the inputs, region edges against real casts, clear errors."""

import math

import numpy as np
import pytest
import torch

from ampviz import formats as F
from ampviz import histogram as H
from ampviz.plots import heatmap_figure, histogram_figure, region_edges, scale_trace_figure
from ampviz.plots.histogram import binade_positions
from ampviz.plots.style import log2_ticks, percent


def sample_counts(seed=0, n=20000, lo=-40, hi=2):
    rng = np.random.default_rng(seed)
    vals = np.exp2(rng.uniform(lo, hi, n)) * rng.choice([-1.0, 1.0], n)
    vals[:500] = 0.0
    vals[500:503] = [np.inf, -np.inf, np.nan]
    return H.histogram(torch.from_numpy(vals).float()).numpy()


def named(items, name):
    [item] = [x for x in items if x.name == name]
    return item


# ---------------------------------------------------------------------------- histogram figure
def test_bar_heights_are_the_counts():
    c = sample_counts()
    fig = histogram_figure(c, "fp16", 0)
    assert list(named(fig.data, "zero").y) == [500]
    np.testing.assert_array_equal(named(fig.data, "binades").y, c[H.BELOW:H.ABOVE])
    assert list(named(fig.data, "nonfinite").y) == [2, 1]
    # bars sit at the centre of their binade: (2**k, 2**(k+1)] at k + 0.5
    x = np.asarray(named(fig.data, "binades").x)
    assert x[H.column(-24) - H.BELOW] == -23.5
    # leading axes (steps, tensors) are summed
    stacked = np.stack([c, 2 * c])
    np.testing.assert_array_equal(named(histogram_figure(stacked).data, "binades").y, 3 * c[H.BELOW:H.ABOVE])


@pytest.mark.parametrize("fmt", list(F.FORMATS.values()), ids=list(F.FORMATS))
@pytest.mark.parametrize("s", [0, 7, -3])
def test_region_edges_are_the_format_limits_shifted_by_the_scale(fmt, s):
    e = region_edges(fmt, s)
    assert e["flushed"][1] == math.log2(fmt.min_subnormal / 2) - s
    assert e["subnormal"] == (math.log2(fmt.min_subnormal / 2) - s, math.log2(fmt.min_normal) - s)
    assert e["overflow"][0] == math.log2(fmt.overflow_threshold) - s
    # the edges are where a real rounding changes class, for a value times 2**s
    a, b, c = e["subnormal"][0], e["normal"][0], e["overflow"][0]
    scale = 2.0 ** s
    assert fmt.round(2.0 ** a * scale) == 0.0 and fmt.round(2.0 ** (a + 0.01) * scale) != 0.0
    below = 2.0 ** b * scale * (1 - fmt.eps)      # min_normal - min_subnormal: the largest subnormal
    assert fmt.classify(below) == "subnormal" and fmt.classify(2.0 ** b * scale) == "normal"
    edge = 2.0 ** c * scale                     # overflow starts here (within float error)
    just_below, just_above = edge * (1 - fmt.eps / 8), edge * (1 + fmt.eps / 8)
    if fmt.saturates:       # e4m3fn: above the edge a cast clamps to max, further than half an ulp away
        half_ulp = fmt.ulp(fmt.max) / 2
        assert just_below - fmt.max < half_ulp < just_above - fmt.max and fmt.round(just_above) == fmt.max
    else:
        assert fmt.round(just_below) == fmt.max and math.isinf(fmt.round(just_above))


@pytest.mark.parametrize("fmt,s", [("fp16", 0), ("fp16", 12), ("bf16", 0), ("fp8_e4m3fn", 9), ("fp8_e5m2", 3)])
def test_shading_and_fractions_match_edges_and_fate(fmt, s):
    c = sample_counts(1)
    fig = histogram_figure(c, fmt, s)
    lo, hi = fig.layout.xaxis2.range
    for r, (a, b) in region_edges(fmt, s).items():
        shape = named(fig.layout.shapes, f"region:{r}")
        assert (shape.x0, shape.x1) == (min(max(a, lo), hi), min(max(b, lo), hi))
    fate = H.fate(c, fmt, log2_scale=s)
    for r in ("flushed", "subnormal", "normal", "overflow"):
        assert named(fig.layout.annotations, f"fraction:{r}").text.endswith(f"<b>{percent(fate.fraction(r))}</b>")
    assert f"2<sup>{s}</sup>" in fig.layout.title.text and F.get_format(fmt).name in fig.layout.title.text
    assert "unscaled" in fig.layout.xaxis2.title.text


def test_flushed_share_on_the_figure_equals_a_real_fp16_cast():
    rng = np.random.default_rng(3)
    x = torch.from_numpy(np.exp2(rng.uniform(-36, -8, 30000))).float()
    for s in (0, 6, 12):
        real = float(((x * 2.0 ** s).half() == 0).double().mean())
        fig = histogram_figure(H.histogram(x), "fp16", s)
        assert named(fig.layout.annotations, "fraction:flushed").text.endswith(f"<b>{percent(real)}</b>")


def test_default_range_shows_every_nonempty_bin_and_the_edges():
    c = sample_counts(lo=-60, hi=-50)
    fig = histogram_figure(c, "fp16", 0)
    lo, hi = fig.layout.xaxis2.range
    x = binade_positions()[c[H.BELOW:H.ABOVE] > 0]
    assert lo <= x.min() - 0.5 and hi >= x.max() + 0.5
    assert lo <= region_edges("fp16", 0)["subnormal"][0] and hi >= region_edges("fp16", 0)["overflow"][0]


def test_log2_ticks_show_real_values():
    vals, text = log2_ticks(-26, -22)
    assert vals == [-26, -25, -24, -23, -22]
    assert text[2] == "2<sup>-24</sup><br>6e-8"         # 2**-24 ≈ 5.96e-8
    vals, _ = log2_ticks(-100, 20)
    assert len(vals) <= 11 and all(v % 16 == 0 for v in vals)


def test_percent_never_rounds_a_nonzero_share_away():
    assert percent(0) == "0%" and percent(1) == "100%"
    assert percent(1e-5) == "<0.1%" and percent(1 - 1e-5) == ">99.9%" and percent(0.1234) == "12.3%"


@pytest.mark.parametrize("kwargs,match", [
    (dict(counts=np.zeros(10, dtype=np.int64)), "257 bins"),
    (dict(log2_scale=2.5), "log2_scale: expected an integer"),
    (dict(domain="loss"), "domain: expected one of"),
    (dict(format="fp12"), "unknown format 'fp12'"),
    (dict(x_range=(3, 1)), "x_range: expected lo < hi"),
])
def test_histogram_figure_rejects_bad_input(kwargs, match):
    args = dict(counts=sample_counts(), format="fp16", log2_scale=0) | kwargs
    with pytest.raises(ValueError, match=match):
        histogram_figure(args.pop("counts"), **args)


# ---------------------------------------------------------------------------- loss-scale trace
def test_scale_trace_marks_skips_and_growths_at_their_steps():
    from ampviz.plots.scale_trace import TRACES
    from ampviz.replay import TorchPolicy, replay
    steps = np.arange(10)
    scale = np.exp2([16, 15, 15, 16, 16, 15, 15, 15, 16, 16])
    skipped = np.array([1, 0, 0, 0, 1, 0, 0, 0, 0, 0], bool)
    grown = np.array([0, 0, 1, 0, 0, 0, 0, 1, 0, 0], bool)
    trace = np.array([2.0, 1e-3, 1e-3, 1e-3, 1.0, 1e-3, 1e-3, 1e-3, 1e-3, np.inf])
    r = replay(TorchPolicy(init_scale=2.0 ** 14, growth_interval=3), trace)
    fig = scale_trace_figure(steps, scale, skipped, grown, replay=r, trace=trace)
    rec = fig.data[TRACES["recorded"]]
    np.testing.assert_array_equal(rec.y, np.log2(scale))
    assert rec.line.shape == "hv"                                  # the scale holds until the next step
    sk = fig.data[TRACES["recorded skipped"]]
    assert list(sk.x) == [0, 4] and list(sk.y) == [16, 16] and sk.name == "recorded: 2 skipped"
    assert list(fig.data[TRACES["recorded grown"]].x) == [2, 7] and fig.data[TRACES["recorded grown"]].name == \
        "recorded: 2 growths"
    one = scale_trace_figure(steps, scale, skipped, grown & (steps < 5))
    assert one.data[TRACES["recorded grown"]].name == "recorded: 1 growth"      # not "1 growths"
    rep = fig.data[TRACES["replay"]]
    np.testing.assert_array_equal(rep.y, np.log2(r.scale))
    assert list(fig.data[TRACES["replay skipped"]].x) == list(np.nonzero(r.skipped)[0])
    assert fig.data[TRACES["replay skipped"]].name == f"replay: {r.n_skipped} skipped"
    ceiling = np.asarray(fig.data[TRACES["ceiling"]].y, dtype=float)
    np.testing.assert_allclose(ceiling[:9], np.log2(65520.0 / trace[:9]))
    assert np.isnan(ceiling[9])                                   # inf gradient: no scale avoids it
    assert fig.layout.yaxis.title.text == "loss scale (log2)" and fig.layout.xaxis.title.text == "optimizer step"
    lo, hi = fig.layout.yaxis.range
    assert lo <= np.log2(r.scale).min() and hi >= ceiling[:9].max()


def test_scale_trace_shows_where_a_deepspeed_replay_stops():
    from ampviz.plots.scale_trace import TRACES
    from ampviz.replay import DeepSpeedPolicy, replay
    r = replay(DeepSpeedPolicy(init_scale=4.0, min_scale=1.0, hysteresis=1), [np.inf] * 8)
    assert r.crashed_at == 2
    fig = scale_trace_figure(np.arange(8), np.full(8, 4.0), replay=r)
    assert len(fig.data[TRACES["replay"]].x) == 3 and "stops at step 2" in fig.data[TRACES["replay"]].name
    stop = fig.layout.shapes[0]
    assert stop.visible and stop.x0 == 2


def test_scale_trace_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match=r"skipped: expected length 3 \(one value per step\), got shape \(2,\)"):
        scale_trace_figure([0, 1, 2], [1.0, 2.0, 4.0], skipped=[True, False])


# ---------------------------------------------------------------------------- heatmap, layers, ranks
def step_counts(steps=12, seed=0):
    rng = np.random.default_rng(seed)
    rows = [H.histogram(torch.from_numpy(np.exp2(rng.uniform(-30 + s, -10 + s, 500))).float()).numpy()
            for s in range(steps)]
    return np.stack(rows)


def test_heatmap_cells_are_log10_counts_and_lines_follow_the_scale():
    from ampviz.plots.heatmap import LIMIT_LINES
    c = step_counts()
    log2s = np.array([16] * 6 + [15] * 6)
    fig = heatmap_figure(c, np.arange(100, 112), "fp16", log2s)
    heat = fig.data[0]
    y = np.asarray(heat.y)
    z = np.asarray(heat.z, dtype=float)
    assert z.shape == (y.size, 12) and list(heat.x) == list(range(100, 112))
    cols = (y - 0.5).astype(int) + 128                       # row at k + 0.5 is column k + 128
    with np.errstate(divide="ignore"):
        expected = np.where(c[:, cols].T > 0, np.log10(c[:, cols].T), np.nan)
    np.testing.assert_allclose(z, expected, atol=5e-4)          # sent to 3 decimals; empty cells as None (nan)
    assert c[:, cols].sum() == c[:, H.BELOW:H.ABOVE].sum()   # every non-empty binade is drawn
    for trace, (_, region, *_) in zip(fig.data[1:4], LIMIT_LINES):
        np.testing.assert_array_equal(trace.y, region_edges("fp16", 0)[region][0] - log2s)
    lo, hi = fig.layout.yaxis.range
    assert lo <= region_edges("fp16", 16)["subnormal"][0] and hi >= region_edges("fp16", 15)["overflow"][0]


def test_long_runs_sum_windows_of_steps_into_columns():
    from ampviz.plots.heatmap import MAX_COLUMNS
    n = MAX_COLUMNS * 2 + 3
    c = np.zeros((n, H.NBINS), dtype=np.int64)
    c[:, H.column(-10)] = np.arange(n)
    fig = heatmap_figure(c, np.arange(n), "bf16")
    z = np.asarray(fig.data[0].z, dtype=float)
    assert z.shape[1] == -(-n // 3)                             # windows of 3 steps
    row = list(np.asarray(fig.data[0].y)).index(-9.5)
    assert 10 ** z[row, 1] == pytest.approx(3 + 4 + 5, rel=2e-3) and fig.data[0].x[1] == 4.0
    assert "each column sums 3 steps" in fig.layout.title.text


def test_heatmap_rejects_bad_input():
    with pytest.raises(ValueError, match=r"counts: expected shape \(steps, 257\)"):
        heatmap_figure(np.zeros((3, 2, H.NBINS)), [0, 1, 2])
    with pytest.raises(ValueError, match="steps: expected 3 step numbers"):
        heatmap_figure(np.zeros((3, H.NBINS)), [0, 1])
    with pytest.raises(ValueError, match="log2_scale: expected integers"):
        heatmap_figure(np.zeros((3, H.NBINS)), [0, 1, 2], log2_scale=[1, 1.5, 2])


def test_layer_small_multiples_one_panel_per_tensor():
    from ampviz.plots import layer_histograms_figure
    c = step_counts(5)
    names = [f"layer{i}" for i in range(5)]
    fig = layer_histograms_figure(c, names, "fp16", 10, cols=2)
    fate = H.fate(c, "fp16", log2_scale=10)
    for i, name in enumerate(names):
        np.testing.assert_array_equal(named(fig.data, name).y, c[i, H.BELOW:H.ABOVE])
        title = fig.layout.annotations[i].text
        assert title.startswith(f"<b>{name}</b>") and f"flushed {percent(fate.fraction('flushed')[i])}" in title
        shape = named(fig.layout.shapes, f"region:overflow:{name}")
        assert shape.x0 == region_edges("fp16", 10)["overflow"][0]
    left = [fig.layout[f"yaxis{'' if i == 0 else i + 1}"] for i in (0, 2, 4)]      # the first column: 3 rows
    assert [a.title.text for a in left] == ["values"] * 3 and not fig.layout.yaxis2.title.text
    with pytest.raises(ValueError, match="names: expected 5 names"):
        layer_histograms_figure(c, names[:3])


def test_rank_comparison_has_one_line_per_rank():
    from test_widgets import make_run

    from ampviz.plots import rank_comparison_figure
    from ampviz.run import Run
    run = Run.merge([make_run(rank=0), make_run(rank=1, seed=1)])
    fig = rank_comparison_figure(run, "fp16", kind="activation")
    for i, rank in enumerate(run.ranks):
        np.testing.assert_array_equal(named(fig.data, f"rank {rank} scale").y, np.log2(run.loss_scale[i]))
        counts = run.counts_in("unscaled")[i][:, [1]].sum(axis=1)
        zeros = 100 * counts[:, H.ZERO] / counts.sum(axis=1)
        np.testing.assert_allclose(named(fig.data, f"rank {rank}").y, zeros)
        np.testing.assert_allclose(named(fig.data, f"rank {rank} max").y, np.log2(H.max_magnitude(counts)))
    with pytest.raises(TypeError, match="run: expected an ampviz.Run"):
        rank_comparison_figure(np.zeros(3))


def test_histogram_title_says_when_values_already_carry_the_loss_scale():
    from ampviz.plots import histogram_figure
    counts = np.zeros(257, dtype=np.int64)
    counts[100:110] = 5
    scaled = histogram_figure(counts, "fp16", 0, domain="scaled", title="act").layout.title.text
    unscaled = histogram_figure(counts, "fp16", 12, domain="unscaled", title="act").layout.title.text
    assert "as scaled in the run" in scaled and "at loss scale" not in scaled
    assert "at loss scale 2<sup>12</sup>" in unscaled


def test_tensor_map_one_row_per_tensor_and_one_set_of_regions():
    from ampviz.plots import tensor_map_figure
    c = step_counts(40)                                    # 40 "tensors"
    names = [f"<b>layer{i}</b>" for i in range(40)]
    fig = tensor_map_figure(c, names, "fp16", 8)
    heat = fig.data[0]
    z = np.asarray(heat.z, dtype=float)
    cols = np.rint(np.asarray(heat.x) - 0.5).astype(int) + 128                    # binade column of each x
    with np.errstate(divide="ignore"):
        expected = np.where(c[:, cols] > 0, np.log10(c[:, cols]), np.nan)
    np.testing.assert_allclose(z, expected, rtol=1e-6)
    assert c[:, cols].sum() == c[:, H.BELOW + 1:H.ABOVE].sum()                  # every non-empty binade drawn
    assert list(heat.y)[:2] == ["0: &lt;b&gt;layer0&lt;/b&gt;", "1: &lt;b&gt;layer1&lt;/b&gt;"]
    assert len(fig.layout.shapes) == 4
    lo, hi = fig.layout.xaxis.range
    a, b = region_edges("fp16", 8)["overflow"]
    assert named(fig.layout.shapes, "region:overflow").x0 == min(max(a, lo), hi)


def test_small_multiples_shorten_long_names_and_escape_them():
    from ampviz.plots import layer_histograms_figure
    c = step_counts(3)
    names = ["model.layers.0.self_attn.q_proj.lora_A.default.weight_and_a_long_tail", "<script>x</script>", "fc"]
    fig = layer_histograms_figure(c, names, "fp16", 0, cols=3)
    first, second = fig.layout.annotations[0].text, fig.layout.annotations[1].text
    assert first.split("<br>")[0] == "<b>model.layers.0.self_a…weight_and_a_long_tail</b>"     # 44 characters
    assert second.startswith("<b>&lt;script&gt;x&lt;/script&gt;</b><br>flushed")
    assert names[0] in fig.data[0].hovertemplate and fig.data[0].name == names[0]    # full name on hover
    assert len(fig.layout.shapes) == 4 * 3
