"""ampviz.doctor against planted faults in real training loops (real GradScaler, real schedulers, real
autocast): each fault is found, named and counted as the loop itself observed it; a healthy run is clean."""

import dataclasses
import json
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz
from ampviz import histogram as H
from ampviz.cli import main
from ampviz.doctor import CAUSES, CHECKS, SEVERITIES, as_text, diagnose, headline

FP16 = torch.float16


class _Poison(torch.autograd.Function):
    """Identity forward; backward writes ``value`` into the first element of the incoming gradient."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.value is None:
            return grad, None
        grad = grad.clone()
        grad.view(-1)[0] = ctx.value
        return grad, None


class Poison(nn.Module):
    """Placed right after a layer: an inf/nan planted into the gradient of that layer's output."""

    def __init__(self):
        super().__init__()
        self.value = None

    def forward(self, x):
        return _Poison.apply(x, self.value)


class SqrtWhere(nn.Module):
    """sqrt where positive, else 0: finite forward, but the masked lanes' gradient is 0 * inf = nan."""

    def forward(self, x):
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))


def mlp(depth=4, width=32, poison_after=None, act=nn.ReLU, seed=0):
    """fc0, act0, fc1, ... head: a Poison module after fc{poison_after} if given."""
    torch.manual_seed(seed)
    layers, d = OrderedDict(), 16
    for i in range(depth):
        layers[f"fc{i}"] = nn.Linear(d, width)
        if i == poison_after:
            layers["poison"] = Poison()
        layers[f"act{i}"] = act()
        d = width
    layers["head"] = nn.Linear(d, 4)
    return nn.Sequential(layers)


