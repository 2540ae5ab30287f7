"""ampviz.integrations.deepspeed against the real DeepSpeed (0.19.8) on 2 CPU ranks (``DS_ACCELERATOR=cpu``, gloo):
ZeRO 0, 1, 2 and 3 in bf16, each trained with and without the Recorder (tests/integrations/_deepspeed_worker.py).

* exact: the ranks' weight counts add up, row for row and step for step, to the histograms of the full gradients
  DeepSpeed assembles itself (``safe_get_full_grad``) at the same point (ZeRO 0: every rank holds the full one);
* training is bit-identical with and without the Recorder;
* the loss scale and the skipped steps recorded are the ones the engine reports; a planted overflow in a bf16 run
  is skipped by DeepSpeed and found by the doctor (``silent_skips``);
* fp16 engines (where DeepSpeed's CPU accelerator supports fp16: avx512_fp16 / AMX-FP16): ZeRO 2 exact after
  unscaling, a scale pinned at ``min_loss_scale`` found by the doctor; ZeRO 0 to 3 with planted overflows that use
  up the hysteresis, back off and grow back: recorded as the engine reports it and replayed exactly by
  ``replay(policy_from_run(run), trace_from_run(run))``; a too-high init scale read by the doctor as the scale's,
  with DeepSpeed's own settings (also through ``ampviz doctor``), and a clean fp16 run with no scale finding.

One spawn runs every case (DeepSpeed's first start JIT-builds its shm comm op once: about 40 s; then about 20 s).
"""

import json
import os
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from _oracles import FP16, needs_fp16

import ampviz
import ampviz.histogram as H

deepspeed = pytest.importorskip("deepspeed")

BF16 = [{"name": f"zero{s}", "stage": s, "dtype": "bf16"} for s in (0, 1, 2, 3)]
# the bucketed, overlapped reduction (small buckets: several per step), and ZeRO 3 with every parameter partitioned
BUCKETS = [{"name": "zero2_buckets", "stage": 2, "dtype": "bf16", "zero": {
               "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 64,
               "allgather_bucket_size": 64}},
           {"name": "zero3_buckets", "stage": 3, "dtype": "bf16", "zero": {
               "overlap_comm": True, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0}}]
# histograms every other step, of the second layer's weights only
EVERY = {"name": "zero1_every2", "stage": 1, "dtype": "bf16", "options": {"every": 2, "weights": r"^2\."}}
# bf16 parameters with fp32 gradient accumulation: ZeRO 1 runs DeepSpeed's BF16_Optimizer (a full fp32 gradient
# buffer on every rank, of which each rank's fragment is counted)
BF16_FP32_ACCUM = {"name": "zero1_fp32_accum", "stage": 1, "dtype": "bf16", "data_types": {"grad_accum_dtype": "fp32"}}
# a DeepSpeed whose partitions cannot be read (planted): training goes on unchanged, with a warning
UNREADABLE = {"name": "zero2_unreadable", "stage": 2, "dtype": "bf16", "unreadable": True}
BF16_INF = {"name": "zero2_inf", "stage": 2, "dtype": "bf16", "inf_at": 1, "scheduler": True}
# fp16 from the minimum: the planted overflow cannot back off (hysteresis 2 keeps the run alive at the minimum)
FP16_MIN = {"name": "fp16_zero2_min", "stage": 2, "dtype": "fp16", "inf_at": 1,
            "fp16": {"min_loss_scale": 256, "hysteresis": 2}}
# fp16 from 2**20 without hysteresis: the first steps overflow because of the scale, which halves each time
FP16_HIGH = {"name": "fp16_zero2_high", "stage": 2, "dtype": "fp16",
             "fp16": {"initial_scale_power": 20, "hysteresis": 1}}
# fp16 on every ZeRO stage, 8 steps from 2**8 with overflows planted at steps 1, 2 and 6: the first overflow uses up
# the hysteresis (2) and the second backs off; after 2 clean steps past the one after it the scale grows back (the
# growth refills the hysteresis, which step 6 uses up again). ZeRO 0's FP16_UnfusedOptimizer has no hysteresis.
HYST_AT, HYST_STEPS = [1, 2, 6], 8
FP16_HYST = [{"name": f"fp16_zero{s}_hyst", "stage": s, "dtype": "fp16", "steps": HYST_STEPS, "inf_at": HYST_AT}
             for s in (0, 1, 2, 3)]
