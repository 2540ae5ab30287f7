"""The doctor's planted-fault matrix (issue 17): loop shapes x faults, each cell a real recorded training run of
the same small network, with the fault planted the way it happens in practice.

    python tests/_doctor_matrix.py          # records every cell (about a minute) and prints the matrix

Loop shapes (``SHAPES``): a plain fp16 loop with a GradScaler; the same with ``scaler.unscale_(opt);
clip_grad_norm_(..., 1.0)``; with 4 accumulated micro-batches; Lightning ``bf16-mixed`` (which calls
``optimizer.step(closure)``); Lightning ``16-mixed`` with ``gradient_clip_val=1.0``; the Hugging Face Trainer on
its fp16 path with its default ``max_grad_norm=1.0``; DDP on 2 gloo ranks. Faults (``FAULTS``): fp16 without a
loss scale on small gradients; a GradScaler held at 1 on the same gradients; one forward that overflows; one nan
made in the backward; ``init_scale=2**24``; an LR scheduler that steps on skipped steps; none. ``EXPECTED`` says
which findings each fault must give, ``NOT_APPLICABLE`` why a cell does not exist.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import warnings
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz

SHAPES = ("plain", "clip", "accumulate 4", "Lightning bf16-mixed (closure)", "Lightning 16-mixed + clip", "HF Trainer",
          "DDP 2 ranks")
FAULTS = ("fp16 underflow, no scaler", "scale held too low", "forward overflow", "nan in backward",
          "init_scale too high", "scheduler on skips", "none")
EXPECTED = {"fp16 underflow, no scaler": {"gradient_underflow"}, "scale held too low": {"gradient_underflow"},
            "forward overflow": {"forward_overflow"}, "nan in backward": {"nonfinite_gradient"},
            "init_scale too high": {"init_scale_too_high"}, "scheduler on skips": {"scheduler_on_skipped"},
            "none": set()}
_BF16 = ("bf16 has fp32's exponent range: these gradients are 100 binades above its smallest subnormal, and "
         "bf16 training uses no GradScaler")
NOT_APPLICABLE = {
    ("Lightning bf16-mixed (closure)", "fp16 underflow, no scaler"): _BF16,
    ("Lightning bf16-mixed (closure)", "scale held too low"): _BF16,
    ("Lightning bf16-mixed (closure)", "init_scale too high"): _BF16,
    ("Lightning bf16-mixed (closure)", "scheduler on skips"): "without a GradScaler no step is ever skipped",
}
STEPS = 24
FAULT_STEP = STEPS - 1              # single-step faults: the last step (bf16 applies a nan step: nothing after it)
SMALL_LOSS = 2.0 ** -14             # the underflow faults: a loss weighted so its gradients sit near fp16's floor
HEALTHY_SCALE = 2.0 ** 10           # init_scale of the healthy GradScaler runs: no step of this network overflows
CELL_ORIGIN = {"forward overflow": ("layer", "gain"), "nan in backward": ("origin", "fc1")}


# ---------------------------------------------------------------------------------------------- the network
class _Poison(torch.autograd.Function):
    """Identity forward; backward writes nan into the first element of the incoming gradient when ``on``."""

    @staticmethod
    def forward(ctx, x, on):
        ctx.on = on
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.on:
            grad = grad.clone()
            grad.view(-1)[0] = float("nan")
        return grad, None


class Gain(nn.Module):
    """A per-feature scale (a trainable parameter, so the Recorder watches it) that carries two planted faults:
    ``overflow`` makes its forward output overflow any 16-bit dtype, ``nan`` makes its backward write a nan
    into the gradient of its input (fc1's output)."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.overflow = self.nan = False

    def forward(self, x):
        y = x * self.weight.to(x.dtype)
        if self.overflow:
            y = y * 2.0 ** 100 * 2.0 ** 100         # beyond fp16's and bf16's range (fp32's too)
        return _Poison.apply(y, self.nan)


class Net(nn.Module):
    """16 -> fc0 -> relu -> fc1 -> gain -> relu -> fc2 -> relu -> head -> 4 classes. ``forward(x, labels)``
    returns ``{"loss", "logits"}`` (what the HF Trainer expects), the loss times ``loss_weight``."""

    def __init__(self, fault="none", seed=0, width=32):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = OrderedDict(fc0=nn.Linear(16, width), act0=nn.ReLU(), fc1=nn.Linear(width, width),
                                  gain=Gain(width), act1=nn.ReLU(), fc2=nn.Linear(width, width), act2=nn.ReLU(),
                                  head=nn.Linear(width, 4))
        for name, module in self.layers.items():
            self.add_module(name, module)
        self.fault = fault
        self.loss_weight = SMALL_LOSS if fault in ("fp16 underflow, no scaler", "scale held too low") else 1.0

    def plant(self, step: int) -> None:
        """Switch the single-step faults on at FAULT_STEP."""
        self.gain.overflow = self.fault == "forward overflow" and step == FAULT_STEP
        self.gain.nan = self.fault == "nan in backward" and step == FAULT_STEP

    def forward(self, x, labels=None):
        for module in self.layers.values():
            x = module(x)
        out = {"logits": x}
        if labels is not None:
            out["loss"] = F.cross_entropy(x.float(), labels) * self.loss_weight
        return out


def batches(n, seed=1, size=32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 16, generator=g), torch.randint(0, 4, (size,), generator=g)) for _ in range(n)]


