"""The process-wide Stratagem objects behind the AdaptDL names.

AdaptDL scripts never create an AutoDist; :func:`init_process_group` does (every replica
calls it at the same point, so its collectives line up), and loaders and models find it here.
"""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist

from stratagem import env as sg_env
from stratagem.adaptdl import collective, env
from stratagem.distributed import process_group
from stratagem.elastic.state import restore_point

_autodist: Any = None
_models: weakref.WeakSet[Any] = weakref.WeakSet()
_loss_steps = -1  # the trainer's steps when an Accumulator's loss was last recorded
_loaders: weakref.WeakSet[Any] = weakref.WeakSet()


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       world_size: int | None = None, rank: int | None = None) -> None:
    """Join the job's process group and set up Stratagem (idempotent).

    ``init_method`` (with ``world_size`` and ``rank``, defaults from ``adaptdl.env``) is
    passed to ``torch.distributed.init_process_group``. Without it the rendezvous is
    ``ADAPTDL_MASTER_ADDR``/``ADAPTDL_MASTER_PORT`` with ``ADAPTDL_REPLICA_RANK`` and
    ``ADAPTDL_NUM_REPLICAS`` (AdaptDL standalone), else torch elastic's ``MASTER_ADDR``,
    ``RANK``, ``WORLD_SIZE`` (``torchrun``, ``stratagem run``); a single replica needs
    neither. The chosen rank and world size are exported as ``RANK``/``WORLD_SIZE``, and
    :mod:`stratagem.adaptdl.collective` is initialized, as in AdaptDL.
    """
    global _autodist
    if _autodist is not None:
        return
    backend = group_backend(backend)
    if not dist.is_initialized() and not sg_env.rescale_store():
        # (in an in-process elastic job, AutoDist joins the job's group: adapt/rescale.py)
        if init_method is not None:
            process_group.init_process_group(
                backend, init_method=init_method,
                world_size=env.num_replicas() if world_size is None else int(world_size),
                rank=env.replica_rank() if rank is None else int(rank))
            atexit.register(collective.destroy_process_group)
        else:
            collective.join_process_group(backend, replica_rank=rank,
                                          num_replicas=world_size)
    world_rank, world = env.replica_rank(), env.num_replicas()
    if dist.is_initialized():
        world_rank, world = dist.get_rank(), dist.get_world_size()
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(world_rank), str(world)
    if "LOCAL_RANK" not in os.environ:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        os.environ["LOCAL_RANK"] = str(world_rank % gpus if gpus else 0)
    from stratagem.autodist import AutoDist

    # AdaptDL trains data-parallel with all-reduce (its gradient noise scale is read off
    # the all-reduce buffers); `stratagem run --strategy` still picks another
    _autodist = AutoDist(strategy_builder="AllReduce", verbose=sg_env.verbose())
    if dist.is_initialized() and not collective.is_initialized():
        collective.initialize()
    restore_point()  # collective on first use: choose it here, on every replica at once


def group_backend(requested: str | None) -> str:
    """The default group's backend for a script's ``init_process_group(requested)``: a plain
    ``"nccl"`` (what AdaptDL scripts ask for where CUDA is available) becomes
    ``cpu:gloo,cuda:nccl``, which runs every CUDA collective on NCCL as asked and lets
    Stratagem's own CPU tensors (the planner's calibration, link probe and trial timings
    under ``stratagem run --strategy Auto``) travel too; anything else as asked, nothing
    asked: :func:`stratagem.distributed.process_group.default_backend`."""
    if requested is None:
        return process_group.default_backend()
    if requested.strip().lower() == "nccl":
        return process_group.GPU_BACKEND
    return requested


def autodist() -> Any:
    """The job's AutoDist (joining the process group first if the script did not)."""
    if _autodist is None:
        init_process_group()
    return _autodist


def report_loss(values: dict[str, Any]) -> None:
    """An Accumulator's synchronized values: if one is a loss, record it with the current
    step (metrics file, progress line, ``stratagem report``'s loss panel), as
    ``ad.log_metrics(loss=...)`` would; AdaptDL scripts have no other way to say it. A key
    with "loss" in its name is taken as it is (``loss``, ``loss_avg``), a ``*loss*_sum``
    divided by the first of ``total``/``count``/``num``/``samples`` present."""
    global _loss_steps
    ad = _autodist
    trainer = getattr(ad, "adaptive", None)
    if trainer is None or trainer.steps == _loss_steps:
        return  # no training since the last one: a validation pass's loss is not recorded
    loss = None
    for key, value in values.items():
        if hasattr(value, "numel") and value.numel() == 1:
            value = value.item()
        if "loss" not in key.lower() or not isinstance(value, (int, float)):
            continue
        if key.lower().endswith("sum"):
            count = next((values[k] for k in ("total", "count", "num", "samples")
                          if isinstance(values.get(k), (int, float)) and values[k]), None)
            if count is None:
                continue
            value = value / count
        loss = float(value)
        break
    if loss is not None:
        _loss_steps = trainer.steps
        ad.log_metrics(loss=loss)


def register_model(model: Any) -> None:
    _models.add(model)


def models() -> list[Any]:
    """The job's live ``AdaptiveDataParallel`` models, oldest first."""
    return sorted(_models, key=id) if len(_models) > 1 else list(_models)


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
    collective.reset()
    _models.clear()
    _loaders.clear()
