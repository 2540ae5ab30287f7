"""A run's block statistics (``Recorder(..., blocks=...)``): :class:`RunBlocks`, their checks and rank merge.

Per rank, on their own step axis, one row per counted tensor ``t`` (``modules[t]``, ``kinds[t]``: "input",
"weight" or "grad_output" of an ``nn.Linear``) and layout ``l``::

    steps   (B,) int64                          steps whose tensors were counted (every ``every`` steps)
    counts  (R, B, T, L, N_COUNTS) int64        ampviz.blocks.BlockCounts.counts of each
    sumsq   (R, B, T, L, N_COUNTS) float64      ampviz.blocks.BlockCounts.sumsq of each

A run file stores them as ``block_steps``, ``block_counts`` and ``block_sumsq`` (one rank each), with
``meta["blocks"]``: ``every``, ``modules``, ``kinds`` and ``layouts`` (``[name, block_rows, block_cols]`` each).
Read them back as :class:`ampviz.blocks.BlockCounts`, which ``what_if`` takes::

    run.block_counts("blocks.0.fc1", "input", "mx32")              # summed over block steps and ranks
    what_if(run.block_counts("head", "grad_output", "mx32", step=200), "mxfp8_e5m2")
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..blocks import LAYOUTS, BlockCounts, BlockLayout
from ..blocks.counts import N_COUNTS
from ._file import RunFileError, show

__all__ = ["RunBlocks", "BLOCK_KINDS", "BLOCK_DOMAINS", "block_problems", "merge_blocks"]

BLOCK_KINDS = ("input", "weight", "grad_output")
# the domain each kind is counted in: the output gradient as the backward computed it, times the loss scale
# (a power-of-two scale moves no value's distance from its block's max: shares and errors are unchanged)
BLOCK_DOMAINS = {"input": "unscaled", "weight": "unscaled", "grad_output": "scaled"}
_COUNT_LIMIT = 2.0 ** 62


@dataclass
class RunBlocks:
    """The block statistics of a run (see the module docstring for the arrays)."""

    steps: np.ndarray
    counts: np.ndarray
    sumsq: np.ndarray
    modules: list
    kinds: list
    layouts: list                    # of BlockLayout
    every: int

    @classmethod
    def from_file(cls, meta, steps, counts, sumsq) -> RunBlocks:
        """From ``meta["blocks"]`` and the arrays (with a rank axis); raises ValueError naming the field when
        ``meta`` is malformed (the shapes and values are :func:`block_problems`')."""
        if not isinstance(meta, dict):
            raise ValueError(f"blocks: expected a dict of every, modules, kinds, layouts, got {show(meta)}")
        every = meta.get("every")
        if type(every) is not int or every < 1:
            raise ValueError(f"blocks.every: expected an integer >= 1, got {show(every)}")
        modules, kinds, layouts = (_list(meta, k) for k in ("modules", "kinds", "layouts"))
        return cls(steps, counts, sumsq, modules, kinds, [_layout(x) for x in layouts], every)

    def meta(self) -> dict:
        return {"every": self.every, "modules": list(self.modules), "kinds": list(self.kinds),
                "layouts": [[x.name, x.block_rows, x.block_cols] for x in self.layouts]}

    @property
    def names(self) -> list[str]:
        """``"<module> [<kind>]"`` of each counted tensor, in row order."""
        return [f"{m} [{k}]" for m, k in zip(self.modules, self.kinds)]

    def index(self, module, kind) -> int:
        """Row of ``module``'s tensor of ``kind`` ("input", "weight" or "grad_output")."""
        if kind not in BLOCK_KINDS:
            raise ValueError(f"kind: expected one of {', '.join(BLOCK_KINDS)}, got {kind!r}")
        for t, (m, k) in enumerate(zip(self.modules, self.kinds)):
            if m == module and k == kind:
                return t
        known = list(dict.fromkeys(self.modules))
        raise KeyError(f"module: no block statistics of {module!r}; recorded: {', '.join(map(str, known[:8]))}"
                       + (" ..." if len(known) > 8 else ""))

    def layout_index(self, layout) -> int:
        name = layout.name if isinstance(layout, BlockLayout) else layout
        names = [x.name for x in self.layouts]
        if name not in names:
            raise KeyError(f"layout: {layout!r} was not recorded; recorded: {', '.join(names)}")
        return names.index(name)

    def rows(self, steps) -> np.ndarray:
        """Positions along ``steps`` of a step, a list of steps, or all (None)."""
        if steps is None:
            return np.arange(self.steps.size)
        wanted = np.atleast_1d(np.asarray(steps))
        if wanted.dtype.kind not in "iu" or wanted.ndim != 1:
            raise TypeError(f"step: expected a step, a list of steps or None, got {steps!r}")
        pos = np.searchsorted(self.steps, wanted)
        ok = (pos < self.steps.size) & (self.steps[np.minimum(pos, self.steps.size - 1)] == wanted) \
            if self.steps.size else np.zeros(wanted.size, bool)
        if not ok.all():
            raise KeyError(f"step: {wanted[~ok][0]} has no block statistics (counted every {self.every} steps; "
                           f"first {self.steps[:3].tolist()}, last {self.steps[-1:].tolist()})")
        return pos

    def select_ranks(self, r) -> RunBlocks:
        return replace(self, counts=self.counts[r], sumsq=self.sumsq[r])


def block_counts_of(blocks: RunBlocks, ranks: list, module, kind, layout, step=None, rank=None) -> BlockCounts:
    """The :class:`BlockCounts` of one tensor in one layout: summed over the block steps ``step`` (a step, a list
    of them, or None: all) and over ``rank`` (an id, or None: every rank), as CPU tensors."""
    t, j = blocks.index(module, kind), blocks.layout_index(layout)
    if rank is not None and rank not in ranks:
        raise KeyError(f"rank: {rank!r} not in this run; ranks: {ranks}")
    r = slice(None) if rank is None else slice(ranks.index(rank), ranks.index(rank) + 1)
    pos = blocks.rows(step)
    counts = blocks.counts[r][:, pos, t, j].sum(axis=(0, 1), dtype=np.int64)          # (N_COUNTS,)
    sumsq = blocks.sumsq[r][:, pos, t, j].sum(axis=(0, 1), dtype=np.float64)
    return BlockCounts(torch.from_numpy(counts), torch.from_numpy(sumsq), blocks.layouts[j])


def _list(meta: dict, name: str) -> list:
    value = meta.get(name)
    if not isinstance(value, list):
        raise ValueError(f"blocks.{name}: expected a list, got {show(value)}")
    return value


def _layout(spec) -> BlockLayout:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)):
        raise ValueError(f"blocks.layouts: expected [name, block_rows, block_cols] each, got {show(spec)}")
    name, rows, cols = spec
    known = LAYOUTS.get(name)
    if known is not None and (known.block_rows, known.block_cols) == (rows, cols):
        return known
    if type(rows) is not int or not (cols is None or type(cols) is int):
        raise ValueError(f"blocks.layouts: {show(spec)}: block_rows and block_cols must be integers")
    try:
        return BlockLayout(name, rows, cols)
    except ValueError as e:
        raise ValueError(f"blocks.layouts: {show(spec)}: {e}") from None


