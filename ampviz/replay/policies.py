"""Loss-scaler policies, replayed offline over a recorded trace ("what if the scaler had been ...").

Four policies: PyTorch's ``GradScaler`` (float32 growth cap), DeepSpeed's ``DynamicLossScaler`` as in
DeepSpeed 0.19.8 (hysteresis), Megatron-LM's ``DynamicGradScaler`` (hysteresis, min_scale, float32
factors) and a static scale; each is tested step for step against the real class or its source. A
replay takes a per-step trace (the largest *unscaled* gradient magnitude of each step, or plain
overflow flags) and returns the scale each step would have used and which steps would have been
skipped::

    >>> from ampviz.replay import TorchPolicy, replay
    >>> r = replay(TorchPolicy(init_scale=2.0**16, growth_interval=2), [1.0, 1e-3, 1e-3, 1e-3])
    >>> r.scale.tolist(), r.skipped.tolist()      # 1.0 * 2**16 >= 65520 overflows fp16
    ([65536.0, 32768.0, 32768.0, 65536.0], [True, False, False, False])

A replay is a counterfactual: in a real run a skipped step changes every later gradient, which a
replay over recorded gradients cannot know. Steps where the real run overflowed only tell us the
magnitude was at least ``threshold / recorded scale``; :func:`ampviz.replay.trace_from_run` uses that bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np

from ..formats import get_format

__all__ = ["TorchPolicy", "DeepSpeedPolicy", "MegatronPolicy", "StaticPolicy", "POLICIES",
           "Replay", "replay", "policy_from_scaler", "policy_fields", "SETTING_RULES"]


# every numeric setting of every policy: (test, what is valid); min_scale is checked against init_scale
SETTING_RULES = {
    "init_scale": (lambda v, p: 0 < v < math.inf, "a positive finite number"),
    "growth_factor": (lambda v, p: v > 1, "a number > 1"),
    "scale_factor": (lambda v, p: v > 1, "a number > 1"),
    "backoff_factor": (lambda v, p: 0 < v < 1, "a number in (0, 1)"),
    "growth_interval": (lambda v, p: int(v) == v and v >= 1, "an integer >= 1"),
    "scale_window": (lambda v, p: int(v) == v and v >= 1, "an integer >= 1"),
    "hysteresis": (lambda v, p: int(v) == v and v >= 1, "an integer >= 1"),
    "min_scale": (lambda v, p: 0 < v <= p.init_scale, "a number in (0, init_scale]"),
}


_F32_MAX = float(np.finfo(np.float32).max)


def _validate(policy) -> None:
    """Check every numeric field of ``policy`` against SETTING_RULES, naming the field, value and valid range."""
    for f in fields(policy):
        if f.name not in SETTING_RULES:
            continue
        value = getattr(policy, f.name)
        ok, valid = SETTING_RULES[f.name]
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not ok(value, policy):
            raise ValueError(f"{f.name}: got {value!r}; expected {valid}")


@dataclass(frozen=True)
class TorchPolicy:
    """``torch.amp.GradScaler``: back off on inf/nan, grow after ``growth_interval`` clean steps.

    As ``torch._amp_update_scale_`` does (CPU and CUDA kernels): the scale is a float32; an overflow
    multiplies it by ``backoff_factor`` and zeroes the clean-step count; the ``growth_interval``-th clean
    step in a row zeroes the count and multiplies the scale by ``growth_factor`` only if the product,
    rounded to float32, is finite; otherwise the scale stays. ``init_scale`` must fit in float32:
    GradScaler refuses a larger one ("value cannot be converted to type float without overflow").
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    name = "pytorch"

    def __post_init__(self):
        _validate(self)
        if self.init_scale > _F32_MAX:
            raise ValueError(f"init_scale: got {self.init_scale!r}; expected a positive number <= {_F32_MAX!r} "
                             f"(the float32 maximum: GradScaler keeps its scale in float32 and refuses more)")


@dataclass(frozen=True)
class DeepSpeedPolicy:
    """DeepSpeed ``DynamicLossScaler.update_scale``, as in DeepSpeed 0.19.8 (the class ZeRO stages 1-3 use).

    The scaler counts iterations from 0 (every update advances it, overflow or not) and remembers the
    last overflowing one (-1 before any). On an overflow: if ``hysteresis`` (DeepSpeed's
    ``delayed_shift``) is 1 or the hysteresis left is down to 1, the scale is divided by
    ``scale_factor``, floored at ``min_scale``; otherwise only the hysteresis left drops by one (the
    scale stays). Either way the iteration becomes the last overflow. On a clean step the scale is
    multiplied by ``scale_factor`` when ``(iteration - last_overflow) - 1`` is positive and a multiple of
    ``scale_window``, i.e. after a full window of clean steps *following* the step after the overflow
    (after steps 1000, 2000, ... from the start with the default window). The hysteresis left is
    restored to ``hysteresis`` on every clean step with ``consecutive_hysteresis``, otherwise only when
    the scale grows; it never goes below 1, so once used up every overflow backs off until then.

    With ``raise_error_at_min_scale`` an overflow that would back off while the scale already equals
    ``min_scale`` ends the run (DeepSpeed raises "Current loss scale already at minimum"): the replay
    stops there and reports the step as ``crashed_at``. Without it the scale stays at ``min_scale``.

    DeepSpeed's constructor fixes ``scale_factor`` at 2.0 and its config has no setting for it; other
    values replay a scaler whose attribute was changed. The non-ZeRO ``FP16_Optimizer`` has its own
    update with the same growth rule and no hysteresis: ``hysteresis=1, raise_error_at_min_scale=False``.
    """

    init_scale: float = 2.0 ** 16
    scale_factor: float = 2.0
    scale_window: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    raise_error_at_min_scale: bool = True
    name = "deepspeed"

    def __post_init__(self):
        _validate(self)


