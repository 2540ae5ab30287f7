"""Loss-scale health: a too-high init_scale, a collapsing scale, skips more frequent than the growth
interval allows, a scale growing without bound, and ranks that disagree. Each finding quotes the steps and
scales, and what replays of other scalers would have done over the recorded gradient trace
(``ampviz.replay.replay``: a counterfactual). The scaler is the run's own, read by ``policy_from_run``: a
GradScaler (``growth_interval``), or DeepSpeed's fp16 DynamicLossScaler (``scale_window``, ``hysteresis``)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..replay import DeepSpeedPolicy, MegatronPolicy, StaticPolicy, TorchPolicy, policy_from_run, replay, trace_from_run
from ..replay.policies import Policy
from ._facts import Facts, best_static_log2, finding, scale_text, steps_text
from ._nonfinite import clip_lines, partition_lines

COLLAPSE_STREAK = 6         # consecutive skips (the scale / 64 with GradScaler's backoff 0.5) that make a collapse
SETTLE_GAP = 4              # clean steps after which a too-high init_scale has settled (fewer: still backing off)
FREQUENT_MIN = 3           # loss-scale overflows after the start before frequent_skips can be reported
UNBOUNDED_LOG2 = 40         # a loss scale of 2**40 or more: every gradient is below 2**-24, fp16's smallest


def streaks(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) positions of the runs of True in a 1-D bool array."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


class _Scales:
    """Rank 0's scale trace split into an initial burst of skips, collapses and the steady rest."""

    def __init__(self, facts: Facts, causes: list[dict]):
        run = self.run = facts.run
        self.facts = facts
        self.skipped, self.scale, self.next = run.skipped[0], run.loss_scale[0], run.next_scale[0]
        self.cause = {e["step"]: e for e in causes if e["rank"] == run.ranks[0]}
        self.policy = policy = policy_from_run(run)
        # DeepSpeed's scaler grows after scale_window clean steps and backs off only once its hysteresis is used up
        self.deepspeed = isinstance(policy, DeepSpeedPolicy)
        self.interval = int(policy.scale_window if isinstance(policy, DeepSpeedPolicy) else
                            policy.growth_interval if isinstance(policy, TorchPolicy) else 0)
        self.hysteresis = int(policy.hysteresis) if isinstance(policy, DeepSpeedPolicy) else 1
        self.scaler_name = "DeepSpeed's loss scaler" if self.deepspeed else "GradScaler"
        runs = streaks(self.skipped)
        self.burst = self._backing_off(runs)
        after = self.burst[1] if self.burst else 0
        self.collapses = [s for s in runs if s[0] >= after and (s[1] - s[0] >= COLLAPSE_STREAK
                                                               or self.next[s[0]:s[1]].min() < 1)]
        steady = np.ones(run.n_steps, dtype=bool)
        for a, b in ([self.burst] if self.burst else []) + self.collapses:
            steady[a:b] = False
        self.steady = steady
        self._trace: np.ndarray | None = None

    def _backing_off(self, runs: list):
        """(0, stop): the start of a run whose first step was skipped, until the scale settled: the skips (all by
        the scale) before the scale first grew, each fewer than SETTLE_GAP clean steps after the previous one (the
        gradients fluctuate around fp16's edge while the scale comes down, so some steps pass on the way)."""
        if not runs or runs[0][0] != 0:
            return None
        grown = self.run.grown[0]
        stop = runs[0][1]
        for a, b in runs[1:]:
            if a - stop >= SETTLE_GAP or grown[stop:a].any():
                break
            stop = b
        skipped = np.flatnonzero(self.skipped[:stop])
        if stop == self.run.n_steps or self.next[stop - 1] < 1 or not all(self._by_scale(p) for p in skipped):
            return None
        return (0, stop)

    def clip_lines(self, positions) -> list[str]:
        """How clipping rewrote the weight gradients of the steps at these positions (evidence read as such), and
        which rank's partition decided them (partitioned gradients, ``_nonfinite.partition_lines``)."""
        entries = [self.cause[s] for s in self.run.steps[list(positions)].tolist() if s in self.cause]
        return clip_lines(entries) + partition_lines(entries)

    def _cause(self, p: int | np.integer) -> str:
        e = self.cause.get(int(self.run.steps[p]))
        return e["cause"] if e else "unknown"

    def _by_scale(self, p: int | np.integer) -> bool:
        """The step at position p overflowed because of the scale (or nothing says otherwise)."""
        e = self.cause.get(int(self.run.steps[p]))
        return e is None or e["cause"] == "unknown" or e["scale_overflow"]

    @property
    def trace(self) -> np.ndarray:
        if self._trace is None:
            if self.facts.grad_rows:
                # partitioned gradients: trace_from_run takes the largest over the ranks' parts
                trace = trace_from_run(self.run, self.facts.grad_format, tensors=self.facts.grad_rows)
            else:                        # no gradient recorded: only which steps overflowed is known
                trace = np.where(self.skipped, np.inf, 0.0)
            # a step non-finite for another reason than the scale overflows at every scale: inf, not the
            # recorded overflow bound (which a smaller scale would pass)
            for p in np.flatnonzero(self.skipped):
                if self._cause(p) in ("forward", "not the loss scale"):
                    trace[p] = np.inf
            self._trace = trace
        return self._trace

    def replays(self, policies: dict, window) -> dict:
        """{label: {"skipped": skips inside window, "crashed_at": step or None}} over the recorded trace;
        ``window`` is a (start, stop) pair of positions or a (N,) bool mask."""
        mask = window if isinstance(window, np.ndarray) else np.zeros(self.run.n_steps, dtype=bool)
        if not isinstance(window, np.ndarray):
            mask[window[0]:window[1]] = True
        out = {}
        for label, policy in policies.items():
            rep = replay(policy, self.trace, self.facts.grad_format)
            crashed = None if rep.crashed_at is None else int(self.run.steps[rep.crashed_at])
            out[label] = {"skipped": int(rep.skipped[mask[:rep.skipped.size]].sum()), "crashed_at": crashed,
                          "final_scale": rep.final_scale}
        return out

    def best_static(self) -> int | None:
        """log2 of the largest static scale at which no clean recorded step overflows (None: no clean step)."""
        return best_static_log2(self.trace, self.facts.grad_format)

    def alternatives(self, slower_growth: bool = True) -> dict:
        """Other scalers to replay: as recorded, (growing 4x less often,) PyTorch or DeepSpeed, Megatron, best
        static."""
        p, g = self.policy, self.interval
        alts: dict[str, Policy] = {}
        if isinstance(p, DeepSpeedPolicy):
            alts[f"DeepSpeed as recorded (hysteresis {p.hysteresis}, scale_window {g})"] = p
            if slower_growth:
                alts[f"DeepSpeed, scale_window {4 * g}"] = dataclasses.replace(p, scale_window=4 * g)
            if p.init_scale <= np.finfo(np.float32).max:
                alts[f"PyTorch (growth_interval {g})"] = TorchPolicy(init_scale=p.init_scale, growth_interval=g)
        elif isinstance(p, TorchPolicy):
            alts[f"PyTorch as recorded (growth_interval {g})"] = p
            if slower_growth:
                alts[f"PyTorch, growth_interval {4 * g}"] = TorchPolicy(p.init_scale, p.growth_factor,
                                                                        p.backoff_factor, 4 * g)
            alts[f"DeepSpeed (hysteresis 2, scale_window {g})"] = DeepSpeedPolicy(
                init_scale=p.init_scale, scale_window=g, min_scale=min(1.0, p.init_scale),
                raise_error_at_min_scale=True)
        alts[f"Megatron (hysteresis 2, growth_interval {g})"] = MegatronPolicy(
            init_scale=p.init_scale, min_scale=min(1.0, p.init_scale), growth_interval=g)
        s = self.best_static()
        if s is not None:
            alts[f"static 2^{s}"] = StaticPolicy(init_scale=2.0 ** s)
        return alts


