"""Would bf16 optimizer state stall? (``bf16_optimizer_state_would_stall``), from the state arrays that
``Recorder(..., updates=N)`` records beside the weights' updates in an fp32 or AMP run::

    state_findings(Facts(run))     # [] without state arrays, in a bf16/fp16-weight run, or below the share

Adam's ``exp_avg_sq`` moves by ``(1 - beta2) * |g**2 / v - 1|`` of itself per step: with ``beta2 = 0.999`` that is
often below half a bf16 ulp (``2**-9`` relative), so a ``v`` stored in bf16 does not move at all (or drifts, the
rounding always the same way); ``exp_avg`` likewise with ``beta1``. ``run.state_stalled`` counts, per weight and
state tensor, the elements whose fp32 state changed at a measured step but whose change rounds away when added to
the state rounded to bf16 (``bf16(bf16(s) + ds) == bf16(s)``); the share is of the changed elements
(``state_counts`` without column 0).
"""

from __future__ import annotations

from ._facts import Facts, finding, names_text, percent, steps_text

__all__ = ["state_findings", "state_summary", "STATE_SHARE"]

STATE_SHARE = 0.01               # a state is named when bf16 would have kept at least this share of it unchanged

STATE_ADVICE = (
    "Keep {names} in fp32 (the optimizer's default: torch.optim keeps its state in the parameter's dtype, so fp32 "
    "weights under autocast give fp32 state). A bf16 copy of that state would stop following the gradients: its "
    "per-step changes are below half a bf16 ulp. To store it in bf16 anyway, round the update into it stochastically "
    "or keep a Kahan compensation buffer beside it (torchao's `bf16_stochastic_round` option applies to bf16 "
    "weights, not to optimizer state). A larger 1 - beta (smaller beta2) makes the changes larger, at the cost of "
    "a noisier average.")


def state_summary(facts: Facts) -> dict | None:
    """Per state name: elements changed and would-be-stalled in bf16, and the share, with the same per weight
    tensor; None without state arrays."""
    run = facts.run
    counts, stalled = run.state_counts, run.state_stalled
    if counts is None or stalled is None or run.update_steps is None:
        return None
    weights = run.tensors_of("weight")
    changed = counts[..., 1:].sum(axis=-1)                           # (R, U, W, S): column 0 did not change
    out = []
    for k, name in enumerate(run.state_names):
        per = []
        for j, t in enumerate(weights):
            c, s = int(changed[:, :, j, k].sum()), int(stalled[:, :, j, k].sum())
            if c:
                per.append({"tensor": run.tensor_names[t], "changed": c, "stalled": s, "share": s / c})
        c, s = sum(r["changed"] for r in per), sum(r["stalled"] for r in per)
        steps = run.update_steps[(stalled[:, :, :, k] > 0).any(axis=(0, 2))]
        out.append({"state": name, "changed": c, "stalled": s, "share": s / c if c else 0.0,
                    "steps": steps.tolist(), "tensors": sorted(per, key=lambda r: -r["share"])})
    return {"update_steps": run.update_steps.tolist(), "states": out}


def state_findings(facts: Facts) -> list[dict]:
    summary = state_summary(facts)
    run = facts.run
    dtypes = {run.tensor_dtypes[t] for t in run.tensors_of("weight")}
    if summary is None or dtypes != {"torch.float32"}:               # an fp32 or AMP run: fp32 state
        return []
    worst = sorted((s for s in summary["states"] if s["changed"] and s["share"] >= STATE_SHARE),
                   key=lambda s: -s["share"])
    if not worst:
        return []
    names = [s["state"] for s in worst]
    tensors = list(dict.fromkeys(r["tensor"] for s in worst for r in s["tensors"] if r["share"] >= STATE_SHARE))
    parts = [f"{s['state']} {percent(s['share'])}" for s in worst]
    return [finding(
        "bf16_optimizer_state_would_stall", "info",
        f"optimizer state kept in bf16 would stop moving: {', '.join(parts)} of its changed elements change by less "
        f"than half a bf16 ulp per step (worst in {names_text(tensors, 3)}): keep {' and '.join(names)} in fp32",
        steps=sorted({x for s in worst for x in s["steps"]}), tensors=tensors, ranks=run.ranks,
        evidence={"states": {s["state"]: {"share": s["share"], "stalled_elements": s["stalled"],
                                          "changed_elements": s["changed"],
                                          "tensors": {r["tensor"]: r["share"] for r in s["tensors"]}}
                             for s in worst}},
        details=[f"{s['state']} of {r['tensor']}: {percent(r['share'])} of {r['changed']} changed elements"
                 for s in worst for r in s["tensors"][:4]]
        + [f"measured at steps {steps_text(summary['update_steps'])}; the stalled elements are counted against "
           f"the state rounded to bf16 before each measured step"],
        recommendation=STATE_ADVICE.format(names=" and ".join(f"`{n}`" for n in names)))]