def train(model, steps=24, dtype=FP16, scaler_kw=None, poison_at=(), poison_value=float("inf"),
          loss_mul=lambda step: 1.0, scheduler=None, scheduler_on_skips=True, **recorder_kw):
    """A plain AMP loop, recorded; returns (run, what the loop observed: skipped steps, scheduler epochs)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", **scaler_kw) if scaler_kw is not None else None
    sched = scheduler(opt) if scheduler else None
    gen = torch.Generator().manual_seed(1)
    seen = {"skipped": [], "last_epoch": [], "loss": []}
    with ampviz.Recorder(model, opt, scaler=scaler, scheduler=sched, **recorder_kw) as rec:
        for step in range(steps):
            x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
            for m in model.modules():
                if isinstance(m, Poison):
                    m.value = poison_value if step in poison_at else None
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y) * loss_mul(step)
            if scaler is not None:
                before = scaler.get_scale()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                skipped = scaler.get_scale() < before
            else:
                loss.backward()
                opt.step()
                skipped = False
            if sched is not None and (scheduler_on_skips or not skipped):
                sched.step()
            opt.zero_grad(set_to_none=True)
            rec.step(loss)
            seen["skipped"].append(skipped)
            seen["loss"].append(float(loss.detach()))
            seen["last_epoch"].append(sched.last_epoch if sched else -1)
    return rec.run, seen


def by_check(diagnosis, check):
    return [f for f in diagnosis["findings"] if f["check"] == check]


def only(diagnosis, check):
    found = by_check(diagnosis, check)
    assert len(found) == 1, as_text(diagnosis)
    return found[0]


def leading_run(flags) -> int:
    n = 0
    while n < len(flags) and flags[n]:
        n += 1
    return n


def assert_plain(value):
    if isinstance(value, dict):
        assert all(isinstance(k, str) for k in value)
        for v in value.values():
            assert_plain(v)
    elif isinstance(value, list):
        for v in value:
            assert_plain(v)
    else:
        assert value is None or type(value) in (str, int, float, bool), type(value)


# ---------------------------------------------------------------------------------------- clean runs
def test_a_clean_fp16_run_gives_no_finding_and_says_it_is_clean(capsys, tmp_path):
    run, seen = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 10))
    assert not any(seen["skipped"])
    d = run.diagnose()
    assert d["clean"] and d["findings"] == [], as_text(d)
    assert_plain(d)
    json.dumps(d, allow_nan=False)
    run.save(tmp_path / "clean.npz")
    assert main(["doctor", str(tmp_path / "clean.npz")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{tmp_path / 'clean.npz'}: clean: no findings"


def test_growth_probes_of_a_healthy_gradscaler_are_not_findings():
    """GradScaler grows every growth_interval steps and overflows at the new scale: a saw-tooth."""
    run, seen = train(mlp(), steps=60, scaler_kw=dict(init_scale=2.0 ** 10, growth_interval=3))
    assert sum(seen["skipped"]) >= 3                                  # it did reach the edge and skip
    d = diagnose(run)
    assert d["clean"], as_text(d)
    skips = [e for e in d["nonfinite_steps"] if e["skipped"]]
    assert len(skips) == sum(seen["skipped"]) and {e["cause"] for e in skips} == {"loss scale"}
    assert "ordinary loss-scale overflows" in as_text(d)


# ---------------------------------------------------------------------------------------- item 1
@pytest.mark.parametrize("k", [0, 2])
def test_an_inf_injected_at_a_layers_gradient_is_traced_to_that_layer(k):
    run, seen = train(mlp(poison_after=k), scaler_kw=dict(init_scale=2.0 ** 10), poison_at={7})
    assert np.flatnonzero(seen["skipped"]).tolist() == [7]           # the real GradScaler skipped it
    d = run.diagnose()
    f = only(d, "nonfinite_gradient")
    assert f["severity"] == "error" and f["steps"] == [7]
    assert f["evidence"]["origin"] == f"fc{k}" and f["tensors"][0] == f"fc{k}"
    # it spread only towards the input: nothing downstream of fc{k} (closer to the loss) is named
    downstream = {f"fc{i}" for i in range(k + 1, 4)} | {"head", "head.weight", "head.bias"}
    assert not downstream & set(f["tensors"])
    assert f"fc{k}.weight" in f["tensors"]
    step = f["evidence"]["per_step"][0]
    assert step["inf"][f"fc{k}"] == 1 and step["skipped"]
    assert "fc" in f["recommendation"] and "detect_anomaly" in f["recommendation"]
    assert [e["cause"] for e in d["nonfinite_steps"]] == ["not the loss scale"]
    assert d["nonfinite_steps"][0]["order_recorded"] and not any("guessed" in line for line in f["details"])


def test_an_inf_applied_without_a_scaler_is_an_error_that_says_the_optimizer_took_it():
    run, seen = train(mlp(poison_after=1), dtype=torch.bfloat16, poison_at={3}, steps=6)
    f = only(run.diagnose(), "nonfinite_gradient")
    assert f["evidence"]["origin"] == "fc1" and f["evidence"]["applied_steps"] == [3]
    assert any("applied" in line for line in f["details"])


# ---------------------------------------------------------------------------------------- item 3
def test_too_high_init_scale_is_reported_with_the_number_of_skipped_steps():
    run, seen = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 40), steps=30)
    burst = leading_run(seen["skipped"])
    assert burst > 5
    d = run.diagnose()
    f = only(d, "init_scale_too_high")
    # the back-off: the leading skips and those fewer than SETTLE_GAP clean steps after them, the scale never grown
    span = f["evidence"]["backing_off_steps"]
    assert span >= burst and not any(seen["skipped"][span:span + 4]) and seen["skipped"][span - 1]
    assert f["severity"] == "info" and f["evidence"]["skipped_at_start"] == sum(seen["skipped"][:span])
    assert f["steps"] == np.flatnonzero(seen["skipped"][:span]).tolist() and f["steps"][:burst] == list(range(burst))
    assert f["evidence"]["settled_scale"] == run.next_scale[0, span - 1]
    assert "harmless" in f["summary"].lower()
    assert f"init_scale=2.0**{int(np.log2(f['evidence']['settled_scale']))})" in f["recommendation"]
    replayed = next(iter(f["evidence"]["replays"].values()))
    assert replayed["skipped"] < burst                                 # starting where it settled skips fewer
    assert not by_check(d, "scale_collapse") and not by_check(d, "nonfinite_gradient")


def test_partitioned_gradients_decide_a_skipped_step_from_every_ranks_part():
    """Two ranks of one run, rank 0's part of the gradients finite on the skipped steps (its inf and nan moved to
    the zero bin): as DeepSpeed ZeRO partitions (meta["deepspeed"]["weights"] == "partition") rank 0 takes rank 1's
    cause; as DDP ranks (the full gradients each) rank 0 cannot tell why: "unknown", as before."""
    run, seen = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 24), steps=12)
    skipped = np.flatnonzero(seen["skipped"])
    counts = run.counts.copy()
    rows = np.searchsorted(run.hist_steps, run.steps[skipped])
    for b in (H.ABOVE, H.NAN):
        counts[0, rows, :, H.ZERO] += counts[0, rows, :, b]
        counts[0, rows, :, b] = 0
    rank0 = dataclasses.replace(run, counts=counts, meta=dict(run.meta, world_size=2))
    rank1 = dataclasses.replace(run, meta=dict(run.meta, ranks=[1], world_size=2))

    def causes(merged):
        return {(e["step"], e["rank"]): e for e in merged.diagnose()["nonfinite_steps"]}
    ddp = causes(ampviz.Run.merge([rank0, rank1]))
    assert {ddp[s, 0]["cause"] for s in skipped} == {"unknown"}
    assert {ddp[s, 1]["cause"] for s in skipped} == {"loss scale"}
    part = {"dtype": "fp16", "weights": "partition"}
    zero = ampviz.Run.merge([dataclasses.replace(r, meta=dict(r.meta, deepspeed=part)) for r in (rank0, rank1)])
    report = zero.diagnose()
    both = causes(zero)
    for s in skipped:
        e = both[s, 0]
        assert (e["cause"], e["own_cause"], e["cause_rank"], e["origin"]) == (
            "loss scale", "unknown", 1, both[s, 1]["origin"])
        assert both[s, 1]["cause"] == "loss scale" and "cause_rank" not in both[s, 1]
    assert all(c["check"] != "causes of all skipped steps" for c in report["checks"])
    init = only(report, "init_scale_too_high")
    assert any("the partition on rank 1 held the non-finite values" in d for d in init["details"])


def test_a_collapsing_scale_is_reported_with_its_count_and_its_cause():
    run, seen = train(mlp(poison_after=1), scaler_kw=dict(init_scale=2.0 ** 10), poison_at=set(range(8, 30)),
                      poison_value=float("nan"), steps=30)
    assert np.flatnonzero(seen["skipped"]).tolist() == list(range(8, 30))
    d = run.diagnose()
    f = only(d, "scale_collapse")
    assert f["severity"] == "error" and f["evidence"]["skipped"] == 22 and f["steps"] == list(range(8, 30))
    assert f["evidence"]["lowest_scale"] == 2.0 ** (10 - 22) and "below 1" in f["summary"]
    assert f["evidence"]["causes"] == {"not the loss scale": 22} and f["tensors"] == ["fc1"]
    # no scaler policy avoids non-finite gradients: every replay skips all of them (or stops the run)
    for label, rep in f["evidence"]["replays"].items():
        assert rep["skipped"] == 22 or rep["crashed_at"] is not None, label
    assert only(d, "nonfinite_gradient")["evidence"]["origin"] == "fc1"
    assert not by_check(d, "init_scale_too_high")


def test_a_nan_gradient_from_the_first_step_collapses_the_scale_and_names_the_op_after_the_layer():
    run, seen = train(mlp(act=SqrtWhere, depth=3), scaler_kw={}, steps=20)
    assert all(seen["skipped"])
    d = run.diagnose()
    assert only(d, "scale_collapse")["evidence"]["skipped"] == 20
    f = only(d, "nonfinite_gradient")
    # the nan is made in the backward of act2 (sqrt at <= 0), i.e. in the gradient of fc2's output
    assert f["evidence"]["origin"] == "fc2" and f["evidence"]["next_module"] == "head"
    assert "head" in f["recommendation"]


def test_skips_more_frequent_than_the_growth_interval_allows():
    """The loss doubles every 4 steps: each doubling overflows once more than GradScaler's probes would."""
    run, seen = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 20, growth_interval=1000), steps=40,
                      loss_mul=lambda step: 2.0 ** (step // 4))
    d = run.diagnose()
    burst = only(d, "init_scale_too_high")["evidence"]["backing_off_steps"]   # the skips while init_scale came down
    assert burst >= leading_run(seen["skipped"])
    later = int(np.sum(seen["skipped"][burst:]))
    assert later >= 5
    f = only(d, "frequent_skips")
    assert f["evidence"]["skipped"] == later > 2 * f["evidence"]["allowed"] and f["evidence"]["allowed"] == 1
    assert f["steps"] == (np.flatnonzero(seen["skipped"][burst:]) + burst).tolist()


def test_a_scale_growing_without_bound_is_reported():
    run, seen = train(mlp(), scaler_kw=dict(growth_interval=1), steps=30, loss_mul=lambda step: 1e-12)
    assert not any(seen["skipped"])
    f = only(run.diagnose(), "scale_unbounded")
    assert f["evidence"]["max_scale"] == run.next_scale[0].max() >= 2.0 ** 40
    assert f["evidence"]["largest_unscaled_gradient"] < 2.0 ** -30


def test_ranks_that_disagree_are_an_error_naming_the_step():
    run, _ = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 10), steps=10)
    skipped = run.skipped.copy()
    skipped[0, 4] = True
    rank1 = dataclasses.replace(run, skipped=skipped, meta=dict(run.meta, ranks=[1], world_size=2))
    merged = ampviz.Run.merge([dataclasses.replace(run, meta=dict(run.meta, world_size=2)), rank1])
    f = only(merged.diagnose(), "ranks_disagree")
    assert f["steps"] == [4] and f["ranks"] == [0, 1]
    assert f["evidence"]["skipped_per_rank"] == [0, 1]


