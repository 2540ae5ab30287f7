"""SamplerExplorer: which data-set indices PyTorch's ``DistributedSampler`` hands each rank, per epoch.

    from ampviz.lessons.sampler import SamplerExplorer
    w = SamplerExplorer(n=15, world_size=2)     # 15 on 2 ranks: one example padded
    w.set_epoch_box.value = False          # forget sampler.set_epoch(epoch): every epoch repeats
    w.table                                # (epochs, ranks, per_rank) indices now shown

Each row of the heatmap is one rank in one epoch, read left to right in the order the rank visits
its examples; a cell's number (and colour) is the data-set index. The table is computed by the real
sampler (``ampviz.lessons.sampler.sampler_table``) with no process group: each rank derives its share
from the seed, the epoch, its rank and the world size, so no communication is involved.

Used by lessons 10 (DDP basics) and 11 (DDP + AMP training).
"""

from __future__ import annotations

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go

from .._args import check_int
from ..plots.style import base_layout
from ..widgets.parts import figure_widget, table_html

__all__ = ["sampler_table", "SamplerExplorer"]

def sampler_table(n: int, world_size: int = 2, epochs: int = 3, *, set_epoch: bool = True, shuffle: bool = True,
                  seed: int = 0, drop_last: bool = False) -> np.ndarray:
    """(epochs, world_size, per_rank) dataset indices that ``DistributedSampler`` gives each rank.

    Computed with PyTorch's own sampler, with no process group: every rank derives its share from
    (seed, epoch, rank, world size) alone, which is why no communication is needed.
    ``set_epoch=False`` reproduces a loop that forgets ``sampler.set_epoch(epoch)``.
    """
    from torch.utils.data import DistributedSampler
    for name, value in (("n", n), ("world_size", world_size), ("epochs", epochs)):
        check_int(name, value, low=1)
    data = range(n)
    table = []
    for epoch in range(epochs):
        row = []
        for rank in range(world_size):
            sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                         seed=seed, drop_last=drop_last)
            if set_epoch:
                sampler.set_epoch(epoch)
            row.append(list(sampler))
        table.append(row)
    return np.asarray(table, dtype=np.int64)


_LIGHT = [[0.0, "#F9D8B0"], [0.5, "#BFE3C8"], [1.0, "#A9CFEA"]]   # light, so black numbers stay readable


class SamplerExplorer(W.VBox):
    """Sliders for data-set size and world size; boxes for ``set_epoch``, ``shuffle``, ``drop_last``.

    Attributes
    ----------
    n_slider, world_slider (IntSlider), set_epoch_box, shuffle_box, drop_last_box (Checkbox),
    figure (FigureWidget heatmap), readout (HTML), table (np.ndarray (epochs, ranks, per_rank)).
    """

    def __init__(self, n: int = 15, world_size: int = 2, epochs: int = 3, seed: int = 0, *,
                 set_epoch: bool = True, shuffle: bool = True, drop_last: bool = False):
        check_int("epochs", epochs, 1, 6)
        check_int("n", n, 2, 40)
        check_int("world_size", world_size, 1, 8)
        self.epochs, self.seed = epochs, seed
        self.n_slider = W.IntSlider(value=n, min=2, max=40, description="data set size")
        self.world_slider = W.IntSlider(value=world_size, min=1, max=8, description="world size")
        self.set_epoch_box = W.Checkbox(value=set_epoch, description="sampler.set_epoch(epoch)")
        self.shuffle_box = W.Checkbox(value=shuffle, description="shuffle")
        self.drop_last_box = W.Checkbox(value=drop_last, description="drop_last")
        self.readout = W.HTML()
        self.table = self._compute()
        self.figure = figure_widget(self._figure())
        self.readout.value = self._readout_html()
        for w in (self.n_slider, self.world_slider, self.set_epoch_box, self.shuffle_box, self.drop_last_box):
            w.observe(self._on_change, "value")
        style = {"description_width": "initial"}
        for w in (self.n_slider, self.world_slider):
            w.style = style
        super().__init__([W.HBox([self.n_slider, self.world_slider]),
                          W.HBox([self.set_epoch_box, self.shuffle_box, self.drop_last_box]),
                          self.figure, self.readout])

    def _compute(self) -> np.ndarray:
        return sampler_table(self.n_slider.value, self.world_slider.value, self.epochs, seed=self.seed,
                             set_epoch=self.set_epoch_box.value, shuffle=self.shuffle_box.value,
                             drop_last=self.drop_last_box.value)

    def _grid(self):
        E, R, K = self.table.shape
        z = self.table.reshape(E * R, K)[::-1]                       # epoch 0, rank 0 on top
        labels = [f"epoch {e} · rank {r}" for e in range(E) for r in range(R)][::-1]
        return z, labels

    def _figure(self) -> go.Figure:
        z, labels = self._grid()
        fig = go.Figure(go.Heatmap(z=z, y=labels, text=z, texttemplate="%{text}", colorscale=_LIGHT,
                                   textfont=dict(color="#222222"),
                                   zmin=0, zmax=self.n_slider.value - 1, showscale=False, xgap=2, ygap=2,
                                   hovertemplate="%{y}, position %{x}: index %{z}<extra></extra>"))
        fig.update_layout(base_layout(self._title(), height=self._height(), margin=dict(l=10, r=10, t=50, b=40)),
                          xaxis=dict(title="position in the rank's order", dtick=1, showline=False, ticks=""),
                          yaxis=dict(type="category", showline=False, ticks=""))
        return fig

    def _height(self) -> int:
        return 120 + 26 * self.table.shape[0] * self.table.shape[1]

    def _title(self) -> str:
        calls = "with" if self.set_epoch_box.value else "without"
        return f"DistributedSampler indices per rank and epoch ({calls} set_epoch)"

    def _on_change(self, change=None) -> None:
        self.table = self._compute()
        z, labels = self._grid()
        with self.figure.batch_update():
            heat = self.figure.data[0]
            heat.z, heat.text, heat.y, heat.zmax = z, z, labels, self.n_slider.value - 1
            self.figure.layout.height = self._height()
            self.figure.layout.title.text = self._title()
        self.readout.value = self._readout_html()

    def _readout_html(self) -> str:
        E, R, K = self.table.shape
        n = self.n_slider.value
        repeats = all(np.array_equal(self.table[0], self.table[e]) for e in range(E))
        seen = np.unique(self.table[0])
        rows = [("per rank per epoch", f"{K} examples ({R} ranks × {K} = {R * K} of {n})"),
                ("every epoch the same order", "yes" if repeats else "no")]
        if R * K > n:
            rows.append(("padding", f"{R * K - n} example(s) appear twice so every rank gets {K}"))
        elif len(seen) < n:
            rows.append(("dropped", f"{n - len(seen)} example(s) unused this epoch (drop_last)"))
        return table_html(rows)
