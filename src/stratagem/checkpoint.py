"""Checkpoints a single process can load: one directory, plain state dicts, checksums.

Layout of ``path/``: ``model.pt`` and ``optimizer.pt`` (rank 0's replicated state),
``sync-rank{r}.pt`` (per-rank synchronizer state such as PowerSGD error feedback),
``meta.json`` (world size, strategy id, user metadata, SHA-256 of every file). The directory
is written under a temporary name and renamed, so a crash never leaves a half-written
checkpoint under the real name. Everything loads with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.errors import CheckpointError

META = "meta.json"


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _save_file(obj: Any, path: Path) -> None:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def save(path: str | os.PathLike[str], model: nn.Module, optimizer: Any = None, *,
         strategy_id: str | None = None, metadata: dict[str, Any] | None = None) -> Path:
    """Collectively save ``model`` (plain or distributed) and ``optimizer`` to ``path``.

    Every rank must call it. ``metadata`` must be JSON-serializable.
    """
    rank, world = _rank_world()
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    sync_state = getattr(model, "synchronizer_state_dict", None)
    if sync_state is not None:
        _save_file(sync_state(), tmp / f"sync-rank{rank}.pt")
    if rank == 0:
        _save_file(_inner(model).state_dict(), tmp / "model.pt")
        if optimizer is not None:
            _save_file(optimizer.state_dict(), tmp / "optimizer.pt")
    _barrier()
    if rank == 0:
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
        meta = {"format": 1, "world_size": world, "strategy_id": strategy_id,
                "metadata": metadata or {}, "sha256": files}
        with (tmp / META).open("w") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    if not (p / META).is_file():
        raise CheckpointError("not a checkpoint (no meta.json)", where=str(p),
                              fix="pass a directory written by stratagem checkpoint save")
    try:
        return json.loads((p / META).read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"meta.json is corrupt: {exc}", where=str(p),
                              fix="restore the checkpoint from a backup") from None


def load_file(path: str | os.PathLike[str], name: str, map_location: Any = "cpu",
              verify: bool = True) -> Any:
    """Load one file of a checkpoint with ``weights_only=True``, checking its checksum."""
    p = Path(path)
    meta = read_meta(p)
    f = p / name
    if not f.is_file():
        raise CheckpointError(f"missing {name}", where=str(p),
                              fix="the checkpoint is incomplete; use an earlier one")
    if verify and meta["sha256"].get(name) != _sha256(f):
        raise CheckpointError(f"checksum mismatch in {name}", where=str(p),
                              fix="the file is corrupt; use an earlier checkpoint")
    return torch.load(f, map_location=map_location, weights_only=True)


def load(path: str | os.PathLike[str], model: nn.Module | None = None, optimizer: Any = None,
         *, map_location: Any = "cpu") -> dict[str, Any]:
    """Restore ``model``/``optimizer`` from ``path``; returns the metadata.

    Works in a single process and in any world size. Per-rank synchronizer state is
    restored only when the world size matches; otherwise it restarts fresh (warned).
    """
    p = Path(path)
    meta = read_meta(p)
    if model is not None:
        try:
            _inner(model).load_state_dict(load_file(p, "model.pt", map_location))
        except RuntimeError as exc:
            raise CheckpointError(f"model does not match: {exc}", where=str(p),
                                  fix="build the same model architecture before loading"
                                  ) from None
        restore = getattr(model, "load_synchronizer_state_dict", None)
        rank, world = _rank_world()
        name = f"sync-rank{rank}.pt"
        if restore is not None and (p / name).is_file():
            if meta["world_size"] == world:
                restore(load_file(p, name, map_location))
            else:
                warnings.warn(f"checkpoint was written by {meta['world_size']} replicas, now "
                              f"{world}: synchronizer state (e.g. PowerSGD) restarts fresh",
                              stacklevel=2)
    if optimizer is not None and (p / "optimizer.pt").is_file():
        optimizer.load_state_dict(load_file(p, "optimizer.pt", map_location))
    return meta.get("metadata", {})
