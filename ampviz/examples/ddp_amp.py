"""DDP + AMP + gradient accumulation on the bundled digits, recorded on every rank by ampviz.

Run it with torchrun (gloo on the CPU; NCCL when every rank has a GPU)::

    torchrun --nproc-per-node 2 -m ampviz.examples.ddp_amp --out runs/ddp
    ampviz info runs/ddp
    ampviz report runs/ddp -o runs/ddp/report.html

A small transformer classifies the 8x8 digits read as 8 tokens (``ampviz.lessons.data.digit_rows``). Each
rank trains on its ``DistributedSampler`` share, accumulates ``--accum`` micro-batches with
``no_sync()`` on all but the last, clips the unscaled gradients (``--max-grad-norm``), steps through a
``GradScaler`` and a warm-up schedule that skips the steps the scaler skipped (``--warmup``), and records its
own run (``rank{r}.npz``, with local pre-all-reduce weight gradients). Rank 0 evaluates on a dev split,
keeps the best checkpoint (``best.pt``, the weights) and the state to resume from (``state.pt``: weights,
optimizer, scaler, scheduler, step), and prints a classification report on the test split.
``--resume runs/ddp/state.pt`` continues a run on every rank, with ``--steps`` the total.

Every collective is bounded by ``--timeout``: if a rank dies or hangs, the others stop with a clear
error instead of waiting forever. Each rank's recording reaches its file while it trains (every
``--save-every`` seconds, default 60, and/or ``--save-every-steps``) and when it stops, also on
SIGTERM (torchrun's way of stopping the survivors of a failed rank): a rank killed outright
(``kill -9``, the OOM killer) keeps all but its last interval. Each rank says what its file holds.
``--fail-rank R --fail-step S [--fail-mode raise|hang|kill]`` makes rank R fail on purpose to show it.
From Python (a notebook), ``ampviz.lessons.launch.launch(train_worker, 2, args=(Config(...),))``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from .. import Recorder, RecordOptions
from .._args import check_int
from .fixtures import TransformerClassifier, digit_rows
from .process_group import PeerFailure, init_from_env, is_collective_failure
from .trainer import Trainer, linear_warmup, load_checkpoint

__all__ = ["Config", "build", "train_worker", "main"]

PROG = "ampviz.examples.ddp_amp"


@dataclass
class Config:
    """Everything a rank needs to know (the same on every rank)."""

    out: str | None = None           # directory for rank{r}.npz and the checkpoint; None: record, save nothing
    steps: int = 60                  # optimizer steps
    accum: int = 2                   # micro-batches per optimizer step
    batch: int = 16                  # micro-batch size per rank
    lr: float = 2e-3
    amp: str = "fp16"                # fp16 (with a GradScaler), bf16 or off
    init_scale: float = 2.0 ** 16
    growth_interval: int = 10
    max_grad_norm: float | None = 1.0    # clip after scaler.unscale_ (None: no clipping)
    warmup: int = 10                 # LR warm-up steps, then a linear decay to 0 at `steps`
    resume: str | None = None        # a state.pt to continue from (loaded on every rank)
    d_model: int = 32
    eval_every: int = 20
    seed: int = 0
    timeout: float = 60.0            # seconds any collective may wait for the other ranks
    local_weights: bool = True       # also record each rank's gradients before the all-reduce
    progress: bool = True            # progress bar on rank 0
    fail_rank: int | None = None     # make this rank fail on purpose ...
    fail_step: int = 3               # ... before this optimizer step
    fail_mode: str = "raise"         # raise an exception, hang (sleep) without answering, or kill -9 itself
    save_every: float | None = 60.0  # seconds between saves of the recording while training (None: on exit)
    save_every_steps: int | None = None   # and/or optimizer steps between saves

    def __post_init__(self):
        if self.amp not in ("fp16", "bf16", "off"):
            raise ValueError(f"amp: expected 'fp16', 'bf16' or 'off', got {self.amp!r}")
        if self.fail_mode not in ("raise", "hang", "kill"):
            raise ValueError(f"fail_mode: expected 'raise', 'hang' or 'kill', got {self.fail_mode!r}")
        for name in ("steps", "accum", "batch", "d_model", "eval_every"):
            check_int(name, getattr(self, name), low=1)
        check_int("warmup", self.warmup, low=0)
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: expected a positive number or None, got {self.max_grad_norm!r}")
        if self.resume is not None and not os.path.isfile(self.resume):
            raise ValueError(f"resume: expected a state.pt written by {PROG} (--out DIR writes DIR/state.pt), "
                             f"got {self.resume!r}, which is not a file")
        RecordOptions(save_every=self.save_every, save_every_steps=self.save_every_steps)   # their checks, now


def splits(seed: int = 0, dev_fraction: float = 0.15):
    """Train / dev / test token sequences of the digits (the same on every rank)."""
    d = digit_rows(seed=seed)
    order = torch.randperm(len(d.y_train), generator=torch.Generator().manual_seed(seed))
    n_dev = int(len(order) * dev_fraction)
    dev, train = order[:n_dev], order[n_dev:]
    return (TensorDataset(d.x_train[train], d.y_train[train]), (d.x_train[dev], d.y_train[dev]),
            (d.x_test, d.y_test))


def train_worker(config: Config) -> dict:
    """Train and record one rank (call it under torchrun, or via ``ampviz.lessons.launch.launch``).

    Returns a summary: rank, world size, device, per-step loss history, dev metrics and the test
    report (rank 0), the test accuracy (rank 0), and a checksum of the final parameters.

    A collective that fails or times out (while joining, in DDP's constructor, or in training)
    raises :class:`ampviz.examples.process_group.PeerFailure` with a message naming the rank and the timeout.
    """
    rank = int(os.environ.get("RANK", "0"))
    recorders = []                                 # _train's recorder, to say what its file holds
    try:
        return _train(config, recorders)
    except SystemExit:                             # SIGTERM (torchrun stopping the survivors of a failed rank)
        print(f"{PROG}: rank {rank} stopped by a signal. {_saved(recorders, config)}", file=sys.stderr, flush=True)
        raise
    except Exception as e:
        if not is_collective_failure(e):
            raise
        first = re.sub(r"\[[^\]]*/[^\]]*\]\s*", "", " ".join(str(e).split())).split(". ")[0][:200]
        raise PeerFailure(f"rank {rank} stopped: a collective operation failed ({first}). Another rank has "
                          f"probably died or stopped responding; collectives give up after timeout="
                          f"{config.timeout:g} s. {_saved(recorders, config)}") from e


def build(config: Config, env) -> tuple[Trainer, DataLoader]:
    """This rank's Trainer (model from ``config.seed`` on every rank, DDP when there are several ranks, AdamW,
    GradScaler, warm-up schedule; no recorder yet) and its training loader (``loader.sampler`` is the sampler)."""
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[config.amp]
    torch.manual_seed(config.seed)                 # the same initial weights on every rank ...
    model = TransformerClassifier(3 ** 8, 10, d_model=config.d_model, heads=4, layers=2, max_len=8).to(env.device)
    ddp = model
    if env.world_size > 1:                         # ... and DDP's constructor broadcasts rank 0's anyway
        ids = [env.device] if env.device.type == "cuda" else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=config.lr)
    scaler = torch.amp.GradScaler(env.device.type, init_scale=config.init_scale,
                                  growth_interval=config.growth_interval, enabled=config.amp == "fp16")
    train_set = splits(config.seed)[0]
    sampler = (DistributedSampler(train_set, shuffle=True, seed=config.seed, drop_last=True) if env.world_size > 1
               else RandomSampler(train_set, generator=torch.Generator().manual_seed(config.seed)))
    loader = DataLoader(train_set, batch_size=config.batch, sampler=sampler, drop_last=True)
    trainer = Trainer(ddp, optimizer, scaler, device=env.device, amp_dtype=amp_dtype, accum=config.accum,
                      progress=config.progress, max_grad_norm=config.max_grad_norm,
                      scheduler=linear_warmup(optimizer, config.warmup, config.steps))
    return trainer, loader


def _saved(recorders: list, config: Config) -> str:
    """What this rank's run file holds, as the recorder reports it (never a save that did not happen)."""
    if not config.out:
        return "Nothing was saved (no --out)."
    saved = recorders[0].saved if recorders else None
    if saved is None:
        return "Nothing of this rank's recording was saved."
    return f"This rank's recording of {saved[1]} steps is saved in {saved[0]}."


