"""Forward overflow: recorded forward outputs that overflow their dtype (named by the first layer in module order)
or come within a factor 2 of it, and a non-finite loss when no output names the layer. No loss scale fixes
these: the loss scale multiplies the backward pass only."""

from __future__ import annotations

import numpy as np

from ..formats import get_format
from ._facts import Facts, finding, names_text, steps_text
from ._nonfinite import _inf_nan, _layer, _n_steps, partition_lines


def forward_findings(facts: Facts, causes: list[dict]) -> list[dict]:
    """Errors for forward outputs that overflowed (by first layer in module order) or a non-finite loss;
    a warning for outputs within one binade of their dtype's maximum."""
    out = _overflowing_outputs(facts)
    seen = {s for f in out for s in f["steps"]}
    lost = [e for e in causes if e["cause"] == "forward" and e["step"] not in seen and not e.get("forward_origin")
            and e.get("cause_rank") is None]                    # another rank's partition: reported there
    if lost:
        steps = sorted({e["step"] for e in lost})
        hint = ("" if facts.output_rows else
                " Record the forward outputs (Recorder(..., outputs=True)) to name the layer that overflowed.")
        by_grad = [e for e in lost if e["forward_reason"] == "output gradient"]
        what = ("the loss was not finite" if not by_grad else
                f"the gradient of the model's output ({by_grad[0]['origin']}) was nan, so the loss or the output "
                f"was not finite")
        out.append(finding(
            "forward_overflow", "error", f"{what} at {_n_steps(steps)}: the forward pass overflowed or produced "
            f"nan", steps=steps, ranks=sorted({e["rank"] for e in lost}),
            evidence={"steps": steps, "loss": [e["loss"] for e in lost[:20]],
                      "reasons": sorted({e["forward_reason"] for e in lost})},
            details=[f"step {e['step']} (rank {e['rank']}): loss {e['loss']:g}"
                     + (f", {e['origin']} holds {_inf_nan(e['origin_inf'], e['origin_nan'])}"
                        if e["forward_reason"] == "output gradient" else "") for e in lost[:3]]
            + partition_lines(e for e in causes if e["cause"] == "forward" and e["step"] in steps),
            recommendation="No loss scale fixes this: the loss scale multiplies the backward pass only. Run the op "
                           "that overflows in bf16 or fp32 (bf16 autocast, or autocast(enabled=False) around it "
                           "with its inputs cast to float32)." + hint))
    return out + _headroom(facts)


def _overflowing_outputs(facts: Facts) -> list[dict]:
    run = facts.run
    groups: dict = {}
    for r in range(facts.n_ranks):
        inf, nan = facts.nonfinite(r)
        for h in range(run.hist_steps.size):
            bad = [t for t in facts.output_rows if inf[h, t] + nan[h, t] > 0]
            if bad:
                groups.setdefault(bad[0], []).append((r, h, bad[1:]))
    out = []
    for t, hits in groups.items():
        name, dtype = _layer(run.tensor_names[t]), run.tensor_dtypes[t].removeprefix("torch.")
        steps = sorted({int(run.hist_steps[h]) for _, h, _ in hits})
        r0, h0, spread0 = hits[0]
        inf, nan = facts.nonfinite(r0)
        top = facts.finite_top(r0, "recorded")[:, t]
        before = top[:h0][np.isfinite(top[:h0])]
        loss = run.loss[r0, facts.hist_pos[h0]]
        spread = list(dict.fromkeys(_layer(run.tensor_names[s]) for _, _, sp in hits for s in sp))
        details = [f"step {steps[0]} (rank {run.ranks[r0]}): {name}'s outputs hold "
                   f"{_inf_nan(int(inf[h0, t]), int(nan[h0, t]))}; loss {loss:g}"
                   + (f"; then {names_text([_layer(run.tensor_names[s]) for s in spread0], 4)}" if spread0 else "")]
        if before.size:
            details.append(f"before step {steps[0]} its largest finite outputs reached 2^{before.max() + 1:g}")
        out.append(finding(
            "forward_overflow", "error", f"{name}'s outputs overflow {dtype} at {_n_steps(steps)}: "
            f"{_inf_nan(int(inf[h0, t]), int(nan[h0, t]))} at step {steps[0]}; no loss scale fixes this",
            steps=steps, tensors=[name] + spread,
            ranks=sorted({run.ranks[r] for r, _, _ in hits}), details=details,
            evidence={"layer": name, "dtype": dtype, "steps": steps, "first_step_inf": int(inf[h0, t]),
                      "first_step_nan": int(nan[h0, t]), "first_step_loss": float(loss),
                      "largest_finite_before_log2": float(before.max() + 1) if before.size else None,
                      "spread": spread},
            recommendation=f"The loss scale multiplies the backward pass only. Run {name} (or the op in it that "
                           f"overflows) in bf16 or fp32: bf16 autocast, or autocast(enabled=False) around it "
                           f"with its input cast to float32; or keep its outputs smaller (normalisation, smaller "
                           f"init)."))
    return out


def _headroom(facts: Facts) -> list[dict]:
    run, out = facts.run, []
    for t in facts.output_rows:
        dtype, layer = run.tensor_dtypes[t].removeprefix("torch."), _layer(run.tensor_names[t])
        if dtype not in ("float16", "bfloat16"):
            continue
        fmt = get_format(dtype)
        hits = []
        for r in range(facts.n_ranks):
            inf, nan = facts.nonfinite(r)
            top = facts.finite_top(r, "recorded")[:, t]
            rows = np.flatnonzero((top >= fmt.emax) & (inf[:, t] + nan[:, t] == 0))
            hits += [(r, h) for h in rows]
        if hits:
            steps = sorted({int(run.hist_steps[h]) for _, h in hits})
            out.append(finding(
                "forward_headroom", "warning", f"{layer}'s {dtype} outputs come within a factor 2 of "
                f"{dtype}'s maximum ({fmt.max:g}) at {_n_steps(steps)}", steps=steps, tensors=[layer],
                ranks=sorted({run.ranks[r] for r, _ in hits}),
                evidence={"layer": layer, "dtype": dtype, "steps": steps,
                          "binade": f"(2^{fmt.emax}, 2^{fmt.emax + 1}]"},
                details=[f"outputs in (2^{fmt.emax}, {fmt.max:g}] at steps {steps_text(steps)}"],
                recommendation=f"One more doubling overflows to inf, and no loss scale helps the forward pass: "
                               f"consider running {layer} in bf16 or fp32."))
    return out

