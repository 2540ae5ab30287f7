"""Weights whose updates round to nothing (``weights_stall``), and whether bf16 weights would
(``bf16_weights_would_stall``), from the update arrays ``Recorder(..., updates=N)`` records.

``weights_stall`` reads, in a run whose weights are stored in bf16 or fp16 (no fp32 master copy), the elements
whose gradient was non-zero and whose weight did not move at all (``run.update_stalled``): the update was below
half an ulp of the weight and rounded away. Tensors whose stalled share reaches ``STALL_SHARE`` are named, norm
parameters first, then biases (their weights sit near 1 or 0 with small updates: where a stall shows first).

``bf16_weights_would_stall`` answers "can I drop fp32 master weights?" from a run whose weights are fp32, from
the histogram of ``|dw| / |w|`` (``run.update_rel_counts``). bf16 has p = 8 significand bits: a weight in
``[2**e, 2**(e+1))`` has ``ulp = 2**(e-7)``, and an update below half of it, ``2**(e-8)``, rounds back to the
weight. With ``|w| >= 2**e``, an update with ``|dw| / |w| <= 2**-9`` is always below half an ulp (at
``|w| = 2**e`` exactly it is the tie, which rounds to the even neighbour: the weight itself when its last bit is
0), so the binades up to ``(2**-10, 2**-9]`` (closed at the top) are lost for certain; ``(2**-9, 2**-8]`` is lost
or not depending on where ``w`` sits in its binade; above ``2**-8`` it is never lost (normal weights; fp16: p = 11,
so ``2**-12`` and ``2**-11``). Weights that did not move in the fp32 run are left out of the shares.
"""

from __future__ import annotations

import re

import numpy as np

from .. import histogram as H
from ._facts import Facts, finding, names_text, percent, percent_range, steps_text

__all__ = ["update_findings", "update_summary", "STALL_SHARE", "lost_share"]

STALL_SHARE = 0.25               # a tensor stalls when this share of its updated elements did not move
WOULD_STALL_SHARE = 0.01         # an fp32 run gets the info finding when bf16 would lose at least this share
LOW_PRECISION = {"torch.bfloat16": 8, "torch.float16": 11}    # significand bits, p
_NORM = re.compile(r"norm|(^|[._])(ln|bn)(_\w+|\d+)?([._]|$)", re.IGNORECASE)    # LayerNorm, RMSNorm, ln_f, bn1

WEIGHTS_STALL_ADVICE = (
    "Keep fp32 master weights: store the parameters in fp32 and train under `torch.autocast(..., "
    "dtype=torch.bfloat16)` (the matmuls still run in bf16; the optimizer adds each update to an fp32 weight), "
    "or keep at least the norm and bias parameters in fp32. Without a master copy, accumulate what rounds away: "
    "Kahan (compensated) summation in the optimizer keeps a bf16 compensation buffer per weight, and stochastic "
    "rounding (e.g. torchao's `_AdamW(bf16_stochastic_round=True)`) rounds an update up with the probability of "
    "its fraction of an ulp, so small updates add up on average.")

WOULD_STALL_ADVICE = (
    "Keep fp32 master weights (or Kahan summation / stochastic rounding) if you move to bf16 weights: these updates "
    "are below half a bf16 ulp of their weight and would round away. The same holds for optimizer state kept in "
    "bf16 (an exponential average whose increments are below half an ulp of it stops moving).")


def lost_share(rel_counts: np.ndarray, p: int) -> tuple[float, float, int]:
    """(certain, possible, moved) of a ``|dw| / |w|`` histogram summed over steps (NBINS,): the share of the moved
    elements that weights with ``p`` significand bits lose for certain (``<= 2**-(p+1)``) and at most
    (``<= 2**-p``), and the number of moved elements (column 0, no move, left out)."""
    moved = int(rel_counts[1:H.NAN].sum())
    if moved == 0:
        return 0.0, 0.0, 0
    certain = int(rel_counts[1:H.column(-(p + 2)) + 1].sum())       # up to (2**-(p+2), 2**-(p+1)]
    possible = certain + int(rel_counts[H.column(-(p + 1))])         # and (2**-(p+1), 2**-p]
    return certain / moved, possible / moved, moved


def _is_norm(name: str) -> bool:
    module = name.rsplit(".", 1)[0] if "." in name else name
    return bool(_NORM.search(module))


def _group(name: str) -> int:
    """0 norm parameters, 1 biases, 2 the rest (the order a stall is reported in)."""
    return 0 if _is_norm(name) else 1 if name.endswith("bias") else 2


