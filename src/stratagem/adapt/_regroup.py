"""After an in-process rescale: rebuild the engine for the new world and hand the job state to
the workers that joined (see :mod:`stratagem.adapt.rescale`).

Every member runs :func:`regroup` right after creating the new process group, with the same
collectives in the same order: the model's synchronizers (parameters and buffers broadcast
from rank 0), then every shared job state (rank 0's, loaded by the newcomers).
"""

from __future__ import annotations

import io
from typing import Any

import torch

from stratagem.adapt import _wire
from stratagem.adapt.state import State, registered_states
from stratagem.errors import StratagemError

_pending: dict[str, dict[str, Any]] = {}  # received by a newcomer, not registered yet


def take_pending(state: State) -> bool:
    """Load ``state`` from what rank 0 sent when this worker joined, if it was not yet
    created then (e.g. an Accumulator made each epoch); called by ``load_state``."""
    payload = _pending.pop(state.name, None)
    if payload is None:
        return False
    _import(state, payload)
    return True


def sync_states(ad: Any = None) -> None:
    """In the old group, before anyone leaves: every state's collective ``sync()`` (e.g.
    pending Accumulator updates) and the adaptive loop's queued gradient statistics."""
    for state in registered_states().values():
        state.sync()
    stats = getattr(getattr(ad, "adaptive", None), "stats", None)
    if stats is not None and hasattr(stats, "flush"):
        stats.flush()


def regroup(group: Any, *, newcomer: bool, joiners: bool) -> None:
    """Collective over the new generation: rebuild, transfer state (when ``joiners``: the
    others hold it already), re-plan the loaders."""
    rank, world = group.rank, group.world_size
    ad = group.ad
    if ad is not None:
        _rebuild_autodist(ad, rank, world, joiners)
    if joiners:
        _transfer_states(newcomer, world)
    for loader in _loaders():
        loader.sampler.rank, loader.sampler.world_size = rank, world
    if ad is not None:
        _update_adaptive_loop(getattr(ad, "adaptive", None), rank, world)


# -- the engine ---------------------------------------------------------------------------------
def _rebuild_autodist(ad: Any, rank: int, world: int, broadcast: bool) -> None:
    from stratagem.resource import ResourceSpec
    from stratagem.runtime import compile_plan
    from stratagem.strategy import validate

    ad.rank, ad.world_size = rank, world
    ad.resource_spec = ResourceSpec.local(world)
    ad.rank_devices = list(ad.resource_spec.replicas)
    if ad.model is None or ad.profile is None:
        return
    strategy = validate(ad._builder.build(ad.profile, ad.resource_spec), ad.profile,
                        ad.resource_spec)
    ad.strategy = strategy
    plan = compile_plan(strategy, ad.profile, rank=rank, world_size=world, device=ad.device)
    rebuild_model(ad.model, plan, broadcast=broadcast)


def rebuild_model(model: Any, plan: Any, *, broadcast: bool = True) -> None:
    """Give a DistributedModel the synchronizers of ``plan`` (a new world), in place:
    the module, optimizer and hooks' owners stay; with ``broadcast``, parameters and buffers
    are broadcast from the new rank 0. Collective when ``plan.world_size > 1``."""
    from stratagem.runtime.allreduce import AllReduceReducer, LocalReducer, check_params
    from stratagem.runtime.comm import BufferSync, broadcast_coalesced, make_comms

    if getattr(model, "_ps", None) is not None or plan.ps is not None:
        raise StratagemError("in-process rescale supports all-reduce strategies only",
                             where="rescale", fix="use checkpoint-restart (SIGTERM and "
                             "relaunch) for jobs with parameter-server synchronizers")
    old = model._reducer
    observers = getattr(old, "observers", None)
    old.remove_hooks()
    params = check_params(plan, model.module)
    model.plan = plan
    model._buffer_sync = None
    model._buffers_dirty = False
    if plan.world_size == 1:
        model._reducer = LocalReducer(params, model.comm_stats)
    else:
        default, comms = make_comms(plan, None, model.comm_stats)
        if broadcast:
            states = list(dict.fromkeys([*model.module.parameters(),
                                         *model.module.buffers()]))
            broadcast_coalesced([t for t in states if t.numel()], default)
        model._reducer = AllReduceReducer(plan, params, comms, model.comm_stats)
        model._buffer_sync = BufferSync(model.module, default)
        model._reducer.before_wait = model._sync_buffers_if_dirty
    if observers is not None and hasattr(model._reducer, "observers"):
        model._reducer.observers = observers  # (their handles keep working)


def _update_adaptive_loop(trainer: Any, rank: int, world: int) -> None:
    """The adaptive loop (``ad.adaptive``) follows the world; it decides again at the next
    loader start on every member (a collective all members then reach together)."""
    if trainer is None:
        return
    trainer.rank, trainer.world_size = rank, world
    if hasattr(trainer, "_decided"):
        trainer._decided = False
    if getattr(trainer, "stats", None) is not None:
        from stratagem.adapt.gradstats import GradStats

        trainer.stats.close()
        trainer.stats = GradStats(trainer.model, trainer.optimizer, trainer.gns,
                                  world_size=world, precond_every=trainer.precond_every)


# -- job state --------------------------------------------------------------------------------
def _custom_file(state: State) -> bool:
    """Whether the state writes its own file (AdaptDL style ``save``/``load``)."""
    return type(state).save is not State.save


def _export(state: State) -> dict[str, Any]:
    if _custom_file(state):
        buf = io.BytesIO()
        state.save(buf)
        data = bytearray(buf.getvalue())
        return {"bytes": torch.frombuffer(data, dtype=torch.uint8) if data else
                torch.zeros(0, dtype=torch.uint8)}
    return {"value": state.state_dict()}


def _import(state: State, payload: dict[str, Any]) -> None:
    if "bytes" in payload:
        state.load(io.BytesIO(payload["bytes"].numpy().tobytes()))
    else:
        state.load_state_dict(payload["value"])


def _transfer_states(newcomer: bool, world: int) -> None:
    """Rank 0's shared states (all but the model, whose tensors were broadcast already and
    per-rank ones) to every member; the newcomers load them."""
    if world == 1:
        return
    import torch.distributed as dist

    states = registered_states()
    payload = None
    if dist.get_rank() == 0:
        payload = {name: _export(s) for name, s in states.items()
                   if not s.per_rank and not name.startswith("model")}
    received = _wire.broadcast_state(payload)
    if newcomer:
        for name, value in received.items():
            if name in states:
                _import(states[name], value)
            else:
                _pending[name] = value


def _loaders() -> list[Any]:
    """The data loaders among the registered states (AutoDist's, AdaptDL's)."""
    from stratagem.data import DistributedDataLoader

    found = []
    for state in registered_states().values():
        owner = getattr(getattr(state, "_get", None), "__self__", None)
        inner = getattr(owner, "_loader", None)
        for obj in (owner, inner):
            if isinstance(obj, DistributedDataLoader) and obj not in found:
                found.append(obj)
    return found
