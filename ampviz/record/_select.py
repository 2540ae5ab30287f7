"""Choosing what a Recorder watches: names, filters and the default modules.

By default the recorder watches every trainable parameter and every leaf module with a trainable
parameter of its own, except the ``out_proj`` of an ``nn.MultiheadAttention``, which attention never
calls (it uses the weight directly): the attention module's output, the same tensor, is watched instead::

    select(named_parameters(model), "weight$", "weights", default=trainable_param)
"""

from __future__ import annotations

import re

import torch.nn as nn

from ._unwrap import is_compile_wrapper


def clean_name(name: str) -> str:
    """A name without torch.compile's ``_orig_mod`` segments (a compiled submodule keeps its own name)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def named_parameters(model) -> list:
    return [(clean_name(n), p) for n, p in model.named_parameters()]


def named_modules(model) -> list:
    return [(clean_name(n), m) for n, m in model.named_modules() if not is_compile_wrapper(m)]


def trainable_param(name, p) -> bool:
    return p.requires_grad


def default_modules(model):
    """Predicate of the default module choice: leaves with a trainable parameter of their own, and each
    ``nn.MultiheadAttention`` in place of its never-called ``out_proj``."""
    out_projs = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}

    def pick(name, m):
        if isinstance(m, nn.MultiheadAttention):
            return any(p.requires_grad for p in m.parameters())
        return (name != "" and id(m) not in out_projs and not list(m.children())
                and any(p.requires_grad for p in m.parameters(recurse=False)))
    return pick


def attention_in_place_of_out_proj(model, chosen: list, argname: str) -> tuple[list, list]:
    """``chosen`` (name, module) with every MultiheadAttention ``out_proj`` replaced by its attention module;
    also the names that were replaced."""
    owner = {id(m.out_proj): (n, m) for n, m in named_modules(model) if isinstance(m, nn.MultiheadAttention)}
    result, replaced, names = [], [], set()
    for n, m in chosen:
        if id(m) in owner:
            replaced.append(n)
            n, m = owner[id(m)]
        if n not in names:
            names.add(n)
            result.append((n, m))
    return result, replaced


def check_filter(spec, argname: str) -> None:
    """A filter's type, and a regex's syntax: what can be checked without the model."""
    if spec is None or isinstance(spec, bool) or callable(spec) or isinstance(spec, (list, tuple, set)):
        return
    if not isinstance(spec, str):
        raise TypeError(f"{argname}: expected True, False, a regex string, a list of names or a callable, "
                        f"got {type(spec).__name__}")
    try:
        re.compile(spec)
    except re.error as e:
        raise ValueError(f"{argname}: invalid regular expression {spec!r}: {e}") from None


def select(items, spec, argname: str, default) -> list:
    """Apply a True / False / regex / list-of-names / callable filter to (name, parameter or module)."""
    items = list(items)
    check_filter(spec, argname)
    if spec is False or spec is None:
        return []
    if spec is True:
        return [(n, x) for n, x in items if default(n, x)]
    if isinstance(spec, str):
        pattern = re.compile(spec)
        chosen = [(n, x) for n, x in items if n and pattern.search(n)]
    elif callable(spec):
        chosen = [(n, x) for n, x in items if spec(n, x)]
    elif isinstance(spec, (list, tuple, set)):
        names = {n for n, _ in items}
        unknown = [s for s in spec if s not in names]
        if unknown:
            raise ValueError(f"{argname}: no such names {unknown[:5]}; known: {sorted(names)[:8]} ...")
        chosen = [(n, x) for n, x in items if n in set(spec)]
    if not chosen:
        raise ValueError(f"{argname}: the filter {spec!r} matches nothing in the model")
    return chosen