def _replay_lines(replays: dict, n: int) -> list[str]:
    lines = []
    for label, r in replays.items():
        crash = ("" if r["crashed_at"] is None else
                 f"; stops the run at step {r['crashed_at']} (loss scale already at minimum)")
        lines.append(f"replay, {label}: {r['skipped']} of these {n} steps skipped{crash}")
    return lines


_REPLAY_CAVEAT = ("Replays run other scalers over this run's recorded gradients: a counterfactual (a different "
                  "scale would have changed which steps were taken, and so every later gradient).")


def scale_findings(facts: Facts, causes: list[dict]) -> list[dict]:
    """Scale-health findings of rank 0's trace (none for a run without a dynamic loss scaler: a GradScaler, or
    DeepSpeed's fp16 one)."""
    if not facts.dynamic_scaler or facts.run.n_steps == 0:
        return []
    if facts.scaler_unused:
        return [_unused_finding(facts)]
    sc = _Scales(facts, causes)
    out = []
    if sc.burst:
        out.append(_init_finding(sc))
    out += [_collapse_finding(sc, s) for s in sc.collapses]
    for make in (_frequent_finding, _unbounded_finding):
        f = make(sc)
        if f:
            out.append(f)
    return out


def _unused_finding(facts: Facts) -> dict:
    """The GradScaler given to the Recorder never stepped: the recorded scale is a bystander's."""
    run = facts.run
    scales = np.unique(run.loss_scale[0])
    return finding(
        "scaler_unused", "error",
        f"the GradScaler given to the Recorder never stepped in {run.n_steps} recorded steps: the loss scale "
        f"({', '.join(scale_text(s) for s in scales[:3])}) and the skipped steps recorded are not the loop's",
        steps=run.steps[:1], evidence={"steps": run.n_steps, "steps_called": 0, "recorded_scales": scales[:3]},
        details=["its step() was not called once while the Recorder watched it, so the loop scaled its loss and "
                 "stepped its optimizer with another GradScaler, or with none; the scale findings were not "
                 "checked (they would judge this bystander's constant scale)"],
        recommendation="give the Recorder the GradScaler whose scale(loss).backward() and step(optimizer) the loop "
                       "calls: Recorder(model, optimizer, scaler), with the same object")


