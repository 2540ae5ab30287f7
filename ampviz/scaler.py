"""Loss-scaler policies, replayed offline over a recorded trace ("what if the scaler had been ...").

Four policies: PyTorch's ``GradScaler``, DeepSpeed's ``DynamicLossScaler`` (hysteresis), Megatron-LM's
``DynamicGradScaler`` (hysteresis, min_scale) and a static scale. A replay takes a per-step trace
(the largest *unscaled* gradient magnitude of each step, or plain overflow flags) and returns the
scale each step would have used and which steps would have been skipped::

    >>> from ampviz.scaler import TorchPolicy, replay
    >>> r = replay(TorchPolicy(init_scale=2.0**16, growth_interval=2), [1.0, 1e-3, 1e-3, 1e-3])
    >>> r.scale.tolist(), r.skipped.tolist()      # 1.0 * 2**16 >= 65520 overflows fp16
    ([65536.0, 32768.0, 32768.0, 65536.0], [True, False, False, False])

A replay is a counterfactual: in a real run a skipped step changes every later gradient, which a
replay over recorded gradients cannot know. Steps where the real run overflowed only tell us the
magnitude was at least ``threshold / recorded scale``; :func:`ampviz.trace.trace_from_run` uses that bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from .formats import get_format

__all__ = ["TorchPolicy", "DeepSpeedPolicy", "MegatronPolicy", "StaticPolicy", "POLICIES",
           "Replay", "replay", "policy_from_scaler", "policy_fields"]


# every numeric setting of every policy: (test, what is valid); min_scale is checked against init_scale
_RULES = {
    "init_scale": (lambda v, p: 0 < v < math.inf, "a positive finite number"),
    "growth_factor": (lambda v, p: v > 1, "a number > 1"),
    "scale_factor": (lambda v, p: v > 1, "a number > 1"),
    "backoff_factor": (lambda v, p: 0 < v < 1, "a number in (0, 1)"),
    "growth_interval": (lambda v, p: int(v) == v and v >= 1, "an integer >= 1"),
    "scale_window": (lambda v, p: int(v) == v and v >= 1, "an integer >= 1"),
    "hysteresis": (lambda v, p: int(v) == v and v >= 1, "an integer >= 1"),
    "min_scale": (lambda v, p: 0 < v <= p.init_scale, "a number in (0, init_scale]"),
}


def _validate(policy) -> None:
    """Check every numeric field of ``policy`` against _RULES, naming the field, value and valid range."""
    for f in fields(policy):
        if f.name not in _RULES:
            continue
        value = getattr(policy, f.name)
        ok, valid = _RULES[f.name]
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not ok(value, policy):
            raise ValueError(f"{f.name}: got {value!r}; expected {valid}")


@dataclass(frozen=True)
class TorchPolicy:
    """``torch.amp.GradScaler``: back off on inf/nan, grow after ``growth_interval`` clean steps."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    name = "pytorch"

    def __post_init__(self):
        _validate(self)


@dataclass(frozen=True)
class DeepSpeedPolicy:
    """DeepSpeed ``DynamicLossScaler``: divide by ``scale_factor`` after ``hysteresis`` overflows.

    ``hysteresis`` is DeepSpeed's ``delayed_shift``; with ``consecutive_hysteresis`` a clean step
    restores it. Growth happens when ``(step - last_overflow) % scale_window == 0``. With
    ``raise_error_at_min_scale`` an overflow at ``min_scale`` ends the run, as DeepSpeed does
    ("Current loss scale already at minimum").
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
    """Megatron-LM ``DynamicGradScaler``: back off after ``hysteresis`` overflows, never below min_scale."""

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


@dataclass
class Replay:
    """Result of :func:`replay`: per-step arrays plus a few summaries."""

    policy: object
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
    trace : 1-D sequence, either of bools (the step overflowed, whatever the scale: use this to
        drive a policy with a known overflow sequence) or of floats (largest unscaled gradient
        magnitude of the step; inf/nan = overflow at any scale). A float step overflows when
        ``magnitude * scale >= format.overflow_threshold`` (65520 for fp16).
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


def _torch_steps(p: TorchPolicy, mags, threshold):
    s, tracker = _f32(p.init_scale), 0
    gi, gf, bf = int(p.growth_interval), float(p.growth_factor), float(p.backoff_factor)
    scales, skipped, grown = [], [], []
    for m in mags:
        scales.append(s)
        over = m * s >= threshold
        skipped.append(over)
        g = False
        if over:
            s, tracker = _f32(s * bf), 0
        else:
            tracker += 1
            if tracker == gi:
                new = _f32(s * gf)
                if new != math.inf:
                    s, g = new, True
                tracker = 0
        grown.append(g)
    return scales, skipped, grown, None


def _deepspeed_steps(p: DeepSpeedPolicy, mags, threshold):
    s, hyst, last_overflow = float(p.init_scale), int(p.hysteresis), -1
    scales, skipped, grown, crashed = [], [], [], None
    for it, m in enumerate(mags):
        scales.append(s)
        over = m * s >= threshold
        skipped.append(over)
        g = False
        if over:
            if p.hysteresis == 1 or hyst == 1:
                if s == p.min_scale and p.raise_error_at_min_scale:
                    crashed = it
                    grown.append(False)
                    break
                s = max(s / p.scale_factor, p.min_scale)
            else:
                hyst -= 1
            last_overflow = it
        else:
            if p.consecutive_hysteresis:
                hyst = int(p.hysteresis)
            if (it - last_overflow) % int(p.scale_window) == 0:
                if not p.consecutive_hysteresis:
                    hyst = int(p.hysteresis)
                s, g = s * p.scale_factor, True
        grown.append(g)
    return scales, skipped, grown, crashed


def _megatron_steps(p: MegatronPolicy, mags, threshold):
    s, growth, hyst = _f32(p.init_scale), 0, int(p.hysteresis)
    scales, skipped, grown = [], [], []
    for m in mags:
        scales.append(s)
        over = m * s >= threshold
        skipped.append(over)
        g = False
        if over:
            growth, hyst = 0, hyst - 1
            if hyst <= 0:
                s = max(_f32(s * p.backoff_factor), _f32(p.min_scale))
        else:
            growth += 1
            if growth == int(p.growth_interval):
                growth, hyst = 0, int(p.hysteresis)
                s, g = _f32(s * p.growth_factor), True
        grown.append(g)
    return scales, skipped, grown, None


def _static_steps(p: StaticPolicy, mags, threshold):
    s = float(p.init_scale)
    over = [m * s >= threshold for m in mags]
    return [s] * len(mags), over, [False] * len(mags), None


_STEPPERS = {"pytorch": _torch_steps, "deepspeed": _deepspeed_steps, "megatron": _megatron_steps,
             "static": _static_steps}


def policy_from_scaler(scaler) -> TorchPolicy:
    """The TorchPolicy with a real ``torch.amp.GradScaler``'s settings (read, not assumed)."""
    return TorchPolicy(init_scale=float(scaler._init_scale),
                       growth_factor=scaler.get_growth_factor(), backoff_factor=scaler.get_backoff_factor(),
                       growth_interval=scaler.get_growth_interval())


def policy_fields(policy) -> dict:
    """The settings of a policy as a plain dict (for metadata and widgets)."""
    return {f.name: getattr(policy, f.name) for f in fields(policy)}
