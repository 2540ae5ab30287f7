"""Block statistics recorded while training (``Recorder(blocks=...)``) and the doctor's verdict on them.

:func:`record_blocks` trains a copy of a model for a few more steps with an ordinary loop (Adam, cross-entropy,
optionally a ``GradScaler``) under ``ampviz.Recorder(model, optimizer, blocks={"every": ..., "layouts": ...})``
and returns the run; ``run.diagnose()["blocks"]`` is the doctor's "can I switch to block-scaled formats?".
:func:`verdict_frame` lays that table out as a DataFrame (one row per recorded tensor, the share of its squared
norm each recipe flushes and the cast's relative RMS error, upper bounds as the doctor judges them;
:func:`verdict_table` styles it, the cells the doctor did not call ok shaded), :func:`recipe_frame` gives each
recipe's call (yes / probably / not as is, and the tensors that keep it from a yes) and
:func:`flushed_frame` sets, for one MX recipe, the share of *values* flushed (exact) beside the share of the
squared norm::

    from ampviz.lessons.block_doctor import record_blocks, verdict_frame
    run = record_blocks(model, data, steps=20, every=5)          # data: an ampviz.lessons.data.Split
    verdict_table(run.diagnose()["blocks"])

The loop is the one a user writes (lesson 06's ``scaler.scale(loss).backward(); scaler.step(opt);
scaler.update()``); the Recorder only reads, so training is what it would be without it.

Used by lessons 08b (fp8 scaling, §7).
"""

from __future__ import annotations

import copy

import pandas as pd
import torch
import torch.nn.functional as F

from ..doctor import RECIPE_LABELS
from ..record import Recorder

__all__ = ["record_blocks", "verdict_frame", "verdict_table", "recipe_frame", "flushed_frame", "RECIPE_NAMES"]

RECIPE_NAMES = RECIPE_LABELS            # each recipe's display name, as the doctor writes it


def record_blocks(model: torch.nn.Module, data, *, steps: int = 20, every: int = 5, layouts=("mx32", "nv16"),
                  lr: float = 3e-3, batch_size: int = 256, seed: int = 0, loss_scale: float | None = None):
    """Train a deep copy of ``model`` for ``steps`` more steps, recording block statistics every ``every`` steps.

    Parameters
    ----------
    model : a classifier already on its device (left untouched: a copy is trained).
    data : an :class:`ampviz.lessons.data.Split` on the model's device.
    steps, every, layouts : the loop's length; ``Recorder(blocks={"every": every, "layouts": layouts})``.
    lr, batch_size, seed : Adam's learning rate (a fresh Adam), the batch size, the batch order's seed.
    loss_scale : None for no loss scaling, else a ``GradScaler`` with this ``init_scale`` (fp32 here: it scales
        the backward and unscales before the step, so only the recorded output gradients change, by the scale).

    Returns
    -------
    ampviz.Run, with ``run.blocks`` and ``run.block_counts(module, kind, layout)``.
    """
    model = copy.deepcopy(model)
    device = next(model.parameters()).device
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type, init_scale=loss_scale or 1.0, enabled=loss_scale is not None)
    batches = torch.Generator().manual_seed(seed)
    recorder = Recorder(model, optimizer, scaler=scaler, blocks={"every": every, "layouts": list(layouts)})
    with recorder:
        for _ in range(steps):
            idx = torch.randint(0, len(data.x_train), (batch_size,), generator=batches).to(device)
            loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            recorder.step(loss)
    return recorder.run


def verdict_frame(blocks: dict) -> pd.DataFrame:
    """The doctor's block table (``run.diagnose()["blocks"]``) as a DataFrame: one row per tensor, for each
    recipe judged the share of the squared norm flushed and the relative RMS error (upper bounds, as the doctor
    judges them), then the doctor's verdict for the tensor (blank when every recipe's cell is ok)."""
    recipes = [r["recipe"] for r in blocks["recipes"]]
    columns = pd.MultiIndex.from_tuples([(RECIPE_NAMES[r], m) for r in recipes
                                         for m in ("sq. norm flushed", "RMS error")] + [("verdict", "")])
    rows = [[t["cells"][r][key] for r in recipes for key in ("norm_lost", "rms_error")]
            + ["" if all(c["ok"] is True for c in t["cells"].values()) else t["verdict"]]
            for t in blocks["tensors"]]
    return pd.DataFrame(rows, index=[t["tensor"] for t in blocks["tensors"]], columns=columns)


def verdict_table(blocks: dict):
    """:func:`verdict_frame` styled: percentages, each cell the doctor did not call ok shaded (amber: unsure,
    red: lossy); each recipe's verdict is :func:`recipe_frame`'s."""
    frame = verdict_frame(blocks)
    recipes = [r["recipe"] for r in blocks["recipes"]]
    shade = {False: "background-color: #f4c2c2", None: "background-color: #fde8b0"}

    def calls(_):
        out = pd.DataFrame("", index=frame.index, columns=frame.columns)
        for t in blocks["tensors"]:
            for r in recipes:
                out.loc[t["tensor"], RECIPE_NAMES[r]] = shade.get(t["cells"][r]["ok"], "")
        return out

    numbers = pd.IndexSlice
    return (frame.style.format("{:.1e}", subset=numbers[:, numbers[:, "sq. norm flushed"]])
            .format("{:.1%}", subset=numbers[:, numbers[:, "RMS error"]]).apply(calls, axis=None)
            .set_caption(f"The doctor on {len(blocks['steps'])} recorded steps: share of the squared norm flushed, "
                         f"relative RMS error of the cast (upper bounds; the squared norm flushed exact under MX); "
                         f"shaded: unsure (amber) or lossy (red); verdict blank where every recipe is ok"))


def recipe_frame(blocks: dict) -> pd.DataFrame:
    """Each recipe's call from the doctor's block table: "yes" (every judged tensor ok), "probably" (none
    lossy, some unsure) or "not as is" (some lossy), and the tensors that keep it from a yes (lossy ones when
    there are any, else the unsure ones)."""
    rows = {}
    for r in blocks["recipes"]:
        cells = {t["tensor"]: t["cells"][r["recipe"]] for t in blocks["tensors"] if r["recipe"] in t["cells"]}
        call = {True: "yes", None: "probably", False: "not as is"}[r["ok"]]
        worst = [t for t, c in cells.items() if c["ok"] is False] or [t for t, c in cells.items() if c["ok"] is None]
        rows[RECIPE_NAMES[r["recipe"]]] = {"call": call, "not ok": ", ".join(worst) if r["ok"] is not True else ""}
    return pd.DataFrame(rows).T


def flushed_frame(blocks: dict, recipe: str = "mxfp4") -> pd.DataFrame:
    """For one MX recipe (exact counts): per tensor the share of its non-zero values flushed, the share of its
    squared norm flushed, and the doctor's call ("ok", "lossy", "unsure", ...)."""
    rows = {}
    for t in blocks["tensors"]:
        cell = t["cells"][recipe]
        if not cell["exact"]:
            raise ValueError(f"{recipe}: counts are bounds, not exact; flushed_frame is for the MX recipes")
        call = {True: "ok", False: "lossy"}.get(cell["ok"], cell["status"].split(":")[0])    # unsure, poisoned, ...
        rows[t["tensor"]] = {"values flushed": cell["flushed_share"], "squared norm flushed": cell["norm_lost"],
                             "doctor": call}
    return pd.DataFrame(rows).T.astype({"values flushed": float, "squared norm flushed": float})
