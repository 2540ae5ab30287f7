"""Rank functions for the DDP + AMP lessons: what DDP all-reduces under autocast, and resuming a run from a
checkpoint on every rank (or, the mistake, restoring the GradScaler on one rank only).

Run them on two ranks from a notebook::

    from ampviz.examples.distributed import Workers
    from ampviz.examples.ddp_amp import Config
    with Workers(2) as workers:
        sent = workers.run(all_reduce_dtypes)                        # the buckets' dtype, with and without AMP
        resumed = workers.run(resume_variants, Config(steps=40), 20, "out")

Used by lessons 11 (DDP + AMP training) and 11b (checkpoints and resuming).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ..examples.data import digits
from ..examples.ddp_amp import Config, build
from ..examples.distributed import init_from_env
from ..examples.models import MLP

__all__ = ["all_reduce_dtypes", "resume_variants"]


def all_reduce_dtypes() -> dict:
    """One backward of a small MLP under DDP without autocast, with fp16 and with bf16 autocast: the dtype
    of the parameters, of their ``.grad`` and of the bucket DDP all-reduces, and the bytes it sends."""
    env = init_from_env(timeout=60)
    d = digits(seed=0)
    x, y = d.x_train[env.rank:64:2].to(env.device), d.y_train[env.rank:64:2].to(env.device)
    out = {"rank": env.rank}
    for label, dtype in (("fp32", None), ("fp16 autocast", torch.float16), ("bf16 autocast", torch.bfloat16)):
        torch.manual_seed(0)
        ddp = DDP(MLP(64, 32, depth=1, d_out=10).to(env.device))
        sent = []

        def hook(state, bucket, sent=sent):
            sent.append((str(bucket.buffer().dtype), bucket.buffer().numel() * bucket.buffer().element_size()))
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        with torch.amp.autocast(env.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = ddp(x)
            loss = F.cross_entropy(logits, y)
        loss.backward()
        params = ddp.module.parameters()
        out[label] = {"logits": str(logits.dtype), "parameters": str(next(params).dtype),
                      "gradients": str(next(ddp.module.parameters()).grad.dtype),
                      "bucket": sent[0][0], "bytes sent": sum(b for _, b in sent)}
    return out


def _checksum(module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def _after(trainer, config, loader, state) -> dict:
    """Train ``trainer`` (restored from ``state``) to ``config.steps``; its weights, scale and skipped steps."""
    scheduler_start = trainer.scheduler.last_epoch
    trainer.train(loader, loader.sampler, config.steps)
    taken = config.steps - int(state["step"])
    return {"checksum": _checksum(trainer.module), "scale": trainer.scaler.get_scale(),
            "skipped": taken - (trainer.scheduler.last_epoch - scheduler_start),
            "lr": trainer.scheduler.get_last_lr()[0]}


def resume_variants(config: Config, stop: int, out_dir: str) -> dict:
    """Train ``config.steps`` steps in one go, saving the training state at step ``stop``; then rebuild
    everything (as a restarted job would) and resume from that state three times: restored on every rank;
    with the GradScaler's state restored on rank 0 only (the others start from ``init_scale``); and with
    everything but the scaler's state restored, on every rank.

    Returns, per variant, this rank's weight checksum, loss scale, learning rate and skipped steps after
    ``stop``, plus the saved state's step and scale."""
    env = init_from_env(config.timeout)
    path = os.path.join(out_dir, "state.pt")
    trainer, loader = build(config, env)
    trainer.train(loader, loader.sampler, stop, eval_every=stop, state=path)    # rank 0 saves; a barrier
    state = torch.load(path, map_location=env.device, weights_only=True)
    out = {"rank": env.rank, "saved step": int(state["step"]), "saved scale": float(state["scaler"]["scale"]),
           "uninterrupted": _after(trainer, config, loader, state)}
    for variant, keeps_scaler in (("every rank", True), ("scaler on rank 0 only", env.rank == 0),
                                  ("scaler on no rank", False)):
        trainer, loader = build(config, env)                   # a new job: fresh model, optimizer, scaler
        # read the file again: the optimizer adopts the loaded tensors, and training changes them in place
        restored = torch.load(path, map_location=env.device, weights_only=True)
        if not keeps_scaler:
            restored["scaler"] = {}                              # this rank forgot the scaler's state
        trainer.load_state_dict(restored)
        out[variant] = _after(trainer, config, loader, state)
    return out
