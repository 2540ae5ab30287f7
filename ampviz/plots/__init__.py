"""Plotly figure builders: they take plain data (counts, a Run, a trace) and return figures.

    from ampviz.plots import histogram_figure
    histogram_figure(run.counts_in("unscaled")[0, -1], "fp16", log2_scale=12)
"""

from .bits import bits_figure
from .clipping import clipping_figure
from .formats import format_comparison_figure
from .heatmap import heatmap_figure
from .histogram import histogram_figure, region_edges
from .layers import layer_histograms_figure
from .memory import memory_figure
from .ranks import rank_comparison_figure
from .spacing import spacing_figure
from .trace import scale_trace_figure
from .update import update_figure

__all__ = ["histogram_figure", "region_edges", "bits_figure", "scale_trace_figure", "heatmap_figure",
           "layer_histograms_figure", "rank_comparison_figure", "format_comparison_figure", "spacing_figure",
           "memory_figure", "update_figure", "clipping_figure"]
