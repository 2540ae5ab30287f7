"""The old name of :mod:`ampviz.replay.policies` (loss-scaler policies and ``replay``), kept so that existing code
runs; new code imports from :mod:`ampviz.replay`."""

from .replay.policies import *  # noqa: F403
from .replay.policies import __all__  # noqa: F401
