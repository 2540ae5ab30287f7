"""MemoryExplorer: pick an MLP's width, depth and batch size; see one real training step's memory
in fp32 and under autocast, counted from the tensors (``ampviz.memory.measure_step``)::

    from ampviz.widgets.memory import MemoryExplorer
    MemoryExplorer()            # in a notebook cell; sliders .width, .depth, .batch; .figure; .readout

Each configuration is measured once (a real forward, backward and Adam step on a fresh model)
and cached, so returning to a setting is instant. The figure is built once and updated in place.
"""

from __future__ import annotations

import ipywidgets as W
import plotly.graph_objects as go
import torch

from ..data import default_device, digits
from ..memory import measure_step
from ..models import MLP
from ..plots.memory import MIB, memory_figure, set_memory

__all__ = ["MemoryExplorer", "WIDTHS", "DEPTHS", "BATCHES"]

WIDTHS = (64, 128, 256, 512)
DEPTHS = (1, 2, 3, 4, 5, 6)
BATCHES = (16, 64, 256, 1024)


class MemoryExplorer(W.VBox):
    """Sliders for an MLP's width, depth and batch size over a stacked-bar chart of measured bytes.

    Parameters
    ----------
    inputs, targets : a classification data set (default: scikit-learn's digits, training split);
        a batch is its first ``batch`` rows (``batch`` may not exceed the number of rows).
    device : where to measure (default ``ampviz.data.default_device()``).
    autocast_dtype : low-precision dtype for autocast (default: autocast's default on the device,
        ``torch.get_autocast_dtype``: bfloat16 on CPU, float16 on CUDA).
    width, depth, batch : initial slider values.
    """

    def __init__(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None, *, device=None,
                 autocast_dtype: torch.dtype | None = None, width: int = 256, depth: int = 3, batch: int = 256):
        self.device = torch.device(device) if device is not None else default_device()
        if inputs is None or targets is None:
            split = digits(seed=0)
            inputs, targets = split.x_train, split.y_train
        if inputs.ndim != 2 or len(inputs) != len(targets):
            raise ValueError(f"inputs, targets: expected (N, features) and (N,), got {tuple(inputs.shape)} "
                             f"and {tuple(targets.shape)}")
        if len(inputs) < max(BATCHES):
            raise ValueError(f"inputs: need at least {max(BATCHES)} rows for the batch slider, got {len(inputs)}")
        self.autocast_dtype = autocast_dtype or torch.get_autocast_dtype(self.device.type)
        if self.autocast_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"autocast_dtype: expected torch.float16 or torch.bfloat16, got {autocast_dtype!r}")
        for name, value, options in (("width", width, WIDTHS), ("depth", depth, DEPTHS), ("batch", batch, BATCHES)):
            if value not in options:
                raise ValueError(f"{name}: expected one of {options}, got {value!r}")
        self.inputs, self.targets = inputs.to(self.device), targets.to(self.device)
        self.n_classes = int(targets.max()) + 1
        self.amp_label = f"autocast {str(self.autocast_dtype).replace('torch.', '')}"
        self._cache: dict[tuple, dict] = {}

        style = dict(description_width="70px")
        self.width = W.SelectionSlider(options=WIDTHS, value=width, description="width", style=style)
        self.depth = W.SelectionSlider(options=DEPTHS, value=depth, description="depth", style=style)
        self.batch = W.SelectionSlider(options=BATCHES, value=batch, description="batch", style=style)
        self.readout = W.HTML()
        self.figure = go.FigureWidget(memory_figure(self.breakdowns()))
        for slider in (self.width, self.depth, self.batch):
            slider.observe(self._on_change, names="value")
        self._update()
        super().__init__([W.HBox([self.width, self.depth, self.batch]), self.figure, self.readout])

    def breakdowns(self, width: int | None = None, depth: int | None = None, batch: int | None = None) -> dict:
        """``{"fp32": MemoryBreakdown, "autocast ...": MemoryBreakdown}`` for a setting (default: the sliders')."""
        key = (width or self.width.value, depth or self.depth.value, batch or self.batch.value)
        if key not in self._cache:
            w, d, b = key
            with torch.random.fork_rng(devices=[]):       # the same initial weights for every visit
                torch.manual_seed(0)
                model = MLP(self.inputs.shape[1], w, d, self.n_classes)
            x, y = self.inputs[:b], self.targets[:b]
            loss_fn = torch.nn.functional.cross_entropy
            self._cache[key] = {"fp32": measure_step(model, x, y, loss_fn),
                                self.amp_label: measure_step(model, x, y, loss_fn,
                                                             autocast_dtype=self.autocast_dtype)}
        return self._cache[key]

    def _on_change(self, _change) -> None:
        self._update()

    def _update(self) -> None:
        result = self.breakdowns()
        fp32, amp = result["fp32"], result[self.amp_label]
        fixed = ("weights", "gradients", "optimizer_state")
        same = all(getattr(amp, c) == getattr(fp32, c) for c in fixed)
        with self.figure.batch_update():
            set_memory(self.figure, result)
        self.readout.value = (
            f"<b>{self.amp_label} / fp32</b>: total <b>{amp.total / fp32.total:.2f}x</b> "
            f"({amp.total / MIB:.2f} vs {fp32.total / MIB:.2f} MiB); saved activations "
            f"{amp.activations / fp32.activations:.2f}x; weights, gradients, Adam state "
            f"{'unchanged' if same else 'changed'} ({', '.join(amp.dtypes['gradients'])} gradients); "
            f"16-bit weight copies "
            f"+{amp.weight_copies / MIB:.2f} MiB")