def scaler_for(fault: str) -> torch.amp.GradScaler:
    if fault == "fp16 underflow, no scaler":
        return torch.amp.GradScaler("cpu", enabled=False)
    if fault == "scale held too low":
        return torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10 ** 6)
    if fault == "init_scale too high":
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    # the scheduler fault needs skips: GradScaler's growth probes, every other step once it reaches fp16's edge
    return torch.amp.GradScaler("cpu", init_scale=HEALTHY_SCALE, growth_interval=1 if fault == "scheduler on skips"
                                else 2000)


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: min(1.0, (epoch + 1) / 10))


# ---------------------------------------------------------------------------------------------- loop shapes
def plain_loop(fault: str, clip=False, accumulate=1, ddp=None, seed=1, **recorder) -> ampviz.Run:
    """The loop as people write it: fp16 autocast, a GradScaler, SGD with momentum, a warm-up scheduler stepped
    only when the optimizer stepped (except under the scheduler fault), ``rec.step(loss)`` after the update."""
    model = Net(fault)
    trained = model if ddp is None else ddp(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler, sched = scaler_for(fault), warmup(opt)
    data = batches(STEPS * accumulate, seed=seed)
    with ampviz.Recorder(trained, opt, scaler=scaler, scheduler=sched, outputs=True, **recorder) as rec:
        for step in range(STEPS):
            model.plant(step)
            for x, y in data[step * accumulate:(step + 1) * accumulate]:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = trained(x, y)["loss"] / accumulate
                scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            before = scaler.get_scale()                  # the loop's own bookkeeping (a host sync)
            scaler.step(opt)
            scaler.update()
            if fault == "scheduler on skips" or scaler.get_scale() >= before:
                sched.step()
            opt.zero_grad(set_to_none=True)
            rec.step(loss)
    return rec.run


def lightning_loop(fault: str, precision: str) -> ampviz.Run:
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from ampviz.integrations.lightning import AmpvizCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net(fault)

        def training_step(self, batch, batch_idx):
            return self.net(*batch)["loss"]

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            if fault != "scheduler on skips":
                return opt
            # Lightning steps a step-interval scheduler after every optimizer step, skipped ones too
            return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup(opt), "interval": "step"}}

    class Plant(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            pl_module.net.plant(trainer.global_step)

    kwargs = (dict(precision="bf16-mixed") if precision == "bf16-mixed" else
              dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler_for(fault))], gradient_clip_val=1.0))
    data = batches(STEPS)
    loader = torch.utils.data.DataLoader(list(zip(*[torch.cat(t) for t in zip(*data)])), batch_size=32)
    callback = AmpvizCallback(outputs=True)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=STEPS, callbacks=[Plant(), callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|lr_scheduler.step).*")
        trainer.fit(Module(), loader)
    return callback.run


