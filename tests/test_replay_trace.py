"""trace_from_run: replaying a real run's own GradScaler settings over its trace reproduces the run."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz
from ampviz import histogram as H
from ampviz.replay import TRACE_RULES, TorchPolicy, policy_from_run, replay, trace_from_run
from ampviz.run import Run


def record_fp16_run(steps=60, every=1, init_scale=2.0 ** 24, growth_interval=3, seed=0):
    """A real fp16-autocast training whose scaler overflows often (a too-high scale, fast growth)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    g = torch.Generator().manual_seed(seed + 1)
    rec = ampviz.Recorder(model, opt, scaler=scaler, every=every)
    with rec:
        for _ in range(steps):
            x, y = torch.randn(16, 12, generator=g) * 4, torch.randint(0, 5, (16,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y, reduction="sum")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            rec.step(loss)
    return rec.run


@pytest.mark.parametrize("every", [1, 3])
def test_replaying_the_recorded_policy_reproduces_the_real_run(every):
    run = record_fp16_run(every=every)
    assert run.skipped.sum() >= 5 and run.grown.sum() >= 3           # the run really backs off and grows
    trace, rules = trace_from_run(run, "fp16", return_rules=True)
    assert trace.shape == (run.n_steps,)
    if every > 1:
        assert (rules == TRACE_RULES.index("filled")).any()
    r = replay(policy_from_run(run), trace)
    np.testing.assert_array_equal(r.scale, run.loss_scale[0])
    np.testing.assert_array_equal(r.skipped, run.skipped[0])
    np.testing.assert_array_equal(r.grown, run.grown[0])


def synthetic_run(loss=(1.0, 1.0, 1.0, 1.0, 1.0, np.inf)):
    """6 steps, histograms at steps 0, 2, 4 (every=2); step 3 skipped; step 2's gradients hold a nan."""
    log2s = np.array([10, 10, 10, 10, 9, 9], dtype=float)
    counts = np.zeros((1, 3, 2, H.NBINS), dtype=np.int64)
    counts[0, 0, 0, H.column(-8)] = 5                 # weight, unscaled: max in (2^-8, 2^-7]
    counts[0, 0, 1, H.column(-20 + 10)] = 7           # activation, scaled by 2^10: unscaled (2^-20, 2^-19]
    counts[0, 1, 0, H.column(-12)] = 1
    counts[0, 1, 0, H.NAN] = 1
    counts[0, 2, 1, H.column(-3 + 9)] = 2             # activation at scale 2^9: unscaled (2^-3, 2^-2]
    scale = np.exp2(log2s)[None]
    nxt = np.exp2([[10, 10, 10, 9, 9, 9]])
    return Run(np.arange(6), np.array([loss], dtype=float), scale, nxt, nxt < scale, np.array([0, 2, 4]),
               counts, ["w", "a"], ["weight", "activation"], ["torch.float32", "torch.float16"],
               {"ranks": [0], "every": 2, "domains": {"weight": "unscaled", "activation": "scaled"},
                "scaler": {"init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                           "growth_interval": 100}})


def test_each_rule_of_the_trace():
    run = synthetic_run()
    trace, rules = trace_from_run(run, "fp16", return_rules=True)
    bound = lambda step: 65520.0 / run.loss_scale[0, step]      # noqa: E731
    assert trace[0] == 2.0 ** -8 and TRACE_RULES[rules[0]] == "recorded"
    assert trace[1] == 2.0 ** -8 and TRACE_RULES[rules[1]] == "filled"        # from step 0, below the bound
    assert trace[2] == bound(2) and TRACE_RULES[rules[2]] == "overflow bound"  # nan in the gradients
    assert trace[3] == bound(3) and TRACE_RULES[rules[3]] == "overflow bound"  # skipped, no histogram
    assert trace[4] == 2.0 ** -3 and TRACE_RULES[rules[4]] == "recorded"       # activation, unscaled
    assert math.isinf(trace[5]) and TRACE_RULES[rules[5]] == "non-finite loss"
    only_a = trace_from_run(run, tensors=["a"])
    assert only_a[0] == 2.0 ** -20


def test_filled_steps_stay_below_the_recorded_overflow_bound():
    run = synthetic_run()
    run.counts[0, 0, 0] = 0
    run.counts[0, 0, 0, H.column(7)] = 1               # 2^7 * 2^10 would overflow, yet step 1 did not skip
    trace = trace_from_run(run)
    assert trace[0] == 2.0 ** 7                        # recorded as is (the real run would have skipped)
    assert trace[1] < 65520.0 / 1024 and trace[1] == np.nextafter(65520.0 / 1024, 0)


def test_nan_losses_mean_not_given_only_when_no_loss_was_given():
    nan = float("nan")
    assert np.isfinite(trace_from_run(synthetic_run(loss=[nan] * 6))[[0, 1, 4]]).all()
    assert math.isinf(trace_from_run(synthetic_run(loss=[1.0, nan, 1.0, 1.0, 1.0, 1.0]))[1])


def test_policy_from_run_and_errors():
    assert policy_from_run(synthetic_run()) == TorchPolicy(init_scale=1024.0, growth_interval=100)
    run = synthetic_run()
    run.meta["scaler"] = None
    with pytest.raises(ValueError, match="recorded without a GradScaler"):
        policy_from_run(run)
    with pytest.raises(TypeError, match="run: expected an ampviz.Run"):
        trace_from_run(np.zeros(3))
    with pytest.raises(KeyError, match="tensor: no tensor named 'x'"):
        trace_from_run(run, tensors=["x"])
    with pytest.raises(KeyError, match="rank: 3 not in this run"):
        trace_from_run(run, rank=3)
    with pytest.raises(ValueError, match="tensors: the selection is empty"):
        trace_from_run(run, tensors=[])


def test_forward_outputs_are_not_gradients_for_the_trace_or_the_domains():
    """An "output" row (a forward activation) never carries the loss scale and is no gradient: the trace
    ignores it by default, and both domains show it as recorded."""
    steps, scale = 3, 2.0 ** 10
    counts = np.zeros((1, steps, 2, H.NBINS), dtype=np.int64)
    counts[0, :, 0, H.column(-20)] = 5           # a weight gradient near 2**-20 (unscaled)
    counts[0, :, 1, H.column(12)] = 7            # forward outputs near 2**12: far larger than any gradient
    meta = {"ranks": [0], "domains": {"weight": "unscaled", "output": "unscaled"},
            "scaler": {"init_scale": scale, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}}
    run = Run(np.arange(steps), np.ones((1, steps)), np.full((1, steps), scale), np.full((1, steps), scale),
              np.zeros((1, steps), bool), np.arange(steps), counts, ["fc.weight", "fc"], ["weight", "output"],
              ["torch.float32", "torch.float16"], meta)
    assert np.all(trace_from_run(run) == 2.0 ** -20)
    for domain in ("unscaled", "scaled"):
        np.testing.assert_array_equal(run.tensor_counts("fc", domain), counts[0, :, 1])
    assert run.fate_in("fp16", "scaled").overflow[0, :, 1].sum() == 0     # 2**13 < 65504: not shifted by 2**10
