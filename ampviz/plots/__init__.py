"""Plotly figures of a recorded run: they take plain data (counts, a Run, a trace) and return figures.

    from ampviz.plots import histogram_figure
    histogram_figure(run.counts_in("unscaled")[0, -1], "fp16", log2_scale=12)

Needs the ``viz`` extra (``pip install "ampviz[viz]"``). The lessons' own figures live beside their
computation in :mod:`ampviz.lessons`.
"""

from .._extras import require

require("plotly", "ampviz.plots")

from .heatmap import heatmap_figure  # noqa: E402
from .histogram import histogram_figure, region_edges  # noqa: E402
from .layers import layer_histograms_figure, tensor_map_figure  # noqa: E402
from .ranks import rank_comparison_figure  # noqa: E402
from .scale_trace import scale_trace_figure  # noqa: E402

__all__ = ["histogram_figure", "region_edges", "scale_trace_figure", "heatmap_figure", "layer_histograms_figure",
           "tensor_map_figure", "rank_comparison_figure"]
