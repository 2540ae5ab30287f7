"""Resuming a DDP + AMP run from a checkpoint on every rank, against the uninterrupted run (and, the
mistake, with the GradScaler's state restored on one rank only).

Run it on two ranks from a notebook::

    from ampviz.lessons.launch import Workers
    from ampviz.examples.ddp_amp import Config
    with Workers(2) as workers:
        resumed = workers.run(resume_variants, Config(steps=40, progress=False), 20, "out")

Used by lessons 11 (DDP + AMP training), in its part b: 11b_ddp_amp_checkpoints.
"""

from __future__ import annotations

import os

import torch

from ..examples.ddp_amp import Config, build
from ..examples.process_group import init_from_env

__all__ = ["resume_variants"]


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
