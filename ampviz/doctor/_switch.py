""""Can I switch precision?": from an fp32 or bf16 run, what fp16 and fp8 would flush or overflow.

Four targets, each judged per recorded tensor from its unscaled histograms (rank 0, steps whose recorded
values are all finite):

* fp16 with a dynamic scaler: GradScaler's defaults replayed over the run's gradient trace
  (``ampviz.replay.replay``), each step at the scale the replay chose;
* fp16 with the best static scale: the largest power of two at which no recorded step overflows;
* fp8 e4m3fn and fp8 e5m2 with per-tensor amax scaling (``ampviz.tensor_scaling``).

Forward outputs never see the loss scale: they are judged in fp16 at scale 1. A tensor is "ok" in a
target when less than ``OK_SHARE`` of its non-zero values flush to zero and none overflow.
"""

from __future__ import annotations

import numpy as np

from .. import histogram as H
from ..formats import FP16
from ..replay import StaticPolicy, TorchPolicy, replay, trace_from_run
from ..tensor_scaling import amax_log2_scales
from ._facts import Facts, best_static_log2, percent, scale_text

OK_SHARE = 1e-3

CAVEAT = ("A replay is a counterfactual: it casts the gradients this run recorded. A run in the target "
          "precision computes different gradients (other rounding, other skipped steps), so this says what "
          "these values would lose, not how that training would go. fp8 recipes cast activations and weights "
          "to e4m3; output gradients to e5m2 (Transformer Engine's HYBRID, torchao's tensorwise) or e4m3 "
          "(block-scaled and row-wise recipes); weight gradients stay bf16/fp32.")

_SHORT = {"fp16 (dynamic scaler)": "fp16 dyn", "fp16 (static scale)": "fp16 static",
          "fp8 e4m3fn (per-tensor amax)": "e4m3", "fp8 e5m2 (per-tensor amax)": "e5m2"}


def switch_table(facts: Facts) -> dict | None:
    """The table and verdicts as plain data; None for an fp16 run (already there) or one with nothing finite."""
    run = facts.run
    rows = facts.grad_rows + facts.output_rows
    if facts.precision == "fp16" or not rows or run.hist_steps.size == 0:
        return None
    inf, nan = facts.nonfinite(0)
    ok_rows = (inf[:, rows] + nan[:, rows]).sum(axis=1) == 0                     # (H,)
    if not ok_rows.any():
        return None
    counts = {t: run.tensor_counts(t, "unscaled")[ok_rows] for t in rows}     # each (H', NBINS)
    trace = trace_from_run(run, "fp16", tensors=facts.grad_rows) if facts.grad_rows else None
    targets: list = []
    shares: dict[int, dict] = {t: {} for t in rows}
    for label, log2s, extra in _fp16_targets(facts, trace, ok_rows):
        for t in rows:
            s = log2s if run.tensor_kinds[t] != "output" else 0       # the loss scale never reaches the forward
            f = H.fate(H.shift(counts[t], np.broadcast_to(s, counts[t].shape[:-1])), "fp16", 1.0)
            shares[t][label] = _share(f, run.tensor_kinds[t])
        targets.append(dict(extra, target=label, short=_SHORT[label], format="fp16"))
    for fmt, label in (("fp8_e4m3fn", "fp8 e4m3fn (per-tensor amax)"), ("fp8_e5m2", "fp8 e5m2 (per-tensor amax)")):
        for t in rows:
            f = H.fate(H.shift(counts[t], amax_log2_scales(counts[t], fmt)), fmt, 1.0)
            shares[t][label] = _share(f, run.tensor_kinds[t])
        targets.append({"target": label, "short": _SHORT[label], "format": fmt,
                        "scaling": "per tensor and step, from its amax"})
    tensors = [{"tensor": run.tensor_names[t], "kind": run.tensor_kinds[t], "shares": shares[t],
                "verdict": _tensor_verdict(shares[t])} for t in rows]
    for tg in targets:
        tg.update(_target_verdict(tg, tensors))
    overall = "; ".join(f"{tg['target']}: {tg['verdict']}" for tg in targets)
    return {"from": facts.precision, "caveat": CAVEAT, "ok_share": OK_SHARE, "targets": targets, "tensors": tensors,
            "verdict": overall, "steps_used": int(ok_rows.sum()),
            "excluded_steps": run.hist_steps[~ok_rows].tolist()}


def _fp16_targets(facts: Facts, trace, ok_rows):
    """(label, per-row log2 scales (H',), extra plain fields) of the two fp16 targets."""
    if trace is None:
        yield "fp16 (dynamic scaler)", 0, {"scaling": "no gradients recorded: scale 1"}
        return
    pos = facts.hist_pos[ok_rows]
    dyn = replay(TorchPolicy(), trace)
    yield "fp16 (dynamic scaler)", np.rint(np.log2(dyn.scale[pos])).astype(np.int64), {
        "scaling": "GradScaler defaults (init 2^16, growth_interval 2000), replayed",
        "skipped_steps": dyn.n_skipped, "scale_range": [float(dyn.scale.min()), float(dyn.scale.max())]}
    best = best_static_log2(trace, FP16)
    best = 0 if best is None else best
    static = replay(StaticPolicy(init_scale=2.0 ** best), trace)
    yield "fp16 (static scale)", best, {"scaling": f"static {scale_text(2.0 ** best)}, the largest with no "
                                                   f"recorded step overflowing", "log2_scale": best,
                                        "skipped_steps": static.n_skipped}


def _share(f: H.Fate, kind: str) -> dict:
    nonzero = float(f.nonzero.sum())
    flushed = float(f.flushed.sum()) / nonzero if nonzero else 0.0
    overflow = float(f.overflow.sum()) / nonzero if nonzero else 0.0
    if overflow > 0:
        status = f"overflows {percent(overflow)}" + (" (forward: no loss scale fixes it)" if kind == "output" else "")
    elif flushed >= OK_SHARE:
        status = f"flushes {percent(flushed)}"
    else:
        status = "ok"
    return {"flushed": flushed, "overflow": overflow, "status": status}


def _tensor_verdict(shares: dict) -> str:
    good = [_SHORT[k] for k, v in shares.items() if v["status"] == "ok"]
    bad = [f"{_SHORT[k]} {v['status']}" for k, v in shares.items() if v["status"] != "ok"]
    if not bad:
        return "ok everywhere"
    return (f"ok in {', '.join(good)}; " if good else "") + "; ".join(bad)


def _target_verdict(target: dict, tensors: list) -> dict:
    label = target["target"]
    bad = [t for t in tensors if t["shares"][label]["status"] != "ok"]
    if not bad:
        return {"ok": True, "verdict": "yes, every tensor ok" + (
            f" ({target['skipped_steps']} replayed skips)" if target.get("skipped_steps") else "")}
    worst = max(bad, key=lambda t: (t["shares"][label]["overflow"], t["shares"][label]["flushed"]))
    return {"ok": False, "verdict": f"no: {len(bad)} of {len(tensors)} tensors lose values (worst {worst['tensor']}: "
                                    f"{worst['shares'][label]['status']})"}
