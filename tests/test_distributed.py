"""ampviz.lessons.launch and ampviz.examples.process_group: sampler tables against PyTorch's own permutation,
ranks launched from Python, collectives checked against sums computed here, and a rank that fails on purpose."""

import os
import signal
import time

import numpy as np
import pytest
import torch

import ampviz
from ampviz.examples.ddp_amp import Config, train_worker
from ampviz.examples.process_group import init_from_env, is_collective_failure
from ampviz.lessons import ddp_ranks
from ampviz.lessons.launch import LaunchError, Workers, launch
from ampviz.lessons.sampler import sampler_table


def test_init_from_env_without_torchrun_is_a_world_of_one(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    env = init_from_env()
    assert (env.rank, env.world_size, env.backend) == (0, 1, None)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="timeout: expected a positive number of seconds, got 0"):
        init_from_env(timeout=0)


def test_launch_rejects_functions_spawn_cannot_import():
    with pytest.raises(ValueError, match="fn: expected a function defined at the top level"):
        launch(lambda: 1, 2)
    with pytest.raises(ValueError, match="nprocs: expected an integer >= 1, got 0"):
        launch(ddp_ranks.hello, 0)


def test_is_collective_failure():
    assert is_collective_failure(RuntimeError("[gloo/pair.cc:553] Connection closed by peer"))
    assert is_collective_failure(torch.distributed.DistBackendError("x"))
    assert not is_collective_failure(RuntimeError("rank 1: deliberate failure"))
    assert not is_collective_failure(ValueError("Timed out"))


@pytest.mark.slow
def test_workers_run_collectives_on_two_ranks():
    with Workers(2, timeout=120) as workers:
        hello = workers.run(ddp_ranks.hello)
        assert [h["rank"] for h in hello] == [0, 1]
        assert {h["world_size"] for h in hello} == {2} and {h["backend"] for h in hello} == {"gloo"}
        assert hello[0]["pid"] != hello[1]["pid"] and hello[0]["master"] == hello[1]["master"]
        shares = workers.run(ddp_ranks.sampler_shares, 12, 3, 5)
        for key, set_epoch in (("with_set_epoch", True), ("without_set_epoch", False)):
            got = np.array([s[key] for s in shares]).transpose(1, 0, 2)       # (epochs, ranks, n)
            np.testing.assert_array_equal(got, sampler_table(12, 2, 3, seed=5, set_epoch=set_epoch))
        red = workers.run(ddp_ranks.reductions)
        total = red[0]["local_loss"] + red[1]["local_loss"]
        assert red[0]["local_loss"] != red[1]["local_loss"]                   # different data per rank
        for r in red:
            assert r["all_reduce_sum"] == pytest.approx(total, rel=1e-6)
        assert red[0]["after_reduce"] == pytest.approx(total, rel=1e-6)
        acc = workers.run(ddp_ranks.accumulation_all_reduces, 3)          # no_sync: one all-reduce, not three
        for r in acc:
            assert r["every_backward"]["all_reduce_calls"] == 3 * r["no_sync"]["all_reduce_calls"] > 0
            assert r["no_sync"]["values_all_reduced"] == sum(p.numel() for p in ddp_ranks.small_model(0).parameters())
            for a, b in zip(r["no_sync"]["grads"], r["every_backward"]["grads"]):
                torch.testing.assert_close(a, b)
        assert all(torch.equal(a, b) for a, b in zip(acc[0]["no_sync"]["grads"], acc[1]["no_sync"]["grads"]))
    assert workers.closed


@pytest.mark.slow
def test_a_failing_rank_stops_the_other_with_a_clear_error(tmp_path):
    config = Config(out=str(tmp_path), steps=8, eval_every=100, fail_rank=1, fail_step=2, timeout=30,
                    progress=False)
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(train_worker, 2, args=(config,), timeout=150, grace=40)
    assert time.monotonic() - start < 150
    outcomes = info.value.outcomes
    assert outcomes[1].startswith("raised RuntimeError: rank 1: deliberate failure before step 2")
    assert outcomes[0].startswith("raised PeerFailure: rank 0 stopped: a collective operation failed")
    assert "rank 1: raised RuntimeError" in str(info.value) and "Traceback" in info.value.tracebacks[1]
    # both ranks saved what they recorded before the failure; no temporary files are left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.npz", "rank1.npz"]
    run = ampviz.Run.load(tmp_path)
    assert run.ranks == [0, 1] and run.n_steps == 2
    np.testing.assert_array_equal(run.skipped[0], run.skipped[1])


@pytest.mark.slow
def test_a_rank_that_died_while_idle_is_a_launch_error_like_a_death_mid_run():
    with Workers(2, timeout=60) as workers:
        assert [h["rank"] for h in workers.run(ddp_ranks.hello)] == [0, 1]
        os.kill(workers.pids[1], signal.SIGKILL)             # the OOM killer, say, between two runs
        deadline = time.monotonic() + 30
        while workers.alive[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers.alive == [True, False]
        start = time.monotonic()
        with pytest.raises(LaunchError) as info:
            workers.run(ddp_ranks.hello)
        assert time.monotonic() - start < 20                 # rank 0 is not left waiting for its peer
        assert info.value.outcomes == {1: "died while idle, before hello (exit status -9)",
                                       0: "not run: rank 1 had died (terminated)"}
        assert "2 of 2 ranks failed running hello" in str(info.value)
        assert workers.closed and workers.alive == [False, False]
