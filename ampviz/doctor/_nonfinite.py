"""Where non-finite values came from: per step, the first non-finite gradient in backward order and what
caused it (the forward pass, the loss scale, or neither); the ``nonfinite_gradient`` findings (the forward's
own are in ``_forward``).

Causes of a step whose gradients (or loss) are not finite, decided in this order:

* ``"forward"``: the loss is inf/nan, or a recorded forward output holds inf/nan, or the gradient nearest
  the loss (the model output's) holds nan and no inf: the loss's backward gives nan only when the loss or
  the output is already non-finite (a loss-scale overflow makes inf). No loss scale fixes this: the loss
  scale multiplies the backward pass only.
* ``"unknown"``: the step has no histograms (``every > 1``), or no recorded tensor holds inf/nan.
* ``"not the loss scale"``: no GradScaler; or the first non-finite gradient holds nan but no inf (an
  overflow makes inf first); or that tensor's finite scaled values, and its values on the clean
  neighbouring steps at this step's scale, stay more than ``EDGE_BINADES`` binades below the format's
  largest binade (an overflow at the scale leaves a tail of large finite values next to the inf).
* ``"loss scale"``: otherwise: the scaled gradients were at the edge of the format, an ordinary overflow
  that GradScaler answers by backing off.

Partitioned gradients (DeepSpeed ZeRO 1 to 3, ``run.meta["deepspeed"]["weights"] == "partition"``): each rank
records only its own part of the gradients, and the engine skips a step when any part overflowed. A step is then
decided from all ranks together: a rank whose own part says less (``"unknown"``: its part stayed finite) or
something milder takes the cause of the rank whose part held the non-finite values, in the order ``"forward"``,
``"not the loss scale"``, ``"loss scale"``; such an entry keeps its own verdict in ``own_cause`` and names that
rank in ``cause_rank`` (its ``origin`` is then that rank's tensor). DDP ranks all-reduce the full gradients:
each decides alone.

Clipping after ``scaler.unscale_`` rewrites a skipped step's weight gradients before the Recorder reads them
(``Facts.clipped``): an infinite total norm multiplies every gradient by 0, so inf becomes nan and every finite
value 0; a nan norm makes every value nan. Their nan are then read as the inf they were, and an inf in a weight
gradient whose finite values the clip erased, at a step the scaler skipped, is an ordinary overflow; after a nan
norm the weight gradients say nothing about where it started (activation gradients, recorded in the backward
before any clip, still do).
"""

from __future__ import annotations

import numpy as np

from ._facts import CLIPPED_INF, CLIPPED_NAN, NEIGHBOURS, Facts, finding, names_text, scale_text, steps_text

CAUSES = ("forward", "loss scale", "not the loss scale", "unknown")


def step_causes(facts: Facts) -> list[dict]:
    """One plain dict per (rank, step) that was skipped or holds non-finite gradients or loss."""
    per_rank = [_rank_causes(facts, r) for r in range(facts.n_ranks)]
    if facts.partitioned and facts.n_ranks > 1:
        _join_partitions(per_rank)
    return [e for entries in per_rank for e in entries]


_JOINT = ("forward", "not the loss scale", "loss scale")          # which rank's cause a partitioned step takes
_ADOPTED = ("origin", "origin_kind", "origin_inf", "origin_nan", "next_module", "edge_gap", "forward_reason",
            "forward_origin")


def _join_partitions(per_rank: list[list[dict]]) -> None:
    """Decide each step of a partitioned run from all ranks (see the module docstring), in place."""
    by_step: dict = {}
    for entries in per_rank:
        for e in entries:
            by_step.setdefault(e["step"], []).append(e)
    for group in by_step.values():
        decided = [e for e in group if e["cause"] in _JOINT]
        if not decided:
            continue
        joint = min(decided, key=lambda e: _JOINT.index(e["cause"]))     # the first rank with the strongest cause
        overflow = any(e["scale_overflow"] for e in group)
        for e in group:
            e["scale_overflow"] = overflow
            if e["cause"] != joint["cause"]:
                e.update(own_cause=e["cause"], cause=joint["cause"], cause_rank=joint["rank"],
                         **{k: joint[k] for k in _ADOPTED if k in joint})


