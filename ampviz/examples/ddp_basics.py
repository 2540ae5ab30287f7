"""Process-group basics, one small function per idea (lessons 10 and 11 run them on 2 ranks).

Each function joins the process group with :func:`ampviz.examples.distributed.init_from_env` (torchrun's
environment) and returns plain data, so a notebook can run it with ``ampviz.examples.distributed.launch``::

    from ampviz.examples.distributed import launch
    launch(hello, nprocs=2)                       # [{'rank': 0, 'world_size': 2, ...}, {'rank': 1, ...}]

or a terminal with torchrun, which runs :func:`main` (hello + an all-reduce on every rank)::

    torchrun --nproc-per-node 2 -m ampviz.examples.ddp_basics
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from .data import digits
from .distributed import init_from_env
from .models import MLP

__all__ = ["hello", "sampler_shares", "reductions", "rank0_evaluation", "restore_and_broadcast",
           "accumulation_all_reduces", "small_model", "main"]


def small_model(seed: int) -> torch.nn.Module:
    """The MLP used by these examples (64 pixels -> 32 -> 10 classes), initialised from ``seed``."""
    torch.manual_seed(seed)
    return MLP(64, 32, depth=1, d_out=10)


def _checksum(module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def _shard(env):
    """This rank's share of the digits training set (every world-th example), on its device."""
    d = digits(seed=0)
    return d.x_train[env.rank::env.world_size].to(env.device), d.y_train[env.rank::env.world_size].to(env.device)


def _ddp(module, env) -> DDP:
    """Wrap ``module`` (moved to this rank's device) in DDP; the constructor broadcasts rank 0's weights."""
    module = module.to(env.device)
    return DDP(module, device_ids=[env.device] if env.device.type == "cuda" else None)


def hello() -> dict:
    """Join the group; report who this process is."""
    env = init_from_env(timeout=60)
    return {"rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
            "backend": env.backend, "device": str(env.device), "pid": os.getpid(),
            "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"}


def sampler_shares(n: int, epochs: int, seed: int = 0) -> dict:
    """The indices this rank's ``DistributedSampler`` yields per epoch, with and without ``set_epoch``."""
    init_from_env(timeout=30)
    out = {}
    for label, call_set_epoch in (("without_set_epoch", False), ("with_set_epoch", True)):
        sampler = DistributedSampler(range(n), shuffle=True, seed=seed)   # rank and world size from the group
        rows = []
        for epoch in range(epochs):
            if call_set_epoch:
                sampler.set_epoch(epoch)
            rows.append(list(sampler))
        out[label] = rows
    return out


def reductions() -> dict:
    """This rank's loss on its data shard, then ``all_reduce`` (sum, every rank) vs ``reduce`` (to rank 0)."""
    env = init_from_env(timeout=30)
    x, y = _shard(env)
    with torch.no_grad():
        loss = F.cross_entropy(small_model(0).to(env.device)(x), y)          # the same model, different data per rank
    summed = loss.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)             # every rank receives the sum
    reduced = loss.clone()
    dist.reduce(reduced, dst=0, op=dist.ReduceOp.SUM)         # only rank 0's result is defined
    return {"rank": env.rank, "examples": len(y), "local_loss": float(loss), "all_reduce_sum": float(summed),
            "all_reduce_mean": float(summed) / env.world_size, "after_reduce": float(reduced)}


def _train_steps(ddp, opt, x, y, steps: int) -> None:
    for i in range(steps):
        sl = slice(32 * i, 32 * (i + 1))
        loss = F.cross_entropy(ddp(x[sl]), y[sl])
        loss.backward()                                       # DDP all-reduces the gradients here
        opt.step()
        opt.zero_grad(set_to_none=True)


