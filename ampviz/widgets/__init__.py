"""ipywidgets explorers of a recorded run, built on ampviz.plots; each displays with one line in a notebook cell.

    from ampviz.widgets import RunDashboard, ScaleExplorer, ScalerPlayground
    run = ampviz.Run.load("runs/demo/run.npz")
    ScaleExplorer(run)

Needs the ``viz`` extra (``pip install "ampviz[viz]"``; plotly's ``FigureWidget`` needs anywidget).
The lessons' own widgets live beside their computation in :mod:`ampviz.lessons`.
"""

from .._extras import require

require("ipywidgets", "ampviz.widgets")
require("anywidget", "ampviz.widgets")

from .dashboard import RunDashboard  # noqa: E402
from .playground import ScalerPlayground  # noqa: E402
from .scale import ScaleExplorer  # noqa: E402

__all__ = ["ScaleExplorer", "ScalerPlayground", "RunDashboard"]
