"""Benchmark models and their synthetic data: DLRM-style, its dense MLPs alone, an LSTM LM.

Every batch is generated from ``(seed, step)`` alone, for all ranks at once, so each variant
of a benchmark sees exactly the same data and every rank can compute global statistics
(unique rows of the global batch) without communicating.

* :class:`DLRM` -- one ``num_rows x dim`` ``EmbeddingBag`` (sum pooling) shared by
  ``fields`` categorical features of ``pooling`` ids each, a bottom MLP over 13 dense
  features, DLRM's pairwise dot-product interaction and a top MLP. The default MLPs are
  small (bottom 13-64-64, top 100-64-1: 16k parameters), so the embedding dominates the
  traffic; pass Criteo-like sizes (512, 256) for a heavier dense part. Ids are
  Zipf-distributed ranks (exponent 1.05) mapped through a fixed random permutation, as
  hashed categorical ids are: hot rows are scattered over the table, not packed at its
  start.
* :class:`DenseMLP` -- a DLRM bottom and top MLP without the embedding (dense only).
* :class:`LSTMLM` -- a word-level LSTM language model: a sparse input embedding over a
  ``vocab``-word vocabulary, one LSTM layer and a dense ``nn.Linear(hidden, vocab)`` output
  layer trained with a *sampled softmax*: logits only for the batch's candidate words (its
  targets plus ``negatives`` words drawn uniformly, shared by the batch). A full softmax
  over 200k words costs ~1.3 s of CPU per 320 tokens here, which would make the benchmark
  measure the CPU, not the network; with uniform negatives the log-Q correction is a
  constant and cancels. The output layer's gradient is still a dense ``vocab x hidden``
  tensor (the weight is indexed, not looked up through a sparse embedding), so every
  strategy treats it as the big dense parameter it is in the issue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


# ----------------------------------------------------------------------------- ids
class ZipfIds:
    """Ids in ``[0, n)`` whose frequency ranks follow Zipf(``exponent``), hot ids scattered.

    Rank ``k`` (1-based) has probability ``k^-exponent / H``; rank ``k`` maps to id
    ``perm[k-1]`` for a fixed random permutation (seed ``perm_seed``).
    """

    def __init__(self, n: int, exponent: float = 1.05, perm_seed: int = 1234) -> None:
        weights = torch.arange(1, n + 1, dtype=torch.float64).pow(-exponent)
        cdf = torch.cumsum(weights, 0)
        self.cdf = cdf / cdf[-1]
        self.perm = torch.randperm(n, generator=torch.Generator().manual_seed(perm_seed))
        self.n = n
        self.exponent = exponent

    def sample(self, count: int, gen: torch.Generator) -> torch.Tensor:
        u = torch.rand(count, generator=gen, dtype=torch.float64)
        ranks = torch.searchsorted(self.cdf, u).clamp_(max=self.n - 1)
        return self.perm[ranks]


@dataclass
class Batch:
    """One rank's batch: ``inputs`` for ``model(*inputs)``, ``target`` for the loss, and
    ``sparse_ids`` -- the rows of the sparse table this batch looks up (for byte bounds)."""

    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor
    sparse_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))


def _gen(seed: int, step: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)


def _mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# ----------------------------------------------------------------------------- DLRM
@dataclass(frozen=True)
class DLRMConfig:
    num_rows: int = 1_000_000
    dim: int = 64
    num_dense: int = 13
    fields: int = 8
    pooling: int = 2
    bottom: tuple[int, ...] = (64,)
    top: tuple[int, ...] = (64,)
    zipf: float = 1.05


class DLRM(nn.Module):
    """DLRM-style click model: sparse ``EmbeddingBag`` + MLPs + dot interaction."""

    def __init__(self, cfg: DLRMConfig, sparse: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.EmbeddingBag(cfg.num_rows, cfg.dim, mode="sum", sparse=sparse)
        bound = math.sqrt(1.0 / cfg.num_rows)  # DLRM's init: U(-sqrt(1/n), sqrt(1/n))
        nn.init.uniform_(self.embedding.weight, -bound, bound)
        self.bottom = _mlp([cfg.num_dense, *cfg.bottom, cfg.dim], last_relu=True)
        vectors = cfg.fields + 1
        self.top = _mlp([cfg.dim + vectors * (vectors - 1) // 2, *cfg.top, 1], last_relu=False)
        rows, cols = torch.triu_indices(vectors, vectors, 1)
        self.register_buffer("_rows", rows, persistent=False)
        self.register_buffer("_cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor
                ) -> torch.Tensor:
        x = self.bottom(dense)
        e = self.embedding(ids, offsets).view(dense.shape[0], self.cfg.fields, self.cfg.dim)
        z = torch.cat([x.unsqueeze(1), e], dim=1)
        inter = torch.bmm(z, z.transpose(1, 2))[:, self._rows, self._cols]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


class DenseMLP(nn.Module):
    """The DLRM's bottom and top MLPs on the dense features alone (no embedding)."""

    def __init__(self, cfg: DLRMConfig) -> None:
        super().__init__()
        self.bottom = _mlp([cfg.num_dense, *cfg.bottom, cfg.dim], last_relu=True)
        self.top = _mlp([cfg.dim, *cfg.top, 1], last_relu=False)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.top(self.bottom(dense)).squeeze(1)


