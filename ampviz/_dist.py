"""Where this process stands in a torch.distributed job: ``(world_size, rank)``, ``(1, 0)`` outside one.
The Recorder and the framework callbacks both ask it."""

from __future__ import annotations

import torch

__all__ = ["dist_info"]


def dist_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0
