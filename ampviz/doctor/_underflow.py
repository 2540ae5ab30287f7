"""Gradients that fp16 flushed to zero inside the backward (``gradient_underflow``), and what a loss scale
would have kept.

A value that underflows in an fp16 backward is stored as an exact zero: the Recorder counts what the backward
produced, so a flushed gradient is a zero, not a value below 2**-24. Underflow is read from the zeros where the
distribution meets fp16's floor, per gradient tensor computed in fp16 (an fp16 activation gradient; a weight
gradient whose values, at the step's loss scale, never fall below fp16's smallest subnormal: computed in fp16,
or from gradients that were) and per step:

* ``at the floor``: exact zeros, the binade of fp16's smallest subnormal (2**-24) populated, and at least
  ``BULK_SHARE`` of the non-zero values subnormal (below 2**-14, with fewer significant bits): the distribution
  runs into the floor, so the values below it are among the zeros;
* ``all zeros``: every value zero at a step where other gradients are at the floor (a whole layer flushed).

Steps that hold inf/nan or were skipped are not judged. A tensor flushed on at least ``PERSISTENT`` of its
judged steps makes the finding an error, on at least ``OCCASIONAL`` of them (and ``MIN_STEPS``) a warning; fewer
is no finding (a deep network's gradients touch the floor at a few steps even under a healthy GradScaler).

The replays put GradScaler's defaults (``ampviz.replay.replay`` over the run's gradient maxima) and the largest
static scale no recorded step overflows at in place of the recorded scale: fp16's floor moves down by their
log2, and the share of the recorded non-zero values that stay subnormal is recounted. The zeros cannot be
recounted (their values are gone): a replay says down to which magnitude they would have been kept.
"""

from __future__ import annotations

import numpy as np

from .. import histogram as H
from ..formats import FP16
from ..replay import StaticPolicy, TorchPolicy, replay, trace_from_run
from ..replay.policies import Policy
from ._facts import Facts, best_static_log2, finding, percent, scale_text, steps_text

BULK_SHARE = 0.5        # share of the non-zero values that are subnormal, with the floor populated: "at the floor"
PERSISTENT = 0.5        # share of a tensor's judged steps at which it is flushed that makes it an error
OCCASIONAL = 0.1        # ... that makes it a warning
MIN_STEPS = 2           # fewer flushed steps than this are not a finding

_FLOOR = FP16.log2_min_subnormal - 1        # binade (2**-25, 2**-24]: the smallest subnormal, 2**-24
_NORMAL = FP16.emin                         # binades up to (2**-15, 2**-14] count as subnormal (as H.fate does)


def flushed_in_backward(facts: Facts) -> list[dict]:
    """Per fp16-computed gradient tensor of rank 0 flushed at some judged step, worst first: plain dicts with
    ``tensor``, ``kind``, ``steps`` (flushed), ``all_zero_steps``, ``judged_steps``, ``zero_share`` and
    ``subnormal_share`` (over its flushed steps), ``floor_values`` (values at 2**-24 on them) and ``row``."""
    if "flushed" not in facts._cache:
        facts._cache["flushed"] = _flushed(facts)
    return facts._cache["flushed"]


def _judged(facts: Facts) -> dict:
    """{tensor index: (H, NBINS) counts at the step's scale, floor offset} for the fp16-computed gradient rows."""
    run = facts.run
    if facts.precision != "fp16" or not run.hist_steps.size:
        return {}
    world = int(run.meta.get("world_size") or 1)
    # DDP averages the weight gradients: 2**-24 / world (judged only for a power-of-two world of sane size)
    reduced = int(np.log2(world)) if world & (world - 1) == 0 and world <= 2 ** 20 else None
    out = {}
    for t in facts.grad_rows:
        kind = run.tensor_kinds[t]
        c = run.tensor_counts(t, "scaled")
        if kind == "activation":
            if run.tensor_dtypes[t] == "torch.float16":
                out[t] = (c, 0)
            continue
        offset = reduced if kind == "weight" else 0
        if offset is None:
            continue
        # computed in fp16 (or from gradients that were): no value below fp16's floor at any step
        if not c[:, H.BELOW:H.column(_FLOOR - offset)].any():
            out[t] = (c, offset)
    return out