def _bad_loss(loss: np.ndarray) -> np.ndarray:
    # nan also stands for "no loss given" (Recorder.step() without a loss): bad only if some loss was given
    return np.isinf(loss) | (np.isnan(loss) & np.isfinite(loss).any())


def _rank_causes(facts: Facts, r: int) -> list[dict]:
    run = facts.run
    inf, nan = facts.nonfinite(r)                                               # (H, T) each
    grads = facts.grad_rows
    bad_rows = (inf[:, grads] + nan[:, grads]).sum(axis=1) > 0 if grads else np.zeros(inf.shape[0], bool)
    bad_loss = _bad_loss(run.loss[r])
    positions = np.flatnonzero(run.skipped[r] | bad_loss)
    positions = np.union1d(positions, facts.hist_pos[bad_rows]).astype(int)
    clean_rows = np.flatnonzero(~bad_rows & ~run.skipped[r][facts.hist_pos] & ~bad_loss[facts.hist_pos])
    out: list[dict] = []
    for p in positions:
        h = facts.row_of_step(p)
        entry = {"step": int(run.steps[p]), "rank": run.ranks[r], "skipped": bool(run.skipped[r, p]),
                 "loss": float(run.loss[r, p]), "loss_scale": float(run.loss_scale[r, p]), "origin": None,
                 "sources": []}
        if h is not None:
            entry.update(_origin(facts, r, h, inf[h], nan[h]))
            for src in entry["sources"]:
                src["edge_gap"] = _edge_gap(facts, r, h, p, clean_rows, src.pop("row"))
                src["cause"] = _source_cause(facts, src)
        entry["cause"] = _cause(entry, bool(bad_loss[p]), h)
        # skipped anyway by the scale, whatever else went wrong in the same step
        entry["scale_overflow"] = entry["cause"] == "loss scale" or any(
            x["cause"] == "loss scale" for x in entry["sources"])
        primary = next((x for x in entry["sources"] if x["cause"] == entry["cause"]), None)
        if primary is not None:
            entry.update(origin=primary["tensor"], origin_kind=primary["kind"], origin_inf=primary["inf"],
                         origin_nan=primary["nan"], next_module=primary["next_module"], edge_gap=primary["edge_gap"])
        out.append(entry)
    return out


def _origin(facts: Facts, r: int, h: int, inf: np.ndarray, nan: np.ndarray) -> dict:
    """The non-finite gradients of row h in backward order, the sources among them (see ``_sources``),
    the first non-finite forward output in module order."""
    run, names = facts.run, facts.run.tensor_names
    bad = [t for t in facts.grad_rows if inf[t] + nan[t] > 0]
    order, recorded = facts.backward_rank(r, h)
    bad.sort(key=lambda t: order[t])
    clipped = int(facts.clipped(r)[h])
    # after a nan norm every weight gradient is nan: none of them tells where the nan started
    blind = set(facts.weight_rows) if clipped == CLIPPED_NAN else set()
    sources = _sources(facts, [t for t in bad if t not in blind], order)
    outputs = [t for t in facts.output_rows if inf[t] + nan[t] > 0]
    nearest = min(facts.grad_rows, key=lambda g: order[g]) if facts.grad_rows else None
    return {"inf": {names[t]: int(inf[t]) for t in bad if inf[t]},
            "nan": {names[t]: int(nan[t]) for t in bad if nan[t]},
            "order_recorded": recorded, "spread": [names[t] for t in bad if t not in sources],
            "clipped": {0: None, CLIPPED_INF: "inf norm", CLIPPED_NAN: "nan norm"}[clipped],
            "forward_origin": _layer(names[outputs[0]]) if outputs else None,
            "sources": [{"tensor": names[t], "row": t, "kind": run.tensor_kinds[t], "inf": int(inf[t]),
                         "nan": int(nan[t]), "nearest_loss": t == nearest, "spread": _spread_of(t, sources, bad, names),
                         "clipped": clipped == CLIPPED_INF and run.tensor_kinds[t] == "weight",
                         "next_module": _next_module(facts, t, order)} for t in sources]}


