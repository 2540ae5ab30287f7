"""ScalerPlayground: replay loss-scaler policies over a recorded run and compare with what happened.

    from ampviz.widgets import ScalerPlayground
    ScalerPlayground(run)                      # starts from the run's own scaler: GradScaler or DeepSpeed's

    w = ScalerPlayground(run)
    w.policy_dropdown.value = "deepspeed"
    w.init_slider.value = 24                   # init_scale 2**24
    w.replay.n_skipped, w.recorded_skipped     # replayed vs real skipped steps

The trace is each step's largest unscaled gradient (:func:`ampviz.replay.trace_from_run`),
computed once; every control change replays the policy over it (a few milliseconds for 2,000
steps). A replay is a counterfactual: a real run with other skips would have computed other
gradients afterwards, so trust the first divergence more than the tail.
"""

from __future__ import annotations

import dataclasses

import ipywidgets as W
import numpy as np

from ..formats import get_format
from ..plots.scale_trace import scale_trace_figure, set_replay
from ..replay import DeepSpeedPolicy, MegatronPolicy, StaticPolicy, TorchPolicy, policy_from_run, replay, trace_from_run
from ..run import Run
from .parts import figure_widget, pow2_label, table_html

__all__ = ["ScalerPlayground", "POLICY_CONTROLS"]

_INTERVALS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
_POLICY_OPTIONS = [("PyTorch GradScaler", "pytorch"), ("DeepSpeed", "deepspeed"), ("Megatron-LM", "megatron"),
                   ("static", "static")]
# which controls each policy reads; the others are disabled while it is chosen
POLICY_CONTROLS = {"pytorch": ("init", "growth", "backoff", "interval"),
                   "deepspeed": ("init", "growth", "interval", "hysteresis"),
                   "megatron": ("init", "growth", "backoff", "interval", "hysteresis"),
                   "static": ("init",)}


