"""Loss-scaler replays checked step for step against the real scalers they imitate.

- DeepSpeed: the installed ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` (0.19.8 when this
  was written), driven with many seeded random overflow sequences. ``update_scale`` calls
  ``deepspeed.comm.get_rank()`` on every overflow (and on every clean step with consecutive_hysteresis),
  which asserts that a DeepSpeed backend is initialised, so a module-scoped fixture starts a one-rank
  gloo group. On a fresh machine DeepSpeed JIT-builds its CPU shared-memory comm op the first time
  (about 40 s, cached under ``~/.cache/torch_extensions`` afterwards).
- Megatron-LM cannot be installed here (it needs CUDA); its ``DynamicGradScaler.update`` is restated
  below from megatron/core/optimizer/grad_scaler.py at NVIDIA/Megatron-LM commit
  a025a69a4a69abbd6b87da02744947d6187d8d40 (the last commit touching that file in the snapshot read),
  with float32 CPU tensors where Megatron uses float32 CUDA tensors.
- PyTorch: a real ``torch.amp.GradScaler("cpu")`` near the top of the float32 range, where
  ``_amp_update_scale_`` refuses a growth whose result is not finite in float32.
"""

import math
import socket
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from ampviz.replay import DeepSpeedPolicy, MegatronPolicy, TorchPolicy, replay


def _sticky_flags(rng, n, rate, stick):
    """``n`` overflow flags: each step overflows with ``rate``, or with ``stick`` right after an overflow
    (bursts of consecutive overflows are what hysteresis is for)."""
    flags = np.zeros(n, dtype=bool)
    draws = rng.random(n)
    for i in range(n):
        flags[i] = draws[i] < (stick if i and flags[i - 1] else rate)
    return flags


@dataclass
class Case:
    """One random DeepSpeed setting and overflow sequence."""

    policy: DeepSpeedPolicy
    flags: np.ndarray

    @property
    def id(self):
        p = self.policy
        return (f"h{p.hysteresis}-{'cons' if p.consecutive_hysteresis else 'plain'}-w{p.scale_window}"
                f"-f{p.scale_factor:g}-init2^{math.log2(p.init_scale):.1f}-min{p.min_scale:g}"
                f"-{'raise' if p.raise_error_at_min_scale else 'floor'}-{int(self.flags.sum())}of{self.flags.size}")


def deepspeed_cases(n=50, steps=300, seed=20250811):
    """``n`` seeded random (policy, flags) pairs covering hysteresis 1/2/3, consecutive_hysteresis on and
    off, small scale windows, low to very high overflow rates, both min_scale behaviours."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(n):
        hysteresis = (1, 2, 3)[i % 3]
        consecutive = bool((i // 3) % 2)
        init = float(rng.choice([1.0, 4.0, 2.0 ** 8, 2.0 ** 16, 1000.0, 3.0 * 2.0 ** 10]))
        min_scale = [1, 0.25, 2.0 ** -6, 0.3][rng.integers(4)]   # DeepSpeed's config gives an int (1)
        min_scale = min_scale if min_scale <= init else 1
        # DeepSpeed's constructor fixes scale_factor at 2.0; update_scale reads the attribute, so other
        # values are driven by setting it (a few cases, to check the replay uses the factor throughout)
        factor = 2.0 if i % 7 else float(rng.choice([3.0, 4.0]))
        policy = DeepSpeedPolicy(init_scale=init, scale_factor=factor,
                                 scale_window=int(rng.choice([1, 2, 3, 4, 5, 8, 13])), min_scale=min_scale,
                                 hysteresis=hysteresis, consecutive_hysteresis=consecutive,
                                 raise_error_at_min_scale=bool(rng.random() < 0.5))
        rate = float(rng.choice([0.02, 0.05, 0.1, 0.2, 0.35, 0.6]))
        stick = float(rng.choice([rate, 0.5, 0.8]))
        cases.append(Case(policy, _sticky_flags(rng, steps, rate, stick)))
    return cases


CASES = deepspeed_cases()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deepspeed_loss_scaler():
    """The real DynamicLossScaler class, with the one-rank gloo group its update_scale needs."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed: the DeepSpeed replay cannot be "
                                            "checked against the real DynamicLossScaler")
    import deepspeed
    import torch.distributed as tdist
    from deepspeed import comm
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel("WARNING")          # update_scale logs every overflow at INFO
    owned = not tdist.is_initialized()  # a group another test started is reused and left alone
    with pytest.MonkeyPatch.context() as mp:
        if owned:
            for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                               "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
                mp.setenv(key, value)
        deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
        try:
            yield DynamicLossScaler
        finally:
            if owned:
                comm.destroy_process_group()
            logger.setLevel(level)