# ---------------------------------------------------------------------------------------- item 4
def test_a_scheduler_stepping_on_skipped_steps_is_reported_with_the_count():
    lam = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 10))  # noqa: E731
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):   # torch's own hint
        run, seen = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 30), scheduler=lam, steps=24)
    burst = leading_run(seen["skipped"])
    assert burst >= 5
    assert run.scheduler_steps[0].tolist() == seen["last_epoch"]          # what the Recorder captured
    d = run.diagnose()
    f = only(d, "scheduler_on_skipped")
    assert f["evidence"]["advanced_on_skipped"] == int(np.sum(seen["skipped"])) and f["steps"][:burst] == list(
        range(burst))
    assert f["evidence"]["scheduler_last_epoch"] == 24 and f["evidence"]["optimizer_steps"] == 24 - sum(seen["skipped"])


def test_a_resumed_scheduler_is_judged_from_where_it_stood_when_recording_began():
    def resumed(opt):                                     # a scheduler restored 100 steps into a run
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.99 ** e)
        for _ in range(100):
            sched.step()
        return sched
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        run, seen = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 30), scheduler=resumed, steps=12)
    assert run.meta["scheduler"] == {"last_epoch_at_start": 100} and seen["skipped"][0]
    f = only(run.diagnose(), "scheduler_on_skipped")
    assert f["evidence"]["advanced_on_skipped"] == int(np.sum(seen["skipped"])) and f["steps"][0] == 0
    assert f["evidence"]["scheduler_start"] == 100


