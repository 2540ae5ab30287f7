"""What rounding does to a weight update and to a running sum held in a low-precision format.

An optimizer step computes ``w + update``; when ``w`` is stored in fp16 or bf16 the exact sum is
rounded back to the format, and an update no larger than half the spacing (ulp) around ``w`` is
rounded away: the weight does not move. A long running sum kept in the format stalls the same
way once the sum is large enough. Every result here is a single round-to-nearest-even of the
exact sum (what ``torch`` does for one fp16/bf16 addition), computed with
:meth:`ampviz.formats.Format.round`::

    >>> from ampviz.lessons.rounding import add_in
    >>> r = add_in(1.0, 4e-4, "fp16")        # half an fp16 ulp at 1.0 is 2**-11 ~ 4.9e-4
    >>> r.stored, r.lost
    (1.0, True)
    >>> add_in(1.0, 4e-4, "fp32").lost
    False
    >>> from ampviz.lessons.rounding import running_sum
    >>> float(running_sum([0.01] * 1000, "bf16")[-1])  # stalls at 4 (exact sum ~ 10)
    4.0

The figure and the ``UpdateExplorer`` that show one update live in :mod:`ampviz.lessons.master_weights`.

Used by lessons 07 (master weights) and 08 (bf16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .._args import check_int
from ..formats import _as_float, get_format

__all__ = ["Addition", "add_in", "neighbours", "lost_fraction", "running_sum", "stall_value", "compensated_sum"]


@dataclass(frozen=True)
class Addition:
    """One addition ``w + update`` done in a format (both operands rounded to it first).

    ``requested`` is the update as asked for, ``w`` and ``update`` the operands after rounding to
    the format, ``exact`` their exact sum, ``stored`` the sum rounded to the format, ``ulp`` the
    spacing above ``|w|``; ``applied`` is the change the weight really sees (``stored - w``) and
    ``moved_ulps`` that change in units of ``ulp``.
    """

    format: str
    requested: float
    w: float
    update: float
    exact: float
    stored: float
    ulp: float

    @property
    def applied(self) -> float:
        return self.stored - self.w

    @property
    def lost(self) -> bool:
        """The weight did not move although the requested update was not zero."""
        return self.stored == self.w and self.update != 0.0

    @property
    def update_underflowed(self) -> bool:
        """The update itself rounded to zero in the format (before any addition)."""
        return self.update == 0.0

    @property
    def moved_ulps(self) -> float:
        return self.applied / self.ulp if self.ulp else math.nan

    @property
    def relative_error(self) -> float:
        """(applied - requested) / requested: -1 when the update is lost, 0 when applied exactly."""
        return (self.applied - self.requested) / self.requested if self.requested else math.nan


def add_in(w, update, format) -> Addition:
    """``w + update`` computed in ``format``: round both operands, add exactly, round once.

    Parameters
    ----------
    w, update : numbers (Python, numpy or one-element tensors).
    format : a format name ("fp16", "bf16", "fp32", ...), torch dtype or Format.

    Returns
    -------
    Addition
    """
    fmt = get_format(format)
    w_in, u_in = _as_float(w, "w"), _as_float(update, "update")
    if not (math.isfinite(w_in) and math.isfinite(u_in)):
        raise ValueError(f"w, update: expected finite numbers, got w={w_in!r}, update={u_in!r}")
    w_r, u_r = fmt.round(w_in), fmt.round(u_in)
    exact = w_r + u_r                     # exact in float64: both have at most 24 significant bits
    return Addition(fmt.name, u_in, w_r, u_r, exact, fmt.round(exact), fmt.ulp(w_r))


def neighbours(w, format, n: int = 4) -> np.ndarray:
    """The ``2n + 1`` representable values centred on ``w`` rounded to ``format`` (ascending)."""
    fmt = get_format(format)
    check_int("n", n, 1, 64)
    centre = fmt.round(_as_float(w, "w"))
    if not math.isfinite(centre):
        raise ValueError(f"w: {w!r} is not finite in {fmt.name}")
    below, above, v = [], [], centre
    for _ in range(n):
        v = fmt.next_down(v)
        below.append(v)
    v = centre
    for _ in range(n):
        v = fmt.next_up(v)
        above.append(v)
    return np.array(below[::-1] + [centre] + above)


def lost_fraction(before, after, grads) -> float:
    """Share of the elements with a non-zero gradient whose value did not change in a step.

    Parameters
    ----------
    before, after : sequences of tensors (parameters before and after ``optimizer.step()``).
    grads : the gradients the step used, same shapes.
    """
    before, after, grads = list(before), list(after), list(grads)
    if not (len(before) == len(after) == len(grads)) or not before:
        raise ValueError(f"before, after, grads: expected equally long non-empty sequences, got lengths "
                         f"{len(before)}, {len(after)}, {len(grads)}")
    moved_to_check, unchanged = 0, 0
    for i, (b, a, g) in enumerate(zip(before, after, grads)):
        if not (b.shape == a.shape == g.shape):
            raise ValueError(f"tensor {i}: shapes differ: before {tuple(b.shape)}, after {tuple(a.shape)}, "
                             f"grad {tuple(g.shape)}")
        asked = g != 0
        moved_to_check += int(asked.sum())           # note: a host sync per tensor (lesson use only)
        unchanged += int((asked & (a == b)).sum())
    return unchanged / moved_to_check if moved_to_check else 0.0


def running_sum(increments, format, start: float = 0.0) -> np.ndarray:
    """Partial sums ``s_k = round(s_{k-1} + round(x_k))``, every one rounded to ``format``.

    This is a running total kept in the format, as a low-precision accumulator or a weight
    receiving one update per step. (``torch.sum`` of a bf16 tensor is *not* this: it accumulates
    in float32 internally and rounds only the result.)
    """
    fmt = get_format(format)
    if isinstance(increments, torch.Tensor):
        increments = increments.detach().double().cpu().numpy()
    x = np.asarray(increments, dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("increments: expected at least one value")
    if not np.all(np.isfinite(x)):
        raise ValueError("increments: expected finite values")
    unique, inverse = np.unique(x, return_inverse=True)
    rounded = np.array([fmt.round(float(v)) for v in unique])[inverse]      # each increment, in the format
    out = np.empty(x.size)
    s = fmt.round(_as_float(start, "start"))
    for k, v in enumerate(rounded.tolist()):
        s = fmt.round(s + v)
        out[k] = s
    return out


def stall_value(increment, format) -> float:
    """The running sum at which adding ``increment`` (> 0) no longer changes it, in ``format``.

    Found by walking the representable values upward from 0 the way a running sum does, one
    binade at a time (so fp32 is as quick as fp16).
    """
    fmt = get_format(format)
    inc = fmt.round(_as_float(increment, "increment"))
    if not inc > 0 or not math.isfinite(inc):
        raise ValueError(f"increment: expected a positive number representable in {fmt.name} "
                         f"(it rounds to {inc!r})")
    s = 0.0
    while True:
        nxt = fmt.round(s + inc)
        if nxt == s or math.isinf(nxt):
            return s
        step, step_after = nxt - s, fmt.round(nxt + inc) - nxt
        if step == step_after:           # constant from here to the end of the binade: jump there
            top = math.ldexp(1.0, math.frexp(nxt)[1])
            nxt += max(int((top - nxt) // step) - 1, 0) * step
        s = nxt


def compensated_sum(start, increment, n: int, dtype=torch.float16) -> float:
    """``start`` plus ``n`` times ``increment``, kept in ``dtype`` with compensated (Kahan) summation.

    A second tensor of the same dtype carries the part of each addition that rounding dropped and
    feeds it into the next one, so a weight updated in 16 bits still collects updates smaller than
    half an ulp. Done with real torch arithmetic in ``dtype``; returns the final value.
    """
    check_int("n", n, 1)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: expected torch.float16, torch.bfloat16 or torch.float32, got {dtype!r}")
    total = torch.tensor(_as_float(start, "start"), dtype=dtype)
    step = torch.tensor(_as_float(increment, "increment"), dtype=dtype)
    carry = torch.zeros((), dtype=dtype)          # what the additions so far rounded away, with its sign
    for _ in range(n):
        corrected = step - carry
        new = total + corrected
        carry = (new - total) - corrected
        total = new
    return float(total)