def real_deepspeed_trace(scaler_cls, policy: DeepSpeedPolicy, flags):
    """Drive a real DynamicLossScaler with ``flags``; return (scale used at each step, grown, crashed_at).

    The run stops where update_scale raises "Current loss scale already at minimum", as a DeepSpeed
    run does; that step is included (it used its scale and was skipped).
    """
    ds = scaler_cls(init_scale=policy.init_scale, scale_window=policy.scale_window, min_scale=policy.min_scale,
                    delayed_shift=policy.hysteresis, consecutive_hysteresis=policy.consecutive_hysteresis,
                    raise_error_at_min_scale=policy.raise_error_at_min_scale)
    ds.scale_factor = policy.scale_factor
    scales, grown, crashed = [], [], None
    for it, overflow in enumerate(flags):
        before = ds.cur_scale
        scales.append(float(before))
        try:
            ds.update_scale(bool(overflow))
        except Exception as e:          # DeepSpeed raises a bare Exception here
            if "already at minimum" not in str(e):
                raise
            grown.append(False)
            crashed = it
            break
        grown.append(ds.cur_scale > before)
    return np.array(scales), np.array(grown), crashed


def _first_difference(a, b):
    diff = np.flatnonzero(np.asarray(a) != np.asarray(b))
    return int(diff[0]) if diff.size else None


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_deepspeed_replay_matches_real_dynamic_loss_scaler(case, deepspeed_loss_scaler):
    scales, grown, crashed = real_deepspeed_trace(deepspeed_loss_scaler, case.policy, case.flags)
    r = replay(case.policy, case.flags)
    assert r.crashed_at == crashed
    assert r.scale.size == scales.size, f"replay ran {r.scale.size} steps, DeepSpeed {scales.size}"
    i = _first_difference(r.scale, scales)
    assert i is None, (f"step {i}: replay scale {r.scale[i]}, DeepSpeed {scales[i]}; "
                       f"flags up to there {case.flags[max(0, i - 8):i + 1].astype(int).tolist()}")
    np.testing.assert_array_equal(r.skipped, case.flags[:scales.size])   # DeepSpeed skips every overflow
    np.testing.assert_array_equal(r.grown, grown)


def test_the_cases_exercise_growth_hysteresis_and_the_floor(deepspeed_loss_scaler):
    """The random cases are only evidence if they reach every branch of update_scale."""
    runs = [real_deepspeed_trace(deepspeed_loss_scaler, c.policy, c.flags) for c in CASES]
    assert sum(g.sum() for _, g, _ in runs) > 100
    assert sum(crashed is not None for _, _, crashed in runs) >= 5
    assert sum(crashed is None and c.policy.min_scale in s for c, (s, _, crashed) in zip(CASES, runs)) >= 5
    # an overflow that only used up hysteresis: the scale stayed although the step overflowed
    held = [c for c, (s, _, _) in zip(CASES, runs) if c.policy.hysteresis > 1
            and np.any(c.flags[:s.size - 1] & (s[1:] == s[:-1]) & (s[:-1] > c.policy.min_scale))]
    assert len(held) >= 10


def test_deepspeed_grows_one_step_after_a_full_window(deepspeed_loss_scaler):
    # stable_interval = (iteration - last_overflow) - 1: with no overflow yet (last_overflow = -1) the
    # scale grows after steps 3, 6, ... for scale_window 3 (a window of clean steps *after* step 0)
    p = DeepSpeedPolicy(init_scale=8.0, scale_window=3, hysteresis=1)
    flags = [False] * 7
    scales, _, _ = real_deepspeed_trace(deepspeed_loss_scaler, p, flags)
    assert scales.tolist() == [8, 8, 8, 8, 16, 16, 16]
    assert replay(p, flags).scale.tolist() == scales.tolist()


