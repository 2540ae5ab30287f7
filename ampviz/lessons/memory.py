"""Where the bytes of one training step go: weights, gradients, optimizer state, saved activations.

Every number is counted from real tensors, never estimated from a formula. The activations a
step keeps for backward are counted with ``torch.autograd.graph.saved_tensors_hooks`` (each
storage once, however many ops save it), so fp32 and autocast can be compared honestly::

    >>> import torch
    >>> from ampviz.lessons.memory import measure_memory
    >>> from ampviz.lessons.models import MLP
    >>> model = MLP(64, 256, depth=3, d_out=10)
    >>> x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    >>> fp32 = measure_memory(model, x, y, torch.nn.functional.cross_entropy)
    >>> amp = measure_memory(model, x, y, torch.nn.functional.cross_entropy, autocast_dtype=torch.bfloat16)
    >>> amp.weights == fp32.weights, amp.activations < fp32.activations
    (True, True)

Under autocast the parameters, their gradients and Adam's state stay fp32; the activations
saved for backward are 16-bit, and the graph also keeps 16-bit copies of the weights
(``weight_copies``), which fp32 training does not need.

The figure (``memory_figure``) and ``MemoryExplorer`` (width, depth, batch sliders; fp32 beside
autocast) follow the computation.

Used by lessons 02 (why mixed precision).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import ipywidgets as W
import plotly.graph_objects as go
import torch

from ..plots.style import OKABE_ITO, base_layout, title_text
from .data import default_device, digits
from .models import MLP

__all__ = ["SavedTensorLog", "MemoryBreakdown", "measure_memory", "tensor_bytes", "CATEGORIES", "memory_figure",
           "set_memory", "CATEGORY_COLORS", "CATEGORY_LABELS", "MIB", "MemoryExplorer", "WIDTHS", "DEPTHS",
           "BATCHES"]


CATEGORIES = ("weights", "gradients", "optimizer_state", "weight_copies", "activations")
KINDS = ("parameter", "input", "weight_copy", "activation")


def tensor_bytes(tensors) -> int:
    """Bytes held by the elements of ``tensors`` (an iterable of tensors; None entries skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class SavedEntry:
    """One storage kept alive by autograd for backward."""

    shape: tuple
    dtype: torch.dtype
    nbytes: int          # bytes of the whole storage (what stays allocated)
    kind: str            # "parameter" or "input" (no extra memory), "weight_copy" or "activation"
    name: str = ""       # the parameter's name for "parameter" and "weight_copy"


class SavedTensorLog:
    """Context manager that logs every tensor autograd saves for backward, once per storage.

    Parameters
    ----------
    model : optional module whose parameters are recognised: a saved parameter costs no extra
        memory (kind "parameter"); a saved storage whose values equal the
        parameter cast to its dtype is a low-precision copy made by autocast (kind "weight_copy").
    inputs : tensors that exist before the forward pass (the batch, the targets): saving them
        costs no extra memory either (kind "input"); their low-precision casts are activations.

    Everything else is kind "activation": memory the forward pass allocates and keeps for backward.
    """

    def __init__(self, model: torch.nn.Module | None = None, inputs=()):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module or None, got {type(model).__name__}")
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if not all(isinstance(t, torch.Tensor) for t in inputs):
            raise TypeError(f"inputs: expected a tensor or a sequence of tensors, got {inputs!r}")
        params = list(model.named_parameters()) if model is not None else []
        self._param_ptrs = {p.untyped_storage().data_ptr(): n for n, p in params}
        self._input_ptrs = {t.untyped_storage().data_ptr() for t in inputs}
        self._param_by_numel: dict[int, list] = {}
        for n, p in params:
            self._param_by_numel.setdefault(p.numel(), []).append((n, p))
        self._seen: set = set()
        self.entries: list[SavedEntry] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __enter__(self) -> SavedTensorLog:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if storage.nbytes() == 0 or key in self._seen:
            return t
        self._seen.add(key)
        kind, name = "activation", ""
        if storage.data_ptr() in self._param_ptrs:
            kind, name = "parameter", self._param_ptrs[storage.data_ptr()]
        elif storage.data_ptr() in self._input_ptrs:
            kind = "input"
        else:
            # autocast saves views of its casts (Linear saves weight.t()): compare whole storages
            flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)
            for n, p in self._param_by_numel.get(flat.numel(), []):
                same_place = t.dtype != p.dtype and t.device == p.device
                if same_place and torch.equal(flat, p.detach().reshape(-1).to(t.dtype)):
                    kind, name = "weight_copy", n
                    break
        self.entries.append(SavedEntry(tuple(t.shape), t.dtype, storage.nbytes(), kind, name))
        return t  # keep the tensor itself: the log never changes what autograd stores

    def bytes(self, kind: str | None = None) -> int:
        """Total bytes of the saved storages, optionally of one kind only."""
        if kind not in (None, *KINDS):
            raise ValueError(f"kind: expected None or one of {KINDS}, got {kind!r}")
        return sum(e.nbytes for e in self.entries if kind is None or e.kind == kind)

    def bytes_by_dtype(self, kind: str | None = None) -> dict[str, int]:
        """Saved bytes per dtype name (e.g. ``{"bfloat16": 65536, "float32": 5120}``)."""
        out: dict[str, int] = {}
        for e in self.entries:
            if kind is None or e.kind == kind:
                key = str(e.dtype).replace("torch.", "")
                out[key] = out.get(key, 0) + e.nbytes
        return out


