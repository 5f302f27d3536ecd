"""Accumulator: metrics summed over replicas and kept across restarts (AdaptDL semantics).

.. code-block:: python

    stats = sg.adapt.Accumulator()
    for x, y in loader:
        ...
        stats["loss_sum"] += loss.item() * len(y)
        stats["total"] += len(y)
    with stats.synchronized():          # collective: every replica enters here
        print(stats["loss_sum"] / stats["total"])
        stats.clear()

Outside ``synchronized()`` (accumulation mode) updates are only recorded locally (``+=``,
``-=``, :meth:`~Accumulator.update`) and reads behave like an empty dict. Entering
``synchronized()`` sums every replica's pending updates into the shared values, which can
then be read and written like a dict (every replica must make the same writes).

The values are job state (JSON): a restart keeps them. A synchronization made outside a
loader iteration is remembered per epoch, so when a restart replays an epoch's code after
its loop, the same ``synchronized()`` gets the same values back instead of summing again.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed as dist

from stratagem.distributed.process_group import all_gather_bytes
from stratagem.elastic import State, current_epoch, current_job, load_state, unique_name

Number = int | float


def _plain(value: Any) -> Any:
    """A JSON-friendly number: tensors and numpy scalars become Python numbers."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        return value.item()
    return value


def _add_into(a: dict[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in b.items():
        a[key] = a[key] + value if key in a else value
    return a


def _allreduce_dict(updates: dict[str, Any]) -> dict[str, Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(updates)
    out: dict[str, Any] = {}  # JSON bytes, never pickles; rank order: the same sum everywhere
    group = current_job().control_group()
    for data in all_gather_bytes(json.dumps(updates).encode(), group=group):
        _add_into(out, json.loads(data.decode()))
    return out


def _in_loader() -> bool:
    return current_job().loader_iterations > 0


class _AccumulatorState(State):
    format = "json"

    def __init__(self, name: str, results: dict[str, Any]) -> None:
        self.results = results
        self.updates: dict[str, Any] = {}
        self.history: dict[str, list[dict[str, Any]]] = {}  # epoch -> results per sync
        super().__init__(name)

    def state_dict(self) -> dict[str, Any]:
        return {"results": self.results, "history": self.history}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.results = dict(state["results"])
        self.history = {k: list(v) for k, v in state.get("history", {}).items()}

    def sync(self) -> None:
        """Collective (also before a checkpoint): sum everyone's pending updates in."""
        _add_into(self.results, _allreduce_dict(self.updates))
        self.updates.clear()


class Accumulator(MutableMapping):
    """A dict of sums over replicas and restarts; see the module docstring.

    Create accumulators in the same order on every replica and in every run (the order
    names their saved state), outside of loader loops.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._synced: dict[str, Any] | None = None
        self._sync_count: Counter[str] = Counter()
        epoch = current_epoch()
        prefix = "accumulator" if epoch is None else f"accumulator-epoch{epoch}"
        self._state = _AccumulatorState(unique_name(prefix), dict(*args, **kwargs))
        load_state(self._state)

    @contextlib.contextmanager
    def synchronized(self) -> Iterator[Accumulator]:
        """Collective: sum all replicas' updates, then act as a plain dict inside."""
        if self._synced is not None:
            yield self
            return
        epoch = current_epoch()
        key = str(epoch)
        for old in [k for k in self._state.history if k not in (key, "None")]:
            if epoch is not None and old.isdigit() and int(old) < epoch:
                del self._state.history[old]
        history = self._state.history.setdefault(key, [])
        count = self._sync_count[key]
        self._sync_count[key] += 1
        if count < len(history):  # replayed after a restart: same values as before
            self._synced = history[count]
            self._state.updates.clear()
        else:
            self._state.sync()
            if not _in_loader():
                history.append(dict(self._state.results))
            self._synced = self._state.results
        try:
            yield self
        finally:
            self._synced = None

    # -- accumulation --------------------------------------------------------------------
    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Add each value to its key (not dict.update's replacement)."""
        for key, value in dict(*args, **kwargs).items():
            self[key] += value

    def subtract(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] -= value

    def __iadd__(self, other: Mapping[str, Any]) -> Accumulator:
        self.update(other)
        return self

    def __isub__(self, other: Mapping[str, Any]) -> Accumulator:
        self.subtract(other)
        return self

    # -- mapping ---------------------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        if self._synced is not None:
            return self._synced[key]
        return _Update(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if self._synced is not None:
            self._synced[key] = _plain(value)
            return
        if not isinstance(value, _Update) or value.owner is not self or value.key != key:
            raise TypeError("outside synchronized(), an Accumulator only takes updates: "
                            f"use stats[{key!r}] += value")
        updates = self._state.updates
        updates[key] = updates.get(key, 0) + value.delta

    def __delitem__(self, key: str) -> None:
        if self._synced is None:
            raise KeyError(key)
        del self._synced[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._synced if self._synced is not None else {})

    def __len__(self) -> int:
        return len(self._synced) if self._synced is not None else 0

    def __contains__(self, key: object) -> bool:
        return self._synced is not None and key in self._synced

    def __repr__(self) -> str:
        return f"Accumulator({self._synced if self._synced is not None else {}!r})"


class _Update:
    """What ``stats[key]`` returns outside ``synchronized()``: it records ``+= v``."""

    __slots__ = ("owner", "key", "delta")

    def __init__(self, owner: Accumulator, key: str) -> None:
        self.owner, self.key, self.delta = owner, key, 0

    def __add__(self, value: Any) -> _Update:
        if isinstance(value, _Update):
            raise TypeError("cannot add an Accumulator entry to another")
        self.delta = self.delta + _plain(value)
        return self

    def __sub__(self, value: Any) -> _Update:
        if isinstance(value, _Update):
            raise TypeError("cannot subtract an Accumulator entry from another")
        self.delta = self.delta - _plain(value)
        return self