def _spread_of(t: int, sources: list, bad: list, names: list) -> list:
    """The non-source tensors after source ``t`` in backward order, up to the next source."""
    i = bad.index(t)
    stop = min((bad.index(s) for s in sources if bad.index(s) > i), default=len(bad))
    return [names[b] for b in bad[i + 1:stop] if b not in sources]


def _sources(facts: Facts, bad: list, order: np.ndarray) -> list:
    """The non-finite tensors (``bad``, in backward order) where non-finite values started, not spread to.

    Backward carries a gradient from one module's output to the previous one's through the module
    in between, so an activation gradient whose neighbour nearer the loss is finite started there; a
    weight gradient whose module's output gradient is finite started in that module's backward.
    """
    run = facts.run
    acts = sorted((t for t in facts.grad_rows if run.tensor_kinds[t] == "activation"), key=lambda t: order[t])
    nearer = {t: (acts[i - 1] if i else None) for i, t in enumerate(acts)}
    module_row = {run.tensor_names[t]: t for t in acts}
    bad_set = set(bad)
    out: list[dict] = []
    for t in bad:
        if run.tensor_kinds[t] == "activation":
            started = nearer[t] is None or nearer[t] not in bad_set
        else:
            m = module_row.get(run.tensor_names[t].removesuffix(" [local]").rsplit(".", 1)[0])
            started = m not in bad_set if m is not None else not out
        if started:
            out.append(t)
    return out


def _next_module(facts: Facts, t: int, order: np.ndarray):
    """For an activation-gradient origin: the recorded module just before it in backward order (closer
    to the loss), whose backward (or the ops between the two) computed the non-finite gradient."""
    run = facts.run
    if run.tensor_kinds[t] != "activation":
        return None
    acts = [a for a in run.tensors_of("activation") if order[a] < order[t]]
    return run.tensor_names[max(acts, key=lambda a: order[a])] if acts else None


def _edge_gap(facts: Facts, r: int, h: int, p: int | np.integer, clean_rows: np.ndarray, t: int) -> float:
    """Binades between the largest finite scaled value of tensor ``t`` at row ``h`` (or on the clean
    neighbouring rows, at this step's scale) and the edge of the format; <= 0 means at the edge."""
    own = facts.finite_top(r, "scaled")[h, t]
    i = np.searchsorted(clean_rows, h)
    near = clean_rows[max(i - NEIGHBOURS, 0):i + NEIGHBOURS]
    log2s = np.log2(facts.run.loss_scale[r, p])
    nb = facts.finite_top(r, "unscaled")[near, t].max(initial=-np.inf) + log2s if near.size else -np.inf
    top = max(own, nb)
    return float(facts.edge_exponent() - top) if np.isfinite(top) else float("inf")


def _source_cause(facts: Facts, src: dict) -> str:
    if src["nearest_loss"] and src["nan"] and not src["inf"]:
        return "forward"            # the loss's own backward gave nan: the loss or the output was not finite
    if facts.scaler_unused:         # the loop's scale is not the one recorded: nothing says whether it overflowed
        return "unknown"
    if not facts.loss_scaled or (src["nan"] and not src["inf"]):
        return "not the loss scale"
    if src["clipped"]:              # the clip erased its finite values (and shrank its neighbours'): no evidence
        return "loss scale"         # against the ordinary explanation of an inf at a scaled step
    if src["edge_gap"] == float("inf"):   # no finite value to measure against the format's edge, at this step or
        return "unknown"                    # a clean one near it: every value inf is what too high a scale does too
    return "loss scale" if src["edge_gap"] <= 0 else "not the loss scale"


