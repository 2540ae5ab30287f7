"""Per-step gradient maxima of a recorded Run: the trace that :func:`ampviz.replay.replay` replays.

    import ampviz
    from ampviz.replay import TorchPolicy, replay, trace_from_run, policy_from_run
    trace = trace_from_run(run, "fp16")              # (steps,) largest unscaled |gradient| per step
    same = replay(policy_from_run(run), trace)       # reproduces the recorded scale trace (GradScaler, DeepSpeed fp16)
    what_if = replay(TorchPolicy(init_scale=2.0**10, growth_interval=50), trace)

A replay is a counterfactual: in a real run a skipped step changes every later gradient, and a
different scale changes which activation gradients flush; the trace only holds what this run
computed. It answers "which of these gradients would have overflowed under that policy", not
"what would training have done".

How each step's magnitude is obtained (``TRACE_RULES``):

* a step with histograms: the lower edge ``2**k`` of the highest non-empty binade
  ``(2**k, 2**(k+1)]`` over the chosen tensors, unscaled. With power-of-two scales this decides
  overflow exactly as :func:`ampviz.histogram.fate` does (the top sliver of one binade,
  [65520, 65536] for fp16, counts as no overflow);
* the recorded gradients hold inf/nan, or the run skipped the step: the real scaled gradients
  overflowed, so the magnitude was at least ``format.overflow_threshold / recorded loss_scale``;
  that bound (or the finite maximum, if larger) is used;
* the loss is not finite: the forward pass overflowed and no loss scale helps: ``inf``;
* a step without histograms (``every > 1``): the nearest earlier recorded step's finite
  maximum (the first recorded step's, before it), kept below the recorded overflow bound because
  the run did not overflow there; skipped steps get the overflow bound as above.
"""

from __future__ import annotations

import numpy as np

from .. import histogram as H
from ..formats import get_format
from ..run import KINDS, SCALE_FREE, Run
from .policies import DeepSpeedPolicy, StaticPolicy, TorchPolicy

__all__ = ["trace_from_run", "policy_from_run", "TRACE_RULES"]

TRACE_RULES = ("recorded", "overflow bound", "non-finite loss", "filled")


def trace_from_run(run: Run, format="fp16", rank=None, tensors=None, *, return_rules: bool = False):
    """Largest unscaled gradient magnitude of every step of ``run`` (see the module docstring).

    Parameters
    ----------
    run : an ``ampviz.Run``.
    format : the format the scaled gradients were computed in (its overflow threshold is used
        for steps that overflowed).
    rank : which rank (default: the first; for a run whose ranks each recorded their own partition of the
        gradients, DeepSpeed ZeRO 1 to 3 (``run.meta["deepspeed"]["weights"] == "partition"``), the largest over
        all ranks, step by step, as the whole gradient's).
    tensors : names or indices of the tensors to take the maximum over (default: every gradient row, i.e. all
        but forward outputs).
    return_rules : also return, per step, the index into ``TRACE_RULES`` of the rule used.

    Returns
    -------
    (steps,) float array (and the (steps,) int array of rules when ``return_rules``).
    """
    if not isinstance(run, Run):
        raise TypeError(f"run: expected an ampviz.Run, got {type(run).__name__}")
    fmt = get_format(format)
    ds = run.meta.get("deepspeed")
    if rank is None and len(run.ranks) > 1 and isinstance(ds, dict) and ds.get("weights") == "partition":
        each = [trace_from_run(run, format, r, tensors, return_rules=True) for r in run.ranks]
        mags = np.stack([m for m, _ in each])                            # (R, N)
        top = np.argmax(mags, axis=0)
        mag, rules = mags[top, np.arange(mags.shape[1])], np.stack([r for _, r in each])[top, np.arange(mags.shape[1])]
        return (mag, rules) if return_rules else mag
    r = run.rank_index(run.ranks[0] if rank is None else rank)
    if tensors is None:        # every gradient row; forward outputs ("output" rows) are not gradients
        idx = run.tensors_of(sorted(set(KINDS) - SCALE_FREE))
    else:
        idx = [run.tensor_index(t) for t in tensors]
    if not idx:
        raise ValueError("tensors: the selection is empty")
    scale, skipped, loss = run.loss_scale[r], run.skipped[r].astype(bool), run.loss[r]
    bound = fmt.overflow_threshold / scale                           # (N,) overflow at the recorded scale
    finite_max, nonfinite = _hist_maxima(run, r, idx)                # (H,) each
    pos = np.searchsorted(run.steps, run.hist_steps)                 # step position of each hist row
    has_hist = np.zeros(run.n_steps, dtype=bool)
    has_hist[pos] = True
    # forward-fill each step from the nearest earlier histogram row (the first row before it)
    row = np.clip(np.searchsorted(pos, np.arange(run.n_steps), side="right") - 1, 0, None)
    mag = finite_max[row] if finite_max.size else np.zeros(run.n_steps)
    rules = np.where(has_hist, 0, 3)
    filled_ok = ~has_hist & ~skipped
    mag = np.where(filled_ok, np.minimum(mag, np.nextafter(bound, 0)), mag)
    overflowed = skipped.copy()
    overflowed[pos] |= nonfinite
    mag = np.where(overflowed, np.maximum(np.where(has_hist, mag, 0.0), bound), mag)
    rules = np.where(overflowed, 1, rules)
    # inf loss: the forward overflowed. nan counts too, unless no step has a loss at all
    # (Recorder.step() without a loss stores nan for "not given")
    bad_loss = np.isinf(loss) | (np.isnan(loss) & np.isfinite(loss).any())
    mag, rules = np.where(bad_loss, np.inf, mag), np.where(bad_loss, 2, rules)
    return (mag, rules) if return_rules else mag


