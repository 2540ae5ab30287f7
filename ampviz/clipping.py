"""Gradient clipping under a loss scale: what ``clip_grad_norm_`` does before and after ``unscale_``.

With a ``GradScaler`` the gradients in ``.grad`` after ``backward()`` are multiplied by the loss
scale ``S``. Clipping them there compares ``S * ||g||`` with ``max_norm``, so the clip fires far too
early and, once ``scaler.step`` divides by ``S``, the optimizer receives a gradient of norm
``max_norm / S``. Calling ``scaler.unscale_(optimizer)`` first makes the clip act on the true
gradient. :func:`clipped_norm` replays both orders on real gradients with the real
``torch.nn.utils.clip_grad_norm_``::

    >>> import torch
    >>> from ampviz.clipping import clipped_norm
    >>> g = [torch.full((4,), 0.5)]                          # true norm 1.0
    >>> round(clipped_norm(g, max_norm=0.5, log2_scale=16, order="unscale first"), 6)
    0.5
    >>> clipped_norm(g, max_norm=0.5, log2_scale=16, order="clip first") * 2**16     # 0.5 / 2**16
    0.5

(``clip_grad_norm_`` divides by ``norm + 1e-6``, so a clipped norm is a hair below ``max_norm``.)
"""

from __future__ import annotations

import math

import torch

__all__ = ["ORDERS", "clipped_norm", "clipped_norms", "total_norm"]

ORDERS = ("unscale first", "clip first")


def total_norm(grads) -> float:
    """The L2 norm of all gradients together (what ``clip_grad_norm_`` computes)."""
    grads = _check_grads(grads)
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def clipped_norm(grads, max_norm: float, log2_scale: int, order: str) -> float:
    """Norm, in true (unscaled) units, of the gradient the optimizer steps with after clipping.

    Parameters
    ----------
    grads : the true gradients (a tensor or a list of tensors), e.g. read after ``unscale_``.
    max_norm : ``clip_grad_norm_``'s threshold.
    log2_scale : the loss scale is ``2**log2_scale`` (as GradScaler's default scales are).
    order : "unscale first" (``scaler.unscale_`` then clip: right) or "clip first" (clip the scaled
        gradients, let ``scaler.step`` unscale them afterwards: wrong).
    """
    grads = _check_grads(grads)
    if not (isinstance(max_norm, (int, float)) and max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"max_norm: expected a positive finite number, got {max_norm!r}")
    if isinstance(log2_scale, bool) or not isinstance(log2_scale, int) or not -60 <= log2_scale <= 60:
        raise ValueError(f"log2_scale: expected an integer in [-60, 60], got {log2_scale!r}")
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    scale = 2.0 ** log2_scale
    holders = []
    for g in grads:                          # stand-in parameters whose .grad is as backward left it
        p = torch.zeros_like(g, dtype=torch.float32, requires_grad=True)
        p.grad = g.detach().float() * scale
        holders.append(p)
    if order == "unscale first":
        for p in holders:
            p.grad.mul_(1.0 / scale)         # what scaler.unscale_ does
        torch.nn.utils.clip_grad_norm_(holders, max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(holders, max_norm)
        for p in holders:
            p.grad.mul_(1.0 / scale)         # what scaler.step does when unscale_ was not called
    return total_norm([p.grad for p in holders])


def clipped_norms(grads, max_norms, log2_scale: int) -> dict:
    """:func:`clipped_norm` for every ``max_norm`` and both orders: ``{order: [norm, ...]}``."""
    return {order: [clipped_norm(grads, float(m), log2_scale, order) for m in max_norms] for order in ORDERS}


def _check_grads(grads) -> list:
    if isinstance(grads, torch.Tensor):
        grads = [grads]
    grads = [g for g in grads if g is not None]
    if not grads or not all(isinstance(g, torch.Tensor) and g.is_floating_point() for g in grads):
        raise TypeError("grads: expected a floating-point tensor or a non-empty list of them")
    return grads