def test_a_scheduler_that_waits_for_real_steps_is_clean():
    lam = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=5)  # noqa: E731
    run, seen = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 30), scheduler=lam, steps=24, scheduler_on_skips=False)
    d = run.diagnose()
    assert run.scheduler_steps is not None
    assert sum(seen["skipped"]) > 0 and not by_check(d, "scheduler_on_skipped")


# ---------------------------------------------------------------------------------------- item 2
def test_a_non_finite_loss_is_a_forward_overflow_and_collapses_the_scale():
    model = mlp()
    with torch.no_grad():
        model.fc2.weight.mul_(1e7)                     # fc2's fp16 outputs exceed 65504 from the first step
    run, seen = train(model, scaler_kw={}, steps=12)
    bad = [i for i, v in enumerate(seen["loss"]) if not np.isfinite(v)]
    assert bad == list(range(12))
    d = run.diagnose()
    f = only(d, "forward_overflow")
    assert f["steps"] == bad and "no loss scale fixes this" in f["recommendation"].lower()
    collapse = only(d, "scale_collapse")
    assert collapse["evidence"]["causes"] == {"forward": 12} and "forward" in collapse["recommendation"]
    assert not by_check(d, "nonfinite_gradient")


@pytest.mark.parametrize("k", [1, 2])
def test_a_model_whose_kth_layer_overflows_in_the_fp16_forward_is_named(k):
    model = mlp()
    with torch.no_grad():
        getattr(model, f"fc{k}").weight.mul_(1e7)
    run, seen = train(model, scaler_kw={}, steps=8, outputs=True)
    assert all(seen["skipped"])
    d = run.diagnose()
    f = only(d, "forward_overflow")
    assert f["evidence"]["layer"] == f"fc{k}" and f["tensors"][0] == f"fc{k}" and f["steps"] == list(range(8))
    assert f["evidence"]["dtype"] == "float16"
    assert f"fc{k - 1}" not in f["tensors"] and "head" in f["tensors"]         # only the layers after it
    assert "bf16 or fp32" in f["recommendation"]
    collapse = only(d, "scale_collapse")
    assert collapse["evidence"]["causes"] == {"forward": 8} and collapse["tensors"] == [f"fc{k}"]


def test_forward_outputs_near_the_fp16_maximum_are_a_warning():
    model = mlp()
    with torch.no_grad():
        model.fc1.weight.mul_(1e3)
        model.fc1.bias.fill_(40000.0)          # every output of fc1 in (2^15, 65504]: finite, one doubling short
    run, _ = train(model, scaler_kw=dict(init_scale=1.0), steps=3, outputs=True,
                   poison_at=(), loss_mul=lambda step: 1.0)
    f = only(run.diagnose(), "forward_headroom")
    assert f["evidence"]["layer"] == "fc1" and f["severity"] == "warning"


