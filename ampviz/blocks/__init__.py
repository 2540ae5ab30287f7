"""Block-scaled formats: how far each value sits below its block's maximum, and what MX / NVFP4 / row-wise /
tiled fp8 casts would do to it.

Per-tensor histograms cannot say whether a tensor survives a block-scaled cast: that depends on each value's
distance from *its block's* maximum. :func:`block_counts` counts those distances on the tensor's device, with no
host sync; :func:`what_if` turns the counts into the shares flushed and saturated, the share of the squared norm
flushed, and the relative RMS error of the cast: exactly for the MX recipes, as tested bounds for the others::

    import torch
    from ampviz.blocks import block_counts, what_if
    counts = block_counts(torch.randn(64, 256), "mx32")      # on the tensor's device; add them over steps
    w = what_if(counts, "mxfp4")                              # one host copy here
    w.share("flushed"), w.exact                               # ((lo, hi), True): lo == hi for MX
"""

from .counts import D_MAX, TINY_EXPONENT, BlockCounts, block_counts
from .layouts import LAYOUTS, BlockLayout, get_layout
from .what_if import E2M1, RECIPES, Recipe, WhatIf, get_recipe, what_if

__all__ = ["BlockLayout", "LAYOUTS", "get_layout", "BlockCounts", "block_counts", "D_MAX", "TINY_EXPONENT",
           "Recipe", "RECIPES", "get_recipe", "E2M1", "WhatIf", "what_if"]
