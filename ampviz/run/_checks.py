"""What a :class:`ampviz.run.Run` must satisfy before anything reads it, and how ranks line up when merged.

Run files travel (people attach them to bug reports), so everything in one is untrusted: shapes,
dtypes, the order of steps, tensor names and kinds, metadata. ``structure_problems`` is cheap and
runs on every Run that is built; ``value_problems`` reads every count once and runs on loaded files.
Each problem is one short phrase starting with the field it is about::

    problems = structure_problems(run)          # [] or ["steps: not strictly increasing (5 after 7)", ...]
"""

from __future__ import annotations

import warnings
from functools import reduce
from numbers import Integral, Real

import numpy as np

from .._counting import NBINS
from .._warnings import AmpvizWarning
from ..replay import SETTING_RULES as SCALER_RULES
from ._blocks import block_problems
from ._file import RunFileError
from ._file import show as show_value
from ._schema import DOMAINS, KINDS

_DTYPES = {"steps": ("iu", "integers"), "hist_steps": ("iu", "integers"), "loss": ("fiu", "real numbers"),
           "loss_scale": ("fiu", "real numbers"), "next_scale": ("fiu", "real numbers"), "skipped": ("b", "booleans"),
           "counts": ("iu", "integer counts"), "grad_order": ("iu", "integers"), "scheduler_steps": ("iu", "integers")}
_COUNT_LIMIT = 2.0 ** 62         # every sum of counts (over tensors, steps, bins) must stay far from int64's end
_MAX_SHOWN = 3                   # problems named in one error line


def is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def structure_problems(run) -> list[str]:
    """Shapes, dtypes, step order, names, kinds and metadata types of ``run``: a list of problems."""
    problems = _shape_problems(run)
    if problems:
        return problems                  # the checks below index the arrays
    for name, (kinds, what) in _DTYPES.items():
        value = getattr(run, name)
        if value is not None and np.asarray(value).dtype.kind not in kinds:
            problems.append(f"{name}: expected {what}, got dtype {np.asarray(value).dtype}")
    if problems:
        return problems
    problems += _order_problems(np.asarray(run.steps), np.asarray(run.hist_steps))
    problems += _tensor_problems(run)
    problems += update_problems(run)
    problems += block_problems(getattr(run, "blocks", None), np.shape(run.loss)[0], np.asarray(run.steps))
    problems += meta_problems(run.meta, np.shape(run.loss)[0])
    return problems


def _shape_problems(run) -> list[str]:
    if np.ndim(run.loss) != 2:
        return [f"loss has shape {np.shape(run.loss)}, expected (ranks, steps)"]
    R, N = np.shape(run.loss)
    problems = []
    for name in ("loss_scale", "next_scale", "skipped"):
        if np.shape(getattr(run, name)) != (R, N):
            problems.append(f"{name} has shape {np.shape(getattr(run, name))}, expected {(R, N)}")
    if np.shape(run.steps) != (N,):
        problems.append(f"steps has shape {np.shape(run.steps)}, expected {(N,)}")
    if np.ndim(run.hist_steps) != 1:
        problems.append(f"hist_steps has shape {np.shape(run.hist_steps)}, expected (n,)")
    for name in ("tensor_names", "tensor_kinds", "tensor_dtypes"):
        if not isinstance(getattr(run, name), list):
            problems.append(f"{name}: expected a list, got {type(getattr(run, name)).__name__}")
    if problems:
        return problems
    T = len(run.tensor_names)
    exp = (R, np.size(run.hist_steps), T, NBINS)
    if np.shape(run.counts) != exp:
        problems.append(f"counts has shape {np.shape(run.counts)}, expected {exp}")
    if not (len(run.tensor_kinds) == len(run.tensor_dtypes) == T):
        problems.append("tensor_names, tensor_kinds and tensor_dtypes differ in length")
    if run.grad_order is not None and np.shape(run.grad_order) != exp[:3]:
        problems.append(f"grad_order has shape {np.shape(run.grad_order)}, expected {exp[:3]}")
    if run.scheduler_steps is not None and np.shape(run.scheduler_steps) != (R, N):
        problems.append(f"scheduler_steps has shape {np.shape(run.scheduler_steps)}, expected {(R, N)}")
    return problems


_UPDATES = ("update_steps", "update_counts", "update_rel_counts", "update_stalled")


