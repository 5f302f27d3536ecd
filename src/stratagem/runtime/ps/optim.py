"""Owner-side optimizers: the user's update rule applied to the shards a rank owns.

An owner runs, over its shards, an optimizer of the same class and hyperparameters as the
user's optimizer that holds the parameter, and before every update copies the current
hyperparameters (``lr`` and the rest) from the user's param groups, so LR schedulers keep
working. Dedicated servers receive those values from the chief with each update.

Only elementwise optimizers can be sharded (each element's update depends on that element
only, so updating slices separately equals updating the whole). Sparse pieces (embedding
rows) use torch's sparse rules: ``SGD`` and ``Adagrad`` as torch applies them to sparse
gradients, ``Adam`` as ``SparseAdam`` (lazy: only the rows present in the gradient update
their moments and values, with one step count per parameter), ``AdamW`` as ``SparseAdam``
plus decoupled weight decay of the touched rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from stratagem.errors import StrategyError

DENSE_OK = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
            torch.optim.Adamax, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.NAdam,
            torch.optim.RAdam, torch.optim.ASGD)
SKIP_KEYS = frozenset({"params", "foreach", "fused", "differentiable", "capturable",
                       "decoupled_weight_decay"})


class LazyAdamW(torch.optim.SparseAdam):
    """SparseAdam plus AdamW's decoupled weight decay, applied to the touched rows only."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, maximize: bool = False) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, maximize=maximize)
        for g in self.param_groups:
            g.setdefault("weight_decay", weight_decay)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            decay = 1.0 - group["lr"] * group["weight_decay"]
            if decay == 1.0:
                continue
            for p in group["params"]:
                if p.grad is not None:
                    rows = p.grad.coalesce().indices()[0]
                    p.index_copy_(0, rows, p.index_select(0, rows) * decay)
        return super().step(closure)


def sparse_class(opt: torch.optim.Optimizer, group: dict[str, Any], where: str) -> type:
    """The torch optimizer class that applies ``opt``'s rule to sparse gradient rows."""
    cls = type(opt)
    if cls is torch.optim.SGD or cls is torch.optim.Adagrad:
        if group.get("weight_decay", 0):
            raise StrategyError(f"{cls.__name__} with weight_decay on a sparse embedding",
                                where=where,
                                fix="use weight_decay=0 for the embedding (a separate param "
                                    "group), as torch requires for sparse gradients")
        return cls
    if cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SparseAdam):
        if group.get("amsgrad"):
            raise StrategyError("amsgrad on a sparse embedding", where=where,
                                fix="use amsgrad=False for the embedding's param group")
        if cls is torch.optim.Adam and group.get("weight_decay", 0):
            raise StrategyError("Adam with weight_decay on a sparse embedding (lazy Adam "
                                "has no L2 term)", where=where,
                                fix="use weight_decay=0 for the embedding, or AdamW")
        return LazyAdamW if cls is torch.optim.AdamW else torch.optim.SparseAdam
    raise StrategyError(f"{cls.__name__} cannot update sparse embedding rows on a parameter "
                        "server", where=where,
                        fix="use SGD, Adagrad, Adam, AdamW or SparseAdam for embeddings")


def dense_class(opt: torch.optim.Optimizer, where: str) -> type:
    cls = type(opt)
    if cls not in DENSE_OK:
        raise StrategyError(
            f"{cls.__name__} cannot be sharded over parameter servers (only elementwise "
            f"optimizers can: {', '.join(c.__name__ for c in DENSE_OK)})", where=where,
            fix="use one of those optimizers, or an AllReduce synchronizer for these "
                "parameters")
    return cls


def locate(optimizers: Sequence[torch.optim.Optimizer], param: torch.Tensor
           ) -> tuple[int, int] | None:
    """(optimizer index, param-group index) holding ``param``, or None."""
    for oi, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            if any(p is param for p in group["params"]):
                return oi, gi
    return None


def _kwargs_for(cls: type, group: dict[str, Any]) -> dict[str, Any]:
    """``group``'s values for the hyperparameters ``cls`` knows."""
    import inspect

    names = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    return {k: v for k, v in group.items() if k in names and k not in SKIP_KEYS}