def _train(config: Config, recorders: list) -> dict:
    env = init_from_env(config.timeout)
    rank, world, device = env.rank, env.world_size, env.device
    trainer, loader = build(config, env)
    model, ddp, optimizer, scaler = trainer.module, trainer.model, trainer.optimizer, trainer.scaler
    if config.resume:
        trainer.resume(config.resume)              # on every rank: weights, optimizer, scaler, scheduler, step
    _, dev, test = splits(config.seed)
    out = Path(config.out) if config.out else None
    run_path = None if out is None else (out if world > 1 else out / "run.npz")
    checkpoint = None if out is None else out / "best.pt"
    if out is not None:                            # every rank: the Recorder checks the directory it writes to
        out.mkdir(parents=True, exist_ok=True)
    recorder = Recorder(ddp, optimizer, scaler=scaler, local_weights=config.local_weights and world > 1,
                        path=run_path, scheduler=trainer.scheduler, save_every=config.save_every,
                        save_every_steps=config.save_every_steps)
    recorders.append(recorder)
    trainer.recorder = recorder
    start = time.perf_counter()
    with recorder:                                 # saved on exit, also when training raises
        history = trainer.train(loader, loader.sampler, config.steps, dev=dev, eval_every=config.eval_every,
                                checkpoint=checkpoint, fail_at=_failure(config, rank),
                                state=None if out is None else out / "state.pt")
    seconds = time.perf_counter() - start
    summary = {"rank": rank, "world_size": world, "device": str(device), "backend": env.backend,
               "seconds": seconds, "history": history, "config": asdict(config),
               "param_checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
               "scheduler_steps": trainer.scheduler.last_epoch, "lr": trainer.scheduler.get_last_lr()[0],
               "scale": scaler.get_scale(), "run_path": None if run_path is None else str(run_path)}
    if rank == 0:
        if checkpoint is not None and checkpoint.exists():  # the best dev checkpoint, not the last weights
            load_checkpoint(model, checkpoint, device)
        x_test, y_test = test
        summary["test_loss"], summary["test_accuracy"] = trainer.evaluate(x_test, y_test)
        summary["report"] = trainer.report(x_test, y_test)
    return summary