def update_problems(run) -> list[str]:
    """The update arrays (``Recorder(..., updates=N)``): all or none; shapes along their own step axis (U,) and
    the weight rows (W); integer dtypes; update steps strictly increasing, among the run's steps; counts
    non-negative, summable, and stalled elements no more than a row's elements."""
    given = [getattr(run, name, None) is not None for name in _UPDATES]
    if not any(given):
        state = [n for n in ("state_counts", "state_stalled") if getattr(run, n, None) is not None]
        return [f"{state[0]}: present without the update arrays"] if state else []
    if not all(given):
        missing = [n for n, g in zip(_UPDATES, given) if not g]
        return [f"{missing[0]}: missing while {_UPDATES[given.index(True)]} is present (the update arrays come "
                f"together)"]
    steps = run.update_steps
    if np.ndim(steps) != 1:
        return [f"update_steps has shape {np.shape(steps)}, expected (n,)"]
    R, U, W = np.shape(run.loss)[0], np.size(steps), sum(k == "weight" for k in run.tensor_kinds)
    problems = []
    for name, shape in (("update_counts", (R, U, W, NBINS)), ("update_rel_counts", (R, U, W, NBINS)),
                        ("update_stalled", (R, U, W))):
        if np.shape(getattr(run, name)) != shape:
            problems.append(f"{name} has shape {np.shape(getattr(run, name))}, expected {shape}")
    for name in _UPDATES:
        if np.asarray(getattr(run, name)).dtype.kind not in "iu":
            problems.append(f"{name}: expected integers, got dtype {np.asarray(getattr(run, name)).dtype}")
    if problems:
        return problems
    if steps.size and steps[0] < 0:
        problems.append(f"update_steps: negative step {steps[0]}")
    bad = np.flatnonzero(np.diff(steps) <= 0)
    if bad.size:
        problems.append(f"update_steps: not strictly increasing ({steps[bad[0] + 1]} after {steps[bad[0]]})")
    elif steps.size and not np.isin(steps, run.steps).all():
        problems.append(f"update_steps: step {steps[~np.isin(steps, run.steps)][0]} has an update but is not in "
                        f"steps")
    for name in _UPDATES[1:]:
        values = getattr(run, name)
        if values.size and values.min() < 0:
            problems.append(f"{name}: negative count {values.min()}")
        elif values.size and values.sum(dtype=np.float64) >= _COUNT_LIMIT:
            problems.append(f"{name}: the counts add up beyond 2**62; not real counts")
    if not problems and run.update_stalled.size and (
            run.update_stalled > run.update_counts.sum(axis=-1)).any():
        problems.append("update_stalled: more stalled elements than the tensor holds")
    return problems or state_problems(run, (R, U, W))