def _init_finding(sc: _Scales) -> dict:
    a, b = sc.burst
    run, p = sc.run, sc.policy
    settled = float(sc.next[b - 1])
    skipped = np.flatnonzero(sc.skipped[a:b]) + a
    steps = run.steps[skipped].tolist()
    rep = sc.replays({f"init_scale {scale_text(settled)}": dataclasses.replace(p, init_scale=settled)}, (a, b))
    n = len(steps)
    which = (f"the first {n} step{'s were' if n > 1 else ' was'}" if n == b - a else
             f"{n} of the first {b - a} steps were")
    return finding(
        "init_scale_too_high", "info", f"init_scale {scale_text(sc.scale[0])} is too high: {which} skipped while the "
        f"scale backed off to {scale_text(settled)}; harmless", steps=steps, ranks=[run.ranks[0]],
        evidence={"skipped_at_start": n, "backing_off_steps": b - a, "init_scale": float(sc.scale[0]),
                  "settled_scale": settled, "replays": rep},
        details=[f"steps {steps_text(steps)} skipped, loss scale {scale_text(sc.scale[0])} -> {scale_text(settled)}"
                 + ("" if n == b - a else " (the steps between them passed at the scales on the way down)"),
                 *sc.clip_lines(skipped), *_replay_lines(rep, b - a), _REPLAY_CAVEAT],
        recommendation=f"Harmless: {_backs_off(sc)}, so this costs {n} optimizer step{'s' if n > 1 else ''} "
                       f"once. To avoid them, start lower: {_start_lower(sc, settled)}. Don't mistake them for "
                       f"instability, and step the LR scheduler only on steps that were not skipped.")


def _backs_off(sc: _Scales) -> str:
    if not sc.deepspeed or sc.hysteresis == 1:
        return f"{sc.scaler_name} backs off on every overflow"
    h = sc.hysteresis
    first = "its first overflow only skips" if h == 2 else f"its first {h - 1} overflows only skip"
    return f"{sc.scaler_name} backs off on an overflow once its hysteresis ({sc.hysteresis}) is used up ({first})"


def _start_lower(sc: _Scales, settled: float) -> str:
    if not sc.deepspeed:
        return f"GradScaler(device, init_scale={_python_number(settled)})"
    m, e = math.frexp(settled)
    power = e - 1 if m == 0.5 else math.floor(math.log2(settled))
    return f'"fp16": {{"initial_scale_power": {power}}} in the DeepSpeed config (2^{power})'


