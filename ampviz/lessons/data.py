"""Small real data sets that ship inside installed packages (no downloads), as tensors. Used by lessons 01 to
13 and the appendices; ``ampviz demo`` and ``ampviz.examples`` take them through ``ampviz.examples.fixtures``.

    >>> from ampviz.lessons.data import digits
    >>> d = digits(seed=0)
    >>> d.x_train.shape, d.n_classes
    (torch.Size([1347, 64]), 10)
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch

from .._args import check_int, resolve_device

__all__ = ["Split", "digits", "digit_rows", "diabetes", "python_source_text", "default_device"]


def default_device() -> torch.device:
    """``cuda`` when a GPU is present, otherwise ``cpu``."""
    return resolve_device("auto")


@dataclass
class Split:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int

    def to(self, device) -> Split:
        return Split(*(t.to(device) for t in (self.x_train, self.y_train, self.x_test, self.y_test)), self.n_classes)


def digits(seed: int = 0, test_size: float = 0.25, normalize: bool = True) -> Split:
    """scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), stratified split.

    Pixels are 0..16; ``normalize`` divides by 16.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / (16.0 if normalize else 1.0)
    y = torch.tensor(d.target, dtype=torch.long)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_size, random_state=seed, stratify=y)
    return Split(xtr, ytr, xte, yte, 10)


def digit_rows(seed: int = 0, test_size: float = 0.25, levels: int = 17) -> Split:
    """The digits as sequences of 8 tokens (one per pixel row) for a transformer.

    Each row of 8 pixels (values 0..16) becomes one token id: the row is quantised to 3 levels
    per pixel and read as a base-3 number, so the vocabulary has 3**8 = 6,561 ids.
    """
    s = digits(seed, test_size, normalize=False)

    def tokens(x):
        q = torch.bucketize(x.view(-1, 8, 8), torch.tensor([5.0, 11.0]))       # 0, 1, 2 per pixel
        return (q * (3 ** torch.arange(8))).sum(-1)                             # (N, 8) token ids
    return Split(tokens(s.x_train), s.y_train, tokens(s.x_test), s.y_test, 10)


def diabetes(test_size: float = 0.2, seed: int = 0) -> Split:
    """scikit-learn's diabetes regression data: standardised features, raw targets (25..346)."""
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split
    x, y = load_diabetes(return_X_y=True)
    x = torch.tensor(x / x.std(0), dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_size, random_state=seed)
    return Split(xtr, ytr, xte, yte, 0)


def python_source_text(n_chars: int = 400_000) -> tuple[torch.Tensor, list]:
    """Characters of the Python standard library's own source files (printable ASCII + newline).

    Returns ``(ids, vocab)``: a long tensor of character ids and the sorted list of characters.
    Deterministic: files are read in sorted order from the running interpreter's stdlib.
    """
    check_int("n_chars", n_chars, low=1000)
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        parts.append("".join(c if 32 <= ord(c) < 127 or c == "\n" else " " for c in text))
        total += len(parts[-1])
        if total >= n_chars:
            break
    text = "".join(parts)[:n_chars]
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), vocab
