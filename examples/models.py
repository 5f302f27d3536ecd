"""Small models for `stratagem plan --model examples/models.py:NAME` and the docs."""

from __future__ import annotations

from torch import nn


def mlp() -> nn.Module:
    """The demo's model (examples/train_mlp.py)."""
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 1))


def small_mlp() -> nn.Module:
    """The model of the hand-written strategies/mlp-mixed.yaml: parameters 0.weight [64, 32],
    0.bias [64], 2.weight [10, 64], 2.bias [10]."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


class Recommender(nn.Module):
    """A sparse embedding plus a dense tower: what Parallax is for."""

    def __init__(self, vocab: int = 100_000, dim: int = 32) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab, dim, mode="sum", sparse=True)
        self.tower = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids, offsets):  # noqa: ANN001, ANN201 - example
        return self.tower(self.embedding(ids, offsets))


class TinyLM(nn.Module):
    """A small language model with a couple of hundred parameter tensors (an embedding
    table, 16 transformer layers, a head): what `stratagem plan --picture` has to keep
    readable."""

    def __init__(self, vocab: int = 30_000, dim: int = 128, layers: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids):  # noqa: ANN001, ANN201 - example
        return self.head(self.encoder(self.embedding(ids)).mean(dim=1))
