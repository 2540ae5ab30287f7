"""AmpvizCallback in a transformers ``Trainer`` run with ``TrainingArguments(deepspeed=<config>)`` on 2 CPU ranks
(``DS_ACCELERATOR=cpu``, gloo; tests/integrations/_hf_deepspeed_worker.py): a 1-layer GPT-2 built from a config
(random weights, nothing downloaded), trained with and without the callback: ZeRO 2 bf16 with a planted overflow,
ZeRO 3 bf16 (every parameter partitioned, gathered only for the forward and backward) and, where DeepSpeed's CPU
accelerator has fp16 (avx512_fp16 / AMX-FP16), ZeRO 2 fp16 under DeepSpeed's dynamic loss scaler with a planted
overflow.

* the callback records through the DeepSpeed path (``ampviz.integrations.deepspeed.Recorder`` on the engine the
  Trainer made, ``trainer.deepspeed``): the ranks' weight counts add up, row for row and step for step, to the
  histograms of the full gradients (``safe_get_full_grad`` at each boundary, before the engine steps);
* training is bit-identical with and without the callback (weights, logged losses, skips);
* the skipped steps recorded are the engine's (a planted inf loss on rank 0 in optimizer step 1);
* the loss of each step is the Trainer's: the ranks' mean is what it logs with ``logging_steps=1``;
* ZeRO 3: the partitions add up to the full gradients too; the run is clean for the doctor;
* fp16: exact after unscaling, the loss scale each backward used and the one after each step are the engine's,
  ``replay(policy_from_run(run), trace_from_run(run))`` reproduces them, and the doctor reads the planted overflow as
  rank 0's forward on both ranks (rank 1's partition takes rank 0's cause).

One spawn, two trainings per rank and case: about 35 s on 2 cores (DeepSpeed's first start on a machine JIT-builds its
shm comm op once: about 40 s more).
"""

import json
import os
import socket

import numpy as np
import pytest
import torch.multiprocessing as mp
from _oracles import FP16, needs_fp16

import ampviz

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_cases(tmp_path_factory):
    import _hf_deepspeed_worker
    out = tmp_path_factory.mktemp("hf_deepspeed")
    cases = ("zero2_bf16", "zero3_bf16") + (("zero2_fp16",) if FP16 else ())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"                   # the spawned ranks inherit it
    try:
        mp.spawn(_hf_deepspeed_worker.run, args=(2, port, str(out), cases), nprocs=2, join=True)
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
    return load


@pytest.fixture(scope="module")
def hf_ds(hf_cases):
    return hf_cases("hf_ds")


def check_partitions_exact(run, engine, oracle):
    """The ranks' weight counts add up to the oracle's full gradients, each parameter counted once per step."""
    w = run.tensors_of("weight")
    assert run.ranks == [0, 1] and [run.tensor_names[t] for t in w] == engine[0]["names"]
    np.testing.assert_array_equal(oracle[0], oracle[1])
    assert run.hist_steps.tolist() == list(range(len(engine[0]["applied"])))
    counts = run.counts[:, :, w]                                         # (ranks, steps, params, bins)
    np.testing.assert_array_equal(counts.sum(axis=0), oracle[0])         # the partitions add up to the full gradients
    per_rank = counts.sum(axis=-1)                                       # (ranks, steps, params): values counted
    assert (per_rank.sum(axis=0) == np.asarray(engine[0]["numels"])).all()
    assert not np.array_equal(counts[0], counts[1])                      # each rank counts only its part
    acts = run.tensors_of("activation")
    assert acts and (run.counts[:, :, acts].sum(axis=-1) > 0).all()
    for r in (0, 1):
        assert engine[r]["bit_identical"] and engine[r]["found_engine"]
        assert engine[r]["plain"] == {k: engine[r][k] for k in ("applied", "skipped", "scales", "logged")}
        assert run.skipped[r].tolist() == [not a for a in engine[r]["applied"]]
        assert run.loss_scale[r].tolist() == engine[r]["used"]           # the scale each step's backward used
        assert run.next_scale[r].tolist() == engine[r]["scales"]         # the engine's after each step
    assert run.meta["deepspeed"]["skipped_steps"] == engine[0]["skipped"][-1]
    return per_rank


