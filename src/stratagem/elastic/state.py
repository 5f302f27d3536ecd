"""Job state for checkpoint-restart: a registry of objects saved and restored together.

Every part of a job's state (model, optimizer, data-loader position, epoch, user state) is a
:class:`State` registered under a unique name. :func:`save_all_states` writes all of them into
one atomic, checksummed checkpoint under ``$STRATAGEM_CHECKPOINT_DIR`` (fallback
``$ADAPTDL_CHECKPOINT_PATH``); :func:`load_state` restores one from the newest good
checkpoint, falling back to the previous one if the newest is corrupt. The registry lives
in the process's job context (:mod:`stratagem.elastic.context`). The files are plain
tensors (``torch.save``, read back with ``weights_only=True``) or JSON: no pickled objects.

A checkpoint directory is also an ordinary :mod:`stratagem.checkpoint` checkpoint:
``checkpoint.load(path, model)`` reads its ``model.pt`` in a single process.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Literal

import torch

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem.distributed.process_group import rank_world
from stratagem.elastic import background_save
from stratagem.elastic.context import NOT_CHOSEN, current_job, drop_job
from stratagem.errors import CheckpointError

ENV_CHECKPOINT_DIR = env.CHECKPOINT_DIR
ENV_ADAPTDL_CHECKPOINT = env.ADAPTDL_CHECKPOINT_PATH
KEEP = 2  # the newest checkpoint and the one before it


def checkpoint_root() -> Path | None:
    """The job's checkpoint directory from the environment, or None (no checkpointing)."""
    return env.checkpoint_dir()


class State:
    """A named part of the job state. Subclass and implement ``state_dict`` and
    ``load_state_dict`` (tensors, numbers, strings, lists and dicts of them), or override
    ``save``/``load`` to write the file yourself (AdaptDL style).

    ``per_rank = True``: every rank saves its own copy, restored only at the same world size.
    ``format = "json"``: stored as JSON instead of a ``torch.save`` file.
    A state whose :meth:`sharded` says so at save time (a sharded model's, its optimizer's)
    is written by every rank as its :meth:`pieces`; restoring joins the pieces of every
    rank (any world size) into the whole state and hands that to ``load_state_dict``.
    """

    per_rank: ClassVar[bool] = False
    format: ClassVar[Literal["pt", "json"]] = "pt"

    def __init__(self, name: str) -> None:
        self.name = name
        register(self)

    def state_dict(self) -> Any:
        raise NotImplementedError

    def load_state_dict(self, state: Any) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        """Called on every rank before saving (collective hook; default: nothing)."""

    def sharded(self) -> bool:
        """Whether this save writes every rank's :meth:`pieces` (default: no)."""
        return False

    def pieces(self) -> Any:
        """This rank's piece file (see :func:`stratagem.checkpoint.assemble_pieces`)."""
        raise NotImplementedError

    def save(self, f: BinaryIO) -> None:
        if self.format == "json":
            f.write(json.dumps(self.state_dict(), indent=1).encode())
        else:
            torch.save(self.state_dict(), f)

    def load(self, f: BinaryIO) -> None:
        if self.format == "json":
            self.load_state_dict(json.loads(f.read().decode()))
        else:
            self.load_state_dict(torch.load(f, map_location="cpu", weights_only=True))

    def filename(self, rank: int) -> str:
        return state_filename(self.name, self.format, self.per_rank, rank)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class ObjectState(State):
    """A State backed by two callables, e.g. an object's ``state_dict``/``load_state_dict``."""

    def __init__(self, name: str, get: Callable[[], Any], put: Callable[[Any], None], *,
                 per_rank: bool = False, format: Literal["pt", "json"] = "pt",
                 sharded: Callable[[], bool] | None = None,
                 pieces: Callable[[], Any] | None = None) -> None:
        self._get, self._put = get, put
        self._sharded, self._pieces = sharded, pieces
        self.per_rank = per_rank  # type: ignore[misc]
        self.format = format  # type: ignore[misc]
        super().__init__(name)

    def state_dict(self) -> Any:
        return self._get()

    def load_state_dict(self, state: Any) -> None:
        self._put(state)

    def sharded(self) -> bool:
        return self._sharded is not None and self._pieces is not None and self._sharded()

    def pieces(self) -> Any:
        assert self._pieces is not None
        return self._pieces()


