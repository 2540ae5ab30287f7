"""Small models (nothing here is ampviz-specific). Used by lessons 02 to 12 and the appendices; ``ampviz demo``,
``ampviz.examples`` and the benchmarks use them too (the first two through ``ampviz.examples.fixtures``).

    >>> import torch
    >>> from ampviz.lessons.models import MLP
    >>> MLP(64, 32, depth=2, d_out=10)(torch.zeros(5, 64)).shape
    torch.Size([5, 10])
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["MLP", "TransformerClassifier", "CharTransformer", "sigmoid_mlp", "relu_mlp"]

_ACTS = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "gelu": nn.GELU}


class MLP(nn.Module):
    """``depth`` hidden layers of ``width`` units with activation ``act``, then a linear head."""

    def __init__(self, d_in: int, width: int, depth: int, d_out: int, act: str = "relu"):
        super().__init__()
        if act not in _ACTS:
            raise ValueError(f"act: expected one of {sorted(_ACTS)}, got {act!r}")
        dims = [d_in] + [width] * depth
        layers = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b), _ACTS[act]()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(dims[-1], d_out)

    def forward(self, x):
        return self.head(self.body(x))


class TransformerClassifier(nn.Module):
    """A small transformer encoder over token ids, mean-pooled, then a linear classifier."""

    def __init__(self, vocab: int, n_classes: int, d_model: int = 64, heads: int = 4, layers: int = 2,
                 max_len: int = 64, dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(max_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=dropout, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, ids):
        h = self.tok(ids) + self.pos[: ids.shape[1]]
        return self.head(self.norm(self.encoder(h)).mean(dim=1))


class CharTransformer(nn.Module):
    """A causal character-level transformer language model (logits for every position)."""

    def __init__(self, vocab: int, d_model: int = 128, heads: int = 4, layers: int = 2, max_len: int = 128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids):
        T = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=ids.device)
        h = self.tok(ids) + self.pos(torch.arange(T, device=ids.device))
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


def sigmoid_mlp(seed: int = 0, depth: int = 6, width: int = 64, d_in: int = 64, d_out: int = 10,
                device=None) -> MLP:
    """The vanishing-gradient network of lessons 05/06: ``depth`` sigmoid layers of ``width`` units."""
    torch.manual_seed(seed)
    return MLP(d_in, width, depth, d_out, act="sigmoid").to(device or "cpu")


def relu_mlp(seed: int = 0, depth: int = 3, width: int = 128, d_in: int = 64, d_out: int = 10,
             device=None) -> MLP:
    """An ordinary ReLU MLP (milder, realistic underflow late in training)."""
    torch.manual_seed(seed)
    return MLP(d_in, width, depth, d_out, act="relu").to(device or "cpu")
