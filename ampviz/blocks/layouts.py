"""Block layouts: which elements share one scale when a tensor is cast to a block-scaled format.

A layout views a tensor as a matrix ``(rows, K)``: ``K`` is the size of the blocked dimension (``dim``, the
last one by default: a Linear's reduction dimension for its input and weight), the rows are every other
dimension flattened in order. A block is ``block_rows`` consecutive rows by ``block_cols`` consecutive columns;
``block_cols=None`` means the whole row (row-wise scaling)::

    >>> from ampviz.blocks import get_layout
    >>> get_layout("mx32").describe()
    'mx32: blocks of 1 x 32 along the blocked dim (OCP MX: MXFP8, MXFP4)'
    >>> get_layout("tile128x128").blocks_of((256, 384))
    (2, 3)

Padding: torchao's MX and NVFP4 casts require the blocked dimension to be a multiple of the block (they
assert); the OCP MX specification leaves the tail to the implementation, and DeepSeek-V3-style tiling pads.
ampviz does the same as torchao by default: a shape that does not fit raises, naming the argument, the value
and what would fit. With ``pad=True`` a partial last block is counted as if padded with zeros: the padding
changes no block's maximum and is not counted as values (a zero-padded cast of the same tensor agrees).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockLayout", "LAYOUTS", "get_layout"]


@dataclass(frozen=True)
class BlockLayout:
    """A block shape over the ``(rows, K)`` view of a tensor.

    Parameters
    ----------
    name : short name ("mx32", "nv16", "row", "tile1x128", "tile128x128").
    block_rows : rows per block (1 for vector blocks).
    block_cols : elements per block along the blocked dimension; None for the whole row.
    note : who uses it (shown by :meth:`describe`).
    """

    name: str
    block_rows: int
    block_cols: int | None
    note: str = ""

    def __post_init__(self):
        if not isinstance(self.block_rows, int) or self.block_rows < 1:
            raise ValueError(f"block_rows: expected a positive integer, got {self.block_rows!r}")
        if self.block_cols is not None and (not isinstance(self.block_cols, int) or self.block_cols < 1):
            raise ValueError(f"block_cols: expected a positive integer or None (the whole row), "
                             f"got {self.block_cols!r}")

    def describe(self) -> str:
        cols = "a whole row" if self.block_cols is None else f"{self.block_rows} x {self.block_cols}"
        return f"{self.name}: blocks of {cols} along the blocked dim" + (f" ({self.note})" if self.note else "")

    def blocks_of(self, shape, dim: int = -1, pad: bool = False) -> tuple[int, int]:
        """``(row_blocks, col_blocks)`` of a tensor of ``shape`` blocked along ``dim``.

        Raises ValueError, naming the shape and what would fit, when a dimension is not a multiple of the
        block and ``pad`` is False."""
        shape = tuple(int(n) for n in shape)
        if not shape:
            raise ValueError(f"x: a 0-d tensor has no dimension to block ({self.name} needs at least 1-d)")
        if not -len(shape) <= dim < len(shape):
            raise ValueError(f"dim: {dim} is out of range for a tensor of shape {shape} "
                             f"(valid: {-len(shape)} ... {len(shape) - 1})")
        cols = shape[dim]
        rows = 1
        for i, n in enumerate(shape):
            if i != dim % len(shape):
                rows *= n
        block_cols = cols if self.block_cols is None else self.block_cols
        if not pad:
            if cols % max(block_cols, 1):
                raise ValueError(f"x: shape {shape} has {cols} elements along dim {dim}, not a multiple of the "
                                 f"{self.name} block's {block_cols}; valid: a multiple of {block_cols} (as torchao "
                                 f"requires), or pad=True to count a partial last block as zero-padded")
            if rows % self.block_rows:
                raise ValueError(f"x: shape {shape} has {rows} rows (every dimension but {dim}, multiplied), not a "
                                 f"multiple of the {self.name} block's {self.block_rows}; valid: a multiple of "
                                 f"{self.block_rows}, or pad=True to count a partial last block as zero-padded")
        return -(-rows // self.block_rows), (-(-cols // block_cols) if block_cols else 0)


LAYOUTS: dict[str, BlockLayout] = {layout.name: layout for layout in (
    BlockLayout("mx32", 1, 32, "OCP MX: MXFP8, MXFP4"),
    BlockLayout("nv16", 1, 16, "NVFP4"),
    BlockLayout("row", 1, None, "row-wise fp8, torchao's rowwise recipe"),
    BlockLayout("tile1x128", 1, 128, "DeepSeek-V3 activations and gradients"),
    BlockLayout("tile128x128", 128, 128, "DeepSeek-V3 weights"),
)}


def get_layout(spec) -> BlockLayout:
    """A layout by name, or a :class:`BlockLayout` passed through."""
    if isinstance(spec, BlockLayout):
        return spec
    if isinstance(spec, str) and spec.lower() in LAYOUTS:
        return LAYOUTS[spec.lower()]
    raise ValueError(f"layout: unknown block layout {spec!r}; valid: {', '.join(LAYOUTS)} or a BlockLayout")
