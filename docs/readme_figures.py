"""Make the two pictures in the README from real recorded runs (CPU, about 15 s).

    python docs/readme_figures.py                # writes docs/histogram.png and docs/scale_trace.png
    python docs/readme_figures.py --out DIR      # writes them to DIR instead (tests/test_docs.py does)

It records the demo twice, as ``ampviz demo`` does (with a GradScaler and without loss scaling), draws
the scaled run, and prints the numbers the README's Quick start quotes.
"""

import argparse
from pathlib import Path

import numpy as np

from ampviz import histogram as H
from ampviz.demo import train_demo
from ampviz.plots import histogram_figure, scale_trace_figure

DOCS = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DOCS, help="directory for the PNGs (default: docs/)")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    run, unscaled = (train_demo(seed=0, progress=False, scaling=s) for s in (True, False))
    acts = run.tensors_of("activation")
    first_steps = run.counts_in("unscaled")[0, :20][:, acts]          # (steps, tensors, bins)
    fig = histogram_figure(first_steps, "fp16", log2_scale=0, domain="unscaled",
                           title="Activation gradients of a deep sigmoid MLP, first 20 steps,")
    fig.write_image(out / "histogram.png", width=1000, height=460)
    fig = scale_trace_figure(run.steps, run.loss_scale[0], run.skipped[0], run.grown[0],
                             title="GradScaler's loss scale in the same fp16 run (CPU)")
    fig.write_image(out / "scale_trace.png", width=1000, height=380)
    flushed = H.fate(first_steps.sum(axis=(0, 1)), "fp16", log2_scale=0).fraction("flushed")
    accuracy = {name: r.meta["demo"]["test_accuracy"] for name, r in (("GradScaler", run), ("no scaling", unscaled))}
    print(f"test accuracy {100 * accuracy['GradScaler']:.1f}% with GradScaler, {100 * accuracy['no scaling']:.1f}% "
          f"without; first 20 steps' activation gradients flushed without a scale: {100 * flushed:.0f}%; "
          f"skipped {int(run.skipped.sum())} of {run.n_steps} steps; scale 2^{np.log2(run.loss_scale.min()):.0f}"
          f"..2^{np.log2(run.loss_scale.max()):.0f}")


if __name__ == "__main__":
    main()
