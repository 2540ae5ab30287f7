"""Gradient underflow: capture one step's real gradients, and find the loss scales that save them.

The histograms of :mod:`ampviz.histogram` predict what a cast does at any power-of-two loss
scale; this module adds the raw tensors (to check predictions against real casts and to weigh
gradients by magnitude) and the questions a learner asks of them::

    import torch, torch.nn.functional as F
    from ampviz.lessons import underflow as U
    grads = U.capture_gradients(model, F.cross_entropy, x, y)        # fp32 backward, nothing stored
    counts = U.counts_of(grads.activations)                          # (NBINS,) pooled histogram
    U.smallest_log2_scale(counts, "fp16", keep=0.99)                 # keeps >= 99% of non-zero values
    U.largest_log2_scale(counts, "fp16")                             # largest scale without overflow
    U.flushed_mass(grads.activations.values(), range(0, 40))         # share of sum|g| flushed, exact
    U.median_log2(counts), U.zero_share(counts)                      # median binade, share of exact zeros

Bins are binades closed at the top, (2**k, 2**(k+1)], as everywhere in ampviz (``ampviz.histogram``).
"Flushed" means a non-zero value that becomes exactly 0 after ``(x * 2**s).to(format)``.

Used by lessons 05 (gradient underflow), 06 and 06b (GradScaler) and 08 (bf16 and fp8).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from .. import histogram as H
from ..formats import get_format

__all__ = ["Gradients", "capture_gradients", "counts_of", "smallest_log2_scale", "largest_log2_scale",
           "flushed_mass", "zero_share", "median_log2", "zero_fraction", "static_scaler"]


@dataclass
class Gradients:
    """One backward pass: gradients w.r.t. module outputs (``activations``) and parameters (``weights``).

    Both are dicts name -> tensor (detached), in the order the Recorder uses; ``loss`` is the
    unscaled loss. Gradients are as computed, i.e. multiplied by ``loss_scale``.
    """

    activations: dict
    weights: dict
    loss: float
    loss_scale: float


def _leaf_modules_with_params(model: nn.Module) -> list:
    return [(n, m) for n, m in model.named_modules()
            if n and not list(m.children()) and any(True for _ in m.parameters(recurse=False))]


def capture_gradients(model: nn.Module, loss_fn, x, y, *, amp_dtype: torch.dtype | None = None,
                      loss_scale: float = 1.0) -> Gradients:
    """Run one forward and backward pass and return every activation and weight gradient.

    Uses ``torch.autograd.grad``, so parameters' ``.grad`` and the optimizer are untouched.

    Parameters
    ----------
    model : the model (its leaf modules with parameters are captured, like the Recorder's default).
    loss_fn : ``loss_fn(model(x), y)`` gives a scalar loss.
    x, y : one batch, on the model's device.
    amp_dtype : None for fp32, or a dtype for ``torch.amp.autocast`` around the forward.
    loss_scale : the loss is multiplied by this before the backward (as ``GradScaler.scale`` does).
    """
    if amp_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"amp_dtype: expected None, torch.float16 or torch.bfloat16, got {amp_dtype!r}")
    if not isinstance(loss_scale, (int, float)) or not 0 < loss_scale < float("inf"):
        raise ValueError(f"loss_scale: expected a positive finite number, got {loss_scale!r}")
    modules = _leaf_modules_with_params(model)
    outputs: dict = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, name=n: outputs.__setitem__(name, out))
             for n, m in modules]
    try:
        device_type = next(model.parameters()).device.type
        with torch.amp.autocast(device_type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            loss = loss_fn(model(x), y)
    finally:
        for h in hooks:
            h.remove()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = list(outputs)
    grads = torch.autograd.grad(loss * loss_scale, [outputs[n] for n in names] + [p for _, p in params],
                                allow_unused=True)
    acts = {n: g.detach() for n, g in zip(names, grads[:len(names)]) if g is not None}
    weights = {n: g.detach() for (n, _), g in zip(params, grads[len(names):]) if g is not None}
    return Gradients(acts, weights, float(loss.detach()), float(loss_scale))


def counts_of(tensors) -> np.ndarray:
    """(NBINS,) histogram of all values of ``tensors`` (a dict's values, a list, or one tensor)."""
    if isinstance(tensors, dict):
        tensors = list(tensors.values())
    elif isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    if not tensors:
        raise ValueError("tensors: expected at least one tensor")
    return H.histograms(tensors).sum(dim=0).cpu().numpy()


def smallest_log2_scale(counts, format="fp16", keep: float = 0.99, log2_range=(0, 64)) -> int | None:
    """Smallest integer ``s`` in ``log2_range`` at which at least ``keep`` of the non-zero values
    survive (are not flushed) when multiplied by ``2**s`` and cast to ``format``; None if none does.

    Overflow is not considered here: compare with :func:`largest_log2_scale`.
    """
    if not 0 < keep <= 1:
        raise ValueError(f"keep: expected a fraction in (0, 1], got {keep!r}")
    lo, hi = _range(log2_range)
    scales = np.arange(lo, hi + 1)
    t = H.fate_table(_pooled(counts), format, scales)
    nonzero = t["flushed"] + t["subnormal"] + t["normal"] + t["overflow"]
    ok = np.nonzero(t["flushed"] <= (1 - keep) * nonzero + 1e-9)[0]
    return int(scales[ok[0]]) if ok.size else None


def largest_log2_scale(counts, format="fp16", log2_range=(-64, 64)) -> int | None:
    """Largest integer ``s`` in ``log2_range`` at which no value overflows ``format`` after ``* 2**s``.

    Judged by whole binades: a value in ``format``'s top binade (fp16: (2**15, 2**16]) counts as
    finite, so the answer can be one too high only if a value times ``2**s`` lands in
    [65520, 65536]. None if even the smallest scale overflows (e.g. the values hold inf).
    """
    lo, hi = _range(log2_range)
    scales = np.arange(lo, hi + 1)
    t = H.fate_table(_pooled(counts), format, scales)
    ok = np.nonzero(t["overflow"] == 0)[0]
    return int(scales[ok[-1]]) if ok.size else None


def flushed_mass(tensors, log2_scales, format="fp16") -> np.ndarray:
    """Exact share of the gradient mass ``sum |g|`` whose values flush to 0 at each scale.

    Each tensor is multiplied by ``2**s`` and really cast to ``format``'s dtype; the flushed
    values' magnitudes are summed in float64. Returns an array of len(log2_scales).
    """
    fmt = get_format(format)
    if fmt.dtype is None:
        raise ValueError(f"format: {fmt.name} has no torch dtype to cast to")
    flat = torch.cat([t.detach().reshape(-1).float() for t in _as_list(tensors)])
    mag = flat.abs().double()
    total = float(mag.sum())
    out = []
    for s in log2_scales:
        flushed = ((flat * 2.0 ** int(s)).to(fmt.dtype) == 0) & (flat != 0)
        out.append(float(mag[flushed].sum()) / total if total > 0 else 0.0)
    return np.asarray(out)


def zero_share(counts) -> np.ndarray:
    """Share of exact zeros among all counted values (nan included), per row of ``counts`` (..., NBINS).

    0 for a row with no values. Unlike ``Fate.fraction``, the denominator is every value, zeros included.
    """
    c = H.as_counts(counts)
    total = c.sum(axis=-1)
    return np.divide(c[..., H.ZERO], total, out=np.zeros(total.shape), where=total > 0)


def median_log2(counts) -> np.ndarray:
    """Binade of the median non-zero magnitude, per row of ``counts`` (..., NBINS).

    Returns k (float) such that the median of the non-zero, non-nan |x| (the ceil(n/2)-th smallest,
    i.e. ``numpy.median`` for odd n, the lower middle value for even n) lies in (2**k, 2**(k+1)];
    -127 when it lies at or below 2**-126 (the "below" bin), 127 when above 2**127 or inf, and nan
    for a row without non-zero values.
    """
    c = H.as_counts(counts)
    rows = c.reshape(-1, H.NBINS)[:, H.BELOW:H.ABOVE + 1]          # below, the binades, above
    exps = np.concatenate([[H.K_MIN - 1], H.binade_exponents(), [H.K_MAX + 1]]).astype(float)
    total = rows.sum(axis=1)
    # the lower middle value: the ceil(n/2)-th smallest, 1-based
    at = np.argmax(rows.cumsum(axis=1) >= np.ceil(total / 2)[:, None], axis=1)
    return np.where(total > 0, exps[at], np.nan).reshape(c.shape[:-1])


def zero_fraction(run, kind: str = "activation", rank=None) -> np.ndarray:
    """(H,) share of exact zeros among the recorded values of ``kind`` at each histogram step.

    ``rank`` is a rank id (one of ``run.ranks``), the first rank by default. In an fp16 run, values the
    backward flushed are recorded as exact zeros; compare with an fp32 run of the same model to tell flushed values from
    values that were zero anyway.
    """
    if kind not in run.tensor_kinds:
        raise ValueError(f"kind: the run has no {kind!r} tensors; kinds: {sorted(set(run.tensor_kinds))}")
    return zero_share(run.pooled_counts("recorded", rank=rank, kind=kind))


def _pooled(counts) -> np.ndarray:
    return H.as_counts(counts).reshape(-1, H.NBINS).sum(axis=0)


def _range(log2_range) -> tuple:
    try:
        lo, hi = (int(v) for v in log2_range)
    except (TypeError, ValueError):
        raise ValueError(f"log2_range: expected (lo, hi) integers, got {log2_range!r}") from None
    if not -126 <= lo <= hi <= 126:
        raise ValueError(f"log2_range: expected -126 <= lo <= hi <= 126, got {log2_range!r}")
    return lo, hi


def _as_list(tensors) -> list:
    if isinstance(tensors, dict):
        return list(tensors.values())
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    out = list(tensors)
    if not out:
        raise ValueError("tensors: expected at least one tensor")
    return out


def static_scaler(device, scale: float = 2.0 ** 12) -> torch.amp.GradScaler:
    """A GradScaler used as a static loss scale: its growth interval is beyond any run's length.

    It still checks for inf/nan and would skip (and halve the scale) on an overflow, so a run
    that used it was truly static only if ``run.skipped`` is all False: check it.
    """
    if not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    device = torch.device(device)
    return torch.amp.GradScaler(device.type, init_scale=float(scale), growth_interval=2 ** 30)
