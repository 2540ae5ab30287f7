"""The torchrun examples, run as a user would: 2 gloo ranks on the CPU, then the recorded runs loaded."""

import os
import random
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import ampviz
from ampviz import cli
from ampviz._warnings import AmpvizWarning
from ampviz.examples.ddp_amp import Config

pytestmark = pytest.mark.slow


def torchrun(*args, timeout=300):
    """``python -m torch.distributed.run --standalone --nproc-per-node 2 ...`` (a free port, no clashes)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_ddp_amp_example_records_every_rank(tmp_path, capsys):
    out = tmp_path / "ddp"
    # init_scale 2**30 overflows fp16 at once: the first steps must be skipped, on both ranks
    proc = torchrun("-m", "ampviz.examples.ddp_amp", "--out", str(out), "--steps", "16", "--accum", "2",
                    "--eval-every", "8", "--init-scale", str(2.0 ** 30), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"ampviz info {out}" in proc.stdout and f"ampviz report {out} -o {out / 'report.html'}" in proc.stdout
    assert "precision" in proc.stdout and "accuracy" in proc.stdout        # the test-set classification report
    assert sorted(p.name for p in out.iterdir()) == ["best.pt", "rank0.npz", "rank1.npz", "state.pt"]
    run = ampviz.Run.load(out)
    assert run.ranks == [0, 1] and run.meta["world_size"] == 2 and run.n_steps == 16
    # the LR schedule stepped only on the steps the scaler did not skip
    np.testing.assert_array_equal(run.scheduler_steps[0], np.cumsum(~run.skipped[0]))
    kinds = np.array(run.tensor_kinds)
    reduced, local = run.counts[:, :, kinds == "weight"], run.counts[:, :, kinds == "weight_local"]
    np.testing.assert_array_equal(reduced[0], reduced[1])                  # all-reduced: identical
    assert not np.array_equal(local[0], local[1])                          # before the all-reduce: not
    acts = run.counts[:, :, kinds == "activation"]
    assert not np.array_equal(acts[0], acts[1])                            # each rank saw other data
    np.testing.assert_array_equal(run.skipped[0], run.skipped[1])
    assert run.skipped[0, 0] and run.skipped[0].sum() >= 2
    np.testing.assert_array_equal(run.loss_scale[0], run.loss_scale[1])
    assert cli.main(["info", str(out)]) == 0
    assert "2 ranks" in capsys.readouterr().out


def test_a_run_resumed_from_its_state_continues_where_it_stopped(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    proc = torchrun("-m", "ampviz.examples.ddp_amp", "--out", str(first), "--steps", "6", "--eval-every", "6",
                    "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = torchrun("-m", "ampviz.examples.ddp_amp", "--out", str(second), "--steps", "10", "--eval-every", "10",
                    "--resume", str(first / "state.pt"), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = ampviz.Run.load(second)
    assert run.n_steps == 4                                                # steps 6 to 9
    assert run.meta["scheduler"]["last_epoch_at_start"] == 6 - ampviz.Run.load(first).skipped[0].sum()


def test_a_hanging_rank_makes_the_survivor_time_out_with_a_clear_error(tmp_path):
    out = tmp_path / "hang"
    timeout = 30                  # also covers the ranks' start-up skew on a busy machine
    start = time.monotonic()
    proc = torchrun("-m", "ampviz.examples.ddp_amp", "--out", str(out), "--steps", "12", "--quiet",
                    "--fail-rank", "1", "--fail-step", "3", "--fail-mode", "hang", "--timeout", str(timeout),
                    timeout=270)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert "ampviz.examples.ddp_amp: error: rank 0 stopped: a collective operation failed" in err
    assert f"give up after timeout={timeout} s" in err and "Timed out" in err
    assert elapsed < 230                                                   # it stopped; it did not hang
    # the survivor saved its run on the way out; torchrun's SIGTERM made the hanging rank save its own
    assert sorted(p.name for p in out.iterdir()) == ["rank0.npz", "rank1.npz"]
    run = ampviz.Run.load(out)
    assert run.ranks == [0, 1] and run.n_steps == 3


def test_a_rank_killed_at_a_random_step_leaves_its_peers_run_and_its_own_saves(tmp_path):
    """kill -9 of rank 1 (issue 23): rank 0's all-reduce fails and torchrun sends it SIGTERM, yet rank 0
    saves every step it finished and says so; rank 1's file holds every step up to its last periodic
    save (all but the last interval); the directory loads. A different step each run."""
    step, every = random.SystemRandom().randrange(4, 15), 3
    out = tmp_path / "lr3e-4.bs16"                     # a new directory with a dot in its name
    proc = torchrun("-m", "ampviz.examples.ddp_amp", "--out", str(out), "--steps", "16", "--quiet",
                    "--fail-rank", "1", "--fail-step", str(step), "--fail-mode", "kill",
                    "--save-every-steps", str(every), timeout=270)
    seen = f"killed before step {step}; stderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode != 0, seen
    survivor, killed = (ampviz.Run.load(out / f"rank{r}.npz") for r in (0, 1))
    assert survivor.n_steps == step, seen                                  # every step it finished
    assert killed.n_steps == step - step % every, seen                     # up to its last save
    assert f"This rank's recording of {step} steps is saved in {out / 'rank0.npz'}." in proc.stderr, seen
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", AmpvizWarning)
        run = ampviz.Run.load(out)
    shorter = any("ranks recorded different numbers of steps" in str(w.message) for w in warned)
    assert shorter == (step % every != 0), seen
    assert run.ranks == [0, 1] and run.n_steps == killed.n_steps
    kinds = np.array(run.tensor_kinds)
    reduced = run.counts[:, :, kinds == "weight"]
    np.testing.assert_array_equal(reduced[0], reduced[1])                 # the same all-reduced gradients
    assert reduced.sum() > 0


def test_ddp_basics_example_under_torchrun():
    proc = torchrun("-m", "ampviz.lessons.ddp_ranks", timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    seen = f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-2000:]}"
    assert len(lines) == 2 and lines[0].startswith("rank 0 of 2") and lines[1].startswith("rank 1 of 2"), seen
    assert all(line.endswith("all_reduce(rank + 1) = 3") for line in lines), seen


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="amp: expected 'fp16', 'bf16' or 'off', got 'fp8'"):
        Config(amp="fp8")
    with pytest.raises(ValueError, match="accum: expected an integer >= 1, got 0"):
        Config(accum=0)
    with pytest.raises(ValueError, match="warmup: expected an integer >= 0, got -1"):
        Config(warmup=-1)
    with pytest.raises(ValueError, match="max_grad_norm: expected a positive number or None, got -1"):
        Config(max_grad_norm=-1)
    with pytest.raises(ValueError, match="resume: expected a state.pt .* got 'nowhere.pt', which is not a file"):
        Config(resume="nowhere.pt")