class ScalerPlayground(W.VBox):
    """Policy dropdown and scaler sliders; the replay is drawn against the recorded loss scale.

    Parameters
    ----------
    source : an ``ampviz.Run`` (its recorded scale, skips and growths are drawn, and the
        controls start at its own scaler's settings, ``ampviz.replay.policy_from_run``: a GradScaler's, or a
        DeepSpeed fp16 engine's with its ``min_loss_scale`` and hysteresis mode kept) or a 1-D per-step trace of
        the largest unscaled gradient magnitudes (inf = overflow at any scale).
    format : format the scaled gradients are computed in (its overflow threshold decides skips).
    policy : initial policy: "pytorch", "deepspeed", "megatron" or "static"; default: the run's own ("deepspeed"
        for a DeepSpeed fp16 run, "static" for one with a static loss scale), else "pytorch".
    rank, tensors : for a Run: which rank, and which tensors the per-step maximum covers.

    Attributes
    ----------
    policy_dropdown, init_slider (log2 of init_scale), growth_slider (growth_factor; DeepSpeed's
    scale_factor), backoff_slider, interval_slider (growth_interval; DeepSpeed's scale_window),
    hysteresis_slider, readout (HTML), figure (FigureWidget), trace, replay (the current Replay),
    recorded_skipped (int or None).
    """

    def __init__(self, source, format="fp16", *, policy: str | None = None, rank=None, tensors=None):
        self.format = get_format(format)
        if not self.format.has_inf:
            raise ValueError(f"format: {self.format.name} has no inf, so no loss scaler sees an overflow; "
                             "use fp16, bf16 or fp8_e5m2")
        if policy is not None and policy not in POLICY_CONTROLS:
            raise ValueError(f"policy: expected one of {list(POLICY_CONTROLS)}, got {policy!r}")
        self.trace, recorded, start = _resolve(source, self.format, rank, tensors)
        if policy is None:
            policy = ("deepspeed" if isinstance(start, DeepSpeedPolicy) else
                      "static" if isinstance(start, StaticPolicy) else "pytorch")
        # DeepSpeed's settings without a slider (min_scale, consecutive_hysteresis, raise_error_at_min_scale): the
        # run's own when it is a DeepSpeed run, DeepSpeedPolicy's defaults otherwise
        self._deepspeed_base = start if isinstance(start, DeepSpeedPolicy) else DeepSpeedPolicy()
        self.recorded_skipped = None if recorded is None else int(recorded["skipped"].sum())
        self._steps = recorded["steps"] if recorded is not None else np.arange(self.trace.size)
        self._build_controls(policy, start)
        self.replay = replay(self.current_policy(), self.trace, self.format)
        fig = scale_trace_figure(self._steps, *_recorded_arrays(recorded), replay=self.replay,
                                 trace=self.trace, format=self.format,
                                 title=f"Loss scale: {'recorded vs ' if recorded else ''}replayed ({self.format.name})")
        self.figure = figure_widget(fig)
        self.readout = W.HTML(self._readout_html())
        for c in self._controls.values():
            c.observe(self._on_change, "value")
        self.policy_dropdown.observe(self._on_change, "value")
        self.init_label = W.Label(pow2_label(self.init_slider.value))
        top = W.HBox([self.policy_dropdown, self.init_slider, self.init_label])
        sliders = W.HBox([self.growth_slider, self.backoff_slider])
        sliders2 = W.HBox([self.interval_slider, self.hysteresis_slider])
        super().__init__([top, sliders, sliders2, self.figure, self.readout])

    # ------------------------------------------------------------------ controls
    def _build_controls(self, policy: str, start: TorchPolicy | DeepSpeedPolicy | StaticPolicy) -> None:
        style = {"description_width": "initial"}
        torch_default = TorchPolicy()
        init_log2 = int(np.clip(np.rint(np.log2(start.init_scale)), 0, 40))
        if isinstance(start, DeepSpeedPolicy):
            growth, backoff = start.scale_factor, torch_default.backoff_factor
            interval, hysteresis = int(start.scale_window), int(start.hysteresis)
        elif isinstance(start, TorchPolicy):
            growth, backoff, interval, hysteresis = (start.growth_factor, start.backoff_factor,
                                                     int(start.growth_interval), 2)
        else:                        # a static scale: the dynamic controls start at GradScaler's defaults
            growth, backoff, interval, hysteresis = (torch_default.growth_factor, torch_default.backoff_factor,
                                                     int(torch_default.growth_interval), 2)
        intervals = sorted(set(_INTERVALS) | {interval})
        self.policy_dropdown = W.Dropdown(options=_POLICY_OPTIONS, value=policy, description="policy")
        self.init_slider = W.IntSlider(value=init_log2, min=0, max=40, description="init_scale (log2)", style=style)
        self.growth_slider = W.FloatSlider(value=growth, min=1.25, max=8.0, step=0.25,
                                           description="growth_factor", style=style)
        self.backoff_slider = W.FloatSlider(value=backoff, min=0.05, max=0.95, step=0.05,
                                            description="backoff_factor", style=style)
        self.interval_slider = W.SelectionSlider(options=intervals, value=interval,
                                                 description="growth_interval", style=style)
        self.hysteresis_slider = W.IntSlider(value=min(max(hysteresis, 1), 10), min=1, max=10, description="hysteresis",
                                             style=style)
        self._controls = {"init": self.init_slider, "growth": self.growth_slider, "backoff": self.backoff_slider,
                          "interval": self.interval_slider, "hysteresis": self.hysteresis_slider}
        self._enable_for(policy)

    def _enable_for(self, policy: str) -> None:
        used = POLICY_CONTROLS[policy]
        for name, control in self._controls.items():
            control.disabled = name not in used

    def current_policy(self):
        """The policy object the controls describe now."""
        name = self.policy_dropdown.value
        init = 2.0 ** self.init_slider.value
        growth, backoff = float(self.growth_slider.value), float(self.backoff_slider.value)
        interval, hyst = int(self.interval_slider.value), int(self.hysteresis_slider.value)
        if name == "pytorch":
            return TorchPolicy(init, growth, backoff, interval)
        if name == "deepspeed":
            return dataclasses.replace(self._deepspeed_base, init_scale=init, scale_factor=growth,
                                       scale_window=interval, hysteresis=hyst)
        if name == "megatron":
            return MegatronPolicy(init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval,
                                  hysteresis=hyst)
        return StaticPolicy(init)

    # ------------------------------------------------------------------ updates
    def _on_change(self, change=None) -> None:
        self._enable_for(self.policy_dropdown.value)
        self.init_label.value = pow2_label(self.init_slider.value)
        self.replay = replay(self.current_policy(), self.trace, self.format)
        with self.figure.batch_update():
            set_replay(self.figure, self.replay, self._steps)
        self.readout.value = self._readout_html()

    def _readout_html(self) -> str:
        r, n = self.replay, self.trace.size
        rows = []
        if self.recorded_skipped is not None:
            rows.append(("recorded run", f"{self.recorded_skipped} of {n} steps skipped"))
        rows.append((f"replay ({r.policy.name})", f"<b>{r.n_skipped}</b> of {r.scale.size} steps skipped"))
        if r.scale.size:
            rows.append(("replay scale", f"min 2^{np.log2(r.scale.min()):.1f}, max 2^{np.log2(r.scale.max()):.1f},"
                                         f" final 2^{np.log2(r.final_scale):.1f}"))
        if r.crashed_at is not None:
            rows.append(("DeepSpeed stops", f"step {int(self._steps[r.crashed_at])}: "
                                            "overflow with the loss scale already at min_scale"))
        greyed = [c.description for c in self._controls.values() if c.disabled]
        if greyed:
            label = dict((v, k) for k, v in _POLICY_OPTIONS)[self.policy_dropdown.value]
            rows.append(("greyed out", f"{', '.join(greyed)}: not used by the {label} policy"))
        rows.append(("note", "a replay is a counterfactual: skips change later gradients in a real run"))
        return table_html(rows)


