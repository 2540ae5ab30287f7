"""Findings from a recorded run: what went wrong, the evidence, and what to do (``ampviz doctor``).

The questions AMP users ask, answered from what the Recorder stored::

    import ampviz
    run = ampviz.Run.load("runs/my_run.npz")
    report = run.diagnose()                  # plain data: dicts, lists, str, int, float, bool, None
    report["clean"], len(report["findings"])
    print(ampviz.doctor.as_text(report, "my_run"))

or ``ampviz doctor runs/my_run.npz [--json]``. Checks (``CHECKS``):

* ``nonfinite_gradient`` (error): gradients that went inf/nan *not* because of the loss scale, named by the
  first tensor in backward order that held them (``Run.grad_order``), with the tensors they spread to; read
  through clipping after ``scaler.unscale_``, which turns an overflow's inf into nan;
* ``gradient_underflow`` (error, or warning when it is not most steps): gradients that fp16 flushed to zero in
  the backward, with or without a GradScaler: exact zeros where the distribution meets fp16's floor, whole
  layers zero; with what GradScaler's defaults or the best static scale would have kept (``flushed_in_backward``
  lists them per tensor);
* ``forward_overflow`` (error) / ``forward_headroom`` (warning): recorded forward outputs
  (``Recorder(..., outputs=True)``) that overflow their dtype, or come within a factor 2 of it; a non-finite
  loss without recorded outputs;
* ``init_scale_too_high`` (info), ``scale_collapse`` (error), ``frequent_skips`` (warning),
  ``scale_unbounded`` (warning): the dynamic loss scaler's trace, a GradScaler's or DeepSpeed's fp16 one (read
  with its own settings: ``growth_interval``, or ``scale_window`` and ``hysteresis``), with replays of other
  scalers (``ampviz.replay``);
* ``scaler_unused`` (error): the GradScaler given to the Recorder never stepped while it recorded, so the
  scale and skips recorded are not the loop's (the other scale checks are then not run);
* ``ranks_disagree`` (error): DDP ranks whose scales or skips differ;
* ``scheduler_on_skipped`` (warning): LR-scheduler steps taken on skipped steps (``Run.scheduler_steps``);
* ``silent_skips`` (warning), ``scale_at_minimum`` (error): runs recorded from a DeepSpeed engine
  (``ampviz.integrations.deepspeed``, ``run.meta["deepspeed"]``): steps DeepSpeed skipped in a bf16 (or fp32) run,
  which has no loss scale to show them; an fp16 scale pinned at ``min_loss_scale`` while steps still overflow;
* ``weights_stall`` (warning): with ``Recorder(..., updates=N)``, bf16 / fp16 weights (no fp32 master copy) whose
  updates round to nothing (gradient non-zero, weight unchanged), norms and biases first;
  ``bf16_weights_would_stall`` (info): in an fp32-weight run, the share of updates below half a bf16 ulp of their
  weight (``|dw|/|w| <= 2**-9``), i.e. what dropping fp32 master weights would lose (``report["updates"]``
  holds the per-tensor numbers and a one-line verdict either way);
  ``bf16_optimizer_state_would_stall`` (info): in an fp32 or AMP run whose optimizer keeps per-element state
  (Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's ``momentum_buffer``), the share of each state's changed elements
  that would not have moved had it been stored in bf16 (change below half a bf16 ulp), and where;

Every finding is a dict: ``check``, ``severity`` ("error", "warning", "info"), ``summary`` (one line),
``steps``, ``tensors``, ``ranks``, ``evidence`` (numbers), ``details`` (evidence in words) and
``recommendation``. A healthy GradScaler run, whose few skips are growth probes, has none. Runs without a
GradScaler also get ``switch``: what fp16 (replayed dynamic scaler, best static scale) and fp8 with
per-tensor amax scaling would flush or overflow, per tensor, with a verdict and the caveat that a replay
is a counterfactual. Runs recorded with ``Recorder(..., blocks=...)`` get ``blocks``, at any precision: what
MXFP8, MXFP4, NVFP4 and row-wise / tiled fp8 would do to each Linear's input, weight and output gradient, judged by
the share of the squared norm lost and the cast's error (``ampviz.doctor._blocks``).

Needs only torch and numpy (no plotly).
"""

