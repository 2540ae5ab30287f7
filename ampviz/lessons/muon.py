"""Muon's Newton–Schulz orthogonalisation, and what an autocast block around the optimizer step does to it.

``torch.optim.Muon`` turns each matrix's update into (roughly) the nearest orthogonal matrix with a few
Newton–Schulz steps, computed in bfloat16 (torch 2.13 ``optim/_muon.py``: ``grad.bfloat16()``, a division by the
norm, then matrix products). Those products are ops autocast casts, so a ``scaler.step(optimizer)`` inside an
fp16 autocast block runs them in float16 instead. :func:`newton_schulz` is the same iteration, with the
coefficients read from ``torch.optim.Muon``'s signature, in any dtype; in float64 it is the exact iteration that
both 16-bit versions approximate::

    >>> import torch
    >>> from ampviz.lessons.muon import newton_schulz, muon_update
    >>> g = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    >>> muon_update(g).dtype, muon_update(g, autocast_dtype=torch.float16).dtype
    (torch.bfloat16, torch.float16)
    >>> newton_schulz(g, torch.float64).dtype
    torch.float64

Used by lessons 04 (its appendix on Muon under autocast).
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["muon_defaults", "newton_schulz", "muon_update", "update_by_muon", "orthogonalization_errors"]


def muon_defaults() -> dict:
    """``ns_coefficients``, ``ns_steps`` and ``eps`` as the installed ``torch.optim.Muon`` defines them."""
    params = inspect.signature(torch.optim.Muon).parameters
    return {name: params[name].default for name in ("ns_coefficients", "ns_steps", "eps")}


def newton_schulz(grad: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Muon's Newton–Schulz iteration on a 2-D ``grad``, with its inputs cast to ``dtype`` first (Muon: bfloat16).

    Under an autocast block the products run in autocast's dtype, as they do inside ``Muon.step``.
    """
    if grad.ndim != 2:
        raise ValueError(f"grad: expected a 2-D matrix, got shape {tuple(grad.shape)}")
    d = muon_defaults()
    a, b, c = d["ns_coefficients"]
    x = grad.to(dtype)
    wide = grad.size(0) > grad.size(1)
    if wide:
        x = x.T
    x = x.div(x.norm().clamp(min=d["eps"]))           # spectral norm at most 1
    for _ in range(d["ns_steps"]):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


def muon_update(grad: torch.Tensor, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`newton_schulz` in bfloat16, as Muon runs it: outside autocast, or inside a block of
    ``autocast_dtype`` on the gradient's device."""
    with torch.amp.autocast(grad.device.type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
        return newton_schulz(grad, torch.bfloat16)


def update_by_muon(grad: torch.Tensor, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The update a real ``torch.optim.Muon`` step makes from ``grad`` (square, so Muon's lr adjustment is 1).

    The step starts from a zero weight with lr 1, no momentum and no weight decay, so the weight it leaves
    is minus the update; with ``autocast_dtype`` the step runs inside an autocast block of that dtype.
    """
    if grad.ndim != 2 or grad.size(0) != grad.size(1):
        raise ValueError(f"grad: expected a square matrix, got shape {tuple(grad.shape)}")
    weight = torch.nn.Parameter(torch.zeros_like(grad))
    weight.grad = grad.clone()
    opt = torch.optim.Muon([weight], lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0)
    with torch.amp.autocast(grad.device.type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
        opt.step()
    return -weight.detach()


def orthogonalization_errors(grads, autocast_dtype: torch.dtype = torch.float16) -> dict:
    """For each 2-D gradient: how far Muon's update (bfloat16 products) and the update inside an
    ``autocast_dtype`` block are from the exact (float64) iteration, and from each other.

    Returns
    -------
    dict of lists, one entry per gradient: "bfloat16" and "autocast" (relative Frobenius distance to the
    float64 iteration), "between" (the two 16-bit updates' distance, relative to the float64 one),
    "rounded input" (the float64 iteration started from the gradient rounded to bfloat16, as both 16-bit
    versions start: the share of the distance that the products' dtype cannot change).
    """
    out = {"bfloat16": [], "autocast": [], "between": [], "rounded input": []}
    for g in grads:
        exact = newton_schulz(g.double(), torch.float64)
        plain, cast = (muon_update(g, dt).double() for dt in (None, autocast_dtype))
        rounded = newton_schulz(g.bfloat16().double(), torch.float64)
        norm = exact.norm()
        out["bfloat16"].append(float((plain - exact).norm() / norm))
        out["autocast"].append(float((cast - exact).norm() / norm))
        out["between"].append(float((plain - cast).norm() / norm))
        out["rounded input"].append(float((rounded - exact).norm() / norm))
    return out
