"""Replays: loss-scaler policies run offline over a recorded run's gradient trace ("what if the scaler had been ...").

Two halves of one idea: :mod:`~ampviz.replay.policies` holds the policies (PyTorch's GradScaler, DeepSpeed's and
Megatron-LM's hysteresis scalers, a static scale) and :func:`replay`; :mod:`~ampviz.replay.trace` turns a recorded
:class:`ampviz.Run` into the per-step trace they replay::

    from ampviz.replay import TorchPolicy, replay, trace_from_run, policy_from_run
    trace = trace_from_run(run, "fp16")              # (steps,) largest unscaled |gradient| per step
    same = replay(policy_from_run(run), trace)       # reproduces the recorded scale trace
    what_if = replay(TorchPolicy(init_scale=2.0**10, growth_interval=50), trace)

A replay is a counterfactual: a skipped step changes every later gradient in a real run, which a replay over
recorded gradients cannot know. (``ampviz.scaler`` and ``ampviz.gradient_trace``, the old names of the two
halves, still import.)
"""

from .policies import (
    POLICIES,
    SETTING_RULES,
    DeepSpeedPolicy,
    MegatronPolicy,
    Replay,
    StaticPolicy,
    TorchPolicy,
    policy_fields,
    policy_from_scaler,
    replay,
)
from .trace import TRACE_RULES, policy_from_run, trace_from_run

__all__ = ["TorchPolicy", "DeepSpeedPolicy", "MegatronPolicy", "StaticPolicy", "POLICIES", "Replay", "replay",
           "policy_from_scaler", "policy_fields", "trace_from_run", "policy_from_run", "TRACE_RULES",
           "SETTING_RULES"]
