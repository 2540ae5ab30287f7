"""Where the bytes of one training step go: weights, gradients, optimizer state, saved activations.

Every number is counted from real tensors, never estimated from a formula. The activations a
step keeps for backward are counted with ``torch.autograd.graph.saved_tensors_hooks`` (each
storage once, however many ops save it), so fp32 and autocast can be compared honestly::

    >>> import torch
    >>> from ampviz.memory import measure_step
    >>> from ampviz.models import MLP
    >>> model = MLP(64, 256, depth=3, d_out=10)
    >>> x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    >>> fp32 = measure_step(model, x, y, torch.nn.functional.cross_entropy)
    >>> amp = measure_step(model, x, y, torch.nn.functional.cross_entropy, autocast_dtype=torch.bfloat16)
    >>> amp.weights == fp32.weights, amp.activations < fp32.activations
    (True, True)

Under autocast the parameters, their gradients and Adam's state stay fp32; the activations
saved for backward are 16-bit, and the graph also keeps 16-bit copies of the weights
(``weight_copies``), which fp32 training does not need.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

__all__ = ["SavedTensorLog", "MemoryBreakdown", "measure_step", "tensor_bytes", "CATEGORIES"]

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


def measure_step(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn, *,
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