_COLLAPSE_ADVICE = {
    "forward": "The forward pass overflows (see the forward_overflow finding): no loss scale fixes it, and "
               "the scaler halves the scale at every step. Run the overflowing op in bf16 or fp32.",
    "not the loss scale": "The gradients are non-finite at every scale (see the nonfinite_gradient finding for "
                          "the layer): fix that op; backing off only skips every step.",
    "loss scale": "The gradients grow faster than the scaler backs off: training is diverging. Lower the "
                  "learning rate, clip gradients (CLIP), check the data of those steps.",
    "unknown": "Nothing recorded says why these steps were non-finite: they have no histograms (record with "
               "every=1), or their inf tensors hold no finite value to measure against the format's edge, which is "
               "what a scale far above what the gradients allow does (try a lower init_scale: if the skips stop, "
               "it was the scale).",
}


def _collapse_finding(sc: _Scales, span: tuple[int, int]) -> dict:
    a, b = span
    run = sc.run
    steps = run.steps[a:b].tolist()
    causes = [sc._cause(p) for p in range(a, b)]
    tally = {c: causes.count(c) for c in dict.fromkeys(causes)}
    main = max(tally, key=tally.__getitem__)
    # a forward overflow makes every gradient nan: name the first overflowing output, not a gradient
    origins = [sc.cause[s].get("forward_origin") if sc.cause[s]["cause"] == "forward" else sc.cause[s].get("origin")
               for s in steps if s in sc.cause]
    origins = [o for o in origins if o]
    lowest = float(sc.next[a:b].min())
    ended = b == run.n_steps
    rep = sc.replays(sc.alternatives(slower_growth=False), (a, b))
    n = b - a
    summary = (f"the loss scale collapsed: {n} consecutive skipped steps ({steps_text(steps)}), "
               f"{scale_text(sc.scale[a])} -> {scale_text(lowest)}" + (" (below 1)" if lowest < 1 else "")
               + ("; still skipping when the run ended" if ended else ""))
    details = ["causes of these steps: " + ", ".join(f"{c}: {k}" for c, k in tally.items())]
    details += partition_lines(sc.cause[s] for s in steps if s in sc.cause)
    if origins:
        common = max(set(origins), key=origins.count)
        details.append(f"first non-finite {'output' if main == 'forward' else 'gradient'} on "
                       f"{origins.count(common)} of them: {common}")
    details += _replay_lines(rep, n) + [_REPLAY_CAVEAT]
    return finding(
        "scale_collapse", "error", summary, steps=steps, ranks=[run.ranks[0]],
        tensors=sorted(set(origins), key=origins.index),
        evidence={"skipped": n, "first_step": steps[0], "last_step": steps[-1], "scale_before": float(sc.scale[a]),
                  "lowest_scale": lowest, "ended_skipping": ended, "causes": tally, "replays": rep},
        details=details, recommendation=_COLLAPSE_ADVICE[main].replace("(CLIP)", _clip(sc)))


