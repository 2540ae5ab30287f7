"""What a Recorder checks so that a mistake costs a warning, not a run: ``rec.step()`` in the wrong place,
a GradScaler the loop does not use, hooks that did not run, and a model changed after the Recorder was made
(``model_changes``). The save path is checked in ``_paths``, signals in ``_signals``.
"""

from __future__ import annotations

from .._warnings import warn
from ._select import named_modules, named_parameters

__all__ = ["StepChecks", "model_changes"]


class StepChecks:
    """Warnings (once each) for ``rec.step()`` called where it records the wrong thing, a GradScaler the loop does
    not use, and hooks that did not run (traced by torch.compile, or never called). Reads only Python state:
    GradScaler's per-optimizer stages, which ``update()`` replaces with a fresh dict, and the counters the hooks
    keep (``_hooks.Capture``)."""

    def __init__(self, scaler, sees_optimizer_steps: bool, watched: int = 0, compiled: bool = False):
        self.scaler, self.sees_optimizer_steps, self.watched = scaler, sees_optimizer_steps, watched
        self.compiled = compiled            # the Recorder knows the model runs compiled (and said so already)
        self.states = self._states()
        self.warned: set = set()

    def _states(self):
        return None if self.scaler is None else getattr(self.scaler, "_per_optimizer_states", None)

    def _warn(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warn(message)

    def at_step(self, capture) -> None:
        states = self._states()
        updated = states is not None and states is not self.states
        if states is not None:
            from torch.amp.grad_scaler import OptState
            if any(s.get("stage", OptState.READY) is not OptState.READY for s in states.values()):
                self._warn("update", "Recorder.step() was called before scaler.update(): the loss scale and the "
                           "skipped flag of every step would be the previous step's. Call rec.step() after "
                           "scaler.update().")
                updated = True
            self.states = states
        self._hooks_ran(capture)
        if self.scaler is not None and capture.total_scaler_steps == 0:     # this scaler has not stepped yet
            if capture.total_optimizer_steps:
                self._warn("unused", self._unused(capture.total_optimizer_steps))
            if getattr(self.scaler, "_scale", None) is None:
                return          # nor scaled a loss: another scaler's skipped step looks like a micro-batch here
        if (self.sees_optimizer_steps or states is not None) and capture.optimizer_steps == 0 and not updated:
            self._warn("micro", "Recorder.step() was called with no optimizer step since the previous call "
                       "(once per micro-batch?): each call ends one recorded step. Call rec.step() once per "
                       "optimizer step, after scaler.update().")

    def _unused(self, optimizer_steps: int) -> str:
        return (f"Recorder(scaler=...): the optimizer stepped {optimizer_steps} times, but this GradScaler's step() "
                f"was never called: the loop uses another scaler (or none), so the loss scale and skipped steps "
                f"recorded would be this one's (its scale stays {self.scaler.get_scale():g}), not the loop's. Give "
                f"the Recorder the GradScaler whose scale(loss).backward() and step(optimizer) the loop calls.")

    def _hooks_ran(self, capture) -> None:
        if capture.traced and not self.compiled:
            self._warn("traced", "Recorder: the model ran under torch.compile without the Recorder being given the "
                       "compiled model (Recorder(model) while the loop calls torch.compile(model), or the model was "
                       "compiled after Recorder(...) was made): the hooks on its modules found themselves traced and "
                       "stood down, so nothing entered the compiled graph and training is unchanged, but activation "
                       "gradients and outputs are not recorded. Give the Recorder the compiled model, or pass "
                       "activations=False.")
        elif self.watched and capture.capturing and capture.grads_seen and not capture.module_forwards:
            self._warn("no forwards", f"Recorder: none of the {self.watched} watched modules ran its forward hooks "
                       f"in a step whose backward ran, so their activation-gradient and output rows do not fill (a "
                       f"model compiled and called before Recorder(...) was made runs without them; so do modules "
                       f"called through their forward() or functionally rather than as module(x)).")

    def at_close(self, steps: int, capture, forwards: int) -> None:
        optimizer_steps = capture.total_optimizer_steps
        if steps == 0 and (optimizer_steps or forwards):
            seen = f"{optimizer_steps} optimizer steps" if optimizer_steps else f"{forwards} training forward passes"
            warn(f"Recorder closed after {seen} without a rec.step() call: the run has 0 steps. Call "
                 f"rec.step(loss) once per optimizer step, after scaler.update().")
        elif self.scaler is not None and steps and capture.total_scaler_steps == 0 and (optimizer_steps or forwards):
            self._warn("unused", self._unused(optimizer_steps))


# ------------------------------------------------------------------------------------- model changes
def model_changes(model, params: list, modules: list, all_weights: bool, default_modules) -> list[str]:
    """What changed in ``model`` since these (name, object) lists were chosen: watched parameters or modules
    replaced, removed or frozen, and (for the default choices) trainable ones added."""
    now_params, now_modules = dict(named_parameters(model)), dict(named_modules(model))
    problems = []
    for kind, watched, now in (("parameter", params, now_params), ("module", modules, now_modules)):
        for name, obj in watched:
            current = now.get(name)
            if current is None:
                problems.append(f"{kind} {name!r} was removed")
            elif current is not obj:
                problems.append(f"{kind} {name!r} was replaced")
            elif kind == "parameter" and not obj.requires_grad:
                problems.append(f"parameter {name!r} was frozen")
    names = {n for n, _ in params}
    if all_weights:
        problems += [f"parameter {n!r} was added" for n, p in now_params.items() if p.requires_grad and n not in names]
    if default_modules is not None:
        names = {n for n, _ in modules}
        problems += [f"module {n!r} was added" for n, m in now_modules.items()
                     if n not in names and default_modules(n, m)]
    return problems
