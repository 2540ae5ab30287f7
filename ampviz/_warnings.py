"""ampviz's own warning class, so tests (and users) can filter or escalate it, and ``warn``, which points a
warning at the user's line: the first frame outside the ampviz package (no hand-counted ``stacklevel``)."""

from __future__ import annotations

import sys
import warnings

__all__ = ["AmpvizWarning", "warn"]


class AmpvizWarning(UserWarning):
    """Something ampviz did is approximate or was adjusted; the message says what."""


def _inside_ampviz(name: str) -> bool:
    return name == "ampviz" or name.startswith("ampviz.")


def warn(message: str, category: type[Warning] = AmpvizWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside the ampviz package (the line of
    the user's loop, or of the framework that called ampviz), however deep inside ampviz it is raised. Walks the
    stack once: not for hot paths, for warnings only."""
    frame = sys._getframe(1)                   # the caller of warn(), stacklevel 2
    level = 2
    while frame is not None and _inside_ampviz(frame.f_globals.get("__name__", "")):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