def state_filename(name: str, fmt: str, per_rank: bool, rank: int,
                   sharded: bool = False) -> str:
    """The file a state is saved in, within a checkpoint directory."""
    if sharded:
        return f"{name}-shard{rank}.pt"
    ext = "json" if fmt == "json" else "pt"
    return f"{name}-rank{rank}.{ext}" if per_rank else f"{name}.{ext}"


# -- registry -----------------------------------------------------------------------------
def register(state: State) -> None:
    """Add ``state`` to the job state (a later registration under the same name replaces
    an earlier one)."""
    if not state.name or "/" in state.name or state.name in ("meta",):
        raise ValueError(f"invalid state name {state.name!r}")
    current_job().states[state.name] = state


def registered_states() -> dict[str, State]:
    """The job's states by name, in registration order."""
    return dict(current_job().states)


def unique_name(prefix: str) -> str:
    """``prefix``, or ``prefix-1``, ``prefix-2``... if taken (stable across restarts as long
    as the script creates its objects in the same order)."""
    name, n = prefix, 0
    states = current_job().states
    while name in states:
        n += 1
        name = f"{prefix}-{n}"
    return name


def register_state(name: str, obj: Any, *, per_rank: bool = False,
                   format: Literal["pt", "json"] = "pt") -> bool:
    """Track ``obj`` (with ``state_dict``/``load_state_dict``, e.g. an LR scheduler) under
    ``name`` and restore it from the checkpoint now; returns whether it was restored."""
    state = ObjectState(name, obj.state_dict, obj.load_state_dict, per_rank=per_rank,
                        format=format)
    return load_state(state)


def track_model(model: Any, optimizer: Any = None) -> bool:
    """Register (and restore) ``model``, its per-rank synchronizer state and ``optimizer``
    as the states ``model``, ``sync`` and ``optimizer`` (``model-1``, ``sync-1``... for a
    second model); returns whether the model was restored."""
    name = unique_name("model")
    suffix = name[len("model"):]
    is_sharded = (lambda: bool(getattr(model, "is_sharded", False)))
    # a sharded model (ZeRO on several workers) saves every rank's pieces and loads the
    # whole state into its shards, whatever the world size that saved it
    model_state = ObjectState(name, model.state_dict,
                              getattr(model, "load_full_state_dict", model.load_state_dict),
                              sharded=is_sharded,
                              pieces=getattr(model, "sharded_model_state", None))
    prepare = getattr(model, "before_checkpoint", None)
    if prepare is not None:  # before saving (e.g. fetch stale parameter-server rows)
        model_state.sync = prepare  # type: ignore[method-assign]
    restored = load_state(model_state)
    sync_get = getattr(model, "synchronizer_state_dict", None)
    if sync_get is not None:
        load_state(ObjectState(f"sync{suffix}", sync_get, model.load_synchronizer_state_dict,
                               per_rank=True))
    if optimizer is not None:
        load_opt = getattr(model, "load_full_optimizer_state_dict", None)
        opt_pieces = getattr(model, "sharded_optimizer_state", None)
        load_state(ObjectState(
            f"optimizer{suffix}", optimizer.state_dict,
            (lambda s: load_opt(optimizer, s)) if load_opt else optimizer.load_state_dict,
            sharded=is_sharded,
            pieces=(lambda: opt_pieces(optimizer)) if opt_pieces else None))
    finish = getattr(model, "after_restore", None)
    if finish is not None and restore_point() is not None:
        finish()  # collective (e.g. hand parameter-server shards to their owners)
    return restored


def track_loader(loader: Any) -> bool:
    """Register (and restore) a data loader's position as ``loader``, ``loader-1``, ..."""
    state = ObjectState(unique_name("loader"), loader.state_dict, loader.load_state_dict,
                        format="json")
    return load_state(state)


def reset_states() -> None:
    """Forget every registered state, the chosen restore point and a pending exit request
    (for in-process restarts): drops the job context, the next call starts a fresh one."""
    drop_job()


# -- handing states over to a newcomer (in-process rescale) ---------------------------------
def _custom_file(state: State) -> bool:
    """Whether the state writes its own file (AdaptDL style ``save``/``load``)."""
    return type(state).save is not State.save


