"""What live export to TensorBoard costs during training, against the two ways it used to work.

    python benchmarks/live_export.py [--steps 4000] [--every 50] [--layers 24]

A Recorder on an MLP of ``--layers`` Linear+Tanh pairs (2 x layers weight rows + layers activation rows)
trains ``--steps`` steps; every ``--every`` steps what is new is exported, the way the framework callbacks
do it. Timed separately, in the same process:

    snapshot   rec.snapshot(after=last written step): only the new steps' histograms are copied
    full       rec.run: every histogram recorded so far is copied (what live export did before)
    write      LiveExport.update: one TensorBoard event per step holding its scalars and histograms
    per-tag    torch's SummaryWriter.add_scalar / add_histogram_raw, one event per tag (as before)

Each is printed as seconds in total and milliseconds per training step, with the ratios.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz
from ampviz import export as E


def per_tag_writer(log_dir):
    """The writer live export used before: torch's SummaryWriter, one event per scalar and per histogram."""
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(log_dir=log_dir)

    def write(step, scalars, histograms):
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, global_step=step)
        for tag, (edges, counts) in histograms.items():
            centers = (edges[:-1] + edges[1:]) / 2
            writer.add_histogram_raw(tag, min=float(edges[0]), max=float(edges[-1]), num=int(counts.sum()),
                                     sum=float(centers @ counts), sum_squares=float(centers ** 2 @ counts),
                                     bucket_limits=edges[1:].tolist(), bucket_counts=counts.tolist(),
                                     global_step=step)
    return writer, write


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--every", type=int, default=50, help="steps between exports (a callback's export_every)")
    ap.add_argument("--layers", type=int, default=24)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    layers = []
    for _ in range(a.layers):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    t = dict.fromkeys(("snapshot", "full", "write", "per-tag"), 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        live = E.LiveExport(tensorboard=f"{tmp}/new")
        old, old_write = per_tag_writer(f"{tmp}/old")
        last = -1
        with ampviz.Recorder(model, opt, max_bytes=1 << 30) as rec:
            for s in range(a.steps):
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                rec.step()
                if (s + 1) % a.every:
                    continue
                t0 = time.perf_counter()
                recent = rec.snapshot(after=last)
                t1 = time.perf_counter()
                _ = rec.run                                  # the old way: every histogram so far
                t2 = time.perf_counter()
                live.update(recent)
                t4 = time.perf_counter()
                records = list(E._step_records(recent, 0, "recorded", "ampviz", after=last))
                for record in records:
                    old_write(*record)
                old.flush()
                t5 = time.perf_counter()
                t["snapshot"] += t1 - t0
                t["full"] += t2 - t1
                t["write"] += t4 - t2
                t["per-tag"] += t5 - t4
                last = records[-1][0]
            n_tensors = len(rec.tensor_names)
        live.close()
        old.close()
    print(f"torch {torch.__version__}, ampviz {ampviz.__version__}: {a.steps} steps, {n_tensors} tensors, "
          f"an export every {a.every} steps")
    for name, seconds in t.items():
        print(f"{name:<10}{seconds:>9.2f} s{seconds / a.steps * 1e3:>9.2f} ms/step")
    print(f"snapshot / full: {t['snapshot'] / t['full']:.3f}; write / per-tag: {t['write'] / t['per-tag']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
