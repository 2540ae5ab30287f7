"""Loss-scaler replays against torch's own GradScaler and hand-worked hysteresis sequences."""

import math

import numpy as np
import pytest
import torch

from ampviz.replay import DeepSpeedPolicy, MegatronPolicy, StaticPolicy, TorchPolicy, policy_from_scaler, replay


def real_gradscaler_trace(flags, **kw):
    """Drive a real torch.amp.GradScaler with a known overflow sequence; return scales and skips."""
    scaler = torch.amp.GradScaler("cpu", **kw)
    p = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    scales, skipped = [], []
    for overflow in flags:
        scales.append(scaler.get_scale())
        before = p.detach().clone()
        loss = p.sum() * (math.inf if overflow else 1.0) + 1.0
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(torch.equal(before, p.detach()))
    return np.array(scales), np.array(skipped)


@pytest.mark.parametrize("kw", [
    {},
    {"init_scale": 2.0 ** 10, "growth_interval": 3},
    {"init_scale": 1000.0, "growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 2},
    {"init_scale": 2.0 ** 126, "growth_interval": 1},       # growth would overflow float32: scale must stay finite
])
def test_torch_replay_matches_real_gradscaler_step_for_step(kw, rng):
    flags = rng.random(400) < 0.15
    flags[:3] = [True, True, False]
    real_scales, real_skipped = real_gradscaler_trace(flags, **kw)
    r = replay(TorchPolicy(**kw), flags)
    np.testing.assert_array_equal(r.scale, real_scales)
    np.testing.assert_array_equal(r.skipped, real_skipped)
    assert r.n_skipped == flags.sum()


def test_policy_from_scaler_reads_a_real_scaler():
    s = torch.amp.GradScaler("cpu", init_scale=512.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    assert policy_from_scaler(s) == TorchPolicy(512.0, 3.0, 0.25, 7)
    d = policy_from_scaler(torch.amp.GradScaler("cpu"))
    assert (d.init_scale, d.growth_factor, d.backoff_factor, d.growth_interval) == (65536.0, 2.0, 0.5, 2000)


def test_magnitude_trace_overflows_at_the_fp16_threshold():
    # unscaled max 1.0 at scale 2**16 -> 65536 >= 65520: overflow; 0.999 * 2**16 = 65470.5 < 65520
    r = replay(TorchPolicy(init_scale=2.0 ** 16, growth_interval=100), [1.0, 0.999, 0.999])
    assert r.skipped.tolist() == [True, False, False]
    assert r.scale.tolist() == [65536.0, 32768.0, 32768.0]
    assert replay(StaticPolicy(2.0 ** 4), [math.nan, 1.0]).skipped.tolist() == [True, False]
    assert replay(TorchPolicy(), [1e-3] * 5, format="bf16").n_skipped == 0


def test_deepspeed_hysteresis_by_hand():
    # checked against DeepSpeed 0.19.8's DynamicLossScaler (tests/test_replay_peers.py drives the real class)
    p = DeepSpeedPolicy(init_scale=1024.0, scale_factor=2.0, scale_window=3, min_scale=1.0, hysteresis=2)
    flags = [True, True, False, False, False, False, True, False]
    r = replay(p, flags)
    # 1st overflow only uses up hysteresis; 2nd halves; growth when (it - last_overflow) - 1 is a positive
    # multiple of 3: after step 5 (last overflow at 1), which also restores hysteresis, so the overflow at
    # step 6 only uses it up again
    assert r.scale.tolist() == [1024, 1024, 512, 512, 512, 512, 1024, 1024]
    assert r.skipped.tolist() == flags
    assert r.grown.tolist() == [False] * 5 + [True, False, False]
    # without the growth the hysteresis stays used up: the overflow at step 5 halves again
    assert replay(p, [True, True, False, False, False, True, False]).scale.tolist() == \
        [1024, 1024, 512, 512, 512, 512, 256]


def test_deepspeed_consecutive_hysteresis_and_min_scale_crash():
    p = DeepSpeedPolicy(init_scale=4.0, scale_window=1000, min_scale=1.0, hysteresis=2, consecutive_hysteresis=True)
    # with consecutive_hysteresis a clean step restores hysteresis: isolated overflows never back off
    assert replay(p, [True, False, True, False]).scale.tolist() == [4, 4, 4, 4]
    q = DeepSpeedPolicy(init_scale=2.0, min_scale=1.0, hysteresis=1)
    r = replay(q, [True, True, True, False])
    assert r.scale.tolist() == [2.0, 1.0] and r.crashed_at == 1     # "already at minimum"


def test_megatron_hysteresis_and_floor_by_hand():
    p = MegatronPolicy(init_scale=8.0, min_scale=2.0, growth_interval=2, hysteresis=2)
    flags = [True, True, True, True, False, False, False]
    r = replay(p, flags)
    # hysteresis 2: 1st overflow waits, then every overflow backs off (tracker <= 0), floored at 2
    assert r.scale.tolist() == [8, 8, 4, 2, 2, 2, 4]
    assert r.grown.tolist() == [False] * 5 + [True, False]


def test_static_policy_keeps_its_scale():
    r = replay(StaticPolicy(4096.0), [1.0, 100.0, 1e-3])
    assert r.scale.tolist() == [4096.0] * 3 and r.skipped.tolist() == [False, True, False]


def test_bad_inputs():
    with pytest.raises(ValueError, match="growth_factor: got 0.5; expected a number > 1"):
        TorchPolicy(growth_factor=0.5)
    with pytest.raises(ValueError, match="growth_interval: got 2.5"):
        TorchPolicy(growth_interval=2.5)
    with pytest.raises(ValueError, match="backoff_factor"):
        MegatronPolicy(backoff_factor=1.0)
    with pytest.raises(ValueError, match="min_scale"):
        DeepSpeedPolicy(init_scale=1.0, min_scale=2.0)
    with pytest.raises(TypeError, match="policy: expected one of"):
        replay("pytorch", [True])
    with pytest.raises(ValueError, match="format: fp8_e4m3fn has no inf"):
        replay(TorchPolicy(), [1.0], format="fp8_e4m3fn")
    with pytest.raises(ValueError, match="trace: expected a 1-D sequence"):
        replay(TorchPolicy(), [[1.0]])
    with pytest.raises(TypeError, match="trace: expected bools or numbers"):
        replay(TorchPolicy(), ["a"])


def test_the_old_module_names_still_import():
    import ampviz.gradient_trace
    import ampviz.replay
    import ampviz.scaler
    assert ampviz.scaler.TorchPolicy is ampviz.replay.TorchPolicy and ampviz.scaler.replay is ampviz.replay.replay
    assert ampviz.gradient_trace.trace_from_run is ampviz.replay.trace_from_run
