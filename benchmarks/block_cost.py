"""What block statistics cost against a per-tensor histogram, on the same tensors in the same run.

    python benchmarks/block_cost.py                        # 4 tensors of 2048 x 2048 fp32 on the CPU
    python benchmarks/block_cost.py --device cuda

For each layout, ``ampviz.blocks.block_counts`` on every tensor (on the CPU: its numba kernel, and with
``AMPVIZ_COUNTER=torch`` its torch ops, the GPU's path), against the per-tensor binade histogram of the same
tensors counted by ``ampviz._counting``: the default counter for the device (numba on the CPU, Triton on a GPU) and
the torch-ops ``Binner`` (the same kind of ops block_counts uses). Median of ``--repeats`` timed rounds after one
warm-up; prints milliseconds per round and the ratio block / histogram.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ampviz._counting import NBINS, Binner, make_counter
from ampviz.blocks import LAYOUTS, block_counts


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` rounds, after one warm-up round."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def histogram_round(counter, tensors):
    def run():
        counter.target = torch.zeros(len(tensors) * NBINS, dtype=torch.int64, device=tensors[0].device)
        counter.add_many(tensors, list(range(len(tensors))))
        counter.submit()
        counter.wait()
    return run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--cols", type=int, default=2048, help="the blocked dimension (a multiple of 128)")
    p.add_argument("--tensors", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    tensors = [torch.randn(args.rows, args.cols, device=device) * 2.0 ** -i for i in range(args.tensors)]
    values = args.tensors * args.rows * args.cols
    print(f"{args.tensors} fp32 tensors of {args.rows} x {args.cols} ({values / 1e6:.1f} M values) on {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats}")
    counter = make_counter(device)
    baselines = {type(counter).__name__: timed(histogram_round(counter, tensors), args.repeats, device)}
    if not isinstance(counter, Binner):
        baselines["Binner (torch ops)"] = timed(histogram_round(Binner(device), tensors), args.repeats, device)
    counter.close()
    for name, seconds in baselines.items():
        print(f"  per-tensor histogram, {name:<20} {seconds * 1e3:9.2f} ms")
    for name in LAYOUTS:
        seconds = timed(lambda layout=name: [block_counts(t, layout, pad=True) for t in tensors], args.repeats, device)
        ratios = ", ".join(f"{seconds / base:6.1f}x {label}" for label, base in baselines.items())
        print(f"  block_counts {name:<12}                {seconds * 1e3:9.2f} ms   {ratios}")


if __name__ == "__main__":
    main()
