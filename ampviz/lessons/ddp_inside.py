"""Rank functions for the DDP lessons: the article launcher (``mp.spawn`` + ``tcp://``), the default timeout,
DDP's gradient buckets and when a forward through the wrapper is a collective.

Run them on two ranks from a notebook (``ampviz.lessons.launch.Workers``), except
:func:`spawned_rank`, which ``torch.multiprocessing.spawn`` starts itself::

    import torch.multiprocessing as mp
    from ampviz.lessons.launch import Workers, free_port
    mp.spawn(spawned_rank, args=(2, free_port(), "out"), nprocs=2)     # out/rank0.json, out/rank1.json
    with Workers(2) as workers:
        events = workers.run(bucket_events)                             # all-reduces during backward

Used by lessons 10 (DDP basics) and 10b (inside DDP).
"""

from __future__ import annotations

import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ..examples.process_group import init_from_env

__all__ = ["spawned_rank", "group_timeout", "bucket_events", "lone_forward"]

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def group_timeout(group=None) -> float | None:
    """Seconds the gloo backend of ``group`` (default: the world) waits in a collective; None where this
    torch does not expose it (it reads the backend's options, which are not public API)."""
    group = group or dist.group.WORLD
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def spawned_rank(local_rank: int, world_size: int, port: int, out_dir: str) -> None:
    """The launcher of the article's Trainer: ``mp.spawn`` passes the process index first, and the group is
    joined with ``init_method="tcp://..."`` plus an explicit rank and world size, with no timeout given.

    Writes ``out_dir/rank{r}.json``: rank, world size, an all-reduce of ``rank + 1``, which of torchrun's
    environment variables this process saw, and the group's timeout (the default)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=local_rank,
                            world_size=world_size)
    try:
        value = torch.tensor([float(local_rank + 1)])
        dist.all_reduce(value)
        info = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "all_reduce": float(value),
                "environment": {k: os.environ.get(k) for k in _ENV}, "timeout_seconds": group_timeout()}
    finally:
        dist.destroy_process_group()
    path = os.path.join(out_dir, f"rank{local_rank}.json")
    with open(f"{path}.tmp", "w") as f:
        json.dump(info, f)
    os.replace(f"{path}.tmp", path)


def _layers(n: int, width: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n)])


def bucket_events(iterations: int = 3, layers: int = 4, width: int = 256, bucket_cap_mb: float = 0.5) -> dict:
    """Train ``iterations`` steps of ``layers`` linear layers under DDP with small buckets; log, in order,
    when each layer's weight gradient is computed and when each bucket's all-reduce is launched.

    Returns the events per iteration (``"grad 3"``, ``"all-reduce bucket 0 (2 layers)"``...), the bucket
    sizes in bytes before and after DDP rebuilds its buckets, and the bucket caps DDP uses by default."""
    env = init_from_env(timeout=60)
    model = _layers(layers, width).to(env.device)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    per_layer = sum(p.numel() * p.element_size() for p in model[0].parameters())
    log: list[str] = []

    def hook(state, bucket):
        layers_in = round(bucket.buffer().numel() * bucket.buffer().element_size() / per_layer)
        log.append(f"all-reduce bucket {bucket.index()} ({layers_in} layers)")
        return default_hooks.allreduce_hook(state, bucket)      # the default: average, all-reduce

    ddp.register_comm_hook(None, hook)
    for i, layer in enumerate(model):
        layer.weight.register_hook(lambda grad, i=i: log.append(f"grad {i}"))
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(env.rank)).to(env.device)
    events = []
    for _ in range(iterations):
        log.clear()
        ddp(x).square().mean().backward()
        events.append(list(log))
    data = ddp._get_ddp_logging_data()                             # DDP's own record of its buckets
    default = DDP(_layers(layers, width).to(env.device))           # no bucket_cap_mb: torch's defaults
    return {"rank": env.rank, "events": events, "layer_bytes": per_layer,
            "first_buckets": [int(b) for b in str(data["bucket_sizes"]).split(", ")],
            "rebuilt_buckets": [int(b) for b in str(data["rebuilt_bucket_sizes"]).split(", ")],
            "default_cap_bytes": default.bucket_bytes_cap,
            "default_first_bucket_bytes": getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None)}


def lone_forward(seconds: float = 2.0) -> dict:
    """A model with **no buffers** under DDP, one joint training step; then rank 0 alone runs a forward
    through the wrapper, first under ``torch.no_grad()``, then with grad enabled (as in training).

    The DDP runs on its own gloo group with a ``seconds`` timeout, so a forward that waits for rank 1
    raises after ``seconds``. Returns what each lone forward did and how long it took."""
    env = init_from_env(timeout=60)
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(env.device)
    dist.barrier()                                               # start together: the short timeout is tight
    ddp = DDP(model, process_group=short)
    x = torch.ones(3, 4, device=env.device)
    ddp(x).sum().backward()                                      # one training iteration, both ranks
    out = {"rank": env.rank, "buffers": len(list(model.buffers())), "syncs_buffers": ddp.will_sync_module_buffers()}
    if env.rank == 0:
        start = time.perf_counter()
        with torch.no_grad():
            ddp(x)                                               # alone, no grad
        out["no_grad_seconds"] = time.perf_counter() - start
        start, out["error"] = time.perf_counter(), None
        try:
            ddp(x)                                               # alone, grad enabled: DDP rebuilds its buckets
        except RuntimeError as err:
            out["error"] = f"{type(err).__name__}: {' '.join(str(err).split())}"
        out["grad_seconds"] = time.perf_counter() - start
    else:
        time.sleep(seconds + 1.0)                                # busy elsewhere, past the timeout
    dist.barrier()                                               # the default group still works
    dist.destroy_process_group(short)
    return out
