"""What the framework callbacks share: checking Recorder options early, and one recording session
(the Recorder, the loss of the current optimizer step, the live export)."""

from __future__ import annotations

import warnings

import torch

from .._args import check_int
from .._dist import dist_info
from .._warnings import AmpvizWarning
from ..export import LiveExport
from ..record import Recorder, RecordOptions

# accelerate (1.15) enables fp16 autocast and a GradScaler only off the CPU (Accelerator.__init__)
FP16_ON_CPU = ("holds no GradScaler on this CPU: accelerate enables fp16 autocast and a GradScaler only off the "
               "CPU, so this run trains in fp32 (loss scale 1, no skipped steps); use bf16 on a CPU")


class Session:
    """One recording: a Recorder entered at the start of training, stepped once per optimizer step with
    the step's loss (summed over its micro-batches), exported live every ``export_every`` steps, closed
    (hooks removed, run saved and exported) at the end."""

    def __init__(self, where: str, path, options: dict, tensorboard, wandb, export_every, domain: str):
        # the Recorder's options, checked now (not at the first training step); the path is the callback's own
        # argument, the scheduler the trainer's unless the options name one
        unknown = sorted(set(options) - set(_option_names()))
        if unknown:
            raise TypeError(f"{where}: unknown Recorder option(s) {unknown}; valid: {_option_names()}")
        self.where, self.path = where, path
        self.options = RecordOptions(path=path, **options)
        self._own_scheduler = "scheduler" in options
        if self.options.local_weights:
            raise ValueError(f"{where}: local_weights=True cannot be recorded from a callback: the trainer hands "
                             f"callbacks the model itself, not its DistributedDataParallel wrapper, whose backward "
                             f"is where local gradients are read. The default records the all-reduced gradients the "
                             f"optimizer uses; for local ones, use ampviz.Recorder(ddp_model, local_weights=True) "
                             f"in your own loop")
        if export_every is not None:
            check_int("export_every", export_every, low=1)
        self.export_every, self.tensorboard, self.wandb, self.domain = export_every, tensorboard, wandb, domain
        LiveExport(tensorboard, wandb, domain=domain)            # checks the export arguments now
        self.recorder: Recorder | None = None
        self.live: LiveExport | None = None
        self.run = None                                          # the last finished recording
        self._loss, self._steps, self._warned = None, 0, set()

    def start(self, model, optimizer, scaler, scheduler, default_export_every: int,
              compiled_by: str | None = None, engine=None) -> Recorder:
        """Enter a Recorder on what the framework holds; ``scheduler`` unless the options name one.
        ``compiled_by``: the setting that makes the framework run ``model`` under torch.compile through a
        wrapper the callback never sees (the Recorder's ``compiled_by``). ``engine``: the DeepSpeed engine that
        trains ``model``: then the Recorder is ``ampviz.integrations.deepspeed.Recorder(engine)`` (its gradient
        partitions, its loss scaler and skipped steps; ``optimizer`` and ``scaler`` are the engine's)."""
        self.close()                             # a second trainer.fit()/train() starts a new recording
        world, rank = dist_info()
        given = {} if self._own_scheduler else {"scheduler": scheduler}
        if compiled_by is not None:
            given["compiled_by"] = compiled_by
        if engine is not None:
            from .deepspeed import Recorder as EngineRecorder
            self.recorder = EngineRecorder(engine, options=self.options, **given)
        else:
            self.recorder = Recorder(model, optimizer, scaler=scaler, options=self.options, **given)
        self.live = LiveExport(self.tensorboard, self.wandb, domain=self.domain, rank=rank, world=world)
        self._every = self.export_every or default_export_every
        self._loss, self._steps = None, 0
        self.recorder.__enter__()
        return self.recorder

    @property
    def open(self) -> bool:
        return self.recorder is not None

    def add_loss(self, loss) -> None:
        """Add one micro-batch's share of the step's loss (a tensor stays on its device: no sync)."""
        if loss is None:
            return
        loss = loss.detach().reshape(()).float() if isinstance(loss, torch.Tensor) else float(loss)
        self._loss = loss if self._loss is None else self._loss + loss

    def step(self) -> None:
        """The optimizer step (and ``scaler.update()``) is done: record it."""
        if self.recorder is None:
            return
        self.recorder.step(self._loss)
        self._loss, self._steps = None, self._steps + 1
        if self.live.enabled and self.recorder.enabled and self._steps % self._every == 0:
            # a snapshot holding only the histograms not written yet: one host copy of the new steps
            self.live.update(self.recorder.snapshot(after=self.live.last_step))

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"{self.where}: {message}", AmpvizWarning, stacklevel=3)

    def close(self) -> None:
        """Remove the hooks, save the run (if ``path``), write what the live export has not written yet."""
        rec, live = self.recorder, self.live
        self.recorder = self.live = None
        if rec is None:
            return
        try:
            rec.close()
            self.run = rec.run if rec.enabled else None
            if live.enabled and self.run is not None:
                live.update(self.run)
        finally:
            live.close()



def _option_names() -> list[str]:
    return [n for n in RecordOptions.names() if n != "path"]        # the callbacks take path themselves
