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
  backward, whose order is the one recorded (a Python counter per gradient hook: no sync).
"""

from __future__ import annotations

import functools

import torch

from ._record_targets import first_tensor

__all__ = ["Capture"]


class Capture:
    """Hooks and per-step state for the watched ``params`` and ``activations`` / ``outputs`` modules,
    each a list of (name, object)."""

    def __init__(self, params, activations, outputs, local: bool, counter, ddp=None):
        self.params, self.counter, self.ddp = params, counter, ddp
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
        self.capturing = True
        self.optimizer_steps = self.forwards = 0             # since the last rec.step(), for the misuse checks
        self.total_optimizer_steps = 0
        self._opt_rows: dict = {}
        self.new_step()

    # ------------------------------------------------------------------ install / remove
    def install(self, root, optimizer, global_hook) -> None:
        """Register every hook (append each handle as soon as it exists, so a failure can remove them)."""
        if root is not None:
            self.handles.append(root.register_forward_pre_hook(self._on_model_forward))
        for m, act, out in self.watched.values():
            self.handles.append(m.register_forward_hook(functools.partial(self._on_forward, act, out)))
        for i, (_, p) in enumerate(self.params):
            self.handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_accumulated, i)))
        if optimizer is not None:
            self.handles.append(optimizer.register_step_pre_hook(self._on_optimizer_step))
        elif global_hook and self.params:
            from torch.optim.optimizer import register_optimizer_step_pre_hook
            self.handles.append(register_optimizer_step_pre_hook(self._on_optimizer_step))

    def remove(self) -> None:
        while self.handles:
            self.handles.pop().remove()

    # ------------------------------------------------------------------ per step
    def new_step(self) -> None:
        self.order = [-1] * self.n_rows                      # backward order of each row this step
        self.next_order = 0
        self.ordering = True                                 # still in the step's first backward
        self.grads_seen = False
        self.weights_done = [False] * self.n_weights
        self.grad_refs = [None] * self.n_weights
        self.optimizer_steps = self.forwards = 0

    def finish_step(self) -> None:
        """Count the weight gradients no optimizer hook counted (a skipped step; no hook fired)."""
        todo = [i for i in range(self.n_weights) if not self.weights_done[i]]
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
        if torch.is_grad_enabled():
            self.forwards += 1
            if self.grads_seen:                              # a new micro-batch: the first backward is over
                self.ordering = False

    def _on_forward(self, act_row, out_row, module, inputs, output):
        if not self.capturing:
            return
        if act_row >= 0:
            t = first_tensor(output, True)
            if t is not None:
                t.register_hook(functools.partial(self._on_activation_grad, act_row))
        # outputs of training forwards only: not under no_grad (evaluation), not the recomputation that
        # gradient checkpointing runs inside the backward
        if out_row >= 0 and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
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
