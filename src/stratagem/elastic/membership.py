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
from stratagem.data import elastic_loaders

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
    for loader in elastic_loaders():
        loader.on_rescale(rank, world)
    trainer = getattr(ad, "adaptive", None)
    if trainer is not None:
        trainer.on_rescale(rank, world)  # after the model's regroup: new synchronizers


def _rebuild_autodist(ad: Any, rank: int, world: int, broadcast: bool) -> None:
    """AutoDist's world, strategy and plan for ``world`` workers on this machine; the
    distributed model re-binds to them (broadcasting rank 0's tensors if ``broadcast``)."""
    from stratagem.resource import ResourceSpec
    from stratagem.runtime import compile_plan

    ad.rank, ad.world_size = rank, world
    ad.resource_spec = ResourceSpec.local(world)
    ad.rank_devices = list(ad.resource_spec.replicas)
    if ad.model is None:
        return
    ad.strategy = ad.build_strategy(ad.model.module)
    plan = compile_plan(ad.strategy, ad.profile, rank=rank, world_size=world,
                        device=ad.device)
    ad.model.regroup(plan, broadcast=broadcast)


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