def _frequent_finding(sc: _Scales):
    run, g, h = sc.run, sc.interval, sc.hysteresis
    counted = [p for p in np.flatnonzero(sc.skipped & sc.steady) if sc._by_scale(p)]
    n_steady = int(sc.steady.sum())
    # a growth probe costs one skip every g + 1 steps; DeepSpeed's, with its hysteresis refilled by the growth, up
    # to h skips every g + 1 + h steps (the scale stays up until the last one backs it off)
    period = g + 1 if h == 1 else g + 1 + h
    allowed = h * (n_steady // period + 1)
    probes = (f"GradScaler's growth probes explain {allowed} (one per growth_interval + 1 = {period} steps)"
              if not sc.deepspeed else
              f"DeepSpeed's growth probes explain {allowed} ({h} per scale_window + {period - g} = {period} steps"
              f"{', hysteresis ' + str(h) if h > 1 else ''})")
    # a little slack: twice what the growth interval allows, and at least FREQUENT_MIN skips
    if len(counted) < FREQUENT_MIN or len(counted) <= 2 * allowed:
        return None
    steps = run.steps[counted].tolist()
    rep = sc.replays(sc.alternatives(), sc.steady)          # skips on the same steps the finding counts
    return finding(
        "frequent_skips", "warning", f"{len(counted)} loss-scale overflows in {n_steady} steps after the start, where "
        f"{probes}", steps=steps, ranks=[run.ranks[0]],
        evidence={"skipped": len(counted), "steady_steps": n_steady,
                  ("scale_window" if sc.deepspeed else "growth_interval"): g, "allowed": allowed, "replays": rep},
        details=[f"skipped steps: {steps_text(steps)}", *sc.clip_lines(counted)] + [
            f"replay, {k}: {v['skipped']} skipped on these {n_steady} steps" + (
                f"; stops the run at step {v['crashed_at']}" if v["crashed_at"] is not None else "")
            for k, v in rep.items()] + [_REPLAY_CAVEAT],
        recommendation="Each skip discards a batch: the gradients' maximum jumps by more than the growth factor "
                       "between steps. A scaler that grows less often or one with hysteresis skips fewer (replays "
                       "above); if the jumps are loss spikes, lower the learning rate or clip gradients "
                       f"{_clip(sc)}.")


def _clip(sc: _Scales) -> str:
    return '("gradient_clipping" in the DeepSpeed config)' if sc.deepspeed else "(after scaler.unscale_)"


def _unbounded_finding(sc: _Scales):
    run = sc.run
    top = float(sc.next.max())
    if not top >= 2.0 ** UNBOUNDED_LOG2:
        return None
    first = int(np.flatnonzero(sc.next >= 2.0 ** UNBOUNDED_LOG2)[0])
    grew = np.flatnonzero(run.grown[0]).tolist()
    finite = sc.trace[np.isfinite(sc.trace) & (sc.trace > 0)]
    largest = float(finite.max()) if finite.size else 0.0
    # GradScaler keeps its scale in float32 and stops growing below inf; DeepSpeed's is a Python float
    capped = isinstance(sc.policy, TorchPolicy) and top * sc.policy.growth_factor > float(np.finfo(np.float32).max)
    details = [f"the scale grew at steps {steps_text(run.steps[grew].tolist())} to {scale_text(top)}"
               + (" (float32's cap: GradScaler grows no further)" if capped else ""),
               f"largest unscaled gradient of the run: {scale_text(largest) if largest else '0'}"]
    return finding(
        "scale_unbounded", "warning", f"the loss scale grew without bound to {scale_text(top)} (from step "
        f"{int(run.steps[first])}): the gradients stay tiny", steps=run.steps[grew].tolist(), ranks=[run.ranks[0]],
        evidence={"max_scale": top, "first_step_above": int(run.steps[first]), "largest_unscaled_gradient": largest,
                  "float32_cap": bool(capped)},
        details=details,
        recommendation=f"The update itself is fine ({sc.scaler_name} unscales in fp32), but gradients this small "
                       "usually mean a vanishing loss or dead layers: check the loss and the layers' gradients. When "
                       "the gradients recover, the scale must back off from this height one skipped step per halving.")


def deepspeed_findings(facts: Facts) -> list[dict]:
    """Findings of a run recorded from a DeepSpeed engine (``run.meta["deepspeed"]``, rank 0's trace): steps that
    DeepSpeed skipped in a run without loss scaling (bf16, fp32), and an fp16 scale pinned at ``min_loss_scale``."""
    ds = facts.run.meta.get("deepspeed")
    run = facts.run
    if not isinstance(ds, dict) or run.n_steps == 0:
        return []
    skipped = run.skipped[0]
    out = []
    if ds.get("dtype") != "fp16" and skipped.any():
        pos = np.flatnonzero(skipped)
        steps = run.steps[pos].tolist()
        n = len(steps)
        plural = "s" if n > 1 else ""
        out.append(finding(
            "silent_skips", "warning", f"DeepSpeed skipped {n} step{plural} of this {ds.get('dtype')} run "
            f"(step{plural} {steps_text(steps)}): non-finite gradients, weights not updated, with no loss scale to "
            f"back off, so nothing but a log line says so", steps=steps, ranks=[run.ranks[0]],
            evidence={"skipped": n, "steps": steps, "engine_skipped_steps": ds.get("skipped_steps"),
                      "stage": ds.get("stage"), "dtype": ds.get("dtype")},
            details=[f"engine.skipped_steps = {ds.get('skipped_steps')} at the end of the recording; "
                     f"engine.was_step_applied() was False after step{plural} {steps_text(steps)}"],
            recommendation="DeepSpeed drops a step whose gradients hold inf/nan also without loss scaling (bf16): "
                           "each one loses a batch, and a persistent cause stops training silently. Find where the "
                           "inf/nan start (the nonfinite_gradient / forward_overflow findings name the tensor) and "
                           "fix that op or the data of those steps; check that the LR scheduler does not advance "
                           "on skipped steps."))
    floor = ds.get("min_loss_scale")
    if ds.get("dtype") == "fp16" and floor is not None:
        at_min = run.loss_scale[0] <= float(floor)
        pinned = np.flatnonzero(at_min & skipped)
        if pinned.size:
            steps = run.steps[pinned].tolist()
            n_min = int(at_min.sum())
            plural = "s" if len(steps) > 1 else ""
            out.append(finding(
                "scale_at_minimum", "error", f"the loss scale is pinned at min_loss_scale {scale_text(float(floor))}: "
                f"{len(steps)} step{plural} overflowed at the minimum (step{plural} {steps_text(steps)}), where "
                f"DeepSpeed cannot back off further", steps=steps, ranks=[run.ranks[0]],
                evidence={"min_loss_scale": float(floor), "steps_at_minimum": n_min, "skipped_at_minimum": len(steps),
                          "hysteresis": ds.get("hysteresis"), "engine_skipped_steps": ds.get("skipped_steps")},
                details=[f"{n_min} of {run.n_steps} steps ran at the minimum scale; skipped among them: "
                         f"{steps_text(steps)}",
                         "with raise_error_at_min_scale (DeepSpeed's default) the next such overflow ends the run "
                         "(\"Current loss scale already at minimum\"); without it every such step is skipped"
                         + (f" (raise_error_at_min_scale: {ds['raise_error_at_min_scale']})"
                            if ds.get("raise_error_at_min_scale") is not None else "")],
                recommendation="The gradients overflow fp16 even at the smallest scale allowed: this is not a "
                               "scaling problem. Lower min_loss_scale only if the overflows are rare spikes; otherwise "
                               "find the overflowing tensor (nonfinite_gradient), lower the learning rate or clip, "
                               "or train in bf16."))
    return out


def rank_findings(facts: Facts) -> list[dict]:
    """Under DDP every rank sees the same all-reduced gradients: scales and skips must agree."""
    run = facts.run
    if facts.n_ranks < 2 or run.n_steps == 0:
        return []
    differ = np.flatnonzero((run.loss_scale != run.loss_scale[0]).any(axis=0)
                            | (run.skipped != run.skipped[0]).any(axis=0))
    if not differ.size:
        return []
    steps = run.steps[differ].tolist()
    lines = []
    for p in differ[:3]:
        lines.append(f"step {int(run.steps[p])}: " + ", ".join(
            f"rank {r} scale {scale_text(run.loss_scale[i, p])}{' skipped' if run.skipped[i, p] else ''}"
            for i, r in enumerate(run.ranks)))
    return [finding(
        "ranks_disagree", "error", f"ranks disagree on the loss scale or on skipping at {len(steps)} steps "
        f"(first at step {steps[0]})", steps=steps, ranks=run.ranks,
        evidence={"steps": steps, "skipped_per_rank": run.skipped.sum(axis=1).tolist(),
                  "first": {str(r): {"loss_scale": float(run.loss_scale[i, differ[0]]),
                                     "skipped": bool(run.skipped[i, differ[0]])} for i, r in enumerate(run.ranks)}},
        details=lines,
        recommendation="Under DDP all ranks all-reduce the same gradients and must skip together. Check that "
                       "every rank calls scaler.step/update the same number of times; sharded gradients (FSDP, "
                       "ZeRO) need found_inf all-reduced (ShardedGradScaler); don't unscale_ or clip local "
                       "gradients before the all-reduce.")]


def _python_number(value: float) -> str:
    """``1048576.0`` -> ``"2.0**20"``, other numbers as ``repr`` would write them."""
    m, e = math.frexp(value)
    return f"2.0**{e - 1}" if m == 0.5 else repr(float(value))
