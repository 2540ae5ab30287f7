"""ipywidgets explorers built on ampviz.plots; each displays with one line in a notebook cell.

    from ampviz.widgets import DtypeExplorer, ScaleExplorer
    DtypeExplorer(0.1, "fp16")
"""

from .clipping import ClipOrderExplorer
from .dashboard import RunDashboard
from .dtype import DtypeExplorer
from .memory import MemoryExplorer
from .optrace import OpTraceExplorer
from .playground import ScalerPlayground
from .sampler import SamplerExplorer
from .scale import ScaleExplorer
from .update import UpdateExplorer

__all__ = ["DtypeExplorer", "ScaleExplorer", "ScalerPlayground", "RunDashboard", "OpTraceExplorer", "MemoryExplorer",
           "UpdateExplorer", "ClipOrderExplorer", "SamplerExplorer"]