def _flushed(facts: Facts) -> list[dict]:
    run = facts.run
    judged = _judged(facts)
    if not judged:
        return []
    inf, nan = facts.nonfinite(0)
    ok = ~run.skipped[0][facts.hist_pos]                                       # (H,) steps to judge
    at_floor, all_zero = {}, {}
    for t, (c, offset) in judged.items():
        floor = H.column(_FLOOR - offset)
        nonzero = c[:, H.BELOW:H.ABOVE].sum(axis=1)
        sub = c[:, floor:H.column(_NORMAL - 1 - offset) + 1].sum(axis=1)
        fine = ok & (inf[:, t] + nan[:, t] == 0)
        at_floor[t] = fine & (c[:, H.ZERO] > 0) & (c[:, floor] > 0) & (sub >= BULK_SHARE * nonzero)
        all_zero[t] = fine & (nonzero == 0) & (c[:, H.ZERO] > 0)
    floor_step = np.any(list(at_floor.values()), axis=0)                     # (H,) some gradient at the floor
    out = []
    for t, (c, offset) in judged.items():
        flushed = at_floor[t] | (all_zero[t] & floor_step)
        n_judged = int((ok & (inf[:, t] + nan[:, t] == 0)).sum())
        if not flushed.any():
            continue
        rows = c[flushed]
        nonzero = rows[:, H.BELOW:H.ABOVE].sum()
        floor = H.column(_FLOOR - offset)
        sub = rows[:, floor:H.column(_NORMAL - 1 - offset) + 1].sum()
        out.append({"tensor": run.tensor_names[t], "kind": run.tensor_kinds[t], "row": t,
                    "steps": run.hist_steps[flushed].tolist(), "judged_steps": n_judged,
                    "all_zero_steps": int((all_zero[t] & flushed).sum()),
                    "zero_share": float(rows[:, H.ZERO].sum() / max(rows[:, :H.ABOVE].sum(), 1)),
                    "subnormal_share": float(sub / nonzero) if nonzero else 0.0,
                    "floor_values": int(rows[:, floor].sum()), "floor_offset": offset})
    # worst first; among equals the layer's output gradient before its weights, then recording order
    out.sort(key=lambda x: (-len(x["steps"]) / max(x["judged_steps"], 1), -x["all_zero_steps"],
                            x["kind"] != "activation", x["row"]))
    return out


def underflow_findings(facts: Facts) -> list[dict]:
    """At most one finding: the tensors fp16 flushed in the backward, worst first (see the module docstring)."""
    flushed = [x for x in flushed_in_backward(facts)
               if len(x["steps"]) >= MIN_STEPS and len(x["steps"]) >= OCCASIONAL * x["judged_steps"]]
    if not flushed:
        return []
    run = facts.run
    persistent = [x for x in flushed if len(x["steps"]) >= PERSISTENT * x["judged_steps"]]
    steps = sorted({s for x in flushed for s in x["steps"]})
    worst = flushed[0]
    recorded = run.loss_scale[0][np.searchsorted(run.steps, steps)]
    lo, hi = float(recorded.min()), float(recorded.max())
    scale = ("no loss scale" if not facts.loss_scaled else
             f"loss scale {scale_text(lo)}" + (f" .. {scale_text(hi)}" if hi != lo else ""))
    more = len(flushed) - 1
    summary = (f"fp16 flushed gradients to zero in the backward: {_what(worst)}"
               + (f"; {more} more tensor{'s' if more != 1 else ''} lose values at fp16's floor" if more else "")
               + f" ({scale})")
    replays = _replays(facts, flushed, steps)
    details = [_line(x) for x in flushed[:5]]
    if len(flushed) > 5:
        details.append(f"... and {len(flushed) - 5} more: {', '.join(x['tensor'] for x in flushed[5:12])}")
    details += [r["text"] for r in replays.values()] + [
        "Replays put another scale on the values this run recorded: a counterfactual (the zeros cannot be "
        "recounted, their values are gone; a scaled run would also have trained differently)."]
    return [finding(
        "gradient_underflow", "error" if persistent else "warning", summary, steps=steps,
        tensors=[x["tensor"] for x in flushed], ranks=[run.ranks[0]], details=details,
        evidence={"tensors": [{k: v for k, v in x.items() if k not in ("row", "floor_offset")} for x in flushed[:20]],
                  "recorded_scale": [lo, hi], "fp16_floor": "2^-24 (smallest subnormal); "
                  "values at or below 2^-25 flush to 0",
                  "replays": {k: {f: v for f, v in r.items() if f != "text"} for k, r in replays.items()}},
        recommendation=_advice(facts, replays, int(np.log2(hi))))]


def _what(x: dict) -> str:
    kind = "gradient of its output" if x["kind"] == "activation" else f"{x['kind'].replace('_', ' ')} gradient"
    n, judged = len(x["steps"]), x["judged_steps"]
    if x["all_zero_steps"] == n:
        return f"{x['tensor']}'s {kind} is all zeros at {n} of {judged} steps"
    return (f"{x['tensor']}'s {kind} runs into fp16's floor at {n} of {judged} steps ({percent(x['zero_share'])} "
            f"exact zeros)")