# fp16 from 2**20 with hysteresis 2: the scale's own overflows at the start, then a growth probe
FP16_HIGH_HYST = {"name": "fp16_zero1_high", "stage": 1, "dtype": "fp16", "steps": HYST_STEPS,
                  "fp16": {"initial_scale_power": 20}}
# fp16 with nothing planted: the scale grows every 3 steps and never overflows
FP16_CLEAN = {"name": "fp16_zero2_clean", "stage": 2, "dtype": "fp16", "steps": HYST_STEPS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import _deepspeed_worker
    out = tmp_path_factory.mktemp("deepspeed")
    cases = BF16 + BUCKETS + [EVERY, BF16_FP32_ACCUM, BF16_INF, UNREADABLE]
    cases += [FP16_MIN, FP16_HIGH, *FP16_HYST, FP16_HIGH_HYST, FP16_CLEAN] if FP16 else []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"                   # the spawned ranks inherit it
    try:
        mp.spawn(_deepspeed_worker.run, args=(2, port, str(out), cases), nprocs=2, join=True)
    finally:
        if env is None:
            os.environ.pop("DS_ACCELERATOR", None)
        else:
            os.environ["DS_ACCELERATOR"] = env

    def load(name):
        run = ampviz.Run.load(out / name)
        engine = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]
        oracle = [np.load(out / f"{name}.oracle{r}.npy") for r in (0, 1)]
        return run, engine, oracle
    load.dir = out                                         # where the runs were saved
    return load


def check_exact(run, engine, oracle, stage):
    import _deepspeed_worker
    names = [n for n, _ in _deepspeed_worker.model().named_parameters()]
    w = run.tensors_of("weight")
    assert run.ranks == [0, 1] and [run.tensor_names[t] for t in w] == names == engine[0]["names"]
    np.testing.assert_array_equal(oracle[0], oracle[1])                 # the oracle is the same on both ranks
    assert run.hist_steps.tolist() == list(range(len(engine[0]["scales"])))
    counts = run.counts[:, :, w]                                         # (ranks, steps, params, bins)
    sizes = [p.numel() for p in _deepspeed_worker.model().parameters()]
    if stage == 0:                                                       # all-reduced .grad: the full one everywhere
        assert run.meta["deepspeed"]["weights"] == "full"
        for r in (0, 1):
            np.testing.assert_array_equal(counts[r], oracle[0])
    else:                                                                # disjoint partitions
        assert run.meta["deepspeed"]["weights"] == "partition"
        np.testing.assert_array_equal(counts.sum(axis=0), oracle[0])
        per_rank = counts[:, 0].sum(axis=-1)                             # (ranks, params) values counted
        assert (per_rank > 0).sum() > len(sizes)                         # some parameter is split between ranks
        assert per_rank.sum(axis=0).tolist() == sizes
    assert (counts.sum(axis=-1) > 0).any(axis=0).all()
    # activation gradients from module hooks: both micro-batches of every step, on every rank
    acts = run.tensors_of("activation")
    assert acts and (run.counts[:, :, acts].sum(axis=-1) > 0).all()
    # training unchanged, the engine's scale and skips
    for r in (0, 1):
        assert engine[r]["bit_identical"] and engine[r]["step_restored"] and engine[r]["warnings"] == []
        assert run.next_scale[r].tolist() == engine[r]["scales"]
        assert run.loss_scale[r].tolist() == engine[r]["used"]             # the scale each step's backward used
        assert run.skipped[r].tolist() == [not a for a in engine[r]["applied"]]
        assert engine[r]["plain"] == {k: engine[r][k] for k in ("scales", "applied", "skipped")}
    assert run.meta["deepspeed"]["skipped_steps"] == engine[0]["skipped"][-1]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage_in_bf16_is_exact_against_the_full_gradients(runs, stage):
    run, engine, oracle = runs(f"zero{stage}")
    check_exact(run, engine, oracle, stage)
    ds = run.meta["deepspeed"]
    assert (ds["stage"], ds["dtype"], ds["gradient_accumulation_steps"]) == (stage, "bf16", 2)
    assert engine[0]["optimizer"] == ds["optimizer"]
    assert run.loss_scale.tolist() == [[1.0] * 4] * 2 and not run.skipped.any()
    assert np.isfinite(run.loss).all()                                   # the mean of each step's micro-batch losses
    assert run.diagnose()["clean"]
    from ampviz.report import summary_rows
    text = dict(summary_rows(run))["loss scale"]                       # what `ampviz info` prints
    assert text == f"2^0 (constant); DeepSpeed ZeRO {stage} bf16, no dynamic loss scaling"


