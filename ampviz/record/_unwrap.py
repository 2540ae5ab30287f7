"""Unwrapping what frameworks hand a Recorder, and telling where torch.compile runs.

Wrappers are unwrapped (DDP's ``.module``, torch.compile's ``_orig_mod``, accelerate's and
Lightning's optimizer and scheduler wrappers)::

    model, ddp, compiled = unwrap_model(torch.compile(DDP(net)))   # net, the DDP wrapper, True
"""

from __future__ import annotations

from typing import Any

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


def unwrap_model(model: Any):
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


def compiled_modules(model) -> set:
    """ids of the modules that run inside a torch.compile region."""
    inside: set[int] = set()
    for _, m in model.named_modules():
        if is_compiled(m):
            inside.update(id(s) for s in m.modules())
    return inside
