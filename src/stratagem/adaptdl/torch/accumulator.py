"""AdaptDL's ``Accumulator``: metrics summed over replicas and across restarts.

In accumulation mode ``acc["k"] += v`` records local updates (reads see an empty dict); in
``with acc.synchronized():`` the updates of every replica are summed and the accumulator
reads and writes like a dict, identically on every replica. Results of a synchronization
outside a data-loader loop are kept in the checkpoint, so a restart that replays the rest of
the epoch sees the same values. Values: numbers, tensors, numpy arrays (summed as such),
sent between replicas as JSON (:mod:`stratagem.adaptdl.collective`), never pickled. With
more than one replica the job's process group must exist (``init_process_group``): without
it ``synchronized()`` raises instead of summing this replica's updates alone.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch.distributed as dist

from stratagem.adaptdl import collective, env
from stratagem.adaptdl.torch import job
from stratagem.adaptdl.torch.data import current_dataloader
from stratagem.elastic.epoch import current_epoch
from stratagem.elastic.state import State, load_state
from stratagem.errors import StratagemError

_init_count: collections.Counter[int | None] = collections.Counter()


def _dict_iadd(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    for k, v in b.items():
        a[k] = a[k] + v if k in a else v
    return a


def _sum_over_replicas(updates: dict[str, Any]) -> dict[str, Any]:
    """Every replica's pending updates summed (collective; the same sum everywhere)."""
    world = dist.get_world_size() if dist.is_initialized() else env.num_replicas()
    if world == 1:
        return dict(updates)
    if not dist.is_initialized():
        raise StratagemError(
            f"an Accumulator of {world} replicas has no process group to sum over",
            where="Accumulator.synchronized",
            fix="call adaptdl.torch.init_process_group(...) (or adaptdl.collective."
                "initialize()) on every replica before synchronizing")
    if not collective.is_initialized():
        collective.initialize()  # a collective point: every replica synchronizes here
    return collective.allreduce(updates, lambda a, b: _dict_iadd(dict(a), b))


def _encode_dict(d: dict[str, Any]) -> Any:
    return collective.encode(d)


def _decode_dict(d: Any) -> dict[str, Any]:
    return collective.decode(d)


class _AccumulatorState(State):
    format = "json"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if current_dataloader() is not None:
            raise RuntimeError("accumulator may not be initialized during dataloader iteration")
        epoch = current_epoch()
        name = f"adaptdl-accumulator-epoch{epoch}-{_init_count[epoch]}"
        _init_count[epoch] += 1
        self.results_history: dict[int | None, list[dict[str, Any]]] = (
            collections.defaultdict(list))
        self.results: dict[str, Any] = dict(*args, **kwargs)
        self.updates: dict[str, Any] = {}
        super().__init__(name)

    def state_dict(self) -> dict[str, Any]:
        history = {json.dumps(k): [_encode_dict(r) for r in v]
                   for k, v in self.results_history.items()}
        return {"results_history": history, "results": _encode_dict(self.results)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.results_history = collections.defaultdict(list)
        for k, v in state["results_history"].items():
            self.results_history[json.loads(k)] = [_decode_dict(r) for r in v]
        self.results = _decode_dict(state["results"])

    def sync(self) -> None:
        """Sum every replica's pending updates into the results (collective)."""
        _dict_iadd(self.results, _sum_over_replicas(self.updates))
        self.updates.clear()


class _Value:
    """What ``acc[k]`` returns in accumulation mode: captures ``+= v`` / ``-= v``."""

    __slots__ = ("accum", "key", "update")

    def __init__(self, accum: Accumulator, key: str) -> None:
        self.accum, self.key, self.update = accum, key, 0

    def __add__(self, update: Any) -> _Value:
        if isinstance(update, _Value):
            raise TypeError(f"invalid update type: {type(update)}")
        self.update = self.update + update
        return self

    def __sub__(self, update: Any) -> _Value:
        if isinstance(update, _Value):
            raise TypeError(f"invalid update type: {type(update)}")
        self.update = self.update - update
        return self


class Accumulator(MutableMapping):
    """Sum statistics (loss, correct predictions, ...) over all replicas and restarts.

    Example::

        stats = Accumulator()
        for x, y in loader:
            ...
            stats["loss_sum"] += loss.item() * len(y)
            stats["total"] += len(y)
        with stats.synchronized():  # collective: every replica enters it
            print(stats["loss_sum"] / stats["total"])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._sync_count: collections.Counter[int | None] = collections.Counter()
        self._synchronized: dict[str, Any] | None = None
        self._state = _AccumulatorState(*args, **kwargs)
        load_state(self._state)

    @contextlib.contextmanager
    def synchronized(self) -> Iterator[Accumulator]:
        """Enter synchronized mode (a collective the first time in a block)."""
        if self._synchronized is not None:
            yield self
            return
        epoch = current_epoch()
        state = self._state
        for key in [k for k in state.results_history if k is not None and epoch is not None
                    and k < epoch]:
            del state.results_history[key]  # finished epochs are never replayed
        count = self._sync_count[epoch]
        self._sync_count[epoch] += 1
        results_list = state.results_history[epoch]
        if count < len(results_list):  # replayed after a restart: the saved results
            self._synchronized = results_list[count]
            state.updates.clear()
        else:
            state.sync()
            if current_dataloader() is None:  # code inside loader loops is not replayed
                results_list.append(copy.deepcopy(state.results))
            self._synchronized = state.results
        try:
            yield self
            job.report_loss(self._synchronized)  # (after the block: the script's averages)
        finally:
            self._synchronized = None

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Add each value to its key (accumulation mode: a pending update)."""
        for key, val in dict(*args, **kwargs).items():
            self[key] += val

    def subtract(self, *args: Any, **kwargs: Any) -> None:
        """Subtract each value from its key."""
        for key, val in dict(*args, **kwargs).items():
            self[key] -= val

    def __iadd__(self, other: Any) -> Accumulator:
        self.update(other)
        return self

    def __isub__(self, other: Any) -> Accumulator:
        self.subtract(other)
        return self

    def __getitem__(self, key: str) -> Any:
        if self._synchronized is not None:
            return self._synchronized[key]
        return _Value(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if self._synchronized is not None:
            self._synchronized[key] = value
            return
        if not isinstance(value, _Value):
            raise TypeError(f"invalid value type: {type(value)}")
        if value.accum is not self:
            raise ValueError(f"incompatible {type(self).__name__}")
        if key != value.key:
            raise ValueError(f"incompatible key: {value.key}")
        updates = self._state.updates
        updates[key] = updates[key] + value.update if key in updates else value.update

    def __delitem__(self, key: str) -> None:
        if self._synchronized is not None:
            del self._synchronized[key]
            return
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return self._synchronized is not None and key in self._synchronized

    def __iter__(self) -> Iterator[str]:
        return iter(self._synchronized if self._synchronized is not None else {})

    def __len__(self) -> int:
        return len(self._synchronized) if self._synchronized is not None else 0

    def __repr__(self) -> str:
        return repr(self._synchronized if self._synchronized is not None else {})
