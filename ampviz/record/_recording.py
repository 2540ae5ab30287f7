"""One recording: everything an open Recorder holds, made at ``with recorder:`` and dropped at its end.

A :class:`~ampviz.Recorder` is its options and what it watches (chosen once, in ``Recorder(...)``); each
``with recorder:`` makes one ``_Recording``, the only owner of the state that changes while the loop runs:

* the counter, the store (``_store.StepStore``) and the hooks (``_hooks.Capture``);
* the step index and the current ``every``: it starts at ``options.every`` and doubles in one place,
  ``_decimated``, when the store dropped every other recorded step; ``_recorded(step)`` is the one decision
  "are this step's histograms recorded", handed to the hooks at each new step;
* where the counts go: ``_aim`` is the one place that sets ``counter.target`` (the store's current row);
* the misuse checks (``_checks.StepChecks``), the saves (``_save.Saver``) and the SIGTERM handler.

Its warnings go through ``ampviz._warnings.warn``, which points them at the user's line, however deep the
call that raised them. Per step: one call of ``step``; the hooks count on their own in between.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import __version__
from .._counting import Counter, make_counter
from .._dist import dist_info
from .._warnings import warn
from ..run import KIND_DOMAIN, Run, RunBlocks
from ._blocks import BlockCapture
from ._checks import StepChecks
from ._hooks import Capture
from ._paths import rank_file
from ._save import Saver
from ._signals import SaveOnTerm, held_signals
from ._store import StepStore
from ._unwrap import compiled_modules
from ._updates import UpdateCapture, state_names

if TYPE_CHECKING:
    from .recorder import Recorder

__all__: list[str] = []

_FILE_ARRAYS = ("steps", "loss", "loss_scale", "next_scale", "skipped", "hist_steps", "counts", "grad_order")
_UPDATE_ARRAYS = ("update_steps", "update_counts", "update_rel_counts", "update_stalled", "state_counts",
                  "state_stalled")


@dataclass(frozen=True)
class Outcome:
    """What a closed recording leaves to its Recorder: the run (None if closing failed before it was built), the
    last completed save, the ``every`` it ended with and its device."""

    run: Run | None
    saved: tuple[Path, int] | None
    every: int
    device: torch.device


class _Recording:
    """The state of one ``with recorder:``. ``start()`` installs the hooks (and the saver, the SIGTERM handler);
    ``step()`` ends one optimizer step; ``close()`` removes everything and builds the final run. Every attribute
    exists from ``__init__`` on."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec                                     # what is watched (fixed when the Recorder was made)
        options = rec.options
        self.scaler, self.scheduler = rec.scaler, options.scheduler
        # a framework that keeps the weight gradients and the loss scaler itself (ampviz.integrations.deepspeed):
        # it counts the weights (``install``) and gives the scale and skipped flag of each step
        self.framework = rec._framework
        first = next(rec.model.parameters(), None)
        self.device: torch.device = first.device if first is not None else torch.device("cpu")
        self.world, self.rank = dist_info()
        numel = sum(p.numel() for _, p in rec._params)
        self.counter: Counter = make_counter(self.device, capacity=numel + (1 << 16))
        try:
            self.every: int = options.every                # histograms every this many steps (_decimated doubles it)
            self.step_index = 0                            # rec.step() calls so far
            self.store = StepStore(self.device, len(rec.tensor_names), options.flush_every, options.max_bytes)
            self.capture = Capture(rec._params, rec._activations, rec._outputs, rec._local, self.counter, rec._ddp,
                                   recorded=self._recorded(0), external_weights=self.framework is not None)
            # watched modules compiled after Recorder(...) was made (``model.compile()``): no hook goes on them, since
            # even a hook that does nothing changes how torch.compile splits an in-place compiled module's graph
            self.late: set[int] = {i for i in compiled_modules(rec.model) if i in self.capture.watched}
            self.checks = StepChecks(self.scaler, sees_optimizer_steps=(rec.optimizer is not None or bool(rec._params)
                                                           or self.framework is not None),
                                     watched=len(set(self.capture.watched) - self.late),
                                     compiled=rec._compiled_anywhere or bool(self.late))
            self.forwards = 0                              # training forwards, for the check at close
            self.changes_seen: list[str] = []              # model changes already warned about (at the first step)
            self.prev_scale = (float(self.framework.scale()) if self.framework is not None else
                               1.0 if self.scaler is None else float(self.scaler.get_scale()))   # one host read
            self.scheduler_start = None if self.scheduler is None else int(self.scheduler.last_epoch)
            self.created = time.time()
            self.saver: Saver | None = None
            self.term = SaveOnTerm()
            self.run: Run | None = None                    # the final run, once close() built it
            # the weights' updates, every ``options.updates`` steps (0: off); not for a framework's own weights
            self.updates: UpdateCapture | None = None
            if options.updates and self.framework is None and rec._params:
                self.updates = UpdateCapture(rec._params, options.updates, self.device, state_names(rec.optimizer))
                self.updates.arm(0)
            elif options.updates:
                warn("Recorder: updates= records nothing here (" + ("the framework keeps the weights"
                     if self.framework is not None else "no weights are watched") + ")")
            # block statistics of the nn.Linear GEMM operands, every ``options.blocks.every`` steps (None: off)
            self.blocks: BlockCapture | None = None
            if options.blocks is not None and rec._blocks:
                self.blocks = BlockCapture(rec._blocks, options.blocks, self.device)
                self.blocks.arm(0)
            elif options.blocks is not None:
                warn("Recorder: blocks= records nothing here (the model has no nn.Linear module)")
            self._aim()
        except BaseException:
            self.counter.close()
            raise

    # ------------------------------------------------------------------ start / close
    def start(self) -> None:
        """Install the hooks, and with a ``path`` the saver and the SIGTERM handler. On failure call ``teardown``."""
        rec = self.rec
        if self.late:
            names = [n for n, m in rec._activations + rec._outputs if id(m) in self.late]
            warn(f"Recorder: the model was compiled after Recorder(...) was made, so {len(self.late)} watched "
                 f"modules now run under torch.compile ({', '.join(list(dict.fromkeys(names))[:3])}): a hook "
                 f"on them would change the compiled graph and training, so their activation gradients and "
                 f"outputs are not recorded (weight gradients are). Make the Recorder once the model is "
                 f"compiled, with activations=False.")
        # the model's own forward pre-hook marks micro-batches; not inside an in-place compiled module
        root = None if getattr(rec._given, "_compiled_call_impl", None) is not None else rec._given
        self.capture.install(root, rec.optimizer, global_hook=rec.optimizer is None, scaler=self.scaler,
                             skip=self.late)
        if self.updates is not None:
            self.updates.install(rec.optimizer, self.capture.handles)                 # removed with the hooks
        if self.blocks is not None:
            late = compiled_modules(rec.model)
            skipped = [n for n, m in rec._blocks if id(m) in late]
            if skipped:
                warn(f"Recorder: the model was compiled after Recorder(...) was made, so {len(skipped)} modules "
                     f"chosen by blocks= now run under torch.compile ({', '.join(skipped[:3])}): their block "
                     f"statistics are not recorded (a hook would change the compiled graph)")
            self.blocks.install(self.capture.handles, skip=late)                      # removed with the hooks
        if self.framework is not None:
            self.capture.handles.append(self.framework.install(self.capture))     # removed with the hooks
        path = rec.options.path
        if path is not None:
            self.saver = Saver(rank_file(Path(path), self.world, self.rank), rec.options.save_every,
                               rec.options.save_every_steps)
            self.term.install()

    def teardown(self) -> None:
        """Remove every hook (and the references to gradients), put SIGTERM's handler back, release the counter."""
        self.capture.remove()
        self.term.restore()
        self.counter.close()

    def close(self, failing: bool) -> None:
        """Remove everything, flush, build ``self.run`` and save it; unless ``failing`` (the loop raised), warn
        about what went unrecorded."""
        self.term.restore()                       # the handler of before; signals wait until the save is done
        with held_signals(f"saving the run to {self.saver.target}" if self.saver else "closing the recorder"):
            self.teardown()
            self.flush()
            self.run = self.build_run(final=True)
            if self.saver is not None:
                self.saver.save(self.store, self.step_index, self._file_meta(), self._file_arrays,
                                updates=self._update_rows(), blocks=self._block_rows())
            if not failing:
                self.checks.at_close(self.step_index, self.capture, self.forwards)
                problems = [p for p in self.rec._model_changes() if p not in self.changes_seen]
                if problems:
                    warn(f"Recorder: the model changed while recording ({'; '.join(problems[:4])}): those rows "
                         f"stopped filling")

    def outcome(self) -> Outcome:
        return Outcome(self.run, self.saved, self.every, self.device)

    @property
    def saved(self) -> tuple[Path, int] | None:
        return None if self.saver is None else self.saver.saved

    def wait(self) -> None:
        self.counter.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ per step
    def _recorded(self, step: int) -> bool:
        """Whether the histograms of step ``step`` are recorded: the one place that decides it."""
        return step % self.every == 0

    def _aim(self) -> None:
        """Point the counter at the store's current row: the one place that sets where counts go."""
        self.counter.target = self.store.slot()

    def _decimated(self, halvings: int) -> None:
        """The store dropped every other recorded step ``halvings`` times: ``every`` doubles as often (the one
        place that changes it), each time with a warning."""
        for _ in range(halvings):
            self.every *= 2
            warn(f"Recorder: histograms reached max_bytes={self.store.max_bytes}; keeping every {self.every}th "
                 f"step from now on")

    def _flush_counts(self) -> None:
        self._decimated(self.store.flush_counts(self.counter, self.every))
        self._aim()

    def flush(self) -> None:
        """Copy everything recorded so far to the host (a device->host sync)."""
        self._flush_counts()
        self.store.flush_scalars()
        if self.updates is not None:
            self.updates.flush()
        if self.blocks is not None:
            self.blocks.flush()

    def _update_rows(self) -> int:
        return 0 if self.updates is None else self.updates.n_rows

    def _block_rows(self) -> int:
        return 0 if self.blocks is None else self.blocks.n_rows

    def step(self, loss: Any) -> None:
        """End one optimizer step (``rec.step(loss)``)."""
        capture = self.capture
        epoch = None if self.scheduler is None else self.scheduler.last_epoch
        fw = self.framework
        if fw is None:
            self.store.put_scalars(loss, self.scaler, epoch)
        else:
            self.store.put_scalars(loss, None, epoch, scale=fw.scale(), skipped=fw.skipped())
        self.checks.at_step(capture)
        if capture.capturing:
            capture.finish_step()
            if self.store.end_row(self.step_index, capture.order):     # the ring is full
                self._flush_counts()
            else:
                self._aim()
        if self.step_index == 0:
            problems = self.changes_seen = self.rec._model_changes()
            if problems:
                warn(f"Recorder: the model changed after `with recorder:` began ({'; '.join(problems[:4])}): "
                     f"those rows do not fill")
        self.forwards += capture.forwards
        if self.updates is not None:
            self.updates.end_step(self.step_index)
        if self.blocks is not None:
            self.blocks.end_step(self.step_index)
        self.step_index += 1
        capture.new_step(recorded=self._recorded(self.step_index))
        if self.updates is not None:
            self.updates.arm(self.step_index)
        if self.blocks is not None:
            self.blocks.arm(self.step_index)
        if self.saver is not None and self.saver.due(self.step_index):
            self.flush()                                   # note: a device->host sync, once per save
            self.saver.periodic(self.store, self.step_index, self._file_meta(), self._file_arrays,
                                updates=self._update_rows(), blocks=self._block_rows())

    # ------------------------------------------------------------------ the run and its file
    def _file_arrays(self, steps_from: int, rows_from: int, updates_from: int = 0,
                     blocks_from: int = 0) -> dict[str, np.ndarray]:
        """The arrays of the rank file (views of the store) from step ``steps_from``, histogram row ``rows_from``,
        update row ``updates_from`` and block row ``blocks_from`` on."""
        a = self.store.arrays(self.prev_scale, self._skip_by_scale(), copy=False, steps_from=steps_from,
                              rows_from=rows_from)
        out = {k: a[k] for k in _FILE_ARRAYS + (("scheduler_steps",) if self.scheduler is not None else ())}
        if self.updates is not None:
            out.update(self.updates.arrays(updates_from))
        if self.blocks is not None:
            out.update(self.blocks.arrays(blocks_from))
        return out

    def _file_meta(self) -> dict[str, Any]:
        rec = self.rec
        meta = dict(self._meta(), rank=self.rank, tensor_names=list(rec.tensor_names),
                    tensor_kinds=list(rec.tensor_kinds), tensor_dtypes=self._tensor_dtypes())
        meta.pop("ranks")
        if self.blocks is not None:
            meta["blocks"] = self.blocks.meta()
        return meta

    def _skip_by_scale(self) -> bool:
        return self.scaler is not None and self.scaler.get_backoff_factor() < 1

    def build_run(self, final: bool, hist_after: int = -1) -> Run:
        """The run of what was flushed: sharing the store's arrays (``final``) or a copy (a snapshot)."""
        rec = self.rec
        a = self.store.arrays(self.prev_scale, self._skip_by_scale(), copy=not final, hist_after=hist_after)
        per_rank = {k: a[k][None] for k in ("loss", "loss_scale", "next_scale", "skipped", "counts", "grad_order")}
        scheduler_steps = None if self.scheduler is None else a["scheduler_steps"][None]
        updates: dict[str, Any] = {}
        if self.updates is not None:
            u = self.updates.arrays(0)
            updates = {k: (v if k == "update_steps" else v[None]) for k, v in u.items()}
        blocks = None
        if self.blocks is not None:
            b = self.blocks.arrays(0)
            blocks = RunBlocks.from_file(self.blocks.meta(), b["block_steps"], b["block_counts"][None],
                                         b["block_sumsq"][None])
        return Run(a["steps"], hist_steps=a["hist_steps"], tensor_names=list(rec.tensor_names),
                   tensor_kinds=list(rec.tensor_kinds), tensor_dtypes=self._tensor_dtypes(),
                   meta=self._meta(), scheduler_steps=scheduler_steps, blocks=blocks, **per_rank, **updates)

    def _tensor_dtypes(self) -> list[str]:
        """Each row's dtype: weight rows the parameters' dtypes now (a model.to(dtype) after Recorder(...) changes
        them), the others as the hooks saw them."""
        rec = self.rec
        dtypes = [str(p.dtype) for _, p in rec._params]
        initial = dtypes + [""] * (len(rec._activations) + len(rec._outputs)) + (dtypes if rec._local else [])
        return self.capture.final_dtypes(initial)

    def _meta(self) -> dict[str, Any]:
        sc = self.scaler
        return {"ampviz_version": __version__, "torch_version": torch.__version__, "device": str(self.device),
                "world_size": self.world, "ranks": [self.rank], "every": self.every,
                "decimated": self.store.decimations, "created": self.created,
                "domains": dict(KIND_DOMAIN),
                "scaler": None if sc is None else {
                    "init_scale": self.prev_scale, "growth_factor": sc.get_growth_factor(),
                    "backoff_factor": sc.get_backoff_factor(), "growth_interval": sc.get_growth_interval(),
                    # calls of this scaler's step() while recording: 0 over recorded steps means the loop used
                    # another scaler (or none), and the scale and skips recorded are not the loop's
                    "steps_called": self.capture.total_scaler_steps},
                # the loop called scaler.unscale_(opt) before scaler.step(opt) (to clip): the doctor reads clipped
                # weight gradients of skipped steps as such only then
                "unscaled_before_step": None if sc is None else self.capture.unscaled_before_step,
                # where the scheduler's last_epoch stood when recording began (a resumed one is not at 0)
                "scheduler": None if self.scheduler is None else {"last_epoch_at_start": self.scheduler_start},
                "options": self.rec.options.meta(),   # how it was recorded (every: as asked; "every" above: now)
                # the optimizer state tensors measured with the updates (state_counts' axis S), when any
                **({"state_names": list(self.updates.state_names)} if self.updates and self.updates.state_names
                   else {}),
                **({} if self.framework is None else self.framework.meta())}
