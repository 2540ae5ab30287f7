"""Step-time overhead of recording gradients, as ratios against no capture in the same process.

    python benchmarks/capture_overhead.py                 # both workloads, 20 rounds of 10-step blocks
    python benchmarks/capture_overhead.py --workload mlp --rounds 40
    python benchmarks/capture_overhead.py --device cuda --amp fp16 --width 4096   # GPU, GradScaler("cuda")

Workloads (CPU, bf16 autocast, AdamW): an MLP of 4 Linear(1024, 1024) at batch 512, and a
transformer encoder of 4 layers, d_model 256, sequence 128, batch 2. Variants, each with its own
copy of the model (same initial weights), optimizer and capture object:

    base            no capture
    read-floor      sum every weight gradient every step (the cost of just reading them)
    ampviz-weights  ampviz.Recorder(activations=False)
    ampviz-updates  ampviz.Recorder(activations=False, updates=True): weights + the weights' updates every 100
                    steps (a copy of the weights before the optimizer step, compared after); few blocks hold a
                    capture, so the line after the table measures one: blocks with a capture at every step
                    against blocks with none, and the ratio it adds at every=100, amortized
    ampviz-blocks   ampviz.Recorder(activations=False, blocks=True): weights + the block statistics of every
                    Linear's input, weight and output gradient in the 5 layouts every 100 steps; measured like
                    ampviz-updates (the line after the table: one capture, and its amortized ratio at every=100)
    ampviz-all      ampviz.Recorder(activations=True)   (weights + every leaf module's output grad)
    ampviz-every10  ampviz.Recorder(activations=True, every=10)
    ampviz-outputs  ampviz.Recorder(activations=False, outputs=True)   (weights + forward outputs)
    ampviz-all-out  ampviz.Recorder(activations=True, outputs=True)    (weights + output grads + outputs)
    ampviz-saved    ampviz-all with path= (a directory): the run is also saved while it records, every 60 s
                    by default (each save appends the steps since the previous one); the line after the
                    table gives the number of saves in the timed blocks and what one cost
    tensorboard     SummaryWriter.add_histogram on every weight gradient every step
    ampviz-hooks    ampviz-all with its counting switched off (not run unless named in --variants): what
                    the hooks themselves cost, the rest of ampviz-all being the counting

``--variants`` picks some (base is always run), e.g. to compare with an older ampviz that lacks outputs=.

Each round runs every variant for a block of ``--block`` consecutive steps, in a new random order
each round (a fixed rotation would always put the same variant after the slow TensorBoard one,
on cold caches). A block ends by waiting for the variant's own background work (ampviz's counts
on a GPU run asynchronously; TensorBoard writes on a thread), so no variant's work leaks into the
next variant's time. On the CPU ampviz counts inside the hooks, while torch waits. A variant's
ratio is the median over rounds of its block time divided by base's block time in the same round
(paired, so slow drifts of the machine cancel); the mean ratio is printed too, as a cost paid in a few
blocks only (a save) moves the mean, not the median.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz
from ampviz import histogram as H
from ampviz.lessons.models import CharTransformer

VARIANTS = ["base", "read-floor", "ampviz-weights", "ampviz-updates", "ampviz-blocks", "ampviz-all", "ampviz-every10",
            "ampviz-outputs", "ampviz-all-out", "ampviz-saved", "tensorboard"]
DIAGNOSTIC = ["ampviz-hooks"]


def make_workload(name: str, device="cpu", width: int = 1024):
    """(model, batch, loss_fn) with the same initial weights every call."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        layers = []
        for i in range(4):
            layers += [nn.Linear(width, width)] + ([nn.ReLU()] if i < 3 else [])
        model = nn.Sequential(*layers)
        batch = (torch.randn(512, width, generator=g), torch.randint(0, width, (512,), generator=g))
        loss_fn = lambda m, b: F.cross_entropy(m(b[0]).float(), b[1])  # noqa: E731
    else:
        model = CharTransformer(vocab=2048, d_model=256, heads=4, layers=4, max_len=128)
        ids = torch.randint(0, 2048, (2, 129), generator=g)
        batch = (ids[:, :-1], ids[:, 1:])
        loss_fn = lambda m, b: F.cross_entropy(m(b[0]).float().flatten(0, 1), b[1].flatten())  # noqa: E731
    return model.to(device), tuple(t.to(device) for t in batch), loss_fn