class ShardOptimizer:
    """The optimizers over one owner's shards, mirroring the user's param groups."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer],
                 entries: Sequence[tuple[torch.Tensor, int, int, bool, str]]) -> None:
        """``entries``: (shard tensor, optimizer index, group index, sparse?, where)."""
        self.user = list(optimizers)
        grouped: dict[tuple[int, bool], dict[int, list[torch.Tensor]]] = {}
        classes: dict[tuple[int, bool], type] = {}
        for shard, oi, gi, sparse, where in entries:
            group = self.user[oi].param_groups[gi]
            cls = (sparse_class(self.user[oi], group, where) if sparse
                   else dense_class(self.user[oi], where))
            key = (oi, sparse)
            if classes.setdefault(key, cls) is not cls:
                raise StrategyError(f"{where}: param groups need different sparse rules",
                                    fix="use one optimizer class per embedding")
            grouped.setdefault(key, {}).setdefault(gi, []).append(shard)
        self.optimizers: list[tuple[torch.optim.Optimizer, list[int], int]] = []
        self.sparse_flags: list[bool] = []  # per entry of ``optimizers``: sparse shards?
        for (oi, _sparse), by_group in grouped.items():
            cls = classes[(oi, _sparse)]
            gis = sorted(by_group)
            first = _kwargs_for(cls, self.user[oi].param_groups[gis[0]])
            groups = [{"params": by_group[gi],
                       **_kwargs_for(cls, self.user[oi].param_groups[gi])} for gi in gis]
            opt = cls(groups, **first)
            if cls is LazyAdamW:
                for g, gi in zip(opt.param_groups, gis, strict=True):
                    g["weight_decay"] = self.user[oi].param_groups[gi].get("weight_decay", 0.0)
            self.optimizers.append((opt, gis, oi))
            self.sparse_flags.append(_sparse)

    def mirror(self) -> None:
        """Copy the user's current hyperparameters into the shard optimizers."""
        for opt, gis, oi in self.optimizers:
            for g, gi in zip(opt.param_groups, gis, strict=True):
                src = self.user[oi].param_groups[gi]
                for k in g:
                    if k not in SKIP_KEYS and k in src:
                        g[k] = src[k]

    @torch.no_grad()
    def step(self, sparse: bool | None = None) -> None:
        """Update the shards: all of them, or only the sparse (``True``) or the dense
        (``False``) ones (their optimizers are separate, so the order does not matter)."""
        self.mirror()
        for (opt, _, _), is_sparse in zip(self.optimizers, self.sparse_flags, strict=True):
            if sparse is None or sparse == is_sparse:
                opt.step()

    def owner_of(self, shard: torch.Tensor) -> torch.optim.Optimizer:
        """The torch optimizer that updates ``shard``."""
        for opt, _, _ in self.optimizers:
            if any(p is shard for g in opt.param_groups for p in g["params"]):
                return opt
        raise KeyError("shard not in this owner's optimizers")

    def state_of(self, shard: torch.Tensor) -> dict[str, Any]:
        return dict(self.owner_of(shard).state.get(shard, {}))

    def set_state(self, shard: torch.Tensor, state: dict[str, Any]) -> None:
        opt = self.owner_of(shard)
        if state:
            opt.state[shard] = {k: (v.to(shard.device) if isinstance(v, torch.Tensor)
                                    and k != "step" else v) for k, v in state.items()}
        else:
            opt.state.pop(shard, None)


# -- hyperparameters on the wire (chief -> dedicated servers) ---------------------------
def hparam_layout(optimizers: Sequence[torch.optim.Optimizer]
                  ) -> list[tuple[int, int, str, str, int]]:
    """(optimizer, group, key, kind, length) of every numeric hyperparameter."""
    out = []
    for oi, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            for key in sorted(group):
                if key in SKIP_KEYS:
                    continue
                v = group[key]
                if isinstance(v, bool):
                    out.append((oi, gi, key, "bool", 1))
                elif isinstance(v, int):
                    out.append((oi, gi, key, "int", 1))
                elif isinstance(v, float):
                    out.append((oi, gi, key, "float", 1))
                elif isinstance(v, torch.Tensor) and v.numel() == 1:
                    out.append((oi, gi, key, "tensor", 1))
                elif isinstance(v, (tuple, list)) and v and all(
                        isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                    out.append((oi, gi, key, "tuple", len(v)))
    return out


def pack_hparams(optimizers: Sequence[torch.optim.Optimizer],
                 layout: list[tuple[int, int, str, str, int]]) -> list[float]:
    vals: list[float] = []
    for oi, gi, key, kind, _n in layout:
        v = optimizers[oi].param_groups[gi][key]
        if kind == "tuple":
            vals.extend(float(x) for x in v)
        elif kind == "tensor":
            vals.append(float(v.item()))
        else:
            vals.append(float(v))
    return vals


def unpack_hparams(optimizers: Sequence[torch.optim.Optimizer],
                   layout: list[tuple[int, int, str, str, int]], values: Sequence[float]
                   ) -> None:
    pos = 0
    for oi, gi, key, kind, n in layout:
        group = optimizers[oi].param_groups[gi]
        chunk = [float(x) for x in values[pos:pos + n]]
        pos += n
        if kind == "bool":
            group[key] = bool(chunk[0])
        elif kind == "int":
            group[key] = int(chunk[0]) if math.isfinite(chunk[0]) else chunk[0]
        elif kind == "float":
            group[key] = chunk[0]
        elif kind == "tensor":
            group[key].fill_(chunk[0])
        else:
            group[key] = tuple(chunk)