@pytest.mark.slow
@pytest.mark.parametrize("case", BUCKETS, ids=[c["name"] for c in BUCKETS])
def test_small_overlapped_reduce_buckets_are_exact(runs, case):
    run, engine, oracle = runs(case["name"])
    check_exact(run, engine, oracle, case["stage"])


@pytest.mark.slow
def test_every_other_step_and_a_weight_filter(runs):
    run, engine, oracle = runs("zero1_every2")
    w = run.tensors_of("weight")
    assert [run.tensor_names[t] for t in w] == ["2.weight", "2.bias"] and run.hist_steps.tolist() == [0, 2]
    np.testing.assert_array_equal(run.counts[:, :, w].sum(axis=0), oracle[0][[0, 2]][:, 2:])
    assert run.n_steps == 4 and run.next_scale[0].tolist() == engine[0]["scales"]
    assert all(e["bit_identical"] and e["warnings"] == [] for e in engine)


@pytest.mark.slow
def test_bf16_with_fp32_gradient_accumulation_in_deepspeeds_bf16_optimizer_is_exact(runs):
    run, engine, oracle = runs("zero1_fp32_accum")
    assert engine[0]["optimizer"] == "BF16_Optimizer"
    check_exact(run, engine, oracle, 1)


@pytest.mark.slow
def test_partitions_it_cannot_read_cost_a_warning_not_the_training(runs):
    run, engine, _ = runs("zero2_unreadable")
    for r in (0, 1):
        assert engine[r]["bit_identical"] and engine[r]["step_restored"]
        assert len(engine[r]["warnings"]) == 1
        assert "could not read the ZeRO 2 gradient partitions" in engine[r]["warnings"][0]
        assert "AttributeError: planted" in engine[r]["warnings"][0]
    assert run.counts[:, :, run.tensors_of("weight")].sum() == 0
    assert (run.counts[:, :, run.tensors_of("activation")].sum(axis=-1) > 0).all()
    assert run.next_scale[0].tolist() == engine[0]["scales"] and not run.skipped.any()


@pytest.mark.slow
def test_a_planted_overflow_in_bf16_is_skipped_by_deepspeed_and_found_by_the_doctor(runs):
    run, engine, oracle = runs("zero2_inf")
    check_exact(run, engine, oracle, 2)                 # the inf/nan counted as the full gradient holds them
    assert engine[0]["applied"] == [True, False, True, True] and engine[0]["skipped"][-1] == 1
    assert run.skipped.tolist() == [[False, True, False, False]] * 2
    assert run.loss_scale.tolist() == [[1.0] * 4] * 2                   # bf16: no scale moves to show the skip
    report = run.diagnose()
    silent = [f for f in report["findings"] if f["check"] == "silent_skips"]
    assert len(silent) == 1 and silent[0]["steps"] == [1] and silent[0]["severity"] == "warning"
    assert silent[0]["evidence"]["engine_skipped_steps"] == 1
    # the planted inf is rank 0's loss: both ranks' parts are decided by it (the forward), so rank 1's non-finite
    # partition is not blamed on a layer of its own (no nonfinite_gradient), and the finding says where it came from
    causes = {e["rank"]: e for e in report["nonfinite_steps"] if e["step"] == 1}
    assert {r: e["cause"] for r, e in causes.items()} == {0: "forward", 1: "forward"}
    assert causes[1]["cause_rank"] == 0 and causes[1]["own_cause"] == "not the loss scale"
    fwd = [f for f in report["findings"] if f["check"] == "forward_overflow"]
    assert len(fwd) == 1 and fwd[0]["steps"] == [1] and fwd[0]["ranks"] == [0]
    assert any("rank 0's forward pass was not finite" in d for d in fwd[0]["details"]), fwd[0]["details"]
    assert not any(f["check"] == "nonfinite_gradient" for f in report["findings"])
    assert not any(f["check"] == "scale_at_minimum" for f in report["findings"])
    # the user's scheduler, stepped outside the engine, advanced on the step DeepSpeed skipped
    on_skipped = [f for f in report["findings"] if f["check"] == "scheduler_on_skipped"]
    assert len(on_skipped) == 1 and on_skipped[0]["steps"] == [1], on_skipped