class Variant:
    def __init__(self, name: str, workload: str, logdir: str, device="cpu", amp="bf16", width: int = 1024):
        self.name, self.device = name, torch.device(device)
        self.dtype = torch.float16 if amp == "fp16" else torch.bfloat16
        self.model, self.batch, self.loss_fn = make_workload(workload, self.device, width)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler(self.device.type) if amp == "fp16" else None
        self.times: list[float] = []
        self.ratios: list[float] = []
        self.rec = self.writer = None
        self.step_i = 0
        self.save_seconds: list[float] = []
        if name.startswith("ampviz"):
            outputs = {"outputs": True} if name in ("ampviz-outputs", "ampviz-all-out") else {}
            path = {"path": f"{logdir}/{workload}-run"} if name == "ampviz-saved" else {}
            self.rec = ampviz.Recorder(self.model, self.opt, self.scaler,
                                       activations=name in ("ampviz-all", "ampviz-every10", "ampviz-all-out",
                                                            "ampviz-hooks", "ampviz-saved"),
                                       every=10 if name.endswith("10") else 1, max_bytes=1 << 30, **outputs, **path,
                                       updates=name == "ampviz-updates", blocks=name == "ampviz-blocks")
            self.rec.__enter__()
            self._time_saves()
            if name == "ampviz-hooks":                    # every hook fires; nothing is counted
                self.rec._recording.counter.add = lambda x, row: None
                self.rec._recording.counter.add_many = lambda xs, rows: None
        elif name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(f"{logdir}/{workload}")

    def _time_saves(self) -> None:
        """Record how long each periodic save takes (where this ampviz saves while recording)."""
        saver = getattr(self.rec, "_saver", None)
        if saver is None:
            return
        save = saver.save

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            save(*args, **kwargs)
            self.save_seconds.append(time.perf_counter() - t0)
        saver.save = timed

    def block(self, steps: int) -> float:
        """Run ``steps`` steps and wait for this variant's background work; seconds per step."""
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        if self.rec is not None:
            self.rec.wait()
        if self.writer is not None:
            self.writer.flush()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - t0) / steps

    def step(self) -> None:
        with torch.autocast(self.device.type, dtype=self.dtype):
            loss = self.loss_fn(self.model, self.batch)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        if self.name == "read-floor":
            total = torch.zeros((), device=self.device)
            for p in self.model.parameters():
                total += p.grad.sum()
        elif self.writer is not None:
            for n, p in self.model.named_parameters():
                self.writer.add_histogram(n, p.grad, self.step_i)
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.rec is not None:
            self.rec.step(loss)
        self.step_i += 1

    def close(self) -> None:
        if self.rec is not None:
            self.rec.close()
        if self.writer is not None:
            self.writer.close()


