"""How fast the counting kernels count, alone and inside a training step.

    python benchmarks/count_speed.py                       # the CPU kernels (numba)
    python benchmarks/count_speed.py --device cuda         # the GPU kernel (Triton) against the torch path

On the CPU:
1. alone: ``NumbaCounter.add`` on 4.2 M fp32 and 2 M bf16 values already in cache (median of 30);
2. in training: the capture benchmark's transformer (``capture_overhead.py``'s ``tfm``, bf16 autocast,
   AdamW) recorded with weights and activations; every count is timed where it runs (in the hooks) and
   divided by the values it counted.
Both print nanoseconds per value; the second also the counted values and counting time per step.

On a GPU: the weight gradients of one step of the capture benchmark's MLP (``--width``, fp16 autocast) counted
by the Triton kernel and by the torch path (``index_add_``), each timed with CUDA events over 50 repeats:
microseconds per step and GB/s read.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from ampviz import histogram as H
from ampviz._counting import cpu_kernels as B

sys.path.insert(0, str(Path(__file__).parent))
import capture_overhead as C  # noqa: E402


def alone() -> None:
    counter = B.NumbaCounter(threads=1)
    counter.target = torch.zeros(2, H.NBINS, dtype=torch.int64).view(-1)
    for x, label in ((torch.randn(4_200_000) * 1e-3, "fp32, 4.2 M values"),
                     (torch.randn(2_000_000).bfloat16(), "bf16, 2 M values")):
        counter.add(x, 0)
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            counter.add(x, 0)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        print(f"alone, {label}: {t * 1e3:.2f} ms, {t / x.numel() * 1e9:.2f} ns/value")


def in_training(steps: int = 100) -> None:
    spent = {"s": 0.0, "values": 0}
    add, add_many = B.NumbaCounter.add, B.NumbaCounter.add_many

    def timed_add(self, x, row):
        t0 = time.perf_counter()
        add(self, x, row)
        spent["s"] += time.perf_counter() - t0
        spent["values"] += x.numel()

    def timed_add_many(self, xs, rows):
        t0 = time.perf_counter()
        add_many(self, xs, rows)
        spent["s"] += time.perf_counter() - t0
        spent["values"] += sum(x.numel() for x in xs)

    B.NumbaCounter.add, B.NumbaCounter.add_many = timed_add, timed_add_many
    try:
        v = C.Variant("ampviz-all", "tfm", logdir="")
        v.block(10)                                          # warm-up
        spent.update(s=0.0, values=0)
        t0 = time.perf_counter()
        v.block(steps)
        step = (time.perf_counter() - t0) / steps
        v.close()
    finally:
        B.NumbaCounter.add, B.NumbaCounter.add_many = add, add_many
    per_step = spent["values"] / steps
    print(f"in training (transformer, weights + activations): {per_step / 1e6:.1f} M values and "
          f"{spent['s'] / steps * 1e3:.2f} ms of counting per {step * 1e3:.1f} ms step, "
          f"{spent['s'] / spent['values'] * 1e9:.2f} ns/value")


def on_gpu(width: int, repeats: int = 50) -> None:
    from ampviz._counting import Binner
    from ampviz._counting.gpu_kernel import TritonCounter, available

    v = C.Variant("base", "mlp", logdir="", device="cuda", amp="fp16", width=width)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = v.loss_fn(v.model, v.batch)
    loss.backward()
    grads = [p.grad for p in v.model.parameters()]
    values = sum(g.numel() for g in grads)
    counters = [("torch path (index_add_)", Binner("cuda", capacity=values))]
    if available():
        counters.insert(0, ("Triton kernel", TritonCounter("cuda")))
    for label, counter in counters:
        counter.target = torch.zeros(len(grads) * H.NBINS, dtype=torch.int64, device="cuda")
        counter.add_many(grads, list(range(len(grads))))       # warm-up: compiles the kernel
        counter.submit()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            counter.add_many(grads, list(range(len(grads))))
            counter.submit()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / repeats
        read = sum(g.numel() * g.element_size() for g in grads)
        print(f"{label}: {len(grads)} weight gradients, {values / 1e6:.1f} M values: {us:.1f} us per step, "
              f"{read / us / 1e3:.0f} GB/s")


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--width", type=int, default=4096, help="the MLP's width on a GPU")
    ap.add_argument("--steps", type=int, default=100, help="training steps timed on the CPU")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.device}")
    if a.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA device here")
        on_gpu(a.width)
    else:
        if not B.available():
            raise SystemExit("numba is not installed: pip install numba")
        alone()
        in_training(a.steps)