def _cause(e: dict, bad_loss: bool, h) -> str:
    if bad_loss or e.get("forward_origin"):
        e["forward_reason"] = "loss" if bad_loss else "output"
        return "forward"
    if h is None or not e["sources"]:
        return "unknown"
    causes = {x["cause"] for x in e["sources"]}
    for cause in ("forward", "not the loss scale", "loss scale"):
        if cause in causes:
            if cause == "forward":
                e["forward_reason"] = "output gradient"
            return cause
    return "unknown"


# ---------------------------------------------------------------------------------------- findings
def nonfinite_findings(facts: Facts, causes: list[dict]) -> list[dict]:
    """One error per module whose backward made non-finite gradients that the loss scale does not explain, named
    by the first tensor that held them (a layer's output gradient before its weights': it carries them on)."""
    groups: dict = {}
    for e in causes:
        if e["cause"] == "forward":
            continue
        made: dict = {}
        for src in e["sources"]:
            if src["cause"] == "not the loss scale":
                made.setdefault(_made_in(src), []).append(src)
        for srcs in made.values():
            src = min(srcs, key=lambda x: x["kind"] != "activation")
            also = [x["tensor"] for x in srcs if x is not src]
            groups.setdefault(_made_in(src), []).append(dict(
                e, origin=src["tensor"], origin_kind=src["kind"], origin_inf=src["inf"], origin_nan=src["nan"],
                next_module=src["next_module"], edge_gap=src["edge_gap"], also=also,
                spread=list(dict.fromkeys(n for x in srcs for n in x["spread"] if n not in also))))
    out = []
    for entries in groups.values():
        first = entries[0]
        origin = first["origin"]
        steps = sorted({e["step"] for e in entries})
        also = list(dict.fromkeys(n for e in entries for n in e["also"]))
        spread = list(dict.fromkeys(n for e in entries for n in e["spread"] if n not in also))
        kind = "gradient of its output" if first["origin_kind"] == "activation" else "weight gradient"
        what = _inf_nan(first["origin_inf"], first["origin_nan"])
        applied = [e["step"] for e in entries if not e["skipped"]]
        summary = (f"non-finite gradients start at {origin} ({kind}: {what})"
                   + (f" and, in the same backward, {names_text(also, 3)}" if also else "")
                   + f" at {_n_steps(steps)}; not caused by the loss scale"
                   + (f"; spread to {len(spread)} more tensors" if spread else ""))
        details = [_step_line(facts, e) for e in entries[:3]]
        if len(entries) > 3:
            details.append(f"... and {len(entries) - 3} more steps: {steps_text(steps[3:])}")
        if applied:
            details.append(f"the optimizer applied these steps (no GradScaler skipped them): {steps_text(applied)}; "
                           f"the weights may now hold inf/nan")
        details += clip_lines(entries)
        if not first["order_recorded"]:
            details.append("backward order not recorded in this run: guessed from the module order")
        out.append(finding(
            "nonfinite_gradient", "error", summary, steps=steps, tensors=[origin] + also + spread,
            ranks=sorted({e["rank"] for e in entries}), details=details,
            evidence={"origin": origin, "origin_kind": first["origin_kind"], "steps": steps,
                      "per_step": [{k: e[k] for k in ("step", "rank", "skipped", "loss_scale", "inf", "nan",
                                                      "edge_gap")} for e in entries[:20]],
                      "applied_steps": applied, "next_module": first.get("next_module"), "same_backward": also},
            recommendation=_origin_advice(first)))
    return out


def _made_in(src: dict) -> str:
    """The module whose backward made a source's non-finite values: a weight gradient's own module; for the
    gradient of a module's output, the recorded module after it (its backward, or the ops in between)."""
    if src["kind"] == "activation":
        return src["next_module"] or ""
    return src["tensor"].removesuffix(" [local]").rsplit(".", 1)[0]


def _n_steps(steps) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"{len(steps)} steps ({steps_text(steps)})"