@pytest.mark.slow
@needs_fp16
def test_fp16_zero2_unscaled_exactly_and_a_scale_pinned_at_min_loss_scale_is_found(runs):
    run, engine, oracle = runs("fp16_zero2_min")
    check_exact(run, engine, oracle, 2)                                  # the oracle divides by the scale too
    ds = run.meta["deepspeed"]
    assert (ds["dtype"], ds["min_loss_scale"], ds["hysteresis"], ds["dynamic_loss_scale"]) == ("fp16", 256.0, 2, True)
    # hysteresis 2: the overflow at the minimum costs the step, the scale stays; then it grows after 2 clean steps
    assert run.loss_scale[0].tolist()[:2] == [256.0, 256.0] and run.skipped[0].tolist()[:2] == [False, True]
    pinned = [f for f in run.diagnose()["findings"] if f["check"] == "scale_at_minimum"]
    assert len(pinned) == 1 and pinned[0]["steps"] == [1] and pinned[0]["severity"] == "error"
    assert not any(f["check"] == "silent_skips" for f in run.diagnose()["findings"])
    from ampviz.report import summary_rows
    assert dict(summary_rows(run))["loss scale"].endswith(
        "DeepSpeed ZeRO 2 fp16, dynamic loss scaler (min 2^8, hysteresis 2, x2 after 2 clean steps)")


@pytest.mark.slow
@needs_fp16
def test_fp16_overflows_of_a_too_high_scale_are_the_scales_not_the_models(runs):
    run, engine, oracle = runs("fp16_zero2_high")
    check_exact(run, engine, oracle, 2)
    assert engine[0]["applied"] == [False, False, False, True]
    assert run.skipped.tolist() == [[True, True, True, False]] * 2
    assert run.loss_scale[0].tolist() == [2.0 ** 20, 2.0 ** 19, 2.0 ** 18, 2.0 ** 17]
    report = run.diagnose()
    assert report["run"]["precision"] == "fp16"
    # DeepSpeed's scale multiplied the backward: the first overflow is read as the scale's, not the model's
    first = [e for e in report["nonfinite_steps"] if e["step"] == 0]
    assert first and {e["cause"] for e in first} == {"loss scale"}
    assert not {"nonfinite_gradient", "silent_skips", "scale_at_minimum"} & {f["check"] for f in report["findings"]}
    check_partitioned_causes(run, report)


def check_partitioned_causes(run, report):
    """Every skipped step of a partitioned fp16 run is decided on every rank, from all ranks' parts together: a rank
    whose own part stayed finite takes the cause of the rank whose part overflowed, and the finding says so."""
    causes = report["nonfinite_steps"]
    skipped = run.steps[run.skipped[0]].tolist()
    assert sorted((e["step"], e["rank"]) for e in causes) == sorted((s, r) for s in skipped for r in run.ranks)
    assert {e["cause"] for e in causes} == {"loss scale"} and all(e["scale_overflow"] for e in causes)
    adopted = [e for e in causes if e.get("cause_rank") is not None]
    assert adopted, "the test needs a step whose overflow is in one rank's partition only"
    for e in adopted:
        assert e["own_cause"] == "unknown" and e["sources"] == [] and e["cause_rank"] != e["rank"]
        own = next(x for x in causes if (x["step"], x["rank"]) == (e["step"], e["cause_rank"]))
        assert own.get("cause_rank") is None and e["origin"] == own["origin"]
    # no "record every step" advice: every tensor of every step was recorded, on one rank or the other
    assert all(c["check"] != "causes of all skipped steps" for c in report["checks"])
    assert "every=1" not in json.dumps(report)
    init = next(f for f in report["findings"] if f["check"] == "init_scale_too_high")
    k = adopted[0]["cause_rank"]
    assert any(f"the partition on rank {k} held the non-finite values" in d for d in init["details"]), init["details"]


