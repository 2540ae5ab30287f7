"""Loading run files into a :class:`ampviz.run.Run`: one file, or a directory of rank files merged along a
rank axis, within one memory budget and without a second copy of the histograms.

Each file is read in two passes. The first reads the metadata, the per-step arrays (a few bytes a step)
and the headers of the histogram arrays, and checks them all; the ranks are then lined up (the steps
every rank recorded) and the merged arrays are allocated once, after checking that they fit the budget
(``AMPVIZ_MAX_RUN_BYTES``, shared by every file of the load: ``ampviz report A B`` passes one budget to
both). The second pass inflates each rank's histograms, piece by piece, straight into its slice::

    run = load(Path("runs/ddp"))                 # what Run.load does
    runs = [load(p, budget) for p in paths]      # several runs within one budget
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from .._counting import NBINS
from .._warnings import AmpvizWarning
from ..blocks.counts import N_COUNTS
from . import _checks as checks
from ._blocks import RunBlocks, merge_blocks
from ._file import (
    BLOCK_ARRAYS,
    DTYPES,
    META_BYTES,
    PER_HIST,
    PER_STEP,
    STATE_ARRAYS,
    UPDATE_ARRAYS,
    Budget,
    RunFileError,
    members,
    parse_meta,
    size_text,
)
from ._zipread import npy_member, open_archive

__all__ = ["load"]

_PIECE = 1 << 20                 # histogram rows not inflated in place go through pieces of at most this size


def load(path, budget: Budget | None = None):
    """The run in ``path`` (a run file, or a directory of rank files), read within ``budget``."""
    from .run import Run
    path = Path(path)
    budget = Budget() if budget is None else budget
    if path.is_dir():
        files = sorted(path.glob("*.npz"))
        if not files:
            raise RunFileError(f"{path}: directory holds no .npz run files")
    elif not path.exists() and not path.is_symlink():
        raise RunFileError(f"{path}: no such file or directory")
    else:
        files = [path]
    with contextlib.ExitStack() as stack:
        ranks = [_first_pass(f, budget, stack) for f in files]
        if not path.is_dir():
            order, steps, hist_steps, meta = ranks, ranks[0].light.steps, ranks[0].light.hist_steps, ranks[0].meta
        else:
            try:
                lights, steps, hist_steps, meta = checks.merge_plan([r.light for r in ranks])
            except RunFileError as e:
                raise RunFileError(f"{path}: {e}") from None
            order = [next(r for r in ranks if r.light is light) for light in lights]
        arrays = _second_pass(order, steps, hist_steps, budget, path)
    arrays.update(_merged_updates([r.light for r in order]))
    arrays["blocks"] = order[0].light.blocks if len(order) == 1 else merge_blocks([r.light for r in order])
    for r in order:
        if r.torn:
            warnings.warn(f"{r.path}: its last save did not finish ({size_text(r.torn)} at its end left out); "
                          "loaded the run as it was saved before that", AmpvizWarning, stacklevel=3)
    first = order[0].light
    return Run(steps, hist_steps=hist_steps, tensor_names=first.tensor_names, tensor_kinds=first.tensor_kinds,
               tensor_dtypes=first.tensor_dtypes, meta=meta, **arrays)


# ------------------------------------------------------------------------------------ first pass
class _RankFile(SimpleNamespace):
    """One file after the first pass: ``light`` is a Run with every array but the histograms (zero views)."""


def _first_pass(path: Path, budget: Budget, stack) -> _RankFile:
    from .run import Run
    archive, torn = stack.enter_context(open_archive(path))
    meta_info, parts = members(path, archive)
    meta = _read_meta(path, archive, meta_info, budget)
    lists = {k: meta.pop(k, []) for k in ("tensor_names", "tensor_kinds", "tensor_dtypes")}
    for name, value in lists.items():
        if not isinstance(value, list):
            raise RunFileError(f"{path}: corrupt run: {name}: expected a list, got {type(value).__name__}")
    meta["ranks"] = [meta.pop("rank", 0)]
    small = {}
    for name in ("steps", "hist_steps"):               # 1-D: they fix every other entry's shape
        small[name] = _read_small(path, archive, parts[name], name, budget, ())
        if small[name].ndim != 1:
            raise RunFileError(f"{path}: corrupt run: {name} has shape {small[name].shape}, expected (n,)")
    n, h, t = small["steps"].size, small["hist_steps"].size, len(lists["tensor_names"])
    for name in PER_STEP[1:]:
        if name in parts:
            small[name] = _read_small(path, archive, parts[name], name, budget, (n,))
    heads = {name: _headers(path, archive, parts[name], name, budget, (h, t) + ((NBINS,) if name == "counts" else ()))
             for name in PER_HIST[1:] if name in parts}
    updates = _read_updates(path, archive, parts, budget, lists["tensor_kinds"], meta)
    blocks = _read_blocks(path, archive, parts, budget, meta.pop("blocks", None))
    zeros: dict[str, np.ndarray] = {
        name: np.broadcast_to(np.zeros((), DTYPES[name][1]), (1, h, t) + ((NBINS,) if name == "counts" else ()))
        for name in heads}
    try:
        light = Run(small["steps"], hist_steps=small["hist_steps"], meta=meta, **lists, loss=small["loss"][None],
                    loss_scale=small["loss_scale"][None], next_scale=small["next_scale"][None],
                    skipped=small["skipped"][None],
                    counts=zeros["counts"], grad_order=zeros.get("grad_order"),
                    scheduler_steps=small["scheduler_steps"][None] if "scheduler_steps" in small else None,
                    blocks=blocks, **updates)
    except RunFileError as e:
        raise RunFileError(f"{path}: {str(e).removeprefix('Run: ')}") from None
    problems = checks.scale_problems(light)             # the histograms' values: in the second pass
    if problems:
        raise RunFileError(f"{path}: corrupt run: {checks.problem_text(problems)}")
    return _RankFile(path=path, archive=archive, torn=torn, parts=parts, heads=heads, meta=meta, light=light)


def _read_updates(path, archive, parts: dict, budget: Budget, kinds: list, meta: dict) -> dict:
    """The update arrays of one file (with a rank axis of 1), read whole, and the optimizer state's when present
    (their axis S from ``meta["state_names"]``); {} when the file has none."""
    if not any(name in parts for name in UPDATE_ARRAYS + STATE_ARRAYS):
        return {}
    missing = [name for name in UPDATE_ARRAYS if name not in parts]
    if missing:
        raise RunFileError(f"{path}: corrupt run: {missing[0]}: missing while other update arrays are present")
    steps = _read_small(path, archive, parts["update_steps"], "update_steps", budget, ())
    if steps.ndim != 1:
        raise RunFileError(f"{path}: corrupt run: update_steps has shape {steps.shape}, expected (n,)")
    W = sum(k == "weight" for k in kinds)
    out = {"update_steps": steps}
    for name in UPDATE_ARRAYS[1:]:
        shape = (steps.size, W) + ((NBINS,) if name != "update_stalled" else ())
        out[name] = _read_rows(path, archive, parts[name], name, budget, shape)[None]
    if not any(name in parts for name in STATE_ARRAYS):
        return out
    names = meta.get("state_names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise RunFileError(f"{path}: corrupt run: state arrays present but meta state_names is not a non-empty "
                           f"list of names")
    for name in STATE_ARRAYS:
        if name not in parts:
            raise RunFileError(f"{path}: corrupt run: {name}: missing while other state arrays are present")
        shape = (steps.size, W, len(names)) + ((NBINS,) if name == "state_counts" else ())
        out[name] = _read_rows(path, archive, parts[name], name, budget, shape)[None]
    return out


def _read_blocks(path, archive, parts: dict, budget: Budget, meta) -> RunBlocks | None:
    """The block statistics of one file (with a rank axis of 1), read whole; None when the file has none."""
    present = [name for name in BLOCK_ARRAYS if name in parts]
    if not present and meta is None:
        return None
    if meta is None or len(present) < len(BLOCK_ARRAYS):
        missing = "meta.blocks" if meta is None else next(n for n in BLOCK_ARRAYS if n not in parts)
        raise RunFileError(f"{path}: corrupt run: {missing}: missing while other block statistics are present")
    steps = _read_small(path, archive, parts["block_steps"], "block_steps", budget, ())
    if steps.ndim != 1:
        raise RunFileError(f"{path}: corrupt run: block_steps has shape {steps.shape}, expected (n,)")
    try:
        shell = RunBlocks.from_file(meta, steps, None, None)
    except ValueError as e:
        raise RunFileError(f"{path}: corrupt run: {e}") from None
    shape = (steps.size, len(shell.kinds), len(shell.layouts), N_COUNTS)
    return replace(shell, counts=_read_rows(path, archive, parts["block_counts"], "block_counts", budget, shape)[None],
                   sumsq=_read_rows(path, archive, parts["block_sumsq"], "block_sumsq", budget, shape)[None])


def _read_rows(path, archive, infos, name: str, budget: Budget, shape: tuple) -> np.ndarray:
    """An array of ``shape`` stored in parts along its first axis, read whole (each part's header checked first)."""
    arr = _read_parts(path, archive, infos, name, budget, shape if len(infos) == 1 else (None,) + shape[1:])
    if arr.shape != shape:
        raise RunFileError(f"{path}: corrupt run: {name} has shape {arr.shape}, expected {shape}")
    return arr


def _merged_updates(lights: list) -> dict:
    """The ranks' update arrays along a rank axis, at the update steps they share."""
    from .run import merge_updates
    return merge_updates(lights)


def _read_meta(path, archive, info, budget: Budget) -> dict:
    if info.file_size > META_BYTES:
        raise RunFileError(f"{path}: corrupt run: meta declares {size_text(info.file_size)} of metadata "
                           f"(at most {size_text(META_BYTES)})")
    budget.check(info.file_size, path, "meta")
    with npy_member(path, archive, info, "meta", "U", "a JSON string") as member:
        budget.take(member.nbytes, path, "meta")
        raw = member.read()
        if raw.ndim != 0:
            raise RunFileError(f"{path}: not an ampviz run (its 'meta' entry is not a JSON string)")
        if raw.dtype.itemsize and raw.reshape(1).view(np.uint32).max(initial=0) > 0x10FFFF:
            raise RunFileError(f"{path}: corrupt run: meta: holds a code point beyond U+10FFFF (not text)")
        text = str(raw[()])
    return parse_meta(path, text)


def _read_small(path, archive, infos, name: str, budget: Budget, shape: tuple) -> np.ndarray:
    """A per-step array (or steps / hist_steps), its parts joined; ``shape``: the total it must have."""
    expect = None if not shape and len(infos) == 1 else shape if len(infos) == 1 else (None,)
    arr = _read_parts(path, archive, infos, name, budget, expect)
    if shape and arr.shape != shape:
        raise RunFileError(f"{path}: corrupt run: {name} has shape {arr.shape}, expected {shape}")
    return arr


def _read_parts(path, archive, infos, name: str, budget: Budget, expect) -> np.ndarray:
    """The parts of array ``name`` joined along the first axis, each part's header checked against ``expect`` (a
    shape, None in a dimension for any size, or None) and its bytes against the budget before it is read."""
    kinds, dtype, what = DTYPES[name]
    pieces = []
    for k, info in enumerate(infos):
        budget.check(info.file_size, path, name)
        with npy_member(path, archive, info, _part(name, k, infos), kinds, what, expect) as member:
            budget.take(member.nbytes, path, name)
            pieces.append(_convert(path, name, member.read(), dtype))
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def _part(name: str, k: int, infos) -> str:
    """How an error names part ``k`` of an array: ``counts``, or ``counts (part 2 of 3)``."""
    return name if len(infos) == 1 else f"{name} (part {k} of {len(infos)})"


def _headers(path, archive, infos, name: str, budget: Budget, shape: tuple) -> list:
    """[(member, rows)] of a histogram array's parts, their headers checked against ``shape`` in total."""
    kinds, _, what = DTYPES[name]
    out, rows = [], 0
    expect = shape if len(infos) == 1 else (None,) + shape[1:]
    for k, info in enumerate(infos):
        budget.check(info.file_size, path, name)      # a zip bomb is refused from its declared size
        with npy_member(path, archive, info, _part(name, k, infos), kinds, what, expect) as member:
            rows += member.shape[0]
        out.append((info, member.shape[0]))
    if rows != shape[0]:
        raise RunFileError(f"{path}: corrupt run: {name} has shape {(rows,) + shape[1:]}, expected {shape}")
    return out


def _convert(path, name: str, arr: np.ndarray, dtype) -> np.ndarray:
    """``arr`` as ``dtype`` (int64, float64, ...), refusing integers that do not fit."""
    target = np.dtype(dtype)
    if arr.size and arr.dtype.kind in "iu" and target.kind == "i":
        info = np.iinfo(target)
        if arr.dtype.kind == "u" and arr.max() > info.max:
            raise RunFileError(f"{path}: corrupt run: {name}: value {arr.max()} does not fit in {target.name}")
        if arr.dtype.kind == "i" and arr.dtype.itemsize > target.itemsize and (
                arr.min() < info.min or arr.max() > info.max):
            raise RunFileError(f"{path}: corrupt run: {name}: values beyond {target.name}")
    return arr.astype(target, copy=False)


# ------------------------------------------------------------------------------------ second pass
def _second_pass(order: list, steps, hist_steps, budget: Budget, where) -> dict:
    """The merged arrays: per-step ones picked at the shared steps, histograms inflated into place."""
    R, Hc, T = len(order), hist_steps.size, len(order[0].light.tensor_names)
    out: dict = {}
    for name in ("loss", "loss_scale", "next_scale", "skipped", "scheduler_steps"):
        values = [getattr(r.light, name) for r in order]
        if any(v is None for v in values):
            out[name] = None
            continue
        out[name] = values[0] if R == 1 else np.concatenate(
            [v[:, np.searchsorted(r.light.steps, steps)] for v, r in zip(values, order)])
    for name in ("counts", "grad_order"):
        if any(name not in r.heads for r in order):
            out[name] = None
            continue
        shape = (R, Hc, T) + ((NBINS,) if name == "counts" else ())
        dtype = np.dtype(DTYPES[name][1])
        nbytes = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
        budget.take(nbytes, where if R > 1 else order[0].path,
                    f"{name} ({' x '.join(map(str, shape))} {dtype.name})" if R > 1 else name)
        try:
            dest = np.empty(shape, dtype=dtype)
        except MemoryError:
            raise RunFileError(f"{where}: {name}: not enough free memory for {size_text(nbytes)}") from None
        for r, rank in enumerate(order):
            _inflate_rows(rank, name, dest[r], np.searchsorted(rank.light.hist_steps, hist_steps), budget)
        out[name] = dest
    for r, rank in enumerate(order):                   # the histograms' values, checked per file
        problems = checks.histogram_problems(SimpleNamespace(
            counts=out["counts"][r:r + 1], hist_steps=hist_steps, tensor_names=rank.light.tensor_names,
            grad_order=None if out["grad_order"] is None else out["grad_order"][r:r + 1]))
        if problems:
            raise RunFileError(f"{rank.path}: corrupt run: {checks.problem_text(problems)}")
    return out


def _inflate_rows(rank: _RankFile, name: str, dest: np.ndarray, wanted: np.ndarray, budget: Budget) -> None:
    """Rows ``wanted`` (positions in this rank's histogram steps) of array ``name`` into ``dest``, in pieces."""
    kinds, dtype, what = DTYPES[name]
    rows = sum(n for _, n in rank.heads[name])
    slot = np.full(rows, -1, dtype=np.int64)           # row of the file -> row of dest (-1: not kept)
    slot[wanted] = np.arange(wanted.size)
    first = 0
    for info, n in rank.heads[name]:
        to = slot[first:first + n]
        with npy_member(rank.path, rank.archive, info, name, kinds, what) as member:
            whole = member.fortran and len(member.shape) > 1      # not row by row: whole, then picked
            if n and to[0] >= 0 and not whole and member.dtype == dest.dtype and np.array_equal(
                    to, np.arange(to[0], to[0] + n)):      # every row kept, in order (a lone -1 is not)
                member.read_into(dest[to[0]:to[0] + n])           # in place: the usual case
            else:
                if whole:
                    budget.take(member.nbytes, rank.path, name)
                for start, block in [(0, member.read())] if whole else member.rows(_PIECE):
                    piece = to[start:start + block.shape[0]]
                    keep = piece >= 0
                    if keep.all():
                        dest[piece] = _convert(rank.path, name, block, dtype)
                    elif keep.any():
                        dest[piece[keep]] = _convert(rank.path, name, block[keep], dtype)
                if whole:
                    budget.give(member.nbytes)
        first += n
