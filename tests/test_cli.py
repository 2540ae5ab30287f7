"""The ``ampviz`` command: info against Run.summary, report contents, a real demo run, error paths."""

import base64
import dataclasses
import html
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import ampviz
from ampviz import histogram as H
from ampviz.cli import main
from ampviz.demo import DEMO_SETTINGS, DEMO_STEPS, train_demo
from ampviz.replay import TorchPolicy, replay
from ampviz.report import (
    format_scale,
    representative_steps,
    summary_rows,
    worst_without_scaling,
    write_report,
)

SHORT_DEMO = 150      # the demo's scale reaches 2**21 by step ~80 and starts backing off


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    """A short ``ampviz demo`` run once for the module (the other tests read its run): its directory."""
    out = tmp_path_factory.mktemp("demo")
    assert main(["demo", "-o", str(out), "--steps", str(SHORT_DEMO), "--device", "cpu", "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def full_demo_dir(tmp_path_factory):
    """``ampviz demo`` as a newcomer runs it: the default length."""
    out = tmp_path_factory.mktemp("full_demo")
    assert main(["demo", "-o", str(out), "--device", "cpu", "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def run_path(demo_dir):
    return demo_dir / "run.npz"


@pytest.fixture(scope="module")
def ranks_dir(run_path, tmp_path_factory):
    """A two-rank run directory: rank 1 is rank 0 with one extra skipped step."""
    run = ampviz.Run.load(run_path)
    skipped = run.skipped.copy()
    skipped[0, 5] = True
    other = dataclasses.replace(run, skipped=skipped, meta=dict(run.meta, ranks=[1], world_size=2))
    merged = ampviz.Run.merge([dataclasses.replace(run, meta=dict(run.meta, world_size=2)), other])
    out = tmp_path_factory.mktemp("ranks")
    merged.save(out)
    return out


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ampviz: error:"), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


# ---------------------------------------------------------------------------- demo
def test_demo_writes_a_run_whose_skipped_steps_match_its_scale_trace_and_gradients(demo_dir, capsys):
    run = ampviz.Run.load(demo_dir / "run.npz")
    assert run.n_steps == SHORT_DEMO and run.hist_steps.size == SHORT_DEMO
    skipped = run.skipped[0]
    assert skipped.sum() >= 1, "the demo promises real overflow: the scale should back off at least once"
    # skipped <=> the scale went down
    np.testing.assert_array_equal(skipped, run.next_scale[0] < run.loss_scale[0])
    # a real GradScaler driven by the same overflow sequence gives the same scale trace
    policy = TorchPolicy(init_scale=DEMO_SETTINGS["init_scale"], growth_interval=DEMO_SETTINGS["growth_interval"])
    np.testing.assert_array_equal(replay(policy, skipped).scale, run.loss_scale[0])
    # skipped <=> the recorded (unscaled) weight gradients of that step hold inf/nan
    weights = run.tensors_of("weight")
    counts = run.counts[0][:, weights]                                            # (H, T, NBINS)
    nonfinite = (counts[..., H.ABOVE] + counts[..., H.NAN]).sum(axis=1) > 0
    np.testing.assert_array_equal(nonfinite, skipped)
    assert (demo_dir / "report.html").stat().st_size > 1_000_000       # plotly.js inlined


def demo_claims(scaled: ampviz.Run, unscaled: ampviz.Run) -> None:
    """What the demo promises: with a GradScaler the model learns; without one it stays at chance,
    because fp16 flushed every first-layer activation gradient at every step."""
    assert scaled.meta["demo"]["test_accuracy"] > 0.8 and scaled.meta["demo"]["scaling"]
    assert unscaled.meta["demo"]["test_accuracy"] < 0.15 and not unscaled.meta["demo"]["scaling"]   # chance: 0.1
    assert (unscaled.loss_scale == 1).all() and not unscaled.skipped.any()
    first = unscaled.tensor_names.index("body.0")
    counts = unscaled.counts[0][:, first]                                 # (steps, bins), as computed in fp16
    assert (counts[:, H.ZERO] == counts.sum(axis=1)).all()                # every value exactly zero, every step
    assert abs(unscaled.loss[0, -50:].mean() - np.log(10)) < 0.02         # a uniform guess over ten digits
    assert scaled.loss[0, -50:].mean() < 0.5
    # the doctor says so (issue 17): an underflow error naming the first layer; the GradScaler run has none
    underflow = [f for f in unscaled.diagnose()["findings"] if f["check"] == "gradient_underflow"]
    assert len(underflow) == 1 and underflow[0]["severity"] == "error" and underflow[0]["tensors"][0] == "body.0"
    assert "body.0's gradient of its output is all zeros" in underflow[0]["summary"]
    errors = [f["check"] for f in scaled.diagnose()["findings"] if f["severity"] == "error"]
    assert "gradient_underflow" not in errors


def test_demo_learns_with_a_gradscaler_and_stays_at_chance_without(full_demo_dir):
    scaled, unscaled = (ampviz.Run.load(full_demo_dir / name) for name in ("run.npz", "no_scaling.npz"))
    assert scaled.n_steps == unscaled.n_steps == DEMO_STEPS
    demo_claims(scaled, unscaled)
    figures = plotly_figures((full_demo_dir / "report.html").read_text())
    assert "run0-scale" in figures and "run1-scale" in figures          # the report shows both runs


def test_doctor_on_the_demo_without_scaling_exits_non_zero_naming_the_first_layer(full_demo_dir, capsys):
    """``ampviz doctor demo/no_scaling.npz`` said "clean: no findings" (exit 0) and ``ampviz info`` "worst flushed to
    zero 0%" for a run whose first layer's gradients fp16 flushed to zero at every step (issue 17, item 1)."""
    unscaled, scaled = full_demo_dir / "no_scaling.npz", full_demo_dir / "run.npz"
    assert main(["doctor", str(unscaled)]) == 1
    out = capsys.readouterr().out
    assert "[error] gradient_underflow: fp16 flushed gradients to zero in the backward: body.0's" in " ".join(
        out.split())
    assert main(["doctor", str(scaled)]) == 0
    assert "gradient_underflow" not in capsys.readouterr().out
    assert main(["info", str(unscaled)]) == 0
    info = capsys.readouterr().out
    assert "flushed inside the fp16 backward, stored as exact zeros: body.0 all zeros at 600 of 600 steps" in info
    assert "flushed to zero 0%" not in info
    page = (full_demo_dir / "report.html").read_text()
    section = page.split('<h2 id="run1">', 1)[1]
    assert "[error] gradient_underflow" in section and "flushed to zero 0%" not in section


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_demo_claims_hold_for_other_seeds(seed):
    demo_claims(*(train_demo(device="cpu", seed=seed, progress=False, scaling=s) for s in (True, False)))


def test_demo_prints_both_accuracies_and_writes_both_runs(tmp_path, capsys):
    assert main(["demo", "-o", str(tmp_path), "--steps", "3", "--device", "cpu", "--quiet"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("trained 3 steps twice on cpu") and "with GradScaler" in first
    assert "without loss scaling" in first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no_scaling.npz", "report.html", "run.npz"]


def test_demo_leaves_the_thread_count_as_it_was():
    threads = torch.get_num_threads()
    train_demo(steps=2, device="cpu", progress=False)
    assert torch.get_num_threads() == threads


def test_demo_function_validates_its_arguments():
    with pytest.raises(ValueError, match="steps: expected an integer >= 1, got 0"):
        train_demo(steps=0)
    with pytest.raises(ValueError, match="device: expected one of 'auto', 'cpu', 'cuda', got 'tpu'"):
        train_demo(steps=1, device="tpu")


def test_demo_is_reproducible_for_a_seed():
    a, b = (train_demo(steps=5, device="cpu", seed=3, progress=False) for _ in range(2))
    np.testing.assert_array_equal(a.counts, b.counts)
    np.testing.assert_array_equal(a.loss, b.loss)
    c = train_demo(steps=5, device="cpu", seed=3, progress=False, scaling=False)
    np.testing.assert_array_equal(c.loss_scale, np.ones_like(c.loss_scale))   # no scaling: the scale is 1


# ---------------------------------------------------------------------------- info
def test_info_prints_the_numbers_of_run_summary(run_path, capsys):
    assert main(["info", str(run_path)]) == 0
    out = capsys.readouterr().out
    s = ampviz.Run.load(run_path).summary("fp16")
    assert out.splitlines()[0] == str(run_path)
    assert re.search(rf"steps\s+{s['steps']} \({s['histogram_steps']} with histograms\), 1 rank", out)
    assert re.search(rf"skipped\s+{s['skipped']} of {s['steps']} steps", out)
    assert f"{format_scale(s['scale_min'])} .. {format_scale(s['scale_max'])}" in out
    assert format_scale(s["scale_min"]) == "2^16" and s["scale_max"] > s["scale_min"]
    assert re.search(rf"tensors\s+{s['tensors']}: 14 weight gradients \(unscaled\), 7 activation", out)
    assert s["worst_overflow_fraction"] > 0
    assert f"worst overflow {100 * s['worst_overflow_fraction']:.3g}% ({s['worst_overflow_tensor']})" in out


def test_info_json_is_run_summary(run_path, capsys):
    assert main(["info", str(run_path), "--json", "--format", "bf16"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(ampviz.Run.load(run_path).summary("bf16")))


def test_info_on_a_directory_of_ranks_shows_per_rank_skips(ranks_dir, run_path, capsys):
    assert main(["info", str(ranks_dir)]) == 0
    out = capsys.readouterr().out
    n = int(ampviz.Run.load(run_path).skipped.sum())
    assert "2 ranks" in out
    assert f"per rank rank 0: {n}, rank 1: {n + 1}" in out


@pytest.fixture(scope="module")
def bf16_path(tmp_path_factory):
    """A bf16 run without a GradScaler, histograms every 3rd step."""
    import torch
    import torch.nn.functional as F

    from ampviz.lessons.models import MLP
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path_factory.mktemp("bf16") / "run.npz"
    with ampviz.Recorder(model, optimizer, every=3, path=path) as rec:
        for _ in range(10):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(torch.randn(32, 8)), torch.randint(0, 3, (32,)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
    return path


def test_info_and_report_of_a_run_without_a_scaler(bf16_path, tmp_path, capsys):
    assert main(["info", str(bf16_path), "--format", "bf16"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"loss scale\s+2\^0 \(constant\); no GradScaler", out)
    assert "10 (4 with histograms)" in out and "without scaling" not in out
    assert main(["report", str(bf16_path), "-o", str(tmp_path / "r.html"), "--format", "bf16"]) == 0
    figures = plotly_figures((tmp_path / "r.html").read_text())
    assert {"run0-scale", "run0-tensors", "run0-heatmap-weight", "run0-heatmap-activation"} <= set(figures)
    assert {k for k in figures if k.startswith("run0-hist-")} == {"run0-hist-0", "run0-hist-9"}


def test_python_dash_m_ampviz_runs_info(run_path):
    done = subprocess.run([sys.executable, "-m", "ampviz", "info", str(run_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == str(run_path) and "loss scale" in done.stdout


# ---------------------------------------------------------------------------- report
def plotly_figures(page: str) -> dict:
    """{div id: (data, layout)} of every ``Plotly.newPlot`` call in a report page."""
    figures, decoder = {}, json.JSONDecoder()
    for m in re.finditer(r'Plotly\.newPlot\(\s*"([^"]+)",\s*', page):
        data, end = decoder.raw_decode(page, m.end())
        layout, _ = decoder.raw_decode(page, re.compile(r",\s*").match(page, end).end())
        figures[m.group(1)] = (data, layout)
    return figures


def array(value) -> np.ndarray:
    """A plotly JSON array: a list, or a typed array ``{"dtype": ..., "bdata": base64}``."""
    if isinstance(value, dict):
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
    return np.asarray(value, dtype=float)


def test_report_is_self_contained_and_holds_the_runs_data(run_path, tmp_path, capsys):
    out = tmp_path / "sub" / "report.html"
    assert main(["report", str(run_path), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    page = out.read_text()
    from plotly.offline import get_plotlyjs
    assert get_plotlyjs()[:2000] in page                                  # plotly.js inline
    assert not re.search(r"<script[^>]+src=", page), "a script is loaded from elsewhere"
    assert not re.search(r"<(link|img|iframe)[^>]+(href|src)=[\"']?https?:", page)
    run = ampviz.Run.load(run_path)
    figures = plotly_figures(page)
    data, _ = figures["run0-scale"]
    recorded = next(t for t in data if t["name"] == "recorded")
    np.testing.assert_array_equal(array(recorded["y"]), np.log2(run.loss_scale[0]))
    skipped = next(t for t in data if t["name"].startswith("recorded: ") and "skipped" in t["name"])
    np.testing.assert_array_equal(array(skipped["x"]), run.steps[run.skipped[0]])
    last = int(run.hist_steps[-1])
    data, layout = figures[f"run0-hist-{last}"]
    bars = next(t for t in data if t["name"] == "binades")
    expected = run.counts_in("unscaled")[0, -1].sum(axis=0)[H.BELOW:H.ABOVE]
    np.testing.assert_array_equal(array(bars["y"]), expected)
    assert f"Step {last} (last step)" in layout["title"]["text"]
    first_skip = int(run.steps[run.skipped[0]][0])
    assert f"run0-hist-{first_skip}" in figures and "Step 0 (first step)" in page
    # the step that would lose most without scaling is shaded at scale 1, and says how much
    unscaled = fp16_flushed_fraction(run.counts_in("unscaled")[0].sum(axis=1))
    worst = int(run.hist_steps[unscaled.argmax()])
    data, layout = figures[f"run0-hist-{worst}"]
    flushed = next(a for a in layout["annotations"] if a.get("name") == "fraction:flushed")
    assert f"{100 * unscaled.max():.1f}%" in flushed["text"] and "loss scale 2<sup>0</sup>" in layout["title"]["text"]
    data, _ = figures["run0-tensors"]
    assert [t["name"] for t in data] == run.tensor_names
    for kind in ("weight", "activation"):
        data, _ = figures[f"run0-heatmap-{kind}"]
        np.testing.assert_array_equal(array(data[0]["x"]), run.hist_steps)
    assert "run0-ranks" not in figures                     # one rank: no per-rank comparison
    for label, text in summary_rows(run):
        assert f"<th>{html.escape(label)}</th><td>{html.escape(text)}</td>" in page


def test_report_of_several_runs_has_a_section_each(run_path, ranks_dir, tmp_path):
    out = tmp_path / "two.html"
    done = subprocess.run([sys.executable, "-m", "ampviz", "report", str(run_path), str(ranks_dir), "-o", str(out),
                           "--title", "two runs"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    figures = plotly_figures(page)
    assert "run0-scale" in figures and "run1-scale" in figures
    data, _ = figures["run1-ranks"]                        # the directory of ranks: one line per rank
    assert {"rank 0 scale", "rank 1 scale"} <= {t["name"] for t in data} and "run0-ranks" not in figures
    assert f'<a href="#run1">{ranks_dir}</a>' in page and "<title>two runs</title>" in page
    assert "2 ranks" in page and "1 rank," in page


def fp16_flushed_fraction(counts) -> np.ndarray:
    """Oracle: share of non-zero, non-nan values of (..., NBINS) counts that an fp16 cast sends to 0,
    i.e. those in columns whose upper edge is <= 2**-25 (half the smallest subnormal, a tie to 0)."""
    flush = (H.upper_edges() <= 2.0 ** -25) & (np.arange(H.NBINS) != H.ZERO)
    return counts[..., flush].sum(-1) / counts[..., H.ZERO + 1:H.NAN].sum(-1)


def test_representative_steps_are_first_worst_skipped_last(run_path):
    run = ampviz.Run.load(run_path)
    picks = dict(representative_steps(run))
    assert picks[0] == "first step" and picks[int(run.hist_steps[-1])] == "last step"
    assert picks[int(run.steps[run.skipped[0]][0])] == "first skipped step"
    # at the scales it used, the demo loses nothing to fp16 underflow beyond what the fp16 backward
    # already zeroed; without scaling it would: the report shows the step that would lose most
    assert fp16_flushed_fraction(run.counts_in("scaled")[0].sum(axis=1)).max() == 0
    unscaled = fp16_flushed_fraction(run.counts_in("unscaled")[0].sum(axis=1))     # (H,)
    worst = int(run.hist_steps[unscaled.argmax()])
    assert picks[worst] == f"worst underflow without scaling: {100 * unscaled.max():.3g}% flushed"
    assert len(picks) == 4


@pytest.mark.parametrize("domain", ["unscaled", "scaled", "recorded"])
def test_lean_domain_views_equal_run_counts_in(ranks_dir, domain):
    run = ampviz.Run.load(ranks_dir)
    full = run.counts_in(domain)                                                   # (R, H, T, NBINS)
    activations = run.tensors_of("activation")
    for r, rank in enumerate(run.ranks):
        np.testing.assert_array_equal(run.pooled_counts(domain, rank=rank), full[r].sum(axis=1))
        np.testing.assert_array_equal(run.pooled_counts(domain, rank=rank, kind="activation"),
                                      full[r][:, activations].sum(axis=1))
        np.testing.assert_array_equal(run.pooled_counts(domain, rank=rank, tensors=activations[:2]),
                                      full[r][:, activations[:2]].sum(axis=1))
        np.testing.assert_array_equal(run.counts_at(3, domain, rank=rank), full[r, 3])
        for t in range(len(run.tensor_names)):
            np.testing.assert_array_equal(run.tensor_counts(t, domain, rank=rank), full[r, :, t])
    flushed = H.fate(run.counts_in("unscaled"), "fp16", 1.0).fraction("flushed")      # (R, H, T)
    worst, name = worst_without_scaling(run)
    assert worst == flushed.max() and name == run.tensor_names[np.unravel_index(flushed.argmax(), flushed.shape)[2]]


def synthetic_run(tensors: int, steps: int = 5) -> ampviz.Run:
    """One rank, ``tensors`` weight gradients; tensor t loses (t % 7) / 10 of its values to fp16 at scale 1."""
    counts = np.zeros((1, steps, tensors, H.NBINS), dtype=np.int64)
    for t in range(tensors):
        counts[0, :, t, H.column(-10)] = 100 - 10 * (t % 7)
        counts[0, :, t, H.column(-40)] = 10 * (t % 7)                # 2**-40: flushed by fp16 at scale 1
    one = np.ones((1, steps))
    return ampviz.Run(np.arange(steps), one, one, one, one < 0, np.arange(steps), counts,
                      [f"layer{t}.weight" for t in range(tensors)], ["weight"] * tensors, ["torch.float32"] * tensors,
                      {"ranks": [0], "world_size": 1, "every": 1})


def test_a_run_with_many_tensors_gets_a_tensor_map_and_panels_of_the_worst(tmp_path):
    from ampviz.report import SMALL_MULTIPLES
    run = synthetic_run(SMALL_MULTIPLES + 26)
    path = write_report([run], tmp_path / "many.html")
    figures = plotly_figures(path.read_text())
    data, _ = figures["run0-tensor-map"]
    assert len(data[0]["y"]) == len(run.tensor_names) and data[0]["y"][3] == "3: layer3.weight (weight)"
    lost = np.array([(t % 7) / 10 for t in range(len(run.tensor_names))])
    worst = sorted(np.argsort(-lost, kind="stable")[:SMALL_MULTIPLES])
    data, _ = figures["run0-tensors"]
    assert [t["name"] for t in data] == [run.tensor_names[i] for i in worst]      # the worst, in recording order
    assert min(lost[worst]) >= max(np.delete(lost, worst))


def test_a_run_without_tensors_or_steps_still_has_an_info_and_a_report(tmp_path, capsys):
    empty = synthetic_run(0)
    nothing = dataclasses.replace(synthetic_run(2, steps=0), meta={"ranks": [0]})
    for name, run in (("empty", empty), ("nothing", nothing)):
        path = run.save(tmp_path / f"{name}.npz")[0]
        assert main(["info", str(path)]) == 0
        assert main(["report", str(path), "-o", str(tmp_path / f"{name}.html")]) == 0
    out = capsys.readouterr().out
    assert "tensors     0:" in out or re.search(r"tensors\s+0", out)
    assert "No tensors were recorded" in (tmp_path / "empty.html").read_text()


def test_reports_are_written_readable_by_others_like_run_files(run_path, tmp_path):
    import os
    import stat
    mask = os.umask(0o022)
    try:
        out = tmp_path / "shared.html"
        assert main(["report", str(run_path), "-o", str(out)]) == 0
    finally:
        os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644                 # not mkstemp's private 0600


# ---------------------------------------------------------------------------- errors
def _bad_files(tmp_path):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"PK\x03\x04 this is not a zip archive")
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, weights=np.zeros(3))
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    return {"missing": (tmp_path / "nope.npz", "no such file"), "garbage": (garbage, "not a readable"),
            "foreign": (foreign, "not an ampviz run"), "empty": (empty, "holds no .npz")}


@pytest.mark.parametrize("case", ["missing", "garbage", "foreign", "empty"])
@pytest.mark.parametrize("command", ["info", "report"])
def test_bad_run_paths_give_one_line_errors(case, command, tmp_path, capsys):
    path, message = _bad_files(tmp_path)[case]
    extra = ["-o", str(tmp_path / "r.html")] if command == "report" else []
    assert main([command, str(path), *extra]) == 1
    line = one_error_line(capsys)
    assert str(path) in line and message in line
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("argv, message", [
    ([], "required: {info,"),
    (["info"], "required: RUN"),
    (["info", "x.npz", "--format", "fp99"], "invalid choice: 'fp99'"),
    (["report", "x.npz"], "required: -o/--output"),
    (["demo", "-o", "d", "--steps", "0"], "--steps: expected an integer >= 1, got '0'"),
    (["demo", "-o", "d", "--steps", "ten"], "--steps: expected an integer >= 1, got 'ten'"),
    (["demo", "-o", "d", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_arguments_give_one_line_usage_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in one_error_line(capsys)


def test_output_paths_that_cannot_be_written(run_path, tmp_path, capsys):
    assert main(["report", str(run_path), "-o", str(tmp_path)]) == 1
    assert "is a directory" in one_error_line(capsys)
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert main(["demo", "-o", str(a_file), "--steps", "1"]) == 1
    assert "exists and is not a directory" in one_error_line(capsys)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error without a GPU")
def test_demo_on_cuda_without_a_gpu_is_a_clear_error(tmp_path, capsys):
    assert main(["demo", "-o", str(tmp_path / "d"), "--device", "cuda", "--steps", "1"]) == 1
    assert "no CUDA device" in one_error_line(capsys)
    assert not (tmp_path / "d").exists()


def test_errors_through_python_dash_m_have_no_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ampviz", "info", str(tmp_path / "missing.npz")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"ampviz: error: {tmp_path / 'missing.npz'}: no such file or directory"]


def test_info_says_which_optional_captures_a_run_holds(tmp_path, capsys):
    """updates= and blocks= each add a row to `ampviz info` (steps measured, optimizer state, modules, layouts);
    a run without them has neither row."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = tmp_path / "run.npz"
    with ampviz.Recorder(model, opt, updates=2, blocks={"every": 3, "layouts": ["mx32", "row"]}, path=path) as rec:
        for _ in range(7):
            torch.nn.functional.cross_entropy(model(torch.randn(8, 32)), torch.randint(0, 4, (8,))).backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    run = ampviz.Run.load(path)
    u, b = run.update_steps.tolist(), run.blocks.steps.tolist()
    assert b == [0, 3, 6] and len(u) >= 2
    assert re.search(rf"weight updates\s+measured at {len(u)} steps \({u[0]} to {u[-1]}\); optimizer state: "
                     rf"exp_avg, exp_avg_sq", out), out
    assert re.search(r"block statistics\s+3 steps \(0 to 6\), 2 Linear modules, layouts mx32, row", out), out
    plain = tmp_path / "plain.npz"
    with ampviz.Recorder(model, opt, path=plain) as rec:
        torch.nn.functional.cross_entropy(model(torch.randn(8, 32)), torch.randint(0, 4, (8,))).backward()
        opt.step()
        opt.zero_grad()
        rec.step()
    assert main(["info", str(plain)]) == 0
    out = capsys.readouterr().out
    assert "weight updates" not in out and "block statistics" not in out