def _hist_maxima(run: Run, r: int, idx: list):
    """Per histogram row: lower edge of the highest non-empty finite binade, and 'holds inf/nan'."""
    lower = H.lower_edges()
    finite_max = np.zeros(run.hist_steps.size)
    nonfinite = np.zeros(run.hist_steps.size, dtype=bool)
    for t in idx:                        # one tensor at a time: never a copy of the whole counts array
        stored = run.counts[r, :, t]                                  # (H, NBINS), as recorded
        nonfinite |= (stored[:, H.ABOVE] > 0) | (stored[:, H.NAN] > 0)
        c = run.tensor_counts(t, "unscaled", rank=run.ranks[r])
        nonempty = c[:, H.ZERO + 1:H.ABOVE] > 0                       # below + binades
        top = np.where(nonempty.any(axis=1), H.ABOVE - 1 - np.argmax(nonempty[:, ::-1], axis=1), -1)
        finite_max = np.maximum(finite_max, np.where(top >= 0, lower[np.maximum(top, 0)], 0.0))
    return finite_max, nonfinite


def policy_from_run(run: Run) -> TorchPolicy | DeepSpeedPolicy | StaticPolicy:
    """The loss scaler a run was recorded with, as a policy (for replays): its own settings, read, not assumed.

    * a GradScaler (``run.meta["scaler"]``): a TorchPolicy;
    * DeepSpeed's fp16 dynamic scaler (``run.meta["deepspeed"]``, ``ampviz.integrations.deepspeed``): a
      DeepSpeedPolicy from the scale the recording began with, ``scale_window``, ``hysteresis`` (ZeRO 0's fp16
      optimizers have none: 1), ``min_loss_scale``, ``consecutive_hysteresis`` and ``raise_error_at_min_scale``;
      a DeepSpeed fp16 run with a static loss scale: a StaticPolicy.

    A recording begun at a fresh scaler replays its scale trace exactly; one begun mid-training starts the
    replay's window count and hysteresis afresh (``run.meta["deepspeed"]["scaler_start"]`` says where the scaler
    stood).

    Raises ValueError for a run without a loss scaler (no GradScaler; a bf16 or fp32 DeepSpeed run).
    """
    sc = run.meta.get("scaler")
    if sc:
        return TorchPolicy(init_scale=float(sc["init_scale"]), growth_factor=float(sc["growth_factor"]),
                           backoff_factor=float(sc["backoff_factor"]), growth_interval=int(sc["growth_interval"]))
    ds = run.meta.get("deepspeed")
    if isinstance(ds, dict):
        return _deepspeed_policy(run, ds)
    raise ValueError("run: recorded without a GradScaler (meta['scaler'] is empty); "
                     "choose a policy, e.g. ampviz.replay.TorchPolicy()")


def _deepspeed_policy(run: Run, ds: dict) -> DeepSpeedPolicy | StaticPolicy:
    if ds.get("dtype") != "fp16":
        raise ValueError(f"run: a DeepSpeed {ds.get('dtype')} run has no loss scale (DeepSpeed scales only fp16 "
                         f"losses): there is no scaler to replay; choose a policy, e.g. "
                         f"ampviz.replay.DeepSpeedPolicy()")
    init = ds.get("init_scale")
    if init is None:                 # a file from before init_scale was recorded: the first step's scale
        if run.n_steps == 0:
            raise ValueError("run: a DeepSpeed fp16 run with no step and no init_scale recorded: nothing to replay")
        init = float(run.loss_scale[0, 0])
    if not ds.get("dynamic_loss_scale"):
        return StaticPolicy(init_scale=float(init))
    missing = [k for k in ("scale_window", "min_loss_scale") if ds.get(k) is None]
    if missing:
        raise ValueError(f"run: meta['deepspeed'] lacks the scaler's {' and '.join(missing)}: cannot replay its "
                         f"scaler; choose a policy, e.g. ampviz.replay.DeepSpeedPolicy()")
    hysteresis = ds.get("hysteresis")
    return DeepSpeedPolicy(
        init_scale=float(init), scale_factor=float(ds.get("scale_factor") or 2.0),
        scale_window=int(ds["scale_window"]), min_scale=float(ds["min_loss_scale"]),
        hysteresis=1 if hysteresis is None else int(hysteresis),      # ZeRO 0's fp16 optimizers: none
        consecutive_hysteresis=bool(ds.get("consecutive_hysteresis")),
        # a file from before it was recorded: DeepSpeed's default where there is hysteresis
        raise_error_at_min_scale=bool(ds.get("raise_error_at_min_scale", hysteresis is not None)))
