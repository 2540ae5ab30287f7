"""Host memory of a long recorded run, as a ratio of the Recorder's ``max_bytes``.

    python benchmarks/recorder_memory.py                    # 20,000 steps, default max_bytes (256 MiB)
    python benchmarks/recorder_memory.py --steps 5000 --max-mib 64

A small MLP (24 Linear layers of width 16: 72 recorded tensors, 148 KB of histograms per step) is
trained on the CPU for ``--steps`` steps inside ``ampviz.Recorder(max_bytes=...)``; at that size the
histograms of 20,000 steps (2.96 GB) are 11x the default ``max_bytes``, so the recorder decimates.
A background thread samples the process's resident set (``/proc/self/statm``) every 2 ms. The figure
printed is the peak above the resident set just before the ``with`` block (after a warm-up run that
loads numba's kernels), covering the whole run, the flushes, decimations, building ``rec.run`` and
saving it, as a multiple of ``max_bytes``; the stated bound is ``max_bytes`` plus ``max_bytes / 16``
(the device ring, which on the CPU is host memory) plus 24 bytes per step of scalars.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampviz

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakSampler:
    """The largest resident set seen while the block runs (sampled every ``interval`` seconds)."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, rss(), threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        return False


def model_and_data(width: int = 16, depth: int = 24):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*layers)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, width, generator=g), torch.randint(0, width, (8,), generator=g)) for _ in range(64)]
    return model, data


def record(model, data, steps: int, max_bytes: int, path) -> ampviz.Run:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # one "reached max_bytes" warning per decimation
        with ampviz.Recorder(model, opt, max_bytes=max_bytes, path=path) as rec:
            for i in range(steps):
                x, y = data[i % len(data)]
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                rec.step(loss)
    return rec.run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--max-mib", type=int, default=256, help="Recorder max_bytes in MiB (default: the Recorder's)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    max_bytes = a.max_mib << 20
    model, data = model_and_data()
    with tempfile.TemporaryDirectory() as tmp:
        record(model, data, 20, max_bytes, None)          # warm-up: numba loads its kernels
        start = rss()
        t0 = time.perf_counter()
        with PeakSampler() as sampler:
            run = record(model, data, a.steps, max_bytes, os.path.join(tmp, "run.npz"))
        seconds = time.perf_counter() - t0
        saved = os.path.getsize(os.path.join(tmp, "run.npz"))
    tensors = len(run.tensor_names)
    row = tensors * ampviz.histogram.NBINS * 8
    print(f"torch {torch.__version__}, ampviz {ampviz.__version__}, python {sys.version.split()[0]}")
    print(f"{a.steps:,} steps of a {tensors}-tensor model ({row:,} bytes of histograms per step, "
          f"{a.steps * row / max_bytes:.1f}x max_bytes without decimation) in {seconds:.1f} s")
    print(f"max_bytes {max_bytes:,}; kept {run.hist_steps.size:,} histogram steps, every {run.meta['every']}, "
          f"{run.meta['decimated']} decimations; run file {saved:,} bytes")
    print(f"peak resident memory above the start: {sampler.peak - start:,} bytes = "
          f"{(sampler.peak - start) / max_bytes:.3f} x max_bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