@pytest.mark.slow
@needs_fp16
def test_fp16_zero0_backs_off_at_once_as_the_engine_reports(runs):
    run, engine, oracle = runs("fp16_zero0_hyst")
    check_exact(run, engine, oracle, 0)
    assert run.meta["deepspeed"]["optimizer"] == "FP16_UnfusedOptimizer"
    assert engine[0]["scales"][:2] == [256.0, 128.0]                     # no hysteresis in ZeRO 0's fp16 optimizer
    assert run.loss_scale[0].tolist()[:3] == [256.0, 256.0, 128.0]


# fp16 scale traces of the FP16_HYST runs, written out from DeepSpeed 0.19.8's update rules: the scale each step used
HYST_SKIPPED = [s in HYST_AT for s in range(HYST_STEPS)]
HYST_USED = {"unfused": [256.0, 256.0, 128.0, 64.0, 64.0, 64.0, 128.0, 64.0],            # every overflow backs off
             "dynamic": [256.0, 256.0, 256.0, 128.0, 128.0, 128.0, 256.0, 256.0]}         # hysteresis 2 first


def check_replay(run):
    """``replay(policy_from_run(run), trace_from_run(run))`` reproduces rank 0's scale trace and skips exactly."""
    from ampviz.replay import DeepSpeedPolicy, policy_from_run, replay, trace_from_run
    policy = policy_from_run(run)
    assert isinstance(policy, DeepSpeedPolicy)
    again = replay(policy, trace_from_run(run, "fp16"))
    assert again.scale.tolist() == run.loss_scale[0].tolist()
    assert again.skipped.tolist() == run.skipped[0].tolist() and again.crashed_at is None
    return policy, again


@pytest.mark.slow
@needs_fp16
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_hysteresis_is_recorded_as_the_engine_scaled_and_replayed_exactly(runs, stage):
    import dataclasses

    from ampviz.replay import replay, trace_from_run
    run, engine, oracle = runs(f"fp16_zero{stage}_hyst")
    check_exact(run, engine, oracle, stage)            # next_scale, loss_scale, skips: as the engine reported them
    used = HYST_USED["unfused" if stage == 0 else "dynamic"]
    assert engine[0]["used"] == used and engine[0]["applied"] == [not s for s in HYST_SKIPPED]
    assert run.loss_scale.tolist() == [used] * 2 and run.skipped.tolist() == [HYST_SKIPPED] * 2
    assert engine[0]["skipped"][-1] == run.meta["deepspeed"]["skipped_steps"] == 3
    policy, _ = check_replay(run)
    ds = run.meta["deepspeed"]
    assert (policy.init_scale, policy.scale_window, policy.min_scale) == (256.0, 2, 1.0) == (
        ds["init_scale"], ds["scale_window"], ds["min_loss_scale"])
    if stage == 0:                                     # FP16_UnfusedOptimizer: no hysteresis, floors at the minimum
        assert ds["hysteresis"] is None and (policy.hysteresis, policy.raise_error_at_min_scale) == (1, False)
    else:                                              # DynamicLossScaler
        assert (policy.hysteresis, policy.consecutive_hysteresis, policy.raise_error_at_min_scale) == (2, False, True)
        assert ds["scaler_start"] == {"cur_iter": 0, "last_overflow_iter": -1, "cur_hysteresis": 2}
        # the replay reads the hysteresis: without it, the first overflow would back off at once
        assert replay(dataclasses.replace(policy, hysteresis=1), trace_from_run(run)).scale.tolist() != used
    if stage in (1, 2, 3):                             # each rank holds a part: the trace is the largest over them
        each = np.stack([trace_from_run(run, rank=r) for r in run.ranks])
        assert run.meta["deepspeed"]["weights"] == "partition"
        assert np.array_equal(trace_from_run(run), each.max(axis=0))
        assert np.array_equal(trace_from_run(run, rank=0), each[0])
        assert (each.max(axis=0) > each[0]).any()      # rank 0's part alone misses the largest gradient somewhere