def rank0_evaluation(path: str, use_barrier: bool, eval_seconds: float = 1.0) -> dict:
    """Train a step, let rank 0 evaluate and save a checkpoint, then look for the file on every rank.

    The evaluation is real, followed by ``eval_seconds`` of sleep that stands in for a long one.
    Returns whether this rank saw the checkpoint, how long it evaluated (rank 0) and waited (in the
    barrier, or in the next step's all-reduce), and a checksum of its parameters after one more step.
    """
    env = init_from_env(timeout=60)
    x, y = _shard(env)
    ddp = _ddp(small_model(0), env)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _train_steps(ddp, opt, x, y, 1)
    start = time.perf_counter()
    if env.rank == 0:
        d = digits(seed=0)
        with torch.no_grad():
            pred = ddp.module(d.x_test.to(env.device)).argmax(1).cpu()
            accuracy = float((pred == d.y_test).float().mean())
        time.sleep(eval_seconds)
        torch.save({"model": ddp.module.state_dict(), "accuracy": accuracy}, path)
    evaluate_seconds = time.perf_counter() - start
    start = time.perf_counter()
    if use_barrier:
        dist.barrier()                                        # nobody passes until rank 0 arrives
    waited_barrier = time.perf_counter() - start
    found = os.path.exists(path)
    start = time.perf_counter()
    _train_steps(ddp, opt, x, y, 1)                           # its all-reduce waits for every rank
    step_seconds = time.perf_counter() - start
    return {"rank": env.rank, "found_checkpoint": found, "evaluate_seconds": evaluate_seconds,
            "barrier_seconds": waited_barrier,
            "next_step_seconds": step_seconds, "checksum": _checksum(ddp.module)}


def restore_and_broadcast(path: str, lr: float = 1e-3) -> dict:
    """Resume from a checkpoint the way the seed does: model on rank 0 then DDP's broadcast; optimizer
    state restored on every rank, or (the mistake) on rank 0 only. One step each; checksums returned."""
    env = init_from_env(timeout=60)
    x, y = _shard(env)
    out = {"rank": env.rank}
    for variant in ("every_rank", "rank0_only"):
        ckpt = torch.load(path, map_location=env.device, weights_only=True)   # every rank reads the file
        model = small_model(100 + env.rank).to(env.device)   # deliberately different weights per rank
        if env.rank == 0:
            model.load_state_dict(ckpt["model"])
        before = _checksum(model)
        ddp = _ddp(model, env)                                # broadcasts rank 0's parameters to all
        after = _checksum(model)
        matches = all(torch.equal(p, ckpt["model"][k]) for k, p in model.state_dict().items())
        opt = torch.optim.Adam(ddp.parameters(), lr=lr)
        if variant == "every_rank" or env.rank == 0:
            opt.load_state_dict(ckpt["optimizer"])
        first = opt.state.get(next(iter(model.parameters())), {})
        adam_step = int(first["step"]) if "step" in first else 0
        _train_steps(ddp, opt, x, y, 1)
        out[variant] = {"before_ddp": before, "after_ddp": after, "matches_checkpoint": matches,
                        "adam_step_loaded": adam_step, "after_step": _checksum(model)}
    return out


def accumulation_all_reduces(accum: int = 4, batch: int = 32) -> dict:
    """Accumulate ``accum`` micro-batches with ``no_sync()`` on all but the last, and without it.

    A communication hook counts DDP's all-reduces (one per gradient bucket per synchronising
    backward) and the values they carry; the final gradients of both variants are returned.
    """
    env = init_from_env(timeout=60)
    x, y = _shard(env)
    out = {"rank": env.rank}
    for label, use_no_sync in (("no_sync", True), ("every_backward", False)):
        ddp = _ddp(small_model(0), env)
        sent = []

        def counting_hook(state, bucket, sent=sent):
            sent.append(bucket.buffer().numel())
            return default_hooks.allreduce_hook(state, bucket)          # the default: all-reduce, average

        ddp.register_comm_hook(None, counting_hook)
        for i in range(accum):
            quiet = ddp.no_sync() if use_no_sync and i < accum - 1 else contextlib.nullcontext()
            with quiet:
                sl = slice(batch * i, batch * (i + 1))
                (F.cross_entropy(ddp(x[sl]), y[sl]) / accum).backward()
        out[label] = {"all_reduce_calls": len(sent), "values_all_reduced": sum(sent),
                      "grads": [p.grad.detach().cpu().clone() for p in ddp.module.parameters()]}
    return out


def main() -> None:
    """Under torchrun: say hello from every rank, then all-reduce each rank's number."""
    info = hello()
    value = torch.tensor([float(info["rank"] + 1)], device=info["device"])
    dist.all_reduce(value)
    line = (f"rank {info['rank']} of {info['world_size']} (pid {info['pid']}, backend {info['backend']}, "
            f"device {info['device']}): all_reduce(rank + 1) = {value.item():g}")
    lines = [None] * info["world_size"]
    dist.gather_object(line, lines if info["rank"] == 0 else None, dst=0)
    if info["rank"] == 0:                     # one process prints: ranks' outputs never interleave
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
