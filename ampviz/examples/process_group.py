"""Join a torch.distributed process group from torchrun's environment, and tell a failed collective apart.

What a program started by ``torchrun`` needs before its first collective (``ampviz.examples.ddp_amp`` uses it;
so do the rank functions the lessons launch with ``ampviz.lessons.launch``)::

    from ampviz.examples.process_group import init_from_env
    env = init_from_env()                        # gloo on the CPU, NCCL with a GPU per local rank
    env.rank, env.world_size, env.device

Without ``WORLD_SIZE`` in the environment (a plain ``python`` run) nothing is initialised and a world of one
is returned.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["PeerFailure", "is_collective_failure", "Dist", "init_from_env"]


class PeerFailure(RuntimeError):
    """This rank stopped because a collective failed: another rank died, hung or was unreachable."""


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` came from a failed or timed-out collective (gloo / NCCL / the store)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(k in text for k in (
        "gloo", "NCCL", "nccl", "Connection closed by peer", "Connection reset by peer", "Timed out", "timed out"))



@dataclass
class Dist:
    """Where this process stands: its rank, the world size, its device and the backend in use."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None


def init_from_env(timeout: float = 60.0, backend: str | None = None) -> Dist:
    """Join the process group described by torchrun's environment variables.

    Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (set by ``torchrun`` and by :func:`launch`).
    The backend is NCCL with ``cuda:LOCAL_RANK`` when there is a GPU for every local rank, gloo on
    the CPU otherwise. ``timeout`` (seconds) bounds every collective: a rank whose peer died or hung
    raises an error after it instead of waiting forever. Without ``WORLD_SIZE`` (a plain
    ``python`` run) nothing is initialised and a world of one is returned.
    """
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return Dist(0, 1, 0, device, None)
    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())
