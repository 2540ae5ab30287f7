"""The Recorder: watch a training loop and record gradient histograms and the loss-scale trace.

It only observes. Add it around an unchanged loop::

    rec = ampviz.Recorder(model, optimizer, scaler=scaler)     # activations=True, every=1
    with rec:                                  # hooks installed here, removed on exit
        for x, y in loader:
            with torch.amp.autocast(device_type, dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()      # activation-gradient hooks fire here
            scaler.step(optimizer)             # weight gradients are read just before the step
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            rec.step(loss)                     # once per optimizer step, after scaler.update()
    run = rec.run                              # an ampviz.Run

What is stored, and in which domain:

* weight gradients, one histogram per parameter, **unscaled**: read in an optimizer step
  pre-hook, i.e. as the optimizer sees them (after ``GradScaler.unscale_``, or divided by the
  ``grad_scale`` a GradScaler hands a fused optimizer, whose kernel unscales them; after every
  accumulated micro-batch, after DDP's all-reduce, after any clipping); with ``step(closure)``
  (LBFGS, SAM, Lightning without a scaler) once the closure's first call has run the backward.
  A step the scaler skips never reaches the optimizer (a fused one's step runs and skips inside: counted
  in the pre-hook as above); its gradients (unscaled in place by ``scaler.step``, containing the inf/nan)
  are counted when the given scaler's ``step`` returns, before the loop can zero them, also in place
  (``zero_grad(set_to_none=False)``); a loop that skips by itself has them read at ``rec.step()``.
  Under FSDP2 each rank counts its shard: the ranks' counts add up to the full gradient's.
* activation gradients, the gradient w.r.t. each chosen module's output, **scaled**: exactly as
  the backward computed them (in fp16 under fp16 autocast, multiplied by the loss scale).
  Micro-batches of one step add up.
* forward outputs (``outputs=``, off by default), in the dtype autocast produced, **unscaled**
  (the loss scale never reaches the forward): where a forward overflow shows. Forwards under
  ``no_grad`` (evaluation) and checkpointing's recomputation are not counted; a reentrant checkpoint's
  forward, which runs under ``no_grad`` inside a training call of the model, is.
* per step: the loss you pass, the loss scale the step used, the scale after ``update()``,
  whether the step was skipped (the scale went down), and the LR scheduler's ``last_epoch``;
  per recorded step the order in which each gradient was counted in the step's first backward.

The GradScaler's ``step`` is wrapped on the instance while recording (put back on exit): it is how a
skipped step's gradients are counted in time, and how a scaler the loop never uses is noticed (a warning).
Under torch.compile give the Recorder the compiled model: hooks that find themselves traced by a compile it
was not told about (the loop calls ``torch.compile(model)``) stand down, so training is unchanged, and the next
``rec.step()`` says that activations are not recorded; modules compiled in place after ``Recorder(...)`` was
made get no hook at ``with recorder:`` (a warning).

Cost: keys and counts stay on the device; there is no host sync per tensor. The counts are
copied to the host once every ``flush_every`` recorded steps. Host memory stays within
``max_bytes`` (plus ``max_bytes / 16`` for the ring and about 40 bytes per step) by **decimation**:
when the histograms fill it, every other recorded step is dropped and ``every`` doubles
(``run.meta["decimated"]`` says how often).

Block statistics (``blocks=``, off by default): on their own period, what MX / NVFP4 / row-wise / tiled fp8 casts
would do to each ``nn.Linear``'s input, weight and output gradient (see ``blocks`` below and docs/blocks.md)::

    rec = ampviz.Recorder(model, optimizer, blocks={"every": 100, "layouts": ["mx32", "nv16"]})
    ...                                            # the loop above
    what_if(rec.run.block_counts("layers.0.mlp.up", "input", "mx32"), "mxfp8_e4m3")

Saving: with ``path``, the run reaches the disk while it is recorded, every ``save_every`` seconds
(default 60) and/or every ``save_every_steps`` steps, at a ``rec.step()``: a save appends the steps
recorded since the previous one (``ampviz.run``'s appending writer), so it costs what is new, not the whole run,
and a crash, a ``kill -9`` or a dead torchrun peer loses at most the last interval. A save is never
cut short: a Ctrl-C or SIGTERM that arrives during one takes effect once the file is complete.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn

from .._args import check_int
from .._warnings import warn
from ..run import Run
from ._blocks import linear_modules
from ._checks import model_changes
from ._recording import Outcome, _Recording
from ._select import (
    attention_in_place_of_out_proj,
    default_modules,
    named_modules,
    named_parameters,
    select,
    trainable_param,
)
from ._unwrap import compiled_modules, unwrap_model, unwrap_optimizer
from .options import RecordOptions

__all__ = ["Recorder"]


class Recorder:
    """Record gradient-magnitude histograms and the loss-scale trace of a training loop.

    Parameters
    ----------
    model : the ``nn.Module`` being trained (DDP and ``torch.compile`` wrappers are unwrapped; create the
        Recorder once the model is final, e.g. after ``fully_shard``).
    optimizer : its optimizer (recommended; accelerate's and Lightning's wrappers are unwrapped). Without
        it a global optimizer hook is used, which fires for any optimizer that steps the model's parameters.
    scaler : the ``torch.amp.GradScaler`` in use, or None (bf16 / fp32 training).
    weights : record weight gradients: True (all trainable parameters), False, a regex on the
        parameter name, a list of names, or a callable ``(name, param) -> bool``.
    activations : record activation gradients: True (every leaf module with a trainable parameter of its
        own; an ``nn.MultiheadAttention`` in place of its ``out_proj``, which it never calls), False, a
        regex on module names, a list of names, or a callable ``(name, module) -> bool``. A module's output
        may be a tensor, or a tuple, list, dict or ``ModelOutput``: its first floating-point tensor counts.
        Under ``torch.compile`` activation capture is off (a hook would add graph breaks and change
        training): ``True`` (the default) records none and says so in a warning; naming modules (a regex,
        list or callable) is an error, as is any ``outputs=`` choice.
    outputs : record forward outputs (kind "output", rows named ``"<module> [output]"``): True (the modules
        ``activations=True`` picks), False (default), or a regex / list / callable as for ``activations``.
    local_weights : under DDP, also record each rank's *local* weight gradients, before the
        all-reduce (kind "weight_local", named "<param> [local]", scaled as computed). They are read
        in the backward pass that all-reduces, i.e. the micro-batch outside ``no_sync()``; use
        ``no_sync()`` on the others, or each backward is counted.
    scheduler : the LR scheduler, if any: its ``last_epoch`` is recorded at every ``rec.step()``
        (``run.scheduler_steps``), so a scheduler that steps on skipped steps shows.
    every : record histograms every ``every`` optimizer steps (scalars are kept for every step).
    flush_every : recorded steps buffered on the device between host copies (capped so the buffer
        stays within ``max_bytes / 16``).
    max_bytes : bound on the host memory of the histograms (decimation beyond it).
    path : where the run is saved while it is recorded (see ``save_every``) and on exit, also when the loop
        raises or on SIGTERM: a file ending in ``.npz`` (under DDP each rank writes ``<stem>.rank{r}.npz``
        beside it), or a directory (an existing one whatever its name, or a new name without a dot),
        which receives ``rank{r}.npz``. Checked here: a path that could never be written is an error
        now, not after training.
    save_every : with ``path``, also save every this many seconds (default 60), at the first ``rec.step()``
        after they have passed; None: not by time. A save appends what was recorded since the previous
        one: a crash loses at most the last interval.
    save_every_steps : with ``path``, also save every this many steps; None (default): not by steps.
    enabled : False makes the recorder a no-op (no hooks), like ``autocast(enabled=False)``.
    compiled_by : where a framework runs ``model`` under torch.compile through a wrapper the Recorder never
        sees, the setting that does it (e.g. ``"TrainingArguments(torch_compile=True)"``): the rules above for
        compiled models then apply to the whole model, and the warning and errors name the setting.
    updates : measure the weights' applied updates every this many steps (True: every 100; False, the default:
        never): on those steps each watched parameter the optimizer steps is copied just before
        ``optimizer.step`` (one copy of those parameters in their dtype, on those steps only) and compared after:
        ``run.update_counts`` (|dw| / ulp(w) in the weight's dtype), ``run.update_rel_counts`` (|dw| / |w|) and
        ``run.update_stalled`` (gradient non-zero, weight unchanged), along ``run.update_steps``. A step the
        GradScaler skipped has no update row. The doctor's ``weights_stall`` reads them. The optimizer's
        per-element state (Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's ``momentum_buffer``: ``run.state_names``) is
        copied and compared on the same steps: ``run.state_counts`` (|ds| / |s|) and ``run.state_stalled``
        (changed, but below half a bf16 ulp: would not move in bf16), read by the doctor's
        ``bf16_optimizer_state_would_stall``. Memory on those steps: one copy of the stepped parameters and of
        their state in their dtypes (fp32 AdamW: 12 bytes per parameter), plus float64 temporaries of 32000
        elements; cost: ``benchmarks/update_cost.py``.
    blocks : record block statistics (:mod:`ampviz.blocks`) of the tensors an fp8 / fp4 recipe casts, on their own
        period: False (the default, also None or 0): never; True: every 100 steps in every layout (mx32, nv16, row,
        tile1x128, tile128x128); an int: every this many steps; a dict with any of ``every`` (steps, default 100),
        ``layouts`` (a layout name or a list of them, or ``BlockLayout`` objects) and ``modules`` (a regex, list of
        names or callable on the modules, as ``activations=``; default all). The modules that count are
        ``nn.Linear`` and its subclasses (torchao's Float8Linear is one), but not an ``nn.MultiheadAttention``'s
        ``out_proj``, which attention never calls; under torch.compile, none (choosing compiled ones is an error).
        On a step due (``step % every == 0``) three tensors of each are counted, each blocked along the reduction
        dimension of the GEMM that consumes it: its ``input`` (``Y = X Wᵀ``; last dim) and ``weight``
        (``in_features``, its last dim; once per step), both as the GEMM receives them (under autocast: cast to its
        dtype, a copy), and its ``grad_output`` (``dX = g W``; last dim), as the backward computed it (scaled, like
        activation gradients). A dimension that is not a multiple of the block counts as zero-padded; micro-batches
        add up; forwards under ``no_grad`` and checkpointing's recomputation are not counted. The hooks only read
        (no in-place op, no RNG): training stays bit-identical. The counts stay on the device (no host sync per
        tensor) until the Recorder flushes (a save, ``rec.run``, exit, or every 8 rows). ``run.blocks`` holds them
        (``steps``, ``counts`` and ``sumsq`` of shape (ranks, steps, tensors, layouts, N_COUNTS), ``modules``,
        ``kinds``, ``layouts``); ``run.block_counts(module, kind, layout, step=None, rank=None)`` gives an
        ``ampviz.blocks.BlockCounts`` (summed over the recorded steps and ranks unless narrowed), for ``what_if``.
    options : an :class:`ampviz.RecordOptions` holding the options above (the keyword arguments given with it
        change those); ``rec.options`` is the one in use, and the run's ``meta["options"]`` its JSON.
    """

    def __init__(self, model: nn.Module, optimizer: Any = None, scaler: torch.amp.GradScaler | None = None, *,
                 options: RecordOptions | None = None, **kw: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if any(c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed") for c in type(model).__mro__):
            # its ZeRO stages keep the gradients outside .grad and scale the loss themselves: hooks here would count
            # the wrong tensors, or none
            raise TypeError(f"model: a DeepSpeed engine ({type(model).__name__}); record it with "
                            f"ampviz.integrations.deepspeed.Recorder(engine), which reads its gradient partitions "
                            f"and its loss scaler")
        self.optimizer = unwrap_optimizer(optimizer)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler: expected a torch.amp.GradScaler or None, got {type(scaler).__name__}")
        self.options = opts = RecordOptions.build(options, **kw)
        weights, activations, outputs, compiled_by = opts.weights, opts.activations, opts.outputs, opts.compiled_by
        # what is watched, chosen once here (a _Recording reads it; nothing below changes while recording)
        self._given = model
        self.model, self._ddp, self._compiled = unwrap_model(model)
        self._compiled_by = compiled_by
        self._compiled = self._compiled or compiled_by is not None
        if opts.local_weights and self._ddp is None:
            raise ValueError("local_weights: True needs a DistributedDataParallel model (local and reduced "
                             "gradients only differ under DDP)")
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._params = select(named_parameters(self.model), weights, "weights", default=trainable_param)
        frozen = [n for n, p in self._params if not p.requires_grad]
        if frozen and isinstance(weights, (list, tuple, set)):
            raise ValueError(f"weights: {frozen[:3]} do not require grad (frozen), so they never get a gradient")
        self._params = [(n, p) for n, p in self._params if p.requires_grad]   # a filter's frozen matches: skipped
        if frozen and not self._params:
            raise ValueError(f"weights: the filter {weights!r} matches only frozen parameters ({frozen[:3]} ...)")
        self._all_weights = weights is True
        self._default_modules = default_modules(self.model)
        self._compiled_anywhere = False                   # some watched module runs compiled (set by _modules_for)
        self._activations = self._modules_for(activations, "activations")
        self._outputs = self._modules_for(outputs, "outputs")
        self._blocks = self._block_modules(opts.blocks)
        # a module added later would have been chosen: only for the default choice, outside torch.compile
        self._watch_added_modules = (activations is True or outputs is True) and not self._compiled_anywhere
        self._local = opts.local_weights
        watched = [n for n, _ in self._params]
        self.tensor_names = (watched + [n for n, _ in self._activations] + [f"{n} [output]" for n, _ in self._outputs]
                             + ([f"{n} [local]" for n in watched] if self._local else []))
        self.tensor_kinds = (["weight"] * len(watched) + ["activation"] * len(self._activations)
                             + ["output"] * len(self._outputs)
                             + (["weight_local"] * len(watched) if self._local else []))
        # the lifecycle: new -> open (one _Recording while enabled) -> closed (its Outcome kept)
        self._open = self._closed = False
        # a framework that holds the weight gradients and the loss scaler itself (set by an integration)
        self._framework: Any = None
        self._recording: _Recording | None = None
        self._outcome: Outcome | None = None

    # ------------------------------------------------------------------ options, read-only
    @property
    def scheduler(self) -> Any:
        return self.options.scheduler

    @property
    def enabled(self) -> bool:
        return self.options.enabled

    @property
    def path(self) -> Any:
        return self.options.path

    @property
    def save_every(self) -> float | None:
        return self.options.save_every

    @property
    def save_every_steps(self) -> int | None:
        return self.options.save_every_steps

    @property
    def flush_every(self) -> int:
        """As given (the store's ring may hold fewer rows: it stays within ``max_bytes / 16``)."""
        return self.options.flush_every

    @property
    def max_bytes(self) -> int:
        return self.options.max_bytes

    @property
    def every(self) -> int:
        """Histograms are recorded every this many steps: ``options.every`` until decimation doubles it while
        recording (``run.meta["every"]`` is the value at the end)."""
        if self._recording is not None:
            return self._recording.every
        return self._outcome.every if self._outcome is not None else self.options.every

    @property
    def device(self) -> torch.device | None:
        """Where the counts are made (the model's device when recording began); None before ``with recorder:``."""
        if self._recording is not None:
            return self._recording.device
        return self._outcome.device if self._outcome is not None else None

    def _modules_for(self, spec: Any, argname: str) -> list[tuple[str, nn.Module]]:
        chosen = select(named_modules(self.model), spec, argname, default=self._default_modules)
        chosen, replaced = attention_in_place_of_out_proj(self.model, chosen, argname)
        if replaced and spec is not True and self.enabled:
            warn(f"{argname}: nn.MultiheadAttention never calls its out_proj ({', '.join(replaced[:3])}); "
                 f"recording the attention module's output instead (the same tensor)")
        inside = {id(m) for m in self.model.modules()} if self._compiled else compiled_modules(self.model)
        self._compiled_anywhere = bool(inside)           # the same for both calls: the model's compiled modules
        hit = [n for n, m in chosen if id(m) in inside]
        if not hit:
            return chosen
        by = self._compiled_by
        if spec is not True or argname == "outputs":         # asked for, not the default: refuse
            what = argname if by is None else f"{argname}={spec!r} with {by}"
            raise ValueError(f"{what}: {len(hit)} chosen modules run inside torch.compile ({', '.join(hit[:3])}); "
                             f"a hook on them would add graph breaks and change the compiled training. Record "
                             f"the model without torch.compile, or pass {argname}=False (weights are still recorded)")
        if self.enabled:
            warn(f"{by or argname}: the model runs under torch.compile, where a hook on its modules would add "
                 f"graph breaks and change training, so {argname} are not recorded for {len(hit)} modules "
                 f"(weight gradients still are); pass {argname}=False to say so")
        return [(n, m) for n, m in chosen if id(m) not in inside]

    def _block_modules(self, spec: Any) -> list[tuple[str, nn.Module]]:
        """The ``nn.Linear`` modules whose block statistics ``blocks=`` records (none when it is off)."""
        if spec is None:
            return []
        chosen = select(linear_modules(self.model, named_modules(self.model)), spec.modules, "blocks: modules",
                        default=lambda name, module: True)
        inside = {id(m) for m in self.model.modules()} if self._compiled else compiled_modules(self.model)
        hit = [n for n, m in chosen if id(m) in inside]
        if hit:
            raise ValueError(f"blocks: {len(hit)} chosen modules run inside torch.compile ({', '.join(hit[:3])}); a "
                             f"hook on them would add graph breaks and change the compiled training. Record the "
                             f"model without torch.compile, or pass blocks=False")
        return chosen

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Recorder:
        if self._open:
            raise RuntimeError("Recorder is already open")
        if self._closed:
            raise RuntimeError("Recorder was closed; create a new one to record again")
        if self.enabled:
            problems = self._model_changes()
            if problems:
                raise RuntimeError(f"Recorder: the model changed after Recorder(...) was made "
                                   f"({'; '.join(problems[:4])}{' ...' if len(problems) > 4 else ''}): those rows "
                                   f"would never fill. Create the Recorder once the model is final (after "
                                   f"fully_shard, adapters, layer changes)")
            recording = _Recording(self)
            try:
                recording.start()
            except BaseException:
                recording.teardown()              # nothing installed is left behind
                raise
            self._recording = recording
        self._open = True
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is None:
            self.close()
            return False
        try:
            self._close(failing=True)
        except Exception as close_error:          # the user's exception stays the one raised
            what = f"saving the run to {self.path}" if self.path is not None else "closing the recorder"
            built = self._outcome is not None and self._outcome.run is not None
            kept = ("it is still in recorder.run: save it elsewhere with recorder.run.save(path)"
                    if built else "what was recorded is lost")
            if self.saved is not None:
                kept += f" (the file holds the {self.saved[1]} steps of the last save)"
            note = f"ampviz: {what} also failed ({type(close_error).__name__}: {close_error}); {kept}"
            if hasattr(exc, "add_note") and isinstance(exc, Exception):
                exc.add_note(note)
            else:                                 # SystemExit prints no traceback, so no notes; Python 3.10
                print(note, file=sys.stderr)
        return False

    def close(self) -> None:
        """Remove every hook, flush what was recorded, build ``self.run`` and save it if ``path``."""
        self._close(failing=False)

    def _close(self, failing: bool) -> None:
        if self._closed:
            return
        self._closed, self._open = True, False
        recording, self._recording = self._recording, None
        if recording is None:                     # enabled=False, or never entered
            return
        try:
            recording.close(failing)
        finally:
            self._outcome = recording.outcome()   # what is left of it: the run, the last save, every, device

    def wait(self) -> None:
        """Block until the counts of every recorded step so far have landed (on the GPU they are
        computed asynchronously). Useful for timing; never needed for correctness."""
        if self._recording is not None:
            self._recording.wait()

    @property
    def saved(self) -> tuple[Path, int] | None:
        """``(file, steps)`` of the last save that completed (periodic or on exit), or None: what is on disk."""
        if self._recording is not None:
            return self._recording.saved
        return self._outcome.saved if self._outcome is not None else None

    @property
    def run(self) -> Run:
        """The recorded run (a snapshot if the recorder is still open)."""
        if not self.enabled:
            raise RuntimeError("Recorder(enabled=False) records nothing")
        if self._outcome is not None and self._outcome.run is not None:
            return self._outcome.run
        if self._recording is None:
            raise RuntimeError("Recorder has not been entered yet")
        self._recording.flush()
        return self._recording.build_run(final=False)

    def snapshot(self, after: int = -1) -> Run:
        """The run so far, like ``rec.run``, with the histograms of the steps after ``after`` only (every
        step's loss, scale and skip flag are kept): what writing the new steps as they come needs, without
        copying every histogram recorded so far each time (``ampviz.export.LiveExport`` uses it)."""
        after = check_int("after", after, low=-1)
        if self._recording is None:
            return self.run
        self._recording.flush()
        return self._recording.build_run(final=False, hist_after=after)

    def _model_changes(self) -> list[str]:
        modules = dict(self._activations + self._outputs)
        return model_changes(self.model, self._params, list(modules.items()), self._all_weights,
                             self._default_modules if self._watch_added_modules else None)

    # ------------------------------------------------------------------ per step
    def step(self, loss: Any = None) -> None:
        """Mark the end of one optimizer step (call it after ``scaler.update()``)."""
        if not self.enabled:
            return
        if self._recording is None:
            raise RuntimeError("Recorder.step() called outside `with recorder:`")
        self._recording.step(loss)
