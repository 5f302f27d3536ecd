"""The auto-strategy benchmark's model zoo: seven models whose best strategy differs.

Each :class:`ZooModel` builds its model and its synthetic data from a seed alone, so every
variant and every rank sees the same weights and batches (``data(world, seed).batches(step)``
returns one :class:`models.Batch` per rank). Sizes put one CPU training step (1 thread) at
roughly 0.05-1 s; ``tiny=True`` gives a smaller copy of each for tests.

=================  ==========================================================================
``cnn``            dense CNN on 32x32 images (4 conv layers + 2 linear; 0.8 M parameters)
``transformer_lm`` 2-layer transformer LM, input and output embeddings tied (16k x 256)
``dlrm``           the DLRM-style model of ``models.py`` (250k x 64 sparse ``EmbeddingBag``)
``lstm_lm``        the LSTM LM of ``models.py``: 200k words, sampled softmax through
                   ``decoder.weight[candidates]`` (~1,400 rows per step of a 102 MB layer)
``wide_deep``      wide part (1M x 1 sparse bag of crossed ids) + deep part (8 dense-declared
                   50k x 16 tables, MLP 141-1024-512-256-1)
``many_small``     120 blocks of Linear(64, 64) + LayerNorm(64): 482 tensors, 2 MB
``hybrid``         38 MB of dense MLP (fp16 all-reduce pays) next to a 400k x 32 embedding
                   declared dense but looked up ~500 times per worker per step (a PS pays): no
                   built-in builder does both
=================  ==========================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from models import (
    DLRM,
    LSTMLM,
    Batch,
    DLRMConfig,
    DLRMData,
    LMConfig,
    LMData,
    ZipfIds,
    _gen,
    _mlp,
    bce_loss,
    ce_loss,
)
from torch import nn


# ----------------------------------------------------------------------------- models
class CNN(nn.Module):
    """Four 3x3 conv layers (pooling after the last three) and a two-layer classifier."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4 * w, 4 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(4 * w * 16, 256), nn.ReLU(),
                                        nn.Linear(256, classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


class TiedTransformerLM(nn.Module):
    """Causal transformer LM whose output projection is the input embedding (tied): its
    gradient is dense in every row (the softmax writes them all)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embedding.weight, std=0.02)  # also the output layer: small logits
        self.position = nn.Parameter(torch.zeros(seq_len, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.decoder = nn.Linear(dim, vocab, bias=False)
        self.decoder.weight = self.embedding.weight  # tied
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), 1)
        self.register_buffer("_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embedding(tokens) + self.position[:n]
        h = self.blocks(h, mask=self._mask[:n, :n], is_causal=True)
        return self.decoder(h).reshape(-1, self.decoder.out_features)


class WideDeep(nn.Module):
    """Wide & deep: a linear model over crossed ids (a 1-wide sparse ``EmbeddingBag``) plus
    an MLP over dense features and per-field embeddings declared dense (``sparse=False``)."""

    def __init__(self, wide_rows: int, fields: int, field_rows: int, dim: int,
                 hidden: tuple[int, ...], num_dense: int = 13) -> None:
        super().__init__()
        self.wide = nn.EmbeddingBag(wide_rows, 1, mode="sum", sparse=True)
        nn.init.zeros_(self.wide.weight)
        self.tables = nn.ModuleList(nn.Embedding(field_rows, dim) for _ in range(fields))
        self.deep = _mlp([num_dense + fields * dim, *hidden, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, field_ids: torch.Tensor, cross_ids: torch.Tensor
                ) -> torch.Tensor:
        emb = [t(field_ids[:, i]) for i, t in enumerate(self.tables)]
        deep = self.deep(torch.cat([dense, *emb], dim=1)).squeeze(1)
        offsets = torch.arange(0, cross_ids.numel(), cross_ids.shape[1])
        return deep + self.wide(cross_ids.reshape(-1), offsets).squeeze(1)


class ManySmall(nn.Module):
    """A deep residual stack of small layers: hundreds of tiny tensors, where per-message
    latency and grouping decide the all-reduce time, not bytes."""

    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
                                    for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + 0.1 * torch.tanh(block(x))  # bounded: stays trainable 120 blocks deep
        return self.head(x).squeeze(1)


class Hybrid(nn.Module):
    """A big dense MLP tower (bandwidth-bound: compress it) and a big embedding declared
    dense whose gradient touches few rows (send rows to parameter servers)."""

    def __init__(self, num_dense: int, width: int, depth: int, rows: int, dim: int) -> None:
        super().__init__()
        self.tower = _mlp([num_dense, *[width] * depth, dim], last_relu=True)
        self.embedding = nn.EmbeddingBag(rows, dim, mode="sum")  # sparse=False
        bound = math.sqrt(1.0 / rows)
        nn.init.uniform_(self.embedding.weight, -bound, bound)
        self.head = nn.Linear(2 * dim, 1)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor
                ) -> torch.Tensor:
        return self.head(torch.cat([self.tower(dense), self.embedding(ids, offsets)],
                                   dim=1)).squeeze(1)


# ----------------------------------------------------------------------------- data
class _Data:
    """Per-rank batches from ``(seed, step, rank)``: ``make(gen) -> Batch``."""

    def __init__(self, world: int, seed: int, make: Callable[[torch.Generator], Batch]) -> None:
        self.world, self.seed, self.make = world, seed, make

    def batches(self, step: int) -> list[Batch]:
        return [self.make(_gen(self.seed, step, rank)) for rank in range(self.world)]


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


@dataclass(frozen=True)
class ZooModel:
    """One benchmark model: how to build it, its data and loss, and what it stands for."""

    name: str
    summary: str
    make: Callable[[], nn.Module]
    data: Callable[[int, int], Any]  # (world, seed) -> object with batches(step)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    local_batch: int
    config: dict[str, Any] = field(default_factory=dict)


def _cnn(tiny: bool) -> ZooModel:
    width, batch = (4, 4) if tiny else (32, 16)

    def make(g: torch.Generator) -> Batch:
        return Batch((torch.randn(batch, 3, 32, 32, generator=g),),
                     torch.randint(0, 10, (batch,), generator=g))

    return ZooModel("cnn", "dense CNN", lambda: CNN(width),
                    lambda world, seed: _Data(world, seed, make), ce_loss, batch,
                    {"width": width, "image": [3, 32, 32]})


def _transformer(tiny: bool) -> ZooModel:
    vocab, dim, layers, seq, batch = (512, 16, 1, 8, 2) if tiny else (16384, 256, 2, 32, 8)
    ids = ZipfIds(vocab)

    def make(g: torch.Generator) -> Batch:
        seqs = ids.sample(batch * (seq + 1), g).view(batch, seq + 1)
        return Batch((seqs[:, :-1].contiguous(),), seqs[:, 1:].reshape(-1))

    return ZooModel("transformer_lm", "transformer LM, tied input/output embedding",
                    lambda: TiedTransformerLM(vocab, dim, layers, 4 if not tiny else 2, seq),
                    lambda world, seed: _Data(world, seed, make), ce_loss, batch,
                    {"vocab": vocab, "dim": dim, "layers": layers, "seq_len": seq})


def _dlrm(tiny: bool) -> ZooModel:
    cfg = DLRMConfig(num_rows=2000 if tiny else 250_000, dim=8 if tiny else 64)
    batch = 8 if tiny else 256
    return ZooModel("dlrm", "DLRM-style, sparse EmbeddingBag", lambda: DLRM(cfg, sparse=True),
                    lambda world, seed: DLRMData(cfg, batch, world, seed), bce_loss, batch,
                    {"table": [cfg.num_rows, cfg.dim], "fields": cfg.fields,
                     "pooling": cfg.pooling})


def _lstm(tiny: bool, vocab: int) -> ZooModel:
    cfg = LMConfig(vocab=1000, emb=8, hidden=16, seq_len=4, negatives=32) if tiny \
        else LMConfig(vocab=vocab)
    batch = 2 if tiny else 32
    return ZooModel("lstm_lm", "LSTM LM, sampled softmax over a dense output layer",
                    lambda: LSTMLM(cfg, sparse=True),
                    lambda world, seed: LMData(cfg, batch, world, seed), ce_loss, batch,
                    {"vocab": cfg.vocab, "hidden": cfg.hidden, "negatives": cfg.negatives,
                     "output_layer_bytes": cfg.vocab * (cfg.hidden + 1) * 4})


def _wide_deep(tiny: bool) -> ZooModel:
    wide_rows, fields, rows, dim = (1000, 2, 100, 4) if tiny else (1_000_000, 8, 50_000, 16)
    hidden = (16,) if tiny else (1024, 512, 256)
    batch, crosses = (4, 2) if tiny else (256, 4)
    field_ids, cross_ids = ZipfIds(rows), ZipfIds(wide_rows)

    def make(g: torch.Generator) -> Batch:
        dense = torch.randn(batch, 13, generator=g)
        f = field_ids.sample(batch * fields, g).view(batch, fields)
        c = cross_ids.sample(batch * crosses, g).view(batch, crosses)
        return Batch((dense, f, c), (torch.rand(batch, generator=g) < 0.25).float(), c)

    return ZooModel("wide_deep", "wide (sparse) and deep (dense-declared embeddings)",
                    lambda: WideDeep(wide_rows, fields, rows, dim, hidden),
                    lambda world, seed: _Data(world, seed, make), bce_loss, batch,
                    {"wide_rows": wide_rows, "fields": fields, "field_rows": rows,
                     "dim": dim, "hidden": list(hidden)})


def _many_small(tiny: bool) -> ZooModel:
    blocks, width, batch = (10, 8, 4) if tiny else (120, 64, 64)

    def make(g: torch.Generator) -> Batch:
        return Batch((torch.randn(batch, width, generator=g),),
                     torch.randn(batch, generator=g))

    return ZooModel("many_small", "hundreds of small tensors",
                    lambda: ManySmall(blocks, width),
                    lambda world, seed: _Data(world, seed, make), mse_loss, batch,
                    {"blocks": blocks, "width": width, "tensors": 4 * blocks + 2})


def _hybrid(tiny: bool) -> ZooModel:
    num_dense, width, depth = (8, 16, 2) if tiny else (512, 2048, 3)
    rows, dim, batch, lookups = (1000, 4, 4, 2) if tiny else (400_000, 32, 32, 16)
    ids = ZipfIds(rows)

    def make(g: torch.Generator) -> Batch:
        dense = torch.randn(batch, num_dense, generator=g)
        i = ids.sample(batch * lookups, g)
        return Batch((dense, i, torch.arange(0, i.numel(), lookups)),
                     (torch.rand(batch, generator=g) < 0.25).float(), i)

    return ZooModel("hybrid", "big dense tower + big dense-declared embedding",
                    lambda: Hybrid(num_dense, width, depth, rows, dim),
                    lambda world, seed: _Data(world, seed, make), bce_loss, batch,
                    {"tower": [num_dense, *[width] * depth, dim], "table": [rows, dim],
                     "lookups_per_sample": lookups})


MODEL_NAMES = ("cnn", "transformer_lm", "dlrm", "lstm_lm", "wide_deep", "many_small", "hybrid")


def zoo(tiny: bool = False, lstm_vocab: int = 200_000) -> dict[str, ZooModel]:
    """Every zoo model by name (``tiny``: small copies for tests)."""
    return {m.name: m for m in (_cnn(tiny), _transformer(tiny), _dlrm(tiny),
                                _lstm(tiny, lstm_vocab), _wide_deep(tiny), _many_small(tiny),
                                _hybrid(tiny))}
