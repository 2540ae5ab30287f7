"""Choosing what a Recorder watches: parameter/module filters, DDP unwrapping, module outputs."""

from __future__ import annotations

import re

import torch
import torch.nn as nn


def is_ddp(model) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def dist_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def first_grad_tensor(output):
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad and output.is_floating_point() else None
    if isinstance(output, (tuple, list)):
        for o in output:
            t = first_grad_tensor(o)
            if t is not None:
                return t
    return None


def select(named, spec, argname: str, default) -> list:
    """Apply a True / False / regex / list-of-names / callable filter to named parameters or modules."""
    items = list(named)
    if spec is False or spec is None:
        return []
    if spec is True:
        return [(n, x) for n, x in items if default(n, x)]
    if isinstance(spec, str):
        try:
            pattern = re.compile(spec)
        except re.error as e:
            raise ValueError(f"{argname}: invalid regular expression {spec!r}: {e}") from None
        chosen = [(n, x) for n, x in items if n and pattern.search(n)]
    elif callable(spec):
        chosen = [(n, x) for n, x in items if spec(n, x)]
    elif isinstance(spec, (list, tuple, set)):
        names = {n for n, _ in items}
        unknown = [s for s in spec if s not in names]
        if unknown:
            raise ValueError(f"{argname}: no such names {unknown[:5]}; known: {sorted(names)[:8]} ...")
        chosen = [(n, x) for n, x in items if n in set(spec)]
    else:
        raise TypeError(f"{argname}: expected True, False, a regex string, a list of names or a callable, "
                        f"got {type(spec).__name__}")
    if not chosen:
        raise ValueError(f"{argname}: the filter {spec!r} matches nothing in the model")
    return chosen
