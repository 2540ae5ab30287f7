"""ClipOrderExplorer: clip before or after ``scaler.unscale_``? Slide max_norm and the loss scale.

    from ampviz.widgets.clipping import ClipOrderExplorer
    grads = [p.grad.clone() for p in model.parameters()]     # true gradients (after unscale_)
    ClipOrderExplorer(grads, max_norm=1.0, log2_scale=16)

    w = ClipOrderExplorer(grads)
    w.scale_slider.value = 8                  # loss scale 2**8
    w.norms["clip first"], w.norms["unscale first"]

Every position really runs ``torch.nn.utils.clip_grad_norm_`` on copies of the gradients, in both
orders (:func:`ampviz.clipping.clipped_norm`); the curves for a loss scale are computed once and
cached.
"""

from __future__ import annotations

import ipywidgets as W

from ..clipping import ORDERS, clipped_norms, total_norm
from ..plots.clipping import MAX_NORMS, clipping_figure, set_clipping
from ._common import figure_widget, pow2_label, table_html

__all__ = ["ClipOrderExplorer"]


class ClipOrderExplorer(W.VBox):
    """Sliders for ``max_norm`` (log scale) and the loss scale (log2); both orders drawn and read out.

    Parameters
    ----------
    grads : the true gradients (a tensor or a list of tensors).
    max_norm : initial clipping threshold (1e-6 .. 100).
    log2_scale : initial loss scale exponent (0 .. 24).

    Attributes
    ----------
    norm_slider (FloatLogSlider), scale_slider (IntSlider), readout (HTML), figure (FigureWidget),
    norms (dict order -> the applied norm now), true_norm.
    """

    def __init__(self, grads, max_norm: float = 1.0, log2_scale: int = 16):
        self.grads = [g.detach().float().clone() for g in ([grads] if hasattr(grads, "dim") else grads)]
        self.true_norm = total_norm(self.grads)
        if not 1e-6 <= max_norm <= 100:
            raise ValueError(f"max_norm: expected a value in [1e-6, 100], got {max_norm!r}")
        if isinstance(log2_scale, bool) or not isinstance(log2_scale, int) or not 0 <= log2_scale <= 24:
            raise ValueError(f"log2_scale: expected an integer in [0, 24], got {log2_scale!r}")
        self._curves: dict = {}
        self.norm_slider = W.FloatLogSlider(value=max_norm, base=10, min=-6, max=2, step=0.05,
                                            description="max_norm", readout_format=".3g")
        self.scale_slider = W.IntSlider(value=log2_scale, min=0, max=24, description="log2 scale")
        self.scale_label = W.Label(pow2_label(log2_scale))
        self.readout = W.HTML()
        fig = clipping_figure(self.grads, max_norm, log2_scale, curves=self._curve(log2_scale))
        self.figure = figure_widget(fig)
        self.norms = {order: clipped_norms(self.grads, [max_norm], log2_scale)[order][0] for order in ORDERS}
        self.readout.value = self._readout_html()
        self.norm_slider.observe(self._on_change, "value")
        self.scale_slider.observe(self._on_change, "value")
        super().__init__([W.HBox([self.norm_slider, self.scale_slider, self.scale_label]), self.readout,
                          self.figure])

    def _curve(self, log2_scale: int) -> dict:
        if log2_scale not in self._curves:
            self._curves[log2_scale] = clipped_norms(self.grads, MAX_NORMS, log2_scale)
        return self._curves[log2_scale]

    def _on_change(self, change=None) -> None:
        m, s = self.norm_slider.value, self.scale_slider.value
        with self.figure.batch_update():
            self.norms = set_clipping(self.figure, self.grads, m, s, curves=self._curve(s))
        self.scale_label.value = pow2_label(s)
        self.readout.value = self._readout_html()

    def _readout_html(self) -> str:
        right, wrong = self.norms["unscale first"], self.norms["clip first"]
        rows = [("true gradient norm ‖g‖", f"{self.true_norm:.4g}"),
                ("scaled norm the clip sees if called first", f"{self.true_norm * 2.0 ** self.scale_slider.value:.4g}"),
                ("step norm, unscale_ then clip (right)", f"{right:.4g}"),
                ("step norm, clip then step unscales (wrong)", f"{wrong:.4g}"),
                ("wrong / right", f"{wrong / right:.3g}")]
        return table_html(rows, title=f"clip_grad_norm_(max_norm={self.norm_slider.value:.3g}) at loss scale "
                                      f"2^{self.scale_slider.value}")