def state_problems(run, axes: tuple) -> list[str]:
    """The optimizer state arrays, with the update arrays (``axes``: R, U, W): both or none; axis S as long as
    ``meta["state_names"]`` (a list of names); integer counts, non-negative, and no more stalled elements than
    changed ones (column 0 of ``state_counts`` holds the unchanged)."""
    counts, stalled = getattr(run, "state_counts", None), getattr(run, "state_stalled", None)
    if counts is None and stalled is None:
        return []
    if counts is None or stalled is None:
        return [f"{'state_counts' if counts is None else 'state_stalled'}: missing while the other state array is "
                f"present"]
    names = run.meta.get("state_names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return ["meta state_names: expected a non-empty list of names with the state arrays"]
    problems = []
    for name, shape in (("state_counts", axes + (len(names), NBINS)), ("state_stalled", axes + (len(names),))):
        values = np.asarray(getattr(run, name))
        if values.shape != shape:
            problems.append(f"{name} has shape {values.shape}, expected {shape}")
        elif values.dtype.kind not in "iu":
            problems.append(f"{name}: expected integers, got dtype {values.dtype}")
        elif values.size and values.min() < 0:
            problems.append(f"{name}: negative count {values.min()}")
        elif values.size and values.sum(dtype=np.float64) >= _COUNT_LIMIT:
            problems.append(f"{name}: the counts add up beyond 2**62; not real counts")
    if not problems and stalled.size and (stalled > counts[..., 1:].sum(axis=-1)).any():
        problems.append("state_stalled: more stalled elements than changed ones")
    return problems


def _order_problems(steps: np.ndarray, hist_steps: np.ndarray) -> list[str]:
    problems = []
    for name, s in (("steps", steps), ("hist_steps", hist_steps)):
        if s.size and s[0] < 0:
            problems.append(f"{name}: negative step {s[0]}")
        bad = np.flatnonzero(np.diff(s) <= 0)
        if bad.size:
            problems.append(f"{name}: not strictly increasing ({s[bad[0] + 1]} after {s[bad[0]]} at position "
                            f"{bad[0] + 1})")
    if not problems and hist_steps.size:
        pos = np.minimum(np.searchsorted(steps, hist_steps), max(steps.size - 1, 0))
        missing = np.flatnonzero(steps[pos] != hist_steps) if steps.size else np.arange(hist_steps.size)
        if missing.size:
            problems.append(f"hist_steps: step {hist_steps[missing[0]]} has a histogram but is not in steps "
                            f"({missing.size} such)")
    return problems


def _tensor_problems(run) -> list[str]:
    problems = []
    for name in ("tensor_names", "tensor_dtypes"):
        bad = [i for i, v in enumerate(getattr(run, name)) if not isinstance(v, str)]
        if bad:
            problems.append(f"{name}[{bad[0]}]: expected a string, got {show_value(getattr(run, name)[bad[0]])}")
    bad = [i for i, k in enumerate(run.tensor_kinds) if not (isinstance(k, str) and k in KINDS)]
    if bad:
        problems.append(f"tensor_kinds[{bad[0]}]: {show_value(run.tensor_kinds[bad[0]])} is not a kind ampviz records "
                        f"(expected one of {', '.join(KINDS)})")
    return problems


def meta_problems(meta, n_ranks: int) -> list[str]:
    """Types and ranges of the metadata fields ampviz reads (others are kept as they are)."""
    if not isinstance(meta, dict):
        return [f"meta: expected a dict, got {type(meta).__name__}"]
    problems = []
    ranks = meta.get("ranks", list(range(n_ranks)))
    if not isinstance(ranks, (list, tuple)) or len(ranks) != n_ranks:
        problems.append(f"ranks: expected a list of {n_ranks} rank numbers, got {show_value(ranks)}")
    elif not all(is_int(r) and r >= 0 for r in ranks):
        bad = next(r for r in ranks if not (is_int(r) and r >= 0))
        problems.append(f"rank: expected a non-negative integer, got {show_value(bad)}")
    elif len(set(ranks)) != len(ranks):
        problems.append(f"ranks: duplicate ranks {show_value(list(ranks))}")
    for key, low in (("world_size", 1), ("every", 1), ("decimated", 0)):
        if key in meta and not (is_int(meta[key]) and meta[key] >= low):
            problems.append(f"{key}: expected an integer >= {low}, got {show_value(meta[key])}")
    domains = meta.get("domains", {})
    if not isinstance(domains, dict):
        problems.append(f"domains: expected a dict of kind -> domain, got {show_value(domains)}")
    else:
        for kind, domain in domains.items():
            if kind not in KINDS or domain not in DOMAINS:
                problems.append(f"domains: {show_value(kind)}: {show_value(domain)} is not one of "
                                f"{', '.join(DOMAINS)} for a kind in {', '.join(KINDS)}")
                break
    problems += _scaler_problems(meta.get("scaler"))
    if meta.get("device") is not None and not isinstance(meta.get("device"), str):
        problems.append(f"device: expected a string, got {show_value(meta['device'])}")
    demo = meta.get("demo")
    if demo is not None and not (isinstance(demo, dict) and _finite_number(demo.get("test_accuracy", 0.0))):
        problems.append(f"demo: expected a dict with a numeric test_accuracy, got {show_value(demo)}")
    return problems


def _finite_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and np.isfinite(np.asarray(value))


def _scaler_problems(scaler) -> list[str]:
    if scaler is None:
        return []
    if not isinstance(scaler, dict):
        return [f"scaler: expected a dict of GradScaler settings or null, got {show_value(scaler)}"]
    for key in ("init_scale", "growth_factor", "backoff_factor"):     # the ranges a replay of them accepts
        ok, valid = SCALER_RULES[key]
        if key in scaler and not (_finite_number(scaler[key]) and ok(scaler[key], None)):
            return [f"scaler.{key}: expected {valid}, got {show_value(scaler[key])}"]
    if "growth_interval" in scaler and not (is_int(scaler["growth_interval"]) and scaler["growth_interval"] >= 1):
        return [f"scaler.growth_interval: expected an integer >= 1, got {show_value(scaler['growth_interval'])}"]
    if "steps_called" in scaler and not (is_int(scaler["steps_called"]) and scaler["steps_called"] >= 0):
        return [f"scaler.steps_called: expected an integer >= 0, got {show_value(scaler['steps_called'])}"]
    return []


def value_problems(run) -> list[str]:
    """Ranges of the values: counts non-negative and summable in int64, scales not nan or negative,
    backward positions within the tensors. Reads every count once."""
    return scale_problems(run) + histogram_problems(run)


def scale_problems(run) -> list[str]:
    """Loss scales not nan or negative."""
    problems = []
    for name in ("loss_scale", "next_scale"):
        values = np.asarray(getattr(run, name), dtype=np.float64)
        if values.size and not (values >= 0).all():
            bad = values[~(values >= 0)][0]
            problems.append(f"{name}: expected scales >= 0, found {bad}")
    return problems


def histogram_problems(run) -> list[str]:
    """Counts non-negative and summable in int64, backward positions within the tensors."""
    problems = []
    counts = run.counts
    if counts.size:
        low = counts.min()
        if low < 0:
            r, h, t, b = np.unravel_index(int(np.argmin(counts)), counts.shape)
            problems.append(f"counts: negative count {low} (rank index {r}, histogram step {run.hist_steps[h]}, "
                            f"tensor {show_value(run.tensor_names[t])}, bin {b})")
        elif counts.sum(dtype=np.float64) >= _COUNT_LIMIT:
            problems.append("counts: the counts add up beyond 2**62 (int64 sums would overflow); not real histograms")
    if run.grad_order is not None and run.grad_order.size:
        lo, hi = int(run.grad_order.min()), int(run.grad_order.max())
        if lo < -1 or hi >= len(run.tensor_names):
            problems.append(f"grad_order: positions must lie in -1..{len(run.tensor_names) - 1}, found {lo}..{hi}")
    return problems


def problem_text(problems: list[str]) -> str:
    """The first few problems as one line."""
    more = len(problems) - _MAX_SHOWN
    return "; ".join(problems[:_MAX_SHOWN]) + (f"; and {more} more" if more > 0 else "")


# ---------------------------------------------------------------------------- merging ranks
def merge_plan(runs) -> tuple:
    """(runs sorted by rank, steps, hist_steps, merged metadata) of single-rank runs to merge: the same
    tensors and domains, distinct ranks, lined up on the steps they share (see ``aligned_steps``)."""
    runs = sorted(runs, key=lambda r: r.ranks[0])
    first = runs[0]
    ranks = [r.ranks[0] for r in runs]
    if len(set(ranks)) != len(ranks):
        raise RunFileError(f"merge: duplicate ranks {ranks}")
    for r in runs[1:]:
        for name in ("tensor_names", "tensor_kinds"):
            if getattr(r, name) != getattr(first, name):
                raise RunFileError(f"merge: rank {r.ranks[0]} recorded other {name} than rank {ranks[0]}")
        if r.meta.get("domains", {}) != first.meta.get("domains", {}):
            raise RunFileError(f"merge: rank {r.ranks[0]} stored its counts in other domains than rank "
                               f"{ranks[0]}: {r.meta.get('domains')} vs {first.meta.get('domains')}")
    steps, hist_steps = aligned_steps(runs)
    world = first.meta.get("world_size", len(runs))
    if is_int(world) and len(runs) < world:
        warnings.warn(f"{len(runs)} of {world} ranks found: {ranks}", AmpvizWarning, stacklevel=4)
    meta = dict(first.meta, ranks=ranks)
    everies = [r.meta.get("every") for r in runs]
    if all(is_int(e) for e in everies):
        meta["every"] = max(everies)
    return runs, steps, hist_steps, meta


def aligned_steps(runs) -> tuple:
    """(steps, hist_steps) every rank recorded; warns when a rank loses some, refuses when none are shared."""
    out = []
    for attr, what in (("steps", "steps"), ("hist_steps", "histogram steps")):
        common = common_steps(runs, attr)
        if all(np.array_equal(getattr(r, attr), common) for r in runs):
            out.append(common)
            continue
        which = "; ".join(describe_steps(r, attr) for r in runs)
        if common.size == 0 and all(np.size(getattr(r, attr)) for r in runs):
            raise RunFileError(f"merge: the ranks share no recorded {what} ({which}): they do not come from "
                               "one run, or were recorded with settings that do not line up")
        if all(is_prefix(r, attr, common) for r in runs):
            warnings.warn(f"ranks recorded different numbers of {what}; keeping the first {common.size} "
                          f"(a rank may have stopped early): {which}", AmpvizWarning, stacklevel=4)
        else:
            warnings.warn(f"ranks recorded different {what} ({which}); keeping the {common.size} {what} "
                          "every rank recorded", AmpvizWarning, stacklevel=4)
        out.append(common)
    return out[0], out[1]


def common_steps(runs, attr: str) -> np.ndarray:
    """Steps (``"steps"`` or ``"hist_steps"``) that every run recorded."""
    return reduce(np.intersect1d, [np.asarray(getattr(r, attr)) for r in runs])


def describe_steps(run, attr: str) -> str:
    """'rank 1: 100 steps 100..199' (or 'every 2' when evenly spaced by more than one)."""
    s = np.asarray(getattr(run, attr))
    if not s.size:
        return f"rank {run.ranks[0]}: none"
    gaps = np.unique(np.diff(s))
    spacing = f" every {gaps[0]}" if gaps.size == 1 and gaps[0] > 1 else ""
    return f"rank {run.ranks[0]}: {s.size} {'histogram steps' if attr == 'hist_steps' else 'steps'} {s[0]}..{s[-1]}" \
           f"{spacing}"


def is_prefix(run, attr: str, common: np.ndarray) -> bool:
    s = np.asarray(getattr(run, attr))
    return s.size >= common.size and np.array_equal(s[:common.size], common)
