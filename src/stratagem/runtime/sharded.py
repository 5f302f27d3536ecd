"""Sharded data parallel: ZeRO stages 1 and 2 on the user's optimizer, stage 3 by FSDP2.

Stage 1 and 2 (whole parameters to owners, :func:`~stratagem.runtime.plan.assign_owners`):
the optimizer's ``step`` is wrapped by hooks. Before it, a non-owner's gradient of an owned
parameter is set to None, so the user's optimizer (any torch optimizer) neither updates
the parameter nor creates state for it: each worker holds the state of its share only.
After it, each owner broadcasts its parameters' new values. Stage-1 gradients are
all-reduced with the other groups; stage-2 gradients are summed onto their owner alone
(``reduce``) as backward produces them, and freed on the other workers right after.

Stage 3 is torch's ``fully_shard`` (FSDP2) on each unit module, and on the root with every
other parameter ignored (so the units are not roots: a root keeps its parameters gathered
after forward). The optimizer's parameters are rebound to FSDP2's sharded ones.

Why stages 1 and 2 are not ``ZeroRedundancyOptimizer``: see docs/concepts/sharding.md.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.errors import StratagemError
from stratagem.runtime.materialize import MetaInit, materialize, rebind
from stratagem.runtime.plan import Owned, Plan
from stratagem.runtime.shard_state import shard_entry, shard_rows
from stratagem.runtime.skeleton import assemble, skeleton


def whole_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t``, gathered whole when it is a sharded DTensor (collective
    then)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def optimizers_of(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return list(optimizer)


class ShardEngine:
    """Runs one rank's :class:`ShardPlan` over its own gloo group (collectives of its own
    order, apart from the all-reduce groups')."""

    def __init__(self, plan: Plan, module: nn.Module, params: dict[str, nn.Parameter],
                 optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
                 process_group: dist.ProcessGroup | None, *,
                 meta: MetaInit | None = None) -> None:
        shards = plan.shards
        assert shards is not None
        self.plan, self.shards, self.rank = plan, shards, plan.rank
        self.world_size = plan.world_size
        self.optimizers = optimizers_of(optimizer)
        if not self.optimizers:
            raise StratagemError(
                "a sharded strategy needs the optimizer", where="DistributedModel",
                fix="pass optimizer= (AutoDist.distribute(model, optimizer) does): sharding "
                    "decides which worker updates which parameter")
        ranks = (dist.get_process_group_ranks(process_group) if process_group is not None
                 else list(range(dist.get_world_size())))
        self.group = dist.new_group(ranks, backend="gloo")
        self.global_ranks = ranks
        self.require_sync = True
        self.grad_weight = 1.0
        self._wrapped: dict[str, Any] = {}
        self._device_mesh: Any = None
        # the model as it is before FSDP2 changes it: an in-process rescale rebuilds from it
        self._skeleton: nn.Module | None = None
        self._skeleton_error: StratagemError | None = None
        if shards.units:
            try:
                self._skeleton = skeleton(module)
            except StratagemError as exc:
                self._skeleton_error = exc
        if meta is not None:  # values unit by unit, each sharded at once
            params = self._materialize(module, params, meta)
        self._owned = {o.param: o for o in shards.owned}
        # (only these: the stage-3 originals must go once FSDP2 has sharded them)
        self._params = {o.param: params[o.param] for o in shards.owned}
        self._handles: list[Any] = []
        self._unsharded: dict[int, str] = {}  # stage 3: FSDP2's unsharded parameters
        self._unsharded_params: list[nn.Parameter] = []
        self._stage2 = [o for o in _reverse(shards.owned, plan.params) if o.stage == 2]
        self._pending: tuple[Owned, Any] | None = None
        self._ready: set[str] = set()
        self._next = 0
        self._queued = False
        ref = weakref.ref(self)
        for o in self._stage2:
            def hook(param: torch.Tensor, name: str = o.param, ref: weakref.ref = ref) -> None:
                engine = ref()
                if engine is not None:
                    engine._on_grad(name)

            self._handles.append(params[o.param].register_post_accumulate_grad_hook(hook))
        for opt in self.optimizers:
            self._handles.append(opt.register_step_pre_hook(
                lambda *_a, ref=ref: ref() and ref()._before_step()))
            self._handles.append(opt.register_step_post_hook(
                lambda *_a, ref=ref: ref() and ref()._after_step()))
        self.sharded_params: dict[str, nn.Parameter] = {}
        if shards.units:
            self._fully_shard(module, params)
            self._hook_units()  # gradient weights, accumulated gradients, statistics

    # -- stage 3 -------------------------------------------------------------------------
    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        if self._device_mesh is None:
            self._device_mesh = DeviceMesh.from_group(
                self.group, "cpu" if self.plan.device == "cpu"
                else torch.device(self.plan.device).type)
        return self._device_mesh

    def _materialize(self, module: nn.Module, params: dict[str, nn.Parameter],
                     meta: MetaInit) -> dict[str, nn.Parameter]:
        """A meta-device model's values (runtime/materialize.py), each stage-3 unit sharded
        by FSDP2 as soon as it has them; the optimizers rebound. The new parameters."""
        from torch.distributed.fsdp import fully_shard

        units = {u.module: u for u in self.shards.units if u.module}
        modules = dict(module.named_modules())
        mesh = self._mesh() if units else None

        def shard(name: str) -> None:
            self._wrapped[name] = fully_shard(
                modules[name], mesh=mesh, reshard_after_forward=units[name].reshard_after_forward)

        materialize(module, meta, torch.device(self.plan.device), units=frozenset(units),
                    unit_done=shard)
        new = dict(module.named_parameters())
        rebind(self.optimizers, params, new)
        return {n: new[n] for n in params}

    def _fully_shard(self, module: nn.Module, params: dict[str, nn.Parameter]) -> None:
        from torch.distributed.fsdp import fully_shard

        names = self.shards.unit_params
        # state the optimizer already holds (a restored job that Auto re-plans to stage
        # 3; an optimizer stepped before wrapping): kept, sliced like its parameter below
        held = [(opt, n, opt.state.pop(params[n])) for opt in self.optimizers
                for n in sorted(names) if opt.state.get(params[n])]
        mesh = self._mesh()
        modules = dict(module.named_modules())
        wrapped = []
        for u in self.shards.units:
            if u.module == "":
                continue
            wrapped.append(self._wrapped.get(u.module) or fully_shard(
                modules[u.module], mesh=mesh, reshard_after_forward=u.reshard_after_forward))
        root_unit = next((u for u in self.shards.units if u.module == ""), None)
        ignored = {p for n, p in params.items() if n not in names}
        fully_shard(module, mesh=mesh, ignored_params=ignored,
                    reshard_after_forward=root_unit.reshard_after_forward if root_unit
                    else True)
        for i, u in enumerate(u for u in self.shards.units if u.module):
            if u.prefetch and i + 1 < len(wrapped):
                wrapped[i].set_modules_to_forward_prefetch(wrapped[i + 1: i + 1 + u.prefetch])
        new = dict(module.named_parameters())
        rebind(self.optimizers, {n: params[n] for n in names}, new)
        self.sharded_params = {n: new[n] for n in names}
        self._root = module
        for opt, n, state in held:
            opt.state[new[n]] = shard_entry(state, new[n], self.rank, self.world_size)

    @torch.no_grad()
    def unshard(self, module: nn.Module) -> nn.Module:
        """Collective over this engine's group (an in-process rescale, before the group
        goes away): the model rebuilt plain -- a new module object from the skeleton taken
        before FSDP2 changed it, every stage-3 parameter whole in it -- and the optimizers
        rebound to its parameters, holding the whole state of the stage-3 ones. The
        engine's hooks are removed: it is done. Every rank then briefly holds the whole
        stage-3 parameters and their optimizer state besides its shards."""
        from torch.distributed.tensor import DTensor

        if self._skeleton is None:
            raise self._skeleton_error or StratagemError(
                "no skeleton of the model to rebuild it from", where="ShardEngine.unshard",
                fix="report this: the engine was built without stage-3 units")
        names = sorted(self.sharded_params)  # the same collectives in the same order
        states: list[tuple[torch.optim.Optimizer, str, dict[str, Any]]] = []
        for opt in self.optimizers:
            for n in names:
                entry = opt.state.pop(self.sharded_params[n], None)
                if entry:
                    states.append((opt, n, {k: whole_copy(v) if isinstance(v, DTensor) else v
                                            for k, v in entry.items()}))
        whole = {n: whole_copy(self.sharded_params[n]) for n in names}
        plain = assemble(self._skeleton, module, whole)
        self._skeleton = None
        new = dict(plain.named_parameters())
        rebind(self.optimizers, {n: self.sharded_params[n] for n in names}, new)
        for opt, n, entry in states:
            opt.state[new[n]] = entry
        self.remove_hooks()
        self.sharded_params = {}
        return plain

    def owned_param(self, name: str) -> nn.Parameter:
        """The stage-1/2 parameter ``name`` (as the engine holds it)."""
        return self._params[name]

    @functools.cached_property
    def gradient_param_names(self) -> dict[int, str]:
        """``id(param) -> name`` of the stage-2 and stage-3 parameters (their gradients are
        never whole and averaged on every rank); fixed once the engine is built."""
        out = {id(self._params[o.param]): o.param for o in self.shards.owned
               if o.stage == 2}
        out.update({id(p): n for n, p in self.sharded_params.items()})
        return out

    def set_requires_gradient_sync(self, on: bool) -> None:
        if self.shards.units:
            self._root.set_requires_gradient_sync(on)

    # -- stage 2: gradients reduced to their owner during backward ------------------------
    def _on_grad(self, name: str) -> None:
        if not self.require_sync:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._ready.add(name)
        while self._next < len(self._stage2) and self._stage2[self._next].param in self._ready:
            self._launch(self._stage2[self._next])
            self._next += 1

    @torch.no_grad()
    def _launch(self, o: Owned) -> None:
        p = self._params[o.param]
        if p.grad is None:  # unused in this backward: a zero gradient, as all-reduce gives
            p.grad = torch.zeros_like(p)
        if self.squares is not None:  # gradient statistics: sum of squares onto the owner
            self._reduce_squares(o.param, p.grad, o.owner)
        p.grad.mul_(self.grad_weight / self.world_size)
        work = dist.reduce(p.grad, dst=self.global_ranks[o.owner], group=self.group,
                           async_op=True)
        self._settle()
        self._pending = (o, work)

    def _settle(self) -> None:
        """Wait for the reduce in flight; a non-owner frees that gradient."""
        if self._pending is None:
            return
        o, work = self._pending
        self._pending = None
        work.wait()
        if o.owner != self.rank:
            self._params[o.param].grad = None

    def _finish_backward(self) -> None:
        while self._next < len(self._stage2):
            self._launch(self._stage2[self._next])
            self._next += 1
        self._settle()
        self._ready.clear()
        self._next = 0
        self._queued = False

    def prepare_for_forward(self) -> None:
        """Drop the state of a backward that failed before its end callback ran."""
        if self._queued:
            self._settle()
            self._ready.clear()
            self._next = 0
            self._queued = False

    # -- stages 1 and 2: owners update, then send the values -------------------------------
    def _before_step(self) -> None:
        for o in self.shards.owned:
            if o.owner != self.rank:
                self._params[o.param].grad = None

    @torch.no_grad()
    def _after_step(self) -> None:
        for owner in range(self.world_size):
            mine = [self._params[o.param] for o in self.shards.owned if o.owner == owner]
            if not mine:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in mine]) if owner == self.rank \
                else torch.empty(sum(p.numel() for p in mine), dtype=mine[0].dtype)
            dist.broadcast(flat, src=self.global_ranks[owner], group=self.group)
            if owner != self.rank:
                offset = 0
                for p in mine:
                    p.copy_(flat[offset: offset + p.numel()].view_as(p))
                    offset += p.numel()

    # -- state ---------------------------------------------------------------------------
    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Collective: the module's state dict with every sharded tensor gathered whole
        (plain tensors: ``torch.load`` + ``load_state_dict`` of the plain model take it)."""
        return {k: whole_copy(v) for k, v in module.state_dict().items()}

    def load_full_state_dict(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load whole tensors (a :meth:`full_state_dict`, any world size's) into this
        rank's shards."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        own = module.state_dict()
        with torch.no_grad():
            for k, v in own.items():
                if k not in state:
                    raise StratagemError(f"the state dict has no {k!r}",
                                         where="DistributedModel.load_full_state_dict",
                                         fix="load a state dict saved from this model")
                if isinstance(v, DTensor):
                    v.copy_(distribute_tensor(state[k].to(v.dtype), v.device_mesh,
                                              v.placements))
                else:
                    v.copy_(state[k])

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- gradient statistics (adaptive batch size; see stratagem.adapt.gradient_stats) --
    squares: dict[str, torch.Tensor] | None = None
    """While statistics are collected: per stage-2/3 parameter held here, the sum over
    ranks of the squared local gradients (this rank's rows: a stage-3 slice, a stage-2
    parameter on its owner), reduced as backward produces the local gradients."""
    _stats_group: Any = None

    def collect_squares(self, on: bool) -> None:
        """Reduce the squared local gradients of the next backward onto the shard holders
        until turned off (collective: every rank the same calls; the first one makes the
        group and the stage-3 hooks). A synced backward reduces stage 2 in its reduce
        order; an unsynced one (accumulation) leaves stage 2 to :meth:`reduce_local_squares`.
        Stage 3 is hooked either way: under ``set_requires_gradient_sync(False)`` FSDP2
        keeps the unsharded gradient, which the hook sees as it accumulates."""
        if on and self._stats_group is None:
            self._stats_group = dist.new_group(self.global_ranks, backend="gloo")
        self.squares = {} if on else None

    def set_grad_weight(self, value: float) -> None:
        """This rank's gradient weight (uneven local batches; ``1/micro-batches`` with
        accumulation). Stage 2 applies it before its reduce; a stage-3 gradient is
        multiplied by it on the unsharded gradient (the whole accumulated local one), by
        the hook below, before FSDP2's reduce-scatter averages the ranks' gradients: so
        each rank may have its own weight, as on all-reduce."""
        self.grad_weight = float(value)

    def local_gradients(self) -> list[torch.Tensor]:
        """The stage-3 gradients accumulated locally so far (FSDP2 keeps them on the
        unsharded parameters under ``set_requires_gradient_sync(False)``; the sharded
        parameters have none until the reduce-scatter), e.g. to rescale them."""
        return [p.grad for p in self._unsharded_params if p.grad is not None]

    def _hook_units(self) -> None:
        """FSDP2 gathers each unit's parameters into the same unsharded tensors every
        step; a forward pre-hook after its own (which gathers them) finds them and hooks
        their gradient accumulation, which runs before FSDP2 reduce-scatters the unit."""
        modules = dict(self._root.named_modules())
        ref = weakref.ref(self)
        for u in self.shards.units:
            prefix = f"{u.module}." if u.module else ""
            rel = {n[len(prefix):]: n for n in u.params}

            def pre(module: nn.Module, _args: Any, rel: dict = rel,
                    ref: weakref.ref = ref) -> None:
                engine = ref()
                if engine is not None:
                    engine._hook_unsharded(module, rel)

            self._handles.append(modules[u.module].register_forward_pre_hook(pre))

    def _hook_unsharded(self, module: nn.Module, rel: dict[str, str]) -> None:
        ref = weakref.ref(self)
        for short, name in rel.items():
            p = module.get_parameter(short)
            if id(p) in self._unsharded or not p.requires_grad:
                continue
            self._unsharded[id(p)] = name
            self._unsharded_params.append(p)

            def hook(param: torch.Tensor, name: str = name, ref: weakref.ref = ref) -> None:
                engine = ref()
                if engine is None or param.grad is None:
                    return
                # armed for this backward only (the first micro-batch's when accumulating:
                # the gradient is then that micro-batch's alone, not yet reduce-scattered)
                if engine.squares is not None:
                    engine._reduce_squares(name, param.grad, None)
                if engine.require_sync and engine.grad_weight != 1.0:
                    param.grad.mul_(engine.grad_weight)

            self._handles.append(p.register_post_accumulate_grad_hook(hook))

    @torch.no_grad()
    def reduce_local_squares(self) -> None:
        """After an unsynced backward while collecting: each stage-2 gradient is this
        rank's local one, whole on every rank; reduce its square onto the owner, in the
        same order on every rank (an unused parameter: zeros, as the synced path does)."""
        if self.squares is None:
            return
        for o in self._stage2:
            p = self._params[o.param]
            self._reduce_squares(o.param, p.grad if p.grad is not None else
                                 torch.zeros_like(p), o.owner)

    @torch.no_grad()
    def _reduce_squares(self, name: str, grad: torch.Tensor, owner: int | None) -> None:
        """Sum ``grad**2`` over the ranks: onto ``owner`` (stage 2), or scattered by
        dim-0 rows as FSDP2 shards (stage 3, ``owner`` None)."""
        sq = grad.detach().pow(2)
        assert self.squares is not None
        if owner is not None:
            dist.reduce(sq, dst=self.global_ranks[owner], group=self._stats_group)
            if owner == self.rank:
                self.squares[name] = sq
            return
        n0, world = sq.shape[0], self.world_size
        chunk = -(-n0 // world)
        padded = sq.new_zeros((chunk * world, *sq.shape[1:]))
        padded[:n0].copy_(sq)
        out = sq.new_empty((chunk, *sq.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=self._stats_group)
        self.squares[name] = out[:shard_rows(n0, self.rank, world)[1]]

    @torch.no_grad()
    def share_owned(self, values: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Each stage-1 parameter's tensor in ``values`` (e.g. an Adam divisor, which
        only the owner can compute) from its owner to every rank (collective)."""
        out = {}
        for o in self.shards.owned:
            if o.stage != 1:
                continue
            p = self._params[o.param]
            if o.owner == self.rank:  # (no value, e.g. no gradient: ones, i.e. none)
                t = values.get(o.param)
                buf = (t.detach().to(p.dtype).contiguous() if t is not None
                       else torch.ones_like(p, memory_format=torch.contiguous_format))
            else:
                buf = torch.empty_like(p, memory_format=torch.contiguous_format)
            dist.broadcast(buf, src=self.global_ranks[o.owner], group=self.group)
            out[o.param] = buf
        return out


def _reverse(owned: tuple[Owned, ...], order: tuple[str, ...]) -> list[Owned]:
    """Stage-2 launch order: reverse registration order, as backward produces gradients."""
    index = {n: i for i, n in enumerate(order)}
    return sorted(owned, key=lambda o: -index[o.param])