@pytest.mark.slow
def test_the_trainers_zero2_engine_is_recorded_exactly_from_its_partitions(hf_ds):
    import _hf_deepspeed_worker as worker
    run, engine, oracle = hf_ds
    # callback.engine is trainer.deepspeed (trainer.model_wrapped)
    assert all(e["stage"] == 2 and e["bf16"] and e["found_engine"] for e in engine)
    ds = run.meta["deepspeed"]
    assert (ds["stage"], ds["dtype"], ds["weights"], ds["gradient_accumulation_steps"]) == (2, "bf16", "partition", 2)
    w = run.tensors_of("weight")
    assert run.ranks == [0, 1] and [run.tensor_names[t] for t in w] == engine[0]["names"]
    np.testing.assert_array_equal(oracle[0], oracle[1])
    assert oracle[0].shape == (worker.STEPS, len(w), oracle[0].shape[-1])
    assert run.hist_steps.tolist() == list(range(worker.STEPS))
    counts = run.counts[:, :, w]                                         # (ranks, steps, params, bins)
    np.testing.assert_array_equal(counts.sum(axis=0), oracle[0])         # the partitions add up to the full gradients
    per_rank = counts[:, 0].sum(axis=-1)                                 # (ranks, params): values counted
    assert (per_rank > 0).all(axis=0).any()                              # some parameter is split between the ranks
    assert not np.array_equal(counts[0], counts[1])                      # ... and each rank counts only its part
    sizes = [int(n) for n in oracle[0][0].sum(axis=-1)]
    assert per_rank.sum(axis=0).tolist() == sizes
    acts = run.tensors_of("activation")
    assert acts and (run.counts[:, :, acts].sum(axis=-1) > 0).all()


@pytest.mark.slow
def test_training_is_unchanged_and_the_skips_are_the_engines(hf_ds):
    import _hf_deepspeed_worker as worker
    run, engine, _ = hf_ds
    for r in (0, 1):
        assert engine[r]["bit_identical"]
        assert engine[r]["plain"] == {k: engine[r][k] for k in ("applied", "skipped", "scales", "logged")}
        assert engine[r]["applied"] == [s != worker.INF_AT for s in range(worker.STEPS)]     # the planted inf
        assert run.skipped[r].tolist() == [not a for a in engine[r]["applied"]]
    assert run.meta["deepspeed"]["skipped_steps"] == engine[0]["skipped"][-1] == 1
    assert run.loss_scale.tolist() == [[1.0] * worker.STEPS] * 2                # bf16: no loss scaling
    silent = [f for f in run.diagnose()["findings"] if f["check"] == "silent_skips"]
    assert len(silent) == 1 and silent[0]["steps"] == [worker.INF_AT]


@pytest.mark.slow
def test_the_loss_of_each_step_is_what_the_trainer_logs(hf_ds):
    import _hf_deepspeed_worker as worker
    run, engine, _ = hf_ds
    clean = [s for s in range(worker.STEPS) if s != worker.INF_AT]
    # the Trainer logs the ranks' mean of its per-rank step losses (the inf step: replaced by its nan/inf filter)
    np.testing.assert_allclose(run.loss.mean(axis=0)[clean], np.asarray(engine[0]["logged"])[clean], rtol=1e-6)
    assert np.isinf(run.loss[0, worker.INF_AT]) and np.isfinite(run.loss[1]).all()