def _line(x: dict) -> str:
    n, kind = len(x["steps"]), x["kind"].replace("_", " ")
    head = f"{x['tensor']} ({kind}): flushed at {n} of {x['judged_steps']} steps ({steps_text(x['steps'], 4)})"
    if x["all_zero_steps"] == n:
        return head + ": all zeros at every one of them"
    floor = 2.0 ** -(24 + x["floor_offset"])
    zeros = f"all zeros at {x['all_zero_steps']} of them; " if x["all_zero_steps"] else ""
    return (head + f": {zeros}on these steps {percent(x['zero_share'])} of its values are exact zeros, "
            f"{percent(x['subnormal_share'])} of the non-zero ones fp16 subnormals, {x['floor_values']} at "
            f"{scale_text(floor)} (the smallest)")


def _replays(facts: Facts, flushed: list, steps: list) -> dict:
    """GradScaler's defaults and the best static scale, replayed over the run's gradient maxima: their scale on
    the flushed steps, fp16's floor there, and the share of the recorded non-zero values left subnormal."""
    run = facts.run
    trace = trace_from_run(run, FP16, tensors=facts.grad_rows)
    pos = np.searchsorted(run.steps, steps)
    rec_log2 = np.rint(np.log2(run.loss_scale[0][pos]))
    policies: dict[str, Policy] = {"GradScaler's defaults (init 2^16, growth_interval 2000)": TorchPolicy()}
    best = best_static_log2(trace, FP16)
    if best is not None:
        policies[f"static {scale_text(2.0 ** best)} (the largest at which no recorded step overflows)"] = \
            StaticPolicy(init_scale=2.0 ** best)
    out = {}
    for label, policy in policies.items():
        rep = replay(policy, trace, FP16)
        log2s = np.rint(np.log2(rep.scale[pos]))
        lo, hi = int(log2s.min()), int(log2s.max())
        shown = [x for x in flushed if x["all_zero_steps"] < len(x["steps"])][:5]       # some values to recount
        shares = {x["tensor"]: _subnormal_after(facts, x, log2s - rec_log2, steps) for x in shown}
        gain = f"2^{lo}" if lo == hi else f"2^{lo} .. 2^{hi}"
        text = (f"replay, {label}: scale {gain} on these steps, {int(rep.skipped[pos].sum())} of them skipped; in "
                f"the unscaled gradients fp16's floor moves from 2^{-25 - int(rec_log2.min())} to 2^{-25 - lo}, so "
                f"the zeros that were values above it are kept; recorded non-zero values still subnormal: "
                + ", ".join(f"{name} {percent(v)}" for name, v in shares.items()))
        out[label] = {"log2_scale": [lo, hi], "skipped": int(rep.skipped[pos].sum()),
                      "subnormal_share": shares, "text": text}
    return out


def _subnormal_after(facts: Facts, x: dict, shift: np.ndarray, steps: list) -> float:
    """Share of tensor x's recorded non-zero values on its flushed steps that stay subnormal after ``shift``
    more binades of scale (one shift per step of ``steps``)."""
    run = facts.run
    rows = np.searchsorted(run.hist_steps, x["steps"])
    per_step = dict(zip(steps, shift))
    c = H.shift(run.tensor_counts(x["row"], "scaled")[rows], np.array([per_step[s] for s in x["steps"]]))
    f = H.fate(c, FP16, log2_scale=x["floor_offset"])        # DDP's average divided by 2**offset: undone
    nonzero = float(f.nonzero.sum())
    return float(f.subnormal.sum()) / nonzero if nonzero else 0.0


def _advice(facts: Facts, replays: dict, recorded_log2: int) -> str:
    static = next((r for k, r in replays.items() if k.startswith("static")), None)
    best = static["log2_scale"][0] if static else None
    bf16 = " Or train in bf16: it has fp32's range, so these gradients need no loss scale."
    if not facts.loss_scaled:
        return ("Scale the loss: torch.amp.GradScaler(device) starts at 2^16 and grows while no step overflows, "
                "lifting every gradient of the backward 16 binades or more above fp16's floor"
                + (f" (a static scale of 2^{best} overflows no recorded step)" if static else "") + "." + bf16)
    if best is not None and best <= recorded_log2:
        return (f"No single loss scale keeps all of these gradients: a scale above 2^{best} overflows some recorded "
                f"step, yet at 2^{recorded_log2} these still flush; their range is wider than fp16's. Train in bf16 "
                f"(fp32's range), or run the layers whose gradients flush in fp32.")
    return ("The loss scale stayed too low for these gradients: let GradScaler grow it (growth_factor > 1 and a "
            "growth_interval the run reaches; don't cap it), or start higher"
            + (f" (init_scale=2.0**{best} overflows no recorded step)" if static else "") + "." + bf16)
