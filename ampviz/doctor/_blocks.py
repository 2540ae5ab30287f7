""""Can this run go to MXFP8 / MXFP4 / NVFP4 / row-wise fp8?": what block-scaled casts do to the tensors a run
recorded with ``Recorder(blocks=...)`` (each Linear's input, weight and output gradient).

Each cell is :func:`ampviz.blocks.what_if` on the tensor's block counts summed over the recorded steps (and
ranks): the share of the tensor's squared norm the cast flushes, and the relative RMS error of the cast (upper
bound: flushed values' exact error plus every kept value's rounding bound). The verdict reads those two, not
the count flushed: lesson 08b measures why the share of values flushed is the wrong yardstick (on its model
e4m3 flushes most of an output gradient's values yet gives a smaller GEMM error than e5m2): flushed values are the
smallest and carry little of the norm.

A tensor is "ok" in a recipe when the cast costs little beyond its element format's own rounding: the share of
the squared norm flushed is at most ``u**2 / 4`` (flushing adds at most half the rounding bound, in RMS terms)
and the RMS error bound at most ``1.25 * u``, where ``u = 2**-(mantissa bits + 1)`` is the format's relative
rounding bound in its normal range (E4M3 1/16, E5M2 1/8, E2M1 1/4). A Gaussian tensor passes every recipe;
above these, the damage comes from the tensor's spread inside its blocks (values flushed, or kept in the element
format's coarse subnormals), which a finer block, another recipe or higher precision for that tensor avoids.
A cast of a tensor with inf or nan in a block is nan under MX ("poisoned") and is reported, not judged. The
numbers are bounds (exact for MX's norm flushed; NVFP4's E4M3 block scale and the fp32 scales of row-wise and
tiled fp8 widen them; no recipe's rounding error is exact, as binade counts do not hold mantissas): "ok" needs the
upper ends to pass, "lossy" the lower ends to fail; a tensor between is "unsure", never called lossy.

Block counts are unchanged by a power-of-two loss scale (every value and its block's maximum move together), so
an fp16 run's scaled output gradients are judged as they are.
"""

from __future__ import annotations

from ..blocks import RECIPES, BlockCounts, what_if
from ._facts import percent, percent_range

CAVEAT = ("A what-if casts the values this run recorded, summed over its recorded steps; a run in the target "
          "format computes other values. Block recipes in practice also keep some tensors in higher precision "
          "(e.g. the first and last layers) and use tricks this does not model (random Hadamard transforms, "
          "stochastic rounding of gradients).")


LABELS = {"mxfp8_e4m3": "MXFP8 E4M3", "mxfp8_e5m2": "MXFP8 E5M2", "mxfp4": "MXFP4", "nvfp4": "NVFP4",
          "rowwise_fp8": "row-wise fp8", "tile_fp8": "tiled fp8"}          # each recipe's name in text
NORM_LOST_OK = 0.25         # ok: squared norm flushed <= NORM_LOST_OK * u**2
RMS_OK = 1.25               # ok: RMS error bound <= RMS_OK * u


def rounding_bound(recipe: str) -> float:
    """``u = 2**-(m+1)``: the element format's relative rounding bound in its normal range."""
    return 2.0 ** -(RECIPES[recipe].element.mantissa_bits + 1)


def cell(counts: BlockCounts, recipe: str) -> dict:
    """One tensor under one recipe, as plain data. ``ok``: True when the upper bounds pass, False when the lower
    bounds already fail (certainly lossy), None when the bounds straddle a threshold ("unsure") or there is nothing
    to judge (poisoned, all zero)."""
    w = what_if(counts, recipe)
    u = rounding_bound(recipe)
    out = {"recipe": recipe, "layout": counts.layout.name, "exact": w.exact, "nonzero": w.nonzero,
           "poisoned": w.poisoned + w.nonfinite, "flushed_share": w.share("flushed")[1],
           "saturated_share": w.share("saturated")[1], "norm_lost": w.norm_lost[1], "rms_error": w.rms_error[1],
           "rms_error_lo": w.rms_error[0]}
    if w.poisoned or w.nonfinite:
        out.update(ok=None, status=f"poisoned: {w.poisoned + w.nonfinite} values in blocks with inf/nan")
    elif w.nonzero == 0:
        out.update(ok=None, status="nothing non-zero")
    elif w.norm_lost[1] <= NORM_LOST_OK * u * u and w.rms_error[1] <= RMS_OK * u:
        out.update(ok=True, status="ok")
    elif w.norm_lost[0] > NORM_LOST_OK * u * u or w.rms_error[0] > RMS_OK * u:
        out.update(ok=False, status=f"lossy: flushes {percent(w.norm_lost[0])} of its squared norm, "
                                    f"rms error {percent_range(w.rms_error[0], w.rms_error[1])}")
    else:                                     # the bounds straddle a threshold: say so, do not call it lossy
        out.update(ok=None, status=f"unsure: flushes up to {percent(w.norm_lost[1])} of its squared norm, rms error "
                                   f"up to {percent(w.rms_error[1])} (bounds; the counts cannot settle it)")
    return out