# ---------------------------------------------------------------------------------------- item 5
def test_can_i_switch_precision_from_bf16_matches_real_casts():
    model = mlp()
    run, _ = train(model, dtype=torch.bfloat16, steps=1, loss_mul=lambda step: 2.0 ** -20)
    d = run.diagnose()
    assert d["clean"] and d["run"]["precision"] == "bf16"
    sw = d["switch"]
    assert "counterfactual" in sw["caveat"]
    targets = {t["target"]: t for t in sw["targets"]}
    static = targets["fp16 (static scale)"]
    assert static["skipped_steps"] == 0
    # the static target's flushed share of a weight gradient equals what a real fp16 cast flushes
    torch.manual_seed(0)
    fresh = mlp()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(fresh(x), y) * 2.0 ** -20
    loss.backward()
    for row in sw["tensors"]:
        if row["kind"] != "weight":
            continue
        grad = dict(fresh.named_parameters())[row["tensor"]].grad
        real = H.cast_counts(grad, "fp16", scale=2.0 ** static["log2_scale"])
        nonzero = real["flushed"] + real["subnormal"] + real["normal"] + real["overflow"]
        assert row["shares"]["fp16 (static scale)"]["flushed"] == pytest.approx(real["flushed"] / nonzero)
        assert row["shares"]["fp16 (static scale)"]["overflow"] == real["overflow"] == 0
    # without any scale (a loss scale of 1), these tiny gradients lose values in fp16: the dynamic replay
    # starts at 2**16 and must lose no more than that
    assert all(t["shares"]["fp16 (dynamic scaler)"]["overflow"] == 0 for t in sw["tensors"])
    assert "can I switch precision" in as_text(d)


def test_a_bf16_run_whose_outputs_exceed_fp16_is_told_no_loss_scale_helps():
    model = mlp()
    with torch.no_grad():
        model.fc1.weight.mul_(1e7)
    run, _ = train(model, dtype=torch.bfloat16, steps=2, outputs=True)
    d = run.diagnose()
    assert not by_check(d, "forward_overflow")                  # fine in bf16 ...
    rows = {t["tensor"]: t for t in d["switch"]["tensors"]}
    fp16 = rows["fc1 [output]"]["shares"]["fp16 (static scale)"]
    assert fp16["overflow"] > 0 and "no loss scale fixes it" in fp16["status"]    # ... not in fp16
    assert not rows["fc0 [output]"]["shares"]["fp16 (static scale)"]["overflow"]
    verdicts = {t["target"]: t for t in d["switch"]["targets"]}
    assert not verdicts["fp16 (static scale)"]["ok"] and "fc1 [output]" in verdicts["fp16 (static scale)"]["verdict"]


