"""A short, real fp16 training run, recorded with ampviz (what ``ampviz demo`` runs).

The model is a deliberately deep sigmoid MLP (64 -> 6 x 64 sigmoid -> 10) on scikit-learn's
8x8 digits, trained with Adam under fp16 autocast and a ``torch.amp.GradScaler``: its first
layers' gradients are tiny (vanishing gradients), so fp16 underflow and the scaler's stairs
and back-offs are real, visible within a few hundred steps, and cheap on a 2-core CPU
(about 8 ms per step: this CPU has no fast fp16 matmul, so the model stays small). On a GPU the
same loop runs as ordinary CUDA AMP (fp16 autocast + ``GradScaler("cuda")``)::

    >>> from ampviz.demo import train_demo
    >>> run = train_demo(steps=50, progress=False)         # doctest: +SKIP
    >>> run.summary()["steps"]                             # doctest: +SKIP
    50
"""

from __future__ import annotations

import torch

from ._args import check_int, resolve_device
from .examples.data import digits
from .examples.models import sigmoid_mlp
from .examples.trainer import train_classifier
from .run import Run

__all__ = ["train_demo", "DEMO_SETTINGS"]

# With growth_interval 20 the scale climbs from 2**16 in stairs and then saw-tooths, skipping a few
# per cent of the steps (measured on a 2-core CPU; tests/test_cli.py checks the stairs and skips).
DEMO_SETTINGS = {"depth": 6, "width": 64, "act": "sigmoid", "batch": 256, "lr": 3e-3,
                 "init_scale": 2.0 ** 16, "growth_interval": 20}


def train_demo(steps: int = 300, device: str = "auto", seed: int = 0, path=None, every: int = 1,
               progress: bool = True) -> Run:
    """Train the demo MLP in fp16 with a GradScaler for ``steps`` steps while recording it.

    Parameters
    ----------
    steps : number of optimizer steps (>= 1).
    device : "auto", "cpu" or "cuda".
    seed : seeds the model's initialisation and the batch order.
    path : if given, the run is also saved there (a ``.npz`` file).
    every : record histograms every ``every`` steps (the loss-scale trace keeps every step).
    progress : show a tqdm progress bar.

    Returns
    -------
    Run
        The recorded run (weight gradients unscaled, activation gradients as computed, scaled).
    """
    for name, value in (("steps", steps), ("every", every)):
        check_int(name, value, low=1)
    dev = resolve_device(device)
    s = DEMO_SETTINGS
    data = digits(seed=0).to(dev)
    model = sigmoid_mlp(seed=seed, depth=s["depth"], width=s["width"], device=dev)
    scaler = torch.amp.GradScaler(dev.type, init_scale=s["init_scale"], growth_interval=s["growth_interval"])
    result = train_classifier(model, data, steps=steps, batch_size=s["batch"], lr=s["lr"], amp_dtype=torch.float16,
                              scaler=scaler, seed=seed + 1, every=every, progress=progress)
    run = result.run
    run.meta["demo"] = dict(s, steps=steps, seed=seed, test_accuracy=result.test_accuracy)
    if path is not None:
        run.save(path)
    return run
