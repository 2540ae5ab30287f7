"""RecordOptions: every option of a Recorder, validated once, frozen, passed whole.

``Recorder(model, optimizer, scaler, **kw)`` builds one; the framework callbacks build one at their
construction (a wrong option fails there, not at the first training step) and hand it through; the run's
metadata keeps its JSON-able part (``run.meta["options"]``), so a file says how it was recorded::

    options = RecordOptions(every=4, activations=r"blocks\\.\\d+$", path="runs/exp.npz")
    rec = Recorder(model, optimizer, scaler=scaler, options=options)
    rec = Recorder(model, optimizer, scaler=scaler, options=options, every=8)   # one option changed
    options.meta()["every"]                                                     # 4

What each option means is in :class:`ampviz.Recorder`'s docstring. Checks that need the model (names that
a filter must match, ``local_weights`` without DDP, modules under torch.compile) are the Recorder's.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from .._args import check_int
from ._blocks import check_blocks
from ._paths import check_path
from ._save import check_save_every
from ._select import check_filter
from ._unwrap import unwrap_scheduler

__all__ = ["RecordOptions"]


@dataclass(frozen=True)
class RecordOptions:
    """The options of a :class:`ampviz.Recorder` (see its docstring for each), checked when made."""

    weights: Any = True
    activations: Any = True
    outputs: Any = False
    local_weights: bool = False
    scheduler: Any = None
    every: int = 1
    flush_every: int = 32
    max_bytes: int = 256 << 20
    path: str | os.PathLike | None = None
    save_every: float | None = 60.0
    save_every_steps: int | None = None
    enabled: bool = True
    compiled_by: str | None = None
    updates: Any = False
    blocks: Any = False

    def __post_init__(self):
        set_ = object.__setattr__                          # frozen: the checked values replace the given ones
        set_(self, "scheduler", unwrap_scheduler(self.scheduler))
        for name in ("every", "flush_every", "max_bytes"):
            check_int(name, getattr(self, name), low=1)
        set_(self, "enabled", bool(self.enabled))
        set_(self, "path", check_path(self.path))
        seconds, steps = check_save_every(self.save_every, self.save_every_steps)
        set_(self, "save_every", seconds)
        set_(self, "save_every_steps", steps)
        if self.compiled_by is not None and not (isinstance(self.compiled_by, str) and self.compiled_by):
            raise TypeError(f"compiled_by: expected the setting that compiles the model, as a non-empty str, or "
                            f"None, got {self.compiled_by!r}")
        for name in ("weights", "activations", "outputs"):
            check_filter(getattr(self, name), name)
        set_(self, "local_weights", bool(self.local_weights))
        set_(self, "updates", check_updates(self.updates))
        set_(self, "blocks", check_blocks(self.blocks))

    @classmethod
    def names(cls) -> list[str]:
        """Every option's name, in order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def build(cls, options: RecordOptions | None = None, where: str = "Recorder", **kw) -> RecordOptions:
        """``options`` with ``kw`` changed (``RecordOptions(**kw)`` without ``options``); an unknown name is a
        TypeError that lists the valid ones."""
        unknown = sorted(set(kw) - set(cls.names()))
        if unknown:
            raise TypeError(f"{where}: unknown Recorder option(s) {unknown}; valid: {cls.names()}")
        if options is None:
            return cls(**kw)
        if not isinstance(options, cls):
            raise TypeError(f"options: expected an ampviz.RecordOptions or None, got {type(options).__name__}")
        return dataclasses.replace(options, **kw) if kw else options

    def meta(self) -> dict:
        """The options as JSON: filters as given (a regex or list of names; a callable by its name), the
        scheduler by its type name, the path as a string."""
        out = {}
        for name in self.names():
            value = getattr(self, name)
            if name in ("weights", "activations", "outputs"):
                value = _filter_text(value)
            elif name == "scheduler":
                value = None if value is None else type(value).__name__
            elif name == "path":
                value = None if value is None else os.fsdecode(value)
            elif name == "blocks":
                value = False if value is None else value.meta(_filter_text)
            out[name] = value
        return out


UPDATE_EVERY = 100          # updates=True: the weights' updates are measured every this many steps


def check_updates(value) -> int:
    """``updates=`` as the number of steps between update captures: 0 (off) for False / None / 0,
    ``UPDATE_EVERY`` for True, or the positive int given."""
    if value is None or value is False:
        return 0
    if value is True:
        return UPDATE_EVERY
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return int(value)
    raise ValueError(f"updates: expected True (every {UPDATE_EVERY} steps), False or a number of steps >= 1 "
                     f"between update captures, got {value!r}")


def _filter_text(spec):
    if spec is None or isinstance(spec, (bool, str)):
        return spec
    if isinstance(spec, (list, tuple, set)):
        names = [str(s) for s in spec]
        return sorted(names) if isinstance(spec, set) else names
    return getattr(spec, "__qualname__", None) or type(spec).__name__     # a callable: no address, same each run
