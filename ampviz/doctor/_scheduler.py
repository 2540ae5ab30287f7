"""An LR scheduler that steps on skipped steps (``scheduler_on_skipped``), from ``Run.scheduler_steps``."""

from __future__ import annotations

import numpy as np

from ._facts import Facts, finding, steps_text


def scheduler_findings(facts: Facts) -> list[dict]:
    """How many LR-scheduler steps advanced on steps the scaler skipped (rank 0)."""
    run = facts.run
    if run.scheduler_steps is None or run.n_steps == 0:
        return []
    last_epoch = run.scheduler_steps[0].astype(np.int64)
    start = _scheduler_start(run, last_epoch)
    # step 0 advanced if last_epoch moved from where it was when recording began (not judged if unknown)
    advanced = np.diff(np.concatenate([[last_epoch[0] if start is None else start], last_epoch])) > 0
    hit = np.flatnonzero(advanced & run.skipped[0])
    if not hit.size:
        return []
    steps = run.steps[hit].tolist()
    n_skipped = int(run.skipped[0].sum())
    taken = run.n_steps - n_skipped
    return [finding(
        "scheduler_on_skipped", "warning", f"the LR scheduler advanced on {len(hit)} of {n_skipped} skipped steps: "
        f"its schedule runs {len(hit)} steps ahead of the optimizer", steps=steps, ranks=[run.ranks[0]],
        evidence={"advanced_on_skipped": len(hit), "skipped": n_skipped, "optimizer_steps": taken,
                  "scheduler_last_epoch": int(last_epoch[-1]), "scheduler_start": start},
        details=[f"scheduler advanced on skipped steps {steps_text(steps)}",
                 f"after {run.n_steps} steps: {taken} optimizer updates, scheduler last_epoch {int(last_epoch[-1])}"],
        recommendation=SCHEDULER_ADVICE)]


SCHEDULER_ADVICE = (
    "Step the scheduler only on steps the optimizer took: `before = scaler.get_scale(); scaler.update(); if "
    "scaler.get_scale() >= before: scheduler.step()` (get_scale() waits for the device, but GradScaler.step already "
    "waits once per step for its inf check, torch 2.13, so this adds little). Each skipped step the scheduler takes "
    "puts the schedule one step ahead of the optimizer: warm-up ends early and the first updates get a larger "
    "learning rate than planned, by the skips' share of the warm-up. Counting only real steps, a schedule sized to "
    "the loop's steps does not reach its end when steps were skipped. HF's Trainer skips the scheduler when "
    "accelerate's optimizer_step_was_skipped is set (accelerate 1.15 sets it when GradScaler did not call the "
    "optimizer's step; a fused optimizer, HF's default adamw_torch_fused, is always called, so it never is); "
    "Lightning steps schedulers on skipped steps (Lightning#16228, #18828).")


def _scheduler_start(run, last_epoch: np.ndarray):
    """The scheduler's ``last_epoch`` when recording began: stored in the run's metadata (by the Recorder), or
    0 for a fresh scheduler (a torch scheduler's constructor leaves ``last_epoch`` at 0, so after the first step it is 0
    or 1); None when unknown (a resumed scheduler)."""
    sched = run.meta.get("scheduler")
    value = sched.get("last_epoch_at_start") if isinstance(sched, dict) else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return 0 if last_epoch[0] in (0, 1) else None
