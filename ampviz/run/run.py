"""The recorded data of a training run, saved as one ``.npz`` per rank (no pickle).

A :class:`Run` holds, for each rank ``r``::

    steps        (N,)               optimizer-step index of every recorded step
    loss         (R, N)             loss passed to ``Recorder.step`` (nan if none)
    loss_scale   (R, N)             scale the step's backward used (1.0 without a GradScaler)
    next_scale   (R, N)             scale after ``scaler.update()``
    skipped      (R, N)             the optimizer step was skipped (inf/nan found)
    hist_steps   (H,)               steps that have histograms (every ``every``-th step)
    counts       (R, H, T, NBINS)   gradient-magnitude histograms, see ``ampviz.histogram``

and, when the recorder had them (None otherwise)::

    grad_order       (R, H, T) int32   order in which each tensor's gradient was counted in that step's
                                       backward pass (0 first, i.e. closest to the loss; -1 not counted)
    scheduler_steps  (R, N) int64      the LR scheduler's ``last_epoch`` after each optimizer step

and, with ``Recorder(..., updates=N)`` (None otherwise), the weights' updates every N steps, on their own step
axis, one column per weight row (``tensors_of("weight")``, in order: W of them)::

    update_steps       (U,) int64              steps whose optimizer update was measured
    update_counts      (R, U, W, NBINS) int64  binade histogram of |dw| / ulp(w), ulp in the weight's dtype
    update_rel_counts  (R, U, W, NBINS) int64  binade histogram of |dw| / |w|
    update_stalled     (R, U, W) int64         elements whose gradient was non-zero and whose weight did not move

and, with ``Recorder(..., blocks=...)`` (None otherwise), ``blocks``: a :class:`~ampviz.run.RunBlocks` holding the
block statistics of each ``nn.Linear``'s input, weight and output gradient on their own step axis (``blocks.steps``;
``blocks.counts`` and ``blocks.sumsq`` of shape (R, B, tensors, layouts, N_COUNTS)), read back as
``ampviz.blocks.BlockCounts`` with :meth:`Run.block_counts`;
and, when the optimizer keeps per-element state (``meta["state_names"]``, S of them: Adam's ``exp_avg``,
``exp_avg_sq``, SGD's ``momentum_buffer`` ...; None otherwise), the state's changes at the same steps::

    state_counts   (R, U, W, S, NBINS) int64  binade histogram of |ds| / |s| (s the state before the step)
    state_stalled  (R, U, W, S) int64         elements whose state changed but would not have moved in bf16

plus tensor names / kinds (``KINDS``) / dtypes and JSON metadata. Weight gradients are stored unscaled
(as the optimizer sees them); activation gradients as computed in the backward pass, i.e.
multiplied by the loss scale. :meth:`Run.counts_for` reads any selection in either view (``rank=`` is a rank
id, one of ``run.ranks``, in every reader; the domain defaults to "unscaled" in every reader)::

    run = ampviz.Run.load("runs/demo")          # a file, or a directory of rank files
    run.counts_in("unscaled")                   # (R, H, T, NBINS)
    run.counts_for("scaled", rank=1, kind="activation", pooled=True)     # (H, NBINS)
    run.tensors_of("weight")                    # indices of the weight gradients' rows
    run.to_pandas()                             # tidy: rank, step, tensor, kind, bin, count
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .. import histogram as H
from .._args import check_choice
from .._warnings import AmpvizWarning
from . import _checks as checks
from . import _file, _write
from ._blocks import RunBlocks, block_counts_of, merge_blocks
from ._file import SCHEMA_VERSION, RunFileError
from ._schema import DOMAINS, KINDS, SCALE_FREE

__all__ = ["Run", "RunFileError", "SCHEMA_VERSION", "DOMAINS", "VIEWS", "KINDS"]

VIEWS = DOMAINS + ("recorded",)       # what counts_in() accepts: a domain, or the counts as stored
_PER_RANK = ("loss", "loss_scale", "next_scale", "skipped", "counts")
_OPTIONAL = ("grad_order", "scheduler_steps")          # per rank too; None when not recorded
UPDATE_ARRAYS = ("update_counts", "update_rel_counts", "update_stalled")   # per rank, along update_steps
STATE_ARRAYS = ("state_counts", "state_stalled")   # the same axes, then the state (S); None without state


@dataclass
class Run:
    """Recorded steps, loss scales and gradient histograms of one run (all ranks)."""

    steps: np.ndarray
    loss: np.ndarray
    loss_scale: np.ndarray
    next_scale: np.ndarray
    skipped: np.ndarray
    hist_steps: np.ndarray
    counts: np.ndarray
    tensor_names: list
    tensor_kinds: list
    tensor_dtypes: list
    meta: dict = field(default_factory=dict)
    grad_order: np.ndarray | None = None
    scheduler_steps: np.ndarray | None = None
    update_steps: np.ndarray | None = None
    update_counts: np.ndarray | None = None
    update_rel_counts: np.ndarray | None = None
    update_stalled: np.ndarray | None = None
    blocks: RunBlocks | None = None
    state_counts: np.ndarray | None = None
    state_stalled: np.ndarray | None = None

    _log2_scales: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._validate("Run")

    # ------------------------------------------------------------------ shape facts
    @property
    def state_names(self) -> list:
        """The optimizer state tensors along ``state_counts``' axis S (``meta["state_names"]``; [] without)."""
        return list(self.meta.get("state_names") or [])

    @property
    def ranks(self) -> list:
        return list(self.meta.get("ranks", range(self.counts.shape[0])))

    @property
    def n_steps(self) -> int:
        return int(self.steps.size)

    @property
    def grown(self) -> np.ndarray:
        """(R, N) bool: the scale grew after this step."""
        return self.next_scale > self.loss_scale

    def tensor_index(self, tensor) -> int:
        """Index of a tensor given its name or index."""
        if isinstance(tensor, (int, np.integer)):
            if not -len(self.tensor_names) <= tensor < len(self.tensor_names):
                raise IndexError(f"tensor: index {tensor} out of range for {len(self.tensor_names)} tensors")
            return int(tensor) % len(self.tensor_names)
        try:
            return self.tensor_names.index(tensor)
        except ValueError:
            raise KeyError(f"tensor: no tensor named {tensor!r}; recorded: {', '.join(self.tensor_names[:8])}"
                           + (" ..." if len(self.tensor_names) > 8 else "")) from None

    def rank_index(self, rank) -> int:
        if rank not in self.ranks:
            raise KeyError(f"rank: {rank!r} not in this run; ranks: {self.ranks}")
        return self.ranks.index(rank)

    def hist_index(self, step) -> int:
        """Row of ``counts`` holding ``step`` (which must have a histogram)."""
        idx = np.searchsorted(self.hist_steps, step)
        if idx >= self.hist_steps.size or self.hist_steps[idx] != step:
            raise KeyError(f"step: {step} has no histogram (recorded every {self.meta.get('every', 1)} "
                           f"steps; first {self.hist_steps[:3].tolist()}, last {self.hist_steps[-1:].tolist()})")
        return int(idx)

    # ------------------------------------------------------------------ domains
    # Weight gradients are stored unscaled, activation gradients scaled (x the loss scale of their
    # step). Every view of the counts in one domain goes through the methods below: a power-of-two
    # loss scale shifts a binade histogram by exactly log2(scale) columns (ampviz.histogram.shift).
    def scale_log2_at_hist(self) -> np.ndarray:
        """(R, H) log2 of the loss scale used at each histogram step (not rounded)."""
        pos = np.searchsorted(self.steps, self.hist_steps)
        return np.log2(self.loss_scale[:, pos])

    def log2_scales(self) -> np.ndarray:
        """(R, H) integer log2 of the loss scale used at each histogram step: the shift between domains.

        Exact for power-of-two scales (GradScaler's defaults keep it one); other scales are rounded
        to the nearest power of two, with one warning per run.
        """
        if self._log2_scales is None:
            log2s = self.scale_log2_at_hist()
            finite = np.isfinite(log2s)
            if not np.all(np.mod(log2s[finite], 1) == 0):
                warnings.warn("loss scales that are not powers of two: shifting by the nearest power of two",
                              AmpvizWarning, stacklevel=3)
            self._log2_scales = np.rint(np.where(finite, log2s, 0)).astype(np.int64)
        return self._log2_scales

    def stored_domain(self, tensor) -> str:
        """The domain a tensor's counts are stored in: "unscaled" or "scaled" (``meta["domains"]``, which the
        Recorder writes from ``ampviz.run.KIND_DOMAIN``; "unscaled" in a run built without it)."""
        kind = self.tensor_kinds[self.tensor_index(tensor)]
        return self.meta.get("domains", {}).get(kind, "unscaled")

    def _shift_sign(self, t: int, domain: str) -> int:
        """0 if tensor index ``t`` is stored in ``domain``, else the sign of the shift into it.

        Kinds the loss scale never reaches (``SCALE_FREE``: forward outputs) are the same in both domains.
        """
        check_choice("domain", domain, VIEWS)
        if domain == "recorded" or self.stored_domain(t) == domain or self.tensor_kinds[t] in SCALE_FREE:
            return 0
        return -1 if domain == "unscaled" else 1

    # ------------------------------------------------------------------ the read API
    # One convention for every reader: ``domain`` is the first argument after what is read (a tensor, a format),
    # "unscaled" by default; ``rank=`` is a rank id (one of ``run.ranks``), never a position; ``tensors=`` names
    # tensors (names or indices) and ``kind=`` narrows them to one kind (``KINDS``). Positions along the rank and
    # histogram axes are private: ``rank_index`` and ``hist_index`` translate ids to them for the raw arrays.
    def counts_for(self, domain: str = "unscaled", *, rank=None, tensors=None, kind=None, step=None,
               pooled: bool = False) -> np.ndarray:
        """Counts in ``domain`` ("unscaled", "scaled" or "recorded": as stored), of a selection.

        The full answer is ``(R, H, T, NBINS)``: every rank, histogram step and tensor. Each selector drops or
        narrows one axis: ``rank=`` a rank id drops the rank axis; ``step=`` a step with a histogram drops the
        step axis; ``tensors=`` a name or index drops the tensor axis, a list keeps it (in the list's order);
        ``kind=`` keeps only that kind's tensors; ``pooled=True`` sums the selected tensors (drops the tensor
        axis). Tensors are summed per stored domain before the one shift into ``domain`` (a shift is linear), so
        ``pooled`` never copies the unselected counts::

            run.counts_for("scaled", rank=1, kind="activation", pooled=True)    # (H, NBINS)
            run.counts_for(step=40, tensors="head.weight")                      # (R, NBINS)
        """
        check_choice("domain", domain, VIEWS)
        if not isinstance(pooled, (bool, np.bool_)):
            raise TypeError(f"pooled: expected True or False, got {pooled!r}")
        single = tensors is not None and not isinstance(tensors, (list, tuple))
        if single and pooled:
            raise ValueError(f"pooled: a single tensor ({tensors!r}) has nothing to sum; pass a list of tensors")
        idx = self.tensor_indices(tensors, kind)
        if not idx:
            raise ValueError(f"tensors: the selection {tensors!r} is empty")
        p = None if rank is None else self.rank_index(rank)
        i = None if step is None else self.hist_index(step)
        r = slice(None) if p is None else slice(p, p + 1)                # slices: views until the tensors are picked
        h = slice(None) if i is None else slice(i, i + 1)
        # (R', H') shifts into ``domain``; "recorded" shifts nothing (and reads no scale)
        log2s = self.log2_scales()[r][:, h] if domain != "recorded" else np.zeros((1, 1), np.int64)
        if pooled:
            parts = []
            for sign in (0, -1, 1):
                group = [t for t in idx if self._shift_sign(t, domain) == sign]
                if group:
                    part = self.counts[r][:, h][:, :, group].sum(axis=2, dtype=np.int64)   # (R', H', NBINS)
                    parts.append(H.shift(part, sign * log2s) if sign else part)
            out = parts[0]
            for part in parts[1:]:
                out = out + part
        else:
            t = slice(None) if idx == list(range(len(self.tensor_names))) else idx
            out = self.counts[r][:, h][:, :, t]
            signs = np.array([self._shift_sign(i, domain) for i in idx], dtype=np.int64)   # (T',)
            if signs.any():
                out = H.shift(out, log2s[:, :, None] * signs[None, None, :])
            if np.may_share_memory(out, self.counts):
                out = out.copy()                                                  # never a view of the run's array
            if single:
                out = out[:, :, 0]
        if step is not None:
            out = out[:, 0]
        if rank is not None:
            out = out[0]
        return out

    def tensors_of(self, kind) -> list:
        """Indices of the tensors of ``kind`` (one of ``KINDS``, or a list/tuple/set of them), in recording order;
        empty if the run recorded none of that kind. ``run.tensors_of("activation")`` replaces
        ``[t for t, k in enumerate(run.tensor_kinds) if k == "activation"]``."""
        kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, (list, tuple, set, frozenset)) \
            else None
        bad = None if kinds is None else sorted(k for k in kinds if k not in KINDS)
        if kinds is None or bad or not kinds:
            raise ValueError(f"kind: expected one of {list(KINDS)} (or a list of them), got {kind!r}")
        return [t for t, k in enumerate(self.tensor_kinds) if k in kinds]

    def _rank_pos(self, rank, rank_index, method: str) -> int:
        """The position of ``rank=`` (an id; the first rank by default), or of the deprecated ``rank_index``."""
        if rank_index is None:
            return 0 if rank is None else self.rank_index(rank)
        if rank is not None:
            raise TypeError(f"{method}: pass rank= (a rank id) or rank_index= (deprecated, a position), not both")
        warnings.warn(f"{method}: rank_index (a position along the rank axis) is deprecated; pass rank= with a "
                      f"rank id, one of {self.ranks}", DeprecationWarning, stacklevel=3)
        if not isinstance(rank_index, (int, np.integer)) or not -len(self.ranks) <= rank_index < len(self.ranks):
            raise IndexError(f"rank_index: {rank_index!r} is not a position among {len(self.ranks)} ranks")
        return int(rank_index) % len(self.ranks)

    def tensor_counts(self, tensor, domain: str = "unscaled", rank_index=None, *, rank=None) -> np.ndarray:
        """(H, NBINS) counts of one tensor (name or index) of one rank (an id, default the first) in ``domain``.

        The same as ``counts_for(domain, rank=rank, tensors=tensor)``. ``rank_index`` (a position) is deprecated.
        """
        r = self._rank_pos(rank, rank_index, "tensor_counts")
        t = self.tensor_index(tensor)
        c = self.counts[r, :, t]
        sign = self._shift_sign(t, domain)
        return H.shift(c, sign * self.log2_scales()[r]) if sign else c

    def pooled_counts(self, domain: str = "unscaled", rank_index=None, tensors=None, kind=None, *,
                      rank=None) -> np.ndarray:
        """(H, NBINS) counts summed over tensors (names/indices, default all; optionally of one ``kind``) of one
        rank (an id, default the first).

        The same as ``counts_for(domain, rank=rank, tensors=tensors, kind=kind, pooled=True)``, without copying the
        whole counts array. ``rank_index`` (a position, the second positional argument) is deprecated.
        """
        r = self._rank_pos(rank, rank_index, "pooled_counts")
        if tensors is not None and not isinstance(tensors, (list, tuple)):
            tensors = [tensors]
        return self.counts_for(domain, rank=self.ranks[r], tensors=tensors, kind=kind, pooled=True)

    def counts_at(self, row: int, domain: str = "unscaled", rank_index=None, *, rank=None) -> np.ndarray:
        """(T, NBINS) counts of every tensor at histogram row ``row`` (a position in ``hist_steps``) of one rank
        (an id, default the first) in ``domain``. ``counts_for(domain, rank=rank, step=step)`` takes the step
        instead of its row. ``rank_index`` (a position) is deprecated."""
        r = self._rank_pos(rank, rank_index, "counts_at")
        signs = np.array([self._shift_sign(t, domain) for t in range(len(self.tensor_names))], dtype=np.int64)
        return H.shift(self.counts[r, row], signs * self.log2_scales()[r, row])

    def counts_in(self, domain: str = "unscaled") -> np.ndarray:
        """(R, H, T, NBINS) counts with every tensor in ``domain``: "unscaled", "scaled", or "recorded"
        (as stored, not a copy). The same as ``counts_for(domain)``; for one tensor or a sum of tensors, select
        with :meth:`counts_for` (``tensors=``, ``kind=``, ``pooled=``), which copies only the selection.
        """
        check_choice("domain", domain, VIEWS)
        if domain == "recorded":
            return self.counts
        return self.counts_for(domain)

    def tensor_indices(self, tensor=None, kind=None) -> list:
        """Indices selected by a tensor name/index (or a list of them) and/or a kind; all by default.

        ``kind`` must be one this run recorded; :meth:`tensors_of` lists a kind's tensors, empty or not."""
        if tensor is None:
            idx = list(range(len(self.tensor_names)))
        elif isinstance(tensor, (list, tuple)):
            idx = [self.tensor_index(t) for t in tensor]
        else:
            idx = [self.tensor_index(tensor)]
        if kind is not None:
            kinds = sorted(set(self.tensor_kinds))
            if kind not in kinds:
                raise ValueError(f"kind: expected one of {kinds} or None, got {kind!r}")
            idx = [i for i in idx if self.tensor_kinds[i] == kind]
            if not idx:
                raise ValueError(f"kind: no {kind} tensor among the selected tensors {tensor!r}")
        return idx

    def histogram(self, step, tensor, rank=None, domain: str = "unscaled") -> np.ndarray:
        """(NBINS,) counts of one tensor at one step of one rank (an id, default the first) in ``domain``:
        ``counts_for(domain, rank=rank, tensors=tensor, step=step)`` for one rank."""
        r = 0 if rank is None else self.rank_index(rank)
        return self.tensor_counts(tensor, domain, rank=self.ranks[r])[self.hist_index(step)]

    def select(self, rank=None, tensors=None) -> Run:
        """A Run restricted to one rank and/or some tensors (names or indices)."""
        r = slice(None) if rank is None else [self.rank_index(rank)]
        t = list(range(len(self.tensor_names))) if tensors is None else [self.tensor_index(x) for x in tensors]
        meta = dict(self.meta)
        if rank is not None:
            meta["ranks"] = [rank]
        order = None if self.grad_order is None else self.grad_order[r][:, :, t]
        sched = None if self.scheduler_steps is None else self.scheduler_steps[r]
        updates: dict = {}
        if self.update_steps is not None:                  # the update columns of the weight rows kept
            weights = self.tensors_of("weight")
            cols = [weights.index(i) for i in t if i in weights]        # in the selection's order
            updates = {name: getattr(self, name)[r][:, :, cols] for name in UPDATE_ARRAYS + STATE_ARRAYS
                       if getattr(self, name) is not None}
        return replace(self, loss=self.loss[r], loss_scale=self.loss_scale[r], next_scale=self.next_scale[r],
                       skipped=self.skipped[r], counts=self.counts[r][:, :, t],
                       tensor_names=[self.tensor_names[i] for i in t], tensor_kinds=[self.tensor_kinds[i] for i in t],
                       tensor_dtypes=[self.tensor_dtypes[i] for i in t], meta=meta, grad_order=order,
                       scheduler_steps=sched, blocks=None if self.blocks is None else self.blocks.select_ranks(r),
                       **updates)

    def block_counts(self, module, kind, layout, *, step=None, rank=None):
        """The :class:`ampviz.blocks.BlockCounts` (CPU tensors) of one ``nn.Linear``'s tensor of ``kind`` ("input",
        "weight" or "grad_output") in ``layout`` (a name, e.g. "mx32"), recorded with ``Recorder(blocks=...)``:
        summed over the block steps ``step`` (one step, a list of steps, or None: every one in ``blocks.steps``)
        and over ``rank`` (an id, or None: every rank; a weight counted on each rank adds up to the same shares).
        ``what_if(run.block_counts("fc1", "input", "mx32"), "mxfp8_e4m3")`` says what that cast does to it."""
        if self.blocks is None:
            raise ValueError("blocks: this run has no block statistics (record with Recorder(..., blocks=True))")
        return block_counts_of(self.blocks, self.ranks, module, kind, layout, step=step, rank=rank)

    # ------------------------------------------------------------------ summaries
    def fate_in(self, format, domain: str = "unscaled") -> H.Fate:
        """What a cast to ``format`` does to every tensor's values in ``domain``: a Fate of (R, H, T) counts.

        ``domain`` defaults to "unscaled", like every reader of a Run (up to 0.1.0 it defaulted to "scaled";
        pass ``"scaled"`` for what a cast inside the scaled backward does to the values as computed).

        Equal to ``histogram.fate(counts_in(domain), format, 1.0)`` but without the copy: each row is
        judged at the log2 scale that moves it into ``domain`` (values below 2**-126 are judged by that
        scale too, not merged into "below"), in one pass over the counts.
        """
        check_choice("domain", domain, VIEWS)
        R, Hn, T = self.counts.shape[:3]
        signs = np.array([self._shift_sign(t, domain) for t in range(T)], dtype=np.int64)       # (T,)
        log2s = self.log2_scales() if (signs != 0).any() else np.zeros((R, Hn), np.int64)      # (R, H)
        shifts = (log2s[:, :, None] * signs[None, None, :]).reshape(-1)                      # (R * H * T,)
        fields = H.fate_rows(self.counts.reshape(-1, H.NBINS), format, shifts)
        return H.Fate(**{f: v.reshape(R, Hn, T) for f, v in fields.items()})

    def summary(self, format="fp16") -> dict:
        """Steps, skipped steps, scale range, worst underflow/overflow fractions (against ``format``) of the recorded
        values, and ``flushed_in_backward``: the tensors whose values fp16 already flushed inside the backward,
        stored as exact zeros, which no cast of the recorded values can count (see ``ampviz.doctor``)."""
        from ..doctor import flushed_in_backward  # lazily: the allowed run -> doctor edge
        fate = self.fate_in(format, "scaled")
        flushed, overflow = fate.fraction("flushed"), fate.fraction("overflow")     # (R, H, T)
        wu, wo = self._worst(flushed), self._worst(overflow)
        return {"steps": self.n_steps, "ranks": self.ranks, "histogram_steps": int(self.hist_steps.size),
                "skipped": int(self.skipped[0].sum()) if self.skipped.size else 0,
                "scale_min": float(np.min(self.loss_scale)) if self.loss_scale.size else None,
                "scale_max": float(np.max(self.loss_scale)) if self.loss_scale.size else None,
                "tensors": len(self.tensor_names),
                "worst_flushed_fraction": wu[0], "worst_flushed_tensor": wu[1],
                "worst_overflow_fraction": wo[0], "worst_overflow_tensor": wo[1],
                "format": str(format), "device": self.meta.get("device"), "scaler": self.meta.get("scaler"),
                "flushed_in_backward": flushed_in_backward(self)}

    def _worst(self, fractions: np.ndarray):
        """(largest fraction, name of its tensor) of an (R, H, T) array."""
        if not fractions.size or not fractions.max() > 0:
            return 0.0, None
        t = np.unravel_index(fractions.argmax(), fractions.shape)[2]
        return float(fractions.max()), self.tensor_names[int(t)]

    def to_pandas(self, domain: str = "unscaled"):
        """Tidy histogram table, one row per non-empty bin: rank, step, tensor, kind, bin, lo, hi, count."""
        import pandas as pd  # lazily: pandas is optional
        c = self.counts_in(domain)
        r, h, t, b = np.nonzero(c)
        lo, hi, labels = H.lower_edges(), H.upper_edges(), np.array(H.bin_labels())
        return pd.DataFrame({"rank": np.asarray(self.ranks)[r], "step": self.hist_steps[h],
                             "tensor": np.asarray(self.tensor_names, dtype=object)[t],
                             "kind": np.asarray(self.tensor_kinds, dtype=object)[t], "bin": labels[b],
                             "lo": lo[b], "hi": hi[b], "count": c[r, h, t, b]})

    def scalars_to_pandas(self):
        """Tidy per-step table: rank, step, loss, loss_scale, next_scale, skipped, grown."""
        import pandas as pd
        R, N = self.loss.shape
        return pd.DataFrame({"rank": np.repeat(self.ranks, N), "step": np.tile(self.steps, R),
                             "loss": self.loss.ravel(), "loss_scale": self.loss_scale.ravel(),
                             "next_scale": self.next_scale.ravel(), "skipped": self.skipped.ravel(),
                             "grown": self.grown.ravel()})

    # ------------------------------------------------------------------ files
    def save(self, path) -> list[Path]:
        """Write one ``.npz`` per rank, atomically. One rank: ``path`` is the file (".npz" appended when it
        has another ending), or an existing directory; several ranks, or a directory: ``path`` receives
        ``rank{r}.npz``. Returns the paths written."""
        path = Path(path)
        if len(self.ranks) == 1 and not path.is_dir():
            target = path if path.suffix == ".npz" else path.with_name(path.name + ".npz")
            _write.write(target, *self._rank_payload(0))
            return [target]
        path.mkdir(parents=True, exist_ok=True)
        out = []
        for i, r in enumerate(self.ranks):
            out.append(path / f"rank{int(r)}.npz")         # ranks are validated integers: the file stays in path
            _write.write(out[-1], *self._rank_payload(i))
        return out

    @classmethod
    def load(cls, path) -> Run:
        """Load a run file, or a directory of per-rank run files merged along a rank axis.

        Files are treated as untrusted: only regular files are read, every entry's declared size and
        shape is checked before it is inflated, no pickle is ever loaded, and every field is validated
        (:meth:`_validate`). The whole load (every rank file of a directory) holds at most 2 GiB of
        arrays (set the environment variable ``AMPVIZ_MAX_RUN_BYTES`` to allow more); the ranks are
        inflated straight into the merged arrays, without a second copy. Any problem is a
        :class:`RunFileError` of one line naming the file and the field. A file whose last periodic
        save was cut off (the process was killed mid-save) loads as it was saved before that, with a
        warning.
        """
        from ._load import load
        return load(path)

    @classmethod
    def merge(cls, runs: list) -> Run:
        """Merge single-rank runs (same tensors) into one run with a rank axis, ordered by rank.

        Ranks are aligned on the steps they all recorded: a rank that stopped early, started later or
        recorded histograms with another ``every`` keeps only the steps the others have too (with a
        warning saying which); ranks that share no step are refused.
        """
        runs, steps, hist_steps, meta = checks.merge_plan(runs)

        def cat(name, attr):
            if any(getattr(r, name) is None for r in runs):
                return None                                   # an optional array some rank lacks
            wanted = steps if attr == "steps" else hist_steps
            parts = [getattr(r, name) if np.array_equal(getattr(r, attr), wanted)       # aligned: a view
                     else getattr(r, name)[:, np.searchsorted(getattr(r, attr), wanted)] for r in runs]
            return np.concatenate(parts)                      # the one copy
        first = runs[0]
        return cls(steps, cat("loss", "steps"), cat("loss_scale", "steps"), cat("next_scale", "steps"),
                   cat("skipped", "steps"), hist_steps, cat("counts", "hist_steps"), first.tensor_names,
                   first.tensor_kinds, first.tensor_dtypes, meta, grad_order=cat("grad_order", "hist_steps"),
                   scheduler_steps=cat("scheduler_steps", "steps"), blocks=merge_blocks(runs), **merge_updates(runs))

    def _rank_payload(self, i: int):
        """(arrays, meta) of rank index ``i``, as one run file stores them."""
        meta = dict(self.meta, rank=self.ranks[i], tensor_names=self.tensor_names, tensor_kinds=self.tensor_kinds,
                    tensor_dtypes=self.tensor_dtypes)
        meta.pop("ranks", None)
        arrays = {name: getattr(self, name) for name in _file.ARRAYS}
        for name in _PER_RANK:
            arrays[name] = arrays[name][i]
        for name in _OPTIONAL:
            if getattr(self, name) is not None:
                arrays[name] = getattr(self, name)[i]
        if self.update_steps is not None:
            arrays["update_steps"] = self.update_steps
            for name in UPDATE_ARRAYS + STATE_ARRAYS:
                if getattr(self, name) is not None:
                    arrays[name] = getattr(self, name)[i]
        if self.blocks is not None:
            meta["blocks"] = self.blocks.meta()
            arrays.update(block_steps=self.blocks.steps, block_counts=self.blocks.counts[i],
                          block_sumsq=self.blocks.sumsq[i])
        return arrays, meta

    # ------------------------------------------------------------------ checks
    def _validate(self, where: str, values: bool = False) -> None:
        """Raise RunFileError naming every problem (the first few) with shapes, dtypes, step order, names,
        kinds and metadata; with ``values``, also with the values themselves (one pass over the counts)."""
        problems = checks.structure_problems(self)
        if values and not problems:
            problems = checks.value_problems(self)
        if problems:
            raise RunFileError(f"{where}: corrupt run: " + checks.problem_text(problems))

    # ------------------------------------------------------------------ findings
    def diagnose(self) -> dict:
        """The doctor's findings on this run, as plain data (dicts, lists, str, int, float, bool, None):
        what went wrong, the evidence (steps, tensors, values) and what to do. See :mod:`ampviz.doctor`."""
        from ..doctor import diagnose  # lazily, the one allowed run -> doctor edge (doctor imports Run)
        return diagnose(self)


def merge_updates(runs: list) -> dict:
    """The update arrays of single-rank ``runs`` merged along the rank axis, at the update steps every rank has
    (none when a rank has none)."""
    if any(r.update_steps is None for r in runs):
        return {}
    common = checks.common_steps(runs, "update_steps")
    out: dict = {"update_steps": common}
    same_state = all(r.state_counts is not None and r.state_names == runs[0].state_names for r in runs)
    names = UPDATE_ARRAYS + (STATE_ARRAYS if same_state else ())
    for name in names:
        out[name] = np.concatenate([getattr(r, name)[:, np.searchsorted(r.update_steps, common)] for r in runs])
    return out
