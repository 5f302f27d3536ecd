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

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ModelProfile:
    """Trainable parameters in registration order (that order defines parameter indices)."""

    params: tuple[ParamInfo, ...]
    frozen: tuple[str, ...] = field(default_factory=tuple)

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
        sparse = sum(p.sparse for p in self.params)
        return (
            f"{len(self.params)} trainable parameters ({self.num_params:,} values, "
            f"{self.total_bytes / 2**20:.1f} MiB; {sparse} sparse), {len(self.frozen)} frozen"
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