@dataclass(frozen=True)
class MegatronPolicy:
    """Megatron-LM ``DynamicGradScaler`` (megatron/core/optimizer/grad_scaler.py at NVIDIA/Megatron-LM
    commit a025a69a4a69abbd6b87da02744947d6187d8d40; ``update`` is the same at the older eedfe533).

    Scale, ``min_scale`` and both factors are float32 tensors, so every product is a float32 product
    of float32-rounded factors. An overflow zeroes the clean-step count and takes one off the
    hysteresis left; once that is <= 0 (it keeps falling) every overflow multiplies the scale by
    ``backoff_factor``, floored at ``min_scale``. ``growth_interval`` clean steps in a row multiply it
    by ``growth_factor`` and restore the hysteresis. Unlike GradScaler, growth is not capped: a scale
    past the float32 maximum becomes inf, and an inf scale overflows every later step.
    """

    init_scale: float = 2.0 ** 32
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    name = "megatron"

    def __post_init__(self):
        _validate(self)


@dataclass(frozen=True)
class StaticPolicy:
    """A constant loss scale; a step whose gradients overflow is skipped (the scale stays)."""

    init_scale: float = 2.0 ** 12
    name = "static"

    def __post_init__(self):
        _validate(self)


POLICIES = {p.name: p for p in (TorchPolicy, DeepSpeedPolicy, MegatronPolicy, StaticPolicy)}


Policy = TorchPolicy | DeepSpeedPolicy | MegatronPolicy | StaticPolicy      # what replay() replays


@dataclass
class Replay:
    """Result of :func:`replay`: per-step arrays plus a few summaries."""

    policy: Policy
    scale: np.ndarray          # scale used at each step
    skipped: np.ndarray        # bool: the optimizer step would have been skipped
    grown: np.ndarray          # bool: the scale grew after this step
    crashed_at: int | None = None   # DeepSpeed: step where "loss scale already at minimum" ends the run
    notes: list = field(default_factory=list)

    @property
    def n_skipped(self) -> int:
        return int(self.skipped.sum())

    @property
    def final_scale(self) -> float:
        return float(self.scale[-1]) if self.scale.size else float("nan")

    def summary(self) -> dict:
        return {"policy": self.policy.name, "steps": int(self.scale.size), "skipped": self.n_skipped,
                "min_scale": float(self.scale.min()) if self.scale.size else None,
                "max_scale": float(self.scale.max()) if self.scale.size else None,
                "final_scale": self.final_scale, "crashed_at": self.crashed_at}