@pytest.mark.slow
@needs_fp16
def test_fp16_a_too_high_init_scale_with_hysteresis_is_the_scales_doing_and_the_doctor_says_so(runs):
    run, engine, oracle = runs("fp16_zero1_high")
    check_exact(run, engine, oracle, 1)
    policy, _ = check_replay(run)
    assert (policy.init_scale, policy.hysteresis, policy.scale_window) == (2.0 ** 20, 2, 2)
    skipped = run.skipped[0]
    assert skipped[:2].all() and run.loss_scale[0, 1] == 2.0 ** 20          # the first overflow only used hysteresis
    report = run.diagnose()
    checks = [f["check"] for f in report["findings"]]
    init = [f for f in report["findings"] if f["check"] == "init_scale_too_high"]
    assert len(init) == 1 and init[0]["severity"] == "info", checks
    start = int(np.argmin(skipped))                                        # the first step that passed
    assert init[0]["steps"] == list(range(start)) and init[0]["evidence"]["init_scale"] == 2.0 ** 20
    assert init[0]["evidence"]["settled_scale"] == run.next_scale[0, start - 1]
    assert '"initial_scale_power"' in init[0]["recommendation"] and "hysteresis (2)" in init[0]["recommendation"]
    assert "DeepSpeed as recorded (hysteresis 2, scale_window 2)" not in str(init[0])   # replays the settled scale
    # nothing blames the model, and no error; a rank whose own part of the gradients stayed finite takes the cause
    # from the rank whose part overflowed: never "unknown", never "record every step"
    check_partitioned_causes(run, report)
    assert not {"nonfinite_gradient", "scale_collapse", "silent_skips", "scale_at_minimum"} & set(checks)
    assert not any(f["severity"] == "error" for f in report["findings"])
    health = next(c for c in report["checks"] if c["check"] == "loss-scale health")
    assert health["ran"]
    # the command line, on the saved run
    from ampviz.cli import main
    assert main(["doctor", str(runs.dir / "fp16_zero1_high")]) == 0


@pytest.mark.slow
@needs_fp16
def test_fp16_a_clean_run_replays_exactly_and_gets_no_scale_finding(runs, capsys):
    run, engine, oracle = runs("fp16_zero2_clean")
    check_exact(run, engine, oracle, 2)
    assert not run.skipped.any() and run.next_scale[0, -1] > run.loss_scale[0, 0]       # the scale grew
    check_replay(run)
    report = run.diagnose()
    assert report["clean"], report["findings"]
    assert next(c for c in report["checks"] if c["check"] == "loss-scale health")["ran"]
    from ampviz.cli import main
    assert main(["doctor", str(runs.dir / "fp16_zero2_clean")]) == 0
    out = capsys.readouterr().out
    assert "fp16_zero2_clean" in out


def test_policy_from_run_reads_deepspeeds_scaler_and_refuses_bf16():
    """No ranks: a run's meta as the Recorder writes it (the real runs above check it against the engine)."""
    from ampviz.replay import DeepSpeedPolicy, StaticPolicy, policy_from_run
    one = np.ones((1, 3))
    ds = {"stage": 2, "dtype": "fp16", "dynamic_loss_scale": True, "min_loss_scale": 4.0, "hysteresis": 3,
          "scale_window": 5, "scale_factor": 2.0, "consecutive_hysteresis": True, "raise_error_at_min_scale": False,
          "init_scale": 512.0}
    run = ampviz.Run(np.arange(3), one, one * 512, one * 512, one < 0, np.arange(0), np.zeros((1, 0, 0, H.NBINS), int),
                     [], [], [], {"ranks": [0], "deepspeed": ds})
    assert policy_from_run(run) == DeepSpeedPolicy(init_scale=512.0, scale_window=5, min_scale=4.0, hysteresis=3,
                                                   consecutive_hysteresis=True, raise_error_at_min_scale=False)
    ds.update(dynamic_loss_scale=False)
    assert policy_from_run(run) == StaticPolicy(init_scale=512.0)
    ds.update(dtype="bf16")
    with pytest.raises(ValueError, match="a DeepSpeed bf16 run has no loss scale"):
        policy_from_run(run)


