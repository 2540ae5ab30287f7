"""The old name of :mod:`ampviz.replay.trace` (a run's per-step gradient maxima), kept so that existing code runs;
new code imports from :mod:`ampviz.replay`."""

from .replay.trace import *  # noqa: F403
from .replay.trace import __all__  # noqa: F401