def _resolve(source, fmt, rank, tensors):
    """(trace, recorded arrays or None, starting policy) from a Run or a plain trace: the run's own scaler
    (``policy_from_run``: a GradScaler's, DeepSpeed's fp16 one), else GradScaler's defaults."""
    if isinstance(source, Run):
        r = source.rank_index(source.ranks[0] if rank is None else rank)
        trace = trace_from_run(source, fmt, source.ranks[r], tensors)
        recorded = {"steps": source.steps, "scale": source.loss_scale[r], "skipped": source.skipped[r],
                    "grown": source.grown[r]}
        try:
            start = policy_from_run(source)
        except ValueError:           # no loss scaler recorded (no GradScaler; a bf16 / fp32 DeepSpeed run)
            start = TorchPolicy()
        return trace, recorded, start
    if rank is not None or tensors is not None:
        raise ValueError("rank, tensors: only apply when the source is an ampviz.Run")
    arr = np.asarray(source)
    if arr.ndim != 1 or arr.size == 0 or not (arr.dtype == bool or np.issubdtype(arr.dtype, np.number)):
        raise ValueError(f"source: expected an ampviz.Run or a non-empty 1-D trace of per-step maxima "
                         f"(or overflow flags), got {type(source).__name__} of shape {arr.shape}")
    # overflow flags become "overflows at any scale" / "never"; nan magnitudes count as overflow
    trace = np.where(arr, np.inf, 0.0) if arr.dtype == bool else np.abs(arr.astype(float))
    trace = np.where(np.isnan(trace), np.inf, trace)
    return trace, None, TorchPolicy()


def _recorded_arrays(recorded):
    """Positional (loss_scale, skipped, grown) for the figure (None: nothing was recorded)."""
    if recorded is None:
        return None, None, None
    return recorded["scale"], recorded["skipped"], recorded["grown"]