from __future__ import annotations

from ..run import Run
from ._blocks import LABELS as RECIPE_LABELS
from ._blocks import block_table
from ._facts import SEVERITIES, Facts, plain
from ._forward import forward_findings
from ._nonfinite import CAUSES, nonfinite_findings, step_causes
from ._optstate import state_findings, state_summary
from ._render import as_html, as_text, headline
from ._scale import deepspeed_findings, rank_findings, scale_findings
from ._scheduler import scheduler_findings
from ._switch import switch_table
from ._underflow import flushed_in_backward as _flushed_in_backward
from ._underflow import underflow_findings
from ._updates import master_weights_verdict, update_findings, update_summary

__all__ = ["diagnose", "flushed_in_backward", "as_text", "as_html", "headline", "CHECKS", "SEVERITIES", "CAUSES",
           "RECIPE_LABELS"]

CHECKS = ("nonfinite_gradient", "gradient_underflow", "forward_overflow", "forward_headroom", "init_scale_too_high",
          "scale_collapse", "frequent_skips", "scale_unbounded", "ranks_disagree", "scheduler_on_skipped",
          "scaler_unused", "silent_skips", "scale_at_minimum", "weights_stall", "bf16_weights_would_stall",
          "bf16_optimizer_state_would_stall")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}


def diagnose(run: Run) -> dict:
    """Every check of the doctor on ``run``.

    Parameters
    ----------
    run : an ``ampviz.Run`` (all ranks).

    Returns
    -------
    dict of plain data: ``clean`` (no findings), ``findings`` (errors first), ``checks`` (what was checked
    and, where a check could not run, why), ``nonfinite_steps`` (per rank and step that was skipped or held
    inf/nan: its cause, one of ``CAUSES``, and first non-finite tensor), ``switch`` (see the module
    docstring; None for fp16 runs), ``blocks`` (with ``Recorder(..., blocks=...)``: per recorded Linear tensor and
    block recipe (MXFP8, MXFP4, NVFP4, row-wise and tiled fp8), the share of its squared norm flushed and the cast's
    RMS error, with a verdict per tensor and per recipe; None without), ``updates`` (with
    ``Recorder(..., updates=N)``: per weight tensor the elements updated and stalled and what bf16 weights would
    lose, and ``master_weights``, a one-line answer to "can I drop fp32 master weights?" for fp32-weight runs,
    and ``optimizer_state``: per state tensor its changed elements and those bf16 would have kept unchanged, or
    None; None without) and ``run`` (steps, ranks, precision).
    """
    facts = Facts(run)
    causes = step_causes(facts)
    found = (forward_findings(facts, causes) + nonfinite_findings(facts, causes) + underflow_findings(facts)
             + scale_findings(facts, causes) + deepspeed_findings(facts) + rank_findings(facts)
             + scheduler_findings(facts) + update_findings(facts) + state_findings(facts))
    found.sort(key=lambda f: _RANK[f["severity"]])
    return plain({"run": {"steps": run.n_steps, "histogram_steps": int(run.hist_steps.size), "ranks": run.ranks,
                          "precision": facts.precision, "scaler": facts.has_scaler,
                          "skipped": int(run.skipped[0].sum()) if run.n_steps else 0},
                  "clean": not found, "findings": found, "checks": _checks(facts, causes), "nonfinite_steps": causes,
                  "switch": switch_table(facts), "blocks": block_table(facts),
                  "updates": _updates_report(facts)})


def _updates_report(facts: Facts) -> dict | None:
    summary = update_summary(facts)
    if summary is None:
        return None
    return dict(summary, master_weights=master_weights_verdict(facts), optimizer_state=state_summary(facts))