def update_summary(facts: Facts) -> dict | None:
    """Per weight row: elements updated, stalled, the stalled share, and (fp32 weights) what bf16 would lose; None
    without update arrays."""
    run = facts.run
    ulp, rel, stalled_counts = run.update_counts, run.update_rel_counts, run.update_stalled
    if run.update_steps is None or ulp is None or rel is None or stalled_counts is None:
        return None
    weights = run.tensors_of("weight")
    totals = ulp.sum(axis=-1)                                         # (R, U, W) elements per step
    rows = []
    for j, t in enumerate(weights):
        updated = int(totals[:, :, j].sum())
        stalled = int(stalled_counts[:, :, j].sum())
        certain, possible, moved = lost_share(rel[:, :, j].sum(axis=(0, 1)), 8)
        stalled_steps = run.update_steps[(stalled_counts[:, :, j] > 0).any(axis=0)]
        rows.append({"tensor": run.tensor_names[t], "dtype": run.tensor_dtypes[t], "updated": updated,
                     "stalled": stalled, "stalled_share": stalled / updated if updated else 0.0,
                     "stalled_steps": stalled_steps.tolist(), "bf16_lost_certain": certain,
                     "bf16_lost_possible": possible, "moved": moved})
    return {"update_steps": run.update_steps.tolist(), "tensors": rows}


def update_findings(facts: Facts) -> list[dict]:
    summary = update_summary(facts)
    if summary is None or not summary["update_steps"]:
        return []
    rows = summary["tensors"]
    low = [r for r in rows if r["dtype"] in LOW_PRECISION and r["updated"]]
    out = []
    if low:
        stalled = sorted((r for r in low if r["stalled_share"] >= STALL_SHARE),
                         key=lambda r: (_group(r["tensor"]), -r["stalled_share"]))
        if stalled:
            updated = sum(r["updated"] for r in low)
            n_stalled = sum(r["stalled"] for r in low)
            steps = sorted({s for r in stalled for s in r["stalled_steps"]})
            names = [r["tensor"] for r in stalled]
            dtypes = sorted({r["dtype"].removeprefix("torch.") for r in stalled})
            out.append(finding(
                "weights_stall", "warning",
                f"{len(stalled)} {'/'.join(dtypes)} weight tensors stop learning: updates below half an ulp of the "
                f"weight round to nothing ({names_text(names, 3)}; {percent(n_stalled / updated)} of all updated "
                f"low-precision weight elements)",
                steps=steps, tensors=names, ranks=facts.run.ranks,
                evidence={"stalled_share": n_stalled / updated, "stalled_elements": n_stalled,
                          "updated_elements": updated, "update_steps": len(summary["update_steps"]),
                          "tensors": {r["tensor"]: {"stalled_share": r["stalled_share"],
                                                    "steps": len(r["stalled_steps"])} for r in stalled}},
                details=[f"{r['tensor']} ({r['dtype'].removeprefix('torch.')}): {percent(r['stalled_share'])} of its "
                         f"elements had a non-zero gradient and did not move, at {len(r['stalled_steps'])} of "
                         f"{len(summary['update_steps'])} measured steps" for r in stalled[:8]]
                + [f"measured at steps {steps_text(summary['update_steps'])}"],
                recommendation=WEIGHTS_STALL_ADVICE))
    fp32 = [r for r in rows if r["dtype"] == "torch.float32" and r["moved"]]
    if fp32 and not low:
        moved = sum(r["moved"] for r in fp32)
        certain = sum(r["bf16_lost_certain"] * r["moved"] for r in fp32) / moved
        possible = sum(r["bf16_lost_possible"] * r["moved"] for r in fp32) / moved
        if certain >= WOULD_STALL_SHARE:
            worst = sorted(fp32, key=lambda r: (_group(r["tensor"]), -r["bf16_lost_certain"]))
            worst = [r for r in worst if r["bf16_lost_certain"] >= WOULD_STALL_SHARE]
            out.append(finding(
                "bf16_weights_would_stall", "info",
                f"bf16 weights without fp32 master weights would lose {percent_range(certain, possible)} "
                f"of the updates (|dw|/|w| <= 2^-9, below half a bf16 ulp): keep fp32 master weights",
                steps=summary["update_steps"], tensors=[r["tensor"] for r in worst], ranks=facts.run.ranks,
                evidence={"lost_certain": certain, "lost_possible": possible, "moved_elements": moved,
                          "tensors": {r["tensor"]: {"lost_certain": r["bf16_lost_certain"],
                                                    "lost_possible": r["bf16_lost_possible"]} for r in worst}},
                details=[f"{r['tensor']}: {percent_range(r['bf16_lost_certain'], r['bf16_lost_possible'])} "
                         f"of its moved elements" for r in worst[:8]],
                recommendation=WOULD_STALL_ADVICE))
    return out


def master_weights_verdict(facts: Facts) -> str | None:
    """One line answering "can I drop fp32 master weights?" from an fp32-weight run with updates; None otherwise."""
    summary = update_summary(facts)
    if summary is None:
        return None
    fp32 = [r for r in summary["tensors"] if r["dtype"] == "torch.float32" and r["moved"]]
    if not fp32:
        return None
    moved = sum(r["moved"] for r in fp32)
    certain = sum(r["bf16_lost_certain"] * r["moved"] for r in fp32) / moved
    possible = sum(r["bf16_lost_possible"] * r["moved"] for r in fp32) / moved
    verdict = "no: keep fp32 master weights" if certain >= WOULD_STALL_SHARE else "likely yes"
    return (f"drop fp32 master weights (bf16 weights)? {verdict}: {percent_range(certain, possible)} of the "
            f"measured updates are below half a bf16 ulp of their weight (|dw|/|w| <= 2^-9 for certain, <= 2^-8 "
            f"possibly)")
