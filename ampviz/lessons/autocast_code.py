"""Autocast in your own code: custom autograd Functions with ``torch.amp.custom_fwd`` / ``custom_bwd``, and
autocast across threads (``nn.DataParallel``'s replicas).

``custom_matmul`` builds a matrix product as a custom ``torch.autograd.Function`` with or without the ``torch.amp``
decorators, and ``trace_custom_function`` reports the dtypes its forward and backward ran in (or the error the
backward raised)::

    >>> from ampviz.lessons.autocast_code import trace_custom_function
    >>> trace_custom_function("custom_fwd(cast_inputs=float32) + custom_bwd", backward_inside=True)["backward mm"]
    ['float32, float32', 'float32, float32']

``parallel_apply_autocast_call`` reads how the installed torch's ``parallel_apply`` enters autocast in a replica's
thread, and ``autocast_in_threads`` runs a module in new threads to show what they inherit.

Used by lessons 04b (autocast in your own code).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import threading

import torch

from .autocast_ops import OpLog

__all__ = ["CUSTOM_VARIANTS", "VARIANTS", "custom_matmul", "trace_custom_function", "parallel_apply_autocast_call",
           "autocast_in_threads"]

CUSTOM_VARIANTS = ("plain", "custom_fwd(cast_inputs=float32)", "custom_fwd(cast_inputs=float32) + custom_bwd",
                   "custom_fwd + custom_bwd")
# every variant custom_matmul builds; "custom_fwd" alone (no custom_bwd) is left out of lesson 04b's table for an
# exercise to ask about
VARIANTS = CUSTOM_VARIANTS + ("custom_fwd",)


def custom_matmul(variant: str, device_type: str = "cpu"):
    """``a @ b`` as a custom autograd Function, decorated as ``variant`` (one of ``VARIANTS``).

    The forward saves its inputs as it receives them and the backward multiplies them with the
    incoming gradient, as a hand-written Function would.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")

    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad @ b.t(), a.t() @ grad

    if variant != "plain":
        cast = torch.float32 if "cast_inputs" in variant else None
        forward = torch.amp.custom_fwd(forward, device_type=device_type, cast_inputs=cast)
    if variant.endswith("custom_bwd"):
        backward = torch.amp.custom_bwd(backward, device_type=device_type)
    return type("MatMul", (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                       "backward": staticmethod(backward)})


def trace_custom_function(variant: str, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                          backward_inside: bool = False, seed: int = 0) -> dict:
    """Apply :func:`custom_matmul` to a 16-bit activation and an fp32 weight under autocast.

    Returns the output dtype, the input dtypes of the forward's and the backward's ``mm`` ops, and
    the error the backward raised (None when it ran).
    """
    gen = torch.Generator().manual_seed(seed)
    x, w0 = torch.randn(8, 16, generator=gen).to(device), torch.randn(16, 16, generator=gen).to(device)
    w = torch.randn(16, 16, generator=gen).to(device).requires_grad_()
    fn, error = custom_matmul(variant, torch.device(device).type), None
    with OpLog() as tracer:
        with torch.amp.autocast(torch.device(device).type, dtype=dtype):
            h = x @ w0                                          # a 16-bit activation, (8, 16)
            out = fn.apply(h, w)
            loss = out.float().sum()
            if backward_inside:
                error = _backward(loss, tracer)
        if not backward_inside:
            error = _backward(loss, tracer)
    def mm(phase):
        return [", ".join(r.input_dtypes) for r in tracer.records if r.op == "mm" and r.phase == phase]

    return {"output": str(out.dtype).removeprefix("torch."),
            "forward mm": mm("forward")[1:],                    # the first is h = x @ w0, outside the Function
            "backward mm": mm("backward"), "error": error}


def _backward(loss, tracer):
    try:
        with tracer.phase("backward"):
            loss.backward()
    except RuntimeError as err:
        return str(err).split("\n")[0]
    return None


def parallel_apply_autocast_call() -> str:
    """The ``torch.amp.autocast(...)`` call with which the installed torch's ``nn.parallel.parallel_apply`` (what
    ``nn.DataParallel`` runs each replica with, one thread per GPU) enters autocast in a replica's thread."""
    import torch.nn.parallel.parallel_apply as module
    found = re.search(r"torch\.amp\.autocast\([^()]*\)", inspect.getsource(module))
    if found is None:
        raise RuntimeError("torch.nn.parallel.parallel_apply no longer calls torch.amp.autocast(...): "
                           "what DataParallel's replicas inherit has changed in this torch")
    return " ".join(found.group(0).split())


def autocast_in_threads(module, x, dtype: torch.dtype) -> dict:
    """``module(x)``'s output dtype under ``autocast(x.device.type, dtype=dtype)``: in the caller, in a new plain
    thread, and in a new thread that enters autocast with only the caller's *enabled* flag, as
    ``parallel_apply`` does (see :func:`parallel_apply_autocast_call`). Each thread runs its own copy of the
    module, as each DataParallel replica does.

    Autocast's state (enabled flag and dtype) is thread-local: a new thread starts from the defaults.
    """
    device_type, results, errors = x.device.type, {}, []

    def run(name, enabled=None):
        try:
            with torch.no_grad(), torch.amp.autocast(device_type, enabled=bool(enabled)) if enabled is not None \
                    else contextlib.nullcontext():
                results[name] = copy.deepcopy(module)(x).dtype
        except Exception as err:                    # re-raised in the caller below
            errors.append(err)

    with torch.no_grad(), torch.amp.autocast(device_type, dtype=dtype):
        results["caller"] = module(x).dtype
        enabled = torch.is_autocast_enabled(device_type)
        for args in (("new thread",), ("new thread + the caller's enabled flag", enabled)):
            thread = threading.Thread(target=run, args=args)
            thread.start()
            thread.join()
    if errors:
        raise errors[0]
    return results
