"""Signals while a Recorder saves: a SIGTERM saves the run (as Ctrl-C does), and a signal during a save
waits until the file is complete::

    with held_signals("saving the run to runs/exp.npz"):
        ...                                          # a Ctrl-C or SIGTERM here arrives after the block
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

__all__ = ["SaveOnTerm", "held_signals"]


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
    pending: list[int] = []
    handlers: dict = {}

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
