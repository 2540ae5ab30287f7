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
import torch.nn.functional as F
from tqdm.auto import tqdm

from .data import digits
from .models import MLP
from .record import Recorder
from .run import Run

__all__ = ["train_demo", "resolve_device", "DEMO_SETTINGS"]

# The measured setup of /prototypes/underflow/demo_sigmoid6.py: with growth_interval 20 the scale
# climbs from 2**16 in stairs and then saw-tooths, skipping a few per cent of the steps.
DEMO_SETTINGS = {"depth": 6, "width": 64, "act": "sigmoid", "batch": 256, "lr": 3e-3,
                 "init_scale": 2.0 ** 16, "growth_interval": 20}


def resolve_device(device: str = "auto") -> torch.device:
    """``"auto"`` -> cuda when available, else cpu; ``"cpu"``; ``"cuda"`` (error without a GPU)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device: expected 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but torch sees no CUDA device; use 'cpu' or 'auto'")
    return torch.device(device)


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
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    dev = resolve_device(device)
    data = digits(seed=0).to(dev)
    torch.manual_seed(seed)
    s = DEMO_SETTINGS
    model = MLP(64, s["width"], s["depth"], data.n_classes, act=s["act"]).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=s["lr"])
    scaler = torch.amp.GradScaler(dev.type, init_scale=s["init_scale"], growth_interval=s["growth_interval"])
    batches = torch.Generator().manual_seed(seed + 1)
    recorder = Recorder(model, optimizer, scaler=scaler, every=every)
    with recorder, tqdm(total=steps, desc=f"ampviz demo ({dev.type}, fp16)", unit="step",
                        disable=not progress) as bar:
        for _ in range(steps):
            idx = torch.randint(0, len(data.x_train), (s["batch"],), generator=batches).to(dev)
            with torch.autocast(dev.type, dtype=torch.float16):
                loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            recorder.step(loss)
            bar.update(1)
    run = recorder.run
    run.meta["demo"] = dict(s, steps=steps, seed=seed, test_accuracy=_accuracy(model, data))
    if path is not None:
        run.save(path)
    return run


@torch.no_grad()
def _accuracy(model, data) -> float:
    """Test accuracy of ``model`` in fp32 (a host sync, once, after training)."""
    return float((model(data.x_test).argmax(1) == data.y_test).float().mean())
