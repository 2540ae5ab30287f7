"""Choosing what a Recorder watches: unwrapping what frameworks hand it, filters, module outputs.

Wrappers are unwrapped (DDP's ``.module``, torch.compile's ``_orig_mod``, accelerate's and
Lightning's optimizer and scheduler wrappers). By default the recorder watches every trainable
parameter and every leaf module with a trainable parameter of its own, except the ``out_proj`` of
an ``nn.MultiheadAttention``, which attention never calls (it uses the weight directly): the
attention module's output, the same tensor, is watched instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.nn as nn


def is_ddp(model) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def is_compile_wrapper(module) -> bool:
    """``torch.compile(m)``'s wrapper (an ``OptimizedModule`` holding ``m`` as ``_orig_mod``)."""
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module)


def is_compiled(module) -> bool:
    """A module that runs under torch.compile: ``torch.compile(m)``'s wrapper, ``m.compile()``, or a forward
    replaced by a compiled one (``m.forward = torch.compile(m.forward)``; what Lightning does to a compiled
    LightningModule given to ``trainer.fit``)."""
    if is_compile_wrapper(module) or getattr(module, "_compiled_call_impl", None) is not None:
        return True
    forward = vars(module).get("forward") if hasattr(module, "__dict__") else None
    return forward is not None and hasattr(forward, "_torchdynamo_orig_callable")


def unwrap_model(model: nn.Module):
    """(the module whose parameters train, its DDP wrapper or None, whether it runs compiled)."""
    ddp, compiled = None, False
    while True:
        if is_ddp(model):
            ddp, model = model, model.module
        elif is_compile_wrapper(model):
            compiled, model = True, model._orig_mod
        else:
            return model, ddp, compiled or is_compiled(model)


def unwrap_optimizer(optimizer):
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (``.optimizer``) or Lightning's
    ``LightningOptimizer`` (``._optimizer``); its step hooks are the ones that fire."""
    if optimizer is None:
        return None
    for _ in range(8):
        inner = next((getattr(optimizer, a) for a in ("optimizer", "_optimizer")
                      if isinstance(getattr(optimizer, a, None), torch.optim.Optimizer)), None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer (or a wrapper holding one in .optimizer, "
                        f"such as accelerate's AcceleratedOptimizer or Lightning's LightningOptimizer) or None, "
                        f"got {type(optimizer).__name__}")
    if not hasattr(optimizer, "_optimizer_step_pre_hooks"):
        raise TypeError(f"optimizer: {type(optimizer).__name__} subclasses torch.optim.Optimizer but never ran "
                        f"Optimizer.__init__, so it has no step hooks; pass the optimizer it wraps")
    return optimizer


def unwrap_scheduler(scheduler):
    """The LR scheduler itself (accelerate's ``AcceleratedScheduler`` keeps it in ``.scheduler``)."""
    if scheduler is None:
        return None
    inner = getattr(scheduler, "scheduler", None)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and isinstance(
            inner, torch.optim.lr_scheduler.LRScheduler):
        scheduler = inner
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(f"scheduler: expected a torch.optim.lr_scheduler.LRScheduler (StepLR, LambdaLR, "
                        f"OneCycleLR, ReduceLROnPlateau, ...) or None, got {type(scheduler).__name__}")
    return scheduler


def dist_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def clean_name(name: str) -> str:
    """A name without torch.compile's ``_orig_mod`` segments (a compiled submodule keeps its own name)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def named_parameters(model) -> list:
    return [(clean_name(n), p) for n, p in model.named_parameters()]


def named_modules(model) -> list:
    return [(clean_name(n), m) for n, m in model.named_modules() if not is_compile_wrapper(m)]


def compiled_modules(model) -> set:
    """ids of the modules that run inside a torch.compile region."""
    inside = set()
    for _, m in model.named_modules():
        if is_compiled(m):
            inside.update(id(s) for s in m.modules())
    return inside


def first_tensor(output, grad: bool):
    """The first floating-point tensor of a module's output (a tensor, or a tuple, list, dict or
    ``ModelOutput`` of them, in order); with ``grad``, the first one that requires grad."""
    if isinstance(output, torch.Tensor):
        if output.is_floating_point() and (output.requires_grad or not grad):
            return output
        return None
    if isinstance(output, Mapping):
        output = output.values()
    elif not isinstance(output, (tuple, list)):
        return None
    for o in output:
        t = first_tensor(o, grad)
        if t is not None:
            return t
    return None


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


def select(items, spec, argname: str, default) -> list:
    """Apply a True / False / regex / list-of-names / callable filter to (name, parameter or module)."""
    items = list(items)
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


def first_grad_tensor(output):
    return first_tensor(output, grad=True)
