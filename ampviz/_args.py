"""Argument checks shared by the whole package: one wording for every error.

Errors name the argument, the value given and what would be valid::

    >>> from ampviz._args import check_int
    >>> check_int("every", 4, low=1)
    4
    >>> check_int("every", 0, low=1)
    Traceback (most recent call last):
    ...
    ValueError: every: expected an integer >= 1, got 0
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["check_int", "check_choice", "resolve_device"]


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int if it is an integer (not a bool) within [low, high]; else a ValueError."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok and ((low is not None and value < low) or (high is not None and value > high)):
        ok = False
    if not ok:
        if low is not None and high is not None:
            valid = f"from {low} to {high}"
        elif low is not None:
            valid = f">= {low}"
        elif high is not None:
            valid = f"<= {high}"
        else:
            valid = ""
        raise ValueError(f"{name}: expected an integer {valid}".rstrip() + f", got {value!r}")
    return int(value)


def check_choice(name: str, value, choices) -> object:
    """``value`` if it is one of ``choices``; else a ValueError listing them."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def resolve_device(device="auto") -> torch.device:
    """``"auto"`` -> cuda when torch sees a GPU, else cpu; ``"cpu"``; ``"cuda"`` (error without a GPU);
    a ``torch.device`` is returned as it is."""
    if isinstance(device, torch.device):
        return device
    check_choice("device", device, ("auto", "cpu", "cuda"))
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but torch sees no CUDA device; use 'cpu' or 'auto'")
    return torch.device(device)