def hf_loop(fault: str, out_dir: str) -> ampviz.Run:
    """The HF Trainer on accelerate's fp16 path (fp16 autocast and a GradScaler, as on a GPU: accelerate 1.15 never
    enables them on a CPU by itself), default ``max_grad_norm=1.0``. Its default fused AdamW steps the scheduler on
    skipped steps (the scheduler fault); the other cells use adamw_torch, whose skipped steps accelerate sees."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ampviz.integrations.transformers import AmpvizCallback

    class Plant(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            model.plant(state.global_step)

    data = [{"x": x[i], "labels": int(y[i])} for x, y in batches(STEPS) for i in range(len(y))]
    args = TrainingArguments(output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=32, learning_rate=0.05,
                             optim="adamw_torch_fused" if fault == "scheduler on skips" else "adamw_torch",
                             lr_scheduler_type="constant_with_warmup", warmup_steps=10, fp16=True, use_cpu=True,
                             report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0)
    callback = AmpvizCallback(outputs=True)
    trainer = Trainer(model=Net(fault), args=args, train_dataset=data, callbacks=[Plant(), callback])
    trainer.accelerator.native_amp, trainer.accelerator.scaler = True, scaler_for(fault)
    trainer.train()
    return callback.run


def ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of the DDP row: every fault in turn, each rank seeing its own data, saved per fault."""
    import torch.distributed as dist
    from _ddp_worker import exit_worker
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)                                # a worker process of its own
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for i, fault in enumerate(FAULTS):
            plain_loop(fault, ddp=nn.parallel.DistributedDataParallel, seed=100 + rank,
                       path=os.path.join(out_dir, f"{i}.npz"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_worker()


def ddp_runs(out_dir: str) -> dict:
    """{fault: Run of both ranks} of the DDP row, from one pair of spawned processes."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(ddp_worker, args=(2, port, out_dir), nprocs=2, join=True)
    return {fault: ampviz.Run.merge([ampviz.Run.load(Path(out_dir) / f"{i}.rank{r}.npz") for r in (0, 1)])
            for i, fault in enumerate(FAULTS)}


def record(shape: str, fault: str, work: str) -> ampviz.Run:
    """The recorded run of one cell, on one CPU thread (these tiny fp16 matmuls run 10x faster so on a busy
    2-core machine); torch's thread count is put back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _record(shape, fault, work)
    finally:
        torch.set_num_threads(threads)


def _record(shape: str, fault: str, work: str, _ddp={}) -> ampviz.Run:      # noqa: B006 (a cache on purpose)
    """(The DDP row is recorded for every fault at once, then kept.)"""
    if shape == "plain":
        return plain_loop(fault)
    if shape == "clip":
        return plain_loop(fault, clip=True)
    if shape == "accumulate 4":
        return plain_loop(fault, accumulate=4)
    if shape.startswith("Lightning"):
        return lightning_loop(fault, "bf16-mixed" if "bf16" in shape else "16-mixed")
    if shape == "HF Trainer":
        return hf_loop(fault, os.path.join(work, "hf"))
    if work not in _ddp:
        _ddp[work] = ddp_runs(os.path.join(work, "ddp"))
    return _ddp[work][fault]


def cells():
    return [(shape, fault) for shape in SHAPES for fault in FAULTS if (shape, fault) not in NOT_APPLICABLE]


def cell_text(diagnosis: dict) -> str:
    return ", ".join(f"{f['check']} ({f['severity']})" for f in diagnosis["findings"]) or "clean"


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))          # _ddp_worker, for the spawned ranks
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for shape in SHAPES:
            rows.append([shape] + [NOT_APPLICABLE.get((shape, fault)) and "n/a" or
                                   cell_text(record(shape, fault, work).diagnose()) for fault in FAULTS])
    widths = [max(len(r[i]) for r in rows + [["loop shape \\ fault", *FAULTS]]) for i in range(len(FAULTS) + 1)]
    for row in [["loop shape \\ fault", *FAULTS]] + rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))
    print()
    for (shape, fault), why in NOT_APPLICABLE.items():
        print(f"n/a: {shape} x {fault}: {why}")


if __name__ == "__main__":
    main()
