"""AdaptDL's ``adaptdl.collective``: reduce and broadcast small Python values over replicas.

Every replica calls the functions in the same order. The values travel over the job's
torch.distributed process group (a separate gloo group, so background reductions never mix
with the training's collectives) as tagged JSON, never pickled: numbers, strings, booleans,
None, lists, tuples, sets, dicts (any of these as keys), tensors and numpy arrays. Anything
else is refused with a TypeError before it is sent.
"""

from __future__ import annotations

import atexit
import functools
import json
import operator
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stratagem import env as sg_env
from stratagem.adaptdl import env
from stratagem.distributed import process_group

__all__ = ["allreduce", "allreduce_async", "broadcast", "initialize", "is_initialized"]

_lock = threading.Lock()
_group: Any = None  # the gloo group of this module, once initialized
_world: Any = None  # the default group it was made from
_executor: ThreadPoolExecutor | None = None


# -- wire format: tagged JSON -------------------------------------------------------------
def encode(value: Any) -> Any:
    """A JSON-ready form of ``value`` that :func:`decode` turns back into an equal value."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, np.generic):
        return value
    if isinstance(value, np.generic):
        return encode(value.item())
    if isinstance(value, torch.Tensor):
        return {"t": "tensor", "v": value.detach().cpu().tolist(),
                "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, np.ndarray):
        return {"t": "ndarray", "v": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {"t": "tuple", "v": [encode(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        kind = "set" if isinstance(value, set) else "frozenset"
        return {"t": kind, "v": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"t": "dict", "v": [[encode(k), encode(v)] for k, v in value.items()]}
    raise TypeError(f"adaptdl.collective cannot send a {type(value).__name__}: use numbers, "
                    "strings, lists, tuples, sets, dicts, tensors or numpy arrays")


def decode(data: Any) -> Any:
    """The value :func:`encode` encoded (only the types listed in the module docstring)."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    kind, items = data["t"], data["v"]
    if kind == "tensor":
        return torch.tensor(items, dtype=getattr(torch, data["dtype"]))
    if kind == "ndarray":
        return np.asarray(items, dtype=np.dtype(data["dtype"]))
    if kind == "tuple":
        return tuple(decode(v) for v in items)
    if kind == "set":
        return {decode(v) for v in items}
    if kind == "frozenset":
        return frozenset(decode(v) for v in items)
    if kind == "dict":
        return {decode(k): decode(v) for k, v in items}
    raise ValueError(f"unknown value kind {kind!r} from a replica")


def _to_bytes(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(encode(value)).encode()), dtype=torch.uint8)


def _from_bytes(buf: torch.Tensor) -> Any:
    return decode(json.loads(buf.numpy().tobytes().decode()))


# -- process group --------------------------------------------------------------------------
def join_process_group(backend: str, master_addr: str | None = None,
                       master_port: int | None = None, replica_rank: int | None = None,
                       num_replicas: int | None = None) -> None:
    """Create the default process group (no-op when one exists) through Stratagem's one
    set-up (:mod:`stratagem.distributed.process_group`, timeout
    ``STRATAGEM_PG_TIMEOUT_S``). AdaptDL's
    rendezvous (``tcp://master_addr:master_port``, given or from ``ADAPTDL_MASTER_ADDR``/
    ``_PORT``) when set; else one replica alone, or torch elastic's ``env://``
    (``torchrun``, ``stratagem run``). Rank and world size default to
    :mod:`stratagem.adaptdl.env`."""
    if dist.is_initialized():
        return
    rank = env.replica_rank() if replica_rank is None else int(replica_rank)
    world = env.num_replicas() if num_replicas is None else int(num_replicas)
    if master_port is not None or sg_env.adaptdl_rendezvous():
        addr = master_addr or env.master_addr()
        port = env.master_port() if master_port is None else int(master_port)
        process_group.init_process_group(backend, init_method=f"tcp://{addr}:{port}",
                                         rank=rank, world_size=world)
    elif world == 1 and not os.environ.get("MASTER_ADDR"):
        process_group.init_single_process_group(backend)
    else:
        process_group.init_process_group(backend, rank=rank, world_size=world)
    atexit.register(destroy_process_group)  # after the set-up's own hook: runs before it


def destroy_process_group() -> None:
    """Stop this module and destroy the process group (at exit: before interpreter teardown,
    which gloo's threads do not survive)."""
    reset()
    process_group.release_holders()  # the runtime's handles too, or the group outlives this
    if dist.is_initialized():
        dist.destroy_process_group()


def initialize(master_addr: str | None = None, master_port: int | None = None,
               replica_rank: int | None = None, num_replicas: int | None = None) -> None:
    """Set up this module (collective: every replica calls it). Joins the job's process
    group first if the script has not (AdaptDL's rendezvous variables, see
    :func:`join_process_group`). Raises RuntimeError if already initialized."""
    global _executor
    if _group is not None:
        raise RuntimeError(f"{__name__} is already initialized")
    join_process_group("gloo", master_addr, master_port, replica_rank, num_replicas)
    _make_group()
    _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adaptdl-collective")


def _make_group() -> None:
    """This module's group over the current default group (collective)."""
    global _group, _world
    _world = dist.group.WORLD
    _group = dist.new_group(backend="gloo") if dist.get_world_size() > 1 else _world


def is_initialized() -> bool:
    """Whether :func:`initialize` ran (``init_process_group`` calls it)."""
    return _group is not None


def reset() -> None:
    """Forget the module's group (tests, and after the process group was destroyed)."""
    global _group, _world, _executor
    if _executor is not None:
        _executor.shutdown(wait=True)
    _group, _world, _executor = None, None, None


def _require() -> tuple[Any, ThreadPoolExecutor]:
    if _group is None or _executor is None:
        raise RuntimeError(f"{__name__} has not been initialized: call "
                           "adaptdl.torch.init_process_group(...) or "
                           "adaptdl.collective.initialize() on every replica first")
    if dist.is_initialized() and dist.group.WORLD is not _world:
        _make_group()  # the job regrouped in-process; every replica gets here in step
    return _group, _executor


def _gather(value: Any, group: Any) -> list[Any]:
    """Every replica's ``value``, in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return [decode(encode(value))]
    buf = _to_bytes(value)
    size = torch.tensor([buf.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[:buf.numel()] = buf
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded, group=group)
    return [_from_bytes(b[:n]) for b, n in zip(bufs, lengths, strict=True)]


def _allreduce(value: Any, reduce_fn: Callable[[Any, Any], Any], group: Any) -> Any:
    return functools.reduce(reduce_fn, _gather(value, group))


def allreduce_async(value: Any, reduce_fn: Callable[[Any, Any], Any] = operator.add
                    ) -> Future:
    """Start reducing ``value`` over all replicas with ``reduce_fn`` (pairwise, in rank
    order, the same result everywhere); returns a Future. Reductions run in call order."""
    group, executor = _require()
    with _lock:
        return executor.submit(_allreduce, value, reduce_fn, group)


def allreduce(value: Any, reduce_fn: Callable[[Any, Any], Any] = operator.add) -> Any:
    """``value`` reduced over all replicas with ``reduce_fn`` (default: addition)."""
    return allreduce_async(value, reduce_fn).result()


def broadcast(value: Any) -> Any:
    """Replica 0's ``value`` on every replica (the others' are ignored)."""
    group, executor = _require()

    def run() -> Any:
        return _gather(value if dist.get_rank() == 0 else None, group)[0]

    with _lock:
        return executor.submit(run).result()
