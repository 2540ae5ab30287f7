"""AmpvizCallback in a transformers ``Trainer`` run with ``TrainingArguments(deepspeed=<bf16 ZeRO 2 config>)`` on 2
CPU ranks (``DS_ACCELERATOR=cpu``, gloo; tests/integrations/_hf_deepspeed_worker.py): a 1-layer GPT-2 built from a
config (random weights, nothing downloaded), trained with and without the callback.

* the callback records through the DeepSpeed path (``ampviz.integrations.deepspeed.Recorder`` on the engine the
  Trainer made, ``trainer.deepspeed``): the ranks' weight counts add up, row for row and step for step, to the
  histograms of the full gradients (``safe_get_full_grad`` at each boundary, before the engine steps);
* training is bit-identical with and without the callback (weights, logged losses, skips);
* the skipped steps recorded are the engine's (a planted inf loss on rank 0 in optimizer step 1);
* the loss of each step is the Trainer's: the ranks' mean is what it logs with ``logging_steps=1``.

One spawn, two trainings per rank: about 20 s on 2 cores (DeepSpeed's first start on a machine JIT-builds its shm
comm op once: about 40 s more).
"""

import json
import os
import socket

import numpy as np
import pytest
import torch.multiprocessing as mp

import ampviz

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_ds(tmp_path_factory):
    import _hf_deepspeed_worker
    out = tmp_path_factory.mktemp("hf_deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"                   # the spawned ranks inherit it
    try:
        mp.spawn(_hf_deepspeed_worker.run, args=(2, port, str(out)), nprocs=2, join=True)
    finally:
        if env is None:
            os.environ.pop("DS_ACCELERATOR", None)
        else:
            os.environ["DS_ACCELERATOR"] = env
    run = ampviz.Run.load(out / "hf_ds")
    engine = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    oracle = [np.load(out / f"oracle{r}.npy") for r in (0, 1)]
    return run, engine, oracle


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
        assert engine[r]["plain"] == {k: engine[r][k] for k in ("applied", "skipped", "logged")}
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
