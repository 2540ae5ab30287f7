"""Plotly figure builders: they take plain data (counts, a Run, a trace) and return figures.

    from ampviz.plots import histogram_figure
    histogram_figure(run.counts_in("unscaled")[0, -1], "fp16", log2_scale=12)
"""

from .bits import bits_figure
from .histogram import histogram_figure, region_edges
from .trace import scale_trace_figure

__all__ = ["histogram_figure", "region_edges", "bits_figure", "scale_trace_figure"]
