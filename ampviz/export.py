"""Export a run to what people already watch: TensorBoard and Weights & Biases, without re-binning.

From a saved run (a file, or a directory of per-rank files)::

    ampviz export runs/my_run.npz --tensorboard tb/       # then: tensorboard --logdir tb/
    ampviz export runs/ddp --wandb --wandb-project my-project

From Python, or live during training (the integrations' callbacks take ``tensorboard=`` / ``wandb=``)::

    from ampviz.export import to_tensorboard, to_wandb
    to_tensorboard(ampviz.Run.load("runs/my_run.npz"), "tb/")

What is written, per step ``s`` (the optimizer step; TensorBoard's ``global_step``, W&B's ``ampviz/step``):

* scalars ``ampviz/loss``, ``ampviz/loss_scale``, ``ampviz/skipped`` (1 when the step was skipped);
* at each histogram step, per tensor: the histogram ``ampviz_<kind>/<tensor>`` whose x axis is
  **log2 |gradient|**: one bucket per binade (2**k, 2**(k+1)] with the limit k + 1, exactly ampviz's
  own bins (torch's ``add_histogram_raw`` summaries, one TensorBoard event per step, and
  ``wandb.Histogram(np_histogram=...)``, so nothing is re-binned and no tensor is cast: TensorBoard's
  own ``add_histogram`` converts bf16 tensors to fp16 first); the values <= 2**-126 form one bucket
  from -149 (the smallest fp32 subnormal) to -126. Zeros, inf (the column of |x| > 2**127, in
  practice inf) and nan have no place on a log axis: they are the scalars
  ``ampviz_zeros/<kind>/<tensor>``, ``ampviz_inf/...``, ``ampviz_nan/...``. A histogram with no
  finite non-zero value is not written.

``domain`` picks the counts written: "recorded" (default: as stored, weights unscaled and activation
gradients scaled; lossless), "unscaled" or "scaled" (shifted by the loss scale, see ``Run.counts_in``).
With several ranks, TensorBoard gets one sub-directory ``rank<r>`` per rank and W&B one key prefix
``ampviz_rank<r>`` per rank.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np

from . import histogram as H
from ._args import check_choice
from ._extras import MissingExtra, Unavailable
from .run import VIEWS, Run

__all__ = ["to_tensorboard", "to_wandb", "log2_buckets", "LiveExport", "SPECIALS"]

SPECIALS = {"zeros": H.ZERO, "inf": H.ABOVE, "nan": H.NAN}     # scalar name -> column
_LOWEST_LOG2 = -149                     # log2 of the smallest positive fp32 (subnormal) value


def log2_buckets(row):
    """(edges, counts) of one histogram row on a log2 |x| axis, or None when it holds no finite non-zero value.

    ``counts[i]`` counts |x| in (2**edges[i], 2**edges[i+1]]; ``len(edges) == len(counts) + 1`` (numpy's
    ``np.histogram`` convention). Only the span from the first to the last non-empty binade is kept.

    >>> import numpy as np, ampviz.histogram as H
    >>> from ampviz.export import log2_buckets
    >>> row = np.zeros(H.NBINS, dtype=np.int64); row[H.column(-3)] = 2; row[H.column(-1)] = 5; row[H.ZERO] = 9
    >>> edges, counts = log2_buckets(row)
    >>> edges.tolist(), counts.tolist()          # (2^-3, 2^-2]: 2 values, (2^-1, 2^0]: 5 values
    ([-3.0, -2.0, -1.0, 0.0], [2, 0, 5])
    """
    row = H.as_counts(row, "row", axes=())
    finite = np.flatnonzero(row[H.BELOW:H.ABOVE]) + H.BELOW        # columns 1..254 with a count
    if finite.size == 0:
        return None
    cols = np.arange(finite[0], finite[-1] + 1)
    upper = (cols - 127).astype(np.float64)            # column c holds (2**(c-128), 2**(c-127)]
    lower_first = _LOWEST_LOG2 if cols[0] == H.BELOW else cols[0] - 128
    return np.concatenate([[float(lower_first)], upper]), row[cols].copy()


def _step_records(run: Run, rank_index: int, domain: str, prefix: str, after: int = -1):
    """(step, scalars, histograms) of every step > ``after`` of one rank: the payload both writers share."""
    hist_row = {int(s): i for i, s in enumerate(run.hist_steps)}
    names, kinds = run.tensor_names, run.tensor_kinds
    first = int(np.searchsorted(run.steps, after, side="right"))
    for n, step in enumerate(run.steps[first:].tolist(), start=first):
        scalars = {f"{prefix}/loss": float(run.loss[rank_index, n]),
                   f"{prefix}/loss_scale": float(run.loss_scale[rank_index, n]),
                   f"{prefix}/skipped": float(run.skipped[rank_index, n])}
        histograms = {}
        if step in hist_row:
            counts = run.counts_at(hist_row[step], domain, rank=run.ranks[rank_index])          # (T, NBINS)
            for t, (name, kind) in enumerate(zip(names, kinds)):
                for special, col in SPECIALS.items():
                    scalars[f"{prefix}_{special}/{kind}/{name}"] = int(counts[t, col])
                buckets = log2_buckets(counts[t])
                if buckets is not None:
                    histograms[f"{prefix}_{kind}/{name}"] = buckets
        yield step, scalars, histograms


def _about(run: Run, domain: str) -> str:
    domains = run.meta.get("domains", {})
    shown = {k: (domains.get(k, "unscaled") if domain == "recorded" else domain) for k in sorted(set(run.tensor_kinds))}
    return ("ampviz run: histograms on a log2 |gradient| axis, one bucket per binade (2^k, 2^(k+1)]; "
            "zeros, inf and nan as scalars. Domains: " + ", ".join(f"{k} {v}" for k, v in shown.items())
            + f". torch {run.meta.get('torch_version', '?')}, device {run.meta.get('device', '?')}.")


# ---------------------------------------------------------------------------- TensorBoard
class _TensorBoardWriter:
    """One event per step holding all of that step's scalars and histograms (TensorBoard reads each tag as
    its own series): a step of a 72-tensor run is one event, not 288, so writing does not wait on the event
    queue (the protos are torch's own ``add_scalar`` / ``add_histogram_raw`` summaries)."""

    def __init__(self, log_dir):
        if importlib.util.find_spec("tensorboard") is None:
            raise MissingExtra("export to TensorBoard needs tensorboard, which is not installed: "
                               "pip install tensorboard")
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        from torch.utils.tensorboard import summary
        self._Event, self._Summary, self._summary = Event, Summary, summary
        self.log_dir = Path(log_dir)
        self._events = EventFileWriter(str(self.log_dir))

    def _add(self, step, summaries) -> None:
        values = [v for s in summaries for v in s.value]
        self._events.add_event(self._Event(wall_time=time.time(), step=int(step),
                                           summary=self._Summary(value=values)))

    def write(self, step, scalars, histograms):
        parts = [self._summary.scalar(tag, value) for tag, value in scalars.items()]
        for tag, (edges, counts) in histograms.items():
            centers = (edges[:-1] + edges[1:]) / 2          # sum / sum_squares: TensorBoard only displays buckets
            parts.append(self._summary.histogram_raw(
                tag, min=float(edges[0]), max=float(edges[-1]), num=int(counts.sum()), sum=float(centers @ counts),
                sum_squares=float(centers ** 2 @ counts), bucket_limits=edges[1:].tolist(),
                bucket_counts=counts.tolist()))
        self._add(step, parts)

    def text(self, tag, text):
        self._add(0, [self._summary.text(tag, text)])

    def flush(self):
        self._events.flush()

    def close(self):
        self._events.close()


def to_tensorboard(run: Run, log_dir, *, domain: str = "recorded", prefix: str = "ampviz",
                   progress: bool = False) -> list[Path]:
    """Write ``run`` as TensorBoard event files under ``log_dir``; returns the directories written.

    One directory for a one-rank run, ``log_dir/rank<r>`` for each rank of a merged run.
    """
    check_choice("domain", domain, VIEWS)
    _check_run(run)
    out = []
    for r, rank in enumerate(run.ranks):
        target = Path(log_dir) if len(run.ranks) == 1 else Path(log_dir) / f"rank{rank}"
        writer = _TensorBoardWriter(target)
        try:
            writer.text(f"{prefix}/about", _about(run, domain))
            for record in _progress(_step_records(run, r, domain, prefix), run, progress, f"rank {rank}"):
                writer.write(*record)
        finally:
            writer.close()
        out.append(target)
    return out


# ---------------------------------------------------------------------------- Weights & Biases
def _import_wandb():
    if importlib.util.find_spec("wandb") is None:
        raise MissingExtra("export to W&B needs wandb, which is not installed: pip install wandb")
    import wandb
    return wandb


def _start_wandb(wandb, **settings):
    """``wandb.init(**settings)``; W&B's own refusal (no login, no network) as one line saying what to do."""
    try:
        return wandb.init(**settings)
    except Exception as e:                     # noqa: BLE001 - wandb.errors.* and whatever its backend raises
        first = " ".join(str(e).split())[:160] or type(e).__name__
        raise Unavailable(f"W&B could not start a run ({type(e).__name__}: {first}). Log in with `wandb login` "
                          "(or set WANDB_API_KEY), or set WANDB_MODE=offline to write the run locally and "
                          "`wandb sync` it later") from None


class _WandbWriter:
    def __init__(self, wandb_run, prefix):
        self.wandb = _import_wandb()
        self.run, self.prefix = wandb_run, prefix
        # ampviz's own x axis: other loggers of the same W&B run keep theirs (W&B's custom step metric)
        self.run.define_metric(f"{prefix}/step")
        self.run.define_metric(f"{prefix}*", step_metric=f"{prefix}/step")

    def write(self, step, scalars, histograms):
        data = {f"{self.prefix}/step": step, **scalars}
        for tag, (edges, counts) in histograms.items():
            data[tag] = self.wandb.Histogram(np_histogram=(counts.tolist(), edges.tolist()))
        self.run.log(data)


def to_wandb(run: Run, wandb_run=None, *, domain: str = "recorded", prefix: str = "ampviz", project: str = "ampviz",
             progress: bool = False):
    """Log ``run`` to a W&B run: ``wandb_run``, else the active one (``wandb.run``), else a new one in
    ``project`` (finished before returning). Returns the W&B run used."""
    check_choice("domain", domain, VIEWS)
    _check_run(run)
    wandb = _import_wandb()
    target = wandb_run if wandb_run is not None else wandb.run
    started = target is None
    if started:
        target = _start_wandb(wandb, project=project, config={"ampviz": run.meta})
    try:
        for r, rank in enumerate(run.ranks):
            rank_prefix = prefix if len(run.ranks) == 1 else f"{prefix}_rank{rank}"
            writer = _WandbWriter(target, rank_prefix)
            for record in _progress(_step_records(run, r, domain, rank_prefix), run, progress, f"rank {rank}"):
                writer.write(*record)
    finally:
        if started:
            target.finish()
    return target


# ---------------------------------------------------------------------------- live, from a recorder
class LiveExport:
    """Write the steps a recorder has added since the last call (what the integrations' callbacks use).

    Parameters
    ----------
    tensorboard : a log directory, or None.
    wandb : True to log to the active W&B run (a new one in project "ampviz" when none is active),
        a W&B run object, or False.
    rank, world : this process's rank and the world size: TensorBoard writes ``<dir>/rank<r>`` when the
        world is larger than one; W&B is logged from rank 0 only (the rank a W&B run lives on).
    """

    def __init__(self, tensorboard=None, wandb=False, *, domain: str = "recorded", prefix: str = "ampviz",
                 rank: int = 0, world: int = 1):
        check_choice("domain", domain, VIEWS)
        if not (wandb is True or wandb is False or hasattr(wandb, "log")):
            raise TypeError(f"wandb: expected True, False or a W&B run, got {type(wandb).__name__}")
        self.domain, self.prefix = domain, prefix
        self._tb_dir = None if tensorboard is None else (Path(tensorboard) if world == 1
                                                          else Path(tensorboard) / f"rank{rank}")
        self._wandb = wandb if rank == 0 else False
        self._tb = self._wb = self._wb_started = None
        self._after = -1

    @property
    def enabled(self) -> bool:
        return self._tb_dir is not None or self._wandb is not False

    @property
    def last_step(self) -> int:
        """The last step written (-1 before the first): ``update(recorder.snapshot(after=last_step))``
        hands over only the histograms not written yet."""
        return self._after

    def update(self, run: Run) -> int:
        """Write the steps of ``run`` after the last one written; returns how many were written."""
        if not self.enabled or run.n_steps == 0:
            return 0
        self._open(run)
        written = 0
        for record in _step_records(run, 0, self.domain, self.prefix, after=self._after):
            for writer in (self._tb, self._wb):
                if writer is not None:
                    writer.write(*record)
            self._after, written = record[0], written + 1
        if self._tb is not None:
            self._tb.flush()
        return written

    def _open(self, run: Run) -> None:
        if self._tb is None and self._tb_dir is not None:
            self._tb = _TensorBoardWriter(self._tb_dir)
            self._tb.text(f"{self.prefix}/about", _about(run, self.domain))
        if self._wb is None and self._wandb is not False:
            wandb = _import_wandb()
            target = self._wandb if self._wandb is not True else wandb.run
            if target is None:
                target = self._wb_started = _start_wandb(wandb, project="ampviz")
            self._wb = _WandbWriter(target, self.prefix)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wb_started is not None:
            self._wb_started.finish()
        self._tb = self._wb = self._wb_started = None


def _check_run(run) -> None:
    if not isinstance(run, Run):
        raise TypeError(f"run: expected an ampviz.Run, got {type(run).__name__}")


def _progress(records, run: Run, show: bool, label: str):
    if not show or importlib.util.find_spec("tqdm") is None:
        return records
    from tqdm.auto import tqdm
    return tqdm(records, total=run.n_steps, desc=f"export {label}", unit="step")
