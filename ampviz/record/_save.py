"""When and how a Recorder with a ``path`` saves: every ``save_every`` seconds and/or ``save_every_steps``
steps while recording, and on close; each save appends what is new (``ampviz.run.RunFileWriter``) while
SIGINT and SIGTERM wait (``held_signals``)::

    saver = Saver(Path("runs/rank0.npz"), save_every=60.0, save_every_steps=None)
    if saver.due(step):
        saver.save(store, step, meta, file_arrays)    # file_arrays(steps_from, rows_from) -> dict of arrays
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from .._args import check_int
from .._files import clean_stale
from .._warnings import warn
from ..run import RunFileWriter
from ._signals import held_signals

__all__ = ["Saver", "check_save_every"]


def check_save_every(seconds, steps) -> tuple:
    """(save_every, save_every_steps), checked: a positive number of seconds or None; steps >= 1 or None."""
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not 0 < seconds < math.inf):
        raise ValueError(f"save_every: expected a positive number of seconds or None, got {seconds!r}")
    if steps is not None:
        check_int("save_every_steps", steps, low=1)
    return (None if seconds is None else float(seconds)), steps


class Saver:
    """The saves of one rank file. ``saved`` is ``(file, steps)`` of the last save that completed."""

    def __init__(self, target: Path, save_every: float | None, save_every_steps: int | None):
        clean_stale(target)                        # temp files a killed save of this file left behind
        self.writer = RunFileWriter(target)
        self.save_every, self.save_every_steps = save_every, save_every_steps
        self.saved: tuple[Path, int] | None = None
        self._written = (0, 0, 0, 0, 0)            # steps, histogram rows, decimations, update and block rows
        self._last = (time.monotonic(), 0)         # when, and at which step, the last save was
        self._failing = False                      # the last periodic save failed (warned once)

    @property
    def target(self) -> Path:
        return self.writer.target

    def due(self, step: int) -> bool:
        """Whether a periodic save is due after ``step`` steps (one clock read)."""
        when, at = self._last
        return ((self.save_every_steps is not None and step - at >= self.save_every_steps)
                or (self.save_every is not None and time.monotonic() - when >= self.save_every))

    def periodic(self, store, step: int, meta: dict, file_arrays, updates: int = 0, blocks: int = 0) -> None:
        """A save while recording: one that fails (disk full, the file's directory gone) is a warning, not an
        error in the training loop; recording goes on and the next save tries again."""
        try:
            self.save(store, step, meta, file_arrays, updates, blocks)
        except Exception as e:                     # noqa: BLE001 - training must not stop for a failed save
            self._last = (time.monotonic(), step)
            if not self._failing:
                warn(f"Recorder: saving the run to {self.target} failed ({type(e).__name__}: {e}); recording goes "
                     f"on, the next save tries again (the file holds {self.saved[1] if self.saved else 0} steps)")
            self._failing = True
            return
        self._failing = False

    def save(self, store, step: int, meta: dict, file_arrays, updates: int = 0, blocks: int = 0) -> None:
        """Append what ``store`` holds beyond the last save (the whole run when decimation dropped rows already
        written); a Ctrl-C or SIGTERM meanwhile takes effect once the file is complete. The store must have
        been flushed to the host."""
        steps, rows, decimations, update_rows, block_rows = self._written
        with held_signals(f"saving the run to {self.target}"):
            self.writer.save(meta, full=lambda: file_arrays(0, 0),
                             tail=lambda: file_arrays(steps, rows, update_rows, block_rows),
                             rewrite=decimations != store.decimations)
        self._written = (store.n_steps, store.n, store.decimations, updates, blocks)
        self.saved = (self.target, store.n_steps)
        self._last = (time.monotonic(), step)
