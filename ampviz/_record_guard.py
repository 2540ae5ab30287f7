"""What a Recorder checks so that a mistake costs a warning, not a run: the save path (at construction,
not after hours of training), a SIGTERM (the run is saved, as on Ctrl-C), a signal during a save (it
waits until the file is complete), ``rec.step()`` in the wrong place, and a model changed after the
Recorder was made::

    path = check_path("runs/exp.npz")                # ValueError now if it could never be written
    rank_file(path, world=2, rank=1)                 # runs/exp.rank1.npz
    with held_signals("saving the run to runs/exp.npz"):
        ...                                          # a Ctrl-C or SIGTERM here arrives after the block
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
import warnings
from pathlib import Path

from ._record_targets import named_modules, named_parameters
from ._warnings import AmpvizWarning

__all__ = ["check_path", "rank_file", "SaveOnTerm", "held_signals", "StepChecks", "model_changes"]


# ---------------------------------------------------------------------------------------------- paths
def check_path(path):
    """``path`` as a Path if a run can be written there: a file ending in ``.npz``, or a directory (which
    receives ``rank{r}.npz``); a clear error otherwise. Nothing is created yet."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike (a file ending in .npz, or a directory), "
                        f"got {type(path).__name__}")
    text = os.fsdecode(os.fspath(path))
    if not text.strip():
        raise ValueError("path: empty; give a file ending in .npz, or a directory (it receives rank{r}.npz)")
    p = Path(text).expanduser()
    suffix = p.suffix.lower()
    if suffix != ".npz" and p.is_dir():              # an existing directory is a directory, dots or not
        suffix = ""
    if suffix not in ("", ".npz"):
        raise ValueError(f"path: {text!r} ends in {p.suffix!r}; give a file ending in .npz, or a directory "
                         f"(an existing one, or a new name without a dot; it receives rank{{r}}.npz)")
    if suffix == ".npz" and p.is_dir():
        raise ValueError(f"path: {text!r} is a directory, but a name ending in .npz is taken for a run file; "
                         f"give a file name, or a directory without the .npz ending")
    if suffix == "" and p.resolve() == Path(p.resolve().anchor):
        raise ValueError(f"path: {text!r} is the file-system root; give a file ending in .npz, or a directory of "
                         f"its own (it receives rank{{r}}.npz)")
    if suffix == "" and p.exists() and not p.is_dir():
        raise ValueError(f"path: {text!r} is an existing file, not a directory; give a file ending in .npz, "
                         f"or a directory (it receives rank{{r}}.npz)")
    _check_writable(p.parent if suffix == ".npz" else p, text)
    return p


def _check_writable(directory: Path, text: str) -> None:
    ancestor = directory
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"path: cannot write under {text!r}: {str(ancestor)!r} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=ancestor):    # a real write: permissions, read-only file systems
            pass
    except OSError as e:
        raise ValueError(f"path: cannot write under {text!r}: directory {str(ancestor)!r} is not writable "
                         f"({e.strerror or e})") from None


def rank_file(path: Path, world: int, rank: int) -> Path:
    """The file this rank writes: ``path`` itself (one rank, ``.npz``), ``<stem>.rank{r}.npz`` beside it (several
    ranks), or ``path / rank{r}.npz`` (a directory)."""
    if path.suffix.lower() == ".npz" and not path.is_dir():
        return path if world == 1 else path.with_name(f"{path.stem}.rank{rank}.npz")
    return path / f"rank{rank}.npz"


# --------------------------------------------------------------------------------------------- SIGTERM
def _exit_on_term(signum, frame):
    sys.stderr.write(f"ampviz: signal {signum} (SIGTERM) received: saving the run, then exiting\n")
    raise SystemExit(128 + signum)      # unwinds through `with recorder:`, which saves, as KeyboardInterrupt does


class SaveOnTerm:
    """While a recorder with a ``path`` is open, SIGTERM raises SystemExit(143) so the run is saved. Only where
    SIGTERM still has its default action (a handler of the user's, or SIG_IGN, is theirs to keep), only in the
    main thread; the default is put back on close."""

    def __init__(self):
        self.installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_term)
            self.installed = True

    def restore(self) -> None:
        if self.installed and signal.getsignal(signal.SIGTERM) is _exit_on_term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.installed = False


_holding = threading.local()


@contextlib.contextmanager
def held_signals(what: str):
    """While the block runs (a save), SIGINT and SIGTERM wait: each is noted, and delivered once the block
    is done, to the handler that was in place (the default action too, which then ends the process after
    the file is complete). A second Ctrl-C during a save therefore cannot cut it short. Main thread only
    (Python runs handlers there); a signal set to be ignored, or not handled from Python, is left alone."""
    if threading.current_thread() is not threading.main_thread() or getattr(_holding, "active", False):
        yield
        return
    pending, handlers = [], {}

    def hold(signum, frame):
        if not pending:
            sys.stderr.write(f"ampviz: {signal.Signals(signum).name} received while {what}; it takes effect once "
                             "the file is complete\n")
        pending.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler is not None and handler is not signal.SIG_IGN:
            handlers[sig] = handler
            signal.signal(sig, hold)
    _holding.active = True
    try:
        yield
    finally:
        _holding.active = False
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(pending):          # each kind once, in the order they came
            signal.raise_signal(signum)


# ------------------------------------------------------------------------------------------ rec.step()
class StepChecks:
    """Warnings (once each) for ``rec.step()`` called where it records the wrong thing, a GradScaler the loop does
    not use, and hooks that did not run (traced by torch.compile, or never called). Reads only Python state:
    GradScaler's per-optimizer stages, which ``update()`` replaces with a fresh dict, and the counters the hooks
    keep (``_record_hooks.Capture``)."""

    def __init__(self, scaler, sees_optimizer_steps: bool, watched: int = 0, compiled: bool = False):
        self.scaler, self.sees_optimizer_steps, self.watched = scaler, sees_optimizer_steps, watched
        self.compiled = compiled            # the Recorder knows the model runs compiled (and said so already)
        self.states = self._states()
        self.warned: set = set()

    def _states(self):
        return None if self.scaler is None else getattr(self.scaler, "_per_optimizer_states", None)

    def _warn(self, key: str, message: str, stacklevel: int = 4) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, AmpvizWarning, stacklevel=stacklevel)

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
                       "activations=False.", stacklevel=5)
        elif self.watched and capture.capturing and capture.grads_seen and not capture.module_forwards:
            self._warn("no forwards", f"Recorder: none of the {self.watched} watched modules ran its forward hooks "
                       f"in a step whose backward ran, so their activation-gradient and output rows do not fill (a "
                       f"model compiled and called before Recorder(...) was made runs without them; so do modules "
                       f"called through their forward() or functionally rather than as module(x)).", stacklevel=5)

    def at_close(self, steps: int, capture, forwards: int) -> None:
        optimizer_steps = capture.total_optimizer_steps
        if steps == 0 and (optimizer_steps or forwards):
            seen = f"{optimizer_steps} optimizer steps" if optimizer_steps else f"{forwards} training forward passes"
            warnings.warn(f"Recorder closed after {seen} without a rec.step() call: the run has 0 steps. Call "
                          f"rec.step(loss) once per optimizer step, after scaler.update().", AmpvizWarning,
                          stacklevel=4)
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