@pytest.mark.slow
def test_the_docs_script_runs_under_torchrun_on_2_cpu_ranks(tmp_path):
    from _oracles import run_docs_torchrun_script
    run_docs_torchrun_script(tmp_path, "train_hf_ds.py", DS_ACCELERATOR="cpu")
    run = ampviz.Run.load(tmp_path / "runs" / "hf_ds")
    assert run.ranks == [0, 1] and run.n_steps == 4
    assert (run.meta["deepspeed"]["stage"], run.meta["deepspeed"]["dtype"]) == (2, "bf16")
    w = run.tensors_of("weight")
    sizes = [p.numel() for p in _docs_model().parameters()]
    assert (run.counts[:, :, w].sum(axis=(0, 3)) == sizes).all()     # every step: each parameter counted once
    assert np.isfinite(run.loss).all() and not run.skipped.any()


def _docs_model():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))


@pytest.mark.slow
def test_the_trainers_zero3_bf16_engine_is_recorded_exactly_from_its_partitions(hf_cases):
    import _hf_deepspeed_worker as worker
    run, engine, oracle = hf_cases("hf_ds_zero3")
    assert all(e["stage"] == 3 and e["bf16"] and e["optimizer"] == "DeepSpeedZeroOptimizer_Stage3" for e in engine)
    ds = run.meta["deepspeed"]
    assert (ds["stage"], ds["dtype"], ds["weights"], ds["gradient_accumulation_steps"]) == (3, "bf16", "partition", 2)
    per_rank = check_partitions_exact(run, engine, oracle)
    # every parameter partitioned (stage3_param_persistence_threshold 0): each is split between the ranks
    assert (per_rank[:, 0] > 0).all()
    assert engine[0]["applied"] == [True] * worker.STEPS and run.loss_scale.tolist() == [[1.0] * worker.STEPS] * 2
    np.testing.assert_allclose(run.loss.mean(axis=0), engine[0]["logged"], rtol=1e-6)
    assert run.diagnose()["clean"]


@pytest.mark.slow
@needs_fp16
def test_the_trainers_zero2_fp16_engine_is_recorded_exactly_with_its_loss_scale(hf_cases):
    import _hf_deepspeed_worker as worker

    from ampviz.replay import DeepSpeedPolicy, policy_from_run, replay, trace_from_run
    run, engine, oracle = hf_cases("hf_ds_fp16")
    assert all(e["stage"] == 2 and e["fp16"] and e["optimizer"] == "DeepSpeedZeroOptimizer" for e in engine)
    ds = run.meta["deepspeed"]
    assert (ds["stage"], ds["dtype"], ds["weights"], ds["dynamic_loss_scale"]) == (2, "fp16", "partition", True)
    check_partitions_exact(run, engine, oracle)                          # unscaled: the oracle divides by the scale
    assert engine[0]["applied"] == [s != worker.INF_AT for s in range(worker.STEPS)]
    assert set(engine[0]["used"]) == {256.0}                             # 2**8; the overflow only used hysteresis
    # the scaler the Trainer's config made, read from the engine, replays the recorded scale exactly
    policy = policy_from_run(run)
    assert policy == DeepSpeedPolicy(init_scale=256.0, scale_factor=2.0, scale_window=2, min_scale=1.0, hysteresis=2)
    rep = replay(policy, trace_from_run(run))
    assert rep.scale.tolist() == run.loss_scale[0].tolist() and rep.skipped.tolist() == run.skipped[0].tolist()
    # the planted inf loss on rank 0: rank 0's forward, on both ranks (rank 1's partition takes rank 0's cause)
    report = run.diagnose()
    causes = {e["rank"]: e for e in report["nonfinite_steps"]}
    assert sorted(causes) == [0, 1] and {e["step"] for e in report["nonfinite_steps"]} == {worker.INF_AT}
    assert causes[0]["cause"] == causes[1]["cause"] == "forward" and causes[1]["cause_rank"] == 0
    assert [f["check"] for f in report["findings"]] == ["forward_overflow"]
    assert report["findings"][0]["steps"] == [worker.INF_AT] and report["findings"][0]["ranks"] == [0]
    clean = [s for s in range(worker.STEPS) if s != worker.INF_AT]
    np.testing.assert_allclose(run.loss.mean(axis=0)[clean], np.asarray(engine[0]["logged"])[clean], rtol=1e-6)
