"""What every parameter-server engine does the same way on a worker.

Hooks (gradients, embedding calls, ``optimizer.step()``), the owners' view of the user's
optimizers, the initial broadcast from worker 0, and turning an embedding gradient into
(row ids, rows). The bulk-synchronous engine (``engine.py``) and the bounded-staleness /
asynchronous one (``consistency.py``) build on it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from stratagem.errors import StrategyError, UnsupportedModelError
from stratagem.runtime.plan import Plan
from stratagem.runtime.ps.cluster import Cluster, Group
from stratagem.runtime.ps.dense import piece_view
from stratagem.runtime.ps.optim import locate
from stratagem.runtime.ps.plan import PSPiece
from stratagem.runtime.ps.state import consolidate, convert_step, export_state, slice_state
from stratagem.runtime.stats import CommStats


class EngineBase:
    """Common state: this rank, the model's parameters, pieces by parameter, optimizers."""

    def __init__(self, plan: Plan, module: nn.Module,
                 optimizers: Sequence[torch.optim.Optimizer], cluster: Cluster,
                 stats: CommStats) -> None:
        ps = plan.ps
        assert ps is not None
        self.plan = plan
        self.ps = ps
        self.cluster = cluster
        self.rank = cluster.rank
        self.W = ps.workers
        self.is_server = self.rank >= self.W
        self.is_chief = self.rank == 0
        self.stats = stats
        self.module = module
        self.optimizers = list(optimizers)
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self._name_of = {id(p): n for n, p in self.params.items()}
        self.by_param: dict[str, list[PSPiece]] = {}
        for p in ps.pieces:
            self.by_param.setdefault(p.param, []).append(p)
        self.grad_weight = 1.0
        self.require_sync = True
        # A GradScaler (runtime/amp.py): gradients are divided by loss_scale as they are
        # captured, and with check_finite a non-finite one sets nonfinite until the update.
        self.loss_scale = 1.0
        self.check_finite = False
        self.nonfinite = False
        self._lock = threading.Lock()
        self._touched: dict[str, list[torch.Tensor]] = {}
        self._handles: list[Any] = []
        self._check_optimizers()

    # -- hooks called by the base (engines override) -------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        raise NotImplementedError

    def _on_embedding(self, name: str, module: nn.Module, ids: torch.Tensor) -> None:
        raise NotImplementedError

    def on_step(self) -> None:
        raise NotImplementedError

    def make_current(self) -> None:
        """This worker's copy of every PS parameter becomes current (not collective)."""
        raise NotImplementedError

    def record_touched(self, name: str, module: nn.Module, flat: torch.Tensor) -> None:
        """Dense-declared embeddings: remember the rows a training forward looks up."""
        if not self.by_param[name][0].sparse_grad:
            pad = getattr(module, "padding_idx", None)
            self._touched.setdefault(name, []).append(flat if pad is None else flat[flat != pad])

    def _check_optimizers(self) -> None:
        if not self.optimizers:
            raise StrategyError("parameter-server synchronizers need the optimizer",
                                where="DistributedModel",
                                fix="pass it: ad.distribute(model, optimizer) or "
                                    "DistributedModel(model, plan, optimizer=optimizer)")
        self._loc: dict[str, tuple[int, int]] = {}
        for name in self.by_param:
            loc = locate(self.optimizers, self.params[name])
            if loc is None:
                raise StrategyError(f"parameter {name!r} has a PS synchronizer but is in no "
                                    "optimizer", where=f"node_config[{name}]",
                                    fix="build the optimizer over model.parameters(), or "
                                        "freeze the parameter (requires_grad=False)")
            self._loc[name] = loc

    @torch.no_grad()
    def _broadcast_initial_state(self, group: Group) -> None:
        """Everyone (servers included) starts from worker 0's parameters and buffers."""
        states = list(dict.fromkeys([*self.module.parameters(), *self.module.buffers()]))
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in states:
            if t.numel():
                by_dtype.setdefault(t.dtype, []).append(t)
        for tensors in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1).cpu() for t in tensors])
            group.run(lambda flat=flat: group.broadcast(flat, 0),
                           "broadcasting the initial parameters")
            if self.rank != 0:
                off = 0
                for t in tensors:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()

    def _install_hooks(self) -> None:
        ref = weakref.ref(self)
        for p in self.params.values():
            def hook(param: torch.Tensor, ref: weakref.ref = ref) -> None:
                engine = ref()
                if engine is not None:
                    engine._on_grad(param)

            self._handles.append(p.register_post_accumulate_grad_hook(hook))
        # Rows of ``rows_from_grad`` pieces are the non-zero rows of the dense gradient
        # (kept on every worker, so nothing is pulled): no embedding hook for them.
        sparse_params = {p.param for p in self.ps.sparse if not p.rows_from_grad}
        found: set[str] = set()
        for mod in self.module.modules():
            if not isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
                continue
            name = self._name_of.get(id(mod.weight))
            if name not in sparse_params:
                continue
            if getattr(mod, "max_norm", None) is not None:
                raise UnsupportedModelError(
                    f"embedding {name!r} uses max_norm, which rewrites rows during forward",
                    where="parameter-server runtime",
                    fix="drop max_norm, or use an AllReduce synchronizer for it")
            found.add(name)

            def pre(module: nn.Module, args: tuple, kwargs: dict, name: str = name,
                    ref: weakref.ref = ref) -> None:
                engine = ref()
                if engine is not None:
                    ids = args[0] if args else kwargs.get("input")
                    engine._on_embedding(name, module, ids)

            self._handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        missing = sparse_params - found
        if missing:
            raise UnsupportedModelError(
                f"sparse PS parameters {sorted(missing)} are not the weight of an "
                "nn.Embedding/nn.EmbeddingBag, so their rows cannot be tracked",
                where="parameter-server runtime",
                fix="look rows up through the embedding module")
        for oi, opt in enumerate(self.optimizers):
            self._handles.append(opt.register_step_pre_hook(
                lambda *_a, ref=ref: ref() and ref().on_step()))
            # optimizer.state_dict() holds the owners' state of its PS parameters, fetched
            # for the call only (state.py), on whichever single rank calls it.
            if any(loc[0] == oi for loc in self._loc.values()):
                self._handles.append(opt.register_state_dict_pre_hook(
                    lambda _opt, oi=oi, ref=ref: ref() and ref().fill_user_state(oi)))
                self._handles.append(opt.register_state_dict_post_hook(
                    lambda _opt, _sd, oi=oi, ref=ref: ref() and ref().drop_user_state(oi)))
        # state_dict() of the module or of any submodule holding a PS parameter reads
        # current values (the user's original module is this module).
        holders = {n.rpartition(".")[0] for n in self.by_param}
        for prefix, mod in self.module.named_modules():
            if any(h == prefix or h.startswith(prefix + ".") or not prefix for h in holders):
                self._handles.append(mod.register_state_dict_pre_hook(
                    lambda *_a, ref=ref: ref() and ref().make_current()))

    # -- checkpoints (see state.py) ------------------------------------------------------
    def pieces_state(self, pieces: Sequence[PSPiece]) -> dict[int, dict[str, Any]]:
        """The owners' optimizer state of ``pieces`` (by piece id), without the other
        workers (engines implement it)."""
        raise NotImplementedError

    def _names_in(self, oi: int) -> list[str]:
        return [n for n in self.by_param if self._loc[n][0] == oi]

    def fill_user_state(self, oi: int) -> None:
        """Before ``optimizers[oi].state_dict()`` (a pre-hook): write the full optimizer
        state of its PS parameters into it, so the state dict is what one process would
        have."""
        names = self._names_in(oi)
        pieces = [p for n in names for p in self.by_param[n]]
        payloads = self.pieces_state(pieces)
        self._consolidate_into_user({pid: {"state": st} for pid, st in payloads.items()},
                                    names)

    def drop_user_state(self, oi: int) -> None:
        """After ``state_dict()`` (a post-hook): the owners keep that state, not the user's
        optimizer (which skips PS parameters), so a later read cannot see it stale."""
        for name in self._names_in(oi):
            self.optimizers[oi].state.pop(self.params[name], None)

    def _owned_payload(self, shards: dict[int, torch.Tensor], optimizer: Any,
                       values: bool = False) -> dict[int, dict[str, Any]]:
        """This owner's pieces: optimizer state (and values), detached on the CPU."""
        out = {}
        for pid, shard in shards.items():
            entry: dict[str, Any] = {
                "state": export_state(optimizer.state_of(shard)) if optimizer else {}}
            if values:
                entry["value"] = shard.detach().cpu().clone()
            out[pid] = entry
        return out

    def _consolidate_into_user(self, payloads: dict[int, dict[str, Any]],
                               names: Sequence[str] | None = None) -> None:
        """Write the full optimizer state of PS parameters ``names`` (default: all) into the
        user's optimizers, so ``optimizer.state_dict()`` is what one process would have."""
        for name in self.by_param if names is None else names:
            pieces = self.by_param[name]
            param = self.params[name]
            opt = self.optimizers[self._loc[name][0]]
            full = consolidate(pieces, [payloads[p.id]["state"] for p in pieces], param,
                               type(opt))
            if full:
                opt.state[param] = full
            else:
                opt.state.pop(param, None)

    def _slices(self, pieces: list[PSPiece], values: bool) -> dict[int, dict[str, Any]]:
        """Each piece's share of the loaded full values and optimizer state."""
        out = {}
        for p in pieces:
            param = self.params[p.param]
            full = self.optimizers[self._loc[p.param][0]].state.get(param, {})
            entry: dict[str, Any] = {"state": slice_state(full, p, tuple(param.shape))}
            if values:
                entry["value"] = piece_view(param, p).cpu().clone()
            out[p.id] = entry
        return out

    @torch.no_grad()
    def _apply_owned(self, shards: dict[int, torch.Tensor], optimizer: Any,
                     entries: dict[int, dict[str, Any]]) -> None:
        for pid, entry in entries.items():
            shard = shards[pid]
            if "value" in entry:
                shard.copy_(entry["value"])
            if optimizer is not None:
                cls = type(optimizer.owner_of(shard))
                optimizer.set_state(shard, convert_step(dict(entry["state"]), cls))

    def holds_user_state(self) -> bool:
        """Whether the user's optimizers hold state for a PS parameter: a new engine's
        owners start empty, so that state is theirs to take (:meth:`after_restore`)."""
        return any(self.params[n] in self.optimizers[self._loc[n][0]].state
                   for n in self.by_param)

    def _drop_user_state(self) -> None:
        """Workers: the owners hold the PS parameters' optimizer state, not the user's
        optimizer (it skips them: their ``.grad`` stays None)."""
        for name in self.by_param:
            self.optimizers[self._loc[name][0]].state.pop(self.params[name], None)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _sparse_rows(self, name: str, piece: PSPiece, grad: torch.Tensor | None,
                     factor: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        touched = self._touched.pop(name, None)
        if grad is None:
            return None, None
        if grad.is_sparse:
            g = grad.coalesce()
            return g.indices()[0].cpu(), (g.values() * factor).cpu()
        if touched is None:  # used, but not through the module's forward
            rows = torch.nonzero(grad.reshape(grad.shape[0], -1).any(dim=1)).reshape(-1)
        else:
            rows = torch.unique(torch.cat(touched))
        return rows.cpu(), (grad.index_select(0, rows.to(grad.device)) * factor).cpu()