def block_problems(blocks: RunBlocks | None, n_ranks: int, run_steps: np.ndarray) -> list[str]:
    """Shapes along (R, B, T, L, N_COUNTS); dtypes; steps strictly increasing, among the run's; kinds known;
    counts non-negative and summable; sums of squares finite and non-negative."""
    if blocks is None:
        return []
    steps = blocks.steps
    if np.ndim(steps) != 1 or np.asarray(steps).dtype.kind not in "iu":
        return [f"block_steps: expected (n,) integers, got shape {np.shape(steps)} dtype {np.asarray(steps).dtype}"]
    if len(blocks.modules) != len(blocks.kinds) or not all(isinstance(m, str) for m in blocks.modules):
        return ["blocks.modules: expected module names, one per entry of blocks.kinds"]
    bad = [k for k in blocks.kinds if k not in BLOCK_KINDS]
    if bad:
        return [f"blocks.kinds: {show(bad[0])} is not a block kind (expected one of {', '.join(BLOCK_KINDS)})"]
    shape = (n_ranks, steps.size, len(blocks.kinds), len(blocks.layouts), N_COUNTS)
    problems = []
    for name, array, kinds in (("block_counts", blocks.counts, "iu"), ("block_sumsq", blocks.sumsq, "f")):
        if np.shape(array) != shape:
            problems.append(f"{name} has shape {np.shape(array)}, expected {shape}")
        elif np.asarray(array).dtype.kind not in kinds:
            problems.append(f"{name}: expected {'integers' if kinds == 'iu' else 'real numbers'}, got dtype "
                            f"{np.asarray(array).dtype}")
    if problems:
        return problems
    if steps.size and steps[0] < 0:
        problems.append(f"block_steps: negative step {steps[0]}")
    elif np.any(np.diff(steps) <= 0):
        problems.append("block_steps: not strictly increasing")
    elif steps.size and not np.isin(steps, run_steps).all():
        problems.append(f"block_steps: step {steps[~np.isin(steps, run_steps)][0]} is not in steps")
    if blocks.counts.size and blocks.counts.min() < 0:
        problems.append(f"block_counts: negative count {blocks.counts.min()}")
    elif blocks.counts.size and blocks.counts.sum(dtype=np.float64) >= _COUNT_LIMIT:
        problems.append("block_counts: the counts add up beyond 2**62; not real counts")
    if blocks.sumsq.size and not (np.isfinite(blocks.sumsq).all() and blocks.sumsq.min() >= 0):
        problems.append("block_sumsq: expected finite sums of squares >= 0")
    return problems


def merge_blocks(runs: list) -> RunBlocks | None:
    """The block statistics of single-rank ``runs`` along the rank axis, at the block steps every rank has (None
    when a rank has none)."""
    if any(r.blocks is None for r in runs):
        return None
    first = runs[0].blocks
    for r in runs[1:]:
        if r.blocks.meta() | {"every": 0} != first.meta() | {"every": 0}:
            raise RunFileError(f"merge: rank {r.ranks[0]} recorded the block statistics of other tensors or layouts "
                               f"than rank {runs[0].ranks[0]}")
    common = first.steps
    for r in runs[1:]:
        common = np.intersect1d(common, r.blocks.steps)
    parts = [(b.counts[:, np.searchsorted(b.steps, common)], b.sumsq[:, np.searchsorted(b.steps, common)])
             for b in (r.blocks for r in runs)]
    return replace(first, steps=common, counts=np.concatenate([c for c, _ in parts]),
                   sumsq=np.concatenate([s for _, s in parts]))