def bench(workload: str, rounds: int, warmup: int, block: int, logdir: str, names=VARIANTS, **setup) -> dict:
    variants = [Variant(v, workload, logdir, **setup) for v in names]
    rng = random.Random(0)
    for r in range(rounds + warmup):
        per_step = {v.name: v.block(block) for v in rng.sample(variants, len(variants))}
        if r >= warmup:
            for v in variants:
                v.times.append(per_step[v.name])
                v.ratios.append(per_step[v.name] / per_step["base"])
    med = {v.name: (statistics.median(v.times), statistics.median(v.ratios), statistics.fmean(v.ratios))
           for v in variants}
    update_cost = _capture_cost(variants, block, max(3, rounds // 2), "ampviz-updates", "updates")
    block_cost = _capture_cost(variants, block, max(3, rounds // 2), "ampviz-blocks", "blocks")
    recs = [v.rec for v in variants if v.rec is not None]
    n_tensors = max((len(r.tensor_names) for r in recs), default=0)
    saves = {v.name: list(v.save_seconds) for v in variants if v.save_seconds}
    steps_timed = (rounds + warmup) * block
    for v in variants:
        v.close()
    return {"median": med, "tensors": n_tensors, "params": sum(p.numel() for p in variants[0].model.parameters()),
            "saves": saves, "steps": steps_timed, "update_cost": update_cost, "block_cost": block_cost}


def _capture_cost(variants, block: int, pairs: int, name: str, attr: str):
    """(one capture in base steps, in s, bytes copied or None, every) of the variant ``name`` whose recording's
    ``attr`` (``updates``, ``blocks``) captures on its own period: blocks capturing at every step against blocks
    capturing at none, each pair with a base block (medians over pairs of the paired ratios, so the machine's
    drifts cancel); None without that variant."""
    upd = next((v for v in variants if v.name == name), None)
    if upd is None:
        return None
    base = next(v for v in variants if v.name == "base")
    recording = upd.rec._recording
    updates = getattr(recording, attr)
    every = updates.every
    extra, ratios = [], []
    for _ in range(pairs):
        base_s = base.block(block)
        updates.every = 1                                  # every step of this block captures
        updates.arm(recording.step_index)
        with_capture = upd.block(block)
        updates.every = 1 << 40                            # no step of this block does
        updates.arm(recording.step_index)
        extra.append(with_capture - upd.block(block))
        ratios.append(extra[-1] / base_s)
    updates.every = every
    updates.arm(recording.step_index)
    return statistics.median(ratios), statistics.median(extra), getattr(updates, "copy_bytes", None), every


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["mlp", "tfm", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--amp", choices=["bf16", "fp16"], default="bf16", help="fp16 adds a GradScaler")
    ap.add_argument("--width", type=int, default=1024, help="MLP width (a larger model on a GPU: 4096)")
    ap.add_argument("--block", type=int, default=10,
                    help="consecutive steps per variant per round (a multiple of 10: one every=10 capture per block)")
    ap.add_argument("--variants", default=",".join(VARIANTS[1:]),
                    help=f"comma-separated, from {', '.join(VARIANTS[1:] + DIAGNOSTIC)} (base is always run)")
    a = ap.parse_args(argv)
    names = ["base"] + [v for v in a.variants.split(",") if v and v != "base"]
    unknown = sorted(set(names) - set(VARIANTS) - set(DIAGNOSTIC))
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {VARIANTS[1:] + DIAGNOSTIC}")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ampviz {ampviz.__version__}, "
          f"{a.device}, {a.amp} autocast{' + GradScaler' if a.amp == 'fp16' else ''}")
    with tempfile.TemporaryDirectory() as logdir:
        for w in (["mlp", "tfm"] if a.workload == "both" else [a.workload]):
            res = bench(w, a.rounds, a.warmup, a.block, logdir, names, device=a.device, amp=a.amp, width=a.width)
            print(f"\n{w}: {res['params']:,} parameters; {a.rounds} rounds of {a.block}-step blocks "
                  f"after {a.warmup} warm-up rounds")
            print(f"{'variant':<16}{'median ms/step':>15}{'ratio':>8}{'mean ratio':>12}")
            for name, (t, ratio, mean) in res["median"].items():
                print(f"{name:<16}{t * 1e3:>15.2f}{ratio:>8.3f}{mean:>12.3f}")
            for name, seconds in res["saves"].items():
                print(f"{name}: {len(seconds)} saves in {res['steps']} steps (the last on close), "
                      f"{1e3 * statistics.median(seconds):.1f} ms each (median; max {1e3 * max(seconds):.1f} ms)")
            if res["update_cost"] is not None:
                steps, one, nbytes, every = res["update_cost"]
                weights = res["median"].get("ampviz-weights", res["median"]["ampviz-updates"])[1]
                print(f"ampviz-updates: one update capture costs {one * 1e3:.2f} ms = {steps:.3f} base steps "
                      f"(a copy of {nbytes / 2**20:.1f} MiB of weights on that step only); at every={every} it adds "
                      f"{steps / every:.4f} to the ratio: {weights + steps / every:.3f} amortized vs "
                      f"ampviz-weights {weights:.3f}")
            if res["block_cost"] is not None:
                steps, one, _, every = res["block_cost"]
                weights = res["median"].get("ampviz-weights", res["median"]["ampviz-blocks"])[1]
                print(f"ampviz-blocks: one block capture costs {one * 1e3:.2f} ms = {steps:.3f} base steps; at "
                      f"every={every} it adds {steps / every:.4f} to the ratio: {weights + steps / every:.3f} "
                      f"amortized vs ampviz-weights {weights:.3f}")
            per_step = res["tensors"] * H.NBINS * 8
            print(f"the largest ampviz variant keeps {res['tensors']} histograms x {H.NBINS} int64 bins = "
                  f"{per_step:,} bytes per recorded step on the host")
    return 0


if __name__ == "__main__":
    sys.exit(main())