class DLRMData:
    """Global DLRM batches: ``batches(step)`` -> one :class:`Batch` per rank."""

    def __init__(self, cfg: DLRMConfig, local_batch: int, world: int, seed: int = 0) -> None:
        self.cfg, self.local_batch, self.world, self.seed = cfg, local_batch, world, seed
        self.ids = ZipfIds(cfg.num_rows, cfg.zipf)

    def batches(self, step: int, dense_only: bool = False) -> list[Batch]:
        cfg, b = self.cfg, self.local_batch
        out = []
        for rank in range(self.world):
            g = _gen(self.seed, step, rank)
            dense = torch.randn(b, cfg.num_dense, generator=g)
            ids = self.ids.sample(b * cfg.fields * cfg.pooling, g)
            offsets = torch.arange(0, ids.numel(), cfg.pooling)
            target = (torch.rand(b, generator=g) < 0.25).float()
            if dense_only:
                out.append(Batch((dense,), target))
            else:
                out.append(Batch((dense, ids, offsets), target, ids))
        return out


def bce_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(output, target)


# ----------------------------------------------------------------------------- LSTM LM
@dataclass(frozen=True)
class LMConfig:
    vocab: int = 200_000
    emb: int = 64
    hidden: int = 128
    seq_len: int = 20
    negatives: int = 1024
    zipf: float = 1.05


class LSTMLM(nn.Module):
    """Sparse input embedding -> LSTM -> dense output layer (sampled softmax logits)."""

    def __init__(self, cfg: LMConfig, sparse: bool = True) -> None:
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab, cfg.emb, sparse=sparse)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        self.lstm = nn.LSTM(cfg.emb, cfg.hidden, batch_first=True)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab)

    def forward(self, tokens: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Logits ``[tokens, len(candidates)]`` over the candidate words only."""
        h, _ = self.lstm(self.embedding(tokens))
        w = self.decoder.weight[candidates]  # dense gradient: vocab x hidden
        return h.reshape(-1, h.shape[-1]) @ w.t() + self.decoder.bias[candidates]


class LMData:
    """Global LM batches: Zipf tokens; candidates = unique(targets + uniform negatives)."""

    def __init__(self, cfg: LMConfig, local_batch: int, world: int, seed: int = 0) -> None:
        self.cfg, self.local_batch, self.world, self.seed = cfg, local_batch, world, seed
        self.ids = ZipfIds(cfg.vocab, cfg.zipf)

    def batches(self, step: int) -> list[Batch]:
        cfg, b = self.cfg, self.local_batch
        out = []
        for rank in range(self.world):
            g = _gen(self.seed, step, rank)
            seq = self.ids.sample(b * (cfg.seq_len + 1), g).view(b, cfg.seq_len + 1)
            tokens, targets = seq[:, :-1].contiguous(), seq[:, 1:].reshape(-1)
            negatives = torch.randint(0, cfg.vocab, (cfg.negatives,), generator=g)
            candidates = torch.unique(torch.cat([targets, negatives]))
            labels = torch.searchsorted(candidates, targets)
            out.append(Batch((tokens, candidates), labels, tokens.reshape(-1)))
        return out


def ce_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