def test_a_pure_bf16_model_recorded_without_activations_is_a_bf16_run():
    """Weight gradients say the precision when nothing else does: a model cast to bf16 (no autocast, bf16
    weights) recorded with activations=False was once called an fp32 run ("can I switch precision? (from fp32)",
    fp16 underflow "not checked: a fp32 run")."""
    model = mlp().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    with ampviz.Recorder(model, opt, activations=False) as rec:
        for _ in range(2):
            x, y = torch.randn(32, 16, generator=gen).bfloat16(), torch.randint(0, 4, (32,), generator=gen)
            F.cross_entropy(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    run = rec.run
    assert set(run.tensor_kinds) == {"weight"} and set(run.tensor_dtypes) == {"torch.bfloat16"}
    d = run.diagnose()
    assert d["run"]["precision"] == "bf16" and d["switch"]["from"] == "bf16"
    # an AMP run's weight gradients are fp32 (its master weights'): they do not make it an fp32 run
    amp, _ = train(mlp(), steps=2, dtype=torch.bfloat16, activations=False, outputs=True)
    assert amp.diagnose()["run"]["precision"] == "bf16"


def test_fp16_runs_get_no_switch_table():
    run, _ = train(mlp(), scaler_kw={}, steps=3)
    d = run.diagnose()
    assert d["switch"] is None and any(c["check"] == "can I switch precision" and not c["ran"] for c in d["checks"])


# ---------------------------------------------------------------------------------------- where users see it
def test_every_finding_has_evidence_and_a_recommendation_and_the_cli_prints_one_line_each(tmp_path, capsys):
    run, _ = train(mlp(poison_after=1), scaler_kw=dict(init_scale=2.0 ** 40), poison_at={20}, steps=26)
    d = run.diagnose()
    checks = {f["check"] for f in d["findings"]}
    assert {"init_scale_too_high", "nonfinite_gradient"} <= checks
    for f in d["findings"]:
        assert f["check"] in CHECKS and f["severity"] in SEVERITIES
        assert f["steps"] and f["details"] and f["evidence"] and len(f["recommendation"]) > 40
    assert {e["cause"] for e in d["nonfinite_steps"]} <= set(CAUSES)
    assert [f["severity"] for f in d["findings"]] == sorted((f["severity"] for f in d["findings"]),
                                                            key=SEVERITIES.index)
    path = tmp_path / "run.npz"
    run.save(path)
    assert main(["doctor", str(path)]) == 1                   # an error finding: a CI job can fail on it
    lines = capsys.readouterr().out.splitlines()
    heads = [line for line in lines if line.startswith("  [")]
    assert len(heads) == len(d["findings"])
    assert [h.split("]")[1].split(":")[0].strip() for h in heads] == [f["check"] for f in d["findings"]]
    other = tmp_path / "copy.npz"
    other.write_bytes(path.read_bytes())
    assert main(["doctor", str(path), str(other), "--json"]) == 1          # the run has errors: exit 1
    both = json.loads(capsys.readouterr().out)
    assert list(both) == [str(path), str(other)]
    assert both[str(path)]["findings"] == both[str(other)]["findings"] == json.loads(json.dumps(d))["findings"]


def test_doctor_on_a_missing_file_is_one_error_line(capsys, tmp_path):
    assert main(["doctor", str(tmp_path / "nope.npz")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ampviz: error:")


def test_the_report_opens_each_run_with_its_findings(tmp_path):
    pytest.importorskip("plotly")
    from ampviz.report import report_html
    run, _ = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 40), steps=26)
    page = report_html([run], labels=["high init"])
    section = page.split('<h2 id="run0">', 1)[1]
    assert section.index("<h3>Findings</h3>") < section.index('<table class="summary">')
    assert "init_scale_too_high" in section.split('<table class="summary">', 1)[0]


def test_the_doctor_works_without_plotly(tmp_path):
    """As after a plain `pip install ampviz`: plotly and the other extras hidden."""
    run, _ = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 40), steps=26)
    run.save(tmp_path / "run.npz")
    script = r'''
import importlib.abc, sys
BLOCKED = {"plotly", "ipywidgets", "anywidget", "sklearn", "tqdm", "jupyterlab", "pandas", "IPython"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Block())
from ampviz.cli import main
assert main(["doctor", "run.npz"]) == 0
assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
'''
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[info] init_scale_too_high" in out.stdout


def test_runs_with_no_steps_no_tensors_or_sparse_histograms_still_get_a_diagnosis():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampviz.Recorder(model, opt, scaler=torch.amp.GradScaler("cpu")) as rec:
        pass
    assert rec.run.diagnose()["clean"]
    # no tensors recorded: the scale trace alone still gives the init_scale finding, counted right
    run, seen = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 40), steps=25, weights=False, activations=False)
    f = only(run.diagnose(), "init_scale_too_high")
    assert f["evidence"]["skipped_at_start"] == sum(seen["skipped"][:f["evidence"]["backing_off_steps"]]) > 5
    # histograms every 3 steps: skipped steps between them are said to be unexplained, not ignored
    run, seen = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 40), steps=25, every=3)
    note = [c for c in run.diagnose()["checks"] if c["check"] == "causes of all skipped steps"]
    assert note and not note[0]["ran"] and "every=1" in note[0]["why"]
    assert str(sum(s for i, s in enumerate(seen["skipped"]) if i % 3)) in note[0]["why"]


# ---------------------------------------------------------------------------------------- issue 17
def clipped_run(clip, init_scale=2.0 ** 24, steps=12, poison_at=(), **kw):
    """The issue's MLP: init_scale 2**24, 12 steps, with or without ``scaler.unscale_(opt); clip(...)``."""
    model = mlp(poison_after=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    gen = torch.Generator().manual_seed(1)
    with ampviz.Recorder(model, opt, scaler=scaler, **kw) as rec:
        for step in range(steps):
            model.poison.value = float("nan") if step in poison_at else None
            x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
            with torch.autocast("cpu", dtype=FP16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(opt)
                clip(model.parameters())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            rec.step(loss)
    return rec.run


CLIPS = {"clip_grad_norm_": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0),
         "clip_grad_value_": lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.5)}


