"""Process-group basics, one small function per idea, run on 2 ranks. Used by lessons 10, 10b, 11 and 11b.

Each function joins the process group with :func:`ampviz.examples.process_group.init_from_env` (torchrun's
environment) and returns plain data, so a notebook can run it with ``ampviz.lessons.launch.launch``::

    from ampviz.lessons.launch import launch
    launch(hello, nprocs=2)                       # [{'rank': 0, 'world_size': 2, ...}, {'rank': 1, ...}]

or a terminal with torchrun, which runs :func:`main` (hello + an all-reduce on every rank)::

    torchrun --nproc-per-node 2 -m ampviz.lessons.ddp_ranks
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from ..examples.process_group import init_from_env
from ..examples.trainer import Trainer
from .data import digits
from .models import MLP

__all__ = ["hello", "env_without_local_rank", "collective_timeout", "forward_broadcasts", "sampler_shares",
           "reductions", "rank0_evaluation", "sharded_evaluation", "restore_and_broadcast",
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


def env_without_local_rank() -> dict:
    """Join a one-process group from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` alone.

    Run it in a process whose environment lacks ``LOCAL_RANK`` (a subprocess): ``init_process_group``
    never reads it; ``dist.get_node_local_rank`` does, and needs a fallback without it.
    """
    dist.init_process_group("gloo")                           # env:// -- the four variables only
    try:
        value = torch.ones(1)
        dist.all_reduce(value)
        try:
            dist.get_node_local_rank()
            local_rank_error = None
        except RuntimeError as err:
            local_rank_error = str(err).split(".")[0]
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "all_reduce": float(value),
                "LOCAL_RANK set": "LOCAL_RANK" in os.environ, "get_node_local_rank() error": local_rank_error,
                "get_node_local_rank(fallback_rank=0)": dist.get_node_local_rank(fallback_rank=0)}
    finally:
        dist.destroy_process_group()


def collective_timeout(seconds: float = 2.0) -> dict:
    """Rank 0 all-reduces on a gloo group with a ``seconds`` timeout; the other ranks never join it.

    Returns the error rank 0 got (gloo raises when the timeout passes; NCCL's watchdog would abort
    the process instead) and how long it waited. The default group stays usable afterwards.
    """
    env = init_from_env(timeout=60)
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
    start, error = time.perf_counter(), None
    if env.rank == 0:
        try:
            dist.all_reduce(torch.ones(1), group=short)      # nobody else calls it
        except RuntimeError as err:
            error = f"{type(err).__name__}: {err}"
    else:
        time.sleep(seconds + 1.0)                             # busy elsewhere, past the timeout
    waited = time.perf_counter() - start
    dist.barrier()                                            # the default group still works
    dist.destroy_process_group(short)
    return {"rank": env.rank, "error": error, "waited_seconds": waited}


class _Offset(torch.nn.Module):
    """A linear layer plus a registered buffer (like BatchNorm's running statistics)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.register_buffer("offset", torch.zeros(2))

    def forward(self, x):
        return self.linear(x) + self.offset


def forward_broadcasts() -> dict:
    """What a DDP forward sends: rank 1 changes a parameter and a buffer after the constructor;
    after one forward, rank 0's buffer has overwritten rank 1's (``forward_sync_buffers``, by default
    on; ``broadcast_buffers`` before torch 2.13), the changed parameter has not (parameters are
    broadcast once, in the constructor). Whether the next forward syncs buffers depends on the grad
    mode of the previous one: reported after a training forward and after a ``no_grad`` one."""
    env = init_from_env(timeout=60)
    torch.manual_seed(0)
    ddp = _ddp(_Offset(), env)
    if env.rank == 1:
        with torch.no_grad():
            ddp.module.linear.bias.add_(1.0)                  # a parameter, changed on rank 1 only
            ddp.module.offset.fill_(5.0)                      # a buffer, changed on rank 1 only
    ddp(torch.ones(3, 4, device=env.device)).sum().backward()  # one forward (and its backward)
    out = {"rank": env.rank, "buffer after forward": ddp.module.offset.tolist(),
           "bias after forward": [round(v, 6) for v in ddp.module.linear.bias.tolist()],
           "forward syncs buffers": ddp.will_sync_module_buffers()}
    with torch.no_grad():
        ddp(torch.ones(3, 4, device=env.device))             # both ranks: it broadcasts the buffers once more
    out["syncs after a no_grad forward"] = ddp.will_sync_module_buffers()   # the previous forward decides
    return out


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


def sharded_evaluation(n_examples: int = 359) -> dict:
    """Train a few DDP steps, then evaluate the first ``n_examples`` test digits two ways: rank 0
    alone on the whole split (``Trainer.evaluate``), and every rank on its ``DistributedSampler``
    share, gathered with the padding trimmed (``Trainer.evaluate_sharded``)."""
    env = init_from_env(timeout=60)
    x, y = _shard(env)
    ddp = _ddp(small_model(0), env)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _train_steps(ddp, opt, x, y, 5)
    d = digits(seed=0)
    x_eval, y_eval = d.x_test[:n_examples], d.y_test[:n_examples]
    trainer = Trainer(ddp, opt, None, device=env.device, amp_dtype=None)
    out = {"rank": env.rank, "examples": len(y_eval), "sharded": trainer.evaluate_sharded(x_eval, y_eval),
           "per_rank": len(DistributedSampler(range(len(y_eval)), shuffle=False))}
    if env.rank == 0:
        out["rank0"] = trainer.evaluate(x_eval, y_eval)        # the unwrapped module: no collectives
    dist.barrier()
    return out


def restore_and_broadcast(path: str, lr: float = 1e-3) -> dict:
    """Resume from a checkpoint the way the walkthrough 模型训练（二） (Soup's Blog) does: model on rank 0, then DDP's
    broadcast; optimizer state restored on every rank, or (the mistake) on rank 0 only. One step each;
    checksums returned."""
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
