"""A DeepSpeed ZeRO 2 run in bf16 on CPU ranks, recorded with ``ampviz.integrations.deepspeed.Recorder``.
Used by lessons 12b (a framework's Trainer, §6), which starts two ranks with :func:`ampviz.lessons.launch.launch`::

    from ampviz.lessons.deepspeed_zero import zero2
    from ampviz.lessons.launch import launch
    ranks = launch(zero2, nprocs=2, args=("runs/zero2",), timeout=300)    # then ampviz.Run.load("runs/zero2")

Each rank trains the digits MLP of lesson 12 on its own batches, with DeepSpeed's CPU accelerator and gloo, and
returns, as the oracle, the histograms of the **full** gradients at every optimizer step: DeepSpeed assembles them
itself (``safe_get_full_grad``, an all-reduce per parameter) after the last micro-batch's backward, before
``engine.step()``, where the Recorder reads this rank's partition.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings

import torch
import torch.nn.functional as F

from ..histogram import histogram
from .data import digits
from .models import MLP

__all__ = ["zero2"]


def zero2(path: str, steps: int = 8, accum: int = 2, batch: int = 16) -> dict:
    """Train ``steps`` optimizer steps of ``accum`` micro-batches under bf16 ZeRO 2 on this rank, recorded at ``path``
    (a directory: one ``rank{r}.npz`` per rank). Run on every rank (``launch``).

    Returns
    -------
    dict: ``full`` (steps, params, bins) the histograms of the full gradients, ``names`` and ``sizes`` of the
    parameters, ``skipped_steps`` (the engine's count), ``partition_size`` (the length of each rank's range of the
    flat gradient buffer, padding included, as DeepSpeed cut it: ``engine.optimizer.partition_size[0]``).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")         # read when deepspeed is imported: CPU ranks, gloo
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from ..integrations.deepspeed import Recorder
    with contextlib.redirect_stdout(io.StringIO()):       # "DeepSpeed ...shm_comm_op built successfully"
        deepspeed.init_distributed("gloo")
    # ZeRO 2 gathers its partitions with torch.distributed.all_gather_into_tensor, which torch 2.13 deprecates
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor", category=FutureWarning)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    net = MLP(64, 64, depth=2, d_out=10)
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": accum,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=3e-3),
                                      config=config)
    data = digits(seed=0)
    full = []                                              # (steps, params, bins): the oracle
    with Recorder(engine, path=path) as rec:
        for step in range(steps):
            for micro in range(accum):
                start = ((step * accum + micro) * world + rank) * batch          # each rank its own examples
                x, y = data.x_train[start:start + batch], data.y_train[start:start + batch]
                loss = F.cross_entropy(engine(x.to(torch.bfloat16)).float(), y)
                engine.backward(loss)
                if engine.is_gradient_accumulation_boundary():
                    # collective: every rank assembles every full gradient
                    full.append(torch.stack([histogram(safe_get_full_grad(p).float())
                                             for p in engine.module.parameters()]))
                engine.step()
                rec.step(loss)
    named = list(engine.module.named_parameters())
    return {"full": torch.stack(full), "names": [n for n, _ in named], "sizes": [p.numel() for _, p in named],
            "skipped_steps": int(engine.skipped_steps), "partition_size": int(engine.optimizer.partition_size[0])}