def tensor_row(tensor: str, kind: str, counts: dict[str, BlockCounts]) -> dict:
    """One recorded tensor: a cell per recipe whose layout was recorded (``counts``: layout name -> counts
    summed over steps), and its verdict."""
    cells = {}
    for name, recipe in RECIPES.items():
        prefer = recipe.layouts[::-1] if kind == "weight" else recipe.layouts   # tiled fp8: 128x128 weight tiles
        layout = next((lay for lay in prefer if lay in counts), None)
        if layout is not None:
            cells[name] = cell(counts[layout], name)
    good = [k for k, c in cells.items() if c["ok"] is True]
    bad = [k for k, c in cells.items() if c["ok"] is False]
    unsure = [k for k, c in cells.items() if c["ok"] is None and c["status"].startswith("unsure")]
    if not (good or bad or unsure):
        verdict = next((c["status"] for c in cells.values()), "no block counts")
    elif not (bad or unsure):
        verdict = "ok in every recipe"
    else:
        verdict = "; ".join(f"{word} {', '.join(LABELS[k] for k in ks)}" for word, ks in
                            (("ok in", good), ("not in", bad), ("unsure in", unsure)) if ks)
    return {"tensor": tensor, "kind": kind, "cells": cells, "verdict": verdict}


def recipe_verdicts(rows: list[dict]) -> list[dict]:
    """Per recipe: ok (True) when every judged tensor is, False when one certainly is not (with how many and the
    worst by squared norm flushed), None when bounds leave some unsettled."""
    out = []
    for name in RECIPES:
        cells = [(r, r["cells"][name]) for r in rows if name in r["cells"]]
        bad = [(r, c) for r, c in cells if c["ok"] is False]
        unsure = [(r, c) for r, c in cells if c["ok"] is None and c["status"].startswith("unsure")]
        judged = [(r, c) for r, c in cells if c["ok"] is not None] + unsure
        if not judged:
            continue
        if bad:
            r, c = max(bad, key=lambda rc: (rc[1]["norm_lost"], rc[1]["rms_error"]))
            verdict = (f"not as is: {len(bad)} of {len(judged)} tensors lose more than its own rounding (worst "
                       f"{r['tensor']}: {c['status']}); keep those in higher precision or use a finer-grained "
                       f"recipe")
        elif unsure:
            verdict = (f"probably: no tensor certainly loses more than its own rounding; for {len(unsure)} of "
                       f"{len(judged)} ({', '.join(r['tensor'] for r, _ in unsure[:3])}"
                       f"{' ...' if len(unsure) > 3 else ''}) the bounds cannot settle it")
        else:
            verdict = (f"yes, its blocks fit: none of the {len(judged)} tensors loses more to the block scale than "
                       f"{LABELS[name]}'s own rounding (up to {percent(rounding_bound(name))} per value) already "
                       f"costs; whether that rounding suits training is another question (lesson 08b: the GEMM "
                       f"error)")
        ok = True if not (bad or unsure) else (False if bad else None)
        out.append({"recipe": name, "ok": ok, "layouts": list(RECIPES[name].layouts),
                    "rounding_bound": rounding_bound(name), "verdict": verdict})
    return out


def block_table(facts) -> dict | None:
    """The block-scaled what-if table as plain data; None for a run recorded without ``blocks=``."""
    run = facts.run
    blocks = run.blocks
    if blocks is None or len(blocks.steps) == 0 or not blocks.modules:
        return None
    names = [lay.name for lay in blocks.layouts]
    rows = []
    for module, kind, name in zip(blocks.modules, blocks.kinds, blocks.names):
        counts = {lay: run.block_counts(module, kind, lay) for lay in names}
        row = tensor_row(name, kind, counts)
        for rec, c in row["cells"].items():
            if c["ok"] is False and len(blocks.steps) > 1:
                c["worst_step"] = _worst_step(run, module, kind, c["layout"], rec, blocks.steps)
        rows.append(row)
    recipes = recipe_verdicts(rows)
    return {"caveat": CAVEAT, "steps": [int(s) for s in blocks.steps], "layouts": names, "recipes": recipes,
            "tensors": rows, "verdict": "; ".join(f"{r['recipe']}: {'yes' if r['ok'] else 'not as is'}"
                                                  for r in recipes)}


def _worst_step(run, module, kind, layout, recipe, steps) -> dict:
    """The recorded block step at which ``recipe`` loses the largest share of this tensor's squared norm."""
    best: dict = {}
    for s in steps:
        w = what_if(run.block_counts(module, kind, layout, step=int(s)), recipe)
        if not best or w.norm_lost[1] > best["norm_lost"]:
            best = {"step": int(s), "norm_lost": w.norm_lost[1], "rms_error": w.rms_error[1]}
    return best