@pytest.mark.parametrize("clip", list(CLIPS))
def test_a_clipped_loop_overflowing_its_scale_is_an_ordinary_overflow_as_without_clipping(clip):
    """Clipping after unscale_ multiplies every gradient by 0 when the norm is inf: inf became nan, and the doctor
    blamed the model with 3 errors (issue 17, item 2). The same findings as without clipping, with the evidence."""
    plain, clipped = clipped_run(None), clipped_run(CLIPS[clip])
    assert clipped.skipped[0].sum() >= 3
    expected = [(f["check"], f["steps"]) for f in plain.diagnose()["findings"]]
    d = clipped.diagnose()
    assert [(f["check"], f["steps"]) for f in d["findings"]] == expected == [("init_scale_too_high", expected[0][1])]
    assert clipped.meta["unscaled_before_step"] and not plain.meta["unscaled_before_step"]
    assert {e["cause"] for e in d["nonfinite_steps"] if e["skipped"]} <= {"loss scale", "unknown"}
    if clip == "clip_grad_norm_":
        line = " ".join(d["findings"][0]["details"])
        assert "clip_grad_norm_" in line and "their nan are read as the inf they were" in line


def test_a_nan_made_in_the_backward_of_a_clipped_loop_is_still_named_by_its_layer():
    """A nan norm makes every weight gradient nan after the clip: the activation gradients, recorded before it,
    still name the layer; the weights do not each become an origin."""
    d = clipped_run(CLIPS["clip_grad_norm_"], init_scale=2.0 ** 10, poison_at={8}).diagnose()
    f = only(d, "nonfinite_gradient")
    assert f["evidence"]["origin"] == "fc1" and f["steps"] == [8]
    assert any("nan total norm" in line for line in f["details"])


def test_gradient_rows_that_never_filled_are_named_in_the_checks():
    """A watched module the loop never calls, and outputs=True rows that stay empty, are said (issue 17, item 3)."""
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.unused = mlp(), nn.Linear(4, 4)

        def forward(self, x):
            return self.net(x)
    run, _ = train(WithUnused(), scaler_kw=dict(init_scale=2.0 ** 10), steps=3, outputs=["unused"])
    checks = {c["check"]: c for c in run.diagnose()["checks"]}
    assert checks["forward overflow (loss only)"]["ran"]
    assert checks["forward overflow (loss only)"]["why"] == "1 of its 1 rows never filled: unused [output]"
    assert checks["non-finite gradients"]["why"].startswith("3 of its ")
    assert "unused.weight, unused.bias, unused" in checks["non-finite gradients"]["why"]
    text = as_text(run.diagnose(), width=0)
    assert "forward overflow (loss only) (1 of its 1 rows never filled: unused [output])" in text


def test_text_wraps_at_word_boundaries_and_the_headline_counts_right(monkeypatch):
    run, seen = train(mlp(), steps=60, scaler_kw=dict(init_scale=2.0 ** 10, growth_interval=3))
    d = run.diagnose()
    one = dict(d, nonfinite_steps=[e for e in d["nonfinite_steps"] if e["skipped"]][:1])
    assert headline(one) == "clean: no findings; its 1 skipped step was an ordinary loss-scale overflow"
    bad, _ = train(mlp(poison_after=1), scaler_kw=dict(init_scale=2.0 ** 40), poison_at={20}, steps=26)
    d = bad.diagnose()
    words = set(" ".join(as_text(d, width=0).split()).split())
    for width in (40, 72, 100):
        lines = as_text(d, width=width).splitlines()
        assert max(len(line) for line in lines if " " in line.strip()) <= width
        assert set(" ".join(lines).split()) == words                     # no word broken in two
    assert all(len(line) > 100 for line in as_text(d, width=0).splitlines()[1:3])
    monkeypatch.setitem(sys.modules, "ipykernel", sys)             # in a notebook: its width, not the terminal's
    monkeypatch.setenv("COLUMNS", "300")
    assert max(len(line) for line in as_text(d).splitlines()) <= 88


def test_the_scheduler_advice_says_what_accelerate_checks_and_which_way_warm_up_goes():
    lam = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 10))  # noqa: E731
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        run, _ = train(mlp(), scaler_kw=dict(init_scale=2.0 ** 30), scheduler=lam, steps=24)
    advice = only(run.diagnose(), "scheduler_on_skipped")["recommendation"]
    assert "compares" not in advice and "delay warm-up" not in advice                         # the old claims
    assert "accelerate 1.15 sets it when GradScaler did not call the optimizer's step" in advice
    assert "warm-up ends early" in advice and "GradScaler.step already waits once per step" in advice