def export_state(state: State) -> dict[str, Any]:
    """``state`` as tensors, numbers and strings (sendable with ``wire.broadcast_state``)."""
    if _custom_file(state):
        data = bytearray(_saved_bytes(state))
        return {"bytes": torch.frombuffer(data, dtype=torch.uint8) if data else
                torch.zeros(0, dtype=torch.uint8)}
    return {"value": state.state_dict()}


def import_state(state: State, payload: dict[str, Any]) -> None:
    """Load what :func:`export_state` produced on another member."""
    if "bytes" in payload:
        state.load(io.BytesIO(payload["bytes"].numpy().tobytes()))
    else:
        state.load_state_dict(payload["value"])


# -- save and restore -----------------------------------------------------------------------
def _saved_bytes(state: State) -> bytes:
    """What ``state.save`` writes, in memory."""
    buf = io.BytesIO()
    state.save(buf)
    return buf.getvalue()


def _write_state(state: State, path: Path) -> None:
    ckpt.write_durably(path, _saved_bytes(state))


def _snapshot(state: State, sharded: bool = False) -> Any:
    """What ``state`` writes, copied now: bytes (JSON and custom-file states, serialized
    here) or its state dict (``sharded``: its pieces) with every tensor copied to CPU
    memory."""
    if sharded:
        return background_save.cpu_copy(state.pieces())
    if state.format == "json" or _custom_file(state):
        return _saved_bytes(state)
    return background_save.cpu_copy(state.state_dict())


def save_all_states(root: str | os.PathLike[str] | None = None, *,
                    only: Collection[str] | None = None, sync: bool = True,
                    background: bool = False) -> Path | None:
    """Collectively save every registered state as the next checkpoint; all ranks call it.

    Returns the checkpoint directory, or None (with a warning) when no checkpoint directory
    is configured. Rank 0 writes the shared states, every rank its ``per_rank`` ones.
    ``only``: save just these state names; every other state keeps what the latest
    checkpoint holds (AdaptDL's ``save_state``). ``sync=False`` skips the ``sync`` hooks.
    ``background`` (full saves only): return once the states are copied to CPU memory and
    write them on a background thread (:mod:`stratagem.elastic.background_save`); the
    returned directory exists once ``background_save.wait_for_checkpoint()`` returns. Any save first
    waits for the one in flight.
    """
    root_path = Path(root) if root is not None else checkpoint_root()
    if root_path is None:
        warnings.warn(f"no checkpoint saved: set {ENV_CHECKPOINT_DIR}", stacklevel=2)
        return None
    background_save.finish_previous()  # at most one in flight, and in order
    started = time.monotonic()  # meta.json's save_seconds (sizes a stop's grace)
    rank, world = rank_world()
    ctx = current_job()
    states = [s for s in ctx.states.values() if only is None or s.name in only]
    if sync:
        for state in states:
            state.sync()
    shards = {s.name for s in states if s.sharded()}
    layout = {s.name: {"format": s.format, "per_rank": s.per_rank,
                       **({"shards": world} if s.name in shards else {})} for s in states}
    meta: dict[str, Any] = {"states": layout, "metadata": {}, "strategy_id": None,
                            "save_started": started}
    if background and only is None and background_save.can_write_in_background():
        files = {_filename(s, rank, s.name in shards): _snapshot(s, s.name in shards)
                 for s in states if s.per_rank or s.name in shards or rank == 0}
        path = background_save.start(ckpt.CheckpointDir(root_path, keep=KEEP), files, meta)
        ctx.steps_since_save, ctx.last_save = 0, None
        return path
    kept: list[Path] = []  # files of the states not saved now, from the latest checkpoint
    previous = ckpt.CheckpointDir(root_path).latest_good() if only is not None else None
    if previous is not None:
        meta = {**ckpt.read_meta(previous), "save_started": started}
        meta.pop("save_seconds", None)
        for name, entry in meta.get("states", {}).items():
            if name in layout or (entry["per_rank"] and meta["world_size"] != world):
                continue
            layout[name] = entry
            count = entry.get("shards")
            files = ({state_filename(name, "pt", False, r, sharded=True)
                      for r in range(count)} if isinstance(count, int) else
                     {state_filename(name, entry["format"], entry["per_rank"], r)
                      for r in range(world)})
            kept += [previous / f for f in sorted(files) if f in meta["sha256"]]

    def write(tmp: Path) -> None:
        for state in states:
            if state.name in shards:
                ckpt.write_durably(tmp / _filename(state, rank, True),
                                   _torch_bytes(state.pieces()))
            elif state.per_rank or rank == 0:
                _write_state(state, tmp / state.filename(rank))
        if rank == 0:
            for path in kept:
                shutil.copyfile(path, tmp / path.name)

    path = ckpt.CheckpointDir(root_path, keep=KEEP).save(write, meta)
    if only is None:  # a full save: the periodic-checkpoint counters start over
        ctx.steps_since_save, ctx.last_save = 0, None  # the clock restarts at the next step
    return path


