"""The hooks of an open Recorder and the state they share. Hot path: no host syncs, no copies.

Rows of the counts, in this order: weight gradients (one per parameter), activation gradients
(one per module), forward outputs (one per module), local weight gradients (DDP). The hooks:

* a forward hook per watched module: attaches a tensor hook to its output (activation gradient,
  counted when the backward computes it) and counts the output itself (forward output);
* a post-accumulate-grad hook per parameter: keeps a reference to ``.grad`` (read at
  ``rec.step()`` for a step the scaler skipped) and, under DDP, counts the local gradient;
* an optimizer step pre-hook: counts the weight gradients as the optimizer sees them (a fused
  optimizer's divided by the ``grad_scale`` GradScaler hands it); with ``step(closure)`` it wraps the
  closure and counts once its first call has run the backward;
* a forward pre-hook on the model: a new forward after gradients were seen ends the step's first
  backward, whose order is the one recorded (a Python counter per gradient hook: no sync); with its
  forward hook it also marks a training forward (grad enabled when the model was called), inside which a
  reentrant checkpoint's no_grad forward counts as the real one;
* the GradScaler's ``step`` wrapped on the instance (put back on remove): a step the scaler skipped
  never reaches the optimizer, so its weight gradients are counted right when ``scaler.step`` returns,
  before the loop can zero them in place (``zero_grad(set_to_none=False)``); it also tells whether the
  loop uses that scaler at all.

Hooks that find themselves traced by torch.compile (a compiled wrapper the Recorder was not given, or a
model compiled after the Recorder was made) stand down: they return at once, so nothing is traced into
the graph and training is unchanged, and they set ``traced`` so the recorder can say so.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch.amp.grad_scaler import OptState
from torch.compiler import is_compiling as _traced

from ._unwrap import unwrap_optimizer

__all__ = ["Capture"]

_UNSCALED = OptState.UNSCALED
# _traced(): True while torch.compile traces the caller (bound once: the hooks call it on every forward)


def first_tensor(output, grad: bool):
    """The first floating-point tensor of a module's output (a tensor, or a tuple, list, dict or
    ``ModelOutput`` of them, in order); with ``grad``, the first one that requires grad."""
    if isinstance(output, torch.Tensor):
        if output.is_floating_point() and (output.requires_grad or not grad):
            return output
        return None
    if isinstance(output, Mapping):
        output = output.values()
    elif not isinstance(output, (tuple, list)):
        return None
    for o in output:
        t = first_tensor(o, grad)
        if t is not None:
            return t
    return None


class Capture:
    """Hooks and per-step state for the watched ``params`` and ``activations`` / ``outputs`` modules,
    each a list of (name, object)."""

    def __init__(self, params, activations, outputs, local: bool, counter, ddp=None, *, recorded: bool,
                 external_weights: bool = False):
        self.params, self.counter, self.ddp = params, counter, ddp
        # weight gradients counted by someone else through ``count_weights_from`` (a framework that keeps them
        # outside ``.grad``, e.g. DeepSpeed ZeRO's partitions): no parameter or optimizer hook of ours
        self.external_weights = external_weights
        self.n_weights = len(params)
        self.first_activation = self.n_weights
        self.first_output = self.first_activation + len(activations)
        self.first_local = self.first_output + len(outputs)
        self.local = local
        self.n_rows = self.first_local + (len(params) if local else 0)
        self.watched = {}                                     # module id -> (module, activation row, output row)
        for i, (_, m) in enumerate(activations):
            self.watched[id(m)] = (m, self.first_activation + i, -1)
        for i, (_, m) in enumerate(outputs):
            mod, act, _ = self.watched.get(id(m), (m, -1, -1))
            self.watched[id(m)] = (mod, act, self.first_output + i)
        self.dtypes: list = [None] * self.n_rows             # torch dtypes seen per row (str at the end)
        self.row_of = {id(p): i for i, (_, p) in enumerate(params)}
        self.handles: list = []
        self.optimizer_steps = self.forwards = 0             # since the last rec.step(), for the misuse checks
        self.total_optimizer_steps = 0
        self.scaler_steps = self.total_scaler_steps = 0      # calls of the watched GradScaler's step()
        self.unscaled_before_step = False                    # scaler.unscale_(opt) before scaler.step(opt): clipping
        self.traced = False                                  # a hook stood down inside torch.compile's tracing
        self.training_forward = False                        # inside a call of the model with grad enabled
        self._opt_rows: dict = {}
        self.new_step(recorded)                              # whether the first step's histograms are recorded

    # ------------------------------------------------------------------ install / remove
    def install(self, root, optimizer, global_hook, scaler=None, skip=frozenset()) -> None:
        """Register every hook (append each handle as soon as it exists, so a failure can remove them); none on the
        watched modules whose ids are in ``skip``."""
        if root is not None:
            self.handles.append(root.register_forward_pre_hook(self._on_model_forward))
            self.handles.append(root.register_forward_hook(self._on_model_forward_end, always_call=True))
        for key, (m, act, out) in self.watched.items():
            if key not in skip:
                self.handles.append(m.register_forward_hook(functools.partial(self._on_forward, act, out)))
        if self.external_weights:
            return
        for i, (_, p) in enumerate(self.params):
            self.handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_accumulated, i)))
        if optimizer is not None:
            self.handles.append(optimizer.register_step_pre_hook(self._on_optimizer_step))
        elif global_hook and self.params:
            from torch.optim.optimizer import register_optimizer_step_pre_hook
            self.handles.append(register_optimizer_step_pre_hook(self._on_optimizer_step))
        if scaler is not None:
            self.handles.append(ScalerStepWatch(scaler, self))

    def remove(self) -> None:
        """Remove every hook and drop the references to gradients (the memory is the loop's again)."""
        while self.handles:
            self.handles.pop().remove()
        self.grad_refs = [None] * self.n_weights

    # ------------------------------------------------------------------ per step
    def new_step(self, recorded: bool) -> None:
        """A new step begins; ``recorded``: whether its histograms are recorded (the hooks count only then)."""
        self.capturing = recorded
        self.order = [-1] * self.n_rows                      # backward order of each row this step
        self.next_order = 0
        self.ordering = True                                 # still in the step's first backward
        self.grads_seen = False
        self.weights_done = [False] * self.n_weights
        self.grad_refs = [None] * self.n_weights
        self.optimizer_steps = self.forwards = self.scaler_steps = 0
        self.module_forwards = False                         # a watched module's forward hook ran

    def finish_step(self) -> None:
        """Count the weight gradients no optimizer hook counted (a skipped step; no hook fired)."""
        todo = [] if self.external_weights else [i for i in range(self.n_weights) if not self.weights_done[i]]
        grads, rows = [], []
        for i in todo:
            g = self.grad_refs[i] if self.grad_refs[i] is not None else self.params[i][1].grad
            if g is not None:
                grads.append(g)
                rows.append(i)
        if grads:
            self.counter.add_many(grads, rows)
        self.counter.submit()

    # ------------------------------------------------------------------ hooks
    def _seen(self, row: int) -> None:
        self.grads_seen = True
        if self.ordering and self.order[row] < 0:
            self.order[row] = self.next_order
            self.next_order += 1

    def _on_model_forward(self, module, inputs):
        if _traced():                    # traced: stand down (nothing enters the graph)
            self.traced = True
            return
        self.training_forward = torch.is_grad_enabled()
        if self.training_forward:
            self.forwards += 1
            if self.grads_seen:                              # a new micro-batch: the first backward is over
                self.ordering = False

    def _on_model_forward_end(self, module, inputs, output):
        if not _traced():
            self.training_forward = False

    def _on_forward(self, act_row, out_row, module, inputs, output):
        if _traced():                    # traced: stand down (nothing enters the graph)
            self.traced = True
            return
        if not self.capturing:
            return
        self.module_forwards = True
        if act_row >= 0:
            t = first_tensor(output, True)
            if t is not None:
                t.register_hook(functools.partial(self._on_activation_grad, act_row))
        # outputs of training forwards only: not under no_grad (evaluation) unless inside a training call of the
        # model (a reentrant checkpoint's forward runs under no_grad), not the recomputation that gradient
        # checkpointing runs inside the backward
        if (out_row >= 0 and (torch.is_grad_enabled() or self.training_forward)
                and torch._C._current_graph_task_id() == -1):
            t = first_tensor(output, False)
            if t is not None:
                self.counter.add(t, out_row)
                self.dtypes[out_row] = t.dtype

    def _on_activation_grad(self, row, grad):
        if grad is not None:
            self._seen(row)
            self.counter.add(grad, row)
            self.dtypes[row] = grad.dtype

    def _on_accumulated(self, i, param):
        if self.capturing:
            self.grad_refs[i] = param.grad                   # a reference, no copy: read at rec.step() if needed
            self._seen(i)
            if self.local and self.ddp.require_backward_grad_sync:    # this backward all-reduces
                self.counter.add(param.grad, self.first_local + i)   # still local

    def _on_optimizer_step(self, optimizer, args, kwargs):
        self.optimizer_steps += 1
        self.total_optimizer_steps += 1
        if not self.capturing:
            return None
        # args = (optimizer, *step's positional arguments)
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if closure is None:
            self._count_weights(optimizer)
            return None
        # step(closure) runs the backward inside step(): count after the closure's first call
        counted = []

        def closure_then_count():
            result = closure()
            if not counted:
                counted.append(True)
                self._count_weights(optimizer)
            return result
        if "closure" in kwargs:
            return args, dict(kwargs, closure=closure_then_count)
        return (args[0], closure_then_count) + tuple(args[2:]), kwargs

    def _on_scaler_step(self, optimizer, optimizer_steps_before: int) -> None:
        """After ``scaler.step(optimizer)``: if the optimizer did not step (skipped), count its weight gradients
        now, unscaled and holding the inf/nan, before the loop can zero them in place."""
        self.scaler_steps += 1
        self.total_scaler_steps += 1
        if self.capturing and self.total_optimizer_steps == optimizer_steps_before:
            try:
                optimizer = unwrap_optimizer(optimizer)
            except TypeError:                                # not an optimizer we can read: rec.step() counts
                return
            self._count_weights(optimizer)

    def count_weights_from(self, parts) -> None:
        """An optimizer step of a framework that keeps the weight gradients itself (``external_weights``): count
        ``parts``, an iterable of (row, tensor) read just before its step (it is only iterated on recorded steps),
        once per step."""
        self.optimizer_steps += 1
        self.total_optimizer_steps += 1
        if not self.capturing:
            return
        grads, rows = [], []
        for i, g in parts:
            if not self.weights_done[i]:
                self.weights_done[i] = True
                if g is not None and g.numel():
                    grads.append(g)
                    rows.append(i)
        if grads:
            self.counter.add_many(grads, rows)

    def _count_weights(self, optimizer) -> None:
        rows = self._rows_of(optimizer)
        grads, todo = [], []
        for i in rows:
            if not self.weights_done[i]:
                self.weights_done[i] = True
                g = self.params[i][1].grad
                if g is not None:
                    grads.append(g)
                    todo.append(i)
        if not grads:
            return
        # A fused optimizer (fused=True, transformers' default adamw_torch_fused) under a GradScaler receives its
        # gradients still scaled: GradScaler.step sets optimizer.grad_scale (a device tensor) and the kernel
        # unscales in place, dividing by it. Count them as it will see them: divided here, one at a time (one
        # gradient's temporary, no host sync). grad_scale is None once unscale_() ran (clipping).
        scale = getattr(optimizer, "grad_scale", None)
        if isinstance(scale, torch.Tensor):
            for g, i in zip(grads, todo):
                self.counter.add(torch.div(g, scale.to(g.device, non_blocking=True)), i)
        else:
            self.counter.add_many(grads, todo)

    def _rows_of(self, optimizer) -> list:
        """Rows of the watched parameters this optimizer steps (cached while its groups stay the same)."""
        groups = optimizer.param_groups
        key = (id(optimizer), len(groups), sum(len(g["params"]) for g in groups))
        rows = self._opt_rows.get(key)
        if rows is None:
            rows = self._opt_rows[key] = [self.row_of[id(p)] for g in groups for p in g["params"]
                                          if id(p) in self.row_of]
        return rows

    def final_dtypes(self, initial: list) -> list:
        return [str(d) if d is not None else initial[i] for i, d in enumerate(self.dtypes)]


class ScalerStepWatch:
    """``scaler.step`` wrapped on the instance: calls the original, then ``capture._on_scaler_step(optimizer,
    optimizer steps before the call)``. ``remove()`` puts back what was there (the class's method, or an
    instance attribute someone set before), if it is still ours; a wrapper left in someone's hands after that
    only passes through."""

    def __init__(self, scaler, capture: Capture):
        self.scaler, self.installed = scaler, True
        self.before = vars(scaler).get("step")               # an instance attribute of someone else's, or None
        original = scaler.step

        @functools.wraps(original)
        def step(optimizer, *args, **kwargs):
            steps_before = capture.total_optimizer_steps
            state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
            if state is not None and state.get("stage") is _UNSCALED:     # the loop clips (or reads) the gradients
                capture.unscaled_before_step = True
            result = original(optimizer, *args, **kwargs)
            if self.installed:
                capture._on_scaler_step(optimizer, steps_before)
            return result
        self.wrapper = step
        scaler.step = step

    def remove(self) -> None:
        if vars(self.scaler).get("step") is self.wrapper:
            if self.before is None:
                del self.scaler.step
            else:
                self.scaler.step = self.before
        self.installed = False
