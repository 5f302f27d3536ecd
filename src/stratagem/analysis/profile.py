"""ModelProfile: what the planner needs to know about each trainable parameter."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

SPARSE_MODULES = (nn.Embedding, nn.EmbeddingBag)


@dataclass(frozen=True)
class ParamInfo:
    """One trainable parameter, counted once however many modules share it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    bytes: int
    sparse: bool = False
    aliases: tuple[str, ...] = ()
    module_type: str = ""
    embedding_like: bool = False

    @property
    def sparse_access(self) -> bool:
        """Whether a step touches only some rows, as far as the model's structure says: a
        gradient declared sparse (``sparse``: every user an embedding with ``sparse=True``),
        or an untied embedding table read by lookups (its gradient is dense, but non-zero
        only in the looked-up rows). A table tied to another module (``aliases``) is not:
        that user writes every row. Parallax and the parameter servers' row path use this."""
        return self.sparse or (self.embedding_like and not self.aliases)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class AccessStats:
    """How one training step reads a parameter's rows, measured (``planner.calibrate``).

    ``rows_touched``: rows with a non-zero gradient in one sample batch (unique: a row read
    twice counts once). ``overlap``: how the unique rows grow with the batch, ``U(k * b) ~
    rows_touched * k ** overlap`` (1: disjoint batches touch new rows, 0: the same rows);
    it also gives the rows that W workers touch together. ``hot_share``: the share of the
    batch's lookups that land on its most-read 1% of rows (skew; 0 when not measured).
    ``calls``: embedding-module calls that look the parameter up in one forward (a table
    looked up twice, or tied to two embedding modules: 2); a parameter-server table pulls
    its rows once per call.
    """

    name: str
    rows: int
    rows_touched: float
    overlap: float = 1.0
    hot_share: float = 0.0
    calls: int = 1

    @property
    def density(self) -> float:
        """Touched rows / all rows: 1.0 is a dense gradient."""
        return self.rows_touched / self.rows if self.rows else 1.0

    def union_rows(self, k: float) -> float:
        """Estimated unique rows of ``k`` sample batches together (k workers' batches)."""
        return min(float(self.rows), self.rows_touched * max(k, 1.0) ** self.overlap)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ModelProfile:
    """Trainable parameters in registration order (that order defines parameter indices).

    ``access``: measured row-access statistics of some parameters (empty until a
    calibration adds them with :meth:`with_access`)."""

    params: tuple[ParamInfo, ...]
    frozen: tuple[str, ...] = field(default_factory=tuple)
    access: tuple[AccessStats, ...] = field(default_factory=tuple)

    def with_access(self, stats: tuple[AccessStats, ...] | list[AccessStats]) -> ModelProfile:
        return ModelProfile(params=self.params, frozen=self.frozen, access=tuple(stats))

    def access_of(self, name: str) -> AccessStats | None:
        for a in self.access:
            if a.name == name:
                return a
        return None

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    @property
    def total_bytes(self) -> int:
        return sum(p.bytes for p in self.params)

    @property
    def dense_bytes(self) -> int:
        return sum(p.bytes for p in self.params if not p.sparse)

    @property
    def sparse_bytes(self) -> int:
        return sum(p.bytes for p in self.params if p.sparse)

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    def get(self, name: str) -> ParamInfo:
        for p in self.params:
            if p.name == name or name in p.aliases:
                return p
        raise KeyError(name)

    def index(self, name: str) -> int:
        return self.names.index(self.get(name).name)

    def summary(self) -> str:
        """One line: counts and sizes, and which parameters have sparse access, split into
        declared sparse (sparse gradients), embedding lookups (dense gradients, rows known)
        and, once calibrated, found row-sparse by measurement -- the same notion of sparse
        as the strategies' and plans' (:attr:`ParamInfo.sparse_access`)."""
        declared = sum(p.sparse for p in self.params)
        lookups = sum(p.sparse_access and not p.sparse for p in self.params)
        measured = sum(not p.sparse_access and a is not None and a.density < 1.0
                       for p in self.params for a in (self.access_of(p.name),))
        found = f", {measured} found by calibration" if self.access else ""
        return (
            f"{len(self.params)} trainable parameters ({self.num_params:,} values, "
            f"{self.total_bytes / 2**20:.1f} MiB; {declared + lookups + measured} with sparse "
            f"access: {declared} declared sparse, {lookups} embedding lookup"
            f"{'s' * (lookups != 1)}{found}), {len(self.frozen)} frozen"
        )


def analyze(model: nn.Module) -> ModelProfile:
    """Profile ``model``: shapes, bytes, sparse-gradient embeddings, tied and frozen params."""
    users: dict[int, list[nn.Module]] = {}  # every module holding the tensor (tied: several)
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), []).append(module)
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    infos, frozen, seen = [], [], set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if not p.requires_grad:
            frozen.append(name)
            continue
        mods = users.get(id(p), [])
        module = mods[0] if mods else None
        # Sparse only if every user emits a sparse gradient: a sparse embedding tied to a
        # Linear accumulates a dense gradient.
        sparse = bool(mods) and all(
            isinstance(m, SPARSE_MODULES) and getattr(m, "sparse", False) for m in mods)
        infos.append(
            ParamInfo(
                name=name,
                shape=tuple(p.shape),
                dtype=str(p.dtype).removeprefix("torch."),
                numel=p.numel(),
                bytes=p.numel() * p.element_size(),
                sparse=sparse,
                aliases=tuple(a for a in aliases[id(p)] if a != name),
                module_type=type(module).__name__ if module is not None else "",
                embedding_like=any(isinstance(m, SPARSE_MODULES) for m in mods),
            )
        )
    return ModelProfile(params=tuple(infos), frozen=tuple(frozen))


def named_trainable_parameters(model: nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) pairs in the order :func:`analyze` uses, shared ones once."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