def _inf_nan(n_inf: int, n_nan: int) -> str:
    parts = [f"{n_inf} inf" if n_inf else "", f"{n_nan} nan" if n_nan else ""]
    return " and ".join(p for p in parts if p) or "no inf or nan"


def _step_line(facts: Facts, e: dict) -> str:
    spread = [f"{n} ({_inf_nan(e['inf'].get(n, 0), e['nan'].get(n, 0))})" for n in e["spread"]]
    edge = facts.edge_exponent()
    gap = e["edge_gap"]
    reach = (f"{e['origin']} has no finite value" if gap == float("inf") else
             f"its finite scaled values reach 2^{edge - gap + 1:g}")
    return (f"step {e['step']} (rank {e['rank']}, loss scale {scale_text(e['loss_scale'])}, "
            f"{'skipped' if e['skipped'] else 'applied'}): {e['origin']} holds "
            f"{_inf_nan(e['origin_inf'], e['origin_nan'])}" + (f", then {names_text(spread, 4)}" if spread else "")
            + f"; {reach}, {facts.grad_format.name} overflows from 2^{facts.grad_format.emax + 1}")


CLIP_TEXT = {"inf norm": "every weight gradient holds only nan and zeros, as clip_grad_norm_ leaves them after an "
                         "infinite total norm (inf x 0 = nan, finite x 0 = 0), or an overflow that reached every "
                         "weight: their nan are read as the inf they were",
             "nan norm": "every weight gradient is nan (clip_grad_norm_ after a nan total norm, or a nan that "
                         "reached every weight): they do not tell where it started; the activation gradients, "
                         "recorded in the backward before any clip, do"}


def partition_lines(entries) -> list[str]:
    """One line per rank whose part of the partitioned gradients decided these steps for another rank."""
    by: dict = {}
    for e in entries:
        if e.get("cause_rank") is not None:
            own = "stayed finite" if not e["sources"] else f"alone read as \"{e['own_cause']}\""
            by.setdefault((e["cause_rank"], e["rank"], own, e["cause"]), []).append(e["step"])
    return [f"{_steps_word(steps)}: rank {r}'s part of the gradients {own}; " + (
            f"rank {k}'s forward pass was not finite (its loss or output), and the gradient reduction carried it into "
            f"every rank's part" if cause == "forward" else
            f"the partition on rank {k} held the non-finite values (cause: {cause})")
            + "; ZeRO partitions the gradients: each rank records only its own part, and the engine skips a step when "
              "any part overflows" for (k, r, own, cause), steps in sorted(by.items())]


def _steps_word(steps: list) -> str:
    steps = sorted(set(steps))
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps_text(steps)}"


def clip_lines(entries) -> list[str]:
    """One line per way clipping rewrote the weight gradients of these steps (``CLIP_TEXT``), with the steps."""
    by: dict = {}
    for e in entries:
        if e.get("clipped"):
            by.setdefault(e["clipped"], []).append(e["step"])
    return [f"steps {steps_text(sorted(set(steps)))}: {CLIP_TEXT[how]}" for how, steps in by.items()]


def _origin_advice(e: dict) -> str:
    origin, nxt = e["origin"], e.get("next_module")
    if e["origin_kind"] == "activation":
        where = (f"the backward of {nxt} or of the ops between {origin} and {nxt}" if nxt
                 else f"the ops between {origin} and the loss")
        first = f"The gradient of {origin}'s output went non-finite first: it was computed by {where}."
    else:
        first = f"{origin}'s gradient went non-finite first, in the backward of its own module."
    return (first + " Look there for a division by zero, log or sqrt of 0, an exp or pow that overflows, or a "
            "custom autograd function; torch.autograd.detect_anomaly() on that step names the op. "
            "A lower loss scale does not fix it.")


def _layer(name: str) -> str:
    """The module of a forward-output row ("fc2 [output]" -> "fc2")."""
    return name.removesuffix(" [output]")