def test_the_report_of_a_flushed_run_with_many_tensors_shows_and_names_the_flushed_ones():
    """With more than 24 tensors the report draws the worst; a run whose values the fp16 backward flushed loses
    nothing more at its scale, and was said to lose nothing ("none loses a value to fp16")."""
    pytest.importorskip("plotly")
    from ampviz.report import SMALL_MULTIPLES, report_html
    run, _ = train(mlp(depth=12), steps=3, loss_mul=lambda step: 2.0 ** -16)
    assert len(run.tensor_names) > SMALL_MULTIPLES
    d = run.diagnose()
    assert only(d, "gradient_underflow")["severity"] == "error"
    section = report_html([run], labels=["flushed"]).split('<h2 id="run0">', 1)[1]
    assert "none loses a value" not in section and "already flushed to exact zeros" in section
    assert "[error] gradient_underflow" in section and "flushed to zero 0%" not in section


def _deepspeed_run(dtype: str, scales: list, skipped: list, **ds) -> ampviz.Run:
    """A run as ampviz.integrations.deepspeed records one (meta["deepspeed"]; skipped as the engine said), without
    histograms: the DeepSpeed checks read only the scale trace and the meta."""
    n = len(scales)
    scale = np.asarray(scales, dtype=float)[None]
    nxt = np.concatenate([scale[:, 1:], scale[:, -1:]], axis=1)
    meta = {"ranks": [0], "world_size": 1, "every": 1,
            "deepspeed": {"stage": 2, "dtype": dtype, "skipped_steps": int(sum(skipped)), "hysteresis": 2,
                          "min_loss_scale": None, "dynamic_loss_scale": dtype == "fp16", **ds}}
    return ampviz.Run(np.arange(n), np.ones((1, n)), scale, nxt, np.asarray(skipped, bool)[None], np.zeros(0, np.int64),
                      np.zeros((1, 0, 1, H.NBINS), np.int64), ["w"], ["weight"], ["torch.bfloat16"], meta)


def test_deepspeed_bf16_skips_are_found_though_no_scale_moves():
    run = _deepspeed_run("bf16", [1.0] * 5, [False, False, True, False, True])
    found = {f["check"]: f for f in diagnose(run)["findings"]}
    assert found["silent_skips"]["steps"] == [2, 4] and found["silent_skips"]["severity"] == "warning"
    assert "DeepSpeed skipped 2 steps of this bf16 run (steps 2, 4)" in found["silent_skips"]["summary"]
    assert "scale_at_minimum" not in found
    assert {c["check"] for c in diagnose(run)["checks"]} >= {"DeepSpeed's skips and scale"}
    assert not diagnose(_deepspeed_run("bf16", [1.0] * 3, [False] * 3))["findings"]


def test_deepspeed_fp16_scale_pinned_at_min_loss_scale():
    pinned = _deepspeed_run("fp16", [1024.0, 512.0, 256.0, 256.0, 256.0], [True, True, False, True, False],
                            min_loss_scale=256.0)
    found = {f["check"]: f for f in diagnose(pinned)["findings"]}
    assert found["scale_at_minimum"]["steps"] == [3] and found["scale_at_minimum"]["severity"] == "error"
    assert found["scale_at_minimum"]["evidence"]["steps_at_minimum"] == 3
    assert "silent_skips" not in found                                   # fp16: the scale shows its skips
    above = _deepspeed_run("fp16", [1024.0, 512.0, 512.0], [True, False, False], min_loss_scale=256.0)
    assert "scale_at_minimum" not in {f["check"] for f in diagnose(above)["findings"]}
    # a run without meta["deepspeed"] never gets these checks
    plain = _deepspeed_run("bf16", [1.0] * 2, [False, True])
    del plain.meta["deepspeed"]
    assert not {"silent_skips", "scale_at_minimum"} & {f["check"] for f in diagnose(plain)["findings"]}
    assert "DeepSpeed's skips and scale" not in {c["check"] for c in diagnose(plain)["checks"]}


def test_long_step_lists_say_how_many_steps_they_leave_out_and_equal_bounds_read_as_one_share():
    """Doctor text once said "... and 32 more runs of steps" and "100% to 100% of its moved elements"."""
    from ampviz.doctor._facts import percent_range, steps_text
    assert steps_text([3, 4, 5, 9]) == "3-5, 9"
    assert steps_text(list(range(0, 200, 5)), limit=3) == "0, 5, 10 and 37 more steps"
    assert steps_text([1, 2, 3, 5, 6, 8, 10, 11, 12, 13], limit=2) == "1-3, 5-6 and 5 more steps"
    assert steps_text([1, 3, 5], limit=2) == "1, 3 and 1 more step"
    assert percent_range(1.0, 1.0) == "100%" and percent_range(0.1, 0.2) == "10% to 20%"
