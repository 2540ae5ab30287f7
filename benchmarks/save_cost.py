"""What saving while recording costs: the time of each periodic save, against the step time of the same run.

    python benchmarks/save_cost.py                     # 600 steps, a save every 200 steps
    python benchmarks/save_cost.py --steps 3000 --save-every-steps 1000

Records capture_overhead.py's MLP workload (bf16 autocast on the CPU, AdamW, ``activations=True``) into a
temporary directory with ``save_every_steps`` and times every ``Saver.save`` (each appends the steps recorded
since the previous one; the last is the save on close). The Recorder's default is a save every 60 s
(``save_every=60``): the last line gives one save's share of 60 s of training.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from capture_overhead import make_workload

import ampviz
from ampviz.record import _save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--save-every-steps", type=int, default=200)
    ap.add_argument("--width", type=int, default=1024, help="MLP width")
    args = ap.parse_args()
    model, batch, loss_fn = make_workload("mlp", width=args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seconds: list[float] = []
    save = _save.Saver.save

    def timed(self, *a, **k):
        start = time.perf_counter()
        save(self, *a, **k)
        seconds.append(time.perf_counter() - start)

    _save.Saver.save = timed
    try:
        with tempfile.TemporaryDirectory() as d:
            start = time.perf_counter()
            with ampviz.Recorder(model, opt, activations=True, path=f"{d}/run",
                                 save_every_steps=args.save_every_steps) as rec:
                for _ in range(args.steps):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = loss_fn(model, batch)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    rec.step(loss)
            total = time.perf_counter() - start
    finally:
        _save.Saver.save = save
    step_ms = 1000 * (total - sum(seconds)) / args.steps
    periodic = seconds[:-1] or seconds
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ampviz {ampviz.__version__}; "
          f"{len(rec.run.tensor_names)} tensors, {args.steps} steps at {step_ms:.1f} ms/step")
    print("saves (ms): " + ", ".join(f"{1000 * s:.1f}" for s in seconds) + " (the last on close)")
    each = statistics.median(periodic)
    print(f"one save of {args.save_every_steps} steps: {1000 * each:.1f} ms = {each / (step_ms / 1000):.2f} steps' "
          f"time; at the default of one save per 60 s: {100 * each / 60:.3f}% of the training time")


if __name__ == "__main__":
    main()
