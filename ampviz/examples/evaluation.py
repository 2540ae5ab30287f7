"""Evaluation for :class:`ampviz.examples.trainer.Trainer`: on one rank, or shared by every rank.

:meth:`Evaluation.evaluate` runs the unwrapped module on the whole split (no collectives, so rank 0
can call it alone); :meth:`Evaluation.evaluate_sharded` gives every rank its ``DistributedSampler``
share and trims the sampler's padding after one ``all_gather``, so each example counts once::

    loss, accuracy = trainer.evaluate(x_dev, y_dev)              # rank 0 alone
    loss, accuracy = trainer.evaluate_sharded(x_dev, y_dev)      # every rank, the same numbers
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["Evaluation"]


class Evaluation:
    """Mixed into ``Trainer``: needs ``self.module``, ``self.device``, ``self.rank``, ``self.world`` and
    ``self.autocast()``."""

    @torch.no_grad()
    def predict(self, x, batch: int = 512) -> torch.Tensor:
        """Logits of the unwrapped module (no collectives, so rank 0 can call it alone)."""
        was_training = self.module.training
        self.module.eval()
        out = []
        for i in range(0, len(x), batch):
            with self.autocast():
                out.append(self.module(x[i:i + batch].to(self.device)).float())
        self.module.train(was_training)
        return torch.cat(out)

    def evaluate(self, x, y) -> tuple[float, float]:
        """Mean cross-entropy and accuracy on the whole of (x, y)."""
        logits = self.predict(x)
        y = y.to(self.device)
        return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())

    @torch.no_grad()
    def evaluate_sharded(self, x, y, batch: int = 512) -> tuple[float, float]:
        """Mean cross-entropy and accuracy on the whole of (x, y), the work shared by every rank.

        Call it on **every** rank (it runs collectives). Rank r evaluates the indices a
        ``DistributedSampler(shuffle=False)`` gives it; the sampler pads the split with repeated
        examples so that it divides by the world size. ``all_gather`` collects every rank's
        per-example loss and correctness (equal lengths, thanks to the padding), and the padding
        is trimmed before averaging, so each example counts exactly once and every rank returns
        the numbers :meth:`evaluate` gives on one process.
        """
        from torch.utils.data import DistributedSampler
        n = len(y)
        mine = list(DistributedSampler(range(n), num_replicas=self.world, rank=self.rank, shuffle=False))
        idx = torch.tensor(mine, dtype=torch.long)
        logits = self.predict(x[idx], batch=batch)                          # (len(mine), classes)
        target = y[idx].to(self.device)
        per_example = torch.stack([F.cross_entropy(logits, target, reduction="none"),
                                   (logits.argmax(1) == target).float()], dim=1)   # (len(mine), 2)
        if self.world > 1:
            gathered = [torch.empty_like(per_example) for _ in range(self.world)]
            dist.all_gather(gathered, per_example)
            # rank r holds positions r, r + world, ...: interleave back to sampler order, then trim
            per_example = torch.stack(gathered, dim=1).reshape(-1, 2)
        loss, correct = per_example[:n].mean(dim=0).tolist()                # a host sync
        return loss, correct

    def report(self, x, y, labels=None) -> str:
        """scikit-learn's classification report on (x, y)."""
        from sklearn.metrics import classification_report
        pred = self.predict(x).argmax(1).cpu().numpy()
        names = labels if labels is not None else [str(c) for c in np.unique(y.cpu().numpy())]
        return classification_report(y.cpu().numpy(), pred, target_names=names, digits=3, zero_division=0)
