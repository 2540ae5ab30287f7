"""ipywidgets explorers built on ampviz.plots; each displays with one line in a notebook cell.

    from ampviz.widgets import DtypeExplorer, ScaleExplorer
    DtypeExplorer(0.1, "fp16")
"""

from .dashboard import RunDashboard
from .dtype import DtypeExplorer
from .playground import ScalerPlayground
from .scale import ScaleExplorer

__all__ = ["DtypeExplorer", "ScaleExplorer", "ScalerPlayground", "RunDashboard"]