def _filename(state: State, rank: int, sharded: bool) -> str:
    return (state_filename(state.name, "pt", False, rank, sharded=True) if sharded
            else state.filename(rank))


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load_sharded(state: State, path: Path, count: int) -> None:
    """Join the pieces every rank of the saving job wrote into the whole state (a model
    state dict, or an optimizer's when the pieces carry param groups) and load it."""
    parts = ckpt.read_pieces(path, state.name, count)
    tensors, values, skeleton = ckpt.assemble_pieces(parts, str(path))
    whole: Any = tensors if skeleton is None else ckpt.optimizer_state_from_pieces(
        tensors, values, skeleton, str(path))
    try:
        state.load_state_dict(whole)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot restore state {state.name!r} from its shards: {exc}",
                              where=str(path),
                              fix="build the same objects as the job that saved it") from None


def restore_point() -> Path | None:
    """The checkpoint states are restored from: the newest good one, chosen once per process
    (collective on first use)."""
    ctx = current_job()
    if ctx.restore_point is NOT_CHOSEN:
        background_save.finish_previous()  # a checkpoint being written counts
        root = checkpoint_root()
        ctx.restore_point = ckpt.CheckpointDir(root).latest_good() if root else None
    return ctx.restore_point


def _is_empty(path: Path) -> bool:
    """Whether a saved state file holds an empty container (nothing lost by skipping it)."""
    try:
        if path.suffix == ".json":
            return not json.loads(path.read_text())
        obj = torch.load(path, map_location="cpu", weights_only=True)
        return isinstance(obj, (dict, list, tuple)) and not obj
    except Exception:  # noqa: BLE001 - unreadable: not known to be empty
        return False


def load_state(state: State) -> bool:
    """Register ``state`` and restore it from the restore point; returns whether it was
    restored (False: no checkpoint, or the checkpoint has no such state). Every rank must
    call it (the first call chooses the checkpoint collectively)."""
    register(state)
    payload = current_job().pending.pop(state.name, None)
    if payload is not None:  # a worker that joined in-process: rank 0's copy
        import_state(state, payload)
        return True
    path = restore_point()
    if path is None:
        return False
    meta = ckpt.read_meta(path)
    entry = meta.get("states", {}).get(state.name)
    if entry is None:
        return False
    if not (isinstance(entry, dict) and isinstance(entry.get("per_rank"), bool)
            and entry.get("format") in ("pt", "json")):
        raise CheckpointError(f"meta.json is corrupt: bad entry for state {state.name!r}",
                              where=str(path), fix="use an earlier checkpoint")
    count = entry.get("shards")
    if count is not None:
        if not (isinstance(count, int) and not isinstance(count, bool) and 0 < count <= 1 << 20):
            raise CheckpointError(f"meta.json is corrupt: bad shard count for state "
                                  f"{state.name!r}", where=str(path),
                                  fix="use an earlier checkpoint")
        _load_sharded(state, path, count)
        return True
    rank, world = rank_world()
    if entry["per_rank"] and meta["world_size"] != world:
        if not _is_empty(path / state_filename(state.name, entry["format"], True, 0)):
            warnings.warn(f"state {state.name!r} was saved per rank by {meta['world_size']} "
                          f"replicas, now {world}: it starts fresh", stacklevel=3)
        return False
    name = state_filename(state.name, entry["format"], entry["per_rank"], rank)
    if entry["format"] != state.format:
        raise CheckpointError(f"state {state.name!r} was saved as {entry['format']}, "
                              f"loads as {state.format}", where=str(path),
                              fix="keep the State's format between runs")
    verified = ckpt.read_verified(path, name)  # checksum-checked: never a damaged file
    try:
        with verified as f:
            state.load(f)
    except (OSError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"cannot restore state {state.name!r} from {name}: {exc}",
                              where=str(path),
                              fix="build the same objects as the job that saved it") from None
    return True
