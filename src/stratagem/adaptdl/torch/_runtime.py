"""The process-wide Stratagem objects behind the AdaptDL names.

AdaptDL scripts never create an AutoDist; :func:`init_process_group` does (every replica
calls it at the same point, so its collectives line up), and loaders and models find it here.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
import torch.distributed as dist

from stratagem import env as sg_env
from stratagem import process_group
from stratagem.adaptdl import env
from stratagem.elastic import state as _state

_autodist: Any = None
_models: weakref.WeakSet[Any] = weakref.WeakSet()
_loaders: weakref.WeakSet[Any] = weakref.WeakSet()


def init_process_group(backend: str | None = None) -> None:
    """Join the job's process group and set up Stratagem (idempotent).

    Rendezvous: ``ADAPTDL_MASTER_ADDR``/``ADAPTDL_MASTER_PORT`` with ``ADAPTDL_REPLICA_RANK``
    and ``ADAPTDL_NUM_REPLICAS`` (AdaptDL standalone), else torch elastic's ``MASTER_ADDR``,
    ``RANK``, ``WORLD_SIZE`` (``torchrun``, ``stratagem run``); a single replica needs
    neither. The chosen rank and world size are exported as ``RANK``/``WORLD_SIZE``.
    """
    global _autodist
    if _autodist is not None:
        return
    rank, world = env.replica_rank(), env.num_replicas()
    if not dist.is_initialized() and not sg_env.rescale_store():
        # (in an in-process elastic job, AutoDist joins the job's group: adapt/rescale.py)
        _join(backend or ("nccl" if torch.cuda.is_available() else "gloo"), rank, world)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    if "LOCAL_RANK" not in os.environ:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        os.environ["LOCAL_RANK"] = str(rank % gpus if gpus else 0)
    from stratagem.autodist import AutoDist

    _autodist = AutoDist(verbose=sg_env.verbose())
    _state.restore_point()  # collective on first use: choose it here, on every replica at once


def _join(backend: str, rank: int, world: int) -> None:
    """Through Stratagem's one process-group set-up (timeout: STRATAGEM_PG_TIMEOUT_S)."""
    if sg_env.adaptdl_rendezvous():
        method = f"tcp://{env.master_addr()}:{env.master_port()}"
        process_group.init_process_group(backend, init_method=method, rank=rank, world_size=world)
    elif world == 1 and not os.environ.get("MASTER_ADDR"):
        process_group.init_single_process_group(backend)
    else:
        process_group.init_process_group(backend, rank=rank, world_size=world)


def autodist() -> Any:
    """The job's AutoDist (joining the process group first if the script did not)."""
    if _autodist is None:
        init_process_group()
    return _autodist


def register_model(model: Any) -> None:
    _models.add(model)


def register_loader(loader: Any) -> None:
    _loaders.add(loader)
    loader.attach_autodist(autodist())


def attach_loaders() -> None:
    """After the model is distributed: hand every loader to its adaptive loop."""
    for loader in list(_loaders):
        loader.attach_autodist(autodist())


def set_grad_weight(weight: float) -> None:
    """Loader hook: this rank's share of the global batch, for every adaptive model."""
    for model in list(_models):
        model.set_grad_weight(weight)


def reset() -> None:
    """Forget the job's objects (tests)."""
    global _autodist
    _autodist = None
    _models.clear()
    _loaders.clear()
