"""What DDP's gradient all-reduce actually sends: dtypes and bytes per bucket, counted live.

DDP groups gradients into buckets and all-reduces each bucket's flat buffer, in the gradients'
dtype. Under autocast the parameters and therefore their gradients are fp32, so the bytes on the
wire do not halve unless a communication hook compresses the buckets (for example
``fp16_compress_hook``). This module runs real DDP backward passes and counts what is handed to
``torch.distributed.all_reduce``::

    >>> import torch
    >>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    >>> from ampviz.lessons.comm import ddp_allreduce_bytes
    >>> from ampviz.lessons.models import MLP
    >>> model, x, y = MLP(64, 128, 2, 10), torch.randn(32, 64), torch.randint(0, 10, (32,))
    >>> loss_fn = torch.nn.functional.cross_entropy
    >>> plain = ddp_allreduce_bytes(model, x, y, loss_fn, autocast_dtype=torch.bfloat16)
    >>> packed = ddp_allreduce_bytes(model, x, y, loss_fn, autocast_dtype=torch.bfloat16,
    ...                              hook=fp16_compress_hook)
    >>> plain.sent_dtypes, packed.sent_dtypes, packed.sent_bytes * 2 == plain.sent_bytes
    (['float32'], ['float16'], True)

DDP averages: its reducer and ``allreduce_hook`` divide each bucket by the world size *before* the
all-reduce (torch's ``default_hooks._allreduce_fut``: "Apply the division first to avoid overflow").
``fp16_compress_hook`` casts each bucket to fp16 first and divides afterwards, so under a
``GradScaler`` a scaled gradient that fp32 (or bf16) holds but fp16 does not overflows in the cast,
and the scaler skips the step; :func:`ddp_scaled_steps` shows it, and how the scaler backs off.

When no process group exists, a one-process group (gloo on CPU, nccl on CUDA) is created on a
temporary file store and destroyed afterwards; inside an existing group (e.g. under torchrun)
that group is used and left alone.

Used by lessons 02b (what DDP sends, and what 16 bits cost), 11 (DDP + AMP training) and
appendix_compression_hooks.
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["AllReduceLog", "DDPBytes", "counting_hook", "ddp_allreduce_bytes", "ddp_scaled_steps", "one_process_group"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class AllReduceLog:
    """Per bucket: what DDP handed the hook, and what the hook handed ``all_reduce``."""

    bucket_dtypes: list = field(default_factory=list)   # dtype name of each bucket buffer
    bucket_bytes: list = field(default_factory=list)
    sent_dtypes: list = field(default_factory=list)     # dtype name of each all-reduced tensor
    sent_bytes: list = field(default_factory=list)
    bucket_amax: list = field(default_factory=list)     # largest |value| of each bucket buffer (a host sync)


def counting_hook(hook, log: AllReduceLog):
    """Wrap a DDP communication hook so that every tensor it all-reduces is logged in ``log``.

    While the wrapped hook runs, ``torch.distributed.all_reduce`` is replaced by a recorder that
    logs the tensor's dtype and bytes and then calls the real function; it is restored as soon
    as the hook returns. Torch's default hooks look ``all_reduce`` up on the module at call
    time, so this sees exactly what they send.
    """
    if not callable(hook):
        raise TypeError(f"hook: expected a DDP communication hook (state, bucket) -> Future, got {hook!r}")

    def wrapped(state, bucket):
        buffer = bucket.buffer()
        log.bucket_dtypes.append(_dtype_name(buffer.dtype))
        log.bucket_bytes.append(buffer.numel() * buffer.element_size())
        log.bucket_amax.append(float(buffer.abs().max()))
        real = dist.all_reduce

        def recording_all_reduce(tensor, *args, **kwargs):
            log.sent_dtypes.append(_dtype_name(tensor.dtype))
            log.sent_bytes.append(tensor.numel() * tensor.element_size())
            return real(tensor, *args, **kwargs)

        dist.all_reduce = recording_all_reduce
        try:
            return hook(state, bucket)
        finally:
            dist.all_reduce = real

    return wrapped


@contextlib.contextmanager
def one_process_group(device_type: str = "cpu"):
    """A world_size=1 process group on a temporary FileStore, destroyed on exit.

    Yields False and does nothing when a default group already exists (it is reused).
    """
    if dist.is_initialized():
        yield False
        return
    backend = "nccl" if device_type == "cuda" and dist.is_nccl_available() else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            yield True
        finally:
            dist.destroy_process_group()


@dataclass
class DDPBytes:
    """One DDP backward pass: gradient dtypes, and what the all-reduce carried (bytes summed over buckets)."""

    grad_dtypes: list
    bucket_dtypes: list
    sent_dtypes: list
    bucket_bytes: int
    sent_bytes: int
    n_buckets: int
    bucket_sizes: list = field(default_factory=list)   # bytes of each bucket, in the order DDP reduced them
    bucket_cap_bytes: int = 0                           # the DDP instance's ``bucket_bytes_cap``
    grads: list = field(default_factory=list)          # each parameter's gradient after the all-reduce
    first_pass_buckets: int = 0                         # buckets of the first backward (before DDP rebuilds them)


def ddp_allreduce_bytes(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn, *,
                        hook=None, autocast_dtype: torch.dtype | None = None,
                        bucket_cap_mb: int | None = None) -> DDPBytes:
    """Run DDP forward/backward passes on a copy of ``model`` and count the all-reduced bytes.

    Two passes run and the second is reported: DDP (with its default ``find_unused_parameters=False``) puts
    every gradient in one bucket on the first backward and rebuilds the buckets (``bucket_cap_mb``) in the
    order the gradients became ready before the next forward; ``first_pass_buckets`` counts the first pass's.

    Parameters
    ----------
    model : the module (deep-copied, moved to ``inputs.device``; the caller's model is untouched).
    inputs, targets, loss_fn : one batch and ``loss_fn(outputs, targets) -> scalar``.
    hook : a DDP communication hook; None means ``allreduce_hook``, the Python spelling of
        DDP's default (divide each bucket by the world size, then all-reduce it).
    autocast_dtype : None for fp32, or the dtype for ``torch.amp.autocast`` around the forward.
    bucket_cap_mb : DDP's bucket size limit in MiB (None: its default, 25 MiB after a 1 MiB first bucket).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if autocast_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"autocast_dtype: expected None, torch.float16 or torch.bfloat16, got {autocast_dtype!r}")
    device = inputs.device
    log = AllReduceLog()
    with one_process_group(device.type):
        local = copy.deepcopy(model).to(device)
        ddp = DistributedDataParallel(local, device_ids=[device] if device.type == "cuda" else None,
                                      bucket_cap_mb=bucket_cap_mb)
        ddp.register_comm_hook(None, counting_hook(hook or allreduce_hook, log))
        first_pass_buckets = 0
        for _ in range(2):   # DDP uses one bucket on the first backward, then rebuilds them by size
            first_pass_buckets = first_pass_buckets or len(log.bucket_bytes)
            for entries in (log.bucket_dtypes, log.bucket_bytes, log.sent_dtypes, log.sent_bytes):
                entries.clear()
            local.zero_grad(set_to_none=True)
            with torch.amp.autocast(device.type, dtype=autocast_dtype or torch.bfloat16,
                                    enabled=autocast_dtype is not None):
                loss = loss_fn(ddp(inputs), targets)
            loss.backward()
        grads = [p.grad.detach().clone() for p in local.parameters() if p.grad is not None]
        cap = ddp.bucket_bytes_cap
        del ddp   # release DDP's reducer before the group goes away
    return DDPBytes(sorted({_dtype_name(g.dtype) for g in grads}), sorted(set(log.bucket_dtypes)),
                    sorted(set(log.sent_dtypes)), sum(log.bucket_bytes), sum(log.sent_bytes), len(log.bucket_bytes),
                    list(log.bucket_bytes), cap, grads, first_pass_buckets)


def ddp_scaled_steps(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn, *,
                     hook=None, autocast_dtype: torch.dtype | None = torch.bfloat16, init_scale: float = 2.0 ** 16,
                     steps: int = 1, lr: float = 0.1) -> list[dict]:
    """``steps`` DDP training steps of a copy of ``model`` through a ``GradScaler`` and a communication hook.

    Every step uses the same batch, SGD at ``lr`` and the scaler's default growth and backoff. One dict
    per step: ``scale`` (the loss scale the step ran with), ``bucket_amax`` (the largest scaled gradient
    handed to the hook), ``sent_dtypes``, ``skipped`` (the scaler found inf/nan in the all-reduced
    gradients and skipped ``optimizer.step``: its scale dropped in ``update()``) and ``weights_changed``.
    ``hook`` None is ``allreduce_hook`` (DDP's default, in Python).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if autocast_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"autocast_dtype: expected None, torch.float16 or torch.bfloat16, got {autocast_dtype!r}")
    if not init_scale > 0:
        raise ValueError(f"init_scale: expected a positive number, got {init_scale!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected a positive integer, got {steps!r}")
    device = inputs.device
    records = []
    with one_process_group(device.type):
        local = copy.deepcopy(model).to(device)
        ddp = DistributedDataParallel(local, device_ids=[device] if device.type == "cuda" else None)
        log = AllReduceLog()
        ddp.register_comm_hook(None, counting_hook(hook or allreduce_hook, log))
        opt = torch.optim.SGD(local.parameters(), lr=lr)
        scaler = torch.amp.GradScaler(device.type, init_scale=init_scale)
        for _ in range(steps):
            log.bucket_amax.clear()
            log.sent_dtypes.clear()
            scale = scaler.get_scale()                      # a host sync, once per step
            before = [p.detach().clone() for p in local.parameters()]
            opt.zero_grad(set_to_none=True)
            with torch.amp.autocast(device.type, dtype=autocast_dtype or torch.bfloat16,
                                    enabled=autocast_dtype is not None):
                loss = loss_fn(ddp(inputs), targets)
            scaler.scale(loss).backward()                   # the hook runs here, on the scaled gradients
            scaler.step(opt)
            scaler.update()
            records.append({"scale": scale, "bucket_amax": max(log.bucket_amax),
                            "sent_dtypes": sorted(set(log.sent_dtypes)),
                            "skipped": scaler.get_scale() < scale,     # the only sign of a skip
                            "weights_changed": any(not torch.equal(b, p.detach())
                                                   for b, p in zip(before, local.parameters()))})
        del ddp
    return records