# ---------------------------------------------------------------------------------------------- Megatron
class MegatronOracle:
    """Megatron-LM ``DynamicGradScaler`` restated (megatron/core/optimizer/grad_scaler.py at commit
    a025a69a4a69abbd6b87da02744947d6187d8d40): scale, min_scale and both factors are one-element float32
    tensors; an overflow zeroes the growth tracker and decrements the hysteresis tracker, backing off
    (floored at min_scale) once it is <= 0; ``growth_interval`` clean steps in a row reset both trackers
    and multiply the scale by growth_factor, with no float32 cap."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        f32 = dict(dtype=torch.float32)
        self.scale = torch.tensor([initial_scale], **f32)
        self.min_scale = torch.tensor([min_scale], **f32)
        self.growth_factor = torch.tensor([growth_factor], **f32)
        self.backoff_factor = torch.tensor([backoff_factor], **f32)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = torch.max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis
            self.scale = self.scale * self.growth_factor


def megatron_oracle_trace(policy: MegatronPolicy, flags):
    """Scale used at each step and skipped flags; found_inf comes from the scaled gradient (0 for a clean
    step, inf for an overflowing one) being non-finite, as in a real run (an inf scale overflows all)."""
    m = MegatronOracle(policy.init_scale, policy.min_scale, policy.growth_factor, policy.backoff_factor,
                       policy.growth_interval, policy.hysteresis)
    scales, skipped = [], []
    for overflow in flags:
        scales.append(m.scale.item())
        grad = torch.tensor([math.inf if overflow else 0.0])
        found_inf = not bool(torch.isfinite(grad * m.scale).all())
        skipped.append(found_inf)
        m.update(found_inf)
    return np.array(scales), np.array(skipped)


MEGATRON_SETTINGS = [
    dict(init_scale=2.0 ** 32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
         hysteresis=2),
    dict(init_scale=1000.0, min_scale=0.3, growth_factor=1.7, backoff_factor=0.3, growth_interval=2,
         hysteresis=1),
    dict(init_scale=3.0, min_scale=1.1, growth_factor=1.1, backoff_factor=0.9, growth_interval=1, hysteresis=3),
    dict(init_scale=2.0 ** 100, min_scale=2.0 ** 90, growth_factor=2.0 ** 5, backoff_factor=0.7,
         growth_interval=1, hysteresis=2),      # grows past float32: Megatron's scale becomes inf
]


@pytest.mark.parametrize("settings", MEGATRON_SETTINGS,
                         ids=lambda s: f"g{s['growth_factor']:g}-b{s['backoff_factor']:g}")
@pytest.mark.parametrize("rate", [0.05, 0.3, 0.7])
def test_megatron_replay_matches_its_update_rule(settings, rate):
    flags = _sticky_flags(np.random.default_rng(int(rate * 100)), 300, rate, 0.6)
    p = MegatronPolicy(**settings)
    scales, skipped = megatron_oracle_trace(p, flags)
    r = replay(p, flags)
    i = _first_difference(r.scale, scales)
    assert i is None, f"step {i}: replay scale {r.scale[i]!r}, Megatron {scales[i]!r}"
    np.testing.assert_array_equal(r.skipped, skipped)


def test_megatron_factors_are_float32():
    # 0.3 and 1.7 are not float32 numbers: Megatron multiplies by float32(0.3), whose product with the
    # scale can round to another float32 than 0.3 (a double) would
    p = MegatronPolicy(init_scale=1000.0, min_scale=0.3, growth_factor=1.7, backoff_factor=0.3,
                       growth_interval=2, hysteresis=1)
    flags = [True] * 12 + [False] * 6
    assert replay(p, flags).scale.tolist() == megatron_oracle_trace(p, flags)[0].tolist()


# ----------------------------------------------------------------------------------------------- PyTorch
def real_gradscaler_after_update(flags, tiny=2.0 ** -120, **kw):
    """Drive a real torch.amp.GradScaler("cpu"); return the scale after each update and the skipped flags.

    Clean steps have a finite tiny gradient (``tiny``, scaled by up to 2**128 it stays finite in float32),
    overflowing steps an infinite one.
    """
    scaler = torch.amp.GradScaler("cpu", **kw)
    p = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    after, skipped = [], []
    for overflow in flags:
        before = p.detach().clone()
        loss = p.sum() * (math.inf if overflow else tiny) + 1.0
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        after.append(scaler.get_scale())
        skipped.append(torch.equal(before, p.detach()))
    return np.array(after), np.array(skipped)


@pytest.mark.parametrize("kw, top", [
    (dict(init_scale=2.0 ** 100, growth_factor=2.0 ** 10, growth_interval=1), 2.0 ** 120),
    (dict(init_scale=2.0 ** 127, growth_factor=2.0 ** 10, growth_interval=1), 2.0 ** 127),
    (dict(init_scale=1.5 * 2.0 ** 126, growth_factor=1.5, growth_interval=1), 1.6875 * 2.0 ** 127),
    (dict(init_scale=2.0 ** 120, growth_factor=3.0, backoff_factor=0.3, growth_interval=2), None),
    (dict(init_scale=float(np.finfo(np.float32).max), growth_factor=1.0001, growth_interval=1), None),
], ids=["2^100x2^10", "2^127x2^10", "1.5x2^126x1.5", "2^120x3-backoff0.3", "f32max"])
@pytest.mark.parametrize("rate", [0.0, 0.1, 0.4])
def test_torch_replay_matches_real_gradscaler_at_the_float32_cap(kw, top, rate):
    flags = np.random.default_rng(7 + int(rate * 10)).random(120) < rate
    after, skipped = real_gradscaler_after_update(flags, **kw)
    assert np.all(np.isfinite(after)), "GradScaler must never grow its scale to inf"
    # the scale after update k is the scale step k + 1 uses: one more (clean) step shows the last one
    r = replay(TorchPolicy(**kw), np.append(flags, False))
    np.testing.assert_array_equal(r.scale[1:], after)
    np.testing.assert_array_equal(r.skipped[:-1], skipped)
    assert skipped.tolist() == flags.tolist()
    if top is not None and rate == 0.0:
        assert after.max() == top and r.scale.max() == top       # the capped growth was refused, not clipped
        assert not r.grown[5:].any()


def test_torch_policy_refuses_an_init_scale_gradscaler_refuses():
    big = float(np.nextafter(float(np.finfo(np.float32).max), math.inf))    # the next double above
    with pytest.raises(RuntimeError, match="cannot be converted to type float without overflow"):
        real_gradscaler_after_update([False], init_scale=big)
    with pytest.raises(ValueError, match=r"init_scale: got 3\.4028234663852\d+e\+38; expected .*float32"):
        TorchPolicy(init_scale=big)
    TorchPolicy(init_scale=float(np.finfo(np.float32).max))     # the largest float32 is fine

