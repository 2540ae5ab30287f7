"""A short, real fp16 training run recorded with ampviz, twice: with a GradScaler, and without one
(what ``ampviz demo`` runs).

The model is a deliberately deep sigmoid MLP (64 -> 6 x 64 sigmoid -> 10) on scikit-learn's 8x8
digits, trained with Adam under fp16 autocast. Its first layers' gradients are tiny (vanishing
gradients): without a loss scale fp16 flushes every one of the first layer's gradients to zero, and
the model never leaves chance (10%); with ``torch.amp.GradScaler`` the same model, seed and batches
learn the digits (above 80% test accuracy on every one of ten seeds we tried, on a 2-core CPU), and
the scale's stairs, overflows and back-offs are real. On a GPU the same loop runs as ordinary CUDA
AMP (fp16 autocast + ``GradScaler("cuda")``)::

    >>> from ampviz.demo import train_demo
    >>> run = train_demo(steps=50, progress=False)         # doctest: +SKIP
    >>> run.summary()["steps"]                             # doctest: +SKIP
    50
    >>> lines = write_demo("demo/", progress=False)        # doctest: +SKIP
    >>> sorted(p.name for p in Path("demo").iterdir())     # doctest: +SKIP
    ['no_scaling.npz', 'report.html', 'run.npz']
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from ._args import check_int, resolve_device
from .examples.fixtures import digits, sigmoid_mlp
from .examples.trainer import train_classifier
from .run import Run

__all__ = ["train_demo", "write_demo", "DEMO_SETTINGS", "DEMO_STEPS"]

# 600 Adam steps at lr 1e-2 take this network off its plateau on every seed we tried (0-9: 83-93% test
# accuracy with a GradScaler, 10% without); with growth_interval 20 the scale climbs from 2**16 in stairs
# to 2**21 and then saw-tooths, skipping about 20 steps (tests/test_cli.py checks learning, stairs and skips).
DEMO_STEPS = 600
DEMO_SETTINGS = {"depth": 6, "width": 64, "act": "sigmoid", "batch": 256, "lr": 1e-2,
                 "init_scale": 2.0 ** 16, "growth_interval": 20}


@contextlib.contextmanager
def _one_thread(device: torch.device):
    """One CPU thread for the run (this small model trains faster so), restored afterwards."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_demo(steps: int = DEMO_STEPS, device: str = "auto", seed: int = 0, path=None, every: int = 1,
               progress: bool = True, scaling: bool = True) -> Run:
    """Train the demo MLP in fp16 for ``steps`` steps while recording it.

    Parameters
    ----------
    steps : number of optimizer steps (>= 1).
    device : "auto", "cpu" or "cuda".
    seed : seeds the model's initialisation and the batch order (0 to 2**32 - 1).
    path : if given, the run is also saved there (a ``.npz`` file).
    every : record histograms every ``every`` steps (the loss-scale trace keeps every step).
    progress : show a tqdm progress bar.
    scaling : True: a ``GradScaler`` (``DEMO_SETTINGS``); False: ``GradScaler(enabled=False)``, the same
        loop with no loss scaling at all.

    Returns
    -------
    Run
        The recorded run (weight gradients unscaled, activation gradients as computed, scaled);
        ``run.meta["demo"]`` holds the settings and the test accuracy.
    """
    for name, value in (("steps", steps), ("every", every)):
        check_int(name, value, low=1)
    check_int("seed", seed, low=0, high=2 ** 32 - 1)
    dev = resolve_device(device)
    s = DEMO_SETTINGS
    data = digits(seed=0).to(dev)
    model = sigmoid_mlp(seed=seed, depth=s["depth"], width=s["width"], device=dev)
    scaler = torch.amp.GradScaler(dev.type, init_scale=s["init_scale"], growth_interval=s["growth_interval"],
                                  enabled=bool(scaling))
    with _one_thread(dev):
        result = train_classifier(model, data, steps=steps, batch_size=s["batch"], lr=s["lr"],
                                  amp_dtype=torch.float16, scaler=scaler, seed=seed + 1, every=every,
                                  progress=progress)
    run = result.run
    run.meta["demo"] = dict(s, steps=steps, seed=seed, scaling=bool(scaling), test_accuracy=result.test_accuracy)
    if path is not None:
        run.save(path)
    return run


def write_demo(out, steps: int = DEMO_STEPS, device: str = "auto", seed: int = 0, progress: bool = True) -> list:
    """Record the demo with and without a GradScaler; write ``run.npz``, ``no_scaling.npz`` and a report.

    Returns the lines ``ampviz demo`` prints (what was trained, both test accuracies, the summary of
    the scaled run, the files written).
    """
    # the report needs plotly (the [viz] extra): imported here, so train_demo does not
    from .report import summary_rows, write_report
    check_int("seed", seed, low=0, high=2 ** 32 - 1)          # before anything is created
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"-o/--output: {out} exists and is not a directory")
    dev = resolve_device(device)                              # fail before creating anything
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runs = [train_demo(steps, dev.type, seed, out / name, progress=progress, scaling=scaling)
            for name, scaling in (("run.npz", True), ("no_scaling.npz", False))]
    seconds = time.perf_counter() - start
    write_report(runs, out / "report.html", labels=[f"fp16 with GradScaler ({dev.type})",
                                                    f"fp16 without loss scaling ({dev.type})"],
                 title="ampviz demo: the same fp16 run with and without a GradScaler")
    scaled, unscaled = (r.meta["demo"]["test_accuracy"] for r in runs)
    lines = [f"trained {steps} steps twice on {dev.type} in {seconds:.1f} s: test accuracy "
             f"{100 * scaled:.1f}% with GradScaler, {100 * unscaled:.1f}% without loss scaling (chance: 10%)"]
    lines += [f"  {label:<26}  {text}" for label, text in summary_rows(runs[0])]
    lines.append(f"wrote {out / 'run.npz'}, {out / 'no_scaling.npz'} and {out / 'report.html'}")
    return lines