def _failure(config: Config, rank: int):
    if config.fail_rank is None or config.fail_rank != rank:
        return None

    def fail_at(step):
        if step == config.fail_step:
            if config.fail_mode == "kill":                 # as kill -9 or the OOM killer: no handler, no save
                os.kill(os.getpid(), signal.SIGKILL)
            if config.fail_mode == "hang":
                time.sleep(10 * config.timeout + 60)       # never answers the next all-reduce
            raise RuntimeError(f"rank {rank}: deliberate failure before step {step} (--fail-rank {rank})")
    return fail_at


def build_parser() -> argparse.ArgumentParser:
    c = Config()
    p = argparse.ArgumentParser(prog=f"torchrun --nproc-per-node N -m {PROG}", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for the rank files, checkpoint and report")
    p.add_argument("--steps", type=int, default=c.steps, help=f"optimizer steps (default {c.steps})")
    p.add_argument("--accum", type=int, default=c.accum, help=f"micro-batches per step (default {c.accum})")
    p.add_argument("--batch", type=int, default=c.batch, help=f"micro-batch size per rank (default {c.batch})")
    p.add_argument("--lr", type=float, default=c.lr)
    p.add_argument("--amp", choices=["fp16", "bf16", "off"], default=c.amp)
    p.add_argument("--init-scale", type=float, default=c.init_scale)
    p.add_argument("--growth-interval", type=int, default=c.growth_interval)
    p.add_argument("--max-grad-norm", type=float, default=c.max_grad_norm,
                   help=f"clip the unscaled gradients' norm (default {c.max_grad_norm}; 0: no clipping)")
    p.add_argument("--warmup", type=int, default=c.warmup, help=f"LR warm-up steps (default {c.warmup})")
    p.add_argument("--resume", default=None, help="a state.pt to continue from, on every rank")
    p.add_argument("--eval-every", type=int, default=c.eval_every)
    p.add_argument("--seed", type=int, default=c.seed)
    p.add_argument("--timeout", type=float, default=c.timeout, help="seconds a collective may wait (default 60)")
    p.add_argument("--no-local-weights", action="store_true", help="do not record pre-all-reduce gradients")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--fail-rank", type=int, default=None, help="make this rank fail on purpose")
    p.add_argument("--fail-step", type=int, default=c.fail_step)
    p.add_argument("--fail-mode", choices=["raise", "hang", "kill"], default=c.fail_mode)
    p.add_argument("--save-every", type=float, default=c.save_every,
                   help="seconds between saves of each rank's recording while training (default 60)")
    p.add_argument("--save-every-steps", type=int, default=None, help="also save every this many steps")
    return p


def _terminate(signum, frame):
    raise SystemExit(128 + signum)      # unwinds through `with recorder:`, which saves this rank's run


@record
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = Config(out=args.out, steps=args.steps, accum=args.accum, batch=args.batch, lr=args.lr,
                        amp=args.amp, init_scale=args.init_scale, growth_interval=args.growth_interval,
                        max_grad_norm=args.max_grad_norm or None, warmup=args.warmup, resume=args.resume,
                        eval_every=args.eval_every, seed=args.seed, timeout=args.timeout,
                        local_weights=not args.no_local_weights, progress=not args.quiet,
                        fail_rank=args.fail_rank, fail_step=args.fail_step, fail_mode=args.fail_mode,
                        save_every=args.save_every, save_every_steps=args.save_every_steps)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)      # torchrun stops the survivors of a failed rank with SIGTERM
    rank = int(os.environ.get("RANK", "0"))
    try:
        summary = train_worker(config)
    except PeerFailure as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        _print_summary(summary, config)
    return 0


def _print_summary(summary: dict, config: Config) -> None:
    out = config.out
    print(f"trained {config.steps} steps on {summary['world_size']} rank(s) "
          f"({summary['device']}, {summary['backend'] or 'no process group'}) in {summary['seconds']:.1f} s")
    if summary["history"]["dev_accuracy"]:
        print(f"dev accuracy {summary['history']['dev_accuracy'][-1]:.3f}; "
              f"test accuracy (best dev checkpoint) {summary['test_accuracy']:.3f}")
    print(summary["report"])
    print(f"recorded {summary['world_size']} rank(s) in {out}. Look at it with:\n  ampviz info {out}\n"
          f"  ampviz report {out} -o {Path(out) / 'report.html'}")


if __name__ == "__main__":
    sys.exit(main())