def flushed_in_backward(run: Run) -> list[dict]:
    """The gradient tensors of an fp16 run whose values fp16 flushed to zero in the backward (stored as exact zeros),
    worst first: per tensor its ``steps``, ``all_zero_steps``, ``judged_steps``, ``zero_share`` and
    ``subnormal_share`` (see ``gradient_underflow``); empty for other runs. Plain data."""
    return plain([{k: v for k, v in x.items() if k not in ("row", "floor_offset")}
                  for x in _flushed_in_backward(Facts(run))])


def _checks(facts: Facts, causes: list[dict]) -> list[dict]:
    """What was checked; ``why``: why a check did not run, or which of the rows it reads never filled."""
    run = facts.run
    outputs = facts.output_rows and len(facts.empty_rows(facts.output_rows)) < len(facts.output_rows)
    rows = [("non-finite gradients", run.hist_steps.size > 0, "no histograms recorded", facts.grad_rows),
            ("fp16 underflow", facts.precision == "fp16" and run.hist_steps.size > 0 and bool(facts.grad_rows),
             f"a {facts.precision} run by its recorded dtypes (no fp16 activation gradient or output, no GradScaler)"
             if facts.precision != "fp16" else "no gradient histograms recorded", facts.grad_rows),
            ("forward overflow" if outputs else "forward overflow (loss only)", True,
             "", facts.output_rows),
            ("loss-scale health", facts.dynamic_scaler and not facts.scaler_unused,
             "the GradScaler given to the Recorder never stepped" if facts.scaler_unused else
             "DeepSpeed's scaler settings (scale_window, min_loss_scale) are not in run.meta" if facts.loss_scaled
             and not facts.has_scaler and (run.meta.get("deepspeed") or {}).get("dynamic_loss_scale") else
             "no dynamic loss scaler (no GradScaler, no DeepSpeed fp16 dynamic scaler)", []),
            ("ranks agree", facts.n_ranks > 1, "one rank", []),
            ("LR scheduler on skipped steps", run.scheduler_steps is not None,
             "no scheduler recorded: Recorder(..., scheduler=scheduler)", []),
            ("can I switch precision", facts.precision != "fp16", "already fp16", []),
            ("can I switch to block-scaled formats (MX, NVFP4, row-wise fp8)", run.blocks is not None,
             "no block statistics recorded: Recorder(..., blocks=True)", []),
            ("weight updates (stalls, master weights, optimizer state)", run.update_steps is not None,
             "no updates recorded: Recorder(..., updates=100)", [])]
    if run.meta.get("deepspeed"):                 # only runs recorded from a DeepSpeed engine have these facts
        rows.insert(4, ("DeepSpeed's skips and scale", True, "", []))
    out = []
    for name, ran, why, needs in rows:
        empty = facts.empty_rows(needs) if ran and needs else []
        if empty and len(empty) == len(needs) and needs is not facts.output_rows:   # nothing to read
            ran, why = False, f"none of its {len(needs)} rows ever filled ({_names(run, empty)})"
        elif empty:
            why = f"{len(empty)} of its {len(needs)} rows never filled: {_names(run, empty)}"
        out.append({"check": name, "ran": bool(ran), "why": why if (not ran or empty) else ""})
    if not facts.output_rows:
        out[2]["why"] = "no forward outputs recorded: Recorder(..., outputs=True) names the layer"
    unseen = [e["step"] for e in causes if e["skipped"] and e["cause"] == "unknown"]
    if unseen:
        out.append({"check": "causes of all skipped steps", "ran": False,
                    "why": f"{len(unseen)} skipped steps have no histograms or no recorded inf/nan (first: "
                           f"{unseen[:3]}; histograms every {run.meta.get('every', 1)} steps): record every step "
                           f"(every=1) and all tensors to see their cause"})
    return out


def _names(run: Run, rows: list) -> str:
    names = [run.tensor_names[t] for t in rows]
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