def _f32(x: float) -> float:
    """Round to float32, as GradScaler stores its scale (overflow gives inf, as in torch)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def replay(policy, trace, format="fp16") -> Replay:
    """Replay ``policy`` over a per-step trace.

    Parameters
    ----------
    policy : TorchPolicy, DeepSpeedPolicy, MegatronPolicy or StaticPolicy.
    trace : 1-D sequence, either of bools (True: the step overflowed, whatever the scale; False: it
        did not at any finite scale; use this to drive a policy with a known overflow sequence) or of
        floats (largest unscaled gradient magnitude of the step; inf/nan = overflow at any scale). A
        float step overflows when ``magnitude * scale >= format.overflow_threshold`` (65520 for fp16)
        or the product is nan (a zero magnitude at an infinite scale, as Megatron's can become).
    format : format the scaled gradients are computed in (must have inf: fp16, bf16, e5m2, ...).

    Returns
    -------
    Replay
    """
    if type(policy) not in POLICIES.values():
        raise TypeError(f"policy: expected one of {', '.join(c.__name__ for c in POLICIES.values())}, "
                        f"got {type(policy).__name__}")
    fmt = get_format(format)
    if not fmt.has_inf:
        raise ValueError(f"format: {fmt.name} has no inf, so a loss scaler never sees an overflow; "
                         f"use fp16, bf16 or fp8_e5m2")
    arr = np.asarray(trace)
    if arr.ndim != 1:
        raise ValueError(f"trace: expected a 1-D sequence, got shape {arr.shape}")
    if arr.dtype == bool:
        mags = np.where(arr, np.inf, 0.0)
    elif np.issubdtype(arr.dtype, np.number):
        mags = np.where(np.isnan(arr), np.inf, np.abs(arr.astype(float)))
    else:
        raise TypeError(f"trace: expected bools or numbers, got dtype {arr.dtype}")
    step = _STEPPERS[policy.name]
    scale, skipped, grown, crashed = step(policy, mags.tolist(), fmt.overflow_threshold)
    return Replay(policy, np.asarray(scale), np.asarray(skipped, dtype=bool),
                  np.asarray(grown, dtype=bool), crashed)


def _overflows(m: float, s: float, threshold: float) -> bool:
    """Whether a step of unscaled magnitude ``m`` overflows at scale ``s``.

    A nan product counts: 0 * inf (an inf scale, Megatron's uncapped growth) and inf * 0 (a scale that
    underflowed to 0) give nan gradients in a real run, which every scaler treats as an overflow.
    """
    x = m * s
    return x >= threshold or x != x


def _torch_steps(p: TorchPolicy, mags, threshold):
    # _amp_update_scale_: scale * factor in double, rounded to float32; growth only if that is finite
    s, tracker = _f32(p.init_scale), 0
    gi, gf, bf = int(p.growth_interval), float(p.growth_factor), float(p.backoff_factor)
    scales, skipped, grown = [], [], []
    for m in mags:
        scales.append(s)
        over = _overflows(m, s, threshold)
        skipped.append(over)
        new = s
        if over:
            new, tracker = _f32(s * bf), 0
        else:
            tracker += 1
            if tracker == gi:
                candidate = _f32(s * gf)
                if math.isfinite(candidate):
                    new = candidate
                tracker = 0       # the count restarts even when the growth was refused
        grown.append(new > s)
        s = new
    return scales, skipped, grown, None


def _deepspeed_steps(p: DeepSpeedPolicy, mags, threshold):
    # DeepSpeed 0.19.8 DynamicLossScaler: cur_scale is a Python float; `it` is cur_iter
    s, hyst, last_overflow = float(p.init_scale), int(p.hysteresis), -1
    window, factor, floor = int(p.scale_window), float(p.scale_factor), float(p.min_scale)
    scales, skipped, grown, crashed = [], [], [], None
    for it, m in enumerate(mags):
        scales.append(s)
        over = _overflows(m, s, threshold)
        skipped.append(over)
        new = s
        if over:
            if p.hysteresis == 1 or hyst == 1:
                if s == floor and p.raise_error_at_min_scale:
                    # DeepSpeed raises before cur_iter or last_overflow_iter move: the run ends here
                    crashed = it
                    grown.append(False)
                    break
                new = max(s / factor, floor)
            else:
                hyst -= 1         # only reached while hyst > 1, so it never drops below 1
            last_overflow = it
        else:
            if p.consecutive_hysteresis:
                hyst = int(p.hysteresis)
            # clean steps since the step after the last overflow: the first step after an overflow
            # (and step 0) never grows, a growth needs `window` clean steps after it
            stable = it - last_overflow - 1
            if stable > 0 and stable % window == 0:
                if not p.consecutive_hysteresis:
                    hyst = int(p.hysteresis)
                new = s * factor
        grown.append(new > s)
        s = new
    return scales, skipped, grown, crashed


def _megatron_steps(p: MegatronPolicy, mags, threshold):
    # Megatron keeps scale, factors and min_scale as float32 tensors: round the factors first, then
    # every product (exact in double for two float32s) rounds once to float32, as a float32 multiply
    s, growth, hyst = _f32(p.init_scale), 0, int(p.hysteresis)
    gf, bf, floor = _f32(p.growth_factor), _f32(p.backoff_factor), _f32(p.min_scale)
    scales, skipped, grown = [], [], []
    for m in mags:
        scales.append(s)
        over = _overflows(m, s, threshold)
        skipped.append(over)
        new = s
        if over:
            growth, hyst = 0, hyst - 1
            if hyst <= 0:
                new = max(_f32(s * bf), floor)
        else:
            growth += 1
            if growth == int(p.growth_interval):
                growth, hyst = 0, int(p.hysteresis)
                new = _f32(s * gf)      # no float32 cap: may become inf
        grown.append(new > s)
        s = new
    return scales, skipped, grown, None


def _static_steps(p: StaticPolicy, mags, threshold):
    s = float(p.init_scale)
    over = [_overflows(m, s, threshold) for m in mags]
    return [s] * len(mags), over, [False] * len(mags), None


_STEPPERS: dict[str, Callable[..., tuple]] = {"pytorch": _torch_steps, "deepspeed": _deepspeed_steps,
                                              "megatron": _megatron_steps, "static": _static_steps}


def policy_from_scaler(scaler) -> TorchPolicy:
    """The TorchPolicy with a real ``torch.amp.GradScaler``'s settings (read, not assumed)."""
    return TorchPolicy(init_scale=float(scaler._init_scale),
                       growth_factor=scaler.get_growth_factor(), backoff_factor=scaler.get_backoff_factor(),
                       growth_interval=scaler.get_growth_interval())


def policy_fields(policy) -> dict:
    """The settings of a policy as a plain dict (for metadata and widgets)."""
    return {f.name: getattr(policy, f.name) for f in fields(policy)}