# ---------------------------------------------------------------------------------------- without ranks
class _Optimizer:
    def __init__(self, scaler):
        self.loss_scaler = scaler


class _Engine:
    def __init__(self, scaler):
        self.optimizer = _Optimizer(scaler)


def test_the_scale_is_read_from_deepspeeds_own_dynamic_loss_scaler():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from ampviz.integrations.deepspeed import _Engine as Source
    scaler = DynamicLossScaler(init_scale=2.0 ** 8, scale_window=2, min_scale=4.0, delayed_shift=2,
                               consecutive_hysteresis=False)
    source = Source(_Engine(scaler), 2, [])
    seen = []
    for _ in range(5):
        scaler.update_scale(False)                     # clean steps: no process group needed
        seen.append(source.scale())
    assert seen == [256.0, 256.0, 512.0, 512.0, 1024.0]      # doubled after every 2 clean steps past the first
    assert source._scaler() is scaler and source.scale() == scaler.loss_scale == 1024.0


def test_recorder_refuses_what_is_not_an_engine_and_what_the_engine_holds():
    from ampviz.integrations.deepspeed import Recorder, is_engine
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="engine: expected a deepspeed.DeepSpeedEngine .* got Linear"):
        Recorder(model)
    assert not is_engine(model) and not is_engine(None)


@pytest.mark.slow
def test_the_docs_script_runs_under_torchrun_on_2_cpu_ranks(tmp_path):
    from _oracles import run_docs_torchrun_script
    run_docs_torchrun_script(tmp_path, "train_ds.py", DS_ACCELERATOR="cpu")
    run = ampviz.Run.load(tmp_path / "runs" / "ds")
    assert run.ranks == [0, 1] and run.n_steps == 4 and run.meta["deepspeed"]["stage"] == 2
    w = run.tensors_of("weight")
    sizes = [16 * 32, 32, 32 * 5, 5]
    assert (run.counts[:, :, w].sum(axis=(0, 3)) == sizes).all()     # every step: each parameter counted once


@pytest.mark.slow
@needs_fp16
@pytest.mark.parametrize("name", ["fp16_zero2_hyst", "fp16_zero0_hyst"])
def test_the_scaler_playground_starts_from_the_engines_scaler_and_reproduces_it(runs, name):
    pytest.importorskip("ipywidgets")
    from ampviz.replay import DeepSpeedPolicy, TorchPolicy, policy_from_run
    from ampviz.widgets import ScalerPlayground
    run = ampviz.Run.load(runs.dir / name)                 # the file the 2-rank engine's Recorder saved
    policy = policy_from_run(run)
    assert isinstance(policy, DeepSpeedPolicy)
    w = ScalerPlayground(run)
    assert w.policy_dropdown.value == "deepspeed" and w.current_policy() == policy
    assert (2.0 ** w.init_slider.value, w.interval_slider.value, w.hysteresis_slider.value, w.growth_slider.value) == (
        policy.init_scale, policy.scale_window, policy.hysteresis, policy.scale_factor)
    np.testing.assert_array_equal(w.replay.scale, run.loss_scale[0])
    assert w.replay.n_skipped == w.recorded_skipped == int(run.skipped[0].sum()) > 0
    assert "DeepSpeed stops" not in w.readout.value
    # moving a slider keeps the engine's settings that have none (min_scale, the hysteresis mode)
    w.interval_slider.value = 10
    assert w.current_policy() == DeepSpeedPolicy(**{**vars(policy), "scale_window": 10})
    # another policy from the same controls: GradScaler growing after the engine's scale_window
    w.policy_dropdown.value = "pytorch"
    assert w.current_policy() == TorchPolicy(policy.init_scale, growth_interval=10)