@dataclass
class MemoryBreakdown:
    """Bytes of one training step by category, with the dtypes seen in each."""

    weights: int
    gradients: int
    optimizer_state: int
    weight_copies: int
    activations: int
    dtypes: dict = field(default_factory=dict)     # category -> sorted dtype names
    peak_step_bytes: int | None = None             # CUDA only: max_memory_allocated growth in the step

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)

    def as_dict(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in CATEGORIES}


def _dtype_names(tensors) -> list[str]:
    return sorted({str(t.dtype).replace("torch.", "") for t in tensors if t is not None})


def measure_memory(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn, *,
                 autocast_dtype: torch.dtype | None = None, lr: float = 1e-3) -> MemoryBreakdown:
    """Run one Adam training step on a copy of ``model`` and count the bytes of its tensors.

    Parameters
    ----------
    model : the module; it is deep-copied, so the caller's model and its weights are untouched.
    inputs, targets : one batch, on the device to measure (the copy is moved there).
    loss_fn : ``loss_fn(outputs, targets) -> scalar``.
    autocast_dtype : None for plain fp32; ``torch.bfloat16`` or ``torch.float16`` to run the
        forward pass under ``torch.amp.autocast(device_type, dtype=autocast_dtype)``.
    lr : Adam's learning rate (the step is real, so its value does not change the byte counts).

    Returns
    -------
    MemoryBreakdown; on CUDA ``peak_step_bytes`` is ``torch.cuda.max_memory_allocated()`` during
    the step minus what was allocated before it (after one warm-up step on another copy).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if autocast_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"autocast_dtype: expected None, torch.float16 or torch.bfloat16, got {autocast_dtype!r}")
    device = inputs.device
    if device.type == "cuda":
        _one_step(copy.deepcopy(model).to(device), inputs, targets, loss_fn, autocast_dtype, lr)  # warm-up
        torch.cuda.synchronize(device)
    model = copy.deepcopy(model).to(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    log, opt = _one_step(model, inputs, targets, loss_fn, autocast_dtype, lr)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - before   # note: reads device counters, a sync point
    params = list(model.parameters())
    grads = [p.grad for p in params]
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return MemoryBreakdown(
        weights=tensor_bytes(params), gradients=tensor_bytes(grads), optimizer_state=tensor_bytes(state),
        weight_copies=log.bytes("weight_copy"), activations=log.bytes("activation"),
        dtypes={"weights": _dtype_names(params), "gradients": _dtype_names(grads),
                "optimizer_state": _dtype_names(state),
                "weight_copies": sorted(log.bytes_by_dtype("weight_copy")),
                "activations": sorted(log.bytes_by_dtype("activation"))},
        peak_step_bytes=peak)


def _one_step(model, inputs, targets, loss_fn, autocast_dtype, lr):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    with SavedTensorLog(model, inputs=(inputs, targets)) as log:
        with torch.amp.autocast(inputs.device.type, dtype=autocast_dtype or torch.bfloat16,
                                enabled=autocast_dtype is not None):
            loss = loss_fn(model(inputs), targets)
    loss.backward()
    opt.step()
    return log, opt


MIB = 2 ** 20
CATEGORY_COLORS = {"weights": OKABE_ITO["blue"], "gradients": OKABE_ITO["sky_blue"],
                   "optimizer_state": OKABE_ITO["bluish_green"], "weight_copies": OKABE_ITO["orange"],
                   "activations": OKABE_ITO["vermillion"]}
CATEGORY_LABELS = {"weights": "weights", "gradients": "gradients", "optimizer_state": "Adam state",
                   "weight_copies": "16-bit weight copies", "activations": "saved activations"}


def _check(breakdowns) -> dict:
    if not isinstance(breakdowns, dict) or not breakdowns:
        raise ValueError(f"breakdowns: expected a non-empty dict label -> MemoryBreakdown, got {breakdowns!r}")
    return breakdowns


def memory_figure(breakdowns: dict, title: str = "Memory of one training step, counted from the tensors",
                  subtitle: str | None = None) -> go.Figure:
    """One stacked bar per entry of ``breakdowns`` (label -> :class:`ampviz.lessons.memory.MemoryBreakdown`), in MiB."""
    _check(breakdowns)
    fig = go.Figure()
    labels = list(breakdowns)
    for c in CATEGORIES:
        fig.add_bar(x=labels, y=[getattr(b, c) / MIB for b in breakdowns.values()], name=CATEGORY_LABELS[c],
                    marker_color=CATEGORY_COLORS[c],
                    hovertemplate=f"{CATEGORY_LABELS[c]}: %{{y:.3f}} MiB<extra>%{{x}}</extra>")
    fig.add_scatter(x=labels, y=[b.total / MIB for b in breakdowns.values()], mode="text",
                    text=_total_text(breakdowns), textposition="top center", showlegend=False, hoverinfo="skip")
    fig.update_layout(**base_layout(title, subtitle or _dtype_text(breakdowns),
                                    height=440, showlegend=True, barmode="stack", inline_subtitle=True,
                                    legend=dict(traceorder="reversed")))
    fig.update_yaxes(title="MiB", rangemode="tozero")
    _fit_y(fig, breakdowns)
    return fig


def set_memory(fig, breakdowns: dict) -> None:
    """Replace the bar heights of a figure made by :func:`memory_figure` (same labels or new ones)."""
    _check(breakdowns)
    labels = list(breakdowns)
    for trace, c in zip(fig.data, CATEGORIES):
        trace.x = labels
        trace.y = [getattr(b, c) / MIB for b in breakdowns.values()]
    fig.data[len(CATEGORIES)].x = labels
    fig.data[len(CATEGORIES)].y = [b.total / MIB for b in breakdowns.values()]
    fig.data[len(CATEGORIES)].text = _total_text(breakdowns)
    # the subtitle is the title text's second line (see plots._style.title_text): keep the first
    fig.layout.title.text = title_text((fig.layout.title.text or "").partition("<br>")[0], _dtype_text(breakdowns))
    _fit_y(fig, breakdowns)


def _dtype_text(breakdowns) -> str:
    """Subtitle naming the dtypes actually found, e.g. 'weights, gradients, Adam state: float32 in every bar'."""
    parts = []
    for c in ("weights", "gradients", "optimizer_state"):
        found = sorted({d for b in breakdowns.values() for d in b.dtypes.get(c, [])})
        parts.append((CATEGORY_LABELS[c], "/".join(found) or "none"))
    if len({p[1] for p in parts}) == 1:
        return f"weights, gradients, Adam state: {parts[0][1]} in every bar"
    return "; ".join(f"{label}: {d}" for label, d in parts)


def _total_text(breakdowns) -> list[str]:
    first = next(iter(breakdowns.values())).total
    return [f"{b.total / MIB:.2f} MiB" + ("" if i == 0 else f" ({b.total / first:.2f}x)")
            for i, b in enumerate(breakdowns.values())]


def _fit_y(fig, breakdowns) -> None:
    top = max(b.total for b in breakdowns.values()) / MIB
    fig.update_yaxes(range=[0, top * 1.15 if top > 0 else 1])


WIDTHS = (64, 128, 256, 512)
DEPTHS = (1, 2, 3, 4, 5, 6)
BATCHES = (16, 64, 256, 1024)


class MemoryExplorer(W.VBox):
    """Sliders for an MLP's width, depth and batch size over a stacked-bar chart of measured bytes.

    Parameters
    ----------
    inputs, targets : a classification data set (default: scikit-learn's digits, training split);
        a batch is its first ``batch`` rows (``batch`` may not exceed the number of rows).
    device : where to measure (default ``ampviz.lessons.data.default_device()``).
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
            self._cache[key] = {"fp32": measure_memory(model, x, y, loss_fn),
                                self.amp_label: measure_memory(model, x, y, loss_fn,
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
